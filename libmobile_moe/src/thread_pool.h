// Threads per handle over ExecuTorch's one process-wide thread pool. The wheel ships libexecutorch_threadpool but not
// its headers; the declarations below match its symbols (extension/threadpool/threadpool.h, threadpool_guard.h).
//
// Why a lease, not a resize per open: XNNPACK keeps the pool's pthreadpool from the moment a graph is loaded
// (backends/xnnpack/runtime/XNNCompiler.cpp passes get_pthreadpool() to xnn_create_runtime_v4), and
// ThreadPool::_unsafe_reset_threadpool destroys that pthreadpool (extension/threadpool/threadpool.cpp), so resizing the
// pool while any graph loaded on it lives leaves that graph running on freed memory. ExecuTorch's per-call
// UseNThreadsThreadPoolGuard is not in its open-source build. So:
//   - a handle of 1 thread loads and runs every graph under NoThreadPoolGuard (thread-local): get_pthreadpool()
//     returns null, XNNPACK runs on the calling thread, and the handle never touches the shared pool;
//   - a handle of N > 1 threads leases the shared pool at N: resized only while no other handle holds a lease; a lease
//     of another size is refused with a message (never a resize under a running graph);
//   - threads 0 leases the pool at whatever size it has.
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>

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

// The pool's size now (1 where there is no pool).
inline int64_t shared_pool_threads() {
  auto* pool = executorch::extension::threadpool::get_threadpool();
  return pool != nullptr ? static_cast<int64_t>(pool->get_thread_count()) : int64_t{1};
}

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

// A handle's threads: its lease on the shared pool (threads != 1), or none (threads == 1: the calling thread).
// Every load and run of the handle's graphs happens inside scope(), on whichever thread does it (the prefetching
// thread too).
class HandleThreads {
 public:
  HandleThreads() = default;
  explicit HandleThreads(int threads) : own_thread_(threads == 1) {
    threads_ = own_thread_ ? 1 : SharedPoolLeases::instance().acquire(threads);
    leased_ = !own_thread_;
  }
  HandleThreads(HandleThreads&& other) noexcept { *this = std::move(other); }
  HandleThreads& operator=(HandleThreads&& other) noexcept {
    std::swap(own_thread_, other.own_thread_);
    std::swap(leased_, other.leased_);
    std::swap(threads_, other.threads_);
    return *this;
  }
  ~HandleThreads() {
    if (leased_) SharedPoolLeases::instance().release();
  }
  int64_t threads() const { return threads_; }

  // RAII: while it lives, this thread's ExecuTorch calls use the handle's threads.
  class Scope {
   public:
    explicit Scope(bool own_thread)
        : previous_(executorch::extension::threadpool::NoThreadPoolGuard::is_enabled()) {
      executorch::extension::threadpool::NoThreadPoolGuard::set_enabled(own_thread);
    }
    ~Scope() { executorch::extension::threadpool::NoThreadPoolGuard::set_enabled(previous_); }
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    bool previous_;
  };
  Scope scope() const { return Scope(own_thread_); }

 private:
  bool own_thread_ = true;
  bool leased_ = false;
  int64_t threads_ = 1;
};

}  // namespace mobile_moe::library
