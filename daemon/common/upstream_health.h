// Whether the node above (the coordinator, or a relay) answers this sidecar,
// as every part of the sidecar sees it: each job's stream (a Welcome is an
// answer; a new stream attempt means the previous one ended) and the
// key-value forwarder (a completed call is an answer; UNAVAILABLE is not).
// One per sidecar process, shared by its jobs' Sidecars and the forwarder,
// so a key-value call made after a job's ranks were told the node above is
// lost (--upstream_loss_limit) ends at once with the same words instead of
// waiting for it until its own deadline (docs/RELIABILITY.md, "Node above
// lost").
//
// Thread-safe.
#ifndef ACCORD_DAEMON_COMMON_UPSTREAM_HEALTH_H_
#define ACCORD_DAEMON_COMMON_UPSTREAM_HEALTH_H_

#include <atomic>
#include <cstdint>
#include <limits>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"

namespace accord::daemon {

class UpstreamHealth {
 public:
  // `limit`: --upstream_loss_limit (zero: never lost).
  explicit UpstreamHealth(absl::Duration limit) : limit_(limit) {}

  absl::Duration limit() const { return limit_; }

  // Called for every message from above (a relaxed load when it answers
  // already: nothing more on the decision path).
  void NoteAnswered() {
    if (since_ns_.load(std::memory_order_relaxed) != kAnswers) {
      since_ns_.store(kAnswers, std::memory_order_relaxed);
    }
  }
  // From `now` on, unless already unanswered since earlier.
  void NoteUnanswered(absl::Time now) {
    int64_t expected = kAnswers;
    since_ns_.compare_exchange_strong(expected, absl::ToUnixNanos(now), std::memory_order_relaxed);
  }
  // When the node above counts as lost (InfiniteFuture: it answers, or no
  // limit).
  absl::Time LostAt() const {
    const int64_t since = since_ns_.load(std::memory_order_relaxed);
    if (limit_ <= absl::ZeroDuration() || since == kAnswers) return absl::InfiniteFuture();
    return absl::FromUnixNanos(since) + limit_;
  }

  // The words a rank gets when the node above is lost; the same on every
  // node of the job.
  static std::string LostMessage(const std::string& job_id, absl::Duration limit) {
    return absl::StrCat(
        "job ", job_id,
        ": the coordinator (or relay) this rank's sidecar reports to has not answered for ",
        absl::FormatDuration(limit),
        " (--upstream_loss_limit), so no registration result, decision or key can reach the "
        "job's ranks; the job is failed. Check that the coordinator runs and that the nodes "
        "reach it, and the sidecars' logs");
  }

 private:
  static constexpr int64_t kAnswers = std::numeric_limits<int64_t>::max();
  const absl::Duration limit_;
  // Since when (Unix ns) the node above has not answered; kAnswers: it does.
  std::atomic<int64_t> since_ns_{kAnswers};
};

}  // namespace accord::daemon

#endif  // ACCORD_DAEMON_COMMON_UPSTREAM_HEALTH_H_
