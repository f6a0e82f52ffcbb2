// CUDA pack/unpack against the CPU path, bit for bit. Skipped (with the
// reason) on machines without a CUDA device.
#include <cuda_runtime_api.h>

#include <unistd.h>

#include <algorithm>
#include <cstring>
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

// Device buffer with `slack` bytes in front, so that tests can hand the
// kernels pointers at any alignment.
struct SlackBytes {
  DeviceBytes raw;
  size_t slack;
  SlackBytes(const std::vector<uint8_t>& host, size_t slack_bytes)
      : raw(host.size() + slack_bytes), slack(slack_bytes) {
    cudaMemcpy(ptr(), host.data(), host.size(), cudaMemcpyHostToDevice);
  }
  void* ptr() const { return static_cast<char*>(raw.p) + slack; }
  std::vector<uint8_t> ToHost(size_t n) const {
    std::vector<uint8_t> h(n);
    cudaMemcpy(h.data(), ptr(), n, cudaMemcpyDeviceToHost);
    return h;
  }
};

// Cheap pseudo-random bytes for buffers too large for RandomBits.
std::vector<uint8_t> FastBytes(size_t n, uint64_t seed) {
  std::vector<uint8_t> v(n);
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (size_t i = 0; i < n; i += 8) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    std::memcpy(v.data() + i, &x, std::min<size_t>(8, n - i));
  }
  return v;
}

// Sources and unpack targets at every element offset from 16-byte
// alignment, so the scalar head, the vector body with element loads and the
// scalar tail all run; results equal the CPU path bit for bit.
TEST(PackCudaMisalignedTest, EveryHeadOffsetMatchesCpuBitForBit) {
  SKIP_WITHOUT_GPU();
  const GroupSpec spec{"misaligned",
                       {{"a", 167, 167}, {"b", 5000, 5000}, {"c", 13, 13 * 3}, {"d", 9000, 9000}}};
  const int world = 2;
  std::mt19937_64 rng(7);
  for (DType wire : {DType::kFloat8E5M2, DType::kBFloat16, DType::kFloat32, DType::kFloat64}) {
    for (DType src : kAllDTypes) {
      for (size_t offset = 0; offset < 16; offset += 3) {
        const std::vector<bool> included(spec.params.size(), true);
        const Layout layout = *ComputeLayout(spec, world, included, wire);
        std::vector<std::vector<uint8_t>> host(spec.params.size());
        std::vector<std::unique_ptr<SlackBytes>> dev(spec.params.size());
        std::vector<GradSource> cpu_src(spec.params.size()), gpu_src(spec.params.size());
        for (size_t i = 0; i < spec.params.size(); ++i) {
          host[i] = testing::RandomBits(src, spec.params[i].numel, rng);
          dev[i] = std::make_unique<SlackBytes>(host[i], offset * DTypeSize(src));
          cpu_src[i] = {host[i].data(), src};
          gpu_src[i] = {dev[i]->ptr(), src};
        }
        PackOptions options;
        options.allow_narrowing = true;
        std::vector<uint8_t> want(layout.total_bytes());
        ASSERT_TRUE(PackCpu(spec, layout, cpu_src, want.data(), options).ok());
        DeviceBytes out(static_cast<size_t>(layout.total_bytes()));
        ASSERT_TRUE(PackCuda(spec, layout, gpu_src, out.p, nullptr, options).ok());
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        ASSERT_EQ(out.ToHost(), want)
            << DTypeName(src) << " -> " << DTypeName(wire) << " at element offset " << offset;
        // Unpack rank 1 into misaligned targets of the source dtype.
        const size_t wsize = DTypeSize(wire);
        std::vector<uint8_t> row(want.begin() + layout.row_numel * wsize,
                                 want.begin() + 2 * layout.row_numel * wsize);
        DeviceBytes shard(row);
        std::vector<std::vector<uint8_t>> cpu_out(spec.params.size());
        std::vector<std::unique_ptr<SlackBytes>> gpu_out(spec.params.size());
        std::vector<UnpackTarget> ct(spec.params.size()), gt(spec.params.size());
        for (size_t i = 0; i < spec.params.size(); ++i) {
          const size_t bytes = layout.params[i].chunk_numel * DTypeSize(src);
          cpu_out[i].assign(bytes, 0xCD);
          gpu_out[i] = std::make_unique<SlackBytes>(cpu_out[i], offset * DTypeSize(src));
          ct[i] = {cpu_out[i].data(), src};
          gt[i] = {gpu_out[i]->ptr(), src};
        }
        ASSERT_TRUE(UnpackCpu(spec, layout, 1, row.data(), ct).ok());
        ASSERT_TRUE(UnpackCuda(spec, layout, 1, shard.p, gt, nullptr).ok());
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        for (size_t i = 0; i < spec.params.size(); ++i) {
          ASSERT_EQ(gpu_out[i]->ToHost(cpu_out[i].size()), cpu_out[i])
              << "unpack param " << i << " " << DTypeName(wire) << " -> " << DTypeName(src)
              << " at element offset " << offset;
        }
      }
    }
  }
}

