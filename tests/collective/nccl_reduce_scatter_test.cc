// The NCCL backend on a real GPU, through GroupReducer: W = 1 for every wire
// dtype, fp8 refused or accepted as docs/GPU.md ("fp8") says, a rendezvous
// that never completes bounded by the timeout, and W = 2 across two
// processes when two GPUs are visible (NCCL refuses two ranks on one GPU).
// Each test skips, with the reason, without what it needs. Each test runs in
// its own process (ctest), and the two-process test forks before any CUDA
// call.
#include <cuda_runtime_api.h>
#include <nccl.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/collective/collective.h"
#include "client/collective/reducer.h"
#include "gtest/gtest.h"
#include "kernels/element_convert.h"
#include "kernels/pack.h"
#include "kernels/pack_cuda.h"
#include "tests/collective/dir_kv_store.h"

namespace accord {
namespace {

#define SKIP_WITHOUT_GPU()                                                   \
  do {                                                                       \
    absl::StatusOr<int> n = CudaDeviceCount();                               \
    if (!n.ok()) GTEST_SKIP() << "no CUDA device: " << n.status().message(); \
  } while (0)

std::string TempDir() {
  char tmpl[] = "/tmp/accord_nccl_XXXXXX";
  if (mkdtemp(tmpl) == nullptr) return "/tmp";
  return tmpl;
}

std::string Incarnation() {
  return absl::StrCat("test-", getpid(), "-",
                      std::chrono::steady_clock::now().time_since_epoch().count());
}

GroupSpec Spec() { return GroupSpec{"nccl.g", {{"w", 1001, 1001 * 3}, {"b", 7, 7}, {"e", 0, 0}}}; }

Decision MakeDecision(const GroupSpec& spec, int world, DType wire, int64_t step) {
  Decision d;
  d.step = step;
  d.wire_dtype = wire;
  d.included.assign(spec.params.size(), true);
  d.layout_fingerprint = LayoutFingerprint(spec, world, d.included, wire);
  return d;
}

// Small values every wire dtype holds exactly (and whose sums over two
// ranks it holds exactly): k/4 for k in [-8, 8].
std::vector<double> Values(int64_t n, int rank) {
  std::vector<double> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[i] = static_cast<double>((i * 7 + rank * 3) % 17 - 8) / 4.0;
  return v;
}

template <DType D>
std::vector<uint8_t> Encode(const std::vector<double>& v) {
  using T = kernels::StorageT<D>;
  std::vector<uint8_t> out(v.size() * sizeof(T));
  for (size_t i = 0; i < v.size(); ++i) {
    const T t = kernels::FromDouble<D>(v[i]);
    std::memcpy(out.data() + i * sizeof(T), &t, sizeof(T));
  }
  return out;
}

std::vector<uint8_t> EncodeAs(DType d, const std::vector<double>& v) {
  switch (d) {
    case DType::kFloat8E4M3FN:
      return Encode<DType::kFloat8E4M3FN>(v);
    case DType::kFloat8E5M2:
      return Encode<DType::kFloat8E5M2>(v);
    case DType::kFloat16:
      return Encode<DType::kFloat16>(v);
    case DType::kBFloat16:
      return Encode<DType::kBFloat16>(v);
    case DType::kFloat32:
      return Encode<DType::kFloat32>(v);
    case DType::kFloat64:
      return Encode<DType::kFloat64>(v);
  }
  return {};
}

struct DeviceCopy {
  void* p = nullptr;
  explicit DeviceCopy(const std::vector<uint8_t>& h) {
    p = *DeviceAlloc(h.size());
    cudaMemcpy(p, h.data(), h.size(), cudaMemcpyHostToDevice);
  }
  ~DeviceCopy() { DeviceFree(p); }
};

// Reduces `spec` on this rank with `wire` (sources in the wire dtype) and
// returns the shard on the host; the expected shard is the CPU pack of the
// rank-summed values.
absl::Status ReduceOnce(Collective& c, DType wire, int64_t step, std::vector<uint8_t>* shard) {
  const GroupSpec spec = Spec();
  std::vector<std::vector<uint8_t>> host(spec.params.size());
  std::vector<std::unique_ptr<DeviceCopy>> dev(spec.params.size());
  std::vector<GradSource> sources(spec.params.size());
  for (size_t i = 0; i < spec.params.size(); ++i) {
    if (spec.params[i].numel == 0) continue;
    host[i] = EncodeAs(wire, Values(spec.params[i].numel, c.rank()));
    dev[i] = std::make_unique<DeviceCopy>(host[i]);
    sources[i] = {dev[i]->p, wire};
  }
  GroupReducer::Options options;
  options.device = GroupReducer::Device::kCuda;
  GroupReducer reducer(spec, c, options);
  if (absl::Status s = reducer.Reduce(MakeDecision(spec, c.world_size(), wire, step), sources);
      !s.ok()) {
    return s;
  }
  shard->resize(static_cast<size_t>(reducer.layout().row_numel) * DTypeSize(wire));
  if (cudaMemcpy(shard->data(), reducer.shard(), shard->size(), cudaMemcpyDeviceToHost) !=
      cudaSuccess) {
    return absl::InternalError("copying the shard back failed");
  }
  return absl::OkStatus();
}

std::vector<uint8_t> ExpectedShard(DType wire, int world, int rank) {
  const GroupSpec spec = Spec();
  std::vector<std::vector<uint8_t>> host(spec.params.size());
  std::vector<GradSource> sources(spec.params.size());
  for (size_t i = 0; i < spec.params.size(); ++i) {
    if (spec.params[i].numel == 0) continue;
    std::vector<double> sum(static_cast<size_t>(spec.params[i].numel), 0.0);
    for (int r = 0; r < world; ++r) {
      const std::vector<double> v = Values(spec.params[i].numel, r);
      for (size_t k = 0; k < v.size(); ++k) sum[k] += v[k];
    }
    host[i] = EncodeAs(wire, sum);
    sources[i] = {host[i].data(), wire};
  }
  const Layout layout =
      *ComputeLayout(spec, world, std::vector<bool>(spec.params.size(), true), wire);
  std::vector<uint8_t> packed(layout.total_bytes());
  EXPECT_TRUE(PackCpu(spec, layout, sources, packed.data()).ok());
  const size_t row = static_cast<size_t>(layout.row_numel) * DTypeSize(wire);
  return std::vector<uint8_t>(packed.begin() + rank * row, packed.begin() + (rank + 1) * row);
}

absl::StatusOr<std::unique_ptr<Collective>> MakeNccl(testing::DirKeyValueStore& kv, int rank,
                                                     int world, const std::string& incarnation,
                                                     bool allow_fp8,
                                                     std::chrono::milliseconds timeout) {
  CollectiveOptions o;
  o.incarnation = incarnation;
  o.timeout = timeout;
  o.nccl_allow_saturating_fp8 = allow_fp8;
  return CreateCollective(Backend::kNccl, rank, world, kv, "job/nccl.g", o);
}

bool IsFp8(DType d) { return d == DType::kFloat8E4M3FN || d == DType::kFloat8E5M2; }

TEST(NcclReduceScatterTest, WorldOfOneEveryAcceptedWireDTypeMatchesCpu) {
  SKIP_WITHOUT_GPU();
  testing::DirKeyValueStore kv(TempDir());
  absl::StatusOr<std::unique_ptr<Collective>> c =
      MakeNccl(kv, 0, 1, Incarnation(), false, std::chrono::seconds(60));
  ASSERT_TRUE(c.ok()) << c.status();
  int64_t step = 0;
  for (DType wire : kAllDTypes) {
    std::vector<uint8_t> shard;
    const absl::Status s = ReduceOnce(**c, wire, ++step, &shard);
    if (IsFp8(wire)) {
      // Refused by default, before any work (docs/GPU.md, "fp8").
      EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << DTypeName(wire) << ": " << s;
      continue;
    }
    ASSERT_TRUE(s.ok()) << DTypeName(wire) << ": " << s;
    EXPECT_EQ(shard, ExpectedShard(wire, 1, 0)) << DTypeName(wire);
  }
}

TEST(NcclReduceScatterTest, Fp8WithTheOptInRunsOnSm90AndIsRefusedBelow) {
  SKIP_WITHOUT_GPU();
  int major = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0), cudaSuccess);
  testing::DirKeyValueStore kv(TempDir());
  absl::StatusOr<std::unique_ptr<Collective>> c =
      MakeNccl(kv, 0, 1, Incarnation(), true, std::chrono::seconds(60));
  ASSERT_TRUE(c.ok()) << c.status();
  for (DType wire : {DType::kFloat8E4M3FN, DType::kFloat8E5M2}) {
    std::vector<uint8_t> shard;
    const absl::Status s = ReduceOnce(**c, wire, 1, &shard);
    if (major < 9) {
      EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
      continue;
    }
    ASSERT_TRUE(s.ok()) << DTypeName(wire) << ": " << s;
    EXPECT_EQ(shard, ExpectedShard(wire, 1, 0)) << DTypeName(wire);
  }
}

