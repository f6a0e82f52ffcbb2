// RelayJob: the engine of a relay, one tier between the sidecars of a rack
// and the coordinator (docs/ARCHITECTURE.md, "Relays"). No lock, no thread:
// the caller (Relay, relay.h) holds the lock and passes the time in;
// messages to the sidecars' sessions go through RelayEffects, messages
// upstream through the UpstreamNode's UpstreamSink.
//
// Downstream it serves the node protocol exactly as the coordinator does
// (NodeSessionHandler: sidecars connect to it unchanged); upstream it is one
// node of the job whose ranks are the union of its sidecars' ranks
// (UpstreamHandler, driven by GrpcUpstream). Per message kind:
//  - NodeHello: the first one of a job starts the job here and the upstream
//    hello (ranks: every connected sidecar's; RESUME with the sidecar's run
//    id when the sidecar resumes one, so a restarted relay rejoins the run).
//    A sidecar is welcomed once the upstream Welcome is in (run id,
//    deadline; batch repeats offered: a sidecar's batch repeat is expanded
//    into its stream's previous batch at the new step). Later sidecars'
//    ranks go up as RankEvent joins. A NEW hello from a sidecar of the run
//    under another epoch (its ranks were restarted) ends the run: every
//    other sidecar gets RUN_ENDED, and the relay rejoins upstream NEW with a
//    fresh epoch, which ends the run at the coordinator for everyone. A hello
//    the coordinator would refuse is refused with its checks and errors
//    (node_hello.h: ids, world size, ranks in range and announced once, the
//    job's world size, a rank another connected sidecar serves); another job
//    while one is served gets LIMIT_EXCEEDED.
//  - NodeRegistration and RankEvent are forwarded unchanged (the
//    coordinator compares registrations per rank); after an upstream
//    reconnect the registrations go again as one per distinct spec with the
//    union of its ranks. A group's members are those of its first
//    registration; the relay's Welcome says `members` when the
//    coordinator's did (docs/MEMBERS.md 2.6).
//  - Node manifests (full or repeat form; a repeat is resolved against the
//    sidecar's previous full form, or answered with resend_full_form) are
//    collected per (group, step); one without rank_bits stands for its
//    sidecar's ranks among the group's members. Once every sidecar that
//    registered the group contributed, ONE manifest goes upstream (without
//    rank_bits when it covers the relay's announced ranks among them): the core Merge of the
//    contributions, with rank_detail for every rank whose usage differs from
//    the merged usage, so the coordinator's skip matrix stays per rank; in
//    repeat form when identical to the previous one sent for the group. An
//    upstream batch that is the previous one again (the same groups and
//    keys, all in repeat form) goes as one batch repeat record when the
//    coordinator's Welcome offers them, so a coordinator behind relays
//    decides steady steps as repeat waves. A
//    contribution that arrives after its step went up (a sidecar that
//    reconnected) goes up alone, for its own ranks (the coordinator accepts
//    disjoint contributions of one node).
//  - Decisions, registration results and errors from upstream fan out to
//    every welcomed sidecar, one shared message for all.
//  - Silent ranks: a sidecar's partial report goes up at once with the ranks
//    of the sidecars that already contributed; a step that some sidecars
//    contributed and others did not for half the deadline is reported up as
//    partial by the relay itself. A ProgressQuery is answered from the
//    contributions plus the answers of the sidecars that did not contribute
//    (each asked in turn), so MISSING_RANKS still names ranks, not relays.
//  - A sidecar whose stream ends keeps its place for `node_reconnect_grace`
//    (its steps wait for it); past the grace its ranks go up as RankEvent
//    leaves, which fails a step that needs them at once. When no sidecar is
//    left the job's state is dropped and the upstream stream restarted.
//
// One job at a time, like a sidecar. Not thread-safe; the effects and the
// UpstreamSink are called from inside its methods and must not call back
// into it.
#ifndef ACCORD_DAEMON_RELAY_RELAY_JOB_H_
#define ACCORD_DAEMON_RELAY_RELAY_JOB_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "accord/v1/accord.pb.h"
#include "core/members.h"
#include "core/rank_set.h"
#include "daemon/common/clock.h"
#include "daemon/common/due_timer.h"
#include "daemon/common/node_hello.h"
#include "daemon/common/upstream.h"
#include "daemon/common/upstream_health.h"
#include "daemon/common/upstream_loss.h"
#include "daemon/common/upstream_node.h"
#include "proto/wire.h"

