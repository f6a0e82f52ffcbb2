// CUDA pack/unpack against the CPU path, bit for bit. Skipped (with the
// reason) on machines without a CUDA device.
#include <cuda_runtime_api.h>

#include <random>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/lattice.h"
#include "gtest/gtest.h"
#include "kernels/pack.h"
#include "kernels/pack_cuda.h"
#include "tests/kernels/reference.h"

namespace accord {
namespace {

#define SKIP_WITHOUT_GPU()                                                   \
  do {                                                                       \
    absl::StatusOr<int> n = CudaDeviceCount();                               \
    if (!n.ok()) GTEST_SKIP() << "no CUDA device: " << n.status().message(); \
  } while (0)

// Device copy of a host buffer, freed at scope end.
struct DeviceBytes {
  void* p = nullptr;
  size_t n = 0;
  explicit DeviceBytes(const std::vector<uint8_t>& host) : n(host.size()) {
    p = *DeviceAlloc(n);
    cudaMemcpy(p, host.data(), n, cudaMemcpyHostToDevice);
  }
  explicit DeviceBytes(size_t bytes) : n(bytes) {
    p = *DeviceAlloc(n);
    cudaMemset(p, 0xCD, n == 0 ? 1 : n);
  }
  ~DeviceBytes() { DeviceFree(p); }
  std::vector<uint8_t> ToHost() const {
    std::vector<uint8_t> h(n);
    cudaMemcpy(h.data(), p, n, cudaMemcpyDeviceToHost);
    return h;
  }
};

GroupSpec Spec() {
  GroupSpec spec{"cuda", {}};
  // Large enough for several tiles and the vector path; odd sizes for the tails.
  const std::vector<std::pair<int64_t, int64_t>> shapes = {
      {1001, 37}, {1, 1}, {0, 0}, {4096, 8}, {5, 1}, {999, 16}, {3, 5}, {33, 1}, {64, 1024}};
  for (size_t i = 0; i < shapes.size(); ++i) {
    spec.params.push_back(
        {absl::StrCat("p", i), shapes[i].first, shapes[i].first * shapes[i].second});
  }
  return spec;
}

class PackCudaTest : public ::testing::TestWithParam<std::tuple<DType, int>> {};

TEST_P(PackCudaTest, PackAndUnpackMatchCpuBitForBit) {
  SKIP_WITHOUT_GPU();
  const auto [wire, world] = GetParam();
  const GroupSpec spec = Spec();
  std::mt19937_64 rng(static_cast<int>(wire) * 10 + world);
  std::vector<bool> included;
  std::vector<std::vector<uint8_t>> host(spec.params.size());
  std::vector<std::unique_ptr<DeviceBytes>> dev(spec.params.size());
  std::vector<GradSource> cpu_src(spec.params.size()), gpu_src(spec.params.size());
  for (size_t i = 0; i < spec.params.size(); ++i) {
    included.push_back(i % 4 != 3);
    if (i % 3 == 1) continue;  // zero-filled
    const DType d = kAllDTypes[(i * 5 + world) % kNumDTypes];
    host[i] = testing::RandomBits(d, spec.params[i].numel, rng);
    dev[i] = std::make_unique<DeviceBytes>(host[i]);
    cpu_src[i] = {host[i].empty() ? nullptr : host[i].data(), d};
    gpu_src[i] = {host[i].empty() ? nullptr : dev[i]->p, d};
  }
  const Layout layout = *ComputeLayout(spec, world, included, wire);
  PackOptions options;
  options.allow_narrowing = true;
  std::vector<uint8_t> want(layout.total_bytes());
  ASSERT_TRUE(PackCpu(spec, layout, cpu_src, want.data(), options).ok());
  DeviceBytes out(static_cast<size_t>(layout.total_bytes()));
  ASSERT_TRUE(PackCuda(spec, layout, gpu_src, out.p, nullptr, options).ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  ASSERT_EQ(out.ToHost(), want);

  const size_t wsize = DTypeSize(wire);
  for (DType to : kAllDTypes) {
    for (int r = 0; r < world; ++r) {
      std::vector<uint8_t> row(want.begin() + r * layout.row_numel * wsize,
                               want.begin() + (r + 1) * layout.row_numel * wsize);
      DeviceBytes shard(row);
      std::vector<std::vector<uint8_t>> cpu_out(spec.params.size());
      std::vector<std::unique_ptr<DeviceBytes>> gpu_out(spec.params.size());
      std::vector<UnpackTarget> ct(spec.params.size()), gt(spec.params.size());
      for (size_t i = 0; i < spec.params.size(); ++i) {
        if (!layout.params[i].included) continue;
        const size_t bytes = layout.params[i].chunk_numel * DTypeSize(to);
        cpu_out[i].assign(bytes, 0xCD);
        gpu_out[i] = std::make_unique<DeviceBytes>(bytes);
        ct[i] = {cpu_out[i].data(), to};
        gt[i] = {gpu_out[i]->p, to};
      }
      ASSERT_TRUE(UnpackCpu(spec, layout, r, row.data(), ct).ok());
      ASSERT_TRUE(UnpackCuda(spec, layout, r, shard.p, gt, nullptr).ok());
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      for (size_t i = 0; i < spec.params.size(); ++i) {
        if (!layout.params[i].included) continue;
        ASSERT_EQ(gpu_out[i]->ToHost(), cpu_out[i])
            << "param " << i << " rank " << r << " to " << DTypeName(to);
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllWireDTypesAndWorlds, PackCudaTest,
                         ::testing::Combine(::testing::ValuesIn(kAllDTypes),
                                            ::testing::Values(1, 2, 3, 8)),
                         [](const ::testing::TestParamInfo<PackCudaTest::ParamType>& info) {
                           std::string s(DTypeName(std::get<0>(info.param)));
                           for (char& c : s) {
                             if (c == '_') c = 'X';
                           }
                           return absl::StrCat(s, "_W", std::get<1>(info.param));
                         });

TEST(PackCudaErrorTest, ValidationMatchesCpu) {
  // Validation runs before any CUDA call, so this runs without a GPU too.
  GroupSpec spec{"g", {{"w", 4, 8}}};
  Layout layout = *ComputeLayout(spec, 2, {true}, DType::kBFloat16);
  std::vector<GradSource> none;
  absl::Status s = PackCuda(spec, layout, none, nullptr, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s, PackCpu(spec, layout, none, nullptr));
}

}  // namespace
}  // namespace accord
