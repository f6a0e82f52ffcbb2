// The groups of a job laid out as PP stages x DP x TP, torchtitan-style, for
// accord_coordinator_bench: rank = ((stage * DP) + dp) * TP + t, DP = world /
// (PP * TP). Each (stage, t) is one member set, the DP ranks of that stage and
// TP index, and holds `groups` groups with ids `group<g>@<tag>` (the tag of
// docs/MEMBERS.md 2.1, so ids are unique per member set). PP = TP = 1 is the
// 1-D job: one set of every rank, members null, ids `group<g>`.
#ifndef ACCORD_BENCH_COORDINATOR_MESH_LAYOUT_H_
#define ACCORD_BENCH_COORDINATOR_MESH_LAYOUT_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/members.h"

namespace accord::bench {

class MeshLayout {
 public:
  // INVALID_ARGUMENT when a count is below 1 or the world (nodes x
  // ranks_per_node) is not a multiple of pp x tp.
  static absl::StatusOr<MeshLayout> Make(int nodes, int ranks_per_node, int pp, int tp, int groups);

  int nodes() const { return nodes_; }
  int ranks_per_node() const { return rpn_; }
  int world() const { return nodes_ * rpn_; }
  int pp() const { return pp_; }
  int tp() const { return tp_; }
  int dp() const { return world() / (pp_ * tp_); }
  int groups_per_set() const { return groups_; }
  int member_sets() const { return pp_ * tp_; }
  // Every group of the job: one decision each per step.
  int total_groups() const { return member_sets() * groups_; }

  // Group index gi = set * groups + g, set = stage * tp + t.
  const std::string& id(int gi) const { return ids_[gi]; }
  // Null for every rank (PP = TP = 1).
  const std::shared_ptr<const MemberSet>& members(int gi) const { return sets_[gi / groups_]; }
  // g: the group's index within its member set.
  int base(int gi) const { return gi % groups_; }
  // The groups node n registers and submits: those of the member sets with a
  // member on it, set by set in ascending order.
  const std::vector<int>& node_groups(int n) const { return node_groups_[n]; }
  // Node n's ranks among group gi's members, ascending.
  std::vector<int> NodeMembers(int n, int gi) const;
  // The nodes with a member of group gi.
  std::vector<int> NodesOf(int gi) const;
  // The most groups any node submits (the 1-D baseline's group count).
  int max_groups_per_node() const;

 private:
  MeshLayout() = default;
  int SetOf(int rank) const { return (rank / (dp() * tp_)) * tp_ + rank % tp_; }

  int nodes_ = 0, rpn_ = 0, pp_ = 1, tp_ = 1, groups_ = 0;
  std::vector<std::shared_ptr<const MemberSet>> sets_;
  std::vector<std::string> ids_;
  std::vector<std::vector<int>> node_groups_;
};

}  // namespace accord::bench

#endif  // ACCORD_BENCH_COORDINATOR_MESH_LAYOUT_H_
