// GroupReducer: one group's data path for one rank, step after step: check
// the decision's layout, pack, reduce-scatter, optionally unpack.
#ifndef ACCORD_CLIENT_COLLECTIVE_REDUCER_H_
#define ACCORD_CLIENT_COLLECTIVE_REDUCER_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "client/collective/collective.h"
#include "client/collective/scratch_buffer.h"
#include "core/decide.h"
#include "core/group.h"
#include "kernels/pack.h"

namespace accord {

// Not thread-safe: owned by the thread that runs the group's backward pass.
// The buffers are kept and reused while the layout does not grow.
class GroupReducer {
 public:
  enum class Device {
    kCpu,   // host memory: PackCpu + the collective (Gloo)
    kCuda,  // device memory: PackCuda on `stream` + the collective (NCCL)
  };
  struct Options {
    Device device = Device::kCpu;
    PackOptions pack;
    void* stream = nullptr;  // cudaStream_t for kCuda
  };

  GroupReducer(GroupSpec spec, Collective& collective, Options options);
  ~GroupReducer();
  GroupReducer(const GroupReducer&) = delete;
  GroupReducer& operator=(const GroupReducer&) = delete;

  // Packs `sources` as `decision` says and reduce-scatters. Errors:
  //  - FAILED_PRECONDITION when the decision's layout fingerprint is not the
  //    one this rank computes (names group, step and both fingerprints);
  //  - FAILED_PRECONDITION, before any work, when the device does not match
  //    the collective's backend (kCpu with Gloo, kCuda with NCCL), a kCuda
  //    gradient is not memory of the current device (host memory, another
  //    device), or the backend refuses the wire dtype
  //    (Collective::CheckWireDType);
  //  - the pack's INVALID_ARGUMENT, the collective's errors;
  //  - UNIMPLEMENTED for kCuda in a build without CUDA.
  absl::Status Reduce(const Decision& decision, absl::Span<const GradSource> sources);

  // Converts the last Reduce's shard into `targets` (see UnpackCpu).
  // FAILED_PRECONDITION for kCuda when a target is not memory of the current
  // device.
  absl::Status Unpack(absl::Span<const UnpackTarget> targets, const UnpackOptions& options = {});

  // The layout and this rank's reduced row (wire dtype) of the last Reduce.
  const Layout& layout() const { return layout_; }
  const void* shard() const { return shard_.data(); }

 private:
  // The checks before any work: backend, wire dtype, gradient placement and
  // the decision's layout fingerprint against this rank's.
  absl::Status CheckDecision(const Decision& decision, absl::Span<const GradSource> sources) const;
  absl::Status CheckBackend() const;
  // `pointers[i]` belongs to parameter i; `kind` names it in errors.
  absl::Status CheckPointers(absl::Span<const void* const> pointers, const char* kind) const;
  // The layout of `decision`, computed again only when its fingerprint changes.
  absl::Status UpdateLayout(const Decision& decision);

  const GroupSpec spec_;
  Collective& collective_;
  const Options options_;
  Layout layout_;
  bool have_layout_ = false;
  bool reduced_ = false;  // the last Reduce succeeded: `shard_` holds its row
  // The packed rows and this rank's reduced row, in host memory (kCpu) or
  // device memory (kCuda).
  ScratchBuffer packed_;
  ScratchBuffer shard_;
};

// The job's policy with each wire dtype it configures (the reduce dtype, the
// empty-group dtype) replaced by what `collective` reduces it in
// (Collective::WireDTypeFor): an fp8 dtype NCCL refuses becomes the widening
// dtype, so every rank's decision carries it. Every rank must pass the same
// policy to the coordinator, hence run on the same kind of device and NCCL.
// A policy without a reduce dtype can still decide an fp8 wire dtype when all
// of a group's gradients are fp8; GroupReducer::Reduce refuses that one.
// Errors: WireDTypeFor's, naming the policy field.
absl::StatusOr<Policy> PolicyForCollective(const Policy& policy, const Collective& collective);

}  // namespace accord

#endif  // ACCORD_CLIENT_COLLECTIVE_REDUCER_H_
