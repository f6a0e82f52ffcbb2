// Floating-point dtypes that accord can put on the wire, and their names.
#ifndef ACCORD_CORE_DTYPE_H_
#define ACCORD_CORE_DTYPE_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include "absl/strings/string_view.h"

#include "absl/status/statusor.h"

namespace accord {

// The numeric values are part of the wire format (proto accord.v1.DType uses
// the same numbers) and of cache keys: never renumber.
enum class DType : uint8_t {
  kFloat8E4M3FN = 1,  // 1 sign, 4 exponent, 3 mantissa bits; no inf; one NaN pattern per sign.
  kFloat8E5M2 = 2,    // 1 sign, 5 exponent, 2 mantissa bits; IEEE-like (inf and NaNs).
  kFloat16 = 3,
  kBFloat16 = 4,
  kFloat32 = 5,
  kFloat64 = 6,
};

inline constexpr int kNumDTypes = 6;
inline constexpr DType kAllDTypes[kNumDTypes] = {DType::kFloat8E4M3FN, DType::kFloat8E5M2,
                                                 DType::kFloat16,      DType::kBFloat16,
                                                 DType::kFloat32,      DType::kFloat64};

// Size of one element in bytes.
size_t DTypeSize(DType dtype);

// Canonical lower-case name, as PyTorch spells it without "torch." ("bfloat16").
absl::string_view DTypeName(DType dtype);

// Parses a canonical name, a short alias ("bf16", "fp32", "e4m3") or a PyTorch
// name ("torch.float16"). Integer, bool and complex types, and anything unknown,
// are rejected with INVALID_ARGUMENT naming the input.
absl::StatusOr<DType> ParseDType(absl::string_view name);

// Converts a wire number (the enum's value) to a DType; INVALID_ARGUMENT for
// 0 (unset) or anything outside the float dtypes.
absl::StatusOr<DType> DTypeFromNumber(int number);

// A set of dtypes as a bitmask: bit (1 << value) for each member.
using DTypeMask = uint8_t;
inline constexpr DTypeMask MaskOf(DType d) {
  return static_cast<DTypeMask>(1u << static_cast<int>(d));
}
inline constexpr bool MaskHas(DTypeMask m, DType d) { return (m & MaskOf(d)) != 0; }
// Mask with every valid dtype bit set; any other bit is invalid.
inline constexpr DTypeMask kValidDTypeMask = 0x7e;
std::string DTypeMaskToString(DTypeMask mask);

}  // namespace accord

#endif  // ACCORD_CORE_DTYPE_H_
