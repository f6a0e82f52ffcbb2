#include "client/collective/reducer.h"

#include <utility>

#include "absl/strings/str_cat.h"
#if ACCORD_WITH_CUDA_KERNELS
#include "kernels/pack_cuda.h"
#endif

namespace accord {

namespace {

ScratchBuffer::Memory MemoryFor(GroupReducer::Device device) {
  return device == GroupReducer::Device::kCpu ? ScratchBuffer::Memory::kHost
                                              : ScratchBuffer::Memory::kDevice;
}

}  // namespace

GroupReducer::GroupReducer(GroupSpec spec, Collective& collective, Options options)
    : spec_(std::move(spec)),
      collective_(collective),
      options_(options),
      packed_(MemoryFor(options.device)),
      shard_(MemoryFor(options.device)) {}

GroupReducer::~GroupReducer() = default;

absl::Status GroupReducer::CheckBackend() const {
  const Backend want = options_.device == Device::kCpu ? Backend::kGloo : Backend::kNccl;
  if (collective_.backend() == want) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "group \"", spec_.group_id, "\" on rank ", collective_.rank(), ": the reducer's buffers are ",
      options_.device == Device::kCpu ? "host memory (Device::kCpu)"
                                      : "device memory (Device::kCuda)",
      " but the collective is ", collective_.backend() == Backend::kGloo ? "Gloo" : "NCCL",
      ", which reduces ", collective_.backend() == Backend::kGloo ? "host memory" : "device memory",
      "; use Device::kCpu with Gloo and Device::kCuda with NCCL"));
}

absl::Status GroupReducer::CheckPointers(absl::Span<const void* const> pointers,
                                         const char* kind) const {
  // Only the CUDA reducer asks CUDA: asking for a CPU reducer would create a
  // CUDA context in a job that may not use the GPU at all.
  if (options_.device != Device::kCuda) return absl::OkStatus();
#if ACCORD_WITH_CUDA_KERNELS
  for (size_t i = 0; i < pointers.size(); ++i) {
    if (pointers[i] == nullptr) continue;
    absl::StatusOr<MemoryPlace> place = PointerPlace(pointers[i]);
    if (!place.ok()) {
      return absl::Status(place.status().code(),
                          absl::StrCat("group \"", spec_.group_id, "\" ", kind, " of parameter \"",
                                       spec_.params[i].name, "\": ", place.status().message()));
    }
    if (place->device != place->current_device) {
      return absl::FailedPreconditionError(absl::StrCat(
          "group \"", spec_.group_id, "\" on rank ", collective_.rank(), ": the ", kind,
          " of parameter \"", spec_.params[i].name, "\" is ",
          place->device >= 0 ? absl::StrCat("on device ", place->device)
                             : std::string("host memory"),
          ", but the NCCL reducer works on device ", place->current_device,
          "; move the tensor to that device or make it current (cudaSetDevice) first"));
    }
  }
#endif
  return absl::OkStatus();
}

absl::Status GroupReducer::CheckDecision(const Decision& decision,
                                         absl::Span<const GradSource> sources) const {
  if (absl::Status s = CheckBackend(); !s.ok()) return s;
  if (absl::Status s = collective_.CheckWireDType(decision.wire_dtype); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("group \"", spec_.group_id, "\" step ",
                                               decision.step, ": ", s.message()));
  }
  if (options_.device == Device::kCuda && sources.size() == spec_.params.size()) {
    std::vector<const void*> pointers(sources.size());
    for (size_t i = 0; i < sources.size(); ++i) pointers[i] = sources[i].data;
    if (absl::Status s = CheckPointers(pointers, "gradient"); !s.ok()) return s;
  }
  const int w = collective_.world_size();
  const uint64_t mine = LayoutFingerprint(spec_, w, decision.included, decision.wire_dtype);
  if (mine == decision.layout_fingerprint) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "group \"", spec_.group_id, "\" step ", decision.step, " on rank ", collective_.rank(),
      ": the decision's layout fingerprint ", decision.layout_fingerprint,
      " differs from this rank's ", mine, " (world size ", w, ", wire dtype ",
      DTypeName(decision.wire_dtype),
      "); this rank registered a different group spec or world size than the coordinator "
      "used; not launching the collective"));
}

absl::Status GroupReducer::UpdateLayout(const Decision& decision) {
  if (have_layout_ && layout_.fingerprint == decision.layout_fingerprint) return absl::OkStatus();
  absl::StatusOr<Layout> layout =
      ComputeLayout(spec_, collective_.world_size(), decision.included, decision.wire_dtype);
  if (!layout.ok()) return layout.status();
  layout_ = *std::move(layout);
  have_layout_ = true;
  return absl::OkStatus();
}

absl::Status GroupReducer::Reduce(const Decision& decision, absl::Span<const GradSource> sources) {
  reduced_ = false;
  if (absl::Status s = CheckDecision(decision, sources); !s.ok()) return s;
  if (absl::Status s = UpdateLayout(decision); !s.ok()) return s;
  absl::Status reserved = packed_.Reserve(static_cast<size_t>(layout_.total_bytes()));
  if (reserved.ok()) {
    reserved =
        shard_.Reserve(static_cast<size_t>(layout_.row_numel) * DTypeSize(layout_.wire_dtype));
  }
  if (!reserved.ok()) {
    return absl::Status(reserved.code(),
                        absl::StrCat("group \"", spec_.group_id, "\": ", reserved.message()));
  }
  absl::Status packed;
  if (options_.device == Device::kCpu) {
    packed = PackCpu(spec_, layout_, sources, packed_.data(), options_.pack);
  } else {
#if ACCORD_WITH_CUDA_KERNELS
    packed = PackCuda(spec_, layout_, sources, packed_.data(), options_.stream, options_.pack);
#endif
  }
  if (!packed.ok()) return packed;
  if (absl::Status s = collective_.ReduceScatterSum(
          packed_.data(), shard_.data(), layout_.row_numel, layout_.wire_dtype, options_.stream);
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
  if (options_.device == Device::kCuda && targets.size() == spec_.params.size()) {
    std::vector<const void*> pointers(targets.size());
    for (size_t i = 0; i < targets.size(); ++i) pointers[i] = targets[i].data;
    if (absl::Status s = CheckPointers(pointers, "unpack target"); !s.ok()) return s;
  }
  if (options_.device == Device::kCpu) {
    return UnpackCpu(spec_, layout_, collective_.rank(), shard_.data(), targets, options);
  }
#if ACCORD_WITH_CUDA_KERNELS
  return UnpackCuda(spec_, layout_, collective_.rank(), shard_.data(), targets, options_.stream,
                    options);
#else
  return absl::UnimplementedError("no CUDA kernels in this build");
#endif
}

absl::StatusOr<Policy> PolicyForCollective(const Policy& policy, const Collective& collective) {
  Policy out = policy;
  if (policy.reduce_dtype.has_value()) {
    absl::StatusOr<DType> wire = collective.WireDTypeFor(*policy.reduce_dtype);
    if (!wire.ok()) {
      return absl::Status(wire.status().code(),
                          absl::StrCat("policy reduce dtype: ", wire.status().message()));
    }
    out.reduce_dtype = *wire;
  }
  absl::StatusOr<DType> empty = collective.WireDTypeFor(policy.empty_group_dtype);
  if (!empty.ok()) {
    return absl::Status(empty.status().code(),
                        absl::StrCat("policy empty-group dtype: ", empty.status().message()));
  }
  out.empty_group_dtype = *empty;
  return out;
}

}  // namespace accord