namespace accord::daemon {

struct RelayOptions {
  // The node id the relay has upstream (one per relay; the coordinator names
  // it for anything it cannot pin on a rank).
  std::string relay_id;
  // The job token sent upstream; empty: the first sidecar's hello token.
  std::string token;
  // How long a sidecar whose stream ended keeps its place (its ranks are
  // reported as left afterwards). Match the coordinator's.
  absl::Duration node_reconnect_grace = absl::Seconds(10);
  // The largest world size a sidecar's hello may say (--max_ranks), as
  // the coordinator's CoordinatorOptions::max_world_size.
  int max_world_size = 1 << 20;
  // While a job is served, the coordinator may go unanswered this long (no
  // stream of it welcomed); past it every sidecar of the job gets one
  // UNAVAILABLE error with the words a sidecar uses for its own node above
  // (UpstreamHealth::LostMessage), so ranks behind a relay end as those of
  // sidecars connected to the coordinator do. Zero: never
  // (docs/RELIABILITY.md, "Node above lost").
  absl::Duration upstream_loss_limit = absl::Seconds(60);
  // Told of every stream attempt and every message from the coordinator;
  // shared with the key-value forwarder. Not owned; may be null.
  UpstreamHealth* upstream_health = nullptr;
  Clock* clock = nullptr;  // not owned; null: the real clock
  // Tests that drive CheckTimers() by hand may turn the thread off.
  bool start_timer_thread = true;
};

struct RelayStats {
  int64_t node_manifests_in = 0;    // manifests from sidecars (after repeat expansion)
  int64_t batch_repeats_in = 0;     // sidecar batches that came as one batch repeat record
  int64_t manifests_up_full = 0;    // merged manifests sent upstream in full form
  int64_t manifests_up_repeat = 0;  // ... in repeat form
  int64_t batch_repeats_up = 0;     // upstream batches sent as one batch repeat record
  int64_t merges_reused = 0;        // steps sent as the previous merge (every part repeated)
  int64_t decision_batches = 0;     // decision batches fanned out
  int nodes = 0;                    // sidecars connected now
  std::string job_id;
};

// What a RelayJob does outside itself, implemented by its caller (Relay) and
// called from inside the RelayJob's methods; the timer's due times are for
// RelayJob::CheckTimers.
class RelayEffects : public DueTimerEffects {
 public:
  using SessionId = uint64_t;
  // Queues `message` on sidecar session `session`'s stream (dropped when the
  // session is closed). The same message object may go to many sessions.
  virtual void SendToSession(SessionId session,
                             std::shared_ptr<const v1::CoordinatorMessage> message) = 0;
};

class RelayJob {
 public:
  using SessionId = RelayEffects::SessionId;

  // Neither is owned; both outlive the RelayJob. options.clock,
  // options.start_timer_thread and options.upstream_health are the caller's.
  RelayJob(const RelayOptions& options, RelayEffects& effects);
  RelayJob(const RelayJob&) = delete;
  RelayJob& operator=(const RelayJob&) = delete;

  // Must be set before any other call; not owned.
  void SetUpstream(UpstreamSink* upstream) { node_.SetSink(upstream); }

  // A sidecar stream opened; its messages and its end name the id returned.
  SessionId OpenSession();
  void HandleMessage(absl::Time now, SessionId session, const v1::NodeMessage& message);
  void CloseSession(absl::Time now, SessionId session);

  // A new upstream stream is up: queues the hello and every resend.
  void OnUpstreamConnected(absl::Time now);
  // One message from upstream; may move its contents out.
  void HandleCoordinatorMessage(v1::CoordinatorMessage* message);

  // Fails the job past the upstream loss limit, drops the sidecars past
  // their grace and reports the partial steps due by `now`; returns when the
  // next one is due (InfiniteFuture: none).
  absl::Time CheckTimers(absl::Time now);

  RelayStats stats() const;
  // The run of `job_id` served ("" while the coordinator has not said it),
  // or nullopt when it serves no such job.
  std::optional<std::string> CurrentRun(const std::string& job_id) const;

