#include "daemon/common/worker_pool.h"

#include <algorithm>
#include <chrono>

namespace accord::daemon {
namespace {

constexpr int kIndexBits = 32;
constexpr uint64_t kClosed = (uint64_t{1} << kIndexBits) - 1;  // no index claimable

uint64_t LoopOf(uint64_t claim) { return claim >> kIndexBits; }
int64_t IndexOf(uint64_t claim) { return static_cast<int64_t>(claim & kClosed); }

void Relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

}  // namespace

WorkerPool::WorkerPool(int threads, absl::Duration spin) : spin_(spin) {
  for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { WorkerLoop(); });
}

WorkerPool::~WorkerPool() {
  stopping_.store(true);
  {
    accord::MutexLock l(&sleep_mu_);
    wake_cv_.SignalAll();
  }
  for (std::thread& t : workers_) t.join();
}

void WorkerPool::ParallelFor(int64_t n, absl::FunctionRef<void(int64_t)> fn) {
  if (n <= 0) return;
  if (workers_.empty() || n == 1 || n >= static_cast<int64_t>(kClosed)) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  accord::MutexLock loop(&loop_mu_);
  // Loops are even numbers; the odd one before a loop closes the previous
  // loop's counter while this loop's bounds are written, so a worker still
  // in the previous loop cannot claim an index against the new bounds (its
  // claim would fail: the counter changed).
  const uint64_t previous = LoopOf(claim_.load(std::memory_order_relaxed));
  const uint64_t loop_id = previous + 2;
  claim_.store(((previous + 1) << kIndexBits) | kClosed, std::memory_order_relaxed);
  fn_.store(&fn, std::memory_order_release);
  chunk_.store(std::max<int64_t>(1, n / (4 * threads())), std::memory_order_release);
  unfinished_.store(n, std::memory_order_release);
  end_.store(n, std::memory_order_release);
  claim_.store(loop_id << kIndexBits, std::memory_order_release);
  {
    accord::MutexLock l(&sleep_mu_);
    if (sleepers_ > 0) wake_cv_.SignalAll();
  }
  RunParts(loop_id);
  // The parts still running are short; a worker descheduled in the middle
  // of one is waited for without burning the core.
  for (int spins = 0; unfinished_.load(std::memory_order_acquire) > 0; ++spins) {
    if (spins < 4096) {
      Relax();
    } else {
      std::this_thread::yield();
    }
  }
}

void WorkerPool::RunParts(uint64_t loop_id) {
  uint64_t claim = claim_.load(std::memory_order_acquire);
  while (true) {
    if (LoopOf(claim) != loop_id) return;
    const int64_t first = IndexOf(claim);
    const int64_t end = end_.load(std::memory_order_acquire);
    if (first >= end) return;
    const int64_t take = std::min(chunk_.load(std::memory_order_acquire), end - first);
    const absl::FunctionRef<void(int64_t)>* fn = fn_.load(std::memory_order_acquire);
    // Succeeds only while the counter is still this loop's (see ParallelFor).
    if (!claim_.compare_exchange_weak(claim, claim + static_cast<uint64_t>(take),
                                      std::memory_order_acq_rel, std::memory_order_acquire)) {
      continue;
    }
    for (int64_t i = first; i < first + take; ++i) (*fn)(i);
    unfinished_.fetch_sub(take, std::memory_order_release);
    claim = claim_.load(std::memory_order_acquire);
  }
}

void WorkerPool::WorkerLoop() {
  uint64_t seen = 0;
  const auto spin = absl::ToChronoNanoseconds(spin_);
  auto open_loop = [&] {
    const uint64_t id = LoopOf(claim_.load(std::memory_order_acquire));
    return id != seen && id % 2 == 0 ? id : 0;
  };
  while (!stopping_.load()) {
    uint64_t loop_id = open_loop();
    if (loop_id == 0) {
      // Spin for a while (the next batch is usually close), then sleep.
      const auto until = std::chrono::steady_clock::now() + spin;
      for (int i = 0; loop_id == 0 && !stopping_.load(std::memory_order_relaxed); ++i) {
        Relax();
        loop_id = open_loop();
        if (loop_id == 0 && i % 64 == 63 && std::chrono::steady_clock::now() >= until) break;
      }
      if (loop_id == 0) {
        accord::MutexLock l(&sleep_mu_);
        ++sleepers_;
        while (!stopping_.load() && (loop_id = open_loop()) == 0) wake_cv_.Wait(&sleep_mu_);
        --sleepers_;
      }
      if (loop_id == 0) continue;  // stopping
    }
    seen = loop_id;
    RunParts(loop_id);
  }
}

}  // namespace accord::daemon
