// The sidecar's logic for one job: serves the job's local ranks and speaks
// for them to the coordinator on the job's own upstream stream. A sidecar
// process serves several jobs at once, one Sidecar each (SidecarJobs,
// sidecar_jobs.h, routes each rank by its RankHello).
//
// Protocol (see accord.proto):
//  - Rank hello: the job must match (--job, or the job of the ranks already
//    here), the token must match (options.token, or the first rank's), the
//    rank must be in range, the world size consistent and the rank
//    not already connected (DUPLICATE_RANK). A refused rank gets an error and
//    only its own stream is closed.
//  - Registrations are validated and forwarded as NodeRegistration with the
//    registering rank; the coordinator compares across all ranks (so two local
//    ranks registering different specs are reported exactly as the
//    coordinator reports any mismatch) and the results fan out to the ranks.
//  - Manifests are validated per rank (errors go to that rank only), merged per
//    (group, step) with core Merge, and once every connected rank that
//    registered the group has reported, ONE node manifest goes upstream: in
//    repeat form (cache key only) when identical to the previous one sent for
//    the group. Everything completed by one incoming message travels in one
//    upstream ManifestBatch. When that batch is the previous batch sent on the
//    stream again (same groups, same keys, all in repeat form, one step) and
//    the coordinator's Welcome said batch_repeat, only a batch repeat record
//    (repeat_step + repeat_batch_key) goes upstream.
//  - Partial steps: a (group, step) that some local ranks submitted and
//    others did not for half the coordinator's deadline (Welcome.deadline_ms)
//    is reported upstream once per stream (NodeProgress.partial), so the
//    coordinator's deadline runs even when no node manifest for it ever
//    leaves a node. A timer thread does this; complete steps cost nothing.
//  - Decisions fan out to the ranks. `same_as_previous` is passed through only
//    to a rank that received the previous decision of the group; others get
//    the full body.
//  - Upstream loss: on reconnect OnUpstreamConnected() resends the hello, the
//    registrations and every manifest still without a decision, in full form.
//  - A rank whose stream ends is reported upstream (RankEvent) at once.
//  - Resume (docs/RELIABILITY.md, "Sidecar restart"): a rank whose stream
//    ended reconnects with RankHello.resume (its run and, per group, the
//    last step it holds a decision for) and resends its registrations and
//    undecided manifests. A Sidecar whose job state a resuming rank created
//    (the sidecar process was restarted) RESUMEs that run upstream; a step
//    does not wait for a rank that holds its decision; a resent manifest of
//    the group's last decided step is answered with that decision; a
//    manifest for a step whose node manifest already went up goes up alone
//    for its rank (a disjoint contribution). A rank that holds a local
//    decision cannot resume on a restarted sidecar: the job fails on the
//    node with one error.
//
// One job at a time: when its last rank leaves the state is reset and (with
// SidecarOptions::reset_when_empty) the upstream stream restarted. Under
// SidecarJobs a Sidecar serves one launch of one job and is then retired.
//
// Thread-safe. Sinks are called with the lock held and must not block or call
// back into the Sidecar.
#ifndef ACCORD_DAEMON_SIDECAR_SIDECAR_H_
#define ACCORD_DAEMON_SIDECAR_SIDECAR_H_

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/node_hash_map.h"
#include "absl/status/status.h"
#include "accord/v1/accord.pb.h"
#include "core/decide.h"
#include "core/group.h"
#include "core/manifest.h"
#include "core/sync.h"
#include "daemon/common/clock.h"
#include "daemon/common/due_timer.h"
#include "daemon/common/upstream.h"
#include "daemon/common/upstream_health.h"
#include "daemon/common/upstream_loss.h"
#include "daemon/common/upstream_node.h"
#include "daemon/sidecar/local_group.h"
#include "proto/wire.h"

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

