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
//     once. The job is failed rather than the group because a collective
//     without one of its ranks cannot complete for any group. The job's state
//     is dropped when its last node disconnects, so a restarted job can reuse
//     the id.
//
// Decisions are deterministic functions of the manifests, so a restarted
// coordinator recomputes the same answers from resent manifests.
//
// Structure (docs/ARCHITECTURE.md, "Classes"): this class owns the lock,
// the sessions and the jobs, and routes each message; the state of each
// concern is a small class of its own without gRPC: RunRegistry (runs),
// Membership (nodes, rank owners), GroupRegistration and StepMerger
// (registration, decide), ContentCache (a node's full forms and repeats),
// StepDeadline (a pending step's deadline and progress queries),
// UsageWindow (the skip matrix's window). Errors are built by
// Error/ErrorFrom/OutOfOrder (daemon/common/decision_errors.h) and sent
// through Send*ErrorLocked, which count them.
//
// Thread-safe. Owns one timer thread (deadlines) unless disabled in options;
// it stops in Stop() or the destructor.
#ifndef ACCORD_DAEMON_COORDINATOR_COORDINATOR_H_
#define ACCORD_DAEMON_COORDINATOR_COORDINATOR_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
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
#include "daemon/coordinator/deadline_tracker.h"
#include "daemon/coordinator/group_agreement.h"
#include "daemon/coordinator/membership.h"
#include "daemon/coordinator/observe_hooks.h"
#include "daemon/coordinator/rank_directory.h"
#include "daemon/coordinator/run_registry.h"
#include "daemon/coordinator/usage_window.h"

