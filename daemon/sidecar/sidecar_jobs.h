// The jobs one sidecar serves (docs/ARCHITECTURE.md, "Jobs on one
// sidecar"): several at once, each in a Sidecar of its own with its own
// upstream stream, so two 4-GPU jobs on an 8-GPU node share the node's
// sidecar and a job whose ranks arrive while another job's ranks are still
// leaving is served at once.
//
// Routing (by the session's RankHello; messages before it are refused):
//  - A hello that fails the stateless checks (Sidecar::CheckHello) or would
//    pass --max_ranks ranks on the node is refused; nothing is created.
//  - A job with no Sidecar gets one with its upstream stream: one *launch*
//    of the job on this node. The launch is the *spare*, a Sidecar whose
//    stream was opened ahead (UpstreamOpener) and has no job yet; a new
//    spare is opened in its place. So a job's first rank does not wait for
//    a connection, and an idle sidecar keeps one stream to the coordinator
//    (a TLS or address problem is logged at startup, as before jobs).
//  - A rank new to its job's current launch joins it.
//  - A rank the current launch already had (connected, or gone) is a new
//    launch of the same job id: a restart, or the next run under a repeated
//    id whose ranks arrive while the previous run's ranks are still leaving.
//    It is *held*: its hello is not answered until the current launch's last
//    rank has left; then a fresh Sidecar (new node epoch, new stream) gets
//    the held ranks in arrival order and answers them at once. Every later
//    hello of the job waits behind the held ones. A hello held for
//    `handover_timeout` (--job_handover_timeout) is refused, naming the
//    previous launch's ranks still connected (DUPLICATE_RANK when its own
//    rank is one of them: a second process with that RANK looks the same).
//  - A rank whose RankHello names another launch (launch_id) than the
//    current launch's ranks named is a new launch too, even when the
//    current launch never had its rank.
//  - A launch whose last session closed is retired: its Sidecar and stream
//    are stopped and destroyed on this class's thread, never on a gRPC
//    callback thread. Its incarnation (run and node epoch, launch id, the
//    ranks it had) is kept for the job id: a rank of the same launch that
//    it never had, arriving after the others left, continues that
//    incarnation in the job's next launch instead of starting a new one, so
//    the coordinator does not take a late rank for restarted ranks.
//    Only within `handover_timeout` of the retirement:
//    a launch id may repeat (the same torchrun --rdzv-id run again), and a
//    later rank is far more likely such a new launch than a late one.
//    Without a launch id a node cannot tell a late rank from a new launch,
//    and starts a new one.
//
// Thread-safe. Lock order: this class's lock, then a Sidecar's. Rank
// messages of a routed session are forwarded without this class's lock; a
// launch is retired only when its last session closed, so the Sidecar a
// session was routed to lives as long as the session. Owns one thread
// (held-hello timeouts, retiring launches), stopped in Stop()/destructor.
#ifndef ACCORD_DAEMON_SIDECAR_SIDECAR_JOBS_H_
#define ACCORD_DAEMON_SIDECAR_SIDECAR_JOBS_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/time/time.h"
#include "accord/v1/accord.pb.h"
#include "core/sync.h"
#include "daemon/common/clock.h"
#include "daemon/common/upstream.h"
#include "daemon/sidecar/sidecar.h"

namespace accord::daemon {

struct SidecarJobsOptions {
  // Each job's Sidecar; `job` (--job) limits the node to one job id,
  // `max_ranks` (--max_ranks) counts every job's ranks together.
  SidecarOptions sidecar;
  // How long a rank of a new launch of a job waits for the node's ranks of
  // the previous launch to leave (--job_handover_timeout). Leaving ranks'
  // streams close within milliseconds of their process closing its client or
  // exiting; the bound is for a previous launch that does not leave.
  absl::Duration handover_timeout = absl::Seconds(10);
  // Messages a held rank may send before its hello is answered (the client
  // sends none; more is refused).
  int max_held_messages = 64;
  // Time for held hellos is sidecar.clock's. Tests may turn the thread off
  // and call CheckHeld() themselves.
  bool start_thread = true;
};

// Per job id: the job's live launch, or one of the last kEndedJobsKept ended
// jobs. Counters add up over the id's launches on this node.
struct SidecarJobsStats {
  int sessions = 0;                // open rank streams
  std::vector<SidecarStats> jobs;  // by job id
  int held = 0;                    // hellos held for a new launch
  int64_t launches = 0;            // launches started since the process began
};

class SidecarJobs final : public RankSessionHandler {
 public:
  static constexpr int kEndedJobsKept = 8;

  // Opens the upstream stream of a new launch's Sidecar: calls
  // job->SetUpstream and starts the stream. Destroying the returned sink
  // stops the stream; it is destroyed after the Sidecar's Stop().
  using UpstreamOpener = std::function<std::unique_ptr<UpstreamSink>(Sidecar* job)>;

  SidecarJobs(SidecarJobsOptions options, UpstreamOpener opener);
  ~SidecarJobs() override;
  SidecarJobs(const SidecarJobs&) = delete;
  SidecarJobs& operator=(const SidecarJobs&) = delete;

  // Stops the thread and every launch (their timers, then their streams)
  // and refuses held hellos; later messages are dropped. Call it once the
  // rank service no longer calls in (after its server shut down).
  // Idempotent.
  void Stop();

  SessionId OpenRank(RankSink* sink) override;
  void HandleRankMessage(SessionId session, const v1::RankMessage& message) override;
  void CloseRank(SessionId session) override;