struct SidecarOptions {
  std::string node_id;
  std::string job;  // empty: accept the first job that arrives
  int max_ranks = 64;
  // The job's token (--token_file / ACCORD_TOKEN), sent in NodeHello. A rank
  // whose RankHello carries a different non-empty token is refused
  // (PERMISSION_DENIED). Empty: the first accepted rank's token is sent
  // upstream and later ranks must carry the same one.
  std::string token;
  // Refuse ranks whose RankHello carries no token (--require_rank_token).
  bool require_rank_token = false;
  // Time for partial-step reports (not owned; null: the real clock).
  Clock* clock = nullptr;
  // Tests that drive CheckPartialSteps() by hand may turn the thread off.
  bool start_timer_thread = true;
  // Single-node jobs: when every rank of the job is connected here, the
  // sidecar decides each complete step itself and answers its ranks at once;
  // the node manifest still goes to the coordinator, whose decision must
  // match (docs/ARCHITECTURE.md, "Local decisions"). --local_decisions.
  bool local_decisions = true;
  // At most this many locally decided steps per group may wait for the
  // coordinator's confirming decision; past it ranks wait for the
  // coordinator as usual. --local_decision_lag.
  int local_decision_lag = 4;
  // When the last rank leaves, restart the upstream stream for the next job.
  // SidecarJobs turns it off: it retires the Sidecar (and its stream).
  bool reset_when_empty = true;
  // A rank whose stream ends and whose hello said it reconnects
  // (RankHello.reconnects) keeps its place this long before its leave goes
  // upstream: a dropped stream is then survived, and a rank killed is named
  // this much later. Zero: every stream end is a leave at once.
  // --rank_reconnect_grace.
  absl::Duration rank_reconnect_grace = absl::ZeroDuration();
  // While this node serves a job, the node above (the coordinator, or a
  // relay) may go unanswered this long (no stream of it welcomed): past it
  // every rank of the job here gets one UNAVAILABLE error and its stream
  // closes, instead of waiting for its client's own timeout. Zero: wait for
  // ever. --upstream_loss_limit (docs/RELIABILITY.md, "Node above lost").
  absl::Duration upstream_loss_limit = absl::Seconds(60);
  // The process's view of whether the node above answers, which this node
  // keeps up to date (stream attempts, Welcomes) for the key-value
  // forwarder. Not owned; null: none.
  UpstreamHealth* upstream_health = nullptr;
};

struct SidecarStats {
  int64_t rank_manifests = 0;
  int64_t node_manifests_full = 0;
  int64_t node_manifests_repeat = 0;
  int64_t node_batch_repeats = 0;  // batches sent as one batch repeat record
  int64_t decisions_in = 0;
  int64_t local_decisions = 0;   // decided here (single-node job), see SidecarOptions
  int64_t local_confirmed = 0;   // ... and later confirmed by the coordinator
  int64_t local_mismatches = 0;  // ... where the coordinator decided otherwise (job failed)
  // What the ranks' framework adapter reported (RankMessage.adapter_counts),
  // summed over this node's ranks and their processes.
  int64_t adapter_speculated = 0;
  int64_t adapter_repaired = 0;
  int64_t adapter_redone = 0;
  int ranks = 0;
  int sessions = 0;    // open rank streams (accepted or not yet)
  std::string job_id;  // the job served now, else the last one ("" before the first)
};

