// Decide: wire dtype (join of gradients and configured reduce dtype, or the
// configured one when exact), zero-fill / skip sets, empty groups, missing
// ranks, determinism across merge orders, and groups with members (their
// count is the layout world; completeness over the members).
#include "core/decide.h"

#include <algorithm>
#include <memory>
#include <optional>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace accord {
namespace {

using ::testing::HasSubstr;

constexpr DType kE4M3 = DType::kFloat8E4M3FN;
constexpr DType kE5M2 = DType::kFloat8E5M2;
constexpr DType kF16 = DType::kFloat16;
constexpr DType kBF16 = DType::kBFloat16;
constexpr DType kF32 = DType::kFloat32;
constexpr DType kF64 = DType::kFloat64;
using Grads = std::vector<std::optional<DType>>;

GroupSpec Spec(size_t n) {
  GroupSpec spec;
  spec.group_id = "blocks.3";
  for (size_t i = 0; i < n; ++i) {
    spec.params.push_back(ParamSpec{absl::StrCat("w", i), static_cast<int64_t>(i + 1),
                                    static_cast<int64_t>(4 * (i + 1))});
  }
  return spec;
}

// Merges one manifest per rank (rank r holds per_rank[r]).
Manifest Cluster(int64_t step, const std::vector<Grads>& per_rank) {
  const int world = static_cast<int>(per_rank.size());
  Manifest m = RankManifest(step, 0, world, per_rank[0]);
  for (int r = 1; r < world; ++r) {
    EXPECT_TRUE(Merge(m, RankManifest(step, r, world, per_rank[r])).ok());
  }
  return m;
}

DType WireOf(const std::vector<Grads>& per_rank, const Policy& policy) {
  absl::StatusOr<Decision> d = Decide(Spec(per_rank[0].size()), static_cast<int>(per_rank.size()),
                                      Cluster(1, per_rank), policy);
  EXPECT_TRUE(d.ok()) << d.status();
  return d.ok() ? d->wire_dtype : DType::kFloat64;
}

Policy WithReduce(std::optional<DType> reduce, bool exact = false,
                  Fp8TieBreak tie = Fp8TieBreak::kBFloat16) {
  Policy p;
  p.reduce_dtype = reduce;
  p.reduce_dtype_exact = exact;
  p.fp8_tie = tie;
  return p;
}

TEST(DecideTest, WireDTypeIsJoinOfGradients) {
  EXPECT_EQ(WireOf({{kBF16, kBF16}, {kBF16, std::nullopt}}, Policy{}), kBF16);
  EXPECT_EQ(WireOf({{kBF16, kBF16}, {kF16, std::nullopt}}, Policy{}), kF32);  // never first-wins
  EXPECT_EQ(WireOf({{kF16, std::nullopt}, {kBF16, kBF16}}, Policy{}), kF32);
  EXPECT_EQ(WireOf({{kBF16, kF32}, {kBF16, kBF16}}, Policy{}), kF32);
  EXPECT_EQ(WireOf({{kE4M3}, {kE5M2}}, Policy{}), kBF16);
  EXPECT_EQ(WireOf({{kE4M3}, {kE5M2}}, WithReduce(std::nullopt, false, Fp8TieBreak::kFloat16)),
            kF16);
  EXPECT_EQ(WireOf({{kE4M3}, {kE5M2}, {kF16}}, Policy{}), kF16);
  EXPECT_EQ(WireOf({{kF64}, {kE4M3}}, Policy{}), kF64);
}

TEST(DecideTest, ConfiguredReduceDTypeJoinsWithGradients) {
  EXPECT_EQ(WireOf({{kBF16}, {kBF16}}, WithReduce(kF32)), kF32);
  EXPECT_EQ(WireOf({{kF32}, {kF32}}, WithReduce(kBF16)), kF32);  // never narrows
  EXPECT_EQ(WireOf({{kF16}, {kF16}}, WithReduce(kBF16)), kF32);
  EXPECT_EQ(WireOf({{kE4M3}, {kE4M3}}, WithReduce(kE5M2)), kBF16);
  EXPECT_EQ(WireOf({{kE4M3}, {kE4M3}}, WithReduce(kE5M2, false, Fp8TieBreak::kFloat16)), kF16);
}

TEST(DecideTest, ExactReduceDTypeIsTheWireDTypeEvenWhenNarrower) {
  EXPECT_EQ(WireOf({{kF32}, {kF32}}, WithReduce(kBF16, true)), kBF16);
  EXPECT_EQ(WireOf({{kF64, kF16}, {kBF16, kF32}}, WithReduce(kF16, true)), kF16);
  EXPECT_EQ(WireOf({{kBF16}, {kBF16}}, WithReduce(kF32, true)), kF32);
  EXPECT_EQ(WireOf({{std::nullopt}, {std::nullopt}}, WithReduce(kE5M2, true)), kE5M2);
}

TEST(DecideTest, RandomizedWireDTypeIsJoinOfEverything) {
  std::mt19937_64 rng(31337);
  for (int trial = 0; trial < 500; ++trial) {
    const int world = 1 + static_cast<int>(rng() % 6);
    const size_t n = 1 + rng() % 6;
    std::vector<Grads> per_rank(world, Grads(n));
    DTypeMask seen = 0;
    for (Grads& g : per_rank) {
      for (auto& d : g) {
        if (rng() % 2) continue;
        d = kAllDTypes[rng() % kNumDTypes];
        seen |= MaskOf(*d);
      }
    }
    Policy p;
    if (rng() % 2) p.reduce_dtype = kAllDTypes[rng() % kNumDTypes];
    p.reduce_dtype_exact = p.reduce_dtype.has_value() && rng() % 3 == 0;
    p.fp8_tie = rng() % 2 ? Fp8TieBreak::kFloat16 : Fp8TieBreak::kBFloat16;
    DType want;
    if (p.reduce_dtype_exact) {
      want = *p.reduce_dtype;
    } else {
      DTypeMask set = seen | (p.reduce_dtype ? MaskOf(*p.reduce_dtype) : 0);
      want = set == 0 ? p.empty_group_dtype : *Join(set, p.fp8_tie);
    }
    EXPECT_EQ(WireOf(per_rank, p), want) << "trial " << trial;
    if (!p.reduce_dtype_exact) {
      // The wire dtype holds every gradient and the configured dtype losslessly.
      for (DType d : kAllDTypes) {
        if (MaskHas(seen, d)) {
          EXPECT_TRUE(IsLossless(d, want));
        }
      }
      if (p.reduce_dtype) {
        EXPECT_TRUE(IsLossless(*p.reduce_dtype, want));
      }
    }
  }
}

TEST(DecideTest, EmptyGroupUsesConfiguredOrEmptyGroupDType) {
  const std::vector<Grads> none = {{std::nullopt, std::nullopt}, {std::nullopt, std::nullopt}};
  EXPECT_EQ(WireOf(none, Policy{}), kF32);  // the default empty_group_dtype
  Policy p;
  p.empty_group_dtype = kBF16;
  EXPECT_EQ(WireOf(none, p), kBF16);
  p.empty_group_dtype = kF64;
  EXPECT_EQ(WireOf(none, p), kF64);
  EXPECT_EQ(WireOf(none, WithReduce(kF16)), kF16);
  EXPECT_EQ(WireOf(none, WithReduce(kF16, true)), kF16);
  absl::StatusOr<Decision> d = Decide(Spec(2), 2, Cluster(4, none), Policy{});
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->SkipIndices(), (std::vector<int>{0, 1}));
  EXPECT_TRUE(d->ZeroFillIndices().empty());
}

