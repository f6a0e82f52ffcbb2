// accord_pack_bench: CPU pack of a realistic group against (a) memcpy of the
// same output bytes and (b) the unfused way FSDP2 and existing patches build
// the reduce-scatter input (zeros allocated for missing gradients, each
// gradient converted into a temporary, then copied into the chunked layout).
//
// Group: 50 parameters, ~64 MiB of bf16 gradients with fp32 accumulations
// mixed in, some parameters without a local gradient, W = 8, wire fp32.
// PackCpu runs with its default options (streaming stores for an output this
// large), then with regular stores, in the same process.
// Usage: accord_pack_bench [iterations]
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/group.h"
#include "kernels/convert_cpu.h"
#include "kernels/pack.h"

namespace accord {
namespace {

using Clock = std::chrono::steady_clock;

template <typename F>
double MedianSeconds(int iters, F&& f) {
  std::vector<double> t;
  f();  // warm-up
  for (int i = 0; i < iters; ++i) {
    const auto a = Clock::now();
    f();
    t.push_back(std::chrono::duration<double>(Clock::now() - a).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// The unfused path: what FSDP2's foreach_reduce does with torch ops on CPU
// (zeros for missing grads, .to(reduce_dtype) into a new tensor, then
// chunk + cat into the reduce-scatter input).
void Unfused(const GroupSpec& spec, const Layout& layout, const std::vector<GradSource>& src,
             float* out) {
  std::vector<std::unique_ptr<float[]>> converted(spec.params.size());
  for (size_t i = 0; i < spec.params.size(); ++i) {
    if (!layout.params[i].included) continue;
    const int64_t n = spec.params[i].numel;
    if (src[i].data == nullptr) {
      // zeros in the parameter dtype, then converted like any gradient
      std::unique_ptr<uint16_t[]> z(new uint16_t[n]());
      converted[i].reset(new float[n]);
      kernels::ConvertRun(DType::kBFloat16, DType::kFloat32, z.get(), converted[i].get(), n);
    } else {
      converted[i].reset(new float[n]);
      kernels::ConvertRun(src[i].dtype, DType::kFloat32, src[i].data, converted[i].get(), n);
    }
  }
  for (int r = 0; r < layout.world_size; ++r) {
    for (size_t i = 0; i < spec.params.size(); ++i) {
      const ParamLayout& pl = layout.params[i];
      if (!pl.included) continue;
      const int64_t begin = r * pl.chunk_numel;
      const int64_t valid = std::clamp<int64_t>(spec.params[i].numel - begin, 0, pl.chunk_numel);
      float* dst = out + layout.ChunkOffset(i, r);
      std::memcpy(dst, converted[i].get() + begin, valid * sizeof(float));
      std::memset(dst + valid, 0, (pl.chunk_numel - valid) * sizeof(float));
    }
  }
}

int Main(int argc, char** argv) {
  const int iters = argc > 1 ? std::atoi(argv[1]) : 15;
  GroupSpec spec;
  spec.group_id = "bench";
  for (int i = 0; i < 50; ++i) {
    const bool vec = i % 5 == 4;
    const int64_t dim0 = vec ? 1000 + 37 * i : 1021 + 13 * i;
    const int64_t inner = vec ? 1 : 640;
    spec.params.push_back({absl::StrCat("p", i), dim0, dim0 * inner});
  }
  std::vector<GradSource> sources(spec.params.size());
  std::vector<std::vector<uint8_t>> storage(spec.params.size());
  std::mt19937 rng(1);
  int64_t bf16_bytes = 0, fp32_bytes = 0, zero_params = 0;
  for (size_t i = 0; i < spec.params.size(); ++i) {
    if (i % 11 == 3) {
      ++zero_params;
      continue;  // no local gradient: zero-filled
    }
    const DType d = i % 7 == 2 ? DType::kFloat32 : DType::kBFloat16;  // fp32 accumulations
    storage[i].resize(spec.params[i].numel * DTypeSize(d));
    for (auto& b : storage[i]) b = static_cast<uint8_t>(rng() & 0x3f);  // finite values
    (d == DType::kFloat32 ? fp32_bytes : bf16_bytes) += storage[i].size();
    sources[i] = {storage[i].data(), d};
  }
  const Layout layout =
      *ComputeLayout(spec, 8, std::vector<bool>(spec.params.size(), true), DType::kFloat32);
  const size_t out_bytes = static_cast<size_t>(layout.total_bytes());
  std::vector<uint8_t> out(out_bytes, 1), copy_src(out_bytes, 2), check(out_bytes, 3);

  std::printf(
      "group: %zu params, %.1f MiB bf16 + %.1f MiB fp32 gradients, %lld zero-filled, "
      "W=8, wire fp32, output %.1f MiB; median of %d runs; F16C %s\n",
      spec.params.size(), bf16_bytes / 1048576.0, fp32_bytes / 1048576.0,
      static_cast<long long>(zero_params), out_bytes / 1048576.0, iters,
      kernels::HaveF16C() ? "yes" : "no");

  const double t_memcpy =
      MedianSeconds(iters, [&] { std::memcpy(out.data(), copy_src.data(), out_bytes); });
  const double t_unfused = MedianSeconds(
      iters, [&] { Unfused(spec, layout, sources, reinterpret_cast<float*>(check.data())); });
  auto gbs = [&](double t) { return out_bytes / t / 1e9; };
  std::printf("%-38s %8.2f ms  %6.2f GB/s written\n", "memcpy (same output bytes)", t_memcpy * 1e3,
              gbs(t_memcpy));
  std::printf("%-38s %8.2f ms  %6.2f GB/s written\n", "unfused (zeros+convert+copy)",
              t_unfused * 1e3, gbs(t_unfused));
  // The default options first (streaming stores at this size), then regular
  // stores for comparison within the same run.
  for (bool regular_stores : {false, true}) {
    for (int threads : {1, 2}) {
      PackOptions options;
      options.num_threads = threads;
      if (regular_stores) options.streaming_min_bytes = INT64_MAX;
      std::memset(out.data(), 1, out_bytes);
      const double t = MedianSeconds(iters, [&] {
        if (!PackCpu(spec, layout, sources, out.data(), options).ok()) std::abort();
      });
      if (std::memcmp(out.data(), check.data(), out_bytes) != 0) {
        std::printf("MISMATCH between PackCpu and the unfused path\n");
        return 1;
      }
      std::printf(
          "%-38s %8.2f ms  %6.2f GB/s written  %.2fx memcpy  %.2fx faster than unfused\n",
          absl::StrCat("PackCpu, ", threads, " thread(s)", regular_stores ? ", regular stores" : "")
              .c_str(),
          t * 1e3, gbs(t), t_memcpy / t, t_unfused / t);
    }
  }
  return 0;
}

}  // namespace
}  // namespace accord

int main(int argc, char** argv) { return accord::Main(argc, argv); }
