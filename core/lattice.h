// The lossless widening lattice of docs/ARCHITECTURE.md ("Lossless lattice").
//
//   e4m3 ⊑ fp16, e4m3 ⊑ bf16, e5m2 ⊑ fp16, e5m2 ⊑ bf16,
//   fp16 ⊑ fp32, bf16 ⊑ fp32, fp32 ⊑ fp64, and transitively.
//
// A join is computed over a *set* of dtypes, not pairwise: with a tie-break a
// pairwise join is not associative (for example (e4m3 ∨ e5m2) ∨ fp16 would be
// bf16 ∨ fp16 = fp32, while e4m3 ∨ (e5m2 ∨ fp16) = fp16). The set join takes the
// upper bounds common to every member; when they have a least element that is
// the answer, and the only case with two minimal bounds (fp16 and bf16, when the
// set holds fp8 types and nothing wider) is broken by the rule below.
#ifndef ACCORD_CORE_LATTICE_H_
#define ACCORD_CORE_LATTICE_H_

#include <initializer_list>

#include "core/dtype.h"

namespace accord {

// How to break the one tie in the lattice: {e4m3, e5m2} has two minimal upper
// bounds, fp16 and bf16. bf16 is the default for its range.
enum class Fp8TieBreak : uint8_t {
  kBFloat16 = 0,
  kFloat16 = 1,
};

// True when every value of `from` (finite, inf, NaN) is exactly representable
// in `to`. Reflexive.
bool IsLossless(DType from, DType to);

// Least upper bound of a non-empty set of dtypes, given as a mask. Returns
// INVALID_ARGUMENT for an empty mask or invalid bits.
absl::StatusOr<DType> Join(DTypeMask set, Fp8TieBreak tie = Fp8TieBreak::kBFloat16);

// Convenience for a list of dtypes (order never matters).
DType Join(std::initializer_list<DType> dtypes, Fp8TieBreak tie = Fp8TieBreak::kBFloat16);

}  // namespace accord

#endif  // ACCORD_CORE_LATTICE_H_
