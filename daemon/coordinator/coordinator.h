// The coordinator's logic: jobs, group registrations, per-step agreement.
//
// Protocol (one Session stream per sidecar, see accord.proto):
//  1. NodeHello creates the job on first sight (job id + world size) and
//     assigns the node's ranks. A rank already held by another connected node
//     is refused (DUPLICATE_RANK); a different world size is refused
//     (WORLD_SIZE_MISMATCH). A node that reconnects under the same node id
//     takes its previous state over.
//  2. NodeRegistration: once every rank of the job registered a group, all
//     registrations are compared (spec and policy). Identical: every node gets
//     RegistrationResult{fingerprint}. Otherwise every node gets the same
//     REGISTRATION_MISMATCH naming the first differing parameter and the ranks
//     that differ from the lowest rank's registration; the group is failed.
//     A group not registered by every rank within `deadline` of its first
//     registration fails the whole JOB: every node gets the same
//     RegistrationResult{MISSING_RANKS} naming the ranks that did not register
//     it (node, connected or not) and the ranks that did; a later
//     registration of the group gets the same error. When the job fails for
//     any reason, every group still collecting gets the failure (JOB_FAILED).
//  3. Node manifests (full or repeat form) are collected per (group, step).
//     When the ranks they cover add up to the world, the coordinator decides
//     (core Decide on the OR-merge of the node manifests) and broadcasts the
//     Decision to every node of the job, many decisions per message. If every
//     node repeated its previous manifest the reply is `same_as_previous`.
//     A batch repeat (ManifestBatch.repeat_batch_key) stands for the
//     session's previous batch in repeat form at a new step; it is expanded
//     from the session's record of that batch (group pointers resolved once)
//     and each entry is handled exactly like the repeat-form manifest.
//     In steady state (every node repeats its whole batch) the repeats of a
//     step are held back as one wave and the last node in decides every group
//     at once: O(1) per node plus O(groups) per step (docs/ARCHITECTURE.md,
//     "Repeat waves"). Any other event first hands the held-back repeats to
//     the entry-by-entry path, so the outcome is the same either way.
//  4. A pending (group, step) that has not heard from every rank within
//     `deadline` of its first submission fails the whole JOB. A step starts
//     pending at its first node manifest, or at a sidecar's partial report
//     (NodeProgress.partial: some of its ranks submitted it `waited_us` ago,
//     others not), whichever comes first; the Welcome tells sidecars the
//     deadline so they report at half of it. At the deadline the nodes with
//     missing ranks are asked (ProgressQuery) which of their ranks submitted;
//     after their answers or a grace of min(1 s, deadline / 4) the failure
//     is named by the oldest waiting step of the lowest group id due to
//     fail: that step gets MISSING_RANKS (naming the missing ranks, the last
//     step each reached and the ranks that submitted; see
//     docs/ARCHITECTURE.md) and every
//     other pending or later step gets JOB_FAILED, on every node. A rank that
//     leaves (RankEvent) while a pending step still needs it fails the job at
//     once, and so does a step that starts pending after a rank left before
//     it. The job is failed rather than the group because a collective
//     without one of its ranks cannot complete for any group. The job's state
//     is dropped when its last node disconnects, so a restarted job can reuse
//     the id.
//
// Decisions are deterministic functions of the manifests, so a restarted
// coordinator recomputes the same answers from resent manifests.
//
// Structure (docs/ARCHITECTURE.md, "Classes"): this class is a facade. It
// owns the lock, the sessions, the jobs, the runs (RunRegistry), the timer
// (DeadlineTimer), the counters and the observer's events, and routes each
// message to its job's engine (job.h), which does the rest without a lock
// or a thread and acts only through JobEffects (Coordinator::Effects here).
// Errors are built by located_errors.h and sent through
// JobEffects::Send*Error, which count them.
//
// Thread-safe. Owns one timer thread (deadlines) unless disabled in options;
// it stops in Stop() or the destructor.
#ifndef ACCORD_DAEMON_COORDINATOR_COORDINATOR_H_
#define ACCORD_DAEMON_COORDINATOR_COORDINATOR_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/container/inlined_vector.h"
#include "absl/container/node_hash_map.h"
#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "accord/v1/accord.pb.h"
#include "accord/v1/observe.pb.h"
#include "core/decide.h"
#include "core/group.h"
#include "core/manifest.h"
#include "core/sync.h"
#include "daemon/common/clock.h"
#include "daemon/common/node_session.h"
#include "daemon/common/worker_pool.h"
#include "daemon/coordinator/content.h"
#include "daemon/coordinator/content_cache.h"
#include "daemon/coordinator/coordinator_options.h"
#include "daemon/coordinator/deadline_timer.h"
#include "daemon/coordinator/deadline_tracker.h"
#include "daemon/coordinator/group_agreement.h"
#include "daemon/coordinator/job.h"
#include "daemon/coordinator/job_core.h"
#include "daemon/coordinator/membership.h"
#include "daemon/coordinator/observe_hooks.h"
#include "daemon/coordinator/rank_directory.h"
#include "daemon/coordinator/run_registry.h"
#include "daemon/coordinator/usage_window.h"

