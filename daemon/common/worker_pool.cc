#include "daemon/common/worker_pool.h"

#include <algorithm>

namespace accord::daemon {

WorkerPool::WorkerPool(int threads) {
  for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { WorkerLoop(); });
}

WorkerPool::~WorkerPool() {
  {
    accord::MutexLock l(&mu_);
    stopping_ = true;
  }
  work_cv_.SignalAll();
  for (std::thread& t : workers_) t.join();
}

void WorkerPool::ParallelFor(int64_t n, absl::FunctionRef<void(int64_t)> fn) {
  if (n <= 0) return;
  if (workers_.empty() || n == 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  accord::MutexLock loop(&loop_mu_);
  accord::MutexLock l(&mu_);
  fn_ = &fn;
  next_ = 0;
  end_ = n;
  ++generation_;
  work_cv_.SignalAll();
  RunPartsLocked();
  while (running_ > 0) done_cv_.Wait(&mu_);
  fn_ = nullptr;
}

int64_t WorkerPool::RunPartsLocked() {
  int64_t ran = 0;
  while (next_ < end_) {
    // Chunks shrink as the loop drains, so the threads finish together.
    const int64_t left = end_ - next_;
    const int64_t chunk = std::max<int64_t>(1, left / (2 * threads()));
    const int64_t begin = next_;
    next_ += chunk;
    ++running_;
    const absl::FunctionRef<void(int64_t)>& fn = *fn_;
    mu_.Unlock();
    for (int64_t i = begin; i < begin + chunk; ++i) fn(i);
    mu_.Lock();
    ran += chunk;
    if (--running_ == 0 && next_ >= end_) done_cv_.SignalAll();
  }
  return ran;
}

void WorkerPool::WorkerLoop() {
  accord::MutexLock l(&mu_);
  // Loops are numbered from 1: a worker that starts after the first loop
  // began still takes part in it.
  uint64_t seen = 0;
  while (true) {
    while (!stopping_ && (generation_ == seen || next_ >= end_)) {
      seen = generation_;
      work_cv_.Wait(&mu_);
    }
    if (stopping_) return;
    seen = generation_;
    RunPartsLocked();
  }
}

}  // namespace accord::daemon
