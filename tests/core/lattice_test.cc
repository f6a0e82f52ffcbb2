// The lossless lattice, checked exhaustively over all 6 dtypes: IsLossless is
// exactly the documented relation (docs/ARCHITECTURE.md, "Lossless lattice"), and Join is
// the least upper bound of every set of dtypes (so every pair and triple),
// independent of order, with the one documented tie {e4m3, e5m2}.
#include "core/lattice.h"

#include <algorithm>
#include <array>
#include <vector>

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

int Idx(DType d) { return static_cast<int>(d) - 1; }

// The documented relation, built independently: the listed edges, closed
// reflexively and transitively (Floyd-Warshall).
std::array<std::array<bool, kNumDTypes>, kNumDTypes> DocumentedOrder() {
  std::array<std::array<bool, kNumDTypes>, kNumDTypes> le{};
  for (int i = 0; i < kNumDTypes; ++i) le[i][i] = true;
  const std::pair<DType, DType> edges[] = {{kE4M3, kF16},  {kE4M3, kBF16}, {kE5M2, kF16},
                                           {kE5M2, kBF16}, {kF16, kF32},   {kBF16, kF32},
                                           {kF32, kF64}};
  for (auto [a, b] : edges) le[Idx(a)][Idx(b)] = true;
  for (int k = 0; k < kNumDTypes; ++k) {
    for (int i = 0; i < kNumDTypes; ++i) {
      for (int j = 0; j < kNumDTypes; ++j) {
        if (le[i][k] && le[k][j]) le[i][j] = true;
      }
    }
  }
  return le;
}

TEST(LatticeTest, IsLosslessIsExactlyTheDocumentedRelation) {
  const auto le = DocumentedOrder();
  int true_pairs = 0;
  for (DType a : kAllDTypes) {
    for (DType b : kAllDTypes) {
      EXPECT_EQ(IsLossless(a, b), le[Idx(a)][Idx(b)]) << DTypeName(a) << " -> " << DTypeName(b);
      true_pairs += IsLossless(a, b) ? 1 : 0;
    }
  }
  EXPECT_EQ(true_pairs, 6 + 13);
}

TEST(LatticeTest, IsLosslessIsReflexiveAntisymmetricTransitive) {
  for (DType a : kAllDTypes) {
    EXPECT_TRUE(IsLossless(a, a)) << DTypeName(a);
    for (DType b : kAllDTypes) {
      if (a != b) {
        EXPECT_FALSE(IsLossless(a, b) && IsLossless(b, a));
      }
      for (DType c : kAllDTypes) {
        if (IsLossless(a, b) && IsLossless(b, c)) {
          EXPECT_TRUE(IsLossless(a, c))
              << DTypeName(a) << " <= " << DTypeName(b) << " <= " << DTypeName(c);
        }
      }
    }
  }
}

TEST(LatticeTest, NamedIncomparablePairs) {
  EXPECT_FALSE(IsLossless(kF16, kBF16));
  EXPECT_FALSE(IsLossless(kBF16, kF16));
  EXPECT_FALSE(IsLossless(kE4M3, kE5M2));
  EXPECT_FALSE(IsLossless(kE5M2, kE4M3));
  EXPECT_FALSE(IsLossless(kF32, kF16));  // narrowing is never lossless
  EXPECT_FALSE(IsLossless(kF64, kF32));
  EXPECT_TRUE(IsLossless(kE4M3, kF64));
}

// Checks Join(set) is an upper bound and least (up to the documented tie).
void ExpectLeastUpperBound(DTypeMask set, Fp8TieBreak tie) {
  absl::StatusOr<DType> j = Join(set, tie);
  ASSERT_TRUE(j.ok()) << j.status();
  const std::string name = DTypeMaskToString(set);
  std::vector<DType> bounds;
  for (DType u : kAllDTypes) {
    bool upper = true;
    for (DType d : kAllDTypes) {
      if (MaskHas(set, d) && !IsLossless(d, u)) upper = false;
    }
    if (upper) bounds.push_back(u);
  }
  ASSERT_TRUE(std::find(bounds.begin(), bounds.end(), *j) != bounds.end())
      << name << ": join " << DTypeName(*j) << " is not an upper bound";
  const bool is_tie = set == (MaskOf(kE4M3) | MaskOf(kE5M2));
  for (DType u : bounds) {
    if (u == *j) continue;
    // No other common upper bound strictly below the join.
    EXPECT_FALSE(IsLossless(u, *j))
        << name << ": " << DTypeName(u) << " is below the join " << DTypeName(*j);
    // Every other common bound is above it, except the other half of the tie.
    if (is_tie && (u == kF16 || u == kBF16)) continue;
    EXPECT_TRUE(IsLossless(*j, u))
        << name << ": join " << DTypeName(*j) << " is not below the common bound " << DTypeName(u);
  }
}

