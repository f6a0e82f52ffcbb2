// One group's state at the coordinator: its registration, its pending steps,
// and what its last decided step was (docs/ARCHITECTURE.md, "Classes").
#ifndef ACCORD_DAEMON_COORDINATOR_GROUP_STATE_H_
#define ACCORD_DAEMON_COORDINATOR_GROUP_STATE_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "accord/v1/accord.pb.h"
#include "core/dtype.h"
#include "daemon/coordinator/content.h"
#include "daemon/coordinator/content_cache.h"
#include "daemon/coordinator/deadline_tracker.h"
#include "daemon/coordinator/group_agreement.h"
#include "daemon/coordinator/membership.h"
#include "daemon/coordinator/observe_hooks.h"
#include "daemon/coordinator/usage_window.h"

namespace accord::daemon {

// One node's manifest content added to a pending step.
struct Contribution {
  NodeState* node;
  // Kept alive by `group`'s cache or retained contents until the step is
  // decided (see ContentCache); Owner() finds the owning pointer.
  const Content* content;
  NodeGroupState* group;
  std::shared_ptr<const Content> Owner() const;
};

// A (group, step) waiting for ranks.
struct PendingStep {
  PendingStep(absl::Time first_seen, absl::Duration deadline) : clock(first_seen, deadline) {}
  StepDeadline clock;  // deadline_tracker.h
  int ranks_covered = 0;
  bool all_repeat = true;
  uint64_t combined_key = 0;  // sum of MixKey(content key) over contributions
  std::vector<Contribution> contributions;
};

// Mixes one node content key into the order-independent combination of a
// step's contributions (PendingStep::combined_key).
uint64_t MixKey(uint64_t k);

// The group's counters for the observe API and metrics.
struct GroupCounters {
  int64_t decisions = 0;
  int64_t cache_hits = 0;
  int64_t cache_misses = 0;
};

// The shape of the group's last ok decision (observe API, metrics, the
// decision-changed event).
struct DecisionShape {
  bool have_last_ok = false;  // the fields below describe an ok decision
  DType last_wire = DType::kFloat32;
  std::vector<bool> last_included;
  int last_num_skipped = 0;
  int64_t last_zero_fills = 0;
};

// Not thread-safe: the coordinator's lock guards it (a step pipeline's pool
// touches one group from one thread at a time).
class GroupState {
 public:
  GroupState(int world_size, const std::string& job_id, const std::string& group_id)
      : group_id(group_id), registration(world_size, job_id, group_id) {}

  // Records that `step` was decided as `d` (ok, error, or same_as_previous,
  // from a pending step or a repeat wave); `combined_key` is the step's
  // PendingStep::combined_key (unused for same_as_previous). The only writer
  // of the last_* facts below: a same_as_previous decision keeps the stored
  // full decision, which stands for this step too (resends patch the step
  // and the wait; no copy per repeated decision). Drops the earlier pending
  // steps whose clock never started.
  void RecordDecision(int64_t step, const v1::Decision& d, uint64_t combined_key);

  int64_t last_decided_step() const { return last_decided_step_; }
  // The group's members (null: every rank) and whether `rank` is one.
  const MemberSet* members() const { return registration.members().get(); }
  bool IsMember(int rank) const { return members() == nullptr || members()->Contains(rank); }
  // Full form (ok body or error) of the last decided step that was not
  // same_as_previous; its step and wait_us are those of the step that
  // computed it.
  const std::shared_ptr<const v1::Decision>& last_decision() const { return last_.decision; }
  // The wait of the last decided step.
  int64_t last_decision_wait_us() const { return last_.wait_us; }
  bool last_ok() const { return last_.ok; }
  // Whether a complete step is decided same_as_previous (no core Decide):
  // every contribution repeated, and they combine to the last step's.
  bool SameAsPrevious(const PendingStep& p) const {
    return p.all_repeat && last_.ok && last_.decision != nullptr &&
           p.combined_key == last_.combined_key;
  }

  std::string group_id;
  GroupRegistration registration;  // group_agreement.h
  // While the registration collects: `deadline` after its first
  // registration, when it fails naming the ranks that did not register.
  absl::Time registration_due = absl::InfiniteFuture();
  std::map<int64_t, PendingStep> pending;
  GroupCounters counters;
  DecisionShape shape;
  UsageWindow usage;
  std::unique_ptr<GroupObserver> observer;
  // Repeat waves that decided this group (NodeGroupState::waves_counted).
  int64_t waves = 0;
  // A step pipeline's marks: a step of this group completed and waits for
  // its decision (`ready`); the batch that last named the group (`batch`).
  struct PipelineMarks {
    bool ready = false;
    uint64_t batch = 0;
  };
  PipelineMarks marks;

 private:
  int64_t last_decided_step_ = -1;
  // The rest of the last decision's facts.
  struct Last {
    std::shared_ptr<const v1::Decision> decision;
    int64_t wait_us = 0;
    bool ok = false;
    uint64_t combined_key = 0;
  };
  Last last_;
};

// Folds the repeat waves the node went through into its skip accounting.
inline void CountWaveSkips(const GroupState& g, NodeGroupState& ng) {
  ng.contents.AddSkipSteps(g.waves - ng.waves_counted);
  ng.waves_counted = g.waves;
}

}  // namespace accord::daemon

#endif  // ACCORD_DAEMON_COORDINATOR_GROUP_STATE_H_
