// Group specs and the FSDP2 buffer layout. The layout is checked element by
// element against a naive reference that builds the buffer the way FSDP2
// does: pad each included parameter's dim 0 to a multiple of W, view it as
// (W, -1), and concatenate those views along dim 1.
#include "core/group.h"

#include <algorithm>
#include <ostream>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace accord {
namespace {

using ::testing::HasSubstr;

// What one buffer element holds: parameter index and element index within
// it, or element -1 for padding.
struct Tag {
  int param = -1;
  int64_t element = -1;
  friend bool operator==(const Tag&, const Tag&) = default;
};

std::ostream& operator<<(std::ostream& os, const Tag& t) {
  return os << "(param " << t.param << ", element " << t.element << ")";
}

// The naive reference: W rows, built by literally padding, viewing as (W, -1)
// and concatenating along dim 1; returned flattened row-major.
std::vector<Tag> ReferenceBuffer(const GroupSpec& spec, int world,
                                 const std::vector<bool>& included) {
  std::vector<std::vector<Tag>> rows(world);
  for (size_t i = 0; i < spec.params.size(); ++i) {
    if (!included[i]) continue;
    const ParamSpec& p = spec.params[i];
    const int64_t inner = p.dim0 == 0 ? 0 : p.numel / p.dim0;
    int64_t padded_dim0 = p.dim0;
    while (padded_dim0 % world != 0) ++padded_dim0;
    // The padded tensor, flattened: real elements then zero padding.
    std::vector<Tag> padded(padded_dim0 * inner);
    for (int64_t k = 0; k < static_cast<int64_t>(padded.size()); ++k) {
      padded[k] = Tag{static_cast<int>(i), k < p.numel ? k : -1};
    }
    // View as (W, -1): row r is the r-th contiguous slice.
    const int64_t cols = static_cast<int64_t>(padded.size()) / world;
    for (int r = 0; r < world; ++r) {
      rows[r].insert(rows[r].end(), padded.begin() + r * cols, padded.begin() + (r + 1) * cols);
    }
  }
  std::vector<Tag> out;
  for (const auto& row : rows) {
    EXPECT_EQ(row.size(), rows[0].size());  // torch.cat along dim 1 needs equal rows
    out.insert(out.end(), row.begin(), row.end());
  }
  return out;
}

// The buffer as Layout describes it.
std::vector<Tag> LayoutBuffer(const GroupSpec& spec, const Layout& layout) {
  std::vector<Tag> out(layout.total_numel());
  for (size_t i = 0; i < spec.params.size(); ++i) {
    const ParamLayout& pl = layout.params[i];
    if (!pl.included) continue;
    for (int r = 0; r < layout.world_size; ++r) {
      for (int64_t j = 0; j < pl.chunk_numel; ++j) {
        const int64_t k = r * pl.chunk_numel + j;
        Tag& t = out[layout.ChunkOffset(i, r) + j];
        EXPECT_EQ(t, Tag{}) << "element written twice";
        t = Tag{static_cast<int>(i), k < spec.params[i].numel ? k : -1};
      }
    }
  }
  return out;
}

GroupSpec MakeSpec(std::vector<std::pair<int64_t, int64_t>> dims) {
  GroupSpec spec;
  spec.group_id = "g";
  for (size_t i = 0; i < dims.size(); ++i) {
    spec.params.push_back(ParamSpec{absl::StrCat("p", i), dims[i].first, dims[i].second});
  }
  return spec;
}

void ExpectMatchesReference(const GroupSpec& spec, int world, const std::vector<bool>& included,
                            DType wire) {
  ASSERT_TRUE(ValidateGroupSpec(spec).ok()) << ValidateGroupSpec(spec);
  absl::StatusOr<Layout> layout = ComputeLayout(spec, world, included, wire);
  ASSERT_TRUE(layout.ok()) << layout.status();
  const std::vector<Tag> want = ReferenceBuffer(spec, world, included);
  EXPECT_EQ(layout->total_numel(), static_cast<int64_t>(want.size()));
  EXPECT_EQ(layout->total_bytes(), static_cast<int64_t>(want.size() * DTypeSize(wire)));
  EXPECT_EQ(LayoutBuffer(spec, *layout), want);
  EXPECT_EQ(layout->fingerprint, LayoutFingerprint(spec, world, included, wire));
  for (size_t i = 0; i < spec.params.size(); ++i) {
    const ParamLayout& pl = layout->params[i];
    EXPECT_EQ(pl.included, included[i]);
    EXPECT_EQ(pl.padded_dim0 % world, 0);
    EXPECT_GE(pl.padded_dim0, spec.params[i].dim0);
    EXPECT_LT(pl.padded_dim0 - spec.params[i].dim0, world);
  }
}

constexpr int kWorlds[] = {1, 2, 3, 8};

TEST(LayoutTest, MatchesReferenceOnEdgeShapes) {
  // dim0 < W, dim0 not divisible by W, zero-element params (dim0 == 0), and
  // dim0 > 0 with numel == 0 (e.g. shape (5, 0)).
  const GroupSpec spec = MakeSpec(
      {{1, 3}, {2, 2}, {0, 0}, {5, 0}, {7, 21}, {8, 8}, {9, 18}, {3, 3}, {16, 64}, {1, 1}});
  for (int world : kWorlds) {
    SCOPED_TRACE(absl::StrCat("W=", world));
    ExpectMatchesReference(spec, world, std::vector<bool>(spec.params.size(), true),
                           DType::kFloat32);
    std::vector<bool> alternate(spec.params.size());
    for (size_t i = 0; i < alternate.size(); ++i) alternate[i] = i % 2 == 0;
    ExpectMatchesReference(spec, world, alternate, DType::kBFloat16);
    ExpectMatchesReference(spec, world, std::vector<bool>(spec.params.size(), false),
                           DType::kFloat16);
  }
}

TEST(LayoutTest, MatchesReferenceOnRandomSpecs) {
  std::mt19937_64 rng(424242);
  for (int trial = 0; trial < 200; ++trial) {
    const int world = kWorlds[trial % 4];
    std::vector<std::pair<int64_t, int64_t>> dims;
    const int n = 1 + static_cast<int>(rng() % 12);
    for (int i = 0; i < n; ++i) {
      const int64_t dim0 = static_cast<int64_t>(rng() % 20);
      const int64_t inner = dim0 == 0 ? 0 : static_cast<int64_t>(rng() % 6);
      dims.push_back({dim0, dim0 * inner});
    }
    const GroupSpec spec = MakeSpec(dims);
    std::vector<bool> included(n);
    for (int i = 0; i < n; ++i) included[i] = rng() % 3 != 0;
    SCOPED_TRACE(absl::StrCat("trial ", trial, " W=", world));
    ExpectMatchesReference(spec, world, included, kAllDTypes[rng() % kNumDTypes]);
  }
}

TEST(LayoutTest, WorldOfOneIsConcatenation) {
  const GroupSpec spec = MakeSpec({{3, 6}, {4, 4}, {2, 10}});
  absl::StatusOr<Layout> l = ComputeLayout(spec, 1, {true, false, true}, DType::kFloat32);
  ASSERT_TRUE(l.ok());
  EXPECT_EQ(l->row_numel, 16);
  EXPECT_EQ(l->params[0].row_offset, 0);
  EXPECT_EQ(l->params[2].row_offset, 6);
}

TEST(LayoutTest, SmallDim0IsPaddedToOneSlicePerRank) {
  // dim0 = 3 with W = 8: padded to 8, one slice (of 4 elements) per rank;
  // ranks 3..7 receive padding only.
  const GroupSpec spec = MakeSpec({{3, 12}});
  absl::StatusOr<Layout> l = ComputeLayout(spec, 8, {true}, DType::kFloat32);
  ASSERT_TRUE(l.ok());
  EXPECT_EQ(l->params[0].padded_dim0, 8);
  EXPECT_EQ(l->params[0].chunk_dim0, 1);
  EXPECT_EQ(l->params[0].chunk_numel, 4);
  EXPECT_EQ(l->row_numel, 4);
  EXPECT_EQ(l->total_bytes(), 8 * 4 * 4);
}

TEST(LayoutTest, Errors) {
  const GroupSpec spec = MakeSpec({{3, 12}, {2, 2}});
  absl::StatusOr<Layout> l = ComputeLayout(spec, 0, {true, true}, DType::kFloat32);
  EXPECT_EQ(l.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(l.status().message(), HasSubstr("world size 0 is below 1"));
  l = ComputeLayout(spec, 2, {true}, DType::kFloat32);
  EXPECT_EQ(l.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(l.status().message(), HasSubstr("1 inclusion flags for 2 parameters"));
}

TEST(LayoutFingerprintTest, SameOnEveryRankGivenSameInputs) {
  // Each "rank" builds its spec and flags independently.
  for (int world : kWorlds) {
    const GroupSpec a = MakeSpec({{5, 10}, {0, 0}, {7, 7}});
    const GroupSpec b = MakeSpec({{5, 10}, {0, 0}, {7, 7}});
    const std::vector<bool> inc_a = {true, false, true};
    const std::vector<bool> inc_b = {true, false, true};
    EXPECT_EQ(ComputeLayout(a, world, inc_a, DType::kBFloat16)->fingerprint,
              ComputeLayout(b, world, inc_b, DType::kBFloat16)->fingerprint);
  }
}

TEST(LayoutFingerprintTest, ChangesWithInclusionDTypeWorldAndSizes) {
  const GroupSpec spec = MakeSpec({{5, 10}, {3, 3}, {7, 7}});
  const std::vector<bool> inc = {true, false, true};
  const uint64_t base = LayoutFingerprint(spec, 4, inc, DType::kBFloat16);
  std::vector<uint64_t> others;
  for (size_t i = 0; i < inc.size(); ++i) {
    std::vector<bool> flipped = inc;
    flipped[i] = !flipped[i];
    others.push_back(LayoutFingerprint(spec, 4, flipped, DType::kBFloat16));
  }
  for (DType d : kAllDTypes) {
    if (d != DType::kBFloat16) others.push_back(LayoutFingerprint(spec, 4, inc, d));
  }
  for (int w : {1, 2, 3, 5, 8}) others.push_back(LayoutFingerprint(spec, w, inc, DType::kBFloat16));
  for (size_t i = 0; i < spec.params.size(); ++i) {
    GroupSpec s = spec;
    s.params[i].dim0 += 1;
    s.params[i].numel = s.params[i].dim0 * (spec.params[i].numel / spec.params[i].dim0);
    others.push_back(LayoutFingerprint(s, 4, inc, DType::kBFloat16));
    s = spec;
    s.params[i].numel *= 2;
    others.push_back(LayoutFingerprint(s, 4, inc, DType::kBFloat16));
  }
  // A skipped parameter's size still counts: ranks that disagree on it are
  // caught before the collective.
  for (uint64_t o : others) EXPECT_NE(o, base);
  std::sort(others.begin(), others.end());
  EXPECT_EQ(std::adjacent_find(others.begin(), others.end()), others.end());
}

TEST(LayoutFingerprintTest, IgnoresNamesAndGroupId) {
  GroupSpec a = MakeSpec({{5, 10}, {3, 3}});
  GroupSpec b = a;
  b.group_id = "other";
  b.params[0].name = "renamed";
  EXPECT_EQ(LayoutFingerprint(a, 2, {true, true}, DType::kFloat32),
            LayoutFingerprint(b, 2, {true, true}, DType::kFloat32));
}

// --- ValidateGroupSpec -------------------------------------------------------

TEST(ValidateGroupSpecTest, AcceptsEdgeShapes) {
  EXPECT_TRUE(ValidateGroupSpec(MakeSpec({{0, 0}, {5, 0}, {1, 1}, {3, 12}})).ok());
}

void ExpectInvalid(const GroupSpec& spec, std::vector<std::string> substrs) {
  absl::Status s = ValidateGroupSpec(spec);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  for (const std::string& sub : substrs) EXPECT_THAT(s.message(), HasSubstr(sub));
}

TEST(ValidateGroupSpecTest, RejectsMalformedSpecs) {
  GroupSpec s = MakeSpec({{2, 4}});
  s.group_id = "";
  ExpectInvalid(s, {"group id is empty"});
  ExpectInvalid(GroupSpec{"g", {}}, {"group \"g\" has no parameters"});
  s = MakeSpec({{2, 4}, {3, 3}, {1, 1}});
  s.params[2].name = "p0";
  ExpectInvalid(s, {"group \"g\" parameter 2 \"p0\"", "name registered twice"});
  s = MakeSpec({{2, 4}, {3, 3}});
  s.params[1].name = "";
  ExpectInvalid(s, {"parameter 1", "empty name"});
  ExpectInvalid(MakeSpec({{2, 4}, {3, 7}}),
                {"parameter 1 \"p1\" (dim0=3, numel=7)", "numel is not a multiple of dim0"});
  ExpectInvalid(MakeSpec({{-1, 0}}), {"parameter 0", "negative size"});
  ExpectInvalid(MakeSpec({{2, -4}}), {"parameter 0", "negative size"});
  ExpectInvalid(MakeSpec({{0, 4}}), {"dim0 is 0 but numel is not"});
  ExpectInvalid(MakeSpec({{1, kMaxParamNumel + 1}}), {"numel above"});
}

// --- CompareRegistration -----------------------------------------------------

TEST(CompareRegistrationTest, IdenticalIsOk) {
  EXPECT_TRUE(
      CompareRegistration(MakeSpec({{2, 4}, {3, 3}}), 0, MakeSpec({{2, 4}, {3, 3}}), 5).ok());
}

TEST(CompareRegistrationTest, CountMismatchNamesFirstExtraParamAndRanks) {
  const GroupSpec ref = MakeSpec({{2, 4}, {3, 3}, {4, 4}});
  const GroupSpec cand = MakeSpec({{2, 4}, {3, 3}});
  absl::Status s = CompareRegistration(ref, 0, cand, 3);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("group \"g\" between rank 0 and rank 3"));
  EXPECT_THAT(s.message(), HasSubstr("3 parameters on rank 0 but 2 on rank 3"));
  EXPECT_THAT(s.message(), HasSubstr("first differing parameter 2 \"p2\""));
  EXPECT_THAT(s.message(), HasSubstr("exists only on rank 0"));
  // And the other way round.
  s = CompareRegistration(cand, 1, ref, 6);
  EXPECT_THAT(s.message(), HasSubstr("2 parameters on rank 1 but 3 on rank 6"));
  EXPECT_THAT(s.message(), HasSubstr("exists only on rank 6"));
}

TEST(CompareRegistrationTest, OrderMismatchNamesIndexAndBothNames) {
  GroupSpec ref = MakeSpec({{2, 4}, {3, 3}, {4, 4}});
  GroupSpec cand = ref;
  std::swap(cand.params[1], cand.params[2]);
  absl::Status s = CompareRegistration(ref, 0, cand, 7);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("parameter 1 is \"p1\" (dim0=3, numel=3) on rank 0 but "
                                     "\"p2\" (dim0=4, numel=4) on rank 7"));
}

TEST(CompareRegistrationTest, SizeMismatchNamesIndexAndBothSizes) {
  GroupSpec ref = MakeSpec({{2, 4}, {3, 3}});
  GroupSpec cand = ref;
  cand.params[0].dim0 = 4;
  cand.params[0].numel = 8;
  absl::Status s = CompareRegistration(ref, 2, cand, 9);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("parameter 0 is \"p0\" (dim0=2, numel=4) on rank 2 but "
                                     "\"p0\" (dim0=4, numel=8) on rank 9"));
}

