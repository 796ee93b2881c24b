// runtime_log.h: the app's log callback, ExecuTorch's log captured into it, and its last error quoted.
#include "runtime_log.h"

#include <executorch/runtime/core/error.h>
#include <executorch/runtime/platform/platform.h>
#include <executorch/runtime/platform/runtime.h>

#include <atomic>
#include <cstdio>
#include <mutex>
#include <string>

#include "mobile_moe.h"

namespace mobile_moe::library {

namespace {

// The app's callback (mm_log_set), process-wide by the app's choice.
struct LibraryLog {
  std::mutex mutex;
  mm_log_callback callback = nullptr;
  void* user_data = nullptr;
};

}  // namespace

static LibraryLog& library_log_sink() {
  static LibraryLog* sink = new LibraryLog();  // never destroyed: a thread may log during the app's exit
  return *sink;
}

void set_library_log(mm_log_callback callback, void* user_data) {
  LibraryLog& sink = library_log_sink();
  std::lock_guard<std::mutex> lock(sink.mutex);
  sink.callback = callback;
  sink.user_data = user_data;
}

void library_log(mm_log_level level, const std::string& message) {
  LibraryLog& sink = library_log_sink();
  mm_log_callback callback = nullptr;
  void* user_data = nullptr;
  {
    std::lock_guard<std::mutex> lock(sink.mutex);
    callback = sink.callback, user_data = sink.user_data;
  }
  if (callback != nullptr) callback(level, message.c_str(), user_data);
}

// At most `bytes` of UTF-8 `text`, never ending inside a character.
static std::string utf8_prefix(const std::string& text, size_t bytes) {
  if (text.size() <= bytes) return text;
  size_t end = bytes;
  while (end > 0 && (static_cast<unsigned char>(text[end]) & 0xc0) == 0x80) --end;  // a continuation byte
  return text.substr(0, end);
}

// ExecuTorch's last error on this thread (a load on the prefetching thread logs there, and throws there too).
static thread_local std::string t_last_runtime_error;

static void capture_log(et_timestamp_t, et_pal_log_level_t level, const char* filename, const char*, size_t line,
                        const char* message, size_t length) {
  std::string text(message, length);
  while (!text.empty() && (text.back() == '\n' || text.back() == '\r')) text.pop_back();
  const bool error = level == kError || level == kFatal;
  if (error) t_last_runtime_error = utf8_prefix(text, 200);
  const mm_log_level ours = error ? MM_LOG_ERROR : level == kInfo ? MM_LOG_INFO : MM_LOG_DEBUG;
  library_log(ours, "executorch:" + std::string(filename) + ":" + std::to_string(line) + "] " + text);
}

void start_runtime() {
  static std::once_flag started;
  std::call_once(started, [] {
    executorch::runtime::register_pal(executorch::runtime::PalImpl::create(capture_log, __FILE__));
    executorch::runtime::runtime_init();
  });
}

std::string runtime_error_text(executorch::runtime::Error status) {
  std::string text = "ExecuTorch error " + std::to_string(static_cast<int>(status)) + " " +
                     executorch::runtime::to_string(status);
  if (!t_last_runtime_error.empty()) text += ": " + t_last_runtime_error;
  t_last_runtime_error.clear();
  return "(" + text + ")";
}

}  // namespace mobile_moe::library
