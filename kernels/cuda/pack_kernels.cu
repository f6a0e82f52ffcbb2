// Pack/unpack kernels. One launch per 64 parameters (the table is a kernel
// argument): blocks walk tiles of a flat tile space; a block finds its
// parameter by binary search in the table and converts the tile with vector
// stores: a scalar head up to the destination's 16-byte alignment, then
// vectors (vector loads too when the source is then aligned, element loads
// otherwise), then a scalar tail. Zeros past the end of a source (padding) or
// for a missing one are written the same way. Every element goes through the
// same Convert, so the path taken never changes a bit.
#include <cstdint>

#include "kernels/cuda/launch.h"
#include "kernels/element_convert.h"

namespace accord::kernels::cuda {
namespace {

constexpr int kThreads = 256;

template <typename T, int N>
struct alignas(sizeof(T) * N < 16 ? sizeof(T) * N : 16) Vec {
  T v[N];
};

template <int A>
__device__ __forceinline__ bool AlignedTo(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) % A) == 0;
}

// Elements before the first 16-byte aligned destination element: 0..n, or n
// when `p` is not even aligned to its element (then it never gets aligned).
template <typename T>
__device__ __forceinline__ int64_t HeadToAlign16(const void* p, int64_t n) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  if (a % sizeof(T) != 0) return n;
  const int64_t h = static_cast<int64_t>(((16 - a % 16) % 16) / sizeof(T));
  return h < n ? h : n;
}

// Converts n elements s -> d within one tile, all threads of the block.
template <DType S, DType D>
__device__ void ConvertTile(const void* src, void* dst, int64_t n) {
  using TS = StorageT<S>;
  using TD = StorageT<D>;
  const TS* s = static_cast<const TS*>(src);
  TD* d = static_cast<TD*>(dst);
  constexpr int kSmaller = sizeof(TS) < sizeof(TD) ? sizeof(TS) : sizeof(TD);
  constexpr int kV = 16 / kSmaller;  // elements per vector step: 16 bytes of the smaller side
  using VS = Vec<TS, kV>;
  using VD = Vec<TD, kV>;
  // Head: scalar until d is 16-byte aligned (VD's alignment is 16: kV
  // elements of the larger side are >= 16 bytes).
  const int64_t head = HeadToAlign16<TD>(d, n);
  for (int64_t i = threadIdx.x; i < head; i += blockDim.x) d[i] = Convert<S, D>(s[i]);
  const TS* sv = s + head;
  TD* dv = d + head;
  const int64_t nv = (n - head) / kV;
  if (AlignedTo<alignof(VS)>(sv)) {
    for (int64_t v = threadIdx.x; v < nv; v += blockDim.x) {
      const VS in = reinterpret_cast<const VS*>(sv)[v];
      VD out;
#pragma unroll
      for (int k = 0; k < kV; ++k) out.v[k] = Convert<S, D>(in.v[k]);
      reinterpret_cast<VD*>(dv)[v] = out;
    }
  } else {
    // Source shifted against the destination: element loads (neighbouring
    // threads still read neighbouring bytes), vector stores.
    for (int64_t v = threadIdx.x; v < nv; v += blockDim.x) {
      const TS* in = sv + v * kV;
      VD out;
#pragma unroll
      for (int k = 0; k < kV; ++k) out.v[k] = Convert<S, D>(in[k]);
      reinterpret_cast<VD*>(dv)[v] = out;
    }
  }
  for (int64_t i = head + nv * kV + threadIdx.x; i < n; i += blockDim.x) {
    d[i] = Convert<S, D>(s[i]);
  }
}

// Zeros `bytes` bytes: a byte head up to 16-byte alignment, 16-byte stores,
// a byte tail.
__device__ void ZeroTile(void* dst, int64_t bytes) {
  char* d = static_cast<char*>(dst);
  const int64_t head = HeadToAlign16<char>(d, bytes);
  for (int64_t i = threadIdx.x; i < head; i += blockDim.x) d[i] = 0;
  const int64_t nv = (bytes - head) / 16;
  uint4* dv = reinterpret_cast<uint4*>(d + head);
  for (int64_t v = threadIdx.x; v < nv; v += blockDim.x) dv[v] = make_uint4(0, 0, 0, 0);
  for (int64_t i = head + nv * 16 + threadIdx.x; i < bytes; i += blockDim.x) d[i] = 0;
}

