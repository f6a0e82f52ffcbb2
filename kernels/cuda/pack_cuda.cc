// Host side of the CUDA pack/unpack: validation (shared with the CPU path),
// the parameter tables (kernel arguments, 64 parameters per launch), the
// launches.
#include "kernels/pack_cuda.h"

#include <cuda_runtime_api.h>

#include <string>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/launch.h"
#include "kernels/pack_validate.h"

// Wraps one CUDA runtime call: returns INTERNAL naming the call, the error
// and what was being done.
#define ACCORD_CUDA_RETURN_IF_ERROR(expr, what)                                                  \
  do {                                                                                           \
    const cudaError_t accord_cuda_err_ = (expr);                                                 \
    if (accord_cuda_err_ != cudaSuccess) {                                                       \
      return absl::InternalError(absl::StrCat(what, ": ", #expr,                                 \
                                              " failed: ", cudaGetErrorName(accord_cuda_err_),   \
                                              " (", cudaGetErrorString(accord_cuda_err_), ")")); \
    }                                                                                            \
  } while (0)

namespace accord {
namespace {

using kernels::cuda::kMaxParamsPerLaunch;
using kernels::cuda::kTile;

// An error pending from an earlier, unrelated CUDA call would otherwise be
// returned by this launch's cudaGetLastError as if the launch had failed.
absl::Status CheckNoPendingError(const std::string& what) {
  const cudaError_t e = cudaPeekAtLastError();
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(
      what, ": not launched: a CUDA error left by an earlier call (not by accord's pack): ",
      cudaGetErrorName(e), " (", cudaGetErrorString(e),
      "); check the CUDA calls made before this one on this thread"));
}

absl::Status LaunchStatus(cudaError_t e, const std::string& what) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": kernel launch failed: ", cudaGetErrorName(e),
                                          " (", cudaGetErrorString(e), ")"));
}

}  // namespace

absl::Status PackCuda(const GroupSpec& spec, const Layout& layout,
                      absl::Span<const GradSource> sources, void* out, void* stream,
                      const PackOptions& options) {
  if (absl::Status s = kernels::ValidatePack(spec, layout, sources, out, options); !s.ok()) {
    return s;
  }
  const std::string what = absl::StrCat("pack group \"", spec.group_id, "\"");
  if (absl::Status s = CheckNoPendingError(what); !s.ok()) return s;
  const auto s = static_cast<cudaStream_t>(stream);
  kernels::cuda::PackBatch batch{};
  auto flush = [&]() -> absl::Status {
    if (batch.total_tiles == 0) return absl::OkStatus();
    const cudaError_t e = kernels::cuda::LaunchPack(static_cast<int>(layout.wire_dtype), batch,
                                                    layout.row_numel, out, s);
    batch.num_params = 0;
    batch.total_tiles = 0;
    return LaunchStatus(e, what);
  };
  for (size_t i = 0; i < spec.params.size(); ++i) {
    const ParamLayout& pl = layout.params[i];
    if (!pl.included || pl.chunk_numel == 0) continue;
    if (batch.num_params == kMaxParamsPerLaunch) {
      if (absl::Status f = flush(); !f.ok()) return f;
    }
    kernels::cuda::PackParam& p = batch.params[batch.num_params++];
    p = {};
    p.src = sources[i].data;
    p.numel = spec.params[i].numel;
    p.chunk_numel = pl.chunk_numel;
    p.row_offset = pl.row_offset;
    p.tile_begin = batch.total_tiles;
    p.tiles_per_chunk = (pl.chunk_numel + kTile - 1) / kTile;
    p.src_dtype = static_cast<int32_t>(sources[i].dtype);
    batch.total_tiles += p.tiles_per_chunk * layout.world_size;
  }
  return flush();
}

absl::Status UnpackCuda(const GroupSpec& spec, const Layout& layout, int rank, const void* shard,
                        absl::Span<const UnpackTarget> targets, void* stream,
                        const UnpackOptions& options) {
  if (absl::Status s = kernels::ValidateUnpack(spec, layout, rank, shard, targets); !s.ok()) {
    return s;
  }
  const std::string what = absl::StrCat("unpack group \"", spec.group_id, "\" rank ", rank);
  if (absl::Status s = CheckNoPendingError(what); !s.ok()) return s;
  const auto s = static_cast<cudaStream_t>(stream);
  kernels::cuda::UnpackBatch batch{};
  auto flush = [&]() -> absl::Status {
    if (batch.total_tiles == 0) return absl::OkStatus();
    const cudaError_t e =
        kernels::cuda::LaunchUnpack(static_cast<int>(layout.wire_dtype), batch, shard, s);
    batch.num_params = 0;
    batch.total_tiles = 0;
    return LaunchStatus(e, what);
  };
  for (size_t i = 0; i < targets.size(); ++i) {
    if (targets[i].data == nullptr) continue;
    const int64_t n = UnpackedNumel(spec, layout, i, rank, options.drop_padding);
    if (n == 0) continue;
    if (batch.num_params == kMaxParamsPerLaunch) {
      if (absl::Status f = flush(); !f.ok()) return f;
    }
    kernels::cuda::UnpackParam& p = batch.params[batch.num_params++];
    p = {};
    p.dst = targets[i].data;
    p.n = n;
    p.row_offset = layout.params[i].row_offset;
    p.tile_begin = batch.total_tiles;
    p.dst_dtype = static_cast<int32_t>(targets[i].dtype);
    batch.total_tiles += (n + kTile - 1) / kTile;
  }
  return flush();
}

absl::StatusOr<MemoryPlace> PointerPlace(const void* p) {
  MemoryPlace place;
  ACCORD_CUDA_RETURN_IF_ERROR(cudaGetDevice(&place.current_device),
                              "finding the current CUDA device");
  cudaPointerAttributes attr{};
  const bool pending = cudaPeekAtLastError() != cudaSuccess;
  const cudaError_t e = cudaPointerGetAttributes(&attr, p);
  if (e != cudaSuccess) {
    if (!pending) (void)cudaGetLastError();  // ours: do not leave it to the next launch
    return absl::UnavailableError(
        absl::StrCat("cudaPointerGetAttributes failed: ", cudaGetErrorName(e), " (",
                     cudaGetErrorString(e), ")"));
  }
  if (attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged) {
    place.device = attr.device;
    place.managed = attr.type == cudaMemoryTypeManaged;
  }
  return place;
}

absl::StatusOr<int> CudaDeviceCount() {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    return absl::UnavailableError(absl::StrCat("cudaGetDeviceCount failed: ", cudaGetErrorName(e),
                                               " (", cudaGetErrorString(e), ")"));
  }
  if (n == 0) return absl::UnavailableError("cudaGetDeviceCount returned 0 devices");
  return n;
}

absl::StatusOr<void*> DeviceAlloc(size_t bytes) {
  void* p = nullptr;
  ACCORD_CUDA_RETURN_IF_ERROR(cudaMalloc(&p, bytes == 0 ? 1 : bytes),
                              absl::StrCat("allocating ", bytes, " bytes of device memory"));
  return p;
}

void DeviceFree(void* p) {
  if (p != nullptr) cudaFree(p);
}

}  // namespace accord
