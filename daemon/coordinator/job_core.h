// The state of one job that every part of its engine reads (docs/
// ARCHITECTURE.md, "Classes"), and the operations they share: failing the
// job, naming the ranks a step misses, starting a pending step, recording a
// decision for the observe side.
#ifndef ACCORD_DAEMON_COORDINATOR_JOB_CORE_H_
#define ACCORD_DAEMON_COORDINATOR_JOB_CORE_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/node_hash_map.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "accord/v1/accord.pb.h"
#include "core/decide.h"
#include "core/rank_set.h"
#include "daemon/coordinator/coordinator_options.h"
#include "daemon/coordinator/group_state.h"
#include "daemon/coordinator/job_effects.h"
#include "daemon/coordinator/member_sets.h"
#include "daemon/coordinator/membership.h"
#include "daemon/coordinator/observe_hooks.h"

namespace accord::daemon {

// The lifecycle of the job state a run holds while a node is connected
// (docs/ARCHITECTURE.md, "Lifecycles"; runs: run_registry.h).
enum class JobState {
  kRunning,
  kFailed,  // MISSING_RANKS, a rank left mid-step, or a node lost past its grace
};

// Not thread-safe: the coordinator's lock guards it.
struct JobCore {
  JobCore(std::string job_id, std::string run_id, int world_size, const CoordinatorOptions& options)
      : job_id(std::move(job_id)),
        run_id(std::move(run_id)),
        world_size(world_size),
        options(options),
        members(world_size) {}

  const std::string job_id;
  const std::string run_id;
  const int world_size;
  const CoordinatorOptions& options;
  Membership members;
  // The distinct member sets of its groups, and each node's ranks among them.
  MemberSets member_sets;
  absl::node_hash_map<std::string, GroupState> groups;
  // kRunning --Fail--> kFailed; a job is dropped (not a state) when its run
  // ends. A failed job answers every request with its failure.
  JobState state = JobState::kRunning;
  v1::DecisionError failure;  // set in kFailed
  std::unique_ptr<JobObserver> observer;
  // Contents its nodes' caches retain (ContentCache::retained()), so a wave
  // prunes them only when there are any.
  int64_t retained = 0;

  bool failed() const { return state == JobState::kFailed; }
  bool observing() const { return options.observer != nullptr; }

  // Fails the job with `error`: the culprit's (group, step) gets it as is
  // (culprit_step -1: the culprit group's registration), every other
  // pending step and every registration still collecting gets it as
  // JOB_FAILED; then every node gets it as a JOB_FAILED
  // CoordinatorMessage.error (job_failed set), the job's verdict.
  void Fail(GroupState* culprit, int64_t culprit_step, v1::DecisionError error, JobEffects& fx);
  // MISSING_RANKS for `step` of `g`, which cannot complete because of `why`:
  // names the ranks at fault (StepFacts::AtFault) with the group's last
  // step and node of each, the ranks that submitted, and the connected
  // ranks not heard from yet (not named).
  v1::DecisionError MissingRanksError(const GroupState& g, int64_t step, const PendingStep& p,
                                      absl::string_view why) const;
  // The words of a failure caused by `rank` leaving its sidecar on `node_id`
  // (`cause`: its RankEvent's, when the sender said why).
  static std::string LeftWhy(int rank, absl::string_view node_id, absl::string_view cause);
  // A rank that left before `step` never submits it, so the step, which has
  // just started pending or gained a contribution, cannot complete: fails
  // the job at once, named by this step, instead of at its deadline.
  // Returns whether it failed the job. O(1) while no rank has left. (A rank
  // leaving while a step is already pending is handled where the leave
  // arrives, Job::HandleRankEvent; between the two, no step a departed rank
  // misses waits for the deadline, whatever order the leave and the other
  // ranks' manifests arrive in.)
  bool FailIfALeftRankMisses(GroupState& g, int64_t step, const PendingStep& p, JobEffects& fx);
  // Creates the pending (group, step) whose clock started at `first_seen`
  // (InfiniteFuture: not started); returns it and when the timer must look
  // at it.
  std::pair<std::map<int64_t, PendingStep>::iterator, absl::Time> StartStep(
      GroupState& g, int64_t step, absl::Time first_seen) const;
  // Starts the clock of a pending step that has none yet (only `decided`
  // manifests spoke for it); returns when the timer must look at it.
  absl::Time StartClock(PendingStep& p, absl::Time first_seen) const;
  // Forgets the node's contributions to steps decided since, and the
  // retained contents only those named.
  void PruneContributions(const GroupState& g, NodeGroupState& ng, JobEffects& fx);
  // The observe side of a decision just made: the group's counters, the
  // decision-changed event, metrics and the usage window. `decided`: the
  // core decision when one was computed (nullptr for same_as_previous or
  // errors); `p`: the pending step (nullptr for a repeat wave); `contents`
  // gives the step's contents when the usage window needs them.
  void ObserveDecision(GroupState& g, int64_t step, const PendingStep* p, const v1::Decision& d,
                       const Decision* decided, StepContents contents, JobEffects& fx);
  // The node connected or disconnected (observer event).
  void ObserveNode(const NodeState& node, bool connected, JobEffects& fx) const;
  // Sends a registration result of `g` to the nodes it concerns: every node
  // (one broadcast) for a group of every rank; else each connected node
  // that serves a member or a rank that registered it.
  void SendToRegistrants(const GroupState& g, v1::CoordinatorMessage msg, JobEffects& fx) const;
};

// What the coordinator knows of one group's ranks at one of its pending
// steps, each fact about that group only (docs/ARCHITECTURE.md, "Silent
// ranks"): who submitted the step, the last step of the group each rank is
// known to have submitted, and which ranks that did not submit are at
// fault. Built on the error and stall paths only (O(pending steps x nodes)).
class StepFacts {
 public:
  StepFacts(const JobCore& job, const GroupState& g, const PendingStep& at);
  // A node manifest for the step covers `rank`, or its sidecar said it
  // submitted the step.
  bool Submitted(int rank) const { return submitted_.Contains(rank); }
  // The last step of the group `rank` submitted, as far as known: every
  // decided step, a later pending step that covers it, its sidecar's answer
  // for this group (-1: none).
  int64_t LastStep(int rank) const;
  // The members that did not submit the step (ascending), split into those at
  // fault (`named`) and the rest (`waiting`): when any of them is gone
  // (left, its node's stream down, or never served), only the gone ones are
  // named, since the others are alive and may only be slower, e.g. blocked
  // in a collective with a gone rank; otherwise all are named.
  struct Missing {
    std::vector<int> named;
    std::vector<int> waiting;
  };
  Missing AtFault() const;

 private:
  const JobCore& job_;
  const PendingStep& at_;
  const MemberSet* members_;  // the group's (null: every rank)
  int64_t last_decided_;
  RankSet submitted_;
  // Later pending steps, newest first, with the ranks that submitted each.
  std::vector<std::pair<int64_t, RankSet>> later_;
};

}  // namespace accord::daemon

#endif  // ACCORD_DAEMON_COORDINATOR_JOB_CORE_H_
