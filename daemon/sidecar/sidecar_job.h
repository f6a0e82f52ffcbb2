// SidecarJob: the engine of one job's sidecar, the protocol between the
// job's local ranks and the node above on the job's own upstream stream. No
// lock, no thread: the caller (Sidecar, sidecar.h) holds the lock and passes
// the time in; replies and stream ends go to the ranks' sessions through
// SidecarEffects, messages upstream through the UpstreamNode's UpstreamSink.
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
//    Groups with members (docs/MEMBERS.md 2.5): a rank outside the members
//    is refused (INVALID_REQUEST). The rank Welcome always says `members`;
//    a registration with members waits here until the node above's Welcome
//    says whether it takes them, and is refused when it does not.
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
//    leaves a node. CheckTimers does this; complete steps cost nothing.
//  - Decisions fan out to the ranks. `same_as_previous` is passed through only
//    to a rank that received the previous decision of the group; others get
//    the full body.
//  - Upstream loss: on reconnect OnUpstreamConnected() resends the hello, the
//    registrations and every manifest still without a decision, in full form.
//  - A rank whose stream ends is reported upstream (RankEvent) at once.
//  - Resume (docs/RELIABILITY.md, "Sidecar restart"): a rank whose stream
//    ended reconnects with RankHello.resume (its run and, per group, the
//    last step it holds a decision for) and resends its registrations and
//    undecided manifests. A SidecarJob whose job state a resuming rank created
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
// SidecarJobs a SidecarJob serves one launch of one job and is then retired.
//
// Not thread-safe. The effects and the UpstreamSink are called from inside
// its methods and must not call back into it.
#ifndef ACCORD_DAEMON_SIDECAR_SIDECAR_JOB_H_
#define ACCORD_DAEMON_SIDECAR_SIDECAR_JOB_H_

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/node_hash_map.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "accord/v1/accord.pb.h"
#include "core/decide.h"
#include "core/group.h"
#include "core/manifest.h"
#include "daemon/common/clock.h"
#include "daemon/common/due_timer.h"
#include "daemon/common/upstream.h"
#include "daemon/common/upstream_health.h"
#include "daemon/common/upstream_loss.h"
#include "daemon/common/upstream_node.h"
#include "daemon/sidecar/local_group.h"
#include "daemon/sidecar/release_coalescer.h"
#include "proto/wire.h"

namespace accord::daemon {

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
  // Node manifests held for their sync class now, and holds flushed by the
  // hold limit rather than by the class (docs/MEMBERS.md 2.11).
  int64_t release_held = 0;
  int64_t release_holds_expired = 0;
  int64_t decisions_in = 0;
  // Decisions of groups no local rank registered (docs/MEMBERS.md 2.5).
  int64_t decisions_ignored = 0;
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

// What a SidecarJob does outside itself, implemented by its caller (Sidecar)
// and called from inside the SidecarJob's methods; the timer's due times are
// for SidecarJob::CheckTimers.
class SidecarEffects : public DueTimerEffects {
 public:
  using SessionId = uint64_t;
  virtual ~SidecarEffects() = default;
  // Queues `reply` on rank session `session`'s stream (dropped when the
  // session is closed).
  virtual void SendToSession(SessionId session, std::shared_ptr<const v1::RankReply> reply) = 0;
  // Ends session `session`'s stream with `status` after its queued replies.
  virtual void CloseSession(SessionId session, const absl::Status& status) = 0;
};

class SidecarJob {
 public:
  using SessionId = SidecarEffects::SessionId;
  static constexpr char kServerVersion[] = "accord-sidecar/0.1";
  // The checks of a RankHello that need no state (job id, --job, world
  // size, rank range, the configured token): the error to refuse it with, or
  // nullopt.
  static std::optional<v1::DecisionError> CheckHello(const SidecarOptions& options,
                                                     const v1::RankHello& hello);

  // Neither is owned; both outlive the SidecarJob. options.clock,
  // options.start_timer_thread and options.upstream_health are the caller's.
  SidecarJob(const SidecarOptions& options, SidecarEffects& effects);
  SidecarJob(const SidecarJob&) = delete;
  SidecarJob& operator=(const SidecarJob&) = delete;

