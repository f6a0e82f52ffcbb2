#include "core/decide.h"

#include <bit>

#include "absl/strings/str_cat.h"

namespace accord {

std::vector<int> Decision::ZeroFillIndices() const {
  std::vector<int> out;
  for (size_t i = 0; i < included.size(); ++i) {
    if (included[i]) out.push_back(static_cast<int>(i));
  }
  return out;
}

std::vector<int> Decision::SkipIndices() const {
  std::vector<int> out;
  for (size_t i = 0; i < included.size(); ++i) {
    if (!included[i]) out.push_back(static_cast<int>(i));
  }
  return out;
}

namespace {

// The merge covers exactly the group's members (every rank when it has none).
absl::Status CheckComplete(const GroupSpec& spec, int world_size, const Manifest& merged) {
  const MemberSet* members = spec.members.get();
  if (members == nullptr) {
    if (merged.ranks.Full()) return absl::OkStatus();
    return absl::FailedPreconditionError(
        absl::StrCat("group \"", spec.group_id, "\" step ", merged.step,
                     ": cannot decide before every rank reported; missing ranks ",
                     FormatRanks(merged.ranks.Missing())));
  }
  if (members->world_size() != world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("group \"", spec.group_id, "\": members of a job of ", members->world_size(),
                     " ranks, job has ", world_size));
  }
  const std::vector<uint64_t>& got = merged.ranks.words();
  const std::vector<uint64_t>& want = members->rank_set().words();
  for (size_t w = 0; w < got.size(); ++w) {
    if (const uint64_t outside = got[w] & ~want[w]; outside != 0) {
      const int rank = static_cast<int>(w * 64) + std::countr_zero(outside);
      return absl::InvalidArgumentError(
          absl::StrCat("group \"", spec.group_id, "\" step ", merged.step, ": rank ", rank,
                       " contributed but is not a member (", members->Describe(), ")"));
    }
  }
  if (merged.ranks == members->rank_set()) return absl::OkStatus();
  std::vector<int> missing;
  for (int r : members->ranks()) {
    if (!merged.ranks.Contains(r)) missing.push_back(r);
  }
  return absl::FailedPreconditionError(
      absl::StrCat("group \"", spec.group_id, "\" step ", merged.step,
                   ": cannot decide before every member reported; missing ranks ",
                   FormatRanks(missing), " of ", members->Describe()));
}

}  // namespace

absl::StatusOr<Decision> Decide(const GroupSpec& spec, int world_size, const Manifest& merged,
                                const Policy& policy) {
  if (absl::Status s = ValidateManifest(merged, spec.group_id, spec.params.size(), world_size);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = CheckComplete(spec, world_size, merged); !s.ok()) return s;
  Decision d;
  d.step = merged.step;
  d.included.resize(spec.params.size());
  DTypeMask seen = 0;
  for (size_t i = 0; i < spec.params.size(); ++i) {
    d.included[i] = merged.dtypes[i] != 0;
    seen |= merged.dtypes[i];
  }
  if (policy.reduce_dtype && policy.reduce_dtype_exact) {
    d.wire_dtype = *policy.reduce_dtype;
  } else {
    DTypeMask set = seen;
    if (policy.reduce_dtype) set |= MaskOf(*policy.reduce_dtype);
    if (set == 0) {
      d.wire_dtype = policy.empty_group_dtype;
    } else {
      absl::StatusOr<DType> j = Join(set, policy.fp8_tie);
      if (!j.ok()) return j.status();
      d.wire_dtype = *j;
    }
  }
  d.layout_fingerprint =
      LayoutFingerprint(spec, LayoutWorld(spec, world_size), d.included, d.wire_dtype);
  return d;
}

}  // namespace accord
