// DType names, parsing, wire numbers and masks.
#include "core/dtype.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace accord {
namespace {

using ::testing::HasSubstr;

TEST(DTypeTest, WireNumbersAreStable) {
  // Part of the wire format and of cache keys: never renumber.
  EXPECT_EQ(static_cast<int>(DType::kFloat8E4M3FN), 1);
  EXPECT_EQ(static_cast<int>(DType::kFloat8E5M2), 2);
  EXPECT_EQ(static_cast<int>(DType::kFloat16), 3);
  EXPECT_EQ(static_cast<int>(DType::kBFloat16), 4);
  EXPECT_EQ(static_cast<int>(DType::kFloat32), 5);
  EXPECT_EQ(static_cast<int>(DType::kFloat64), 6);
  DTypeMask all = 0;
  for (DType d : kAllDTypes) all |= MaskOf(d);
  EXPECT_EQ(all, kValidDTypeMask);
}

TEST(DTypeTest, Sizes) {
  EXPECT_EQ(DTypeSize(DType::kFloat8E4M3FN), 1u);
  EXPECT_EQ(DTypeSize(DType::kFloat8E5M2), 1u);
  EXPECT_EQ(DTypeSize(DType::kFloat16), 2u);
  EXPECT_EQ(DTypeSize(DType::kBFloat16), 2u);
  EXPECT_EQ(DTypeSize(DType::kFloat32), 4u);
  EXPECT_EQ(DTypeSize(DType::kFloat64), 8u);
}

TEST(DTypeTest, CanonicalNamesRoundTrip) {
  for (DType d : kAllDTypes) {
    absl::StatusOr<DType> p = ParseDType(DTypeName(d));
    ASSERT_TRUE(p.ok()) << DTypeName(d) << ": " << p.status();
    EXPECT_EQ(*p, d);
    p = ParseDType(std::string("torch.") + std::string(DTypeName(d)));
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_EQ(*p, d);
  }
}

TEST(DTypeTest, AliasesAndCase) {
  EXPECT_EQ(*ParseDType("bf16"), DType::kBFloat16);
  EXPECT_EQ(*ParseDType("BF16"), DType::kBFloat16);
  EXPECT_EQ(*ParseDType("torch.BFloat16"), DType::kBFloat16);
  EXPECT_EQ(*ParseDType("half"), DType::kFloat16);
  EXPECT_EQ(*ParseDType("fp16"), DType::kFloat16);
  EXPECT_EQ(*ParseDType("float"), DType::kFloat32);
  EXPECT_EQ(*ParseDType("double"), DType::kFloat64);
  EXPECT_EQ(*ParseDType("e4m3"), DType::kFloat8E4M3FN);
  EXPECT_EQ(*ParseDType("e5m2"), DType::kFloat8E5M2);
  EXPECT_EQ(*ParseDType("torch.float8_e4m3fn"), DType::kFloat8E4M3FN);
}

TEST(DTypeTest, NonFloatDTypesAreRejectedByName) {
  for (const char* name : {"int32", "bool", "complex64", "torch.int64", "uint8", "int8",
                           "torch.complex128", "float128", "", "torch.", "float8_e4m3fnuz"}) {
    absl::StatusOr<DType> p = ParseDType(name);
    ASSERT_FALSE(p.ok()) << name;
    EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument) << name;
    EXPECT_THAT(p.status().message(), HasSubstr(std::string("\"") + name + "\"")) << name;
    EXPECT_THAT(p.status().message(), HasSubstr("floating-point gradients only")) << name;
  }
}

TEST(DTypeTest, FromNumber) {
  for (DType d : kAllDTypes) EXPECT_EQ(*DTypeFromNumber(static_cast<int>(d)), d);
  absl::Status unset = DTypeFromNumber(0).status();
  EXPECT_EQ(unset.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(unset.message(), HasSubstr("unset"));
  for (int n : {7, 19, -1, 255}) {
    absl::Status s = DTypeFromNumber(n).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << n;
    EXPECT_THAT(s.message(), HasSubstr("dtype number " + std::to_string(n))) << n;
  }
}

TEST(DTypeTest, MaskHelpers) {
  const DTypeMask m = MaskOf(DType::kFloat16) | MaskOf(DType::kFloat32);
  EXPECT_TRUE(MaskHas(m, DType::kFloat16));
  EXPECT_FALSE(MaskHas(m, DType::kBFloat16));
  EXPECT_EQ(DTypeMaskToString(m), "{float16,float32}");
  EXPECT_EQ(DTypeMaskToString(0), "{}");
}

}  // namespace
}  // namespace accord
