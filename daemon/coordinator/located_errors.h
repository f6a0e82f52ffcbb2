// Errors (docs/ARCHITECTURE.md, "Errors"): the builders of
// daemon/common/decision_errors.h, with the job, group and step they are
// about. None pairs a kind with a code by hand. Internal to the coordinator.
#ifndef ACCORD_DAEMON_COORDINATOR_LOCATED_ERRORS_H_
#define ACCORD_DAEMON_COORDINATOR_LOCATED_ERRORS_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "accord/v1/accord.pb.h"
#include "daemon/common/decision_errors.h"

namespace accord::daemon::located {

inline v1::DecisionError Located(v1::DecisionError e, absl::string_view job_id,
                                 absl::string_view group_id, int64_t step) {
  e.set_job_id(std::string(job_id));
  e.set_group_id(std::string(group_id));
  e.set_step(step);
  return e;
}

// An error of `kind` with the kind's canonical code (wire::CodeOfKind).
inline v1::DecisionError Error(v1::ErrorKind kind, absl::string_view message,
                               absl::string_view job_id = "", absl::string_view group_id = "",
                               int64_t step = -1) {
  return Located(KindedError(kind, message), job_id, group_id, step);
}

// An error caused by a status from a lower layer or a check (a registration
// or manifest that does not convert, a decision core Decide refused, a
// refused NodeHello): keeps the cause's code and message (after `context`),
// and its kind unless `kind` is given.
inline v1::DecisionError ErrorFrom(v1::ErrorKind kind, const absl::Status& cause,
                                   absl::string_view context, absl::string_view job_id = "",
                                   absl::string_view group_id = "", int64_t step = -1) {
  return Located(ErrorFromStatus(kind, cause, context), job_id, group_id, step);
}

// A well-formed request the stream's state does not allow (before NodeHello,
// a second hello, a repeat the coordinator cannot resolve): FAILED_PRECONDITION.
inline v1::DecisionError OutOfOrder(v1::ErrorKind kind, absl::string_view message,
                                    absl::string_view job_id = "", absl::string_view group_id = "",
                                    int64_t step = -1) {
  return Located(OutOfOrderError(kind, message), job_id, group_id, step);
}

}  // namespace accord::daemon::located

#endif  // ACCORD_DAEMON_COORDINATOR_LOCATED_ERRORS_H_
