#include "daemon/coordinator/membership.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace accord::daemon {

Membership::Membership(int world_size)
    : world_size_(world_size),
      owner_(world_size, nullptr),
      left_step_(world_size, -1),
      left_(world_size, false),
      left_cause_(world_size) {}

int Membership::HeldElsewhere(absl::string_view node_id, const std::vector<int>& ranks) const {
  for (int r : ranks) {
    const NodeState* owner = owner_[r];
    if (owner != nullptr && owner->node_id != node_id && owner->connected()) return r;
  }
  return -1;
}

NodeState& Membership::Connect(const std::string& node_id, const std::vector<int>& ranks,
                               uint64_t session, NodeSink* sink, bool answers_progress,
                               uint64_t* replaced) {
  NodeState& node = nodes_[node_id];
  node.node_id = node_id;
  node.answers_progress = answers_progress;
  *replaced = node.session;
  if (node.connected()) --connected_;
  for (int r : node.ranks) {
    if (owner_[r] == &node) owner_[r] = nullptr;
  }
  auto set = std::make_shared<RankSet>(world_size_);
  for (int r : ranks) {
    TakeRank(node, r);
    set->Add(r);
  }
  node.ranks = ranks;
  SetRankSet(node, std::move(set));
  node.session = session;
  node.sink = sink;
  node.disconnected_at = absl::InfiniteFuture();
  ++connected_;
  return node;
}

void Membership::Disconnect(NodeState& node, absl::Time now) {
  node.session = 0;
  node.sink = nullptr;
  node.disconnected_at = now;
  --connected_;
}

Membership::Join Membership::JoinRank(NodeState& node, int rank) {
  const NodeState* owner = owner_[rank];
  if (owner != nullptr && owner != &node && owner->connected()) return Join::kHeldElsewhere;
  if (left_[rank]) --left_count_;
  left_[rank] = false;
  left_cause_[rank].clear();
  if (owner == &node) return Join::kAlreadyServed;
  TakeRank(node, rank);
  node.ranks.push_back(rank);
  std::sort(node.ranks.begin(), node.ranks.end());
  auto set = std::make_shared<RankSet>(*node.rank_set);
  set->Add(rank);
  SetRankSet(node, std::move(set));
  return Join::kJoined;
}

bool Membership::LeaveRank(const NodeState& node, int rank, int64_t last_step, std::string cause) {
  // A rank this node does not serve (e.g. one refused as a duplicate)
  // leaving changes nothing.
  if (owner_[rank] != &node) return false;
  if (!left_[rank]) ++left_count_;
  left_[rank] = true;
  left_step_[rank] = std::max(left_step_[rank], last_step);
  left_cause_[rank] = std::move(cause);
  return true;
}

int Membership::LeftBefore(int64_t step, const MemberSet* members) const {
  if (left_count_ == 0) return -1;
  if (members != nullptr) {
    for (int r : members->ranks()) {
      if (left_[r] && left_step_[r] < step) return r;
    }
    return -1;
  }
  for (int r = 0; r < world_size_; ++r) {
    if (left_[r] && left_step_[r] < step) return r;
  }
  return -1;
}

int64_t Membership::LastStep(int rank) const {
  int64_t last = left_step_[rank];
  if (const NodeState* owner = owner_[rank]; owner != nullptr) {
    last = std::max(last, owner->last_step);
  }
  return last;
}

std::string Membership::Describe(int rank) const {
  const NodeState* owner = owner_[rank];
  if (owner == nullptr)
    return absl::StrCat("rank ", rank, " (not connected: no sidecar has announced it)");
  if (left_[rank] && !left_cause_[rank].empty()) {
    return absl::StrCat("rank ", rank, " (node \"", owner->node_id,
                        "\", not connected: ", left_cause_[rank], ")");
  }
  const char* state = left_[rank] ? ", not connected: it left its sidecar"
                      : !owner->connected()
                          ? ", not connected: the node's stream to the coordinator is down"
                          : ", connected";
  return absl::StrCat("rank ", rank, " (node \"", owner->node_id, "\"", state, ")");
}

void Membership::TakeRank(NodeState& node, int rank) {
  NodeState* owner = owner_[rank];
  if (owner != nullptr && owner != &node) {
    // Moved from a disconnected node.
    owner->ranks.erase(std::remove(owner->ranks.begin(), owner->ranks.end(), rank),
                       owner->ranks.end());
  }
  owner_[rank] = &node;
}

void Membership::SetRankSet(NodeState& node, std::shared_ptr<const RankSet> set) {
  const std::vector<uint64_t>& words = set->words();
  int lo = 0;
  int hi = static_cast<int>(words.size());
  while (lo < hi && words[lo] == 0) ++lo;
  while (hi > lo && words[hi - 1] == 0) --hi;
  node.word_lo = lo;
  node.word_hi = hi;
  node.rank_set = std::move(set);
}

}  // namespace accord::daemon
