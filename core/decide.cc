#include "core/decide.h"

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

absl::StatusOr<Decision> Decide(const GroupSpec& spec, int world_size, const Manifest& merged,
                                const Policy& policy) {
  if (absl::Status s = ValidateManifest(merged, spec.group_id, spec.params.size(), world_size);
      !s.ok()) {
    return s;
  }
  if (!merged.ranks.Full()) {
    return absl::FailedPreconditionError(
        absl::StrCat("group \"", spec.group_id, "\" step ", merged.step,
                     ": cannot decide before every rank reported; missing ranks ",
                     FormatRanks(merged.ranks.Missing())));
  }
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
  d.layout_fingerprint = LayoutFingerprint(spec, world_size, d.included, d.wire_dtype);
  return d;
}

}  // namespace accord
