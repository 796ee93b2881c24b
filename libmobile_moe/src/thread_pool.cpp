// thread_pool.h: a handle's threads, leased from ExecuTorch's one process-wide thread pool. The wheel ships
// libexecutorch_threadpool but not its headers; the declarations below match its symbols
// (extension/threadpool/threadpool.h, threadpool_guard.h).
#include "thread_pool.h"

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>

#include "errors.h"

namespace executorch::extension::threadpool {
class ThreadPool {
 public:
  size_t get_thread_count() const;
  bool _unsafe_reset_threadpool(uint32_t num_threads);
};
ThreadPool* get_threadpool();
struct NoThreadPoolGuard {
  static bool is_enabled();
  static void set_enabled(bool enabled);
};
}  // namespace executorch::extension::threadpool

namespace mobile_moe::library {

int64_t shared_pool_threads() {
  auto* pool = executorch::extension::threadpool::get_threadpool();
  return pool != nullptr ? static_cast<int64_t>(pool->get_thread_count()) : int64_t{1};
}

namespace {

// The shared pool's leases: how many open handles load graphs on it. The library's one piece of process-wide state,
// and it guards ExecuTorch's.
class SharedPoolLeases {
 public:
  static SharedPoolLeases& instance() {
    static SharedPoolLeases* leases = new SharedPoolLeases();  // never destroyed: a handle may close during exit
    return *leases;
  }
  // A lease at `threads` (0: the pool's size as it is) -> the pool's size. Throws UsageError where another handle
  // holds the pool at another size.
  int64_t acquire(int threads) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto* pool = executorch::extension::threadpool::get_threadpool();
    if (pool == nullptr) throw std::runtime_error("ExecuTorch has no thread pool on this machine (cpuinfo failed)");
    const auto now = static_cast<int64_t>(pool->get_thread_count());
    if (threads > 0 && threads != now) {
      if (holders_ > 0)
        throw UsageError("options.threads " + std::to_string(threads) + ": ExecuTorch's thread pool is process-wide " +
                         "and runs " + std::to_string(now) + " threads for " + std::to_string(holders_) +
                         " open handle(s); ask for " + std::to_string(now) + ", or for 1 (a handle that runs on the " +
                         "calling thread alone), or close those handles first");
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
      pool->_unsafe_reset_threadpool(static_cast<uint32_t>(threads));  // no graph holds the old pthreadpool
#pragma GCC diagnostic pop
    }
    ++holders_;
    return static_cast<int64_t>(pool->get_thread_count());
  }
  void release() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (holders_ > 0) --holders_;
  }

 private:
  std::mutex mutex_;
  int holders_ = 0;
};

}  // namespace

HandleThreads::HandleThreads(int threads) : own_thread_(threads == 1) {
  threads_ = own_thread_ ? 1 : SharedPoolLeases::instance().acquire(threads);
  leased_ = !own_thread_;
}

HandleThreads& HandleThreads::operator=(HandleThreads&& other) noexcept {
  std::swap(own_thread_, other.own_thread_);
  std::swap(leased_, other.leased_);
  std::swap(threads_, other.threads_);
  return *this;
}

HandleThreads::~HandleThreads() {
  if (leased_) SharedPoolLeases::instance().release();
}

HandleThreads::Scope::Scope(bool own_thread)
    : previous_(executorch::extension::threadpool::NoThreadPoolGuard::is_enabled()) {
  executorch::extension::threadpool::NoThreadPoolGuard::set_enabled(own_thread);
}

HandleThreads::Scope::~Scope() { executorch::extension::threadpool::NoThreadPoolGuard::set_enabled(previous_); }

}  // namespace mobile_moe::library
