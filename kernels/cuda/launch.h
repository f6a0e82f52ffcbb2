// The boundary between the host launchers (pack_cuda.cc, plain C++) and the
// kernels (pack_kernels.cu). Internal to kernels/.
#ifndef ACCORD_KERNELS_CUDA_LAUNCH_H_
#define ACCORD_KERNELS_CUDA_LAUNCH_H_

#include <cuda_runtime_api.h>

#include <cstdint>

namespace accord::kernels::cuda {

// Elements per tile; a block packs one tile at a time.
inline constexpr int64_t kTile = 4096;

// Parameters per launch. The table is a kernel argument (so stream capture
// records it by value: a CUDA graph's replay reads no host or freed
// memory), and kernel arguments are limited to 4 KiB: 64 entries of 56
// bytes fit with room to spare.
inline constexpr int kMaxParamsPerLaunch = 64;

// One included parameter of a pack. Tiles [tile_begin, tile_begin +
// world_size * tiles_per_chunk) of the launch belong to it (row-major by row).
struct PackParam {
  const void* src;  // nullptr: zeros
  int64_t numel;
  int64_t chunk_numel;
  int64_t row_offset;
  int64_t tile_begin;
  int64_t tiles_per_chunk;
  int32_t src_dtype;  // DType value
  int32_t unused;
};

// One wanted target of an unpack: n elements from row_offset of the shard.
struct UnpackParam {
  void* dst;
  int64_t n;
  int64_t row_offset;
  int64_t tile_begin;
  int32_t dst_dtype;
  int32_t unused;
};

// One launch's table, passed by value.
struct PackBatch {
  int32_t num_params;
  int64_t total_tiles;
  PackParam params[kMaxParamsPerLaunch];
};
struct UnpackBatch {
  int32_t num_params;
  int64_t total_tiles;
  UnpackParam params[kMaxParamsPerLaunch];
};
static_assert(sizeof(PackBatch) + 64 <= 4096, "PackBatch must fit the kernel argument limit");
static_assert(sizeof(UnpackBatch) + 64 <= 4096, "UnpackBatch must fit the kernel argument limit");

// Enqueue one kernel; return the launch's error (cudaSuccess when enqueued).
// The caller checks cudaPeekAtLastError before, so an error returned here is
// this launch's.
cudaError_t LaunchPack(int wire_dtype, const PackBatch& batch, int64_t row_numel, void* out,
                       cudaStream_t stream);
cudaError_t LaunchUnpack(int wire_dtype, const UnpackBatch& batch, const void* shard,
                         cudaStream_t stream);

}  // namespace accord::kernels::cuda

#endif  // ACCORD_KERNELS_CUDA_LAUNCH_H_