template <DType D>
__device__ void ConvertFrom(int src_dtype, const void* src, void* dst, int64_t n) {
  switch (src_dtype) {
    case static_cast<int>(DType::kFloat8E4M3FN):
      return ConvertTile<DType::kFloat8E4M3FN, D>(src, dst, n);
    case static_cast<int>(DType::kFloat8E5M2):
      return ConvertTile<DType::kFloat8E5M2, D>(src, dst, n);
    case static_cast<int>(DType::kFloat16):
      return ConvertTile<DType::kFloat16, D>(src, dst, n);
    case static_cast<int>(DType::kBFloat16):
      return ConvertTile<DType::kBFloat16, D>(src, dst, n);
    case static_cast<int>(DType::kFloat32):
      return ConvertTile<DType::kFloat32, D>(src, dst, n);
    default:
      return ConvertTile<DType::kFloat64, D>(src, dst, n);
  }
}

template <DType S>
__device__ void ConvertTo(int dst_dtype, const void* src, void* dst, int64_t n) {
  switch (dst_dtype) {
    case static_cast<int>(DType::kFloat8E4M3FN):
      return ConvertTile<S, DType::kFloat8E4M3FN>(src, dst, n);
    case static_cast<int>(DType::kFloat8E5M2):
      return ConvertTile<S, DType::kFloat8E5M2>(src, dst, n);
    case static_cast<int>(DType::kFloat16):
      return ConvertTile<S, DType::kFloat16>(src, dst, n);
    case static_cast<int>(DType::kBFloat16):
      return ConvertTile<S, DType::kBFloat16>(src, dst, n);
    case static_cast<int>(DType::kFloat32):
      return ConvertTile<S, DType::kFloat32>(src, dst, n);
    default:
      return ConvertTile<S, DType::kFloat64>(src, dst, n);
  }
}

// Index of the last entry whose tile_begin <= tile.
template <typename P>
__device__ int FindParam(const P* params, int num_params, int64_t tile) {
  int lo = 0, hi = num_params - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (params[mid].tile_begin <= tile) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

template <DType W>
__global__ void __launch_bounds__(kThreads)
    PackKernel(const __grid_constant__ PackBatch batch, int64_t row_numel, char* __restrict__ out) {
  constexpr int64_t kW = sizeof(StorageT<W>);
  for (int64_t tile = blockIdx.x; tile < batch.total_tiles; tile += gridDim.x) {
    const PackParam p = batch.params[FindParam(batch.params, batch.num_params, tile)];
    const int64_t local = tile - p.tile_begin;
    const int64_t r = local / p.tiles_per_chunk;
    const int64_t j0 = (local % p.tiles_per_chunk) * kTile;
    const int64_t len = min(kTile, p.chunk_numel - j0);
    char* dst = out + (r * row_numel + p.row_offset + j0) * kW;
    const int64_t s0 = r * p.chunk_numel + j0;
    int64_t valid = 0;
    if (p.src != nullptr) {
      valid = max(int64_t{0}, min(len, p.numel - s0));
      if (valid > 0) {
        const int ssize = p.src_dtype <= 2 ? 1 : p.src_dtype <= 4 ? 2 : p.src_dtype == 5 ? 4 : 8;
        ConvertFrom<W>(p.src_dtype, static_cast<const char*>(p.src) + s0 * ssize, dst, valid);
      }
    }
    if (valid < len) ZeroTile(dst + valid * kW, (len - valid) * kW);
  }
}

template <DType W>
__global__ void __launch_bounds__(kThreads)
    UnpackKernel(const __grid_constant__ UnpackBatch batch, const char* __restrict__ shard) {
  constexpr int64_t kW = sizeof(StorageT<W>);
  for (int64_t tile = blockIdx.x; tile < batch.total_tiles; tile += gridDim.x) {
    const UnpackParam p = batch.params[FindParam(batch.params, batch.num_params, tile)];
    const int64_t j0 = (tile - p.tile_begin) * kTile;
    const int64_t len = min(kTile, p.n - j0);
    const int dsize = p.dst_dtype <= 2 ? 1 : p.dst_dtype <= 4 ? 2 : p.dst_dtype == 5 ? 4 : 8;
    ConvertTo<W>(p.dst_dtype, shard + (p.row_offset + j0) * kW,
                 static_cast<char*>(p.dst) + j0 * dsize, len);
  }
}

unsigned GridFor(int64_t total_tiles) {
  // Enough blocks to fill any current GPU several times over; the kernels
  // stride over the rest.
  constexpr int64_t kMaxBlocks = 65535;
  return static_cast<unsigned>(total_tiles < kMaxBlocks ? total_tiles : kMaxBlocks);
}

}  // namespace

