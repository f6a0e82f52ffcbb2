// The decision function: what every rank packs for one group and step.
#ifndef ACCORD_CORE_DECIDE_H_
#define ACCORD_CORE_DECIDE_H_

#include <cstdint>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "core/group.h"
#include "core/lattice.h"
#include "core/manifest.h"

namespace accord {

// The job's reduce policy.
struct Policy {
  // The configured reduce dtype (FSDP2's reduce_dtype), if any.
  std::optional<DType> reduce_dtype;
  // When true the configured reduce dtype is the wire dtype even if narrower
  // than the gradients (the user chose it); the join then only decides when
  // nothing is configured. When false it joins with the gradient dtypes.
  bool reduce_dtype_exact = false;
  Fp8TieBreak fp8_tie = Fp8TieBreak::kBFloat16;
  // Wire dtype when no rank has any gradient and nothing is configured.
  DType empty_group_dtype = DType::kFloat32;
};

struct Decision {
  int64_t step = 0;
  DType wire_dtype = DType::kFloat32;
  // One flag per parameter: true when used on at least one rank (in the buffer;
  // ranks without a local gradient contribute zeros), false when used on no
  // rank (skipped: absent from the buffer, gradient stays empty).
  std::vector<bool> included;
  uint64_t layout_fingerprint = 0;

  std::vector<int> ZeroFillIndices() const;  // included parameters
  std::vector<int> SkipIndices() const;      // excluded parameters
  friend bool operator==(const Decision&, const Decision&) = default;
};

// Decides for a complete cluster manifest: one that covers exactly the
// spec's members (every rank of `world_size` when it has none). The layout
// fingerprint is over LayoutWorld(spec, world_size). Errors:
//  - INVALID_ARGUMENT: the manifest does not fit the spec (count, bits), a
//    rank outside the members contributed (names it), or the members belong
//    to another world size.
//  - FAILED_PRECONDITION: the manifest does not cover every member (names
//    the missing ones).
absl::StatusOr<Decision> Decide(const GroupSpec& spec, int world_size, const Manifest& merged,
                                const Policy& policy);

}  // namespace accord

#endif  // ACCORD_CORE_DECIDE_H_
