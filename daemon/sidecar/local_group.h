// One group's state in a Sidecar, split by concern: collecting the local
// ranks' steps (StepCollection), the node manifest the group last produced
// and whether the stream upstream holds it (NodeForm), what the ranks were
// given (Decided), and the steps decided here (LocalDecisionState, see
// local_decisions.cc). Plain data with small methods; the Sidecar holds them
// under its lock, all its groups in one LocalGroups.
#ifndef ACCORD_DAEMON_SIDECAR_LOCAL_GROUP_H_
#define ACCORD_DAEMON_SIDECAR_LOCAL_GROUP_H_

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/node_hash_map.h"
#include "absl/time/time.h"
#include "accord/v1/accord.pb.h"
#include "core/dtype.h"
#include "core/group.h"
#include "daemon/common/upstream_node.h"

namespace accord::daemon {

// One (group, step) being collected. Rows are per reporting rank, sorted by
// rank; storage is reused across steps (StepCollection::spare).
struct LocalStep {
  int64_t step = 0;
  bool sent = false;
  // When its first local rank submitted it, and whether it was reported to
  // the coordinator as partial on the current stream.
  absl::Time first_seen;
  bool partial_reported = false;
  std::vector<int> ranks;         // reporting ranks, ascending
  std::vector<DTypeMask> rows;    // ranks.size() x num_params dtype sets
  std::vector<DTypeMask> merged;  // OR of the rows
};

// A local rank's last full-form manifest content for a group, against which
// its repeat-form manifests are resolved.
struct LastFull {
  int rank = -1;
  uint64_t key = 0;
  std::vector<DTypeMask> dtypes;
};

// Collecting the local ranks' manifests of one group, step by step.
struct StepCollection {
  std::vector<LocalStep> steps;     // ascending step
  std::vector<LocalStep> spare;     // emptied steps, kept for their storage
  std::vector<LastFull> last_full;  // per local rank, ascending rank
  uint64_t touched_epoch = 0;       // HandleManifestsLocked dedup

  // The LocalStep for `step`, created (from spare storage) if absent.
  LocalStep& StepFor(int64_t step);
  // Drops every step <= `step`, keeping their storage.
  void DropUpTo(int64_t step);
  // A rank's last full-form content (null: none), and recording it.
  const LastFull* LastFullOf(int rank) const;
  void RememberFull(int rank, uint64_t key, const std::vector<DTypeMask>& dtypes);
  // Adds `rank`'s row `content` to `st` (kAdded), unless it has one: the
  // same (kSame) or another (kDiffers).
  enum class Row { kAdded, kSame, kDiffers };
  static Row AddRow(LocalStep& st, int rank, const std::vector<DTypeMask>& content);
};

// Fills `detail` with the ranks of `st` whose usage differs from its merge.
void UsageDetailOf(const LocalStep& st, size_t num_params, UsageDetail* detail);

// The last node manifest produced for the group (content, per-rank detail,
// whether it carried rank_bits, its full form), and whether the stream
// upstream holds it as this node's previous manifest (repeat form allowed).
struct NodeForm {
  uint64_t key = 0;
  std::vector<int> covered;
  std::vector<DTypeMask> merged;
  UsageDetail detail;
  bool with_ranks = false;
  std::shared_ptr<const v1::Manifest> full;
  uint64_t content_gen = 0;  // bumped when the content above changes
  RepeatFormOf<UsageDetail> repeat;
};

// What the group's ranks were given: the last decided step, its ok body (what
// a `same_as_previous` stands for), and its decision when it was an error,
// for a rank that submits that step only afterwards.
struct Decided {
  int64_t step = -1;
  std::optional<v1::DecisionOk> ok;
  std::optional<v1::Decision> error;

  // The one writer of the fields above: records a decision delivered to the
  // ranks. Returns the last decided step before it.
  int64_t Record(const v1::Decision& d);
};

// Local decisions (SidecarOptions::local_decisions): steps decided here that
// the coordinator has not decided yet, ascending, each with its DecisionOk's
// bytes; the bytes of the last local decision and the node content
// generation they were computed for; the coordinator's own last ok (what its
// `same_as_previous` stands for).
struct LocalDecisionState {
  struct Unconfirmed {
    int64_t step = 0;
    std::shared_ptr<const std::string> ok_bytes;
  };
  std::deque<Unconfirmed> unconfirmed;
  std::shared_ptr<const std::string> ok_bytes;
  uint64_t content_gen = 0;
  // Decided::ok holds these bytes (set by a local decision, reset by any
  // decision of the coordinator delivered as such).
  std::shared_ptr<const std::string> delivered;
  std::optional<std::string> coordinator_ok_bytes;
};

struct LocalGroup {
  std::string group_id;
  int index = 0;                     // dense, in registration order
  GroupSpec spec;                    // the first registration's, members included
  std::vector<int> ranks;            // local ranks that registered it, ascending
  GroupRegistrations registrations;  // as forwarded, for resends
  std::optional<v1::RegistrationResult> result;
  InflightManifests inflight;  // node manifests sent, undecided
  StepCollection collect;
  NodeForm form;
  Decided decided;
  LocalDecisionState local;

  // The group's members (null: every rank of the job).
  const MemberSet* members() const { return spec.members.get(); }
};

// A Sidecar's groups, by id and in registration order (LocalGroup::index).
class LocalGroups {
 public:
  // The group registered as `group_id`; null when none is.
  LocalGroup* Find(const std::string& group_id);
  // The group `group_id`, added with the next index when new.
  LocalGroup& FindOrAdd(const std::string& group_id);
  // Every group, by LocalGroup::index.
  const std::vector<LocalGroup*>& ordered() const { return order_; }
  size_t size() const { return order_.size(); }
  void Clear();

 private:
  // node_hash_map: LocalGroup addresses are stable (order_ points at them).
  absl::node_hash_map<std::string, LocalGroup> by_id_;
  std::vector<LocalGroup*> order_;
};

}  // namespace accord::daemon

#endif  // ACCORD_DAEMON_SIDECAR_LOCAL_GROUP_H_