TEST(DecideTest, ZeroFillIsUsedSomewhereSkipIsUsedNowhere) {
  // Param 0: used everywhere. 1: only rank 2. 2: nowhere. 3: ranks 0 and 3.
  const std::vector<Grads> per_rank = {
      {kBF16, std::nullopt, std::nullopt, kBF16},
      {kBF16, std::nullopt, std::nullopt, std::nullopt},
      {kBF16, kBF16, std::nullopt, std::nullopt},
      {kBF16, std::nullopt, std::nullopt, kBF16},
  };
  absl::StatusOr<Decision> d = Decide(Spec(4), 4, Cluster(17, per_rank), Policy{});
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->step, 17);
  EXPECT_EQ(d->wire_dtype, kBF16);
  EXPECT_EQ(d->included, (std::vector<bool>{true, true, false, true}));
  EXPECT_EQ(d->ZeroFillIndices(), (std::vector<int>{0, 1, 3}));
  EXPECT_EQ(d->SkipIndices(), (std::vector<int>{2}));
  EXPECT_EQ(d->layout_fingerprint, LayoutFingerprint(Spec(4), 4, d->included, d->wire_dtype));
  EXPECT_EQ(d->layout_fingerprint,
            ComputeLayout(Spec(4), 4, d->included, d->wire_dtype)->fingerprint);
}

