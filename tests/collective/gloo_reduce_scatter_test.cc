// Gloo reduce-scatter across 4 real processes (this binary forks itself),
// rendezvousing through a directory-backed key-value store, driven through
// GroupReducer with a decision that zero-fills and skips.
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/collective/collective.h"
#include "client/collective/reducer.h"
#include "core/lattice.h"
#include "gtest/gtest.h"
#include "kernels/element_convert.h"
#include "tests/collective/dir_kv_store.h"

namespace accord {
namespace {

constexpr int kWorld = 4;

GroupSpec Spec() {
  return GroupSpec{"blocks.3",
                   {{"attn.w", 9, 9 * 5},    // uneven dim0
                    {"attn.b", 3, 3},        // dim0 < W
                    {"vision.w", 8, 8 * 4},  // used on no rank: skipped
                    {"moe.e1", 6, 6 * 2},    // used on rank 2 only: zero-filled elsewhere
                    {"empty", 0, 0},
                    {"mlp.w", 17, 17 * 3}}};
}

bool HasGrad(size_t param, int rank) {
  switch (param) {
    case 2:
      return false;
    case 3:
      return rank == 2;
    default:
      return (param + rank) % 4 != 1;  // each rank misses some
  }
}

// Deterministic per (rank, param, wire): every process can rebuild every
// rank's gradients for the reference.
struct RankGrads {
  std::vector<std::vector<double>> storage;  // large enough for any dtype
  std::vector<GradSource> sources;
};

RankGrads MakeGrads(const GroupSpec& spec, int rank, DType wire) {
  RankGrads g;
  g.storage.resize(spec.params.size());
  g.sources.resize(spec.params.size());
  std::mt19937_64 rng(1000 * rank + static_cast<int>(wire));
  // Each gradient in the wire dtype or a narrower one that widens to it.
  std::vector<DType> dtypes;
  for (DType d : kAllDTypes) {
    if (IsLossless(d, wire)) dtypes.push_back(d);
  }
  for (size_t i = 0; i < spec.params.size(); ++i) {
    if (!HasGrad(i, rank) || spec.params[i].numel == 0) continue;
    const DType d = dtypes[(i + rank) % dtypes.size()];
    const int64_t n = spec.params[i].numel;
    g.storage[i].resize(static_cast<size_t>(n));
    char* p = reinterpret_cast<char*>(g.storage[i].data());
    for (int64_t k = 0; k < n; ++k) {
      const double v = (static_cast<double>(rng() % 4001) - 2000.0) / 1000.0;  // [-2, 2]
      const uint64_t bits = [&]() -> uint64_t {
        switch (d) {
          case DType::kFloat8E4M3FN:
            return kernels::FromDouble<DType::kFloat8E4M3FN>(v);
          case DType::kFloat8E5M2:
            return kernels::FromDouble<DType::kFloat8E5M2>(v);
          case DType::kFloat16:
            return kernels::FromDouble<DType::kFloat16>(v);
          case DType::kBFloat16:
            return kernels::FromDouble<DType::kBFloat16>(v);
          case DType::kFloat32:
            return fp::FloatBits(static_cast<float>(v));
          case DType::kFloat64:
            return fp::DoubleBits(v);
        }
        return 0;
      }();
      std::memcpy(p + k * DTypeSize(d), &bits, DTypeSize(d));
    }
    g.sources[i] = {g.storage[i].data(), d};
  }
  return g;
}

double WireToDouble(DType d, const char* p, int64_t i) {
  uint64_t bits = 0;
  std::memcpy(&bits, p + i * DTypeSize(d), DTypeSize(d));
  switch (d) {
    case DType::kFloat8E4M3FN:
      return fp::Float8E4M3FN::ToDouble(static_cast<uint32_t>(bits));
    case DType::kFloat8E5M2:
      return fp::Float8E5M2::ToDouble(static_cast<uint32_t>(bits));
    case DType::kFloat16:
      return fp::Half::ToDouble(static_cast<uint32_t>(bits));
    case DType::kBFloat16:
      return fp::BFloat16::ToDouble(static_cast<uint32_t>(bits));
    case DType::kFloat32:
      return fp::BitsFloat(static_cast<uint32_t>(bits));
    case DType::kFloat64:
      return fp::BitsDouble(bits);
  }
  return 0;
}

// Unit roundoff and half the smallest subnormal of each wire dtype.
double UnitRoundoff(DType d) {
  const int mant[] = {0, 3, 2, 10, 7, 23, 52};
  return std::ldexp(1.0, -(mant[static_cast<int>(d)] + 1));
}
double HalfMinSubnormal(DType d) {
  const int e[] = {0, -10, -17, -25, -134, -150, -1074};
  return std::ldexp(1.0, e[static_cast<int>(d)]);
}

Decision MakeDecision(const GroupSpec& spec, DType wire, int64_t step) {
  Decision d;
  d.step = step;
  d.wire_dtype = wire;
  for (size_t i = 0; i < spec.params.size(); ++i) {
    bool used = false;
    for (int r = 0; r < kWorld; ++r) used = used || HasGrad(i, r);
    d.included.push_back(used);
  }
  d.layout_fingerprint = LayoutFingerprint(spec, kWorld, d.included, wire);
  return d;
}

// Runs in a child process; returns the number of failures (printed).
int RunRank(const std::string& dir, int rank) {
  int failures = 0;
  auto fail = [&](const std::string& msg) {
    std::fprintf(stderr, "rank %d: %s\n", rank, msg.c_str());
    ++failures;
  };
  testing::DirKeyValueStore kv(dir);
  const GroupSpec spec = Spec();
  for (GlooAlgorithm algo : {GlooAlgorithm::kRing, GlooAlgorithm::kAllreduce}) {
    CollectiveOptions options;
    options.gloo_algorithm = algo;
    options.timeout = std::chrono::seconds(60);
    // The ring rendezvouses under a run's incarnation ("job/0/run-1/..."),
    // the allreduce directly under its prefix: both key layouts are used.
    if (algo == GlooAlgorithm::kRing) options.incarnation = "run-1";
    const std::string prefix = absl::StrCat("job/", static_cast<int>(algo));
    absl::StatusOr<std::unique_ptr<Collective>> coll =
        CreateCollective(Backend::kGloo, rank, kWorld, kv, prefix, options);
    if (!coll.ok()) {
      fail(coll.status().ToString());
      return failures;
    }
    GroupReducer reducer(spec, **coll, {});
    int64_t step = 0;
    for (DType wire : kAllDTypes) {
      const std::string what =
          absl::StrCat("algorithm ", static_cast<int>(algo), " wire ", DTypeName(wire));
      const Decision decision = MakeDecision(spec, wire, ++step);
      RankGrads mine = MakeGrads(spec, rank, wire);
      if (absl::Status s = reducer.Reduce(decision, mine.sources); !s.ok()) {
        fail(absl::StrCat(what, ": ", s.ToString()));
        continue;
      }
      const Layout& layout = reducer.layout();
      if (layout.params[2].included || !layout.params[3].included) {
        fail(absl::StrCat(what, ": skip/zero-fill not reflected in the layout"));
      }
      // float64 reference: pack every rank's gradients and add row `rank`.
      std::vector<double> ref(layout.row_numel, 0.0), mag(layout.row_numel, 0.0);
      for (int q = 0; q < kWorld; ++q) {
        RankGrads g = MakeGrads(spec, q, wire);
        std::vector<char> buf(layout.total_bytes());
        if (!PackCpu(spec, layout, g.sources, buf.data()).ok()) fail("reference pack failed");
        const char* row = buf.data() + rank * layout.row_numel * DTypeSize(wire);
        for (int64_t j = 0; j < layout.row_numel; ++j) {
          const double v = WireToDouble(wire, row, j);
          ref[j] += v;
          mag[j] += std::fabs(v);
        }
      }
      const char* shard = static_cast<const char*>(reducer.shard());
      for (int64_t j = 0; j < layout.row_numel; ++j) {
        const double got = WireToDouble(wire, shard, j);
        const double tol = (kWorld - 1) * (UnitRoundoff(wire) * mag[j] + HalfMinSubnormal(wire));
        if (!(std::fabs(got - ref[j]) <= tol)) {
          fail(absl::StrCat(what, ": element ", j, " got ", got, " want ", ref[j], " +- ", tol));
          break;
        }
      }
      // Unpack to fp64 without padding: same values as the shard.
      std::vector<std::vector<double>> out(spec.params.size());
      std::vector<UnpackTarget> targets(spec.params.size());
      for (size_t i = 0; i < spec.params.size(); ++i) {
        if (!layout.params[i].included) continue;
        out[i].resize(layout.params[i].chunk_numel + 1);
        targets[i] = {out[i].data(), DType::kFloat64};
      }
      UnpackOptions uo;
      uo.drop_padding = true;
      if (absl::Status s = reducer.Unpack(targets, uo); !s.ok()) fail(s.ToString());
      for (size_t i = 0; i < spec.params.size(); ++i) {
        const int64_t n = UnpackedNumel(spec, layout, i, rank, true);
        for (int64_t k = 0; k < n; ++k) {
          if (out[i][k] != WireToDouble(wire, shard, layout.params[i].row_offset + k)) {
            fail(absl::StrCat(what, ": unpacked param ", i, " element ", k, " differs"));
            break;
          }
        }
      }
    }
  }
  return failures;
}

TEST(GlooReduceScatterTest, FourProcessesEveryWireDTypeMatchFloat64SumWithZeroFillAndSkip) {
  char tmpl[] = "/tmp/accord_gloo_test.XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  std::vector<pid_t> pids;
  for (int r = 0; r < kWorld; ++r) {
    const pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      alarm(180);  // a hung child dies (SIGALRM) instead of hanging the test
      _exit(RunRank(dir, r) == 0 ? 0 : 1);
    }
    pids.push_back(pid);
  }
  for (int r = 0; r < kWorld; ++r) {
    int status = 0;
    ASSERT_EQ(waitpid(pids[r], &status, 0), pids[r]);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
        << "rank " << r << " failed (status " << status << "; its messages are above)";
  }
  std::filesystem::remove_all(dir);
}

// A fake collective: the reducer must refuse before calling it.
class NeverCalledCollective : public Collective {
 public:
  absl::Status ReduceScatterSum(const void*, void*, int64_t, DType, void*) override {
    ADD_FAILURE() << "collective launched despite a fingerprint mismatch";
    return absl::OkStatus();
  }
  absl::Status CheckWireDType(DType) const override { return absl::OkStatus(); }
  int rank() const override { return 1; }
  int world_size() const override { return kWorld; }
  Backend backend() const override { return Backend::kGloo; }
};

TEST(GroupReducerTest, RefusesDecisionWithOtherLayoutFingerprintNamingGroupStepAndBoth) {
  NeverCalledCollective coll;
  GroupReducer reducer(Spec(), coll, {});
  Decision d = MakeDecision(Spec(), DType::kFloat32, 41);
  const uint64_t mine = d.layout_fingerprint;
  d.layout_fingerprint ^= 1;
  std::vector<GradSource> sources(Spec().params.size());
  absl::Status s = reducer.Reduce(d, sources);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("blocks.3"), std::string::npos) << s;
  EXPECT_NE(s.message().find("step 41"), std::string::npos) << s;
  EXPECT_NE(s.message().find(absl::StrCat(mine)), std::string::npos) << s;
  EXPECT_NE(s.message().find(absl::StrCat(mine ^ 1)), std::string::npos) << s;
  EXPECT_EQ(reducer.Unpack({}).code(), absl::StatusCode::kFailedPrecondition);
}

TEST(CollectiveFactoryTest, GlooWorldOfOneCopiesAndBadRankIsInvalid) {
  char tmpl[] = "/tmp/accord_gloo_test.XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  testing::DirKeyValueStore kv(tmpl);
  EXPECT_EQ(CreateCollective(Backend::kGloo, 3, 2, kv, "x").status().code(),
            absl::StatusCode::kInvalidArgument);
  absl::StatusOr<std::unique_ptr<Collective>> c = CreateCollective(Backend::kGloo, 0, 1, kv, "one");
  ASSERT_TRUE(c.ok()) << c.status();
  std::vector<float> in = {1, 2, 3}, out(3);
  ASSERT_TRUE((*c)->ReduceScatterSum(in.data(), out.data(), 3, DType::kFloat32).ok());
  EXPECT_EQ(out, in);
  std::filesystem::remove_all(tmpl);
}

}  // namespace
}  // namespace accord