namespace accord::daemon {

// Node sessions send through NodeSink (daemon/common/node_session.h), called
// with the coordinator's lock held.

// Per-rank skip counts of one group: skips[rank][param] = number of decided
// steps at which that rank had no gradient for that parameter.
struct SkipMatrix {
  std::vector<std::string> param_names;
  std::map<int, std::vector<int64_t>> skips;
};

// Observer events queued while the coordinator's lock is held and delivered
// in order without it. Thread-safe.
class EventQueue {
 public:
  void Push(ObserveEvent event) ABSL_LOCKS_EXCLUDED(mu_);
  // Every queued event, oldest first (cheap when there is none).
  std::vector<ObserveEvent> Take() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  accord::Mutex mu_;
  std::vector<ObserveEvent> events_ ABSL_GUARDED_BY(mu_);
  std::atomic<bool> have_events_{false};  // events_ is not empty (read without mu_)
};

class Coordinator : public NodeSessionHandler, public RankDirectory {
 public:
  using SessionId = NodeSessionHandler::SessionId;

  Coordinator(CoordinatorOptions options, Clock* clock);
  ~Coordinator();
  Coordinator(const Coordinator&) = delete;
  Coordinator& operator=(const Coordinator&) = delete;

  // Stops the timer thread. Idempotent.
  void Stop();

  // A node stream opened; messages for it go to `sink` until CloseSession.
  SessionId OpenSession(NodeSink* sink) override;
  // Handles one message of a session. Replies and broadcasts go to the sinks
  // before this returns.
  void HandleMessage(SessionId session, const v1::NodeMessage& message) override;
  // The stream ended; `sink` is not used afterwards.
  void CloseSession(SessionId session) override;

  // Fails every pending step whose deadline passed at clock->Now(). The timer
  // thread calls this; tests without the thread may call it directly.
  void CheckDeadlines();

  CoordinatorStats stats();
  // Who sent a key-value request: the run, node and node epoch its sidecar
  // stamped on it (all empty/0 for a request that did not come through a
  // sidecar).
  struct KeyValueOrigin {
    std::string run_id;
    std::string node_id;
    uint64_t node_epoch = 0;
  };
  // The run a key-value request of `job_id` belongs to, starting one when the
  // job has none, and ending the current one when the request comes from a
  // node whose ranks were restarted (as NodeHello does; see
  // docs/ARCHITECTURE.md, "Runs"); returns the run's key scope (see
  // KeyScopeOf). FAILED_PRECONDITION (RUN_ENDED payload) for a request of a
  // run that ended; RESOURCE_EXHAUSTED past --max_jobs live runs.
  absl::StatusOr<std::string> RunForKeyValue(const std::string& job_id,
                                             const KeyValueOrigin& origin);
  // The job's current run id ("" when it has none).
  std::string CurrentRun(const std::string& job_id);
  // RankDirectory (the key-value store names the ranks a Get is missing).
  int WorldSize(const std::string& job_id) override;
  std::vector<std::string> DescribeRanks(const std::string& job_id,
                                         const std::vector<int>& ranks) override;

  // Last step each rank of the job reached (-1: none), indexed by rank.
  absl::StatusOr<std::vector<int64_t>> RankLastSteps(const std::string& job_id);
  absl::StatusOr<SkipMatrix> SkipCounts(const std::string& job_id, const std::string& group_id);

  // Observe API (observe.proto); defined in observe_views.cc. Live jobs
  // first, then retired ones. NOT_FOUND names an unknown job or group;
  // INVALID_ARGUMENT for a negative window.
  absl::StatusOr<v1::StatusResponse> ObserveStatus(const std::string& job_id);
  absl::StatusOr<v1::SkipMatrixResponse> ObserveSkipMatrix(const std::string& job_id,
                                                           const std::string& group_id,
                                                           int64_t window_steps);
  absl::StatusOr<v1::StallsResponse> ObserveStalls(const std::string& job_id);
  // Gauges read at scrape time, one entry per live job.
  struct JobGauges {
    std::string job_id;
    int connected_nodes = 0;
    int stalled_groups = 0;  // groups with a step waiting longer than half the deadline
  };
  std::vector<JobGauges> Gauges();

