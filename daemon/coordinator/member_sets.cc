#include "daemon/coordinator/member_sets.h"

#include <utility>

namespace accord::daemon {

std::shared_ptr<const MemberSet> MemberSets::Intern(std::shared_ptr<const MemberSet> members,
                                                    Membership& nodes) {
  if (members == nullptr) return nullptr;
  for (const std::shared_ptr<const MemberSet>& m : sets_) {
    if (*m == *members) return m;
  }
  sets_.push_back(std::move(members));
  for (auto& [id, node] : nodes.nodes()) Compute(node, *sets_.back());
  return sets_.back();
}

void MemberSets::Refresh(NodeState& node) const {
  node.member_ranks.clear();
  for (const std::shared_ptr<const MemberSet>& m : sets_) Compute(node, *m);
}

const NodeMembers* MemberSets::Of(const NodeState& node, const MemberSet& members) {
  auto it = node.member_ranks.find(&members);
  return it == node.member_ranks.end() ? nullptr : &it->second;
}

void MemberSets::Compute(NodeState& node, const MemberSet& members) {
  if (node.rank_set == nullptr) return;
  RankSet set(members.world_size());
  int count = 0;
  for (int r : node.ranks) {
    if (members.Contains(r)) {
      set.Add(r);
      ++count;
    }
  }
  if (count == 0) {
    node.member_ranks.erase(&members);
    return;
  }
  const std::vector<uint64_t>& words = set.words();
  int lo = 0;
  int hi = static_cast<int>(words.size());
  while (lo < hi && words[lo] == 0) ++lo;
  while (hi > lo && words[hi - 1] == 0) --hi;
  node.member_ranks[&members] =
      NodeMembers{std::make_shared<const RankSet>(std::move(set)), count, lo, hi};
}

}  // namespace accord::daemon