// Packs and unpacks (drop_padding) one parameter of `numel` elements at W =
// 2 on a non-default stream and compares with the CPU path.
void CheckOneLargeParam(int64_t numel, DType src, DType wire) {
  const GroupSpec spec{"large", {{"w", numel, numel}}};
  const Layout layout = *ComputeLayout(spec, 2, {true}, wire);
  const std::vector<uint8_t> host = FastBytes(static_cast<size_t>(numel) * DTypeSize(src), 11);
  DeviceBytes dev(host);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  PackOptions options;
  options.allow_narrowing = true;
  std::vector<uint8_t> want(layout.total_bytes());
  ASSERT_TRUE(PackCpu(spec, layout, {{host.data(), src}}, want.data(), options).ok());
  DeviceBytes out(static_cast<size_t>(layout.total_bytes()));
  // The set-up ran on the legacy stream, which a non-blocking stream does
  // not wait for.
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  ASSERT_TRUE(PackCuda(spec, layout, {{dev.p, src}}, out.p, stream, options).ok());
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  ASSERT_TRUE(out.ToHost() == want) << "pack of " << numel << " elements";

  const int64_t n = UnpackedNumel(spec, layout, 0, 1, /*drop_padding=*/true);
  ASSERT_LT(n, layout.params[0].chunk_numel);  // the last rank has padding to drop
  const size_t wsize = DTypeSize(wire);
  DeviceBytes shard(static_cast<size_t>(layout.row_numel) * wsize);
  std::vector<uint8_t> cpu_out(static_cast<size_t>(n) * DTypeSize(src), 0xCD);
  DeviceBytes gpu_out(cpu_out.size());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  ASSERT_EQ(cudaMemcpyAsync(shard.p, static_cast<char*>(out.p) + layout.row_numel * wsize, shard.n,
                            cudaMemcpyDeviceToDevice, stream),
            cudaSuccess);
  UnpackOptions drop;
  drop.drop_padding = true;
  ASSERT_TRUE(UnpackCpu(spec, layout, 1, want.data() + layout.row_numel * wsize,
                        {{cpu_out.data(), src}}, drop)
                  .ok());
  ASSERT_TRUE(UnpackCuda(spec, layout, 1, shard.p, {{gpu_out.p, src}}, stream, drop).ok());
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  ASSERT_TRUE(gpu_out.ToHost() == cpu_out) << "unpack of " << n << " elements";
  cudaStreamDestroy(stream);
}

TEST(PackCudaLargeTest, MoreThan65535TilesOnANonDefaultStream) {
  SKIP_WITHOUT_GPU();
  // 2 rows x ~35k tiles: the grid (65535 blocks) strides over the rest.
  CheckOneLargeParam(70000 * 4096 + 123, DType::kBFloat16, DType::kFloat32);
}

