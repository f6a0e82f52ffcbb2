// Which node serves which rank of one job (docs/ARCHITECTURE.md, "Classes").
#ifndef ACCORD_DAEMON_COORDINATOR_MEMBERSHIP_H_
#define ACCORD_DAEMON_COORDINATOR_MEMBERSHIP_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/node_hash_map.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "core/members.h"
#include "core/rank_set.h"
#include "daemon/coordinator/content_cache.h"

namespace accord::daemon {

class NodeSink;

// A node's ranks among one member set (MemberSets keeps them current).
struct NodeMembers {
  std::shared_ptr<const RankSet> set;  // world-sized; zero outside [word_lo, word_hi)
  int count = 0;
  int word_lo = 0;
  int word_hi = 0;
};

// One node (sidecar) of a job.
struct NodeState {
  std::string node_id;
  uint64_t session = 0;  // the coordinator's session id; 0: disconnected
  NodeSink* sink = nullptr;
  std::vector<int> ranks;  // sorted
  std::shared_ptr<const RankSet> rank_set;
  // rank_set->words() is zero outside [word_lo, word_hi).
  int word_lo = 0;
  int word_hi = 0;
  int64_t last_step = -1;         // the highest step it contributed to
  bool answers_progress = false;  // NodeHello.answers_progress
  // When its stream ended; InfiniteFuture while connected.
  absl::Time disconnected_at = absl::InfiniteFuture();
  // Per group; node_hash_map: sessions' batch records point at the values.
  absl::node_hash_map<std::string, NodeGroupState> groups;
  // Its ranks among each member set of the job that it serves a rank of.
  absl::flat_hash_map<const MemberSet*, NodeMembers> member_ranks;

  bool connected() const { return session != 0; }
  // Whether its stream ended and it has not come back (yet).
  bool lost() const { return session == 0 && disconnected_at != absl::InfiniteFuture(); }
};

// The nodes of one job and the owner of each rank. A rank is owned by at
// most one node; a connected node's ranks cannot be taken by another node,
// a disconnected node's can (the rank moved). Not thread-safe: the
// coordinator's lock guards it. NodeState addresses are stable.
class Membership {
 public:
  explicit Membership(int world_size);

  int world_size() const { return world_size_; }
  int connected() const { return connected_; }
  bool all_connected() const { return connected_ == static_cast<int>(nodes_.size()); }
  absl::node_hash_map<std::string, NodeState>& nodes() { return nodes_; }
  const absl::node_hash_map<std::string, NodeState>& nodes() const { return nodes_; }

  // The first of `ranks` that a connected node other than `node_id` serves
  // (-1: none): the DUPLICATE_RANK check of a NodeHello.
  int HeldElsewhere(absl::string_view node_id, const std::vector<int>& ranks) const;
  // Connects node `node_id` (created on first sight) on `session`, serving
  // exactly `ranks` (sorted, each in the world, checked with HeldElsewhere):
  // ranks it served before and no longer announces are released, ranks of
  // disconnected nodes move to it. Returns the node; `*replaced` is the
  // session it was still connected on (it reconnected before its old stream
  // was noticed as gone), 0 when none.
  NodeState& Connect(const std::string& node_id, const std::vector<int>& ranks, uint64_t session,
                     NodeSink* sink, bool answers_progress, uint64_t* replaced);
  // The node's stream ended at `now`.
  void Disconnect(NodeState& node, absl::Time now);

  enum class Join { kJoined, kAlreadyServed, kHeldElsewhere };
  // RankEvent(joined): `rank` (in the world) joined `node`'s sidecar.
  // kHeldElsewhere when a connected node serves it (nothing changes);
  // otherwise the rank no longer counts as left.
  Join JoinRank(NodeState& node, int rank);
  // RankEvent(left): `rank` of `node` left after `last_step`, for `cause`
  // (RankEvent.cause; empty: its stream to the node's sidecar ended). False
  // (nothing recorded) when `node` does not serve it.
  bool LeaveRank(const NodeState& node, int rank, int64_t last_step, std::string cause = "");

  // The node serving `rank` (nullptr: none).
  const NodeState* OwnerOf(int rank) const { return owner_[rank]; }
  // Whether `rank` left (RankEvent) since it joined, whatever step it left at.
  bool Left(int rank) const { return left_[rank]; }
  int left_count() const { return left_count_; }
  // Why `rank` left, as its RankEvent said ("" when it did not say, or the
  // rank did not leave).
  const std::string& LeftCause(int rank) const { return left_cause_[rank]; }
  // The lowest rank that left before reaching `step` (its RankEvent's last
  // step is earlier), so it can never submit `step`; -1 when none. O(1)
  // while no rank has left. With `members`, the lowest such member.
  int LeftBefore(int64_t step, const MemberSet* members = nullptr) const;
  // Whether `rank` is gone: it left, its node's stream is down, or no node
  // ever served it. A missing rank that is gone is at fault for a step that
  // cannot complete; a missing rank that is not may only be slower.
  bool Gone(int rank) const {
    return left_[rank] || owner_[rank] == nullptr || !owner_[rank]->connected();
  }
  // The last step `rank` reached: from its RankEvent when it left, or its
  // node's last contribution (-1: none).
  int64_t LastStep(int rank) const;
  // `rank` with its node and whether it is connected, for errors that name
  // missing ranks: `rank R (node "N", connected)`, `rank R (node "N", not
  // connected: it left its sidecar)`, `rank R (node "N", not connected: the
  // node's stream to the coordinator is down)` or `rank R (not connected: no
  // sidecar has announced it)`.
  std::string Describe(int rank) const;

 private:
  static void SetRankSet(NodeState& node, std::shared_ptr<const RankSet> set);
  // Moves `rank` from its current owner (if any) to `node`.
  void TakeRank(NodeState& node, int rank);

  const int world_size_;
  int connected_ = 0;
  absl::node_hash_map<std::string, NodeState> nodes_;
  std::vector<NodeState*> owner_;        // per rank
  std::vector<int64_t> left_step_;       // per rank, from RankEvent; -1: none
  std::vector<bool> left_;               // per rank: left (RankEvent) and not joined since
  std::vector<std::string> left_cause_;  // per rank: RankEvent.cause of its leave
  int left_count_ = 0;                   // ranks with left_ set
};

}  // namespace accord::daemon

#endif  // ACCORD_DAEMON_COORDINATOR_MEMBERSHIP_H_