  // Must be set before any other call; not owned.
  void SetUpstream(UpstreamSink* upstream) { node_.SetSink(upstream); }

  // A rank stream opened; its messages and its end name the id returned.
  SessionId OpenSession();
  void HandleRankMessage(absl::Time now, SessionId session, const v1::RankMessage& message);
  void CloseSession(absl::Time now, SessionId session);

  // A new upstream stream is up: queues the hello and every resend.
  void OnUpstreamConnected(absl::Time now);
  // One message from upstream; the pointer form may move its contents out (a
  // decision batch that goes to every rank unchanged is forwarded as is).
  void HandleCoordinatorMessage(absl::Time now, const v1::CoordinatorMessage& message);
  void HandleCoordinatorMessage(absl::Time now, v1::CoordinatorMessage* message);

  // Detached ranks' graces, the node above's loss limit, then the partial
  // steps due by `now`; returns when the next one is due (InfiniteFuture:
  // none).
  absl::Time CheckTimers(absl::Time now);

  // Before the job's first rank: the job continues the incarnation of a
  // launch of it whose ranks have all left (run `run_id`, `node_epoch`).
  void ContinueIncarnation(std::string run_id, uint64_t node_epoch);

  // Whether `rank` was accepted since the job's state was last reset, and
  // the ranks connected now.
  bool HadRank(int rank) const { return node_.announced().count(rank) != 0; }
  std::vector<int> ConnectedRanks() const;
  SidecarStats stats() const;
  // The job, run and epoch upstream.
  const UpstreamNode& node() const { return node_; }

 private:
  struct RankState {
    SessionId session = 0;   // its stream
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
  using Outgoing = OutgoingManifest;
  // A rank's manifest for a step already sent upstream (SendLate).
  struct Late {
    LocalGroup* group;
    int64_t step;
    int rank;
    std::vector<DTypeMask> content;
  };
  // What one call builds and sends before it returns, kept across calls for
  // its storage, and the count that tells one rank batch from the next.
  struct Scratch {
    // HandleManifests: the groups one rank batch added to, each
    // noted once (StepCollection::touched_epoch is the batch's epoch).
    uint64_t touch_epoch = 0;
    std::vector<LocalGroup*> touched;
    std::vector<Outgoing> outgoing;  // collected node manifests (SendOutgoing)
    v1::DecisionBatch local_batch;   // DecideLocally's output
    UsageDetail detail;              // CollectComplete's per-rank detail
    std::vector<Late> late;          // rank manifests for steps already sent (SendLate)
  };