  // The run the current launch of `job_id` is in, for the key-value
  // forwarder; job_id is empty when the job has no launch here.
  Sidecar::RunStamp CurrentRun(const std::string& job_id);

  SidecarJobsStats stats();

  // Refuses the hellos held past the handover timeout and destroys retired
  // launches. The thread calls it; tests without the thread may.
  void CheckHeld();

 private:
  // What a retired launch stood for upstream, for a late rank of it.
  struct Incarnation {
    std::string launch_id;
    std::string run_id;
    uint64_t node_epoch = 0;
    std::vector<int> ranks;  // sorted: every rank the launch had
    absl::Time retired_at;
  };
  struct Launch {
    std::string job_id;
    std::string launch_id;  // its first rank's RankHello.launch_id
    // Sorted: every rank routed to it, and those of the incarnation it
    // continues.
    std::vector<int> ranks;
    Sidecar::RunStamp last_run;  // taken as each rank leaves
    std::unique_ptr<Sidecar> sidecar;
    std::unique_ptr<UpstreamSink> upstream;
    int sessions = 0;      // sessions routed to it and not closed
    bool emptied = false;  // its last rank left: it takes no new rank
    SidecarStats carried;  // counters of the job id's earlier launches here
  };
  struct Job {
    std::unique_ptr<Launch> launch;  // null between launches
    std::deque<SessionId> held;      // arrival order
  };
  // Launches that serve no job: the spare, its stream opened ahead for the
  // next job's first rank (OpenLaunchLocked), and the retired ones, whose
  // last session closed, destroyed outside the lock (DestroyRetiredLocked).
  struct IdleLaunches {
    std::unique_ptr<Launch> spare;
    std::vector<std::unique_ptr<Launch>> retired;
  };
  // What outlives a launch: how many launches started, and the final
  // counters of the last kEndedJobsKept ended job ids, oldest first, which
  // the id's next launch carries on.
  class LaunchHistory {
   public:
    // A launch of `job_id` starts: counted; returns (and forgets) the final
    // counters of the id's ended launches, zero when there are none.
    SidecarStats Start(const std::string& job_id);
    // A launch of `job_id` ended with `final_stats`, kept in place of any
    // earlier ones of the id; the oldest id goes past kEndedJobsKept.
    void End(const std::string& job_id, SidecarStats final_stats);
    int64_t started() const { return started_; }
    const std::deque<std::pair<std::string, SidecarStats>>& ended() const { return ended_; }
    // A retired launch of `job_id`: its incarnation, kept in place of any
    // earlier one of the id (the oldest id goes past kEndedJobsKept).
    void Retire(const std::string& job_id, Incarnation incarnation);
    // The kept incarnation of `job_id` that a hello of `launch_id` for
    // `rank` continues (the same non-empty launch id, a rank it never had,
    // retired after `retired_since`), taken out; nullopt when none.
    std::optional<Incarnation> Continued(const std::string& job_id, const std::string& launch_id,
                                         int rank, absl::Time retired_since);

   private:
    int64_t started_ = 0;
    std::deque<std::pair<std::string, SidecarStats>> ended_;
    std::deque<std::pair<std::string, Incarnation>> incarnations_;
  };
  enum class State { kNew, kHeld, kRouted, kRefused };
  struct Session {
    RankSink* sink = nullptr;
    State state = State::kNew;
    // kHeld: the hello, what came after it, and when it arrived.
    std::string job_id;
    std::string launch_id;  // its hello's
    std::vector<v1::RankMessage> held;
    absl::Time held_since;
    int rank = -1;
    // kRouted: its launch and its id there.
    Launch* launch = nullptr;
    SessionId routed_id = 0;
  };

  void HandleHelloLocked(SessionId id, Session& s, const v1::RankMessage& hello)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Gives `s` (held messages first) to `job`'s launch, creating one when
  // there is none.
  // `continued`: the incarnation a launch created for it continues.
  void RouteLocked(SessionId id, Session& s, Job& job, const std::string& job_id,
                   std::optional<Incarnation> continued = std::nullopt)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether `launch` had `rank` (its own, or its incarnation's before it).
  static bool HadRank(Launch& launch, int rank);
  // A routed session closed: retires its launch when it was the last, and
  // then serves the job's held hellos.
  void LeaveLaunchLocked(Session& s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Routes the job's held sessions to a fresh launch, in arrival order; a
  // rank the fresh launch already has stays held for the one after.
  void ServeHeldLocked(const std::string& job_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Refuses `s` (not routed) with `error` and forgets it from its job's
  // held list.
  void RefuseLocked(SessionId id, Session& s, const std::string& job_id, int rank,
                    v1::DecisionError error) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RefuseExpiredLocked(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ForgetJobIfIdleLocked(const std::string& job_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A Sidecar with its stream opened, no job yet.
  std::unique_ptr<Launch> OpenLaunchLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Destroys the retired launches outside the lock.
  void DestroyRetiredLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  int RanksLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Loop();

  const SidecarJobsOptions options_;
  const UpstreamOpener opener_;
  Clock* const clock_;
  accord::Mutex mu_;
  accord::CondVar wake_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  SessionId next_session_ ABSL_GUARDED_BY(mu_) = 1;
  absl::flat_hash_map<SessionId, Session> sessions_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, Job> jobs_ ABSL_GUARDED_BY(mu_);
  IdleLaunches idle_ ABSL_GUARDED_BY(mu_);
  LaunchHistory history_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;  // last: started once everything above is initialised
};

}  // namespace accord::daemon

#endif  // ACCORD_DAEMON_SIDECAR_SIDECAR_JOBS_H_