class Sidecar final : public UpstreamHandler, public RankSessionHandler {
 public:
  static constexpr char kServerVersion[] = "accord-sidecar/0.1";
  // The checks of a RankHello that need no state (job id, --job, world
  // size, rank range, the configured token): the error to refuse it with, or
  // nullopt. SidecarJobs runs them before it gives the rank a job's Sidecar.
  static std::optional<v1::DecisionError> CheckHello(const SidecarOptions& options,
                                                     const v1::RankHello& hello);

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
  struct RankState {
    SessionId session = 0;
    RankSink* sink = nullptr;
    int64_t last_step = -1;  // over all groups (RankEvent.last_step)
    // Indexed by LocalGroup::index: the step of the last decision delivered
    // to this rank (-1: none) ...
    std::vector<int64_t> delivered;
    // ... and the last step it submitted of each group (-1: none), what
    // progress answers and partial reports say of it: the coordinator names
    // a missing rank with its last step of the step's own group.
    std::vector<int64_t> submitted;
    int64_t SubmittedOf(int group_index) const {
      return static_cast<size_t>(group_index) < submitted.size() ? submitted[group_index] : -1;
    }
    // The entries of group `group_index` in `delivered` and `submitted`,
    // which grow to `num_groups` (LocalGroups::size) when they are shorter.
    int64_t& DeliveredSlot(int group_index, size_t num_groups) {
      if (delivered.size() <= static_cast<size_t>(group_index)) delivered.resize(num_groups, -1);
      return delivered[group_index];
    }
    int64_t& SubmittedSlot(int group_index, size_t num_groups) {
      if (submitted.size() <= static_cast<size_t>(group_index)) submitted.resize(num_groups, -1);
      return submitted[group_index];
    }
    absl::flat_hash_map<std::string, bool> got_result;
    // From RankHello.resume: per group, the last step this rank holds a
    // decision for (its manifests up to it will not come again). Empty for
    // a rank that did not resume.
    absl::flat_hash_map<std::string, int64_t> resume_decided;
    bool resumed = false;
    bool reconnects = false;  // RankHello.reconnects
    // This rank's one-rank manifest, for recomputing rank manifest keys
    // without building a world-sized rank set per manifest.
    Manifest key_scratch;
  };
  struct Session {
    RankSink* sink = nullptr;
    int rank = -1;  // -1 until a hello is accepted
  };
  // A rank whose stream ended within its reconnect grace
  // (SidecarOptions::rank_reconnect_grace): not connected, not yet gone.
  struct Detached {
    absl::Time until;
    int64_t last_step = -1;
  };
  // The rank streams and the ranks: every open session (accepted or not
  // yet) by id, the connected ranks, and the detached ones.
  struct Ranks {
    SessionId next_session = 1;
    absl::flat_hash_map<SessionId, Session> sessions;
    std::map<int, RankState> connected;
    std::map<int, Detached> detached;
    // No rank here, none coming back: the job's state may be reset.
    bool none() const { return connected.empty() && detached.empty(); }
  };
  // Resume on a restarted sidecar (docs/RELIABILITY.md, "Sidecar restart").
  struct ResumeState {
    // The job's state here was created by a resuming rank: this sidecar was
    // restarted under the run (or lost every rank's stream) and holds
    // nothing of what was decided before.
    bool fresh = false;
    // Set once a rank holding local decisions resumed on a restarted
    // sidecar: every rank of the job here gets it.
    std::optional<v1::DecisionError> refusal;
    // ContinueIncarnation's run and epoch, for the job's first rank.
    std::string continued_run;
    uint64_t continued_epoch = 0;
  };
  // A rank's manifest for a step already sent upstream (SendLateLocked).
  struct Late {
    LocalGroup* group;
    int64_t step;
    int rank;
    std::vector<DTypeMask> content;
  };
  // A node manifest ready to go upstream.
  struct Outgoing {
    const LocalGroup* group;
    int64_t step;
    bool repeat;
    uint64_t key;
    std::shared_ptr<const v1::Manifest> full;  // full form (step unset) when !repeat
  };
  // What one call into the Sidecar builds and sends before it returns,
  // kept across calls for its storage, and the count that tells one rank
  // batch from the next.
  struct Scratch {
    // HandleManifestsLocked: the groups one rank batch added to, each
    // noted once (StepCollection::touched_epoch is the batch's epoch).
    uint64_t touch_epoch = 0;
    std::vector<LocalGroup*> touched;
    std::vector<Outgoing> outgoing;  // collected node manifests (SendOutgoingLocked)
    v1::DecisionBatch local_batch;   // DecideLocallyLocked's output
    UsageDetail detail;              // CollectCompleteLocked's per-rank detail
  };

