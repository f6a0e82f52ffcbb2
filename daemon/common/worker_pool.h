// A fixed set of worker threads that share the parts of one parallel loop
// with the thread that asks for it (docs/ARCHITECTURE.md, "More than one
// core"). The coordinator uses it to handle the manifests of one batch and
// to compute the decisions of the groups it completes side by side; each
// part writes only its own results, so the outcome does not depend on which
// thread ran it.
//
// Loops are short (a batch of 200 manifests is ~100 µs of work), so a
// hand-off through a condition variable (tens of µs to wake a thread on a
// virtual machine) would cost more than it saves: parts are claimed from an
// atomic counter, the caller spins until the last part is done, and an idle
// worker spins for `spin` before it sleeps.
#ifndef ACCORD_DAEMON_COMMON_WORKER_POOL_H_
#define ACCORD_DAEMON_COMMON_WORKER_POOL_H_

#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/time/time.h"
#include "core/sync.h"

namespace accord::daemon {

class WorkerPool {
 public:
  // `threads` counts the caller: 1 (or less) starts no thread and runs every
  // loop on the caller.
  explicit WorkerPool(int threads, absl::Duration spin = absl::Microseconds(200));
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
  void ParallelFor(int64_t n, absl::FunctionRef<void(int64_t)> fn) ABSL_LOCKS_EXCLUDED(loop_mu_);

 private:
  void WorkerLoop();
  // Claims and runs parts of loop `loop_id` until none is left.
  void RunParts(uint64_t loop_id);

  const absl::Duration spin_;
  accord::Mutex loop_mu_;  // one loop at a time
  // The current loop: its number in the high 32 bits of claim_, the next
  // unclaimed index in the low 32 bits, so a worker still finishing an
  // earlier loop cannot claim a part of this one.
  std::atomic<uint64_t> claim_{0};
  std::atomic<int64_t> end_{0};
  std::atomic<int64_t> chunk_{1};
  std::atomic<const absl::FunctionRef<void(int64_t)>*> fn_{nullptr};
  std::atomic<int64_t> unfinished_{0};  // indices of the current loop not yet run
  std::atomic<bool> stopping_{false};
  // Sleeping workers wait here for a new loop.
  accord::Mutex sleep_mu_;
  accord::CondVar wake_cv_;
  int sleepers_ ABSL_GUARDED_BY(sleep_mu_) = 0;
  std::vector<std::thread> workers_;
};

}  // namespace accord::daemon

#endif  // ACCORD_DAEMON_COMMON_WORKER_POOL_H_
