#include "daemon/coordinator/deadline_tracker.h"

#include <algorithm>
#include <utility>

namespace accord::daemon {

StepDeadline::Due StepDeadline::Check(absl::Time now, bool stalls, absl::Time& next) {
  if (deadline_ > now) {
    next = std::min(next, deadline_);
    if (stalls && !stall_reported_) {
      if (stall_at() <= now) {
        stall_reported_ = true;
        return Due::kStall;
      }
      next = std::min(next, stall_at());
    }
    return Due::kNothing;
  }
  if (phase_ == Phase::kRunning) return Due::kAsk;
  if (grace_end_ > now) {
    next = std::min(next, grace_end_);
    return Due::kNothing;
  }
  return Due::kFail;
}

void StepDeadline::Ask(std::vector<const NodeState*> asked, absl::Time grace_end) {
  phase_ = Phase::kAsking;
  unanswered_ = std::move(asked);
  grace_end_ = grace_end;
}

StepDeadline::Answered StepDeadline::Answer(const NodeState* node, absl::Time now) {
  if (phase_ != Phase::kAsking) return Answered::kIgnored;
  auto it = std::find(unanswered_.begin(), unanswered_.end(), node);
  if (it == unanswered_.end()) return Answered::kIgnored;  // not asked, or answered already
  unanswered_.erase(it);
  if (!unanswered_.empty()) return Answered::kMore;
  // Everyone asked has answered: fail now rather than at the grace's end.
  grace_end_ = now;
  return Answered::kAll;
}

}  // namespace accord::daemon
