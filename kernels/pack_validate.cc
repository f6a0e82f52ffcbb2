#include "kernels/pack_validate.h"

#include <cstdint>

#include "absl/strings/str_cat.h"
#include "core/lattice.h"

namespace accord::kernels {
namespace {

bool ValidDType(DType d) {
  const int v = static_cast<int>(d);
  return v >= 1 && v <= kNumDTypes;
}

bool Aligned(const void* p, DType d) { return reinterpret_cast<uintptr_t>(p) % DTypeSize(d) == 0; }

absl::Status CheckLayout(const GroupSpec& spec, const Layout& layout, absl::string_view what) {
  if (layout.world_size < 1 || layout.params.size() != spec.params.size() ||
      !ValidDType(layout.wire_dtype)) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, " group \"", spec.group_id, "\": the layout (world size ", layout.world_size, ", ",
        layout.params.size(), " parameters) does not fit the spec (", spec.params.size(),
        " parameters); compute it with ComputeLayout for this spec"));
  }
  std::vector<bool> included(layout.params.size());
  for (size_t i = 0; i < included.size(); ++i) included[i] = layout.params[i].included;
  const uint64_t fp = LayoutFingerprint(spec, layout.world_size, included, layout.wire_dtype);
  if (fp != layout.fingerprint) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " group \"", spec.group_id, "\": layout fingerprint ",
                     layout.fingerprint, " is not the fingerprint of this spec and inclusion (", fp,
                     "); the layout was computed for another group or modified"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidatePack(const GroupSpec& spec, const Layout& layout,
                          absl::Span<const GradSource> sources, const void* out,
                          const PackOptions& options) {
  if (absl::Status s = CheckLayout(spec, layout, "pack:"); !s.ok()) return s;
  if (sources.size() != spec.params.size()) {
    return absl::InvalidArgumentError(absl::StrCat("pack: group \"", spec.group_id,
                                                   "\": ", sources.size(), " sources for ",
                                                   spec.params.size(), " parameters"));
  }
  if (layout.total_bytes() > 0 && out == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("pack: group \"", spec.group_id,
                                                   "\": output buffer is null but the layout has ",
                                                   layout.total_bytes(), " bytes"));
  }
  if (out != nullptr && !Aligned(out, layout.wire_dtype)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "pack: group \"", spec.group_id, "\": output buffer is not aligned to ",
        DTypeSize(layout.wire_dtype), " bytes (wire dtype ", DTypeName(layout.wire_dtype), ")"));
  }
  if (options.num_threads < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("pack: num_threads is ", options.num_threads, "; use 1 or more"));
  }
  for (size_t i = 0; i < sources.size(); ++i) {
    const GradSource& src = sources[i];
    if (!layout.params[i].included || src.data == nullptr) continue;
    const ParamSpec& p = spec.params[i];
    auto where = [&] {
      return absl::StrCat("pack: group \"", spec.group_id, "\" parameter ", i, " \"", p.name,
                          "\": ");
    };
    if (!ValidDType(src.dtype)) {
      return absl::InvalidArgumentError(absl::StrCat(where(), "source dtype number ",
                                                     static_cast<int>(src.dtype),
                                                     " is not a float dtype accord supports"));
    }
    if (!Aligned(src.data, src.dtype)) {
      return absl::InvalidArgumentError(absl::StrCat(where(), "source is not aligned to ",
                                                     DTypeSize(src.dtype), " bytes (",
                                                     DTypeName(src.dtype), ")"));
    }
    if (!options.allow_narrowing && !IsLossless(src.dtype, layout.wire_dtype)) {
      return absl::InvalidArgumentError(absl::StrCat(
          where(), "gradient dtype ", DTypeName(src.dtype),
          " does not widen losslessly to wire dtype ", DTypeName(layout.wire_dtype),
          "; the decision's wire dtype should cover it (check that this rank's manifest reported "
          "this dtype), or set allow_narrowing when the reduce dtype is exact"));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateUnpack(const GroupSpec& spec, const Layout& layout, int rank,
                            const void* shard, absl::Span<const UnpackTarget> targets) {
  if (absl::Status s = CheckLayout(spec, layout, "unpack:"); !s.ok()) return s;
  if (rank < 0 || rank >= layout.world_size) {
    return absl::InvalidArgumentError(absl::StrCat("unpack: group \"", spec.group_id, "\": rank ",
                                                   rank, " is outside world size ",
                                                   layout.world_size));
  }
  if (targets.size() != spec.params.size()) {
    return absl::InvalidArgumentError(absl::StrCat("unpack: group \"", spec.group_id,
                                                   "\": ", targets.size(), " targets for ",
                                                   spec.params.size(), " parameters"));
  }
  if (layout.row_numel > 0 && shard == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("unpack: group \"", spec.group_id,
                                                   "\": shard is null but a row has ",
                                                   layout.row_numel, " elements"));
  }
  if (shard != nullptr && !Aligned(shard, layout.wire_dtype)) {
    return absl::InvalidArgumentError(absl::StrCat("unpack: group \"", spec.group_id,
                                                   "\": shard is not aligned to ",
                                                   DTypeSize(layout.wire_dtype), " bytes"));
  }
  for (size_t i = 0; i < targets.size(); ++i) {
    const UnpackTarget& t = targets[i];
    if (t.data == nullptr) continue;
    const ParamSpec& p = spec.params[i];
    auto where = [&] {
      return absl::StrCat("unpack: group \"", spec.group_id, "\" parameter ", i, " \"", p.name,
                          "\": ");
    };
    if (!layout.params[i].included) {
      return absl::InvalidArgumentError(
          absl::StrCat(where(),
                       "is skipped in this layout (no rank has a gradient), so nothing can be "
                       "unpacked; pass a null target and leave its gradient empty"));
    }
    if (!ValidDType(t.dtype)) {
      return absl::InvalidArgumentError(absl::StrCat(where(), "target dtype number ",
                                                     static_cast<int>(t.dtype),
                                                     " is not a float dtype accord supports"));
    }
    if (!Aligned(t.data, t.dtype)) {
      return absl::InvalidArgumentError(
          absl::StrCat(where(), "target is not aligned to ", DTypeSize(t.dtype), " bytes"));
    }
  }
  return absl::OkStatus();
}

}  // namespace accord::kernels