TEST(CompareRegistrationTest, GroupIdMismatch) {
  GroupSpec ref = MakeSpec({{2, 4}});
  GroupSpec cand = ref;
  cand.group_id = "h";
  absl::Status s = CompareRegistration(ref, 0, cand, 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("group id \"h\" on rank 1"));
}

// --- SpecFingerprint ---------------------------------------------------------

TEST(SpecFingerprintTest, EqualSpecsEqualAndAnyChangeDiffers) {
  const GroupSpec base = MakeSpec({{2, 4}, {3, 3}, {0, 0}});
  EXPECT_EQ(SpecFingerprint(base), SpecFingerprint(MakeSpec({{2, 4}, {3, 3}, {0, 0}})));
  std::vector<GroupSpec> variants;
  GroupSpec v = base;
  v.group_id = "g2";
  variants.push_back(v);
  v = base;
  v.params[1].name = "q";
  variants.push_back(v);
  v = base;
  std::swap(v.params[0], v.params[1]);
  variants.push_back(v);
  v = base;
  v.params[0].numel = 6;
  v.params[0].dim0 = 3;
  variants.push_back(v);
  v = base;
  v.params.pop_back();
  variants.push_back(v);
  // Name boundaries matter: ("ab","c") vs ("a","bc").
  GroupSpec x = MakeSpec({{1, 1}, {1, 1}});
  GroupSpec y = x;
  x.params[0].name = "ab";
  x.params[1].name = "c";
  y.params[0].name = "a";
  y.params[1].name = "bc";
  EXPECT_NE(SpecFingerprint(x), SpecFingerprint(y));
  for (const GroupSpec& g : variants) EXPECT_NE(SpecFingerprint(g), SpecFingerprint(base));
}

}  // namespace
}  // namespace accord
