// accord_pack_cuda_bench: GPU pack of the CPU benchmark's group (50 params,
// bf16 with fp32 accumulations, some zero-filled, W = 8, wire fp32) against
// cudaMemcpyAsync device-to-device of the same output bytes, timed with CUDA
// events in the same run. Target: pack >= 0.85x the copy's throughput.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/pack_cuda.h"

namespace accord {
namespace {

template <typename F>
float MedianMs(int iters, cudaStream_t s, F&& f) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  std::vector<float> t;
  f();
  for (int i = 0; i < iters; ++i) {
    cudaEventRecord(a, s);
    f();
    cudaEventRecord(b, s);
    cudaEventSynchronize(b);
    float ms = 0;
    cudaEventElapsedTime(&ms, a, b);
    t.push_back(ms);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

int Main() {
  absl::StatusOr<int> n = CudaDeviceCount();
  if (!n.ok()) {
    std::printf("no CUDA device: %s\n", std::string(n.status().message()).c_str());
    return 2;
  }
  GroupSpec spec{"bench", {}};
  for (int i = 0; i < 50; ++i) {
    const bool vec = i % 5 == 4;
    const int64_t dim0 = vec ? 1000 + 37 * i : 1021 + 13 * i;
    spec.params.push_back({absl::StrCat("p", i), dim0, dim0 * (vec ? 1 : 640)});
  }
  std::vector<GradSource> sources(spec.params.size());
  std::vector<void*> bufs;
  for (size_t i = 0; i < spec.params.size(); ++i) {
    if (i % 11 == 3) continue;
    const DType d = i % 7 == 2 ? DType::kFloat32 : DType::kBFloat16;
    void* p = *DeviceAlloc(spec.params[i].numel * DTypeSize(d));
    cudaMemset(p, 0x11, spec.params[i].numel * DTypeSize(d));
    bufs.push_back(p);
    sources[i] = {p, d};
  }
  const Layout layout =
      *ComputeLayout(spec, 8, std::vector<bool>(spec.params.size(), true), DType::kFloat32);
  const size_t bytes = layout.total_bytes();
  void* out = *DeviceAlloc(bytes);
  void* src = *DeviceAlloc(bytes);
  cudaStream_t s;
  cudaStreamCreate(&s);
  const int iters = 50;
  const float t_copy =
      MedianMs(iters, s, [&] { cudaMemcpyAsync(out, src, bytes, cudaMemcpyDeviceToDevice, s); });
  absl::Status st;
  const float t_pack =
      MedianMs(iters, s, [&] { st.Update(PackCuda(spec, layout, sources, out, s)); });
  if (!st.ok()) {
    std::printf("PackCuda failed: %s\n", st.ToString().c_str());
    return 1;
  }
  std::printf("GPU pack, output %.1f MiB fp32 (W=8, 50 params), median of %d:\n", bytes / 1048576.0,
              iters);
  std::printf("  cudaMemcpyAsync D2D (same output bytes): %.3f ms  %.1f GB/s written\n", t_copy,
              bytes / t_copy / 1e6);
  std::printf(
      "  PackCuda:                                %.3f ms  %.1f GB/s written  %.2fx copy "
      "(target >= 0.85x)\n",
      t_pack, bytes / t_pack / 1e6, t_copy / t_pack);
  for (void* p : bufs) DeviceFree(p);
  DeviceFree(out);
  DeviceFree(src);
  cudaStreamDestroy(s);
  return 0;
}

}  // namespace
}  // namespace accord

int main() { return accord::Main(); }