namespace accord::daemon {

struct CoordinatorOptions {
  absl::Duration deadline = absl::Seconds(60);
  int max_jobs = 1024;
  int max_groups_per_job = 16384;
  int64_t max_params_per_group = kMaxParamsPerGroup;
  int max_pending_steps = 64;  // per group
  int max_world_size = 1 << 20;
  // Tests that drive CheckDeadlines() by hand may turn the thread off.
  bool start_timer_thread = true;
  // Metrics and event log (not owned; may be null). Must outlive the
  // Coordinator.
  CoordinatorObserver* observer = nullptr;
  // Observe API: decided steps of per-step usage kept per group for the skip
  // matrix (runs of identical steps cost one entry), and an approximate byte
  // bound of what they keep alive.
  int64_t usage_window_steps = 1000;
  int64_t usage_window_bytes = 16 << 20;
  // A cap on what every usage window together keeps (live jobs' groups and
  // retired jobs): past it, retired jobs' windows go first (oldest first),
  // then the deciding group's own window shrinks to its newest run.
  int64_t usage_total_bytes = 256 << 20;
  // Runs (docs/ARCHITECTURE.md, "Runs"). Called once per run that ended
  // (its last node left, a newer run superseded it, it never got a node
  // within run_start_timeout) or failed, without the coordinator's lock held,
  // with a RUN_ENDED (or the failure's) status saying why. The key-value
  // store drops the run's keys here. Must not call back into the Coordinator.
  // For a failed run `successor` names its fresh key scope (waiting Gets
  // move there); empty when the run ended.
  std::function<void(const std::string& job_id, const std::string& run_id, const absl::Status&,
                     const std::string& successor)>
      on_run_ended;
  // A node whose stream ended (its sidecar died or restarted, or its host is
  // unreachable) while a pending step still needs its ranks fails the job,
  // on every node, once it has not come back for this long (a sidecar that
  // only lost its connection reconnects well within it). See
  // docs/RELIABILITY.md, "Sidecar restart".
  absl::Duration node_reconnect_grace = absl::Seconds(10);
  // A run started by a key-value request whose node never says NodeHello
  // ends after this long.
  absl::Duration run_start_timeout = absl::Minutes(5);
  // Jobs whose last node left stay visible to the observe API (status, skip
  // matrix) until this many newer jobs ended or the same job id returns.
  int retired_jobs = 8;
  // Repeat waves (docs/ARCHITECTURE.md, "Repeat waves"): once every node of
  // a job contributed its whole batch to a step that decided every group,
  // a step where every node sends a batch repeat is decided in O(groups)
  // after O(1) per node, with the same decisions, errors and counters as
  // without. Off: every batch repeat is handled entry by entry.
  bool repeat_waves = true;
  // More than one core (docs/ARCHITECTURE.md, "More than one core"): the
  // manifests of one batch (distinct groups) are handled, and the groups it
  // completes decided, side by side on this many threads, the handling
  // thread included (0: one per hardware thread, at most 8). Decisions,
  // messages and counters do not depend on it. 1 by default: on the 2-vCPU
  // machines measured (bench/RESULTS.md) more threads did not shorten a step.
  int decide_threads = 1;
  // A batch's manifests are handled side by side only when it has at least
  // this many (each costs about a microsecond).
  int64_t parallel_min_entries = 64;
  // A message's completed steps are decided in parallel only when their
  // merges add up to at least this many node contents (below it the
  // hand-off costs more than it saves).
  int64_t parallel_decide_min_contents = 4096;
};

// Node sessions send through NodeSink (daemon/common/node_session.h), called
// with the coordinator's lock held.

// Counters for the metrics hook.
struct CoordinatorStats {
  int64_t manifests = 0;
  int64_t cache_hits = 0;    // repeat-form manifests resolved from the cache
  int64_t cache_misses = 0;  // full-form manifests
  int64_t repeat_key_mismatches = 0;
  int64_t decisions = 0;
  int64_t same_as_previous = 0;
  int64_t repeat_waves = 0;  // steps decided as one repeat wave
  // Core Decides computed side by side on the worker pool (decide_threads).
  int64_t parallel_decides = 0;
  // Manifests whose HandleEntry part ran on the worker pool.
  int64_t parallel_entries = 0;
  int64_t errors = 0;  // error decisions and results sent (counted once per event)
  int64_t jobs = 0;    // live jobs
  int64_t runs = 0;    // live runs (a run may precede its job: see RunForKeyValue)
  int64_t sessions = 0;
  int64_t retained_contents = 0;  // ContentCache::retained() entries, all jobs
  int64_t usage_bytes = 0;        // usage windows, live and retired jobs (approximate)
};

// Per-rank skip counts of one group: skips[rank][param] = number of decided
// steps at which that rank had no gradient for that parameter.
struct SkipMatrix {
  std::vector<std::string> param_names;
  std::map<int, std::vector<int64_t>> skips;
};

// The lifecycle of the job state a run holds while a node is connected
// (docs/ARCHITECTURE.md, "Lifecycles"; runs: run_registry.h).
enum class JobState {
  kRunning,
  kFailed,  // MISSING_RANKS, a rank left mid-step, or a node lost past its grace
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
  // A node manifest's content (content.h), shared between a node's cache,
  // the pending steps it contributed to and the usage windows.
  using Content = ::accord::daemon::Content;
  using NodeState = ::accord::daemon::NodeState;            // membership.h
  using NodeGroupState = ::accord::daemon::NodeGroupState;  // content_cache.h
  struct Contribution {
    NodeState* node;
    // Kept alive by `group`'s cache or retained contents until the step is
    // decided (see ContentCache); Owner() finds the owning pointer.
    const Content* content;
    NodeGroupState* group;
    std::shared_ptr<const Content> Owner() const;
  };
  struct PendingStep {
    PendingStep(absl::Time first_seen, absl::Duration deadline) : clock(first_seen, deadline) {}
    StepDeadline clock;  // deadline_tracker.h
    int ranks_covered = 0;
    bool all_repeat = true;
    uint64_t combined_key = 0;  // sum of MixKey(content key) over contributions
    std::vector<Contribution> contributions;
  };
  struct GroupState {
    GroupState(int world_size, const std::string& job_id, const std::string& group_id)
        : group_id(group_id), registration(world_size, job_id, group_id) {}
    std::string group_id;
    GroupRegistration registration;  // group_agreement.h
    // While the registration collects: `deadline` after its first
    // registration, when it fails naming the ranks that did not register.
    absl::Time registration_due = absl::InfiniteFuture();
    int64_t last_decided_step = -1;
    // Full form (ok body or error) of the last decided step; its step and
    // wait_us are those of the step that computed it (a same_as_previous
    // step reuses it: the step is last_decided_step, the wait below).
    std::shared_ptr<const v1::Decision> last_decision;
    int64_t last_decision_wait_us = 0;
    bool last_ok = false;
    uint64_t last_combined_key = 0;
    std::map<int64_t, PendingStep> pending;
    // Observe API and metrics.
    int64_t decisions = 0;
    int64_t cache_hits = 0;
    int64_t cache_misses = 0;
    bool have_last_ok = false;  // the fields below describe an ok decision
    DType last_wire = DType::kFloat32;
    std::vector<bool> last_included;
    int last_num_skipped = 0;
    int64_t last_zero_fills = 0;
    UsageWindow usage;
    std::unique_ptr<GroupObserver> observer;
    // Repeat waves that decided this group (NodeGroupState::waves_counted).
    int64_t waves = 0;
    // A step of this group completed and waits in ready_ for its decision.
    bool ready = false;
    // The batch (HandleEntriesLocked) that last named this group.
    uint64_t batch_stamp = 0;
  };
  // Batch repeats of one step held back as a wave (docs/ARCHITECTURE.md,
  // "Repeat waves"): nothing per group happens until every node is in.
  struct RepeatWave {
    int64_t step = -1;
    absl::Time first_seen;
    absl::Time wake;                  // the stall or deadline check a pending step would have
    std::vector<SessionId> sessions;  // arrival order
  };
  struct Job {
    explicit Job(int world_size) : world_size(world_size), members(world_size) {}
    std::string job_id;
    std::string run_id;
    const int world_size;
    Membership members;
    absl::node_hash_map<std::string, GroupState> groups;
    // kRunning --Fail--> kFailed; a job is dropped (not a state) when its
    // run ends. A failed job answers every request with its failure.
    JobState state = JobState::kRunning;
    v1::DecisionError failure;  // set in kFailed
    std::unique_ptr<JobObserver> observer;
    // Repeat waves. wave_base >= 0: at that step every connected node (all of
    // the job's nodes, wave_members sessions) contributed its whole batch
    // record, the records name the same groups, each of them was decided ok
    // with nothing pending, and nothing but wave joins happened since.
    int64_t wave_base = -1;
    int wave_members = 0;
    RepeatWave wave;
    // Sessions whose whole batch was added at sync_step (NoteSyncedLocked);
    // sync_groups: their records' GroupsKey, sync_ok: all the same so far.
    int64_t sync_step = -1;
    int sync_sessions = 0;
    uint64_t sync_groups = 0;
    bool sync_ok = false;
    // Contents its nodes' caches retain (ContentCache::retained()), so a
    // wave prunes them only when there are any.
    int64_t retained = 0;
    bool failed() const { return state == JobState::kFailed; }
    void Fail(const v1::DecisionError& error) {
      state = JobState::kFailed;
      failure = error;
    }
  };

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
  // One manifest of a session's previous batch, resolved once.
  struct BatchEntry {
    std::string group_id;
    uint64_t cache_key = 0;
    GroupState* group = nullptr;  // nullptr: unknown when recorded
    NodeGroupState* node_group = nullptr;
  };
  // What a batch repeat on this stream stands for.
  struct BatchRecord {
    std::vector<BatchEntry> entries;
    // wire::BatchKeyHasher over entries, taken when the batch is recorded
    // (0: no batch yet).
    uint64_t key = 0;
    // A hash of the entries' resolved groups, in order (0: not computed).
    uint64_t groups_key = 0;
    uint64_t GroupsKey();
  };
  struct Session {
    NodeSink* sink = nullptr;
    Job* job = nullptr;
    NodeState* node = nullptr;
    BatchRecord last_batch;
    // The last step this session's whole batch was added to (-1: none).
    int64_t synced_step = -1;
    // The step of the wave it joined (-1: none).
    int64_t wave_step = -1;
  };
  // A full-form manifest's dtypes decoded before mu_ was taken, on the
  // thread that read the message (DecodeBeforeLock, content_cache.h).
  using Predecoded = PredecodedContent;
  // A manifest's fields as the hot path needs them: a proto manifest or one
  // entry of a batch repeat. `full` is set for full-form manifests only.
  struct ManifestRef {
    absl::string_view group_id;
    int64_t step = 0;
    bool repeat = false;
    uint64_t cache_key = 0;
    const v1::Manifest* full = nullptr;
    Predecoded* predecoded = nullptr;  // full form: what was decoded before the lock
  };
  // Decodes the full-form manifests of a batch without the lock (one entry
  // per manifest, in order; empty for any other message).
  static std::vector<Predecoded> DecodeBeforeLock(const v1::NodeMessage& message);
  // Messages produced while handling one event, sent at its end.
  struct Outbox {
    absl::flat_hash_map<Job*, v1::CoordinatorMessage> broadcast_decisions;
    std::vector<std::pair<Job*, v1::CoordinatorMessage>> broadcast_other;
    std::vector<std::pair<NodeSink*, v1::CoordinatorMessage>> direct;
    v1::DecisionBatch* ReplyBatch(NodeSink* sink);
  };

