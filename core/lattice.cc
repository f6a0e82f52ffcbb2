#include "core/lattice.h"

#include "absl/strings/str_cat.h"

namespace accord {
namespace {

// up[d] = the set of dtypes d widens to losslessly (reflexive, transitive).
constexpr DTypeMask UpSet(DType d) {
  constexpr DTypeMask f64 = MaskOf(DType::kFloat64);
  constexpr DTypeMask f32 = MaskOf(DType::kFloat32) | f64;
  constexpr DTypeMask f16 = MaskOf(DType::kFloat16) | f32;
  constexpr DTypeMask bf16 = MaskOf(DType::kBFloat16) | f32;
  switch (d) {
    case DType::kFloat8E4M3FN:
      return MaskOf(DType::kFloat8E4M3FN) | f16 | bf16;
    case DType::kFloat8E5M2:
      return MaskOf(DType::kFloat8E5M2) | f16 | bf16;
    case DType::kFloat16:
      return f16;
    case DType::kBFloat16:
      return bf16;
    case DType::kFloat32:
      return f32;
    case DType::kFloat64:
      return f64;
  }
  return 0;
}

}  // namespace

bool IsLossless(DType from, DType to) { return MaskHas(UpSet(from), to); }

absl::StatusOr<DType> Join(DTypeMask set, Fp8TieBreak tie) {
  if (set == 0) return absl::InvalidArgumentError("cannot join an empty set of dtypes");
  if ((set & ~kValidDTypeMask) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("dtype set 0x", absl::Hex(set), " has bits that name no dtype"));
  }
  DTypeMask common = kValidDTypeMask;
  for (DType d : kAllDTypes) {
    if (MaskHas(set, d)) common &= UpSet(d);
  }
  // Minimal elements of `common`: members with no other member below them.
  DTypeMask minimal = 0;
  for (DType c : kAllDTypes) {
    if (!MaskHas(common, c)) continue;
    bool has_lower = false;
    for (DType o : kAllDTypes) {
      if (o != c && MaskHas(common, o) && IsLossless(o, c)) has_lower = true;
    }
    if (!has_lower) minimal |= MaskOf(c);
  }
  if (minimal == (MaskOf(DType::kFloat16) | MaskOf(DType::kBFloat16))) {
    return tie == Fp8TieBreak::kFloat16 ? DType::kFloat16 : DType::kBFloat16;
  }
  for (DType d : kAllDTypes) {
    if (minimal == MaskOf(d)) return d;
  }
  // Unreachable: fp64 bounds everything and the lattice has no other tie.
  return absl::InternalError(
      absl::StrCat("lattice has no unique join for ", DTypeMaskToString(set)));
}

DType Join(std::initializer_list<DType> dtypes, Fp8TieBreak tie) {
  DTypeMask m = 0;
  for (DType d : dtypes) m |= MaskOf(d);
  absl::StatusOr<DType> j = Join(m, tie);
  return j.ok() ? *j : DType::kFloat64;
}

}  // namespace accord