cudaError_t LaunchPack(int wire_dtype, const PackBatch& batch, int64_t row_numel, void* out,
                       cudaStream_t stream) {
  if (batch.total_tiles == 0) return cudaSuccess;
  const unsigned grid = GridFor(batch.total_tiles);
  char* o = static_cast<char*>(out);
  switch (wire_dtype) {
    case static_cast<int>(DType::kFloat8E4M3FN):
      PackKernel<DType::kFloat8E4M3FN><<<grid, kThreads, 0, stream>>>(batch, row_numel, o);
      break;
    case static_cast<int>(DType::kFloat8E5M2):
      PackKernel<DType::kFloat8E5M2><<<grid, kThreads, 0, stream>>>(batch, row_numel, o);
      break;
    case static_cast<int>(DType::kFloat16):
      PackKernel<DType::kFloat16><<<grid, kThreads, 0, stream>>>(batch, row_numel, o);
      break;
    case static_cast<int>(DType::kBFloat16):
      PackKernel<DType::kBFloat16><<<grid, kThreads, 0, stream>>>(batch, row_numel, o);
      break;
    case static_cast<int>(DType::kFloat32):
      PackKernel<DType::kFloat32><<<grid, kThreads, 0, stream>>>(batch, row_numel, o);
      break;
    default:
      PackKernel<DType::kFloat64><<<grid, kThreads, 0, stream>>>(batch, row_numel, o);
      break;
  }
  return cudaGetLastError();
}

cudaError_t LaunchUnpack(int wire_dtype, const UnpackBatch& batch, const void* shard,
                         cudaStream_t stream) {
  if (batch.total_tiles == 0) return cudaSuccess;
  const unsigned grid = GridFor(batch.total_tiles);
  const char* s = static_cast<const char*>(shard);
  switch (wire_dtype) {
    case static_cast<int>(DType::kFloat8E4M3FN):
      UnpackKernel<DType::kFloat8E4M3FN><<<grid, kThreads, 0, stream>>>(batch, s);
      break;
    case static_cast<int>(DType::kFloat8E5M2):
      UnpackKernel<DType::kFloat8E5M2><<<grid, kThreads, 0, stream>>>(batch, s);
      break;
    case static_cast<int>(DType::kFloat16):
      UnpackKernel<DType::kFloat16><<<grid, kThreads, 0, stream>>>(batch, s);
      break;
    case static_cast<int>(DType::kBFloat16):
      UnpackKernel<DType::kBFloat16><<<grid, kThreads, 0, stream>>>(batch, s);
      break;
    case static_cast<int>(DType::kFloat32):
      UnpackKernel<DType::kFloat32><<<grid, kThreads, 0, stream>>>(batch, s);
      break;
    default:
      UnpackKernel<DType::kFloat64><<<grid, kThreads, 0, stream>>>(batch, s);
      break;
  }
  return cudaGetLastError();
}

}  // namespace accord::kernels::cuda