TEST(LatticeTest, JoinIsLeastUpperBoundOfEveryNonEmptySet) {
  for (int set = 1; set < 64; ++set) {
    const DTypeMask mask = static_cast<DTypeMask>(set << 1);
    ExpectLeastUpperBound(mask, Fp8TieBreak::kBFloat16);
    ExpectLeastUpperBound(mask, Fp8TieBreak::kFloat16);
  }
}

TEST(LatticeTest, TieBreakMattersOnlyForTheFp8Pair) {
  for (int set = 1; set < 64; ++set) {
    const DTypeMask mask = static_cast<DTypeMask>(set << 1);
    const DType a = *Join(mask, Fp8TieBreak::kBFloat16);
    const DType b = *Join(mask, Fp8TieBreak::kFloat16);
    if (mask == (MaskOf(kE4M3) | MaskOf(kE5M2))) {
      EXPECT_EQ(a, kBF16);
      EXPECT_EQ(b, kF16);
    } else {
      EXPECT_EQ(a, b) << DTypeMaskToString(mask);
    }
  }
}

TEST(LatticeTest, JoinOfEveryOrderedPairAndTripleIsOrderIndependent) {
  for (Fp8TieBreak tie : {Fp8TieBreak::kBFloat16, Fp8TieBreak::kFloat16}) {
    for (DType a : kAllDTypes) {
      for (DType b : kAllDTypes) {
        EXPECT_EQ(Join({a, b}, tie), Join({b, a}, tie));
        EXPECT_EQ(Join({a, b}, tie), *Join(static_cast<DTypeMask>(MaskOf(a) | MaskOf(b)), tie));
        for (DType c : kAllDTypes) {
          std::array<DType, 3> v = {a, b, c};
          std::sort(v.begin(), v.end());
          const DType first = Join({v[0], v[1], v[2]}, tie);
          do {
            EXPECT_EQ(Join({v[0], v[1], v[2]}, tie), first);
          } while (std::next_permutation(v.begin(), v.end()));
          // The set join is associative: join of a pair's join with the third
          // equals the triple's join whenever no tie is involved.
          const DTypeMask ab = static_cast<DTypeMask>(MaskOf(a) | MaskOf(b));
          if (ab != (MaskOf(kE4M3) | MaskOf(kE5M2))) {
            EXPECT_EQ(Join({Join({a, b}, tie), c}, tie), first);
          }
        }
      }
    }
  }
}

TEST(LatticeTest, Fp16JoinBf16IsAlwaysFp32) {
  for (Fp8TieBreak tie : {Fp8TieBreak::kBFloat16, Fp8TieBreak::kFloat16}) {
    EXPECT_EQ(Join({kF16, kBF16}, tie), kF32);
    EXPECT_EQ(Join({kBF16, kF16}, tie), kF32);
    EXPECT_EQ(Join({kE4M3, kE5M2, kF16, kBF16}, tie), kF32);
    EXPECT_EQ(Join({kF16, kBF16, kF64}, tie), kF64);
    // Every set holding both half types joins to fp32 or fp64, never a half.
    for (int set = 1; set < 64; ++set) {
      const DTypeMask mask = static_cast<DTypeMask>(set << 1) | MaskOf(kF16) | MaskOf(kBF16);
      const DType j = *Join(mask, tie);
      EXPECT_EQ(j, MaskHas(mask, kF64) ? kF64 : kF32) << DTypeMaskToString(mask);
    }
  }
}

TEST(LatticeTest, Fp8PairJoinUsesTieBreak) {
  EXPECT_EQ(Join({kE4M3, kE5M2}), kBF16);  // default
  EXPECT_EQ(Join({kE4M3, kE5M2}, Fp8TieBreak::kBFloat16), kBF16);
  EXPECT_EQ(Join({kE4M3, kE5M2}, Fp8TieBreak::kFloat16), kF16);
  // The tie does not leak into sets that have a least bound: the set join is
  // not a fold of pairwise joins.
  EXPECT_EQ(Join({kE4M3, kE5M2, kF16}, Fp8TieBreak::kBFloat16), kF16);
  EXPECT_EQ(Join({kE4M3, kE5M2, kBF16}, Fp8TieBreak::kFloat16), kBF16);
  EXPECT_EQ(Join({kE4M3, kF16}), kF16);
  EXPECT_EQ(Join({kE5M2, kBF16}), kBF16);
  EXPECT_EQ(Join({kE4M3, kE4M3}), kE4M3);
}

TEST(LatticeTest, JoinRejectsEmptyAndInvalidMasks) {
  absl::StatusOr<DType> empty = Join(DTypeMask{0});
  EXPECT_EQ(empty.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(empty.status().message(), HasSubstr("empty set"));
  for (DTypeMask bad : {DTypeMask{0x01}, DTypeMask{0x80}, DTypeMask{0x81},
                        static_cast<DTypeMask>(0x80 | MaskOf(kF32))}) {
    absl::StatusOr<DType> j = Join(bad);
    EXPECT_EQ(j.status().code(), absl::StatusCode::kInvalidArgument) << int{bad};
    EXPECT_THAT(j.status().message(), HasSubstr("name no dtype"));
  }
}

}  // namespace
}  // namespace accord