  // HandleMessage and CloseSession without the event delivery that follows.
  void HandleMessageWithoutDelivery(SessionId id, const v1::NodeMessage& message,
                                    std::vector<Predecoded>* predecoded = nullptr)
      ABSL_LOCKS_EXCLUDED(mu_);
  void CloseSessionWithoutDelivery(SessionId id) ABSL_LOCKS_EXCLUDED(mu_);
  void CheckDeadlinesWithoutDelivery() ABSL_LOCKS_EXCLUDED(mu_);
  void HandleHelloLocked(SessionId id, Session& s, const v1::NodeHello& hello, Outbox& out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // HandleHelloLocked's steps: the hello's own checks (sorted, checked ranks
  // into `ranks`), the job (created on first sight), the job's checks
  // (world size, ranks held elsewhere), and the node's placement + Welcome.
  absl::Status ValidateHello(const Session& s, const v1::NodeHello& hello,
                             std::vector<int>& ranks) const;
  absl::StatusOr<Job*> FindOrCreateJobLocked(const v1::NodeHello& hello, const std::string& run_id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status CheckJoinLocked(const Job& job, const v1::NodeHello& hello,
                               const std::vector<int>& ranks) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void PlaceNodeLocked(SessionId id, Session& s, Job& job, const v1::NodeHello& hello,
                       const std::vector<int>& ranks, Outbox& out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void HandleRegistrationLocked(Session& s, const v1::NodeRegistration& reg, Outbox& out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // HandleRegistrationLocked's steps: the registering ranks (served by the
  // node, at least one) and the size limit; the group (created on first
  // sight, up to --max_groups_per_job); the registration itself and its reply.
  absl::StatusOr<std::vector<int>> CheckRegistration(const Job& job, const NodeState& node,
                                                     const v1::NodeRegistration& nr,
                                                     const GroupSpec& spec) const;
  absl::StatusOr<GroupState*> FindOrCreateGroupLocked(Job& job, const std::string& group_id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RegisterLocked(Session& s, GroupState& g, const GroupSpec& spec, const Policy& policy,
                      const std::vector<int>& ranks, Outbox& out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void HandleManifestsLocked(Session& s, const v1::ManifestBatch& batch,
                             std::vector<Predecoded>* predecoded, Outbox& out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A batch repeat: every entry of the session's previous batch at a new step.
  void HandleBatchRepeatLocked(Session& s, const v1::ManifestBatch& batch, Outbox& out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A manifest of a batch with its resolved group states (nullptr: unknown).
  struct EntryRef {
    ManifestRef m;
    GroupState* g;
    NodeGroupState* ng;
  };
  // Handles a batch's manifests in order, as HandleManifestLocked would one
  // by one, and decides the steps they complete; returns whether every one
  // was added to its step. With more than one decide thread, a batch of at
  // least parallel_min_entries manifests naming distinct groups runs their
  // HandleEntry parts side by side (docs/ARCHITECTURE.md, "More than one
  // core").
  bool HandleEntriesLocked(Session& s, std::vector<EntryRef>& refs, Outbox& out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Resolves a batch entry's group pointers when it has none (the group was
  // unknown when recorded, or the entry is new).
  void ResolveEntryLocked(Session& s, BatchEntry& e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The entries of the session's batch record at `step`, one by one.
  void RepeatBatchLocked(Session& s, int64_t step, Outbox& out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // `g`/`ng` are the resolved group states (nullptr: unknown group). Returns
  // whether the manifest was added to its step.
  bool HandleManifestLocked(Session& s, const ManifestRef& m, GroupState* g, NodeGroupState* ng,
                            Outbox& out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Repeat waves (docs/ARCHITECTURE.md, "Repeat waves"). TryJoinWaveLocked
  // holds back a batch repeat that may join the job's wave (returns false,
  // changing nothing, when it may not); the last node in decides every
  // group of the records as same_as_previous (CompleteWaveLocked).
  bool TryJoinWaveLocked(SessionId id, Session& s, const v1::ManifestBatch& batch, Outbox& out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void CompleteWaveLocked(Job& job, Outbox& out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Any other event of the job: the held-back repeats are handled entry by
  // entry, as if they had been on arrival (their steps' clocks start at the
  // wave's first arrival), and the job leaves wave mode until it syncs again.
  void BreakWaveLocked(Job& job, Outbox& out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // After a batch handled entry by entry: `all_added` when every entry was
  // added to `step`. Puts the job in wave mode when every node did so.
  void NoteSyncedLocked(Session& s, int64_t step, bool all_added)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Folds the repeat waves the node went through into its skip accounting.
  static void CountWaveSkips(const GroupState& g, NodeGroupState& ng);
  // HandleManifestLocked's steps (docs/ARCHITECTURE.md, "More than one
  // core"). A manifest that needs no content (failed job, unknown or failed
  // group, negative or decided step; AnswersWithoutContent) is answered by
  // AnswerWithoutContentLocked. Any other is handled in two parts:
  // HandleEntry changes only its group's state (GroupState, the node's
  // NodeGroupState, their pending step) and writes everything else it would
  // change into an EntryResult, which ApplyEntryLocked applies (counters,
  // timer, error reply, the node's last step, the decision). Manifests of
  // one batch for distinct groups may therefore run HandleEntry side by
  // side on the worker pool, while the handling thread holds mu_ and waits;
  // the results are applied in the batch's order.
  enum class Added { kAdded, kResent, kRefused };
  struct EntryResult {
    bool answer = false;  // answered without content; nothing else was done
    int64_t cache_hits = 0;
    int64_t cache_misses = 0;
    int64_t key_mismatches = 0;
    int64_t retained = 0;  // change of the retained contents' count
    absl::Time wake = absl::InfiniteFuture();
    Added added = Added::kRefused;
    v1::DecisionError error;  // kRefused
    bool complete = false;    // its step now has every rank
  };
  static bool AnswersWithoutContent(const Job& job, const GroupState* g, const NodeGroupState* ng,
                                    int64_t step);
  void AnswerWithoutContentLocked(Session& s, const ManifestRef& m, GroupState* g,
                                  NodeGroupState* ng, Outbox& out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Runs with mu_ held by the handling thread (on it or on the pool); reads
  // `job` and `node` and writes neither. A new pending step starts at `now`.
  void HandleEntry(const Job& job, NodeState& node, GroupState& g, NodeGroupState& ng,
                   const ManifestRef& m, absl::Time now, EntryResult& r) const;
  // Returns whether the manifest was added to its step.
  bool ApplyEntryLocked(Session& s, const ManifestRef& m, GroupState* g, NodeGroupState* ng,
                        EntryResult& r, Outbox& out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Forgets the node's contributions to steps decided since, and the
  // retained contents only those named.
  void PruneContributionsLocked(Job& job, const GroupState& g, NodeGroupState& ng)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // HandleEntry's steps. The manifest's content: the node's cached one for a
  // repeat, else the parsed full form, which becomes the cache. nullptr with
  // r.error set when it cannot be resolved (resend_full_form for an unknown
  // repeat).
  static const Content* ResolveContent(const Job& job, const NodeState& node, GroupState& g,
                                       NodeGroupState& ng, const ManifestRef& m, EntryResult& r);
  // The pending step, started at `now` when new (r.wake: when the timer must
  // look at it); nullptr (LIMIT_EXCEEDED in r.error) past --max_pending_steps.
  PendingStep* PendingStepFor(const Job& job, GroupState& g, const ManifestRef& m, absl::Time now,
                              EntryResult& r) const;
  // Adds the node's content to the step: kResent for an identical resend
  // (no-op), kRefused (`error` set) for a different one about the same ranks.
  static Added AddContribution(const Job& job, NodeState& node, NodeGroupState& ng,
                               const ManifestRef& m, const Content* content, PendingStep& p,
                               v1::DecisionError& error);
  // The one reply path for errors sent to one node: each counts the error
  // (stats, observer event; NoteErrorLocked) and queues it in the shape the
  // node expects (a session error, a registration result, a decision). A
  // failure already counted (the job's or the group's) is resent as is.
  void SendErrorLocked(NodeSink* sink, v1::DecisionError error, Outbox& out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void SendRegistrationErrorLocked(NodeSink* sink, const std::string& group_id,
                                   v1::DecisionError error, Outbox& out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void SendDecisionErrorLocked(NodeSink* sink, absl::string_view group_id, int64_t step,
                               v1::DecisionError error, Outbox& out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void HandleRankEventLocked(Session& s, const v1::RankEvent& e, Outbox& out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Sends every node of the job the group's completed registration: its
  // fingerprint, or the mismatch (which also fails the group's pending steps).
  void BroadcastRegistrationLocked(Job& job, GroupState& g, Outbox& out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Decides a complete step. `computed`: its core decision when it was
  // computed already (DecideReadyLocked), else nullptr.
  void DecideStepLocked(Job& job, GroupState& g, int64_t step, PendingStep& p,
                        absl::StatusOr<Decision>* computed, Outbox& out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether a complete step is decided same_as_previous (no core Decide).
  static bool SameAsPrevious(const GroupState& g, const PendingStep& p);
  // The core Decide on the OR-merge of the step's contributions. Reads only
  // the step's contents and the group's agreed registration, which nothing
  // changes while it runs, so steps of different groups may run at once.
  static absl::StatusOr<Decision> ComputeDecision(const RegVariant& agreed, int world_size,
                                                  int64_t step, const PendingStep& p);
  // Steps a batch completed are collected (collect_ready_) and decided at
  // its end, or before another manifest of the same group is handled: their
  // core Decides side by side on pool_, then every decision in the order the
  // steps completed, as the one-by-one path would (docs/ARCHITECTURE.md,
  // "More than one core").
  void DecideReadyLocked(Job& job, Outbox& out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Fails the job with `error`: the culprit's (group, step) gets it as is
  // (culprit_step -1: the culprit group's registration), every other pending
  // step and every registration still collecting gets it as JOB_FAILED.
  void FailJobLocked(Job& job, GroupState* culprit, int64_t culprit_step, v1::DecisionError error,
                     Outbox& out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A group's registration past its deadline: MISSING_RANKS naming the
  // ranks that did not register it (each with its node and whether it is
  // connected) and those that did; fails the job with it.
  void FailRegistrationAtDeadlineLocked(Job& job, GroupState& g, Outbox& out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // What the coordinator knows of one group's ranks at one of its pending
  // steps, each fact about that group only (docs/ARCHITECTURE.md, "Silent
  // ranks"): who submitted the step, the last step of the group each rank is
  // known to have submitted, and which ranks that did not submit are at
  // fault. Built on the error and stall paths only (O(pending steps x nodes)).
  class StepFacts {
   public:
    StepFacts(const Job& job, const GroupState& g, const PendingStep& at);
    // A node manifest for the step covers `rank`, or its sidecar said it
    // submitted the step.
    bool Submitted(int rank) const { return submitted_.Contains(rank); }
    // The last step of the group `rank` submitted, as far as known: every
    // decided step, a later pending step that covers it, its sidecar's
    // answer for this group (-1: none).
    int64_t LastStep(int rank) const;
    // The ranks that did not submit the step (ascending), split into those
    // at fault (`named`) and the rest (`waiting`): when any of them is gone
    // (left, its node's stream down, or never served), only the gone ones
    // are named, since the others are alive and may only be slower, e.g.
    // blocked in a collective with a gone rank; otherwise all are named.
    struct Missing {
      std::vector<int> named;
      std::vector<int> waiting;
    };
    Missing AtFault() const;

   private:
    const Job& job_;
    const PendingStep& at_;
    int64_t last_decided_;
    RankSet submitted_;
    // Later pending steps, newest first, with the ranks that submitted each.
    std::vector<std::pair<int64_t, RankSet>> later_;
  };
  // MISSING_RANKS for `step` of `g`, which cannot complete because of `why`:
  // names the ranks at fault (StepFacts::AtFault) with the group's last
  // step and node of each, the ranks that submitted, and the connected
  // ranks not heard from yet (not named).
  v1::DecisionError MissingRanksErrorLocked(const Job& job, const GroupState& g, int64_t step,
                                            const PendingStep& p, absl::string_view why)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // At a step's deadline: asks the nodes whose ranks are missing (and that
  // answer progress queries) which of their ranks submitted. Returns whether
  // any was asked (then the step fails when they answer or after a grace).
  bool AskProgressLocked(Job& job, GroupState& g, int64_t step, PendingStep& p, absl::Time now,
                         Outbox& out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // One pending step at a deadline check: reports a stall or asks progress
  // as its StepDeadline says, or returns true when the step fails now
  // (FailStepAtDeadlineLocked); lowers `next`.
  bool CheckStepLocked(Job& job, GroupState& g, int64_t step, PendingStep& p, absl::Time now,
                       absl::Time& next, Outbox& out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Fails the job with MISSING_RANKS for a step past its deadline.
  void FailStepAtDeadlineLocked(Job& job, GroupState& g, int64_t step, PendingStep& p,
                                absl::Time now, Outbox& out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void HandleProgressLocked(Session& s, const v1::NodeProgress& progress)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A sidecar's own report (NodeProgress.partial) of a step some of its ranks
  // submitted and others did not: starts the step's deadline clock at the
  // node's first submission when no node manifest for it arrived yet.
  void HandlePartialProgressLocked(Session& s, const v1::NodeProgress& progress)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Keeps what `node` says about its own ranks (submitted, last steps).
  static void RecordProgressLocked(const Job& job, const NodeState& node,
                                   const v1::NodeProgress& progress, PendingStep& p);
  // Creates the pending (group, step) whose clock started at `first_seen`
  // and wakes the timer if its deadline is the earliest.
  std::map<int64_t, PendingStep>::iterator StartStepLocked(Job& job, GroupState& g, int64_t step,
                                                           absl::Time first_seen)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The same without the timer: returns when the timer must wake for it.
  std::pair<std::map<int64_t, PendingStep>::iterator, absl::Time> StartStep(
      const Job& job, GroupState& g, int64_t step, absl::Time first_seen) const;
  void FlushLocked(Outbox& out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RemoveJobLocked(Job* job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Wakes the timer at `at` if that is earlier than its next wake.
  void WakeTimerAtLocked(absl::Time at) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // At a deadline check: fails the job when a pending step needs ranks of a
  // node disconnected for longer than node_reconnect_grace (returns whether
  // it did); otherwise lowers `next` to when one would be due.
  bool FailIfNodeLostLocked(Job& job, absl::Time now, absl::Time& next, Outbox& out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Runs. JoinRunLocked places a node (NodeHello, or a key-value request it
  // forwarded) in the job's run according to `start` (see accord.proto,
  // NodeHello.run_start), superseding the current run when the node's ranks
  // were restarted; a RUN_ENDED error for a node of an ended run.
  absl::StatusOr<Run*> JoinRunLocked(const std::string& job_id, v1::NodeHello::RunStart start,
                                     const std::string& run_id, const std::string& node_id,
                                     uint64_t node_epoch, Outbox& out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  Run& StartRunLocked(const std::string& job_id, std::string run_id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ends the job's run: every connected node of it gets `error` (when set)
  // and loses its job, the job's state is dropped, the run's end is queued
  // for on_run_ended.
  void EndRunLocked(const std::string& job_id, const absl::Status& why,
                    const v1::DecisionError* error, Outbox& out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ends runs that never got a node within run_start_timeout; returns the
  // next time one is due.
  absl::Time ExpireStartingRunsLocked(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void DeliverRunEnds() ABSL_LOCKS_EXCLUDED(mu_);
  void TimerLoop();

  // Observe hooks (observe_views.cc). NoteErrorLocked counts an error sent to a
  // node and queues its event; ObserveDecisionLocked updates the group's counters,
  // usage window and metrics for a decision just made (`decided`: the core
  // decision when one was computed, nullptr for same_as_previous or errors)
  // and takes the step's contents; RetireJobLocked keeps a leaving job's observe
  // view; DeliverEvents hands queued events to the observer.
  void NoteErrorLocked(const v1::DecisionError& error) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void QueueEventLocked(ObserveEvent event) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  UsageWindow::Limits UsageLimits() const;
  using StepContents = absl::FunctionRef<std::vector<std::shared_ptr<const Content>>()>;
  void ObserveDecisionLocked(Job& job, GroupState& g, int64_t step, PendingStep& p,
                             const v1::Decision& d, const Decision* decided)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The same for a decision without a pending step (a repeat wave);
  // `contents` gives the step's contents when the usage window needs them.
  void ObserveDecisionLocked(Job& job, GroupState& g, int64_t step, const PendingStep* p,
                             const v1::Decision& d, const Decision* decided, StepContents contents)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // ObserveDecisionLocked's parts: a computed decision's counters and
  // decision-changed event; the usage window (and the global byte cap).
  void NoteDecidedLocked(const Job& job, GroupState& g, int64_t step, const PendingStep& p,
                         const Decision& decided) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RecordUsageLocked(GroupState& g, int64_t step, bool same, StepContents contents)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  static int64_t ZeroFills(const PendingStep& p, const Decision& decided);
  void ObserveNodeLocked(const Job& job, const NodeState& node, bool connected)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ObserveDeadlineFailureLocked(const Job& job, const GroupState& g, int64_t step,
                                    const PendingStep& p, const v1::DecisionError& error,
                                    absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ObserveStallLocked(const Job& job, const GroupState& g, int64_t step, const PendingStep& p,
                          absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RetireJobLocked(Job& job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops the oldest retired job (its usage windows).
  void PopRetiredLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The status view of a job: copied under the lock (StatusSnapshotLocked),
  // built into the proto outside it (JobStatusOf; observe_views.cc).
  struct StatusSnapshot {
    struct Node {
      std::string node_id;
      bool connected = false;
      std::vector<int> ranks;
    };
    struct Group {
      std::string group_id;
      int num_params = -1;  // -1: not registered
      int64_t last_decided_step = -1;
      int64_t decisions = 0;
      int64_t cache_hits = 0;
      int64_t cache_misses = 0;
      bool have_last_ok = false;
      DType last_wire = DType::kFloat32;
      int last_num_skipped = 0;
      bool failed = false;
      std::string error;
    };
    std::string job_id;
    int world_size = 0;
    std::vector<Node> nodes;      // by node id
    std::vector<int> rank_owner;  // per rank: index into nodes, -1: none
    std::vector<bool> rank_connected;
    std::vector<int64_t> rank_last_step;
    std::vector<Group> groups;  // by group id
    bool failed = false;
    std::string error;
  };
  StatusSnapshot StatusSnapshotLocked(const Job& job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  static StatusSnapshot::Group GroupStatusOf(const GroupState& g);
  static v1::JobStatus JobStatusOf(const StatusSnapshot& snapshot);
  // What ObserveStalls copies of one job under the lock (observe_views.cc).
  struct StallsSnapshot;
  StallsSnapshot StallsSnapshotLocked(const Job& job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void DeliverEvents() ABSL_LOCKS_EXCLUDED(mu_);

  const CoordinatorOptions options_;
  Clock* const clock_;

  accord::Mutex mu_;
  accord::CondVar timer_cv_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  absl::Time next_deadline_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();
  // While BreakWaveLocked hands held-back repeats to the entry-by-entry path:
  // the wave's first arrival, the start of the steps it creates.
  std::optional<absl::Time> wave_first_seen_ ABSL_GUARDED_BY(mu_);
  SessionId next_session_ ABSL_GUARDED_BY(mu_) = 1;
  absl::flat_hash_map<SessionId, Session> sessions_ ABSL_GUARDED_BY(mu_);
  absl::node_hash_map<std::string, Job> jobs_ ABSL_GUARDED_BY(mu_);
  RunRegistry runs_ ABSL_GUARDED_BY(mu_);
  CoordinatorStats stats_ ABSL_GUARDED_BY(mu_);
  std::vector<ObserveEvent> events_ ABSL_GUARDED_BY(mu_);
  std::atomic<bool> have_events_{false};                 // events_ is not empty (read without mu_)
  std::deque<RetiredJob> retired_ ABSL_GUARDED_BY(mu_);  // oldest first
  // Held while delivering events so they reach the observer in order; taken
  // before mu_.
  accord::Mutex deliver_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  // Complete steps waiting for DecideReadyLocked (one group at most once).
  struct ReadyStep {
    GroupState* group;
    int64_t step;
  };
  bool collect_ready_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<ReadyStep> ready_ ABSL_GUARDED_BY(mu_);
  uint64_t batch_stamp_ ABSL_GUARDED_BY(mu_) = 0;
  // HandleEntriesLocked's scratch, kept to save allocations.
  std::vector<EntryRef> entry_refs_ ABSL_GUARDED_BY(mu_);
  std::vector<EntryResult> entry_results_ ABSL_GUARDED_BY(mu_);
  // Parallel decides; used only with mu_ held.
  std::unique_ptr<WorkerPool> pool_;
  std::thread timer_;
};

}  // namespace accord::daemon

#endif  // ACCORD_DAEMON_COORDINATOR_COORDINATOR_H_
