// Which wire dtypes a backend reduces with accord's sum semantics
// (docs/GPU.md, "fp8"). Pure functions: the NCCL backend feeds them the
// device and library it found at Create; tests feed them any.
#ifndef ACCORD_CLIENT_COLLECTIVE_WIRE_POLICY_H_
#define ACCORD_CLIENT_COLLECTIVE_WIRE_POLICY_H_

#include <optional>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/dtype.h"

namespace accord {

enum class Backend { kGloo, kNccl };

// What the NCCL backend runs on, read at runtime when the communicator is
// made (not from compile-time macros alone).
struct NcclRuntimeInfo {
  int device = 0;    // CUDA device ordinal
  int cc_major = 0;  // compute capability
  int cc_minor = 0;
  int nccl_version = 0;         // ncclGetVersion(): 22809 for 2.28.9
  bool built_with_fp8 = false;  // nccl.h at build time had ncclFloat8e4m3/e5m2 (>= 2.24)
};

// NCCL's first version with fp8 reductions, and the compute capability it
// needs for them.
inline constexpr int kNcclFp8MinVersion = 22400;
inline constexpr int kNcclFp8MinCcMajor = 9;

// What the NCCL backend does with an fp8 wire dtype (CollectiveOptions).
struct Fp8Options {
  // Accept NCCL's saturating fp8 sum where the device and NCCL support fp8.
  bool allow_saturating = false;
  // Widen an fp8 wire dtype NCCL refuses to this dtype (kBFloat16 or
  // kFloat16, as the lattice's fp8 tie-break does) instead of refusing it.
  std::optional<DType> widen_to;
};

// OK or FAILED_PRECONDITION (naming device, capability, NCCL version and what
// to use instead). fp8 needs sm_90+, NCCL >= 2.24 at build and run time, and
// `allow_saturating_fp8` (NCCL saturates where accord's sum gives inf/NaN).
absl::Status NcclWireDTypeStatus(DType wire, const NcclRuntimeInfo& info,
                                 bool allow_saturating_fp8);

// The Gloo backend reduces every wire dtype with accord's semantics
// (client/collective/sum_reduce.h): always OK.
absl::Status GlooWireDTypeStatus(DType wire);

// The wire dtype `backend` reduces a decision's `wire` in: `wire` itself when
// the backend reduces it with accord's sum semantics (always for Gloo, whose
// `info` is ignored); for NCCL, an fp8 `wire` it refuses becomes
// `fp8.widen_to` when set, else FAILED_PRECONDITION (NcclWireDTypeStatus).
// INVALID_ARGUMENT when `fp8.widen_to` is set to anything but bf16 or fp16.
absl::StatusOr<DType> ResolveWireDType(Backend backend, DType wire, const NcclRuntimeInfo& info,
                                       const Fp8Options& fp8);

}  // namespace accord

#endif  // ACCORD_CLIENT_COLLECTIVE_WIRE_POLICY_H_
