// ExecuTorch's log: kept off stderr (the runner's stderr is one line on failure), its last error quoted in ours.
// MOBILE_MOE_DEBUG=1 passes every log line through. Also the runner's current phase, for the one line a fatal signal
// prints. Part of the native runner (runner.cpp).
#pragma once

#include <executorch/runtime/core/error.h>
#include <executorch/runtime/platform/platform.h>

#include <cstdio>
#include <mutex>
#include <string>

namespace mobile_moe::runner {

inline std::string g_last_runtime_error;
inline std::mutex g_last_runtime_error_mutex;  // the prefetching thread's loads log too
inline bool g_debug = false;

inline void capture_log(et_timestamp_t, et_pal_log_level_t level, const char* filename, const char*, size_t line,
                        const char* message, size_t length) {
  std::string text(message, length);
  while (!text.empty() && (text.back() == '\n' || text.back() == '\r')) text.pop_back();
  if (g_debug) std::fprintf(stderr, "%c executorch:%s:%zu] %s\n", static_cast<char>(level), filename, line, text.c_str());
  if (level == kError || level == kFatal) {
    std::lock_guard<std::mutex> lock(g_last_runtime_error_mutex);
    g_last_runtime_error = text.substr(0, 200);
  }
}

// "(ExecuTorch error 35 InvalidProgram: Verification failed; ...)": the status, and what the runtime logged about it.
inline std::string runtime_error_text(executorch::runtime::Error status) {
  std::string text = "ExecuTorch error " + std::to_string(static_cast<int>(status)) + " " +
                     executorch::runtime::to_string(status);
  std::lock_guard<std::mutex> lock(g_last_runtime_error_mutex);
  if (!g_last_runtime_error.empty()) text += ": " + g_last_runtime_error;
  g_last_runtime_error.clear();
  return "(" + text + ")";
}

// What the runner is doing, for the one line a fatal signal prints (written before the work, read in the handler).
// The prefetching thread (graphs.h) sets it too: writers take turns.
inline char g_phase[256] = "starting";
inline std::mutex g_phase_mutex;
inline void set_phase(const std::string& phase) {
  std::lock_guard<std::mutex> lock(g_phase_mutex);
  std::snprintf(g_phase, sizeof(g_phase), "%s", phase.c_str());
}

}  // namespace mobile_moe::runner
