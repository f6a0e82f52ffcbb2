// Sidecar: one job's sidecar, the thread-safe, gRPC-facing side of a
// SidecarJob (sidecar_job.h, the protocol): it holds the lock, the timer
// thread, the clock and the ranks' sinks, and delivers what the SidecarJob
// does (SidecarEffects). A sidecar process serves several jobs at once, one
// Sidecar each (SidecarJobs, sidecar_jobs.h, routes each rank by its
// RankHello).
//
// Thread-safe. Sinks are called with the lock held and must not block or call
// back into the Sidecar.
#ifndef ACCORD_DAEMON_SIDECAR_SIDECAR_H_
#define ACCORD_DAEMON_SIDECAR_SIDECAR_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "accord/v1/accord.pb.h"
#include "core/sync.h"
#include "daemon/common/clock.h"
#include "daemon/common/due_timer.h"
#include "daemon/common/upstream.h"
#include "daemon/sidecar/sidecar_job.h"

namespace accord::daemon {

// One rank's stream.
class RankSink {
 public:
  virtual ~RankSink() = default;
  virtual void Send(std::shared_ptr<const v1::RankReply> reply) = 0;
  // Ends the stream with `status` after the queued replies.
  virtual void Close(const absl::Status& status) = 0;
};

// What the rank service (grpc_sidecar.h) drives: a Sidecar (one job) or
// SidecarJobs (every job of the node). A session's calls come in order from
// one stream; CloseRank is its last.
class RankSessionHandler {
 public:
  using SessionId = uint64_t;
  virtual ~RankSessionHandler() = default;
  virtual SessionId OpenRank(RankSink* sink) = 0;
  virtual void HandleRankMessage(SessionId session, const v1::RankMessage& message) = 0;
  virtual void CloseRank(SessionId session) = 0;
};

class Sidecar final : public UpstreamHandler, public RankSessionHandler, private SidecarEffects {
 public:
  using SessionId = RankSessionHandler::SessionId;
  static constexpr const char* kServerVersion = SidecarJob::kServerVersion;
  // The checks of a RankHello that need no state (SidecarJob::CheckHello).
  // SidecarJobs runs them before it gives the rank a job's Sidecar.
  static std::optional<v1::DecisionError> CheckHello(const SidecarOptions& options,
                                                     const v1::RankHello& hello) {
    return SidecarJob::CheckHello(options, hello);
  }

  explicit Sidecar(SidecarOptions options);
  ~Sidecar();
  Sidecar(const Sidecar&) = delete;
  Sidecar& operator=(const Sidecar&) = delete;

  // Stops the timer thread (no partial-step report is sent afterwards).
  // Idempotent; call it before the UpstreamSink goes away.
  void Stop();

  // Must be set before any other call; not owned.
  void SetUpstream(UpstreamSink* upstream);

  SessionId OpenRank(RankSink* sink) override;
  void HandleRankMessage(SessionId session, const v1::RankMessage& message) override;
  void CloseRank(SessionId session) override;

  // Whether `rank` was accepted since the job's state was last reset
  // (connected now or left), and the ranks connected now.
  bool HadRank(int rank);
  std::vector<int> ConnectedRanks();

  void OnUpstreamConnected() override;
  void HandleCoordinatorMessage(const v1::CoordinatorMessage& message);
  // The same; may move the message's contents out (a decision batch that goes
  // to every rank unchanged is forwarded without a copy).
  void HandleCoordinatorMessage(v1::CoordinatorMessage* message) override;

  SidecarStats stats();

  // The job served now, the run the coordinator placed this node in ("" until
  // its Welcome), the node and the epoch drawn for the current ranks; the
  // key-value forwarder stamps them on requests (docs/ARCHITECTURE.md, Runs).
  struct RunStamp {
    std::string job_id;
    std::string run_id;
    std::string node_id;
    uint64_t node_epoch = 0;
  };
  RunStamp CurrentRun();

  // Before the job's first rank: the job continues the incarnation of a
  // launch of it whose ranks have all left (run `run_id`, `node_epoch`), for
  // a late rank of that launch (SidecarJobs). A rank that resumes a run
  // names its own instead.
  void ContinueIncarnation(std::string run_id, uint64_t node_epoch);

  // Reports upstream (NodeProgress.partial) every step that some local ranks
  // submitted and others did not for at least half the coordinator's
  // deadline. The timer thread calls this; tests without it may call it.
  void CheckPartialSteps();

 private:
  // SidecarEffects, called by job_ with mu_ held.
  void SendToSession(SessionId session, std::shared_ptr<const v1::RankReply> reply) override;
  void CloseSession(SessionId session, const absl::Status& status) override;
  void ArmTimer(absl::Time at) override;
  bool TimerArmed() const override;

  const SidecarOptions options_;
  Clock* const clock_;
  accord::Mutex mu_;
  // Each open rank session's stream (not owned), from OpenRank to CloseRank.
  absl::flat_hash_map<SessionId, RankSink*> sinks_ ABSL_GUARDED_BY(mu_);
  SidecarJob job_ ABSL_GUARDED_BY(mu_);
  // Runs job_.CheckTimers when the time job_ armed passes. Not
  // ABSL_GUARDED_BY(mu_): Start and Stop take mu_ themselves. Last: its
  // thread starts once everything above is initialised.
  DueTimer timer_;
};

}  // namespace accord::daemon

#endif  // ACCORD_DAEMON_SIDECAR_SIDECAR_H_
