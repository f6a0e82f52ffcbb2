#include "daemon/coordinator/group_agreement.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "daemon/common/decision_errors.h"
#include "proto/wire.h"

namespace accord::daemon {
namespace {

// First parameter index where two specs differ (or the shorter count).
int FirstDifference(const GroupSpec& a, const GroupSpec& b) {
  const size_t n = std::min(a.params.size(), b.params.size());
  for (size_t i = 0; i < n; ++i) {
    if (!(a.params[i] == b.params[i])) return static_cast<int>(i);
  }
  return a.params.size() == b.params.size() ? -1 : static_cast<int>(n);
}

}  // namespace

GroupRegistration::GroupRegistration(int world_size, std::string job_id, std::string group_id)
    : world_size_(world_size),
      job_id_(std::move(job_id)),
      group_id_(std::move(group_id)),
      registered_(world_size) {}

GroupRegistration::Added GroupRegistration::Add(const GroupSpec& spec, const Policy& policy,
                                                const std::vector<int>& ranks) {
  const std::string policy_bytes = wire::PolicyToProto(policy).SerializeAsString();
  int variant = -1;
  for (size_t i = 0; i < variants_.size(); ++i) {
    if (variants_[i].spec == spec && variants_[i].policy_bytes == policy_bytes) {
      variant = static_cast<int>(i);
    }
  }
  if (variants_.empty()) members_ = spec.members;
  const bool same_members = SameMembers(spec.members.get(), members_.get());
  if (variant < 0) {
    variants_.push_back(RegVariant{spec, policy, policy_bytes, RankSet(world_size_)});
    variant = static_cast<int>(variants_.size()) - 1;
  }
  for (int r : ranks) {
    if (r < 0 || r >= world_size_) continue;
    variants_[variant].ranks.Add(r);
    if (same_members && (members_ == nullptr || members_->Contains(r)) &&
        !registered_.Contains(r)) {
      registered_.Add(r);
      ++registered_count_;
    }
  }
  Added added{variant, false};
  if (state_ == State::kCollecting && !same_members) {
    state_ = State::kFailed;
    error_ = MembersMismatchError(spec.members.get(), ranks);
    added.completed = true;
    return added;
  }
  if (state_ == State::kCollecting && registered_count_ == member_count()) {
    Complete();
    added.completed = true;
  }
  return added;
}

std::vector<int> GroupRegistration::Unregistered() const {
  if (members_ == nullptr) return registered_.Missing();
  std::vector<int> out;
  for (int r : members_->ranks()) {
    if (!registered_.Contains(r)) out.push_back(r);
  }
  return out;
}

std::vector<int> GroupRegistration::Registered() const {
  if (members_ == nullptr) return registered_.Members();
  std::vector<int> out;
  for (int r : members_->ranks()) {
    if (registered_.Contains(r)) out.push_back(r);
  }
  return out;
}

void GroupRegistration::Fail(v1::DecisionError error) {
  if (state_ != State::kCollecting) return;
  state_ = State::kFailed;
  error_ = std::move(error);
}

void GroupRegistration::Complete() {
  // The reference is the variant of the lowest rank.
  int ref = 0;
  int ref_rank = world_size_;
  for (size_t i = 0; i < variants_.size(); ++i) {
    std::vector<int> members = variants_[i].ranks.Members();
    if (!members.empty() && members[0] < ref_rank) {
      ref_rank = members[0];
      ref = static_cast<int>(i);
    }
  }
  if (variants_.size() == 1) {
    state_ = State::kAgreed;
    agreed_ = 0;
    fingerprint_ = SpecFingerprint(variants_[0].spec);
    return;
  }
  state_ = State::kFailed;
  error_ = MismatchError(ref, ref_rank);
}

v1::DecisionError GroupRegistration::MismatchError(int ref, int ref_rank) const {
  // Name the first other variant (by lowest rank) and every differing rank.
  int other = -1;
  int other_rank = world_size_;
  std::vector<int> differing;
  for (size_t i = 0; i < variants_.size(); ++i) {
    if (static_cast<int>(i) == ref) continue;
    std::vector<int> members = variants_[i].ranks.Members();
    differing.insert(differing.end(), members.begin(), members.end());
    if (!members.empty() && members[0] < other_rank) {
      other_rank = members[0];
      other = static_cast<int>(i);
    }
  }
  std::sort(differing.begin(), differing.end());
  const RegVariant& a = variants_[ref];
  const RegVariant& b = variants_[other];
  absl::Status cmp = CompareRegistration(a.spec, ref_rank, b.spec, other_rank);
  std::string detail;
  int param = -1;
  if (!cmp.ok()) {
    detail = std::string(cmp.message());
    param = FirstDifference(a.spec, b.spec);
  } else {
    detail = absl::StrCat("group \"", group_id_, "\": rank ", ref_rank, " and rank ", other_rank,
                          " registered different reduce policies (",
                          wire::PolicyToProto(a.policy).ShortDebugString(), " vs ",
                          wire::PolicyToProto(b.policy).ShortDebugString(), ")");
  }
  v1::DecisionError err =
      KindedError(v1::REGISTRATION_MISMATCH,
                  absl::StrCat("job ", job_id_, ": ", detail, "; ranks ", FormatRanks(differing),
                               " differ from rank ", ref_rank,
                               ". Every rank must build the same model and wrap it the same way"));
  err.set_job_id(job_id_);
  err.set_group_id(group_id_);
  err.set_step(-1);
  err.set_param_index(param);
  if (param >= 0 && param < static_cast<int>(a.spec.params.size())) {
    err.set_param_name(a.spec.params[param].name);
  } else if (param >= 0 && param < static_cast<int>(b.spec.params.size())) {
    err.set_param_name(b.spec.params[param].name);
  }
  err.add_ranks(ref_rank);
  for (int r : differing) err.add_ranks(r);
  return err;
}

v1::DecisionError GroupRegistration::MembersMismatchError(const MemberSet* other,
                                                          const std::vector<int>& ranks) const {
  const std::vector<int> first = variants_[0].ranks.Members();
  const int ref_rank = first.empty() ? -1 : first[0];
  const int other_rank = ranks.empty() ? -1 : ranks[0];
  v1::DecisionError err = KindedError(
      v1::REGISTRATION_MISMATCH,
      absl::StrCat("job ", job_id_, ": registration mismatch for group \"", group_id_, "\": rank ",
                   ref_rank, " registered it with members ", DescribeMembers(members_.get()),
                   ", rank ", other_rank, " with members ", DescribeMembers(other),
                   "; a group id must name one member set (accord.torch makes ids unique per "
                   "mesh; check that the ranks build the same meshes)"));
  err.set_job_id(job_id_);
  err.set_group_id(group_id_);
  err.set_step(-1);
  err.set_param_index(-1);
  if (ref_rank >= 0) err.add_ranks(ref_rank);
  for (int r : ranks) err.add_ranks(r);
  return err;
}

StepMerger::StepMerger(size_t num_params, int world_size, int64_t step)
    : world_size_(world_size), words_((world_size + 63) / 64, 0) {
  merged_.step = step;
  merged_.dtypes.assign(num_params, 0);
}

void StepMerger::Add(const Content& content) {
  const size_t n = std::min(merged_.dtypes.size(), content.dtypes.size());
  for (size_t i = 0; i < n; ++i) merged_.dtypes[i] |= content.dtypes[i];
  const std::vector<uint64_t>& w = content.ranks->words();
  const int hi = std::min<int>(content.word_hi, static_cast<int>(words_.size()));
  for (int i = content.word_lo; i < hi; ++i) words_[i] |= w[i];
}

absl::StatusOr<Decision> StepMerger::Decide(const RegVariant& agreed) {
  if (!RankSet::FromWords(world_size_, std::move(words_), &merged_.ranks)) {
    merged_.ranks = RankSet(world_size_);  // Decide reports every rank missing
  }
  return ::accord::Decide(agreed.spec, world_size_, merged_, agreed.policy);
}

}  // namespace accord::daemon
