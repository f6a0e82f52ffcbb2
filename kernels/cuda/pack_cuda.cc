// Host side of the CUDA pack/unpack: validation (shared with the CPU path),
// the parameter table, its stream-ordered upload, the launch.
#include "kernels/pack_cuda.h"

#include <cuda_runtime_api.h>

#include <vector>

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

using kernels::cuda::kTile;

// Copies `table` to the device on `stream`, launches via `launch(dev_table)`
// and frees the device copy in stream order.
template <typename P, typename F>
absl::Status UploadAndLaunch(const std::vector<P>& table, cudaStream_t stream,
                             const std::string& what, F&& launch) {
  void* dev = nullptr;
  const size_t bytes = table.size() * sizeof(P);
  ACCORD_CUDA_RETURN_IF_ERROR(cudaMallocAsync(&dev, bytes, stream), what);
  // Pageable source: the call returns once the bytes are staged, so `table`
  // may go away after it.
  const cudaError_t copied =
      cudaMemcpyAsync(dev, table.data(), bytes, cudaMemcpyHostToDevice, stream);
  const cudaError_t launched = copied == cudaSuccess ? launch(static_cast<P*>(dev)) : copied;
  ACCORD_CUDA_RETURN_IF_ERROR(cudaFreeAsync(dev, stream), what);
  ACCORD_CUDA_RETURN_IF_ERROR(launched, what);
  return absl::OkStatus();
}

}  // namespace

absl::Status PackCuda(const GroupSpec& spec, const Layout& layout,
                      absl::Span<const GradSource> sources, void* out, void* stream,
                      const PackOptions& options) {
  if (absl::Status s = kernels::ValidatePack(spec, layout, sources, out, options); !s.ok()) {
    return s;
  }
  std::vector<kernels::cuda::PackParam> table;
  int64_t tiles = 0;
  for (size_t i = 0; i < spec.params.size(); ++i) {
    const ParamLayout& pl = layout.params[i];
    if (!pl.included || pl.chunk_numel == 0) continue;
    kernels::cuda::PackParam p{};
    p.src = sources[i].data;
    p.numel = spec.params[i].numel;
    p.chunk_numel = pl.chunk_numel;
    p.row_offset = pl.row_offset;
    p.tile_begin = tiles;
    p.tiles_per_chunk = (pl.chunk_numel + kTile - 1) / kTile;
    p.src_dtype = static_cast<int32_t>(sources[i].dtype);
    tiles += p.tiles_per_chunk * layout.world_size;
    table.push_back(p);
  }
  if (tiles == 0) return absl::OkStatus();
  const auto s = static_cast<cudaStream_t>(stream);
  return UploadAndLaunch(table, s, absl::StrCat("pack group \"", spec.group_id, "\""),
                         [&](const kernels::cuda::PackParam* dev) {
                           return kernels::cuda::LaunchPack(static_cast<int>(layout.wire_dtype),
                                                            dev, static_cast<int>(table.size()),
                                                            tiles, layout.row_numel, out, s);
                         });
}

absl::Status UnpackCuda(const GroupSpec& spec, const Layout& layout, int rank, const void* shard,
                        absl::Span<const UnpackTarget> targets, void* stream,
                        const UnpackOptions& options) {
  if (absl::Status s = kernels::ValidateUnpack(spec, layout, rank, shard, targets); !s.ok()) {
    return s;
  }
  std::vector<kernels::cuda::UnpackParam> table;
  int64_t tiles = 0;
  for (size_t i = 0; i < targets.size(); ++i) {
    if (targets[i].data == nullptr) continue;
    const int64_t n = UnpackedNumel(spec, layout, i, rank, options.drop_padding);
    if (n == 0) continue;
    kernels::cuda::UnpackParam p{};
    p.dst = targets[i].data;
    p.n = n;
    p.row_offset = layout.params[i].row_offset;
    p.tile_begin = tiles;
    p.dst_dtype = static_cast<int32_t>(targets[i].dtype);
    tiles += (n + kTile - 1) / kTile;
    table.push_back(p);
  }
  if (tiles == 0) return absl::OkStatus();
  const auto s = static_cast<cudaStream_t>(stream);
  return UploadAndLaunch(table, s, absl::StrCat("unpack group \"", spec.group_id, "\" rank ", rank),
                         [&](const kernels::cuda::UnpackParam* dev) {
                           return kernels::cuda::LaunchUnpack(static_cast<int>(layout.wire_dtype),
                                                              dev, static_cast<int>(table.size()),
                                                              tiles, shard, s);
                         });
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
