// The C API's handles: the table of open ones, a handle locked for one call, and failures as a status and this
// thread's message. Shared by the library's two interfaces (mobile_moe_api.cpp: mobile_moe.h; measure_api.cpp:
// mobile_moe_measure.h), so both refuse a closed handle and name the call alike.
#pragma once

#include <exception>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <unordered_map>

#include "errors.h"
#include "flatbuffer_check.h"
#include "mobile_moe.h"

namespace mobile_moe::library {

// This thread's last failure (mm_last_error).
extern thread_local std::string t_last_error;

mm_status failed(mm_status status, const std::string& message);

// Every entry point's exceptions as a status and this thread's message, prefixed with the call the app made: nothing
// is thrown across the C boundary.
template <typename Work>
mm_status guarded(const char* call, mm_status runtime_status, Work work) {
  const std::string prefix = std::string(call) + ": ";
  try {
    work();
    return MM_OK;
  } catch (const BundleError& error) {
    return failed(MM_BAD_BUNDLE, prefix + error.what());
  } catch (const UsageError& error) {
    return failed(runtime_status == MM_RUNTIME_ERROR ? MM_BAD_ARGUMENT : runtime_status, prefix + error.what());
  } catch (const FileFault& error) {
    return failed(MM_BAD_BUNDLE, prefix + error.what());
  } catch (const std::bad_alloc&) {
    return failed(MM_OUT_OF_MEMORY, prefix + "out of memory");
  } catch (const std::exception& error) {
    return failed(MM_RUNTIME_ERROR, prefix + error.what());
  } catch (...) {  // nothing crosses the C boundary, whatever a dependency throws
    return failed(MM_RUNTIME_ERROR, prefix + "an unknown exception");
  }
}

// The open handles. A handle's address is a key here, never dereferenced before it is found: a handle closed (or
// never opened) is refused instead of read, and mm_close waits, under the handle's own lock, for a call running on it.
class OpenHandles {
 public:
  static OpenHandles& instance();
  void add(std::shared_ptr<mm_model> model);
  std::shared_ptr<mm_model> find(const mm_model* model);
  std::shared_ptr<mm_model> remove(const mm_model* model);

 private:
  std::mutex mutex_;
  std::unordered_map<const mm_model*, std::shared_ptr<mm_model>> open_;
};

// An open handle, locked for one call: `model` is null where `handle` is not open (closed, or never opened).
struct Locked {
  explicit Locked(const mm_model* handle);
  std::shared_ptr<mm_model> owner;
  std::unique_lock<std::mutex> lock;
  mm_model* model = nullptr;
};

mm_status not_open(const char* call, const mm_model* handle);

}  // namespace mobile_moe::library
