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
#ifndef ACCORD_DAEMON_SIDECAR_UPSTREAM_HEALTH_H_
#define ACCORD_DAEMON_SIDECAR_UPSTREAM_HEALTH_H_

#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "core/sync.h"

namespace accord::daemon {

class UpstreamHealth {
 public:
  // `limit`: --upstream_loss_limit (zero: never lost).
  explicit UpstreamHealth(absl::Duration limit) : limit_(limit) {}

  absl::Duration limit() const { return limit_; }

  void NoteAnswered() {
    accord::MutexLock l(&mu_);
    unanswered_since_ = absl::InfiniteFuture();
  }
  // From `now` on, unless already unanswered since earlier.
  void NoteUnanswered(absl::Time now) {
    accord::MutexLock l(&mu_);
    if (unanswered_since_ == absl::InfiniteFuture()) unanswered_since_ = now;
  }
  // Since when the node above has not answered (InfiniteFuture: it answers).
  absl::Time unanswered_since() const {
    accord::MutexLock l(&mu_);
    return unanswered_since_;
  }
  // When the node above counts as lost (InfiniteFuture: it answers, or no
  // limit).
  absl::Time LostAt() const {
    if (limit_ <= absl::ZeroDuration()) return absl::InfiniteFuture();
    const absl::Time since = unanswered_since();
    return since == absl::InfiniteFuture() ? since : since + limit_;
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
  const absl::Duration limit_;
  mutable accord::Mutex mu_;
  absl::Time unanswered_since_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();
};

}  // namespace accord::daemon

#endif  // ACCORD_DAEMON_SIDECAR_UPSTREAM_HEALTH_H_
