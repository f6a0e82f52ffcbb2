// Manifest merge as a semilattice join, over randomized manifests with fixed
// seeds: commutative, associative, idempotent; the order in which ranks
// arrive never matters; ranks -> nodes -> cluster equals ranks -> cluster.
// Also ValidateManifest, Merge's errors (which leave `into` unchanged) and
// ManifestKey.
#include "core/manifest.h"

#include <algorithm>
#include <numeric>
#include <optional>
#include <random>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace accord {
namespace {

using ::testing::HasSubstr;

// The gradient dtypes one rank holds: each parameter unused with probability
// `p_unused`, otherwise one of a few dtypes (skewed towards one, as in real
// jobs, so that both uniform and mixed manifests appear).
std::vector<std::optional<DType>> RandomGrads(std::mt19937_64& rng, size_t num_params,
                                              double p_unused) {
  std::uniform_real_distribution<double> u(0, 1);
  std::vector<std::optional<DType>> out(num_params);
  for (auto& g : out) {
    if (u(rng) < p_unused) continue;
    const double x = u(rng);
    g = x < 0.7 ? DType::kBFloat16 : kAllDTypes[rng() % kNumDTypes];
  }
  return out;
}

std::vector<Manifest> RandomRankManifests(std::mt19937_64& rng, int64_t step, int world,
                                          size_t num_params) {
  std::vector<Manifest> out;
  const double p_unused = std::uniform_real_distribution<double>(0.0, 0.9)(rng);
  for (int r = 0; r < world; ++r) {
    out.push_back(RankManifest(step, r, world, RandomGrads(rng, num_params, p_unused)));
  }
  return out;
}

// An arbitrary manifest: random rank subset and arbitrary valid masks.
Manifest RandomManifest(std::mt19937_64& rng, int64_t step, int world, size_t num_params) {
  Manifest m;
  m.step = step;
  m.ranks = RankSet(world);
  for (int r = 0; r < world; ++r) {
    if (rng() % 3 == 0) m.ranks.Add(r);
  }
  m.dtypes.resize(num_params);
  for (DTypeMask& d : m.dtypes) d = static_cast<DTypeMask>(rng() & kValidDTypeMask);
  return m;
}

Manifest Merged(Manifest a, const Manifest& b) {
  absl::Status s = Merge(a, b);
  EXPECT_TRUE(s.ok()) << s;
  return a;
}

Manifest MergeAll(const std::vector<Manifest>& ms) {
  Manifest out = ms.front();
  for (size_t i = 1; i < ms.size(); ++i) out = Merged(out, ms[i]);
  return out;
}

constexpr int kWorlds[] = {1, 2, 3, 7, 8, 64, 65, 130};

TEST(ManifestMergeTest, CommutativeAssociativeIdempotent) {
  std::mt19937_64 rng(20261129);
  for (int trial = 0; trial < 300; ++trial) {
    const int world = kWorlds[trial % std::size(kWorlds)];
    const size_t n = rng() % 40;
    const Manifest a = RandomManifest(rng, 5, world, n);
    const Manifest b = RandomManifest(rng, 5, world, n);
    const Manifest c = RandomManifest(rng, 5, world, n);
    EXPECT_EQ(Merged(a, b), Merged(b, a));
    EXPECT_EQ(Merged(Merged(a, b), c), Merged(a, Merged(b, c)));
    EXPECT_EQ(Merged(a, a), a);
    // Merging in something already covered changes nothing.
    const Manifest ab = Merged(a, b);
    EXPECT_EQ(Merged(ab, a), ab);
  }
}

TEST(ManifestMergeTest, RankOrderIsIrrelevant) {
  std::mt19937_64 rng(7);
  for (int world : kWorlds) {
    const std::vector<Manifest> ranks = RandomRankManifests(rng, 12, world, 33);
    const Manifest direct = MergeAll(ranks);
    EXPECT_TRUE(direct.ranks.Full());
    std::vector<Manifest> shuffled = ranks;
    for (int perm = 0; perm < 50; ++perm) {
      std::shuffle(shuffled.begin(), shuffled.end(), rng);
      ASSERT_EQ(MergeAll(shuffled), direct) << "world " << world << " permutation " << perm;
    }
  }
}

TEST(ManifestMergeTest, MergedContentIsUnionOfRanks) {
  std::mt19937_64 rng(11);
  const int world = 9;
  const std::vector<Manifest> ranks = RandomRankManifests(rng, 3, world, 20);
  const Manifest all = MergeAll(ranks);
  for (size_t i = 0; i < 20; ++i) {
    DTypeMask want = 0;
    for (const Manifest& m : ranks) want |= m.dtypes[i];
    EXPECT_EQ(all.dtypes[i], want) << i;
  }
}

TEST(ManifestMergeTest, NodesThenClusterEqualsRanksDirectly) {
  std::mt19937_64 rng(99);
  for (int trial = 0; trial < 60; ++trial) {
    const int world = kWorlds[trial % std::size(kWorlds)];
    const std::vector<Manifest> ranks = RandomRankManifests(rng, 40, world, 1 + rng() % 50);
    const Manifest direct = MergeAll(ranks);
    // Random assignment of ranks to nodes (not necessarily contiguous).
    const int nodes = 1 + static_cast<int>(rng() % world);
    std::vector<int> order(world);
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    std::vector<std::vector<Manifest>> per_node(nodes);
    for (int i = 0; i < world; ++i) per_node[i % nodes].push_back(ranks[order[i]]);
    std::vector<Manifest> node_manifests;
    for (auto& node : per_node) {
      std::shuffle(node.begin(), node.end(), rng);
      node_manifests.push_back(MergeAll(node));
    }
    std::shuffle(node_manifests.begin(), node_manifests.end(), rng);
    EXPECT_EQ(MergeAll(node_manifests), direct) << "trial " << trial;
    // A tree two levels deep as well: pairs of nodes, then the cluster.
    std::vector<Manifest> level2;
    for (size_t i = 0; i < node_manifests.size(); i += 2) {
      level2.push_back(i + 1 < node_manifests.size()
                           ? Merged(node_manifests[i], node_manifests[i + 1])
                           : node_manifests[i]);
    }
    EXPECT_EQ(MergeAll(level2), direct) << "trial " << trial;
  }
}

TEST(ManifestMergeTest, DuplicateRankMergesIdempotently) {
  const Manifest a = RankManifest(1, 2, 4, {DType::kFloat32, std::nullopt});
  Manifest into = a;
  ASSERT_TRUE(Merge(into, a).ok());
  EXPECT_EQ(into, a);
}

TEST(ManifestMergeTest, ErrorsLeaveIntoUnchanged) {
  std::mt19937_64 rng(5);
  const Manifest base = RandomManifest(rng, 10, 8, 6);
  struct Case {
    Manifest other;
    const char* substr;
  };
  Manifest other_step = RandomManifest(rng, 11, 8, 6);
  Manifest other_count = RandomManifest(rng, 10, 8, 7);
  Manifest other_world = RandomManifest(rng, 10, 9, 6);
  for (const Case& c :
       {Case{other_step, "steps 10 and 11"}, Case{other_count, "with 6 and 7 parameters"},
        Case{other_world, "world sizes 8 and 9"}}) {
    Manifest into = base;
    absl::Status s = Merge(into, c.other);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(s.message(), HasSubstr(c.substr));
    EXPECT_EQ(into, base);
  }
}

TEST(RankManifestTest, BuildsMasksAndRankSet) {
  const Manifest m = RankManifest(3, 1, 4, {DType::kBFloat16, std::nullopt, DType::kFloat32});
  EXPECT_EQ(m.step, 3);
  EXPECT_EQ(m.dtypes,
            (std::vector<DTypeMask>{MaskOf(DType::kBFloat16), 0, MaskOf(DType::kFloat32)}));
  EXPECT_EQ(m.ranks.Members(), std::vector<int>{1});
  EXPECT_EQ(m.ranks.world_size(), 4);
}

TEST(ValidateManifestTest, AcceptsWellFormed) {
  const Manifest m = RankManifest(0, 0, 2, {DType::kFloat16});
  EXPECT_TRUE(ValidateManifest(m, "g", 1, 2).ok());
}

TEST(ValidateManifestTest, WrongParamCount) {
  // (A manifest for an unregistered group is the daemon's concern; at core
  // level the closest failure is a manifest whose size fits no registration.)
  const Manifest m = RankManifest(7, 0, 2, {DType::kFloat16, DType::kFloat16, std::nullopt});
  absl::Status s = ValidateManifest(m, "layers.0", 4, 2);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("group \"layers.0\" step 7"));
  EXPECT_THAT(s.message(), HasSubstr("3 parameter entries but the group registered 4"));
}

