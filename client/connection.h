// One rank's connection to its sidecar as a state machine: the phase of the
// session across streams, and the I/O phase of the current stream. No lock,
// no thread, no gRPC; time is passed in and what to do next is returned
// (GrpcClient, client/grpc_client.h, holds one under its mutex and performs
// it). tests/client/connection_test.cc drives it alone.
//
// [Note: session phases]
//
//   Start ─► kConnecting ──Welcome──► kWelcomed ◄──────────Welcome───────┐
//             │   ▲                     │                                │
//             │   └── UNAVAILABLE:      │ the stream ended               │
//             │       retry with        ▼                                │
//             │       backoff     kReconnecting ── retry with backoff ───┘
//             │                         │   (until the reconnect grace,
//             │                         │    then one last try)
//             ▼                         ▼
//   kClosed ◄─ other end, connect timeout, fatal error, stop, grace 0 or
//              over (kClosed is final: every call fails with CallStatus())
//
// A fatal error from the sidecar (FatalError) is latched in any phase:
// calls fail with it at once, and the session closes with it when its
// stream ends.
//
// [Note: stream phases] A stream is read by one thread and written by
// another; Finish may run only once both stopped:
//
//   StreamOpened ─► kOpen ──ReadEnded──► kReadEnded ──WriterStopped──► kOver
//                     │                                                  ▲
//                     └──WriterStopped──► kWriterStopped ──ReadEnded─────┘
#ifndef ACCORD_CLIENT_CONNECTION_H_
#define ACCORD_CLIENT_CONNECTION_H_

#include <cstdint>
#include <optional>
#include <random>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "client/client.h"

namespace accord {

// Not thread-safe: its owner calls it with the owner's lock held.
class ClientConnection {
 public:
  enum class Phase { kConnecting, kWelcomed, kReconnecting, kClosed };
  enum class StreamPhase { kOpen, kWriterStopped, kReadEnded, kOver };

  // How a stream ended (its gRPC status, in plain terms).
  struct StreamEnd {
    bool ok = false;
    bool unavailable = false;  // UNAVAILABLE: the sidecar could not be reached
    std::string message;
  };
  // What the owner does after a stream ended: close every call with
  // `close`, or wait until `retry_at` (a stop ends the wait) and call
  // RetryDue.
  struct AfterEnd {
    std::optional<absl::Status> close;
    absl::Time retry_at = absl::InfinitePast();
    bool first_miss = false;  // the first stream found no sidecar: worth a log line
    bool lost = false;        // a welcomed stream was lost: reconnecting starts
  };
  // What the owner does once the wait is over: close, or open a stream whose
  // hello resumes (kReconnecting) or not (kConnecting).
  struct Next {
    std::optional<absl::Status> close;
    bool resume = false;
  };

  static constexpr absl::Duration kFirstBackoff = absl::Milliseconds(50);
  static constexpr absl::Duration kMaxBackoff = absl::Seconds(1);

  // `seed` draws the backoff jitter (ranks that lost the same sidecar spread
  // their attempts).
  ClientConnection(const ClientOptions& options, uint64_t seed);

  // Transitions.
  // The first stream is being opened: connecting until now + connect_timeout.
  void Start(absl::Time now);
  // A new stream: its I/O phase is kOpen and it is not welcomed yet.
  void StreamOpened();
  // The sidecar welcomed the current stream. Returns how long the session
  // was without a welcomed stream when this ends a reconnect.
  std::optional<absl::Duration> Welcomed(const std::string& node_id, const std::string& run_id,
                                         uint64_t node_epoch, absl::Time now);
  void ReadEnded();
  void WriterStopped();
  // A session- or job-wide error from the sidecar.
  void FatalError(absl::Status status) { error_ = std::move(status); }
  // The owner is closing: waits end, and the next stream end closes.
  void RequestStop() { stopping_ = true; }
  // A decision made by the sidecar alone was received; a resume says so.
  void NoteLocalDecision() { resume_.holds_local_decisions = true; }
  // The current stream ended (after kOver).
  AfterEnd StreamEnded(const StreamEnd& end, absl::Time now);
  // The wait AfterEnd asked for is over (or a stop ended it).
  Next RetryDue(absl::Time now);

  // Reads.
  Phase phase() const { return phase_; }
  StreamPhase stream_phase() const { return stream_phase_; }
  bool welcomed() const { return phase_ == Phase::kWelcomed; }
  bool reconnecting() const { return phase_ == Phase::kReconnecting; }
  bool closed() const { return phase_ == Phase::kClosed; }
  bool stopping() const { return stopping_; }
  bool read_ended() const {
    return stream_phase_ == StreamPhase::kReadEnded || stream_phase_ == StreamPhase::kOver;
  }
  bool writer_stopped() const {
    return stream_phase_ == StreamPhase::kWriterStopped || stream_phase_ == StreamPhase::kOver;
  }
  // OK while calls may proceed; else the error they fail with (a fatal
  // error, or why the session closed).
  const absl::Status& CallStatus() const { return error_; }
  // The error of a first connect that ran out of time without a welcome:
  // UNAVAILABLE naming the socket when the last attempt found no sidecar and
  // the one under way, if any, has not connected either (`connected`: its
  // channel is up); otherwise DEADLINE_EXCEEDED, no welcome.
  absl::Status ConnectTimedOut(bool connected) const;
  absl::Time connect_deadline() const { return connect_deadline_; }
  const std::string& node_id() const { return resume_.node_id; }
  const std::string& run_id() const { return resume_.run_id; }
  uint64_t node_epoch() const { return resume_.node_epoch; }
  bool holds_local_decisions() const { return resume_.holds_local_decisions; }

 private:
  // kClosed with `why`, unless a fatal error came first; returns what every
  // call fails with.
  absl::Status Close(absl::Status why);
  AfterEnd FirstStreamEnded(const StreamEnd& end, absl::Time now);
  absl::Status Unreachable(const StreamEnd& end) const;
  absl::Status SidecarGone() const;
  // The next wait: equal jitter over a nominal backoff that doubles up to a cap.
  absl::Duration NextBackoff();

  // What a resume names (RankResume): the last Welcome's facts, and whether
  // a decision made by the sidecar alone was received.
  struct ResumeFacts {
    std::string node_id;
    std::string run_id;
    uint64_t node_epoch = 0;
    bool holds_local_decisions = false;
  };

  const ClientOptions options_;
  Phase phase_ = Phase::kConnecting;
  StreamPhase stream_phase_ = StreamPhase::kOpen;
  bool stopping_ = false;
  // A fatal error from the sidecar (latched in any phase; the session closes
  // with it), or in kClosed why the session closed. OK otherwise.
  absl::Status error_;
  // kConnecting: a stream that cannot reach the sidecar is tried again until then.
  absl::Time connect_deadline_ = absl::InfiniteFuture();
  // The last first-stream attempt that found no sidecar (its message).
  std::optional<std::string> last_miss_;
  // kReconnecting: when the last welcomed stream ended, and whether the
  // attempt under way began past the grace (the last one).
  absl::Time lost_at_ = absl::InfinitePast();
  bool last_try_ = false;
  absl::Duration backoff_ = kFirstBackoff;
  std::mt19937_64 rng_;
  ResumeFacts resume_;
};

}  // namespace accord

#endif  // ACCORD_CLIENT_CONNECTION_H_
