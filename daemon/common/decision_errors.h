// Building the DecisionErrors the daemons send (docs/ARCHITECTURE.md,
// "Errors"). Every error's code comes from one of three places, never from a
// kind and a code paired by hand: the kind (wire::CodeOfKind, the one table),
// the status that caused it, or FAILED_PRECONDITION for a request its
// stream's state does not allow. Header-only: needs accord_wire.
#ifndef ACCORD_DAEMON_COMMON_DECISION_ERRORS_H_
#define ACCORD_DAEMON_COMMON_DECISION_ERRORS_H_

#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "accord/v1/accord.pb.h"
#include "proto/wire.h"

namespace accord::daemon {

// An error of `kind` with the kind's canonical code.
inline v1::DecisionError KindedError(v1::ErrorKind kind, absl::string_view message) {
  return wire::MakeError(kind, wire::KindError(kind, message));
}

// An error caused by `cause` (a status from a lower layer or a check): its
// code and message (after `context`), and its kind unless `kind` is given.
inline v1::DecisionError ErrorFromStatus(v1::ErrorKind kind, const absl::Status& cause,
                                         absl::string_view context = "") {
  v1::DecisionError e = wire::MakeError(kind, cause);
  if (!context.empty()) e.set_message(absl::StrCat(context, cause.message()));
  return e;
}

// A well-formed request its stream's state does not allow (out of order, a
// repeat the receiver cannot resolve, a second different manifest):
// FAILED_PRECONDITION whatever the kind's code, so the sender resends rather
// than fixes its input.
inline v1::DecisionError OutOfOrderError(v1::ErrorKind kind, absl::string_view message) {
  return wire::MakeError(kind, absl::FailedPreconditionError(message));
}

}  // namespace accord::daemon

#endif  // ACCORD_DAEMON_COMMON_DECISION_ERRORS_H_
