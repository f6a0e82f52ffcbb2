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
//  3. Node manifests (full or repeat form) are collected per (group, step).
//     When the ranks they cover add up to the world, the coordinator decides
//     (core Decide on the OR-merge of the node manifests) and broadcasts the
//     Decision to every node of the job, many decisions per message. If every
//     node repeated its previous manifest the reply is `same_as_previous`.
//  4. A pending (group, step) that has not heard from every rank within
//     `deadline` of its first manifest fails the whole JOB: that step gets
//     MISSING_RANKS (naming the ranks and the last step each reached) and every
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
// Thread-safe. Owns one timer thread (deadlines) unless disabled in options;
// it stops in Stop() or the destructor.
#ifndef ACCORD_DAEMON_COORDINATOR_COORDINATOR_H_
#define ACCORD_DAEMON_COORDINATOR_COORDINATOR_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/node_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "accord/v1/accord.pb.h"
#include "core/decide.h"
#include "core/group.h"
#include "core/manifest.h"
#include "daemon/common/clock.h"

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
};

// Where the coordinator sends one node session's messages. Send is called
// with the coordinator's lock held: it must not block and must not call back
// into the Coordinator. The same message object may go to many sinks.
class NodeSink {
 public:
  virtual ~NodeSink() = default;
  virtual void Send(std::shared_ptr<const v1::CoordinatorMessage> message) = 0;
};

// Counters for the metrics hook.
struct CoordinatorStats {
  int64_t manifests = 0;
  int64_t cache_hits = 0;    // repeat-form manifests resolved from the cache
  int64_t cache_misses = 0;  // full-form manifests
  int64_t repeat_key_mismatches = 0;
  int64_t decisions = 0;
  int64_t same_as_previous = 0;
  int64_t errors = 0;  // error decisions and results sent (counted once per event)
  int64_t jobs = 0;    // live jobs
  int64_t sessions = 0;
};

// Per-rank skip counts of one group: skips[rank][param] = number of decided
// steps at which that rank had no gradient for that parameter.
struct SkipMatrix {
  std::vector<std::string> param_names;
  std::map<int, std::vector<int64_t>> skips;
};

class Coordinator {
 public:
  using SessionId = uint64_t;

  Coordinator(CoordinatorOptions options, Clock* clock);
  ~Coordinator();
  Coordinator(const Coordinator&) = delete;
  Coordinator& operator=(const Coordinator&) = delete;

  // Stops the timer thread. Idempotent.
  void Stop();

  // A node stream opened; messages for it go to `sink` until CloseSession.
  SessionId OpenSession(NodeSink* sink);
  // Handles one message of a session. Replies and broadcasts go to the sinks
  // before this returns.
  void HandleMessage(SessionId session, const v1::NodeMessage& message);
  // The stream ended; `sink` is not used afterwards.
  void CloseSession(SessionId session);

  // Fails every pending step whose deadline passed at clock->Now(). The timer
  // thread calls this; tests without the thread may call it directly.
  void CheckDeadlines();

  CoordinatorStats stats();
  // Last step each rank of the job reached (-1: none), indexed by rank.
  absl::StatusOr<std::vector<int64_t>> RankLastSteps(const std::string& job_id);
  absl::StatusOr<SkipMatrix> SkipCounts(const std::string& job_id, const std::string& group_id);

