// The log: ExecuTorch's messages and the library's own failures reach the callback an app set with mm_log_set, or
// nowhere (never stderr: the library lives in an app's process). ExecuTorch's last error on this thread is quoted in
// our messages.
#pragma once

#include <executorch/runtime/core/error.h>

#include <string>

#include "mobile_moe.h"

namespace mobile_moe::library {

// mm_log_set: the app's callback, process-wide by the app's choice.
void set_library_log(mm_log_callback callback, void* user_data);

// The callback runs outside the sink's lock (one that sets another callback, or logs, does not wait on itself); lines
// from several threads may reach it at once (mobile_moe.h: it must be thread-safe).
void library_log(mm_log_level level, const std::string& message);

// ExecuTorch's log into capture_log, then the runtime initialised, once per process, before the library's first call
// into ExecuTorch: its default platform layer writes to stderr (runtime/platform/default/posix.cpp), and runtime_init
// is not safe to call from two threads at once.
void start_runtime();

// "(ExecuTorch error 35 InvalidProgram: Verification failed; ...)": the status, and what the runtime logged about it.
std::string runtime_error_text(executorch::runtime::Error status);

}  // namespace mobile_moe::library
