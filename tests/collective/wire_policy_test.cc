// The wire-dtype policy per backend (docs/GPU.md, "fp8"): Gloo reduces every
// wire dtype; NCCL refuses fp8 below sm_90, with an NCCL older than 2.24 (at
// build or run time), and without the saturation opt-in; ResolveWireDType
// widens a refused fp8 dtype when asked, for both backends.
#include "client/collective/wire_policy.h"

#include <optional>
#include <string>

#include "absl/strings/str_cat.h"
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

// The rule, stated independently of the implementation: NCCL reduces fp8
// only on sm_90+, with fp8 in nccl.h and an NCCL >= 2.24 loaded, and with the
// saturation opt-in; Gloo reduces everything.
bool NcclAccepts(DType d, const NcclRuntimeInfo& info, bool allow) {
  return !IsFp8(d) ||
         (info.cc_major >= 9 && info.built_with_fp8 && info.nccl_version >= 22400 && allow);
}

TEST(ResolveWireDTypeTest, EveryBackendDeviceVersionAndOptionGivesTheWireTheWidenedOrAnError) {
  const std::optional<DType> widenings[] = {std::nullopt, DType::kBFloat16, DType::kFloat16};
  for (Backend backend : {Backend::kGloo, Backend::kNccl}) {
    for (int cc : {7, 8, 9, 10}) {
      for (int version : {21805, 22304, 22400, 22809}) {
        for (bool built : {false, true}) {
          for (bool allow : {false, true}) {
            for (const std::optional<DType>& widen : widenings) {
              for (DType d : kAll) {
                const NcclRuntimeInfo info{0, cc, 0, version, built};
                const absl::StatusOr<DType> got =
                    ResolveWireDType(backend, d, info, Fp8Options{allow, widen});
                const std::string where =
                    absl::StrCat(backend == Backend::kGloo ? "gloo " : "nccl ", DTypeName(d),
                                 " sm_", cc, "0 v", version, " built=", built, " allow=", allow,
                                 " widen=", widen ? DTypeName(*widen) : "none");
                if (backend == Backend::kGloo || NcclAccepts(d, info, allow)) {
                  ASSERT_TRUE(got.ok()) << where << ": " << got.status();
                  EXPECT_EQ(*got, d) << where;
                } else if (widen.has_value()) {
                  ASSERT_TRUE(got.ok()) << where << ": " << got.status();
                  EXPECT_EQ(*got, *widen) << where;
                } else {
                  EXPECT_EQ(got.status().code(), absl::StatusCode::kFailedPrecondition) << where;
                }
              }
            }
          }
        }
      }
    }
  }
}

TEST(ResolveWireDTypeTest, NcclRefusalNamesTheDTypeCapabilityAndVersion) {
  const absl::StatusOr<DType> got =
      ResolveWireDType(Backend::kNccl, DType::kFloat8E4M3FN, A100(), Fp8Options{true, {}});
  ASSERT_EQ(got.status().code(), absl::StatusCode::kFailedPrecondition) << got.status();
  const std::string m(got.status().message());
  EXPECT_NE(m.find(std::string(DTypeName(DType::kFloat8E4M3FN))), std::string::npos) << m;
  EXPECT_NE(m.find("sm_80"), std::string::npos) << m;
  EXPECT_NE(m.find("NCCL 2.28.9"), std::string::npos) << m;
}

TEST(ResolveWireDTypeTest, WideningToAnythingButBf16OrFp16IsInvalidForBothBackends) {
  for (Backend backend : {Backend::kGloo, Backend::kNccl}) {
    for (DType widen : {DType::kFloat32, DType::kFloat64, DType::kFloat8E5M2}) {
      const absl::StatusOr<DType> got =
          ResolveWireDType(backend, DType::kFloat8E4M3FN, A100(), Fp8Options{false, widen});
      EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument) << got.status();
      EXPECT_NE(got.status().message().find(std::string(DTypeName(widen))), std::string::npos)
          << got.status();
    }
  }
}

TEST(ResolveWireDTypeTest, AnAcceptedFp8IsNotWidened) {
  const absl::StatusOr<DType> got = ResolveWireDType(Backend::kNccl, DType::kFloat8E5M2, H200(),
                                                     Fp8Options{true, DType::kBFloat16});
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, DType::kFloat8E5M2);
}

}  // namespace
}  // namespace accord
