#include "daemon/common/upstream_loss.h"

#include "absl/status/status.h"
#include "daemon/common/upstream_health.h"

namespace accord::daemon {

absl::Time UpstreamLossClock::Start(absl::Time now) {
  if (counting() || reported_) return absl::InfiniteFuture();
  since_ = now;
  return limit_ > absl::ZeroDuration() ? since_ + limit_ : absl::InfiniteFuture();
}

std::optional<v1::DecisionError> UpstreamLossClock::Check(absl::Time now, bool has_job,
                                                          const std::string& job_id,
                                                          absl::Time* next) {
  *next = absl::InfiniteFuture();
  if (limit_ <= absl::ZeroDuration() || !has_job || !counting()) return std::nullopt;
  const absl::Time due = since_ + limit_;
  if (due > now) {
    *next = due;
    return std::nullopt;
  }
  since_ = absl::InfiniteFuture();
  reported_ = true;
  // Every wait of the job's ranks needs the node above; none can end another
  // way. The words are the same on every node of the job, so ranks that lost
  // the same coordinator end alike.
  v1::DecisionError e;
  e.set_kind(v1::UNAVAILABLE);
  e.set_code(static_cast<int>(absl::StatusCode::kUnavailable));
  e.set_job_id(job_id);
  e.set_message(UpstreamHealth::LostMessage(job_id, limit_));
  return e;
}

}  // namespace accord::daemon