  // Accepts the rank of a RankHello on session `id`, or refuses it and
  // closes the session.
  void HandleHello(absl::Time now, SessionId id, Session& s, const v1::RankHello& hello);
  // The error a RankHello on `s` is refused with (the first check it fails:
  // CheckHello, the job, the token, CheckResume, the world size,
  // DUPLICATE_RANK, --max_ranks), else nullopt.
  std::optional<v1::DecisionError> HelloRefusal(const Session& s, const v1::RankHello& hello);
  // Accepts the rank of `hello` on session `id` (starting the job when it is
  // the first), welcomes it and announces it upstream.
  void AcceptRank(absl::Time now, SessionId id, Session& s, const v1::RankHello& hello);
  void HandleRegistration(int rank, const v1::GroupRegistration& reg);
  // The error `rank`'s registration `reg` is refused with (INVALID_REQUEST:
  // malformed, a rank outside its members; FAILED_PRECONDITION: members
  // the node above does not take), else nullopt with its spec in `spec`.
  std::optional<v1::DecisionError> RegistrationRefusal(int rank, const v1::GroupRegistration& reg,
                                                       GroupSpec* spec) const;
  // Replies `e` to `rank`'s registration of `group_id`.
  void RefuseRegistration(int rank, const std::string& group_id, v1::DecisionError e);
  // The node above's Welcome said whether it takes members: the
  // registrations held for it go on (or are refused).
  void ReleaseHeldRegistrations();
  void HandleManifests(absl::Time now, int rank, const v1::ManifestBatch& batch);
  // Adds what `counts` (rank's cumulative report) adds to its last report
  // to stats_; a count that went down is a new process: added whole.
  void HandleAdapterCounts(int rank, const v1::AdapterCounts& counts);
  void HandleRankManifest(absl::Time now, int rank, RankState& rs, const v1::Manifest& m,
                          uint64_t epoch, v1::RankReply& errors);
  // A manifest `m` of a step `g` already decided: the step's error again,
  // its decision again for a resumed rank, else STEP_REGRESSION, in `errors`.
  void AnswerDecidedStep(int rank, RankState& rs, const LocalGroup& g, const v1::Manifest& m,
                         v1::RankReply& errors);
  // Adds `rank`'s row `content` to its step `m` of `g` (noting a late one,
  // scratch_.late); false when the step has its row already (the same: a no-op;
  // another: an error in `errors`).
  bool AddRankRow(absl::Time now, int rank, LocalGroup& g, const v1::Manifest& m,
                  const std::vector<DTypeMask>& content, v1::RankReply& errors);
  // The dtypes a rank's manifest `m` of `g` carries: for a repeat, its
  // previous full form's; else `m` decoded into rs.key_scratch, its key in
  // `full_key`. Null, with the error for the rank in `refused`, when neither.
  const std::vector<DTypeMask>* RankContent(int rank, RankState& rs, const LocalGroup& g,
                                            const v1::Manifest& m, uint64_t* full_key,
                                            v1::DecisionError* refused);
  // Answers the coordinator's question about a (group, step) past its
  // deadline: which local ranks submitted it, and each one's last step.
  void AnswerProgress(const v1::ProgressQuery& query);
  // Appends every complete local step of `g` to `out` (sidecar_job.cc).
  void CollectComplete(absl::Time now, LocalGroup& g, std::vector<Outgoing>* out);
  // Sends the node manifests collected in scratch_.outgoing, completed by
  // `release` (Release{}: not by a rank's release batch), as the release
  // coalescer says: now, or held with their class.
  void SendCompleted(absl::Time now, const ReleaseCoalescer::Release& release);
  // Sends each of `batches` (SendOutgoing); clears it.
  void SendBatches(std::vector<ReleaseCoalescer::Batch>& batches);
  // Sends collected node manifests as one batch, or as a batch repeat when
  // they repeat the stream's previous batch (built only when they do not);
  // clears `items`. The upstream side is in sidecar_upstream.cc.
  void SendOutgoing(std::vector<Outgoing>& items);
  // `take`: null, or `batch` itself, whose decisions may be moved out.
  // `local`: decisions made here (local_decisions.cc), not the coordinator's.
  void HandleDecisions(const v1::DecisionBatch& batch, v1::DecisionBatch* take, bool local = false);
  // The coordinator said the job is failed (DecisionError.job_failed):
  // every step the ranks here submitted and no decision answered yet, of
  // every group, is answered with `verdict`, and so is every later manifest
  // (docs/RELIABILITY.md, "A failed job's verdict reaches every waiting
  // rank").
  void NoteJobFailed(const v1::DecisionError& verdict);
  // The verdict as the answer for `step` of `g`.
  v1::Decision JobFailureAt(const LocalGroup& g, int64_t step) const;
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
  bool RecordDecision(LocalGroup& g, const v1::Decision& d, bool local, RoutedDecision& out);
  // Sends the routed decisions: one shared reply when `uniform` (the whole
  // `batch`, moved out of `take` when given and nothing was left out), else
  // one reply per rank.
  void DeliverDecisions(const v1::DecisionBatch& batch, v1::DecisionBatch* take,
                        const std::vector<RoutedDecision>& routed, bool uniform);
  // Local decisions (local_decisions.cc). Decides the complete step `st` of
  // `g` here when allowed, into scratch_.local_batch ...
  void DecideLocally(absl::Time now, LocalGroup& g, const LocalStep& st);
  // ... which this delivers to the ranks (after the steps were collected).
  void DeliverLocalDecisions();
  bool LocalDecisionAllowed(const LocalGroup& g) const;
  // A coordinator decision for a step decided here: compares it with the
  // local one (a difference fails the job on this node) and drops the step.
  // Returns false when `d` is not about a locally decided step.
  bool ConfirmLocal(LocalGroup& g, const v1::Decision& d);
  // Fails the job on this node: every rank gets `e` and its stream closes.
  void FailRanks(const v1::DecisionError& e);
  void SendToRank(int rank, v1::RankReply reply);
  // A rank's Welcome: this node, the run and the node epoch.
  std::shared_ptr<const v1::RankReply> RankWelcome() const;
  // Sends `e` to session `session` and ends its stream with it.
  void SendErrorAndClose(SessionId session, const v1::DecisionError& e);
  // Sends the 16-byte record "step `step` repeats the previous batch".
  void SendBatchRepeat(int64_t step);
  void ResetJob();
  // The refusal of a resuming hello (run mismatch, local decisions held on a
  // restarted sidecar), else nullopt; may fail the node's ranks.
  std::optional<v1::DecisionError> CheckResume(const v1::RankHello& hello);
  // Whether `rank` (connected) holds a decision for `step` of `g` from
  // before it resumed: the step does not wait for its manifest.
  bool HoldsDecision(int rank, const LocalGroup& g, int64_t step) const;
  // Sends each manifest a rank added to a step whose node manifest had
  // already gone up, alone for its rank (scratch_.late).
  void SendLate();
  // Sends the leave of every detached rank whose grace ended by `now`;
  // returns when the next one ends.
  absl::Time ExpireDetached(absl::Time now);
  // Partial-step reports: a step's first rank arrived; the timer is due at `at`.
  void NoteStepStarted(absl::Time now, LocalStep& st);
  // Reports the steps due by `now`; returns when the next one is due.
  absl::Time CheckPartialSteps(absl::Time now);
  // The node above answered this stream: its run, its deadline (partial
  // reports at half of it), and the loss limit's clock stopped.
  void HandleWelcome(absl::Time now, const v1::Welcome& welcome);
  // The job's clock against options_.upstream_loss_limit starts now, unless
  // it counts already (UpstreamLossClock::Start); the timer is armed for it.
  void StartUnanswered(absl::Time now);
  // Fails the job's ranks here once the node above has gone unanswered for
  // options_.upstream_loss_limit; returns when that will be (InfiniteFuture:
  // not counting).
  absl::Time CheckUpstreamLoss(absl::Time now);

