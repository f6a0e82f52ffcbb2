#include "client/collective/wire_policy.h"

#include "absl/strings/str_cat.h"

namespace accord {
namespace {

bool IsFp8(DType d) { return d == DType::kFloat8E4M3FN || d == DType::kFloat8E5M2; }

std::string VersionString(int v) {
  return absl::StrCat(v / 10000, ".", (v / 100) % 100, ".", v % 100);
}

}  // namespace

absl::Status NcclWireDTypeStatus(DType wire, const NcclRuntimeInfo& info,
                                 bool allow_saturating_fp8) {
  if (!IsFp8(wire)) return absl::OkStatus();
  const std::string where =
      absl::StrCat("nccl: wire dtype ", DTypeName(wire), " on device ", info.device, " (sm_",
                   info.cc_major, info.cc_minor, ", NCCL ", VersionString(info.nccl_version), ")");
  if (info.cc_major < kNcclFp8MinCcMajor) {
    return absl::FailedPreconditionError(
        absl::StrCat(where,
                     ": NCCL reduces fp8 only on sm_90 and newer; use a bf16 or fp16 wire dtype on "
                     "this device (the group's reduce dtype), or the Gloo backend"));
  }
  if (!info.built_with_fp8 || info.nccl_version < kNcclFp8MinVersion) {
    return absl::FailedPreconditionError(
        absl::StrCat(where, ": fp8 reductions need NCCL >= 2.24 both in nccl.h at build time (",
                     info.built_with_fp8 ? "yes" : "no",
                     ") and in the loaded libnccl; upgrade NCCL or use a "
                     "bf16 or fp16 wire dtype"));
  }
  if (!allow_saturating_fp8) {
    return absl::FailedPreconditionError(absl::StrCat(
        where,
        ": NCCL's fp8 sum saturates (e4m3 to +-448, e5m2 to +-57344: an overflow or an "
        "inf a loss scaler must see becomes finite) while accord's fp8 sum gives inf/NaN "
        "as the Gloo backend does (docs/GPU.md, \"fp8\"); use a bf16 or fp16 wire dtype, "
        "or set CollectiveOptions::nccl_allow_saturating_fp8 to accept saturation"));
  }
  return absl::OkStatus();
}

absl::Status GlooWireDTypeStatus(DType) { return absl::OkStatus(); }

absl::StatusOr<DType> ResolveWireDType(Backend backend, DType wire, const NcclRuntimeInfo& info,
                                       const Fp8Options& fp8) {
  if (fp8.widen_to.has_value() && *fp8.widen_to != DType::kBFloat16 &&
      *fp8.widen_to != DType::kFloat16) {
    return absl::InvalidArgumentError(
        absl::StrCat("collective: fp8 may widen only to bf16 or fp16 (the lattice's fp8 "
                     "tie-break), not to ",
                     DTypeName(*fp8.widen_to)));
  }
  if (backend == Backend::kGloo) {
    if (absl::Status s = GlooWireDTypeStatus(wire); !s.ok()) return s;
    return wire;
  }
  absl::Status s = NcclWireDTypeStatus(wire, info, fp8.allow_saturating);
  if (s.ok()) return wire;
  if (IsFp8(wire) && fp8.widen_to.has_value()) return *fp8.widen_to;
  return s;
}

}  // namespace accord
