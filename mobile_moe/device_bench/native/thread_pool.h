// ExecuTorch's process-wide thread pool, sized by the runner and by libmobile_moe alike. The wheel ships
// libexecutorch_threadpool but not its header; these declarations match the library's symbols
// (executorch/extension/threadpool/threadpool.h) and are all either needs. Header-only.
#pragma once

#include <cstddef>
#include <cstdint>

namespace executorch::extension::threadpool {
class ThreadPool {
 public:
  size_t get_thread_count() const;
  bool _unsafe_reset_threadpool(uint32_t num_threads);
};
ThreadPool* get_threadpool();
}  // namespace executorch::extension::threadpool

namespace mobile_moe::runner {

// `threads` threads for every graph this process runs.
inline void set_threads(int threads) {
  auto* pool = executorch::extension::threadpool::get_threadpool();
  if (pool != nullptr) pool->_unsafe_reset_threadpool(static_cast<uint32_t>(threads));
}

// The pool's size now (1 where there is no pool).
inline int64_t thread_count() {
  auto* pool = executorch::extension::threadpool::get_threadpool();
  return pool != nullptr ? static_cast<int64_t>(pool->get_thread_count()) : int64_t{1};
}

}  // namespace mobile_moe::runner
