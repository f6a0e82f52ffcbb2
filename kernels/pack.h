// Pack and unpack of a group's reduce-scatter buffer (docs/ARCHITECTURE.md, "Buffer
// layout"): host API. CPU implementations here; the CUDA ones, with the same
// arguments plus a stream, are in kernels/pack_cuda.h.
//
// Pack writes FSDP2's layout in one pass: W rows, row r = the concatenation,
// in group order, of every included parameter's chunk r (dim 0 padded to a
// multiple of W). Each source gradient is read once in its own dtype and
// converted to the layout's wire dtype; parameters without a local gradient
// and the padding are written as zeros; skipped parameters take no bytes.
// An output larger than the caches is written with streaming stores
// (PackOptions::streaming_min_bytes): a widening pack then moves fewer bytes
// than a memcpy of its output, which reads the whole output's worth.
//
// Conversions follow kernels/element_convert.h: identity on bits for equal
// dtypes, otherwise exact via double with one round-to-nearest-even step; the
// CPU and CUDA results are the same bits.
#ifndef ACCORD_KERNELS_PACK_H_
#define ACCORD_KERNELS_PACK_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "core/dtype.h"
#include "core/group.h"

namespace accord {

// One parameter's local gradient: `numel` contiguous elements (dim0 x inner,
// unpadded, row-major) in `dtype`. data == nullptr: no local gradient (the
// parameter is packed as zeros when included; the dtype is then ignored).
struct GradSource {
  const void* data = nullptr;
  DType dtype = DType::kFloat32;
};

struct PackOptions {
  // Host threads for PackCpu (1: the calling thread only). Small buffers are
  // packed on the calling thread regardless.
  int num_threads = 1;
  // A source dtype that does not widen losslessly to the wire dtype is an
  // error unless this is set; when set it is rounded to nearest even. Set it
  // only when the wire dtype is an exact (user-chosen) reduce dtype.
  bool allow_narrowing = false;
  // PackCpu: outputs of at least this many bytes are written with streaming
  // (non-temporal) stores: they do not fit the caches, and a streaming store
  // does not read the line it overwrites, so the pack moves fewer bytes than
  // a copy of its output does. Smaller outputs stay in the cache for the
  // collective that reads them next. 0: always stream.
  int64_t streaming_min_bytes = int64_t{8} << 20;
};

// Packs `sources` (one per parameter of `spec`, in group order) into `out`,
// which must hold layout.total_bytes() bytes. `layout` must be the layout of
// `spec` (its fingerprint is checked). INVALID_ARGUMENT for a wrong source
// count, a null `out` with a non-empty layout, a layout of another spec, or a
// narrowing source without allow_narrowing; each error names the group and
// parameter.
absl::Status PackCpu(const GroupSpec& spec, const Layout& layout,
                     absl::Span<const GradSource> sources, void* out,
                     const PackOptions& options = {});

// Where one parameter's part of a received shard goes. data == nullptr: not
// wanted (must be null for skipped parameters, whose gradient stays empty).
struct UnpackTarget {
  void* data = nullptr;
  DType dtype = DType::kFloat32;
};

struct UnpackOptions {
  // false: each target receives the parameter's whole chunk (chunk_numel
  // elements; FSDP2's sharded gradient, padding included for the last ranks).
  // true: only the unpadded part (UnpackedNumel elements; may be 0).
  bool drop_padding = false;
};

// Elements of parameter `i` that UnpackCpu/UnpackCuda write for `rank`.
int64_t UnpackedNumel(const GroupSpec& spec, const Layout& layout, size_t i, int rank,
                      bool drop_padding);

// Converts `shard` (row `rank` of the reduced buffer: layout.row_numel
// elements in the wire dtype) into the targets, any dtype (narrowing rounds to
// nearest even). INVALID_ARGUMENT for a wrong target count, a rank outside the
// world, a null shard with a non-empty row, or a target for a skipped
// parameter.
absl::Status UnpackCpu(const GroupSpec& spec, const Layout& layout, int rank, const void* shard,
                       absl::Span<const UnpackTarget> targets, const UnpackOptions& options = {});

}  // namespace accord

#endif  // ACCORD_KERNELS_PACK_H_
