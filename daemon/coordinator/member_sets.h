// The member sets of one job's groups (docs/MEMBERS.md 2.7): interned, so
// that groups with equal members share one MemberSet, and per node the
// node's ranks among each (NodeState::member_ranks), which a node manifest
// without rank_bits stands for.
#ifndef ACCORD_DAEMON_COORDINATOR_MEMBER_SETS_H_
#define ACCORD_DAEMON_COORDINATOR_MEMBER_SETS_H_

#include <memory>
#include <vector>

#include "core/members.h"
#include "daemon/coordinator/membership.h"

namespace accord::daemon {

// Not thread-safe: the coordinator's lock guards it. The node entries are
// written only here, on the event path (registrations, connects, joins),
// and read by the step pipeline.
class MemberSets {
 public:
  // The interned set equal to `members` (null stays null); a set seen the
  // first time gets its entry in every node of `nodes` that serves a member.
  std::shared_ptr<const MemberSet> Intern(std::shared_ptr<const MemberSet> members,
                                          Membership& nodes);
  // The node's ranks changed (it connected, or a rank joined it): its
  // entries are computed again.
  void Refresh(NodeState& node) const;
  // The node's ranks among `members` (null: none of them).
  static const NodeMembers* Of(const NodeState& node, const MemberSet& members);
  bool empty() const { return sets_.empty(); }
  int size() const { return static_cast<int>(sets_.size()); }

 private:
  static void Compute(NodeState& node, const MemberSet& members);

  std::vector<std::shared_ptr<const MemberSet>> sets_;
};

}  // namespace accord::daemon

#endif  // ACCORD_DAEMON_COORDINATOR_MEMBER_SETS_H_