// fp8 declared in CollectiveOptions::wire_dtypes is refused at Create (before
// the rendezvous) with the dtype, this device's compute capability and the
// loaded NCCL's version, or widened when asked (docs/GPU.md, "fp8").
TEST(NcclReduceScatterTest, Fp8IsRefusedOrWidenedAtCreate) {
  SKIP_WITHOUT_GPU();
  int major = 0, minor = 0, version = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0), cudaSuccess);
  ASSERT_EQ(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0), cudaSuccess);
  ASSERT_EQ(ncclGetVersion(&version), ncclSuccess);
  testing::DirKeyValueStore kv(TempDir());
  CollectiveOptions o;
  o.timeout = std::chrono::seconds(60);
  o.wire_dtypes = {DType::kBFloat16, DType::kFloat8E4M3FN, DType::kFloat8E5M2};

  o.incarnation = Incarnation();
  absl::StatusOr<std::unique_ptr<Collective>> refused =
      CreateCollective(Backend::kNccl, 0, 1, kv, "job/nccl.create", o);
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  const std::string m(refused.status().message());
  EXPECT_NE(m.find(std::string(DTypeName(DType::kFloat8E4M3FN))), std::string::npos) << m;
  EXPECT_NE(m.find(absl::StrCat("sm_", major, minor)), std::string::npos) << m;
  EXPECT_NE(m.find(absl::StrCat("NCCL ", version / 10000, ".", (version / 100) % 100, ".",
                                version % 100)),
            std::string::npos)
      << m;
  std::printf("fp8 at Create without the opt-in: %s\n", refused.status().ToString().c_str());

  o.incarnation = Incarnation();
  o.nccl_allow_saturating_fp8 = true;
  absl::StatusOr<std::unique_ptr<Collective>> opted =
      CreateCollective(Backend::kNccl, 0, 1, kv, "job/nccl.create", o);
  if (major >= 9 && version >= 22400) {
    ASSERT_TRUE(opted.ok()) << opted.status();
  } else {
    EXPECT_EQ(opted.status().code(), absl::StatusCode::kFailedPrecondition) << opted.status();
  }

  o.incarnation = Incarnation();
  o.nccl_allow_saturating_fp8 = false;
  o.nccl_widen_fp8_to = DType::kBFloat16;
  absl::StatusOr<std::unique_ptr<Collective>> widened =
      CreateCollective(Backend::kNccl, 0, 1, kv, "job/nccl.create", o);
  ASSERT_TRUE(widened.ok()) << widened.status();
  absl::StatusOr<DType> wire = (*widened)->WireDTypeFor(DType::kFloat8E4M3FN);
  ASSERT_TRUE(wire.ok()) << wire.status();
  EXPECT_EQ(*wire, DType::kBFloat16);
  std::vector<uint8_t> shard;
  ASSERT_TRUE(ReduceOnce(**widened, *wire, 1, &shard).ok());
  EXPECT_EQ(shard, ExpectedShard(*wire, 1, 0));
}