 private:
  struct Session {
    NodeSink* sink = nullptr;
    Job* job = nullptr;            // set with `stream` by NodeHello
    NodeStream* stream = nullptr;  // owned by `job`
  };
  // Messages produced while handling one event, sent at its end (FlushLocked).
  struct Outbox {
    absl::flat_hash_map<Job*, v1::CoordinatorMessage> broadcast_decisions;
    std::vector<std::pair<Job*, v1::CoordinatorMessage>> broadcast_other;
    std::vector<std::pair<NodeSink*, v1::CoordinatorMessage>> direct;
    // Sent after the above: a member-set wave's decisions, then job verdicts.
    struct Late {
      // list: ScopedDecisions hands out references into it.
      std::list<std::pair<std::vector<NodeSink*>, v1::CoordinatorMessage>> scoped_decisions;
      std::vector<std::pair<Job*, v1::CoordinatorMessage>> broadcast_last;
    };
    // Built on first use: an Outbox is built per message and few need it
    // (a 1-D job's none but a verdict's; docs/MEMBERS.md 2.11).
    std::unique_ptr<Late> late;
    v1::DecisionBatch* ReplyBatch(NodeSink* sink);
    Late& GetLate() {
      if (late == nullptr) late = std::make_unique<Late>();
      return *late;
    }
  };
  // JobEffects of one event (of `job`; nullptr before NodeHello placed the
  // session): into `out`, the counters, the events and the timer. Used with
  // mu_ held.
  class Effects;
  // What the observe API keeps of a job after its last node left.
  struct RetiredGroup {
    std::vector<std::string> param_names;
    UsageWindow usage;
  };
  struct RetiredJob {
    v1::JobStatus status;
    std::map<std::string, RetiredGroup> groups;
    int64_t usage_bytes = 0;
  };

  // Routes one message of session `id` (HandleMessage's part under mu_).
  void DispatchLocked(SessionId id, Session& s, const v1::NodeMessage& message,
                      std::vector<PredecodedContent>* predecoded, Outbox& out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // NodeHello: the hello's own checks (ValidateHello: sorted, checked ranks
  // into `ranks`), the run (JoinRunLocked), the job (created on first
  // sight), the job's checks (Job::CheckJoin), the node's placement.
  void HandleHelloLocked(SessionId id, Session& s, const v1::NodeHello& hello, Outbox& out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status ValidateHello(const Session& s, const v1::NodeHello& hello,
                             std::vector<int>& ranks) const;
  absl::StatusOr<Job*> FindOrCreateJobLocked(const v1::NodeHello& hello, const std::string& run_id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void PlaceNodeLocked(SessionId id, Session& s, Job& job, const v1::NodeHello& hello,
                       const std::vector<int>& ranks, Outbox& out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FlushLocked(Outbox& out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops the job's state (its last node left, or its run ended); the run
  // ends with it unless a newer run replaced it.
  void RemoveJobLocked(Job* job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Runs. JoinRunLocked places a node (NodeHello, or a key-value request it
  // forwarded) in the job's run according to `start` (see accord.proto,
  // NodeHello.run_start), superseding the current run when the node's ranks
  // were restarted; a RUN_ENDED error for a node of an ended run.
  absl::StatusOr<Run*> JoinRunLocked(const std::string& job_id, v1::NodeHello::RunStart start,
                                     const std::string& run_id, const std::string& node_id,
                                     uint64_t node_epoch, Outbox& out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ends the job's run: every connected node of it gets `error` (when set)
  // and loses its job, the job's state is dropped, the run's end is queued
  // for on_run_ended.
  void EndRunLocked(const std::string& job_id, const absl::Status& why,
                    const v1::DecisionError* error, Outbox& out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ends runs that never got a node within run_start_timeout; returns the
  // next time one is due.
  absl::Time ExpireStartingRunsLocked(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Hands ended runs to on_run_ended and queued events to the observer, in
  // order across threads, without mu_.
  void Deliver() ABSL_LOCKS_EXCLUDED(mu_);
  // Keeps a leaving job's observe view (observe_views.cc).
  void RetireJobLocked(Job& job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const CoordinatorOptions options_;
  DeadlineTimer timer_;  // its clock is the coordinator's
  accord::Mutex mu_;
  // Held while delivering run ends and events so they reach their receivers
  // in order; taken before mu_.
  accord::Mutex deliver_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  SessionId next_session_ ABSL_GUARDED_BY(mu_) = 1;
  absl::flat_hash_map<SessionId, Session> sessions_ ABSL_GUARDED_BY(mu_);
  absl::node_hash_map<std::string, Job> jobs_ ABSL_GUARDED_BY(mu_);
  RunRegistry runs_ ABSL_GUARDED_BY(mu_);
  CoordinatorStats stats_ ABSL_GUARDED_BY(mu_);
  EventQueue events_;
  std::deque<RetiredJob> retired_ ABSL_GUARDED_BY(mu_);  // oldest first
  // The step pipelines' executor (decide_threads); used only with mu_ held.
  std::unique_ptr<WorkerPool> pool_;
};

}  // namespace accord::daemon

#endif  // ACCORD_DAEMON_COORDINATOR_COORDINATOR_H_
