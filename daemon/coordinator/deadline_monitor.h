// The deadlines of one job (docs/ARCHITECTURE.md, "Every wait names who is
// missing", "Silent ranks"): a node lost past its reconnect grace, a group
// registration past its deadline, a pending step at half its deadline (a
// stall event), at its deadline (progress queries) and past the answers or
// the grace (the job fails, named by the oldest waiting step of the lowest
// group id due to fail); and the progress reports that feed them. Time is
// passed in; every effect goes through JobEffects. A view over the job's
// core, made per call; not thread-safe (the coordinator's lock).
#ifndef ACCORD_DAEMON_COORDINATOR_DEADLINE_MONITOR_H_
#define ACCORD_DAEMON_COORDINATOR_DEADLINE_MONITOR_H_

#include <cstdint>

#include "absl/time/time.h"
#include "accord/v1/accord.pb.h"
#include "daemon/coordinator/group_state.h"
#include "daemon/coordinator/job_core.h"
#include "daemon/coordinator/job_effects.h"
#include "daemon/coordinator/membership.h"

namespace accord::daemon {

class DeadlineMonitor {
 public:
  explicit DeadlineMonitor(JobCore& job) : job_(job) {}

  // Everything due at `now`; returns the next time something will be due
  // (InfiniteFuture: nothing).
  absl::Time Check(absl::Time now, JobEffects& fx);
  // A node's answer to a progress query (NodeProgress, not partial).
  void HandleProgress(const NodeState& node, const v1::NodeProgress& progress, absl::Time now,
                      JobEffects& fx);
  // A sidecar's own report (NodeProgress.partial) of a step some of its
  // ranks submitted and others did not: starts the step's deadline clock at
  // the node's first submission when no node manifest for it arrived yet.
  void HandlePartialProgress(const NodeState& node, const v1::NodeProgress& progress,
                             absl::Time now, JobEffects& fx);

 private:
  // Fails the job when a pending step needs ranks of a node disconnected
  // for longer than node_reconnect_grace (returns whether it did);
  // otherwise lowers `next` to when one would be due.
  bool FailIfNodeLost(absl::Time now, absl::Time& next, JobEffects& fx);
  // The registrations and the pending steps, in (group id, step) order;
  // returns whether the job failed.
  bool CheckGroups(absl::Time now, absl::Time& next, JobEffects& fx);
  // One pending step: reports a stall or asks progress as its StepDeadline
  // says, or returns true when the step fails now; lowers `next`.
  bool CheckStep(GroupState& g, int64_t step, PendingStep& p, absl::Time now, absl::Time& next,
                 JobEffects& fx);
  // Asks the nodes whose ranks are missing (and that answer progress
  // queries) which of their ranks submitted. Returns whether any was asked
  // (then the step fails when they answer or after a grace).
  bool AskProgress(GroupState& g, int64_t step, PendingStep& p, absl::Time now, JobEffects& fx);
  // Fails the job with MISSING_RANKS for a step past its deadline.
  void FailStep(GroupState& g, int64_t step, PendingStep& p, absl::Time now, JobEffects& fx);
  // A group's registration past its deadline: MISSING_RANKS naming the
  // ranks that did not register it (each with its node and whether it is
  // connected) and those that did; fails the job with it.
  void FailRegistration(GroupState& g, JobEffects& fx);
  // Keeps what `node` says about its own ranks (submitted, last steps).
  void RecordProgress(const NodeState& node, const v1::NodeProgress& progress, PendingStep& p);
  void ObserveStall(const GroupState& g, int64_t step, const PendingStep& p, absl::Time now,
                    JobEffects& fx) const;

  JobCore& job_;
};

}  // namespace accord::daemon

#endif  // ACCORD_DAEMON_COORDINATOR_DEADLINE_MONITOR_H_