TEST(PackCudaLargeTest, MoreThan2To31Elements) {
  SKIP_WITHOUT_GPU();
  const int64_t numel = (int64_t{1} << 31) + 3 * 4096 + 5;
  size_t free_bytes = 0, total_bytes = 0;
  ASSERT_EQ(cudaMemGetInfo(&free_bytes, &total_bytes), cudaSuccess);
  const size_t device_need = 3 * static_cast<size_t>(numel) + (size_t{1} << 30);
  const size_t host_need = 4 * static_cast<size_t>(numel) + (size_t{2} << 30);
  const size_t host_have =
      static_cast<size_t>(sysconf(_SC_AVPHYS_PAGES)) * static_cast<size_t>(sysconf(_SC_PAGESIZE));
  if (free_bytes < device_need || host_have < host_need) {
    GTEST_SKIP() << "needs " << (device_need >> 20) << " MiB free device memory (have "
                 << (free_bytes >> 20) << ") and " << (host_need >> 20)
                 << " MiB free host memory (have " << (host_have >> 20) << ")";
  }
  CheckOneLargeParam(numel, DType::kFloat8E4M3FN, DType::kFloat8E4M3FN);
}

// The pack is captured into a CUDA graph; everything the host built for it
// is gone before the graph is replayed (twice), which must still give the
// CPU result. 150 parameters: three launches of up to 64.
TEST(PackCudaGraphTest, CapturedPackReplaysWithoutHostState) {
  SKIP_WITHOUT_GPU();
  GroupSpec spec{"graph", {}};
  for (int i = 0; i < 150; ++i) spec.params.push_back({absl::StrCat("p", i), 3 + i, (3 + i) * 7});
  const int world = 4;
  const DType wire = DType::kBFloat16;
  const std::vector<bool> included(spec.params.size(), true);
  const Layout layout = *ComputeLayout(spec, world, included, wire);
  std::mt19937_64 rng(3);
  std::vector<std::vector<uint8_t>> host(spec.params.size());
  std::vector<std::unique_ptr<DeviceBytes>> dev(spec.params.size());
  std::vector<GradSource> cpu_src(spec.params.size());
  for (size_t i = 0; i < spec.params.size(); ++i) {
    if (i % 5 == 2) continue;  // zero-filled
    host[i] = testing::RandomBits(DType::kFloat32, spec.params[i].numel, rng);
    dev[i] = std::make_unique<DeviceBytes>(host[i]);
    cpu_src[i] = {host[i].data(), DType::kFloat32};
  }
  PackOptions options;
  options.allow_narrowing = true;
  std::vector<uint8_t> want(layout.total_bytes());
  ASSERT_TRUE(PackCpu(spec, layout, cpu_src, want.data(), options).ok());
  DeviceBytes out(static_cast<size_t>(layout.total_bytes()));
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // set-up on the legacy stream
  cudaGraph_t graph = nullptr;
  {
    std::vector<GradSource> gpu_src(spec.params.size());
    for (size_t i = 0; i < spec.params.size(); ++i) {
      gpu_src[i] = {dev[i] ? dev[i]->p : nullptr, DType::kFloat32};
    }
    ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
    const absl::Status packed = PackCuda(spec, layout, gpu_src, out.p, stream, options);
    ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
    ASSERT_TRUE(packed.ok()) << packed;
    // gpu_src (and the launcher's tables) go out of scope here.
  }
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (int replay = 0; replay < 2; ++replay) {
    ASSERT_EQ(cudaMemsetAsync(out.p, 0xCD, out.n, stream), cudaSuccess);
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    ASSERT_EQ(out.ToHost(), want) << "replay " << replay;
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

TEST(PackCudaErrorTest, AnEarlierCudaErrorIsReportedAsSuchAndNotLaunched) {
  SKIP_WITHOUT_GPU();
  GroupSpec spec{"g", {{"w", 4, 8}}};
  Layout layout = *ComputeLayout(spec, 1, {true}, DType::kFloat32);
  DeviceBytes out(static_cast<size_t>(layout.total_bytes()));
  ASSERT_NE(cudaSetDevice(1 << 20), cudaSuccess);  // leaves cudaErrorInvalidDevice pending
  absl::Status s = PackCuda(spec, layout, {{nullptr, DType::kFloat32}}, out.p, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
  EXPECT_NE(s.message().find("earlier call"), std::string::npos) << s;
  (void)cudaGetLastError();
  EXPECT_TRUE(PackCuda(spec, layout, {{nullptr, DType::kFloat32}}, out.p, nullptr).ok());
}

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
