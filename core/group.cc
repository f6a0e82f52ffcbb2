#include "core/group.h"

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "core/hash.h"

namespace accord {
namespace {

std::string Describe(const ParamSpec& p) {
  return absl::StrCat("\"", p.name, "\" (dim0=", p.dim0, ", numel=", p.numel, ")");
}

}  // namespace

absl::Status ValidateGroupSpec(const GroupSpec& spec) {
  if (spec.group_id.empty()) return absl::InvalidArgumentError("group id is empty");
  if (spec.params.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("group \"", spec.group_id, "\" has no parameters"));
  }
  if (static_cast<int64_t>(spec.params.size()) > kMaxParamsPerGroup) {
    return absl::InvalidArgumentError(absl::StrCat("group \"", spec.group_id, "\" has ",
                                                   spec.params.size(), " parameters; the limit is ",
                                                   kMaxParamsPerGroup));
  }
  absl::flat_hash_set<absl::string_view> names;
  for (size_t i = 0; i < spec.params.size(); ++i) {
    const ParamSpec& p = spec.params[i];
    auto where = [&] {
      return absl::StrCat("group \"", spec.group_id, "\" parameter ", i, " ", Describe(p));
    };
    if (p.name.empty()) return absl::InvalidArgumentError(absl::StrCat(where(), ": empty name"));
    if (!names.insert(p.name).second) {
      return absl::InvalidArgumentError(absl::StrCat(where(), ": name registered twice"));
    }
    if (p.dim0 < 0 || p.numel < 0) {
      return absl::InvalidArgumentError(absl::StrCat(where(), ": negative size"));
    }
    if (p.numel > kMaxParamNumel) {
      return absl::InvalidArgumentError(absl::StrCat(where(), ": numel above ", kMaxParamNumel));
    }
    if (p.dim0 == 0 && p.numel != 0) {
      return absl::InvalidArgumentError(absl::StrCat(where(), ": dim0 is 0 but numel is not"));
    }
    if (p.dim0 > 0 && p.numel % p.dim0 != 0) {
      return absl::InvalidArgumentError(absl::StrCat(where(), ": numel is not a multiple of dim0"));
    }
  }
  return absl::OkStatus();
}

absl::Status CompareRegistration(const GroupSpec& reference, int reference_rank,
                                 const GroupSpec& candidate, int candidate_rank) {
  auto prefix = [&] {
    return absl::StrCat("registration mismatch for group \"", reference.group_id,
                        "\" between rank ", reference_rank, " and rank ", candidate_rank, ": ");
  };
  if (reference.group_id != candidate.group_id) {
    return absl::FailedPreconditionError(
        absl::StrCat(prefix(), "group id \"", candidate.group_id, "\" on rank ", candidate_rank));
  }
  if (!SameMembers(reference.members.get(), candidate.members.get())) {
    return absl::FailedPreconditionError(absl::StrCat(
        prefix(), "rank ", reference_rank, " registered it with members ",
        DescribeMembers(reference.members.get()), ", rank ", candidate_rank, " with members ",
        DescribeMembers(candidate.members.get()),
        "; a group id must name one member set (accord.torch makes ids unique per mesh; check "
        "that the ranks build the same meshes)"));
  }
  const size_t n = std::min(reference.params.size(), candidate.params.size());
  for (size_t i = 0; i < n; ++i) {
    const ParamSpec& a = reference.params[i];
    const ParamSpec& b = candidate.params[i];
    if (!(a == b)) {
      return absl::FailedPreconditionError(
          absl::StrCat(prefix(), "parameter ", i, " is ", Describe(a), " on rank ", reference_rank,
                       " but ", Describe(b), " on rank ", candidate_rank,
                       "; check that every rank builds the same model and wraps it identically"));
    }
  }
  if (reference.params.size() != candidate.params.size()) {
    const bool ref_longer = reference.params.size() > candidate.params.size();
    const ParamSpec& extra = ref_longer ? reference.params[n] : candidate.params[n];
    return absl::FailedPreconditionError(
        absl::StrCat(prefix(), reference.params.size(), " parameters on rank ", reference_rank,
                     " but ", candidate.params.size(), " on rank ", candidate_rank,
                     "; first differing parameter ", n, " ", Describe(extra),
                     " exists only on rank ", ref_longer ? reference_rank : candidate_rank));
  }
  return absl::OkStatus();
}

uint64_t SpecFingerprint(const GroupSpec& spec) {
  StableHasher h;
  h.AddBytes(spec.group_id);
  h.AddU64(spec.params.size());
  for (const ParamSpec& p : spec.params) {
    h.AddBytes(p.name);
    h.AddU64(static_cast<uint64_t>(p.dim0));
    h.AddU64(static_cast<uint64_t>(p.numel));
  }
  if (spec.members) h.AddU64(spec.members->Fingerprint());
  return h.Finish();
}

uint64_t LayoutFingerprint(const GroupSpec& spec, int world_size, const std::vector<bool>& included,
                           DType wire_dtype) {
  StableHasher h;
  h.AddU64(static_cast<uint64_t>(world_size));
  h.AddU64(static_cast<uint64_t>(wire_dtype));
  h.AddU64(spec.params.size());
  for (size_t i = 0; i < spec.params.size(); ++i) {
    const bool inc = i < included.size() && included[i];
    h.AddU64((static_cast<uint64_t>(i) << 1) | (inc ? 1 : 0));
    h.AddU64(static_cast<uint64_t>(spec.params[i].dim0));
    h.AddU64(static_cast<uint64_t>(spec.params[i].numel));
  }
  return h.Finish();
}

absl::StatusOr<Layout> ComputeLayout(const GroupSpec& spec, int world_size,
                                     const std::vector<bool>& included, DType wire_dtype) {
  if (world_size < 1) {
    return absl::InvalidArgumentError(absl::StrCat("world size ", world_size, " is below 1"));
  }
  if (included.size() != spec.params.size()) {
    return absl::InvalidArgumentError(absl::StrCat("group \"", spec.group_id,
                                                   "\": ", included.size(), " inclusion flags for ",
                                                   spec.params.size(), " parameters"));
  }
  Layout layout;
  layout.world_size = world_size;
  layout.wire_dtype = wire_dtype;
  layout.params.resize(spec.params.size());
  int64_t offset = 0;
  for (size_t i = 0; i < spec.params.size(); ++i) {
    const ParamSpec& p = spec.params[i];
    ParamLayout& pl = layout.params[i];
    pl.included = included[i];
    pl.inner = p.dim0 > 0 ? p.numel / p.dim0 : 0;
    pl.padded_dim0 = (p.dim0 + world_size - 1) / world_size * world_size;
    pl.chunk_dim0 = pl.padded_dim0 / world_size;
    pl.chunk_numel = pl.chunk_dim0 * pl.inner;
    pl.row_offset = offset;
    if (pl.included) offset += pl.chunk_numel;
  }
  layout.row_numel = offset;
  layout.fingerprint = LayoutFingerprint(spec, world_size, included, wire_dtype);
  return layout;
}

}  // namespace accord