TEST(ValidateManifestTest, InvalidDTypeBits) {
  for (DTypeMask bad : {DTypeMask{0x01}, DTypeMask{0x80}, DTypeMask{0x83}}) {
    Manifest m = RankManifest(1, 0, 1, {DType::kFloat16, DType::kFloat16, DType::kFloat16});
    m.dtypes[2] = bad;
    absl::Status s = ValidateManifest(m, "g", 3, 1);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(s.message(), HasSubstr("parameter 2 dtype set 0x"));
    EXPECT_THAT(s.message(), HasSubstr("non-float or unknown dtype"));
  }
}

TEST(ValidateManifestTest, NegativeStepWorldMismatchAndNoRanks) {
  Manifest m = RankManifest(-1, 0, 2, {DType::kFloat16});
  EXPECT_THAT(ValidateManifest(m, "g", 1, 2).message(), HasSubstr("negative step"));
  m = RankManifest(1, 0, 2, {DType::kFloat16});
  absl::Status s = ValidateManifest(m, "g", 1, 3);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("rank set for world size 2, job has 3"));
  m = RankManifest(1, 5, 2, {DType::kFloat16});  // rank outside the world
  EXPECT_THAT(ValidateManifest(m, "g", 1, 2).message(), HasSubstr("speaks for no rank"));
}