 private:
  // One sidecar of the job.
  struct Node {
    std::string node_id;
    SessionId session = 0;  // 0: its stream ended (within the grace)
    // Its live ranks (ascending): those of its hello and joins, less those
    // that left.
    std::vector<int> ranks;
    // The ranks its manifests without rank_bits stand for: those of its
    // hello and joins; a leave does not take one out (UpstreamNode::
    // announced(), as the sidecar keeps it).
    RankSet rank_set;
    bool answers_progress = false;
    uint64_t epoch = 0;  // NodeHello.node_epoch: its ranks' incarnation
    bool welcomed = false;
    absl::Time lost_at = absl::InfiniteFuture();
    // Its previous full-form manifest per group (step cleared), against which
    // its repeat-form manifests are resolved.
    absl::flat_hash_map<std::string, v1::Manifest> last_full;
    // Its stream's previous manifest batch, which a batch repeat stands for
    // (as the coordinator keeps it; docs/ARCHITECTURE.md, "Repeat waves").
    wire::StreamBatchRecord received;
  };
  // One sidecar's contribution to a (group, step), in full form, with the
  // ranks it covers as of its arrival (a later hello or join of the sidecar
  // does not change what an earlier manifest stood for).
  struct Part {
    std::string node_id;
    v1::Manifest manifest;
    bool repeat = false;  // resolved from the sidecar's repeat form
    // Its rank_bits, or the sidecar's rank_set when it has none; the error
    // when its rank_bits do not parse.
    absl::StatusOr<RankSet> ranks;
    // Manifest.decided: its sidecar holds the step's decision (a new
    // stream's resend of a step this relay never saw decided).
    bool decided = false;
  };
  struct LocalStep {
    // When a rank began to wait for it: its first unflagged part, or a
    // sidecar's partial report (`waited`). A step only flagged parts speak
    // for has nobody waiting, so no clock and no partial report.
    bool waited = false;
    absl::Time first_seen;
    std::vector<Part> unsent;
    // Sidecars that contributed (sent up or not), with the ranks covered.
    std::map<std::string, std::vector<int>> contributed;
    bool partial_reported = false;
  };
  // A ProgressQuery being answered: the sidecars still asked, and the answer
  // so far.
  struct Query {
    std::set<std::string> waiting;
    v1::NodeProgress answer;
  };
  // A group's last merge: a signature of its parts (PartsSignature; 0:
  // none) and its result (full form, step cleared). A step whose parts are
  // all repeats with the same signature merges to the same manifest.
  struct LastMerge {
    uint64_t parts_signature = 0;
    std::shared_ptr<const v1::Manifest> merged;
    size_t announced = 0;  // UpstreamNode::announced() at its build
  };
  struct Group {
    std::string group_id;
    size_t num_params = 0;
    // From its first registration (null: every rank; docs/MEMBERS.md 2.6):
    // a manifest without rank_bits stands for the announced ranks among them.
    std::shared_ptr<const MemberSet> members;
    std::set<std::string> nodes;       // sidecars that registered it
    GroupRegistrations registrations;  // as forwarded, for resends
    std::map<int64_t, LocalStep> steps;
    InflightManifests inflight;  // merges sent up, undecided
    std::map<int64_t, Query> queries;
    int64_t last_decided = -1;
    std::optional<v1::Decision> last_decision;  // with an ok or error body
    // Whether the upstream stream holds the previous merge sent (its shape:
    // rank_bits + rank_detail), for repeat form.
    RepeatFormOf<ManifestShape> repeat;
    LastMerge last_merge;
  };
  struct Session {
    std::string node_id;  // "" until its hello is accepted
  };