TEST(DecideTest, MissingRanksAreNamed) {
  const int world = 8;
  const Grads g = {kBF16};
  Manifest m = RankManifest(9, 0, world, g);
  for (int r : {1, 3, 4}) ASSERT_TRUE(Merge(m, RankManifest(9, r, world, g)).ok());
  absl::StatusOr<Decision> d = Decide(Spec(1), world, m, Policy{});
  EXPECT_EQ(d.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(d.status().message(), HasSubstr("group \"blocks.3\" step 9"));
  EXPECT_THAT(d.status().message(), HasSubstr("missing ranks 2,5-7"));
}

// Pinned before groups with members existed: a spec without members decides
// over the whole world exactly as before (the value travels on the wire).
TEST(DecideTest, NoMembersDecidesOverTheWorldAsBefore) {
  const std::vector<Grads> per_rank = {
      {kBF16, std::nullopt, kF32}, {kBF16, std::nullopt, std::nullopt}, {kF16, std::nullopt, kF32}};
  absl::StatusOr<Decision> d = Decide(Spec(3), 3, Cluster(5, per_rank), Policy{});
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->wire_dtype, kF32);
  EXPECT_EQ(d->included, (std::vector<bool>{true, false, true}));
  EXPECT_EQ(d->layout_fingerprint, 0xc7ee96511bb13193ull);
  EXPECT_EQ(SpecFingerprint(Spec(3)), 0xdb3f8f1af9da3f3eull);
}

GroupSpec SpecWithMembers(size_t n, std::vector<int> members, int world) {
  GroupSpec spec = Spec(n);
  absl::StatusOr<MemberSet> set = MemberSet::FromRanks(std::move(members), world);
  EXPECT_TRUE(set.ok()) << set.status();
  if (set.ok()) spec.members = std::make_shared<const MemberSet>(*std::move(set));
  return spec;
}

// Merges one manifest per member (members[i] holds grads[i]) in a world of `world`.
Manifest MembersCluster(int64_t step, int world, const std::vector<int>& members,
                        const std::vector<Grads>& grads) {
  Manifest m = RankManifest(step, members[0], world, grads[0]);
  for (size_t i = 1; i < members.size(); ++i) {
    EXPECT_TRUE(Merge(m, RankManifest(step, members[i], world, grads[i])).ok());
  }
  return m;
}

TEST(DecideTest, MembersDecideOverTheirCountAsTheLayoutWorld) {
  const std::vector<int> members = {1, 3, 5, 7};
  const GroupSpec spec = SpecWithMembers(3, members, 8);
  const std::vector<Grads> grads = {{kBF16, std::nullopt, std::nullopt},
                                    {kBF16, std::nullopt, std::nullopt},
                                    {kBF16, kF32, std::nullopt},
                                    {std::nullopt, std::nullopt, std::nullopt}};
  absl::StatusOr<Decision> d = Decide(spec, 8, MembersCluster(6, 8, members, grads), Policy{});
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->step, 6);
  EXPECT_EQ(d->wire_dtype, kF32);
  EXPECT_EQ(d->included, (std::vector<bool>{true, true, false}));
  EXPECT_EQ(LayoutWorld(spec, 8), 4);
  EXPECT_EQ(d->layout_fingerprint, LayoutFingerprint(spec, 4, d->included, d->wire_dtype));
  EXPECT_NE(d->layout_fingerprint, LayoutFingerprint(spec, 8, d->included, d->wire_dtype));
  EXPECT_EQ(d->layout_fingerprint,
            ComputeLayout(spec, LayoutWorld(spec, 8), d->included, d->wire_dtype)->fingerprint);
}