TEST(ManifestKeyTest, IgnoresStepButNotContent) {
  const Manifest a = RankManifest(1, 0, 4, {DType::kBFloat16, std::nullopt, DType::kFloat32});
  Manifest b = a;
  b.step = 999;
  EXPECT_EQ(ManifestKey(a), ManifestKey(b));
  Manifest c = a;
  c.dtypes[1] = MaskOf(DType::kBFloat16);
  EXPECT_NE(ManifestKey(a), ManifestKey(c));
  Manifest d = a;
  d.dtypes[2] = MaskOf(DType::kFloat16);
  EXPECT_NE(ManifestKey(a), ManifestKey(d));
  Manifest e = a;
  e.ranks.Add(3);
  EXPECT_NE(ManifestKey(a), ManifestKey(e));
  Manifest f = a;
  f.dtypes.push_back(0);
  EXPECT_NE(ManifestKey(a), ManifestKey(f));
  const Manifest g = RankManifest(1, 0, 5, {DType::kBFloat16, std::nullopt, DType::kFloat32});
  EXPECT_NE(ManifestKey(a), ManifestKey(g));
}

TEST(ManifestKeyTest, NoCollisionsAcrossRandomManifests) {
  std::mt19937_64 rng(1234);
  std::vector<uint64_t> keys;
  std::vector<Manifest> seen;
  for (int i = 0; i < 2000; ++i) {
    Manifest m = RandomManifest(rng, 0, 16, 1 + rng() % 20);
    if (std::find(seen.begin(), seen.end(), m) != seen.end()) continue;
    seen.push_back(m);
    keys.push_back(ManifestKey(m));
  }
  std::sort(keys.begin(), keys.end());
  EXPECT_EQ(std::adjacent_find(keys.begin(), keys.end()), keys.end());
}

}  // namespace
}  // namespace accord
