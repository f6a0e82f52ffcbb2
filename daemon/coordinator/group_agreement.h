// What the ranks of a job agree on per group: the registration (the same
// spec and policy on every rank) and, per step, the decision computed from
// the node manifests (docs/ARCHITECTURE.md, "Classes").
#ifndef ACCORD_DAEMON_COORDINATOR_GROUP_AGREEMENT_H_
#define ACCORD_DAEMON_COORDINATOR_GROUP_AGREEMENT_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "accord/v1/accord.pb.h"
#include "core/decide.h"
#include "core/group.h"
#include "core/manifest.h"
#include "core/members.h"
#include "core/rank_set.h"
#include "daemon/coordinator/content.h"

namespace accord::daemon {

// A (spec, policy) some ranks registered.
struct RegVariant {
  GroupSpec spec;
  Policy policy;
  std::string policy_bytes;  // serialized ReducePolicy, for equality
  RankSet ranks;
};

// The registrations of one group by the ranks of a job. The group's members
// (null: every rank) are fixed by its first registration. Collecting until
// every member registered; then agreed (one variant: every node gets its
// fingerprint) or failed (REGISTRATION_MISMATCH naming the first differing
// parameter and the ranks that differ from the lowest rank's registration).
// A registration with another member set fails the group at once
// (REGISTRATION_MISMATCH naming both sets: a group id names one member set).
// A later registration is checked against the agreed variant. A group still
// collecting when it can no longer complete (a rank did not register it
// within the coordinator's deadline, or the job failed) is failed with the
// error its ranks get (Fail). Not thread-safe: the coordinator's lock guards
// it.
class GroupRegistration {
 public:
  enum class State { kCollecting, kAgreed, kFailed };
  struct Added {
    int variant = -1;        // the index of the registering ranks' variant
    bool completed = false;  // this registration completed it (kAgreed or kFailed now)
  };

  GroupRegistration(int world_size, std::string job_id, std::string group_id);

  // `ranks` (in the world, members of spec.members; the caller checks)
  // registered `spec` and `policy`. O(ranks): a registration costs its own
  // ranks, not the world (a job of 16,384 nodes re-registers 200 groups per
  // node after a coordinator restart).
  Added Add(const GroupSpec& spec, const Policy& policy, const std::vector<int>& ranks);
  Added Add(const GroupSpec& spec, const Policy& policy, const RankSet& ranks) {
    return Add(spec, policy, ranks.Members());
  }

  // kCollecting -> kFailed: the group can never complete; `error` is what
  // every rank that registered it gets, and what a later registration gets.
  // No effect in another state.
  void Fail(v1::DecisionError error);
  // The members that have not registered the group (ascending).
  std::vector<int> Unregistered() const;
  // The members that registered it (ascending).
  std::vector<int> Registered() const;
  // The group's members, fixed by its first registration (null: every rank,
  // or nothing registered yet).
  const std::shared_ptr<const MemberSet>& members() const { return members_; }
  // How many ranks must register it: the member count, or the world's.
  int member_count() const { return members_ ? members_->count() : world_size_; }

  State state() const { return state_; }
  // kAgreed: the agreed spec's fingerprint.
  uint64_t fingerprint() const { return fingerprint_; }
  // kFailed: the mismatch every rank gets.
  const v1::DecisionError& error() const { return error_; }
  // Whether `variant` is the agreed one (kAgreed).
  bool IsAgreed(int variant) const { return state_ == State::kAgreed && variant == agreed_; }
  // The agreed variant, or the first registered one before agreement.
  // Requires !empty().
  const RegVariant& reference() const { return variants_[agreed_ >= 0 ? agreed_ : 0]; }
  const RegVariant& variant(int i) const { return variants_[i]; }
  int variant_count() const { return static_cast<int>(variants_.size()); }
  bool empty() const { return variants_.empty(); }

 private:
  void Complete();
  v1::DecisionError MismatchError(int ref, int ref_rank) const;
  // A registration by `ranks` with members other than the group's.
  v1::DecisionError MembersMismatchError(const MemberSet* other,
                                         const std::vector<int>& ranks) const;

  const int world_size_;
  const std::string job_id_;
  const std::string group_id_;
  std::vector<RegVariant> variants_;
  std::shared_ptr<const MemberSet> members_;
  RankSet registered_;
  int registered_count_ = 0;  // ranks in registered_
  State state_ = State::kCollecting;
  int agreed_ = -1;
  uint64_t fingerprint_ = 0;
  v1::DecisionError error_;
};

// The OR-merge of one step's node contents and the decision on it.
class StepMerger {
 public:
  StepMerger(size_t num_params, int world_size, int64_t step);
  // Adds one node's content (its ranks and dtypes).
  void Add(const Content& content);
  // Core Decide on the merged manifest: the wire dtype and included set,
  // or why there is none (a rank missing, dtypes that do not reduce).
  absl::StatusOr<Decision> Decide(const RegVariant& agreed);

 private:
  const int world_size_;
  Manifest merged_;
  // A node's ranks are a few words of a world-sized set: OR only those.
  std::vector<uint64_t> words_;
};

}  // namespace accord::daemon

#endif  // ACCORD_DAEMON_COORDINATOR_GROUP_AGREEMENT_H_
