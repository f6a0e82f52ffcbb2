#include "bench/coordinator/mesh_layout.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace accord::bench {

absl::StatusOr<MeshLayout> MeshLayout::Make(int nodes, int ranks_per_node, int pp, int tp,
                                            int groups) {
  if (nodes < 1 || ranks_per_node < 1 || pp < 1 || tp < 1 || groups < 1) {
    return absl::InvalidArgumentError(
        "--nodes, --ranks_per_node, --pp, --tp and --groups must be at least 1");
  }
  MeshLayout l;
  l.nodes_ = nodes;
  l.rpn_ = ranks_per_node;
  l.pp_ = pp;
  l.tp_ = tp;
  l.groups_ = groups;
  if (l.world() % (pp * tp) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the world of ", l.world(), " ranks is not a multiple of --pp x --tp = ", pp * tp));
  }
  for (int stage = 0; stage < pp; ++stage) {
    for (int t = 0; t < tp; ++t) {
      std::vector<int> ranks;
      ranks.reserve(l.dp());
      for (int d = 0; d < l.dp(); ++d) ranks.push_back((stage * l.dp() + d) * tp + t);
      absl::StatusOr<std::shared_ptr<const MemberSet>> m = MembersOf(std::move(ranks), l.world());
      if (!m.ok()) return m.status();
      const std::string tag = *m == nullptr ? "" : absl::StrCat("@", (*m)->Tag());
      for (int g = 0; g < groups; ++g) l.ids_.push_back(absl::StrCat("group", g, tag));
      l.sets_.push_back(*std::move(m));
    }
  }
  l.node_groups_.resize(nodes);
  for (int n = 0; n < nodes; ++n) {
    std::vector<int> sets;
    for (int r = n * ranks_per_node; r < (n + 1) * ranks_per_node; ++r) sets.push_back(l.SetOf(r));
    std::sort(sets.begin(), sets.end());
    sets.erase(std::unique(sets.begin(), sets.end()), sets.end());
    for (int set : sets) {
      for (int g = 0; g < groups; ++g) l.node_groups_[n].push_back(set * groups + g);
    }
  }
  return l;
}

std::vector<int> MeshLayout::NodeMembers(int n, int gi) const {
  std::vector<int> out;
  const int set = gi / groups_;
  for (int r = n * rpn_; r < (n + 1) * rpn_; ++r) {
    if (SetOf(r) == set) out.push_back(r);
  }
  return out;
}

std::vector<int> MeshLayout::NodesOf(int gi) const {
  // A set's ranks lie in its stage's range of dp() x tp ranks.
  const int stage = gi / groups_ / tp_;
  const int first = stage * dp() * tp_;
  const int last = first + dp() * tp_ - 1;
  std::vector<int> out;
  for (int n = first / rpn_; n <= last / rpn_; ++n) {
    if (!NodeMembers(n, gi).empty()) out.push_back(n);
  }
  return out;
}

int MeshLayout::max_groups_per_node() const {
  size_t most = 0;
  for (const std::vector<int>& g : node_groups_) most = std::max(most, g.size());
  return static_cast<int>(most);
}

}  // namespace accord::bench
