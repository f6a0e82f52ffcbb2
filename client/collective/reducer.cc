#include "client/collective/reducer.h"

#include <utility>

#include "absl/strings/str_cat.h"
#if ACCORD_WITH_CUDA_KERNELS
#include "kernels/pack_cuda.h"
#endif

namespace accord {

GroupReducer::GroupReducer(GroupSpec spec, Collective& collective, Options options)
    : spec_(std::move(spec)), collective_(collective), options_(options) {}

GroupReducer::~GroupReducer() {
#if ACCORD_WITH_CUDA_KERNELS
  DeviceFree(device_packed_);
  DeviceFree(device_shard_);
#endif
}

absl::Status GroupReducer::Reserve(size_t packed_bytes, size_t shard_bytes) {
  if (options_.device == Device::kCpu) {
    if (host_packed_.size() < packed_bytes) host_packed_.resize(packed_bytes);
    if (host_shard_.size() < shard_bytes) host_shard_.resize(shard_bytes);
    packed_ = host_packed_.data();
    shard_ = host_shard_.data();
    return absl::OkStatus();
  }
#if ACCORD_WITH_CUDA_KERNELS
  if (device_packed_bytes_ < packed_bytes) {
    DeviceFree(device_packed_);
    device_packed_ = nullptr;
    device_packed_bytes_ = 0;
    absl::StatusOr<void*> p = DeviceAlloc(packed_bytes);
    if (!p.ok()) return p.status();
    device_packed_ = *p;
    device_packed_bytes_ = packed_bytes;
  }
  if (device_shard_bytes_ < shard_bytes) {
    DeviceFree(device_shard_);
    device_shard_ = nullptr;
    device_shard_bytes_ = 0;
    absl::StatusOr<void*> p = DeviceAlloc(shard_bytes);
    if (!p.ok()) return p.status();
    device_shard_ = *p;
    device_shard_bytes_ = shard_bytes;
  }
  packed_ = device_packed_;
  shard_ = device_shard_;
  return absl::OkStatus();
#else
  return absl::UnimplementedError(absl::StrCat(
      "group \"", spec_.group_id, "\": CUDA device requested but this build has no CUDA kernels"));
#endif
}

absl::Status GroupReducer::Reduce(const Decision& decision, absl::Span<const GradSource> sources) {
  reduced_ = false;
  const int w = collective_.world_size();
  const uint64_t mine = LayoutFingerprint(spec_, w, decision.included, decision.wire_dtype);
  if (mine != decision.layout_fingerprint) {
    return absl::FailedPreconditionError(absl::StrCat(
        "group \"", spec_.group_id, "\" step ", decision.step, " on rank ", collective_.rank(),
        ": the decision's layout fingerprint ", decision.layout_fingerprint,
        " differs from this rank's ", mine, " (world size ", w, ", wire dtype ",
        DTypeName(decision.wire_dtype),
        "); this rank registered a different group spec or world size than the coordinator "
        "used; not launching the collective"));
  }
  if (!have_layout_ || layout_.fingerprint != mine) {
    absl::StatusOr<Layout> layout = ComputeLayout(spec_, w, decision.included, decision.wire_dtype);
    if (!layout.ok()) return layout.status();
    layout_ = *std::move(layout);
    have_layout_ = true;
  }
  const size_t esize = DTypeSize(layout_.wire_dtype);
  if (absl::Status s = Reserve(static_cast<size_t>(layout_.total_bytes()),
                               static_cast<size_t>(layout_.row_numel) * esize);
      !s.ok()) {
    return s;
  }
  absl::Status packed;
  if (options_.device == Device::kCpu) {
    packed = PackCpu(spec_, layout_, sources, packed_, options_.pack);
  } else {
#if ACCORD_WITH_CUDA_KERNELS
    packed = PackCuda(spec_, layout_, sources, packed_, options_.stream, options_.pack);
#endif
  }
  if (!packed.ok()) return packed;
  if (absl::Status s = collective_.ReduceScatterSum(packed_, shard_, layout_.row_numel,
                                                    layout_.wire_dtype, options_.stream);
      !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("group \"", spec_.group_id, "\" step ",
                                               decision.step, ": ", s.message()));
  }
  reduced_ = true;
  return absl::OkStatus();
}

absl::Status GroupReducer::Unpack(absl::Span<const UnpackTarget> targets,
                                  const UnpackOptions& options) {
  if (!reduced_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "group \"", spec_.group_id, "\": Unpack called without a successful Reduce before it"));
  }
  if (options_.device == Device::kCpu) {
    return UnpackCpu(spec_, layout_, collective_.rank(), shard_, targets, options);
  }
#if ACCORD_WITH_CUDA_KERNELS
  return UnpackCuda(spec_, layout_, collective_.rank(), shard_, targets, options_.stream, options);
#else
  return absl::UnimplementedError("no CUDA kernels in this build");
#endif
}

}  // namespace accord
