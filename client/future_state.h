// What a DecisionFuture shares with the client that completes it.
#ifndef ACCORD_CLIENT_FUTURE_STATE_H_
#define ACCORD_CLIENT_FUTURE_STATE_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "client/client.h"
#include "core/sync.h"

namespace accord {

// The one mutex of all futures of a client: a batch of decisions completes
// under one lock, and no mutex is created or destroyed per future (Abseil's
// deadlock detection, on in Debian's build, tracks every mutex it sees).
// Shared by the client and its futures, which may outlive it.
struct FutureHub {
  accord::Mutex mu;
};

struct DecisionFuture::State {
  State(std::shared_ptr<FutureHub> h, std::string g, int64_t s)
      : hub_owner(std::move(h)), hub(hub_owner.get()), group_id(std::move(g)), step(s) {}
  const std::shared_ptr<FutureHub> hub_owner;
  FutureHub* const hub;
  const std::string group_id;
  const int64_t step;
  bool done ABSL_GUARDED_BY(hub->mu) = false;
  // Read only once done (an empty-message placeholder until then).
  absl::StatusOr<Decision> result ABSL_GUARDED_BY(hub->mu);

  // Set (release) after `result` is written, which then never changes:
  // a reader that sees it true (acquire) may read `result` without the lock.
  std::atomic<bool> completed{false};

  void CompleteLocked(absl::StatusOr<Decision> r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(hub->mu) {
    if (done) return;
    result = std::move(r);
    done = true;
    completed.store(true, std::memory_order_release);
  }
  // Only after `completed` was seen true.
  const absl::StatusOr<Decision>& CompletedResult() const ABSL_NO_THREAD_SAFETY_ANALYSIS {
    return result;
  }
  void Complete(absl::StatusOr<Decision> r) {
    accord::MutexLock lock(&hub->mu);
    CompleteLocked(std::move(r));
  }
};

}  // namespace accord

#endif  // ACCORD_CLIENT_FUTURE_STATE_H_
