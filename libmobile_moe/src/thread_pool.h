// Threads per handle over ExecuTorch's one process-wide thread pool. The wheel ships libexecutorch_threadpool but not
// its headers; thread_pool.cpp declares what it calls to match its symbols (extension/threadpool/threadpool.h,
// threadpool_guard.h).
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

#include <cstdint>
#include <utility>

namespace mobile_moe::library {

// The pool's size now (1 where there is no pool).
int64_t shared_pool_threads();

// A handle's threads: its lease on the shared pool (threads != 1), or none (threads == 1: the calling thread).
// Every load and run of the handle's graphs happens inside scope(), on whichever thread does it (the prefetching
// thread too).
class HandleThreads {
 public:
  HandleThreads() = default;
  explicit HandleThreads(int threads);
  HandleThreads(HandleThreads&& other) noexcept { *this = std::move(other); }
  HandleThreads& operator=(HandleThreads&& other) noexcept;
  ~HandleThreads();
  int64_t threads() const { return threads_; }

  // RAII: while it lives, this thread's ExecuTorch calls use the handle's threads.
  class Scope {
   public:
    explicit Scope(bool own_thread);
    ~Scope();
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