TEST(NcclReduceScatterTest, RendezvousWithAMissingPeerEndsAtTheTimeout) {
  SKIP_WITHOUT_GPU();
  testing::DirKeyValueStore kv(TempDir());
  const auto start = std::chrono::steady_clock::now();
  // Rank 0 of 2, and rank 1 never comes: the init must end (aborted).
  absl::StatusOr<std::unique_ptr<Collective>> c =
      MakeNccl(kv, 0, 2, Incarnation(), false, std::chrono::seconds(5));
  const auto took = std::chrono::steady_clock::now() - start;
  EXPECT_EQ(c.status().code(), absl::StatusCode::kDeadlineExceeded) << c.status();
  // Not a timing assertion: a report of how long the abort took.
  std::printf(
      "init with a missing peer returned after %lld ms: %s\n",
      static_cast<long long>(std::chrono::duration_cast<std::chrono::milliseconds>(took).count()),
      c.status().ToString().c_str());
}

// Runs one rank of the two-process test; returns 0 (pass), 1 (fail) or 77
// (skip: fewer than two GPUs).
int RunRank(const std::string& dir, const std::string& incarnation, int rank) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n < 2) return 77;
  if (cudaSetDevice(rank) != cudaSuccess) return 1;
  testing::DirKeyValueStore kv(dir);
  absl::StatusOr<std::unique_ptr<Collective>> c =
      MakeNccl(kv, rank, 2, incarnation, false, std::chrono::seconds(60));
  if (!c.ok()) {
    std::fprintf(stderr, "rank %d: %s\n", rank, c.status().ToString().c_str());
    return 1;
  }
  int64_t step = 0;
  for (DType wire : {DType::kFloat64, DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    std::vector<uint8_t> shard;
    if (absl::Status s = ReduceOnce(**c, wire, ++step, &shard); !s.ok()) {
      std::fprintf(stderr, "rank %d %s: %s\n", rank, std::string(DTypeName(wire)).c_str(),
                   s.ToString().c_str());
      return 1;
    }
    if (shard != ExpectedShard(wire, 2, rank)) {
      std::fprintf(stderr, "rank %d %s: shard differs from the CPU sum\n", rank,
                   std::string(DTypeName(wire)).c_str());
      return 1;
    }
  }
  return 0;
}

TEST(NcclReduceScatterTest, TwoProcessesOnTwoGpusMatchCpu) {
  // No CUDA call in this process before the fork.
  const std::string dir = TempDir();
  const std::string incarnation = Incarnation();
  pid_t pids[2];
  for (int r = 0; r < 2; ++r) {
    pids[r] = fork();
    ASSERT_GE(pids[r], 0);
    if (pids[r] == 0) _exit(RunRank(dir, incarnation, r));
  }
  int codes[2];
  for (int r = 0; r < 2; ++r) {
    int status = 0;
    ASSERT_EQ(waitpid(pids[r], &status, 0), pids[r]);
    codes[r] = WIFEXITED(status) ? WEXITSTATUS(status) : 1;
  }
  if (codes[0] == 77 && codes[1] == 77) {
    GTEST_SKIP() << "needs two visible GPUs: NCCL refuses two ranks of one communicator on the "
                    "same GPU";
  }
  EXPECT_EQ(codes[0], 0);
  EXPECT_EQ(codes[1], 0);
}

}  // namespace
}  // namespace accord
