// Groups (one reduce-scatter each) and their FSDP2-style buffer layout.
#ifndef ACCORD_CORE_GROUP_H_
#define ACCORD_CORE_GROUP_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/dtype.h"
#include "core/members.h"

namespace accord {

// One parameter of a group, as registered. `dim0` is the size of its first
// dimension (the one FSDP2 shards), `numel` its element count. A parameter with
// dim0 == 0 has numel == 0; otherwise numel is a multiple of dim0.
struct ParamSpec {
  std::string name;
  int64_t dim0 = 0;
  int64_t numel = 0;

  friend bool operator==(const ParamSpec&, const ParamSpec&) = default;
};

// An ordered list of parameters reduce-scattered together. Registered once per
// job by every member; every member must register the identical spec.
struct GroupSpec {
  std::string group_id;
  std::vector<ParamSpec> params;
  // The ranks that reduce the group; null: every rank of the job (a set of
  // every rank is held as null, see MembersOf).
  std::shared_ptr<const MemberSet> members;

  // Members compare by value.
  friend bool operator==(const GroupSpec& a, const GroupSpec& b) {
    return a.group_id == b.group_id && a.params == b.params &&
           SameMembers(a.members.get(), b.members.get());
  }
};

// The world a group's layout is computed over: its member count, or
// `world_size` (the job's) when the spec has no members.
inline int LayoutWorld(const GroupSpec& spec, int world_size) {
  return spec.members ? spec.members->count() : world_size;
}

// Limits enforced by ValidateGroupSpec.
inline constexpr int64_t kMaxParamsPerGroup = 1 << 20;
inline constexpr int64_t kMaxParamNumel = int64_t{1} << 48;

// Checks a spec is well formed: non-empty id, at least one parameter, unique
// non-empty names, dim0 >= 0, numel >= 0, numel a multiple of dim0, numel == 0
// when dim0 == 0. INVALID_ARGUMENT naming the group and parameter otherwise.
absl::Status ValidateGroupSpec(const GroupSpec& spec);

// Compares a rank's registration with the reference one. OK when identical;
// otherwise FAILED_PRECONDITION naming the group, the two ranks, and the two
// member sets when they differ, else the first differing parameter (index and
// both names/sizes) or the differing count.
absl::Status CompareRegistration(const GroupSpec& reference, int reference_rank,
                                 const GroupSpec& candidate, int candidate_rank);

// A deterministic 64-bit fingerprint of the spec (ids, names, sizes, order,
// and the members' Fingerprint() when the spec has members; a spec without
// members has the fingerprint it had before members existed). The same on
// every machine and build.
uint64_t SpecFingerprint(const GroupSpec& spec);

// Where one parameter sits in the reduce-scatter buffer.
struct ParamLayout {
  bool included = false;    // false: skipped, no bytes in the buffer
  int64_t inner = 0;        // elements per dim-0 slice (numel / dim0; 0 when dim0 == 0)
  int64_t padded_dim0 = 0;  // dim0 rounded up to a multiple of the world size
  int64_t chunk_dim0 = 0;   // padded_dim0 / world_size: dim-0 slices per row
  int64_t chunk_numel = 0;  // chunk_dim0 * inner: elements of this parameter per row
  int64_t row_offset = 0;   // element offset of this parameter's chunk within each row
};

// FSDP2's reduce-scatter input: W rows; row r is the concatenation, in group
// order, of every included parameter's chunk r (dim 0 padded to a multiple of
// W, then split in W equal chunks). Rank r receives row r.
struct Layout {
  int world_size = 0;
  DType wire_dtype = DType::kFloat32;
  int64_t row_numel = 0;  // elements per row (= the shard each rank receives)
  std::vector<ParamLayout> params;
  uint64_t fingerprint = 0;  // LayoutFingerprint of the above

  int64_t total_numel() const { return row_numel * world_size; }
  int64_t total_bytes() const {
    return total_numel() * static_cast<int64_t>(DTypeSize(wire_dtype));
  }
  // Element offset of parameter `i`'s chunk in row `r` of the whole buffer.
  int64_t ChunkOffset(size_t i, int r) const { return r * row_numel + params[i].row_offset; }
};

// Computes the layout for the given included set (one flag per parameter, in
// group order) over `world_size` rows (a group's LayoutWorld).
// INVALID_ARGUMENT when world_size < 1 or the flag count differs from the
// parameter count.
absl::StatusOr<Layout> ComputeLayout(const GroupSpec& spec, int world_size,
                                     const std::vector<bool>& included, DType wire_dtype);

// The fingerprint every rank checks before launching the collective: a hash of
// the layout's world size (the group's LayoutWorld), the wire dtype, and each
// parameter's index, inclusion, dim0 and numel, in order.
uint64_t LayoutFingerprint(const GroupSpec& spec, int world_size, const std::vector<bool>& included,
                           DType wire_dtype);

}  // namespace accord

#endif  // ACCORD_CORE_GROUP_H_
