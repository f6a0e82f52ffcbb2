// The clock of a sidecar's or a relay's job against --upstream_loss_limit
// (docs/RELIABILITY.md, "Node above lost"): since when the node above has not
// answered while a job is served, and the one error the job's ranks (or
// sidecars) get once that lasts past the limit. No lock, no thread; time is
// passed in and the due time and the error are returned for the owner to arm
// its timer with and to send.
//
//   stopped ──Start──► counting ──Check past the limit──► reported
//      ▲                  │                                  │
//      └────Answered──────┘                                  │
//      └───────────────────────────EndJob────────────────────┘
//
// Not thread-safe: the owner calls it under its lock.
#ifndef ACCORD_DAEMON_COMMON_UPSTREAM_LOSS_H_
#define ACCORD_DAEMON_COMMON_UPSTREAM_LOSS_H_

#include <optional>
#include <string>

#include "absl/time/time.h"
#include "accord/v1/accord.pb.h"

namespace accord::daemon {

class UpstreamLossClock {
 public:
  // `limit`: --upstream_loss_limit; zero or less never counts.
  explicit UpstreamLossClock(absl::Duration limit) : limit_(limit) {}

  // The node above has not answered since `now` (a new stream, or a job's
  // first rank before any Welcome), unless the clock counts already or the
  // job's loss was reported. Returns when the loss will be due
  // (InfiniteFuture: not counting).
  absl::Time Start(absl::Time now);
  // An answer (a Welcome): the clock stops.
  void Answered() { since_ = absl::InfiniteFuture(); }
  // The job ended: the clock stops and the next job's loss may be reported.
  void EndJob() {
    since_ = absl::InfiniteFuture();
    reported_ = false;
  }
  // Past the limit at `now` while `job_id` is served (`has_job`): the error
  // for every rank (or sidecar) of the job, once per job. Otherwise nothing,
  // and `*next` says when to look again (InfiniteFuture: not counting).
  std::optional<v1::DecisionError> Check(absl::Time now, bool has_job, const std::string& job_id,
                                         absl::Time* next);

  bool counting() const { return since_ != absl::InfiniteFuture(); }
  absl::Duration limit() const { return limit_; }

 private:
  const absl::Duration limit_;
  absl::Time since_ = absl::InfiniteFuture();  // InfiniteFuture: stopped or reported
  bool reported_ = false;
};

}  // namespace accord::daemon

#endif  // ACCORD_DAEMON_COMMON_UPSTREAM_LOSS_H_
