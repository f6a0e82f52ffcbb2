// A fixed set of worker threads that share the parts of one parallel loop
// with the thread that asks for it (docs/ARCHITECTURE.md, "More than one
// core"). The coordinator uses it to compute the decisions of the groups one
// message completes side by side; each part writes only its own result, so
// the outcome does not depend on which thread ran it.
#ifndef ACCORD_DAEMON_COMMON_WORKER_POOL_H_
#define ACCORD_DAEMON_COMMON_WORKER_POOL_H_

#include <cstdint>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "core/sync.h"

namespace accord::daemon {

class WorkerPool {
 public:
  // `threads` counts the caller: 1 (or less) starts no thread and runs every
  // loop on the caller.
  explicit WorkerPool(int threads);
  ~WorkerPool();
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  // Threads that take parts of a loop, the caller included.
  int threads() const { return static_cast<int>(workers_.size()) + 1; }

  // Calls fn(i) once for every i in [0, n), on the workers and the caller,
  // and returns when every call returned. Everything the caller wrote before
  // is visible to the calls, and everything the calls wrote is visible to
  // the caller afterwards. Loops from several callers run one after another.
  // `fn` must not throw nor call ParallelFor.
  void ParallelFor(int64_t n, absl::FunctionRef<void(int64_t)> fn) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  void WorkerLoop();
  // Takes and runs parts of the current loop until none is left; returns how
  // many it ran. Called with mu_ held; releases it while running parts.
  int64_t RunPartsLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  accord::Mutex loop_mu_ ABSL_ACQUIRED_BEFORE(mu_);  // one loop at a time
  accord::Mutex mu_;
  accord::CondVar work_cv_;  // workers: a loop started, or stopping
  accord::CondVar done_cv_;  // the caller: the last part finished
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  const absl::FunctionRef<void(int64_t)>* fn_ ABSL_GUARDED_BY(mu_) = nullptr;
  int64_t next_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t end_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t running_ ABSL_GUARDED_BY(mu_) = 0;  // parts taken and not finished
  std::vector<std::thread> workers_;
};

}  // namespace accord::daemon

#endif  // ACCORD_DAEMON_COMMON_WORKER_POOL_H_
