#include "client/connection.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace accord {

ClientConnection::ClientConnection(const ClientOptions& options, uint64_t seed)
    : options_(options), rng_(seed) {}

void ClientConnection::Start(absl::Time now) {
  phase_ = Phase::kConnecting;
  connect_deadline_ = now + options_.connect_timeout;
}

void ClientConnection::StreamOpened() { stream_phase_ = StreamPhase::kOpen; }

std::optional<absl::Duration> ClientConnection::Welcomed(const std::string& node_id,
                                                         const std::string& run_id,
                                                         uint64_t node_epoch, absl::Time now) {
  const bool resumed = phase_ == Phase::kReconnecting;
  phase_ = Phase::kWelcomed;
  resume_.node_id = node_id;
  if (!run_id.empty()) resume_.run_id = run_id;
  if (node_epoch != 0) resume_.node_epoch = node_epoch;
  if (!resumed) return std::nullopt;
  return now - lost_at_;
}

void ClientConnection::ReadEnded() {
  stream_phase_ =
      stream_phase_ == StreamPhase::kWriterStopped ? StreamPhase::kOver : StreamPhase::kReadEnded;
}

void ClientConnection::WriterStopped() {
  stream_phase_ =
      stream_phase_ == StreamPhase::kReadEnded ? StreamPhase::kOver : StreamPhase::kWriterStopped;
}

absl::Status ClientConnection::Close(absl::Status why) {
  if (error_.ok()) error_ = std::move(why);
  phase_ = Phase::kClosed;
  return error_;
}

absl::Duration ClientConnection::NextBackoff() {
  const absl::Duration wait =
      backoff_ / 2 + std::uniform_real_distribution<double>(0, 1)(rng_) * (backoff_ / 2);
  backoff_ = std::min(backoff_ * 2, kMaxBackoff);
  return wait;
}

absl::Status ClientConnection::Unreachable(const StreamEnd& end) const {
  return absl::UnavailableError(absl::StrCat(
      "cannot reach the sidecar at ", options_.socket_path, " (job \"", options_.job_id,
      "\", rank ", options_.rank, ") within ", absl::FormatDuration(options_.connect_timeout),
      " (the connect timeout): ", end.message,
      "; check that accord-sidecar runs on this node with --socket=", options_.socket_path));
}

absl::Status ClientConnection::ConnectTimedOut(bool connected) const {
  if (last_miss_.has_value() && !connected) {
    StreamEnd end;
    end.unavailable = true;
    end.message = *last_miss_;
    return Unreachable(end);
  }
  return absl::DeadlineExceededError(absl::StrCat(
      "no welcome from the sidecar at ", options_.socket_path, " within ",
      absl::FormatDuration(options_.connect_timeout), " (job \"", options_.job_id, "\", rank ",
      options_.rank, "); check that accord-sidecar is healthy and connected to its coordinator"));
}

absl::Status ClientConnection::SidecarGone() const {
  // The same text on every rank of the node (no rank in it).
  return absl::UnavailableError(absl::StrCat(
      "job ", options_.job_id, ": the sidecar of node \"", resume_.node_id, "\" at ",
      options_.socket_path, " closed its ranks' connections and did not come back within ",
      absl::FormatDuration(options_.reconnect_grace),
      " (the client's reconnect grace, ClientOptions.reconnect_grace), so this node's ranks "
      "cannot take part: check accord-sidecar on this node (its log, --socket=",
      options_.socket_path, ") and restart the job"));
}

// Before the first welcome, a stream that could not reach the sidecar (none
// yet at the socket, or one restarting) is tried again with backoff until
// the connect timeout: a sidecar may start after its ranks. Any other end
// closes the session.
ClientConnection::AfterEnd ClientConnection::FirstStreamEnded(const StreamEnd& end,
                                                              absl::Time now) {
  AfterEnd out;
  if (!error_.ok()) {
    out.close = Close(error_);
  } else if (stopping_) {
    out.close = Close(absl::CancelledError("the client is shutting down"));
  } else if (!end.unavailable) {
    out.close = Close(Unreachable(end));
  } else {
    out.first_miss = !last_miss_.has_value();
    last_miss_ = end.message;
    const absl::Duration wait = NextBackoff();
    if (now + wait >= connect_deadline_) {
      out.close = Close(Unreachable(end));
    } else {
      out.retry_at = now + wait;
    }
  }
  return out;
}

ClientConnection::AfterEnd ClientConnection::StreamEnded(const StreamEnd& end, absl::Time now) {
  if (phase_ == Phase::kConnecting) return FirstStreamEnded(end, now);
  AfterEnd out;
  if (phase_ == Phase::kClosed) {
    out.close = CallStatus();
    return out;
  }
  if (!error_.ok()) {  // a fatal error
    out.close = Close(error_);
    return out;
  }
  if (stopping_) {
    out.close = Close(absl::CancelledError("the client is shutting down"));
    return out;
  }
  if (options_.reconnect_grace <= absl::ZeroDuration()) {
    const std::string detail = end.ok ? std::string() : absl::StrCat(": ", end.message);
    out.close = Close(absl::UnavailableError(absl::StrCat(
        "sidecar at ", options_.socket_path, " closed the connection (job \"", options_.job_id,
        "\", rank ", options_.rank, ")", detail,
        "; this client does not reconnect (ClientOptions.reconnect_grace is 0), so this "
        "rank's session is over: restart the job")));
    return out;
  }
  if (phase_ == Phase::kWelcomed) {
    phase_ = Phase::kReconnecting;
    lost_at_ = now;
    last_try_ = false;
    backoff_ = kFirstBackoff;
    out.lost = true;
  }
  out.retry_at = std::min(lost_at_ + options_.reconnect_grace, now + NextBackoff());
  return out;
}

ClientConnection::Next ClientConnection::RetryDue(absl::Time now) {
  Next out;
  if (stopping_) {
    out.close = Close(absl::CancelledError("the client is shutting down"));
    return out;
  }
  if (phase_ == Phase::kConnecting) return out;
  // The sidecar is judged gone only by an attempt that finds it gone once the
  // grace is over: a rank that was itself stopped past the grace (its sidecar
  // came back meanwhile) tries before it judges.
  const absl::Time give_up = lost_at_ + options_.reconnect_grace;
  if (now >= give_up && last_try_) {
    out.close = Close(SidecarGone());
    return out;
  }
  last_try_ = now >= give_up;
  out.resume = true;
  return out;
}

}  // namespace accord