 private:
  struct RankDetail {
    int rank;
    std::vector<bool> used;
  };
  // One node manifest's content (shared between the cache and the steps it
  // contributed to).
  struct Content {
    uint64_t key = 0;
    std::vector<DTypeMask> dtypes;
    std::shared_ptr<const RankSet> ranks;
    int rank_count = 0;
    std::vector<RankDetail> detail;
  };
  struct NodeState;
  struct NodeGroupState {
    int variant = -1;                        // index of this node's registration variant, -1: none
    std::vector<int64_t> contributed_steps;  // pending steps this node spoke for
    std::shared_ptr<const Content> cache;
    // Skip accounting: `skip_content` has been in effect for `skip_steps`
    // contributions not yet added to the counts below.
    std::shared_ptr<const Content> skip_content;
    int64_t skip_steps = 0;
    std::vector<int64_t> node_skips;  // per param: steps the whole node lacked it
    absl::flat_hash_map<int, std::vector<int64_t>> rank_extra_skips;
  };
  struct NodeState {
    std::string node_id;
    SessionId session = 0;  // 0: disconnected
    NodeSink* sink = nullptr;
    std::vector<int> ranks;
    std::shared_ptr<const RankSet> rank_set;
    int64_t last_step = -1;
    absl::flat_hash_map<std::string, NodeGroupState> groups;
  };
  struct Contribution {
    NodeState* node;
    std::shared_ptr<const Content> content;
  };
  struct PendingStep {
    absl::Time first_seen;
    absl::Time deadline;
    int ranks_covered = 0;
    bool all_repeat = true;
    std::vector<Contribution> contributions;
  };
  struct RegVariant {
    GroupSpec spec;
    Policy policy;
    std::string policy_bytes;  // serialized ReducePolicy, for equality
    RankSet ranks;
  };
  enum class RegState { kCollecting, kOk, kFailed };
  struct GroupState {
    std::string group_id;
    std::vector<RegVariant> variants;
    RankSet registered;
    RegState reg_state = RegState::kCollecting;
    v1::DecisionError reg_error;
    int spec_variant = -1;
    uint64_t spec_fingerprint = 0;
    int64_t last_decided_step = -1;
    std::shared_ptr<const v1::Decision> last_decision;  // full form (ok body or error)
    bool last_ok = false;
    uint64_t last_combined_key = 0;
    std::map<int64_t, PendingStep> pending;
  };
  struct Job {
    std::string job_id;
    int world_size = 0;
    absl::node_hash_map<std::string, NodeState> nodes;
    absl::node_hash_map<std::string, GroupState> groups;
    std::vector<NodeState*> rank_owner;
    std::vector<int64_t> rank_left_step;  // from RankEvent, -1: none
    int connected_nodes = 0;
    bool failed = false;
    v1::DecisionError failure;
  };
  struct Session {
    NodeSink* sink = nullptr;
    Job* job = nullptr;
    NodeState* node = nullptr;
  };
  // Messages produced while handling one event, sent at its end.
  struct Outbox {
    absl::flat_hash_map<Job*, v1::CoordinatorMessage> broadcast_decisions;
    std::vector<std::pair<Job*, v1::CoordinatorMessage>> broadcast_other;
    std::vector<std::pair<NodeSink*, v1::CoordinatorMessage>> direct;
    v1::DecisionBatch* ReplyBatch(NodeSink* sink);
  };

  void HandleHello(SessionId id, Session& s, const v1::NodeHello& hello, Outbox& out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void HandleRegistration(Session& s, const v1::NodeRegistration& reg, Outbox& out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void HandleManifest(Session& s, const v1::Manifest& m, Outbox& out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void HandleRankEvent(Session& s, const v1::RankEvent& e, Outbox& out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<std::shared_ptr<const Content>> ParseFull(const NodeState& node,
                                                           const GroupState& group,
                                                           const RegVariant& variant, int world,
                                                           const v1::Manifest& m);
  void FinishRegistration(Job& job, GroupState& g, Outbox& out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void DecideStep(Job& job, GroupState& g, int64_t step, PendingStep& p, Outbox& out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FailJob(Job& job, GroupState* culprit, int64_t culprit_step, v1::DecisionError error,
               Outbox& out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  v1::DecisionError MissingRanksError(const Job& job, const GroupState& g, int64_t step,
                                      const PendingStep& p, const std::vector<int>& missing,
                                      absl::string_view why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  int64_t RankLastStep(const Job& job, int rank) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void CountSkips(NodeGroupState& ng, const std::shared_ptr<const Content>& content);
  static void FlushSkips(NodeGroupState& ng);
  void Flush(Outbox& out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RemoveJob(Job* job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void TimerLoop();

  const CoordinatorOptions options_;
  Clock* const clock_;

  absl::Mutex mu_;
  absl::CondVar timer_cv_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  absl::Time next_deadline_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();
  SessionId next_session_ ABSL_GUARDED_BY(mu_) = 1;
  absl::flat_hash_map<SessionId, Session> sessions_ ABSL_GUARDED_BY(mu_);
  absl::node_hash_map<std::string, Job> jobs_ ABSL_GUARDED_BY(mu_);
  CoordinatorStats stats_ ABSL_GUARDED_BY(mu_);
  std::thread timer_;
};

}  // namespace accord::daemon

#endif  // ACCORD_DAEMON_COORDINATOR_COORDINATOR_H_
