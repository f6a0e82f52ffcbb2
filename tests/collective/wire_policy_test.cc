// The wire-dtype policy per backend (docs/GPU.md, "fp8"): Gloo reduces every
// wire dtype; NCCL refuses fp8 below sm_90, with an NCCL older than 2.24 (at
// build or run time), and without the saturation opt-in.
#include "client/collective/wire_policy.h"

#include <string>

#include "gtest/gtest.h"

namespace accord {
namespace {

constexpr DType kAll[] = {DType::kFloat8E4M3FN, DType::kFloat8E5M2, DType::kFloat16,
                          DType::kBFloat16,     DType::kFloat32,    DType::kFloat64};

NcclRuntimeInfo H200() { return {0, 9, 0, 22809, true}; }
NcclRuntimeInfo A100() { return {1, 8, 0, 22809, true}; }

bool IsFp8(DType d) { return d == DType::kFloat8E4M3FN || d == DType::kFloat8E5M2; }

TEST(WirePolicyTest, GlooAcceptsEveryWireDType) {
  for (DType d : kAll) EXPECT_TRUE(GlooWireDTypeStatus(d).ok()) << DTypeName(d);
}

TEST(WirePolicyTest, NcclAcceptsNonFp8OnEveryDeviceAndVersion) {
  for (DType d : kAll) {
    if (IsFp8(d)) continue;
    EXPECT_TRUE(NcclWireDTypeStatus(d, A100(), false).ok()) << DTypeName(d);
    EXPECT_TRUE(NcclWireDTypeStatus(d, {0, 7, 0, 21805, false}, false).ok()) << DTypeName(d);
  }
}

TEST(WirePolicyTest, NcclRefusesFp8BelowSm90EvenWithTheOptIn) {
  for (DType d : {DType::kFloat8E4M3FN, DType::kFloat8E5M2}) {
    const absl::Status s = NcclWireDTypeStatus(d, A100(), /*allow_saturating_fp8=*/true);
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_NE(s.message().find("device 1 (sm_80"), std::string::npos) << s;
    EXPECT_NE(s.message().find("sm_90"), std::string::npos) << s;
  }
}

TEST(WirePolicyTest, NcclRefusesFp8WithAnOldLibraryAtBuildOrRunTime) {
  NcclRuntimeInfo old_runtime = H200();
  old_runtime.nccl_version = 22304;
  EXPECT_EQ(NcclWireDTypeStatus(DType::kFloat8E5M2, old_runtime, true).code(),
            absl::StatusCode::kFailedPrecondition);
  NcclRuntimeInfo old_headers = H200();
  old_headers.built_with_fp8 = false;
  EXPECT_EQ(NcclWireDTypeStatus(DType::kFloat8E5M2, old_headers, true).code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(WirePolicyTest, NcclRefusesFp8OnSm90UnlessSaturationIsAccepted) {
  const absl::Status s = NcclWireDTypeStatus(DType::kFloat8E5M2, H200(), false);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("saturates"), std::string::npos) << s;
  EXPECT_NE(s.message().find("nccl_allow_saturating_fp8"), std::string::npos) << s;
  EXPECT_TRUE(NcclWireDTypeStatus(DType::kFloat8E5M2, H200(), true).ok());
  EXPECT_TRUE(NcclWireDTypeStatus(DType::kFloat8E4M3FN, H200(), true).ok());
}

}  // namespace
}  // namespace accord