  void HandleHello(absl::Time now, SessionId id, Session& s, const v1::NodeHello& hello);
  // Sends `error` (its job: the one served now) to session `session` and
  // logs it.
  void Refuse(SessionId session, v1::DecisionError error, std::vector<int> ranks = {});
  // The first of `ranks` that another connected sidecar serves.
  RankHeldElsewhere HeldElsewhere(const std::string& node_id, const std::vector<int>& ranks) const;
  void Welcome(Node& node);
  // A NEW hello from `id` under another epoch ended the current run: every
  // other sidecar gets RUN_ENDED and the job's state is dropped.
  void EndRun(SessionId id, const v1::NodeHello& hello);
  // The accepted hello's sidecar takes its place (a new stream: no previous
  // manifest or batch).
  Node& PlaceNode(SessionId id, Session& s, const v1::NodeHello& hello,
                  const std::vector<int>& ranks);
  // A NEW hello from a sidecar of the current job under another epoch: its
  // ranks were restarted, so the current run is over.
  bool RanksRestarted(const v1::NodeHello& hello) const;
  void HandleRegistration(Node& node, const v1::NodeRegistration& nr);
  void HandleRankEvent(Node& node, const v1::RankEvent& e);
  // A sidecar's batch: recorded, or expanded when it is a batch repeat.
  void HandleManifests(absl::Time now, Node& node, const v1::ManifestBatch& batch);
  // The manifests of a batch, each resolved and added.
  void AddBatch(absl::Time now, Node& node, const v1::ManifestBatch& batch);
  // Adds one resolved manifest (`repeat`: from the sidecar's repeat form);
  // appends what is ready to go up to `out`.
  void AddManifest(absl::Time now, Node& node, Group& g, v1::Manifest m, bool repeat, bool decided,
                   v1::ManifestBatch* out);
  // Answers `node`'s manifest for a step of g at or before its last decided
  // one: that decision again (the last step, or any when it was an error),
  // else STEP_REGRESSION, as the coordinator answers it.
  void AnswerDecidedStep(Node& node, const Group& g, int64_t step);
  // What a merge of `parts` depends on: each sidecar's content key and the
  // ranks the relay knows (membership_epoch_). 0 when a part has no key.
  uint64_t PartsSignature(const std::vector<Part>& parts) const;
  // Sends the unsent contributions of (g, step) once every sidecar that
  // registered g contributed.
  void MaybeSendStep(Group& g, int64_t step, v1::ManifestBatch* out);
  // The merged manifest of `parts` (full form), or an error about them.
  absl::StatusOr<v1::Manifest> Merge(const Group& g, int64_t step, const std::vector<Part>& parts);
  void SendBatch(v1::ManifestBatch batch);
  void HandleProgress(absl::Time now, Node& node, const v1::NodeProgress& p);
  void HandleProgressQuery(const v1::ProgressQuery& q);
  void FinishQuery(Group& g, int64_t step);
  // Ranks of the sidecars that contributed (g, step).
  std::vector<int> ContributedRanks(const Group& g, int64_t step);
  // Records decided steps; takes out answers about the relay's own repeat
  // forms (resending those steps upstream in full form).
  void HandleDecisions(v1::DecisionBatch* batch);
  // Sends `message` to every welcomed, connected sidecar.
  void Broadcast(std::shared_ptr<const v1::CoordinatorMessage> message);
  // Sends `message` to session `session` (none: 0).
  void SendTo(SessionId session, v1::CoordinatorMessage message);
  void DropNode(const std::string& node_id);
  void ResetJob();
  // The job's clock against options_.upstream_loss_limit starts now, unless
  // it counts already or the loss was reported; the timer is armed for it.
  void StartUnanswered(absl::Time now);
  // Past the limit: every sidecar of the job gets the error, once per job.
  // Returns when it will be due (InfiniteFuture: not counting).
  absl::Time CheckUpstreamLoss(absl::Time now);

  const RelayOptions& options_;
  RelayEffects& effects_;
  SessionId next_session_ = 1;
  absl::flat_hash_map<SessionId, Session> sessions_;
  // The relay as one node upstream: the job served now (none: no job), its
  // run and epoch, the ranks announced, the stream's Welcome and previous
  // batch (docs/ARCHITECTURE.md, "Relays").
  UpstreamNode node_;
  // Moves whenever a sidecar's ranks or the announced ranks change (merges
  // depend on both).
  uint64_t membership_epoch_ = 0;
  // Since when the coordinator has gone unanswered while a job is served (a
  // new stream until its Welcome, or the job's first sidecar before any);
  // the job's sidecars are told once past the limit.
  UpstreamLossClock upstream_loss_ = UpstreamLossClock(options_.upstream_loss_limit);
  std::map<std::string, Node> nodes_;
  // The epoch of each sidecar of the job dropped past its grace: one that
  // comes back NEW under another epoch had its ranks restarted
  // (RanksRestarted), as when its entry is still here. Cleared with the job.
  absl::flat_hash_map<std::string, uint64_t> dropped_epochs_;
  std::map<std::string, Group> groups_;
  RelayStats stats_;
};

}  // namespace accord::daemon

#endif  // ACCORD_DAEMON_RELAY_RELAY_JOB_H_
