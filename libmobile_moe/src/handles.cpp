// handles.h: the open handles, a handle locked for one call, and failures as a status and this thread's message.
#include "handles.h"

#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "model.h"
#include "runtime_log.h"

namespace mobile_moe::library {

thread_local std::string t_last_error;

mm_status failed(mm_status status, const std::string& message) {
  t_last_error = message;
  for (char& c : t_last_error)  // one line, as the runner prints it
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) c = ' ';
  library_log(MM_LOG_ERROR, t_last_error);
  return status;
}

OpenHandles& OpenHandles::instance() {
  static OpenHandles* handles = new OpenHandles();  // never destroyed: an app's threads may call during exit
  return *handles;
}

void OpenHandles::add(std::shared_ptr<mm_model> model) {
  std::lock_guard<std::mutex> lock(mutex_);
  open_[model.get()] = std::move(model);
}

std::shared_ptr<mm_model> OpenHandles::find(const mm_model* model) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto found = open_.find(model);
  return found == open_.end() ? nullptr : found->second;
}

std::shared_ptr<mm_model> OpenHandles::remove(const mm_model* model) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto found = open_.find(model);
  if (found == open_.end()) return nullptr;
  auto removed = std::move(found->second);
  open_.erase(found);
  return removed;
}

Locked::Locked(const mm_model* handle) : owner(OpenHandles::instance().find(handle)) {
  if (owner) {
    lock = std::unique_lock<std::mutex>(owner->mutex);
    if (!owner->closed) model = owner.get();
  }
}

mm_status not_open(const char* call, const mm_model* handle) {
  return failed(MM_BAD_ARGUMENT, std::string(call) + ": " +
                                     (handle == nullptr ? "model is NULL"
                                                        : "model is not an open handle (closed, or never opened)"));
}

}  // namespace mobile_moe::library
