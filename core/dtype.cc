#include "core/dtype.h"

#include <algorithm>
#include <cctype>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace accord {

size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kFloat8E4M3FN:
    case DType::kFloat8E5M2:
      return 1;
    case DType::kFloat16:
    case DType::kBFloat16:
      return 2;
    case DType::kFloat32:
      return 4;
    case DType::kFloat64:
      return 8;
  }
  return 0;
}

absl::string_view DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kFloat8E4M3FN:
      return "float8_e4m3fn";
    case DType::kFloat8E5M2:
      return "float8_e5m2";
    case DType::kFloat16:
      return "float16";
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kFloat32:
      return "float32";
    case DType::kFloat64:
      return "float64";
  }
  return "invalid";
}

absl::StatusOr<DType> ParseDType(absl::string_view name) {
  std::string s(name);
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  absl::string_view v = s;
  if (v.substr(0, 6) == "torch.") v.remove_prefix(6);
  struct Alias {
    absl::string_view name;
    DType dtype;
  };
  static constexpr Alias kAliases[] = {
      {"float8_e4m3fn", DType::kFloat8E4M3FN},
      {"e4m3", DType::kFloat8E4M3FN},
      {"fp8_e4m3", DType::kFloat8E4M3FN},
      {"e4m3fn", DType::kFloat8E4M3FN},
      {"float8_e5m2", DType::kFloat8E5M2},
      {"e5m2", DType::kFloat8E5M2},
      {"fp8_e5m2", DType::kFloat8E5M2},
      {"float16", DType::kFloat16},
      {"half", DType::kFloat16},
      {"fp16", DType::kFloat16},
      {"f16", DType::kFloat16},
      {"bfloat16", DType::kBFloat16},
      {"bf16", DType::kBFloat16},
      {"float32", DType::kFloat32},
      {"float", DType::kFloat32},
      {"fp32", DType::kFloat32},
      {"f32", DType::kFloat32},
      {"float64", DType::kFloat64},
      {"double", DType::kFloat64},
      {"fp64", DType::kFloat64},
      {"f64", DType::kFloat64},
  };
  for (const Alias& a : kAliases) {
    if (a.name == v) return a.dtype;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unsupported gradient dtype \"", name,
      "\": accord reduces floating-point gradients only (float8_e4m3fn, float8_e5m2, float16, "
      "bfloat16, float32, float64); integer, bool and complex tensors cannot be reduce-scattered "
      "as gradients"));
}

absl::StatusOr<DType> DTypeFromNumber(int number) {
  if (number >= 1 && number <= kNumDTypes) return static_cast<DType>(number);
  if (number == 0) {
    return absl::InvalidArgumentError("dtype is unset (0); every gradient needs a float dtype");
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "dtype number ", number,
      " is not a float dtype accord can reduce (valid: 1..6, float8_e4m3fn..float64)"));
}

std::string DTypeMaskToString(DTypeMask mask) {
  std::vector<absl::string_view> names;
  for (DType d : kAllDTypes) {
    if (MaskHas(mask, d)) names.push_back(DTypeName(d));
  }
  if (names.empty()) return "{}";
  return absl::StrCat("{", absl::StrJoin(names, ","), "}");
}

}  // namespace accord