  const SidecarOptions& options_;
  SidecarEffects& effects_;
  // A rank's registration with members, held until the node above's
  // Welcome says whether it takes members (UpstreamNode::takes_members).
  struct HeldRegistration {
    int rank = -1;
    v1::GroupRegistration registration;
  };
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
    std::vector<HeldRegistration> held;
    // Release coalescing by sync_key (docs/MEMBERS.md 2.11); its hold limit
    // is report_after.
    ReleaseCoalescer releases;
  };
  UpstreamState upstream_ = UpstreamState(options_.upstream_loss_limit);
  Ranks ranks_;
  // The node upstream: the job served now (none before the first rank and
  // after the last), its run and epoch (drawn at the job's first local
  // rank), the token (options_.token, else the first rank's), the ranks
  // announced (every rank accepted since the job started), the stream's
  // Welcome and previous batch.
  UpstreamNode node_;
  ResumeState resume_;
  LocalGroups groups_;
  Scratch scratch_;
  // The counters, and the job served now, else the last one (job_id, set
  // when a job starts); release_holds_expired is the coalescer's.
  SidecarStats stats_;
  // Each rank's last AdapterCounts (kept when its stream ends: a resumed
  // rank reports the same totals again).
  absl::flat_hash_map<int, v1::AdapterCounts> adapter_last_;
  // The job's verdict, once the coordinator failed it (NoteJobFailed).
  std::optional<v1::DecisionError> job_failure_;
};

}  // namespace accord::daemon

#endif  // ACCORD_DAEMON_SIDECAR_SIDECAR_JOB_H_
