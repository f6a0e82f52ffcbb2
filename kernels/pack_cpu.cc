// CPU pack/unpack. The buffer is walked as one flat range of elements so it
// can be split evenly across threads: each thread packs a contiguous slice of
// the output, converting the parts of the sources that land there.
#include <algorithm>
#include <cstring>
#include <thread>
#include <vector>

#include "kernels/convert_cpu.h"
#include "kernels/pack.h"
#include "kernels/pack_validate.h"

namespace accord {
namespace {

// Below this many output bytes threads cost more than they save.
constexpr int64_t kMinBytesPerThread = int64_t{1} << 20;

// How PackRange writes: regular or streaming stores (PackOptions).
// Streaming stores are weakly ordered: `fence` orders them before the thread
// join or the return that hands the buffer on.
struct Stores {
  void (*convert)(DType, DType, const void*, void*, int64_t);
  void (*zero)(void*, int64_t);
  void (*fence)();
};

void ZeroRegular(void* dst, int64_t bytes) { std::memset(dst, 0, static_cast<size_t>(bytes)); }
void NoFence() {}

constexpr Stores kRegularStores{&kernels::ConvertRun, &ZeroRegular, &NoFence};
constexpr Stores kStreamingStores{&kernels::ConvertRunStreaming, &kernels::ZeroStreaming,
                                  &kernels::StreamFence};

// Packs the elements [begin, end) of the whole buffer.
void PackRange(const GroupSpec& spec, const Layout& layout, absl::Span<const GradSource> sources,
               const Stores& stores, char* out, int64_t begin, int64_t end) {
  const int64_t row = layout.row_numel;
  const DType wire = layout.wire_dtype;
  const int64_t wsize = static_cast<int64_t>(DTypeSize(wire));
  for (int64_t r = begin / row; r * row < end; ++r) {
    const int64_t lo = std::max<int64_t>(begin - r * row, 0);
    const int64_t hi = std::min<int64_t>(end - r * row, row);
    for (size_t i = 0; i < layout.params.size(); ++i) {
      const ParamLayout& pl = layout.params[i];
      if (!pl.included || pl.chunk_numel == 0) continue;
      const int64_t off = pl.row_offset;
      if (off >= hi) break;
      if (off + pl.chunk_numel <= lo) continue;
      const int64_t a = std::max(lo, off) - off;  // [a, b) within the chunk
      const int64_t b = std::min(hi, off + pl.chunk_numel) - off;
      char* dst = out + (r * row + off + a) * wsize;
      const int64_t src_begin = r * pl.chunk_numel + a;  // element of the source
      const GradSource& src = sources[i];
      int64_t n_copy = 0;
      if (src.data != nullptr) {
        n_copy = std::clamp<int64_t>(spec.params[i].numel - src_begin, 0, b - a);
        const int64_t ssize = static_cast<int64_t>(DTypeSize(src.dtype));
        stores.convert(src.dtype, wire, static_cast<const char*>(src.data) + src_begin * ssize, dst,
                       n_copy);
      }
      // Zero bits are +0 in every dtype: padding and missing gradients.
      stores.zero(dst + n_copy * wsize, (b - a - n_copy) * wsize);
    }
  }
  stores.fence();
}

}  // namespace

absl::Status PackCpu(const GroupSpec& spec, const Layout& layout,
                     absl::Span<const GradSource> sources, void* out, const PackOptions& options) {
  if (absl::Status s = kernels::ValidatePack(spec, layout, sources, out, options); !s.ok()) {
    return s;
  }
  const int64_t total = layout.total_numel();
  if (total == 0) return absl::OkStatus();
  char* out_bytes = static_cast<char*>(out);
  const int threads = static_cast<int>(
      std::clamp<int64_t>(layout.total_bytes() / kMinBytesPerThread, 1, options.num_threads));
  const Stores& stores =
      layout.total_bytes() >= options.streaming_min_bytes ? kStreamingStores : kRegularStores;
  if (threads == 1) {
    PackRange(spec, layout, sources, stores, out_bytes, 0, total);
    return absl::OkStatus();
  }
  std::vector<std::thread> workers;
  workers.reserve(threads - 1);
  for (int t = 1; t < threads; ++t) {
    workers.emplace_back([&, t] {
      PackRange(spec, layout, sources, stores, out_bytes, total * t / threads,
                total * (t + 1) / threads);
    });
  }
  PackRange(spec, layout, sources, stores, out_bytes, 0, total / threads);
  for (std::thread& w : workers) w.join();
  return absl::OkStatus();
}

int64_t UnpackedNumel(const GroupSpec& spec, const Layout& layout, size_t i, int rank,
                      bool drop_padding) {
  const ParamLayout& pl = layout.params[i];
  if (!pl.included) return 0;
  if (!drop_padding) return pl.chunk_numel;
  return std::clamp<int64_t>(spec.params[i].numel - rank * pl.chunk_numel, 0, pl.chunk_numel);
}

absl::Status UnpackCpu(const GroupSpec& spec, const Layout& layout, int rank, const void* shard,
                       absl::Span<const UnpackTarget> targets, const UnpackOptions& options) {
  if (absl::Status s = kernels::ValidateUnpack(spec, layout, rank, shard, targets); !s.ok()) {
    return s;
  }
  const int64_t wsize = static_cast<int64_t>(DTypeSize(layout.wire_dtype));
  for (size_t i = 0; i < targets.size(); ++i) {
    if (targets[i].data == nullptr) continue;
    const int64_t n = UnpackedNumel(spec, layout, i, rank, options.drop_padding);
    kernels::ConvertRun(layout.wire_dtype, targets[i].dtype,
                        static_cast<const char*>(shard) + layout.params[i].row_offset * wsize,
                        targets[i].data, n);
  }
  return absl::OkStatus();
}

}  // namespace accord