TEST(DecideTest, MissingMembersAreNamedAmongTheMembers) {
  const GroupSpec spec = SpecWithMembers(1, {0, 2, 4, 6}, 8);
  absl::StatusOr<Decision> d =
      Decide(spec, 8, MembersCluster(3, 8, {0, 2}, {{kBF16}, {kBF16}}), Policy{});
  EXPECT_EQ(d.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(d.status().message(), HasSubstr("group \"blocks.3\" step 3"));
  EXPECT_THAT(d.status().message(), HasSubstr("missing ranks 4,6 of ranks 0,2,4,6"));
}

TEST(DecideTest, ARankOutsideTheMembersIsInvalidAndNamed) {
  for (int outside : {2, 65, 99}) {
    const GroupSpec spec = SpecWithMembers(1, {0, 1}, 100);
    absl::StatusOr<Decision> d = Decide(
        spec, 100, MembersCluster(3, 100, {0, 1, outside}, {{kBF16}, {kBF16}, {kBF16}}), Policy{});
    EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(d.status().message(),
                HasSubstr(absl::StrCat("rank ", outside, " contributed but is not a member")));
    EXPECT_THAT(d.status().message(), HasSubstr("ranks 0-1"));
  }
}

TEST(DecideTest, MembersOfAnotherWorldSizeAreInvalid) {
  const GroupSpec spec = SpecWithMembers(1, {0, 1}, 4);
  absl::StatusOr<Decision> d =
      Decide(spec, 8, MembersCluster(3, 8, {0, 1}, {{kBF16}, {kBF16}}), Policy{});
  EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(d.status().message(), HasSubstr("members of a job of 4 ranks, job has 8"));
}

// A member set of every rank decides exactly as no members.
TEST(DecideTest, MembersOfEveryRankDecideAsNoMembers) {
  std::mt19937_64 rng(909);
  for (int trial = 0; trial < 100; ++trial) {
    const int world = 1 + static_cast<int>(rng() % 9);
    const size_t n = 1 + rng() % 8;
    std::vector<Grads> per_rank(world, Grads(n));
    for (Grads& g : per_rank) {
      for (auto& d : g) {
        if (rng() % 2) d = kAllDTypes[rng() % kNumDTypes];
      }
    }
    std::vector<int> all(world);
    for (int r = 0; r < world; ++r) all[r] = r;
    const Manifest m = Cluster(trial, per_rank);
    absl::StatusOr<Decision> plain = Decide(Spec(n), world, m, Policy{});
    absl::StatusOr<Decision> with = Decide(SpecWithMembers(n, all, world), world, m, Policy{});
    ASSERT_TRUE(plain.ok() && with.ok()) << plain.status() << with.status();
    EXPECT_EQ(*plain, *with) << "trial " << trial;
  }
}

TEST(DecideTest, ManifestThatDoesNotFitTheSpecIsInvalid) {
  const Manifest m = Cluster(2, {{kBF16, kBF16}, {kBF16, kBF16}});
  absl::StatusOr<Decision> d = Decide(Spec(3), 2, m, Policy{});
  EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(d.status().message(), HasSubstr("2 parameter entries but the group registered 3"));
  d = Decide(Spec(2), 3, m, Policy{});
  EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(d.status().message(), HasSubstr("world size 2, job has 3"));
  Manifest bad = m;
  bad.dtypes[1] = 0x80;
  d = Decide(Spec(2), 2, bad, Policy{});
  EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(d.status().message(), HasSubstr("parameter 1 dtype set 0x80"));
}

TEST(DecideTest, DeterministicForAnyMergeOrder) {
  std::mt19937_64 rng(2718);
  for (int trial = 0; trial < 40; ++trial) {
    const int world = 2 + static_cast<int>(rng() % 10);
    const size_t n = 1 + rng() % 30;
    std::vector<Manifest> ranks;
    for (int r = 0; r < world; ++r) {
      Grads g(n);
      for (auto& d : g) {
        if (rng() % 3) d = rng() % 4 ? kBF16 : kAllDTypes[rng() % kNumDTypes];
      }
      ranks.push_back(RankManifest(trial, r, world, g));
    }
    const Policy p = WithReduce(rng() % 2 ? std::optional<DType>(kF32) : std::nullopt);
    std::optional<Decision> first;
    for (int perm = 0; perm < 10; ++perm) {
      std::shuffle(ranks.begin(), ranks.end(), rng);
      Manifest m = ranks[0];
      for (int r = 1; r < world; ++r) ASSERT_TRUE(Merge(m, ranks[r]).ok());
      absl::StatusOr<Decision> d = Decide(Spec(n), world, m, p);
      ASSERT_TRUE(d.ok()) << d.status();
      if (!first) {
        first = *d;
      } else {
        EXPECT_EQ(*d, *first) << "trial " << trial << " permutation " << perm;
      }
    }
  }
}

}  // namespace
}  // namespace accord