  // Accepts the rank of a RankHello on session `id`, or refuses it and
  // closes the session.
  void HandleHelloLocked(SessionId id, Session& s, const v1::RankHello& hello)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The error a RankHello on `s` is refused with (the first check it fails:
  // CheckHello, the job, the token, CheckResumeLocked, the world size,
  // DUPLICATE_RANK, --max_ranks), else nullopt.
  std::optional<v1::DecisionError> HelloRefusalLocked(const Session& s, const v1::RankHello& hello)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Accepts the rank of `hello` on session `id` (starting the job when it is
  // the first), welcomes it and announces it upstream.
  void AcceptRankLocked(SessionId id, Session& s, const v1::RankHello& hello)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void HandleRegistrationLocked(int rank, const v1::GroupRegistration& reg)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void HandleManifestsLocked(int rank, const v1::ManifestBatch& batch)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Adds what `counts` (rank's cumulative report) adds to its last report
  // to stats_; a count that went down is a new process: added whole.
  void HandleAdapterCountsLocked(int rank, const v1::AdapterCounts& counts)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void HandleRankManifestLocked(int rank, RankState& rs, const v1::Manifest& m, uint64_t epoch,
                                v1::RankReply& errors) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A manifest `m` of a step `g` already decided: the step's error again,
  // its decision again for a resumed rank, else STEP_REGRESSION, in `errors`.
  void AnswerDecidedStepLocked(int rank, RankState& rs, const LocalGroup& g, const v1::Manifest& m,
                               v1::RankReply& errors) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Adds `rank`'s row `content` to its step `m` of `g` (noting a late one,
  // late_); false when the step has its row already (the same: a no-op;
  // another: an error in `errors`).
  bool AddRankRowLocked(int rank, LocalGroup& g, const v1::Manifest& m,
                        const std::vector<DTypeMask>& content, v1::RankReply& errors)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The dtypes a rank's manifest `m` of `g` carries: for a repeat, its
  // previous full form's; else `m` decoded into rs.key_scratch, its key in
  // `full_key`. Null, with the error for the rank in `refused`, when neither.
  const std::vector<DTypeMask>* RankContentLocked(int rank, RankState& rs, const LocalGroup& g,
                                                  const v1::Manifest& m, uint64_t* full_key,
                                                  v1::DecisionError* refused)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Answers the coordinator's question about a (group, step) past its
  // deadline: which local ranks submitted it, and each one's last step.
  void AnswerProgressLocked(const v1::ProgressQuery& query) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Appends every complete local step of `g` to `out` (sidecar.cc).
  void CollectCompleteLocked(LocalGroup& g, std::vector<Outgoing>* out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Sends collected node manifests as one batch, or as a batch repeat when
  // they repeat the stream's previous batch (built only when they do not);
  // clears `items`. The upstream side is in sidecar_upstream.cc.
  void SendOutgoingLocked(std::vector<Outgoing>& items) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // `take`: null, or `batch` itself, whose decisions may be moved out.
  // `local`: decisions made here (local_decisions.cc), not the coordinator's.
  void HandleDecisionsLocked(const v1::DecisionBatch& batch, v1::DecisionBatch* take,
                             bool local = false) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The coordinator said the job is failed (DecisionError.job_failed):
  // every step the ranks here submitted and no decision answered yet, of
  // every group, is answered with `verdict`, and so is every later manifest
  // (docs/RELIABILITY.md, "A failed job's verdict reaches every waiting
  // rank").
  void NoteJobFailedLocked(const v1::DecisionError& verdict) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The verdict as the answer for `step` of `g`.
  v1::Decision JobFailureAt(const LocalGroup& g, int64_t step) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A decision for the ranks, and which of them get the full body instead
  // of `same_as_previous` (they missed the group's previous decision).
  struct RoutedDecision {
    const v1::Decision* decision;
    LocalGroup* group;
    std::vector<int> expand;   // ranks that get the full body (usually none)
    v1::DecisionOk expand_ok;  // that body (the group's last ok at this decision)
  };
  // Records `d` for `g` and its ranks into `out`; whether every connected
  // rank gets it as is.
  bool RecordDecisionLocked(LocalGroup& g, const v1::Decision& d, bool local, RoutedDecision& out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Sends the routed decisions: one shared reply when `uniform` (the whole
  // `batch`, moved out of `take` when given and nothing was left out), else
  // one reply per rank.
  void DeliverDecisionsLocked(const v1::DecisionBatch& batch, v1::DecisionBatch* take,
                              const std::vector<RoutedDecision>& routed, bool uniform)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Local decisions (local_decisions.cc). Decides the complete step `st` of
  // `g` here when allowed, into scratch_.local_batch ...
  void DecideLocallyLocked(LocalGroup& g, const LocalStep& st) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // ... which this delivers to the ranks (after the steps were collected).
  void DeliverLocalDecisionsLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool LocalDecisionAllowedLocked(const LocalGroup& g) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A coordinator decision for a step decided here: compares it with the
  // local one (a difference fails the job on this node) and drops the step.
  // Returns false when `d` is not about a locally decided step.
  bool ConfirmLocalLocked(LocalGroup& g, const v1::Decision& d) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Fails the job on this node: every rank gets `e` and its stream closes.
  void FailRanksLocked(const v1::DecisionError& e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void SendToRankLocked(int rank, v1::RankReply reply) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Sends the 16-byte record "step `step` repeats the previous batch".
  void SendBatchRepeatLocked(int64_t step) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ResetJobLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The refusal of a resuming hello (run mismatch, local decisions held on a
  // restarted sidecar), else nullopt; may fail the node's ranks.
  std::optional<v1::DecisionError> CheckResumeLocked(const v1::RankHello& hello)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether `rank` (connected) holds a decision for `step` of `g` from
  // before it resumed: the step does not wait for its manifest.
  bool HoldsDecisionLocked(int rank, const LocalGroup& g, int64_t step) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Sends each manifest a rank added to a step whose node manifest had
  // already gone up, alone for its rank (late_).
  void SendLateLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Sends the leave of every detached rank whose grace ended by `now`;
  // returns when the next one ends.
  absl::Time ExpireDetachedLocked(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Partial-step reports: a step's first rank arrived; the timer is due at `at`.
  void NoteStepStartedLocked(LocalStep& st) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The timer's check: detached ranks' graces, the node above's loss limit,
  // then the partial steps due; returns when the next one is due.
  absl::Time CheckTimersLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Reports the steps due; returns when the next one is due.
  absl::Time CheckPartialStepsLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The node above answered this stream: its run, its deadline (partial
  // reports at half of it), and the loss limit's clock stopped.
  void HandleWelcomeLocked(const v1::Welcome& welcome) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The job's clock against options_.upstream_loss_limit starts now, unless
  // it counts already (UpstreamLossClock::Start); the timer is armed for it.
  void StartUnansweredLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Fails the job's ranks here once the node above has gone unanswered for
  // options_.upstream_loss_limit; returns when that will be (InfiniteFuture:
  // not counting).
  absl::Time CheckUpstreamLossLocked(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const SidecarOptions options_;
  Clock* const clock_;
  accord::Mutex mu_;
  // The stream to the node above, as this node sees it.
  struct UpstreamState {
    explicit UpstreamState(absl::Duration loss_limit) : loss(loss_limit) {}
    // Half the coordinator's deadline (Welcome.deadline_ms) on the current
    // stream; zero: partial steps are not reported.
    absl::Duration report_after = absl::ZeroDuration();
    // The current stream got its Welcome: the node above answers.
    bool welcomed = false;
    // Since when the node above has not answered while this node serves a
    // job, against SidecarOptions::upstream_loss_limit.
    UpstreamLossClock loss;
  };
  UpstreamState upstream_ ABSL_GUARDED_BY(mu_) = UpstreamState(options_.upstream_loss_limit);
  Ranks ranks_ ABSL_GUARDED_BY(mu_);
  // The node upstream: the job served now (none before the first rank and
  // after the last), its run and epoch (drawn at the job's first local
  // rank), the token (options_.token, else the first rank's), the ranks
  // announced (every rank accepted since the job started), the stream's
  // Welcome and previous batch.
  UpstreamNode node_ ABSL_GUARDED_BY(mu_);
  ResumeState resume_ ABSL_GUARDED_BY(mu_);
  std::vector<Late> late_ ABSL_GUARDED_BY(mu_);
  LocalGroups groups_ ABSL_GUARDED_BY(mu_);
  Scratch scratch_ ABSL_GUARDED_BY(mu_);
  // The counters, and the job served now, else the last one (job_id, set
  // when a job starts).
  SidecarStats stats_ ABSL_GUARDED_BY(mu_);
  // Each rank's last AdapterCounts (kept when its stream ends: a resumed
  // rank reports the same totals again).
  absl::flat_hash_map<int, v1::AdapterCounts> adapter_last_ ABSL_GUARDED_BY(mu_);
  // The job's verdict, once the coordinator failed it (NoteJobFailedLocked).
  std::optional<v1::DecisionError> job_failure_ ABSL_GUARDED_BY(mu_);
  // Partial-step reports and detached ranks' grace: due at the earliest time
  // a step not yet sent or reported becomes due or a grace ends (armed at
  // most once per due time, so the steady state signals the timer at most
  // once per upstream_.report_after). Not grouped with upstream_.report_after: the timer is
  // not ABSL_GUARDED_BY(mu_), Start and Stop take mu_ themselves. Last: its
  // thread starts once everything above is initialised.
  DueTimer timer_;
};

}  // namespace accord::daemon

#endif  // ACCORD_DAEMON_SIDECAR_SIDECAR_H_
