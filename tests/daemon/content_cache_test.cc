#include "daemon/coordinator/content_cache.h"

#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/wire.h"

namespace accord::daemon {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::shared_ptr<const Content> ContentWithKey(uint64_t key, int rank_count = 2) {
  auto c = std::make_shared<Content>();
  c->key = key;
  c->rank_count = rank_count;
  return c;
}

// A full-form node manifest of 3 parameters, float32 where `used` says so.
v1::Manifest FullForm(const std::string& group, int64_t step, unsigned used_bits,
                      v1::DType dtype = v1::FLOAT32) {
  v1::Manifest m;
  m.set_group_id(group);
  m.set_step(step);
  m.set_used_bits(std::string(1, static_cast<char>(used_bits)));
  m.set_uniform_dtype(dtype);
  return m;
}

// Node "n" serving ranks 2 and 3 of a world of 8.
class ParseContentTest : public ::testing::Test {
 protected:
  ParseContentTest() : set_(MakeSet()) {}
  static std::shared_ptr<const RankSet> MakeSet() {
    auto s = std::make_shared<RankSet>(8);
    s->Add(2);
    s->Add(3);
    return s;
  }
  ServedRanks Node() const { return ServedRanks{"n", 2, set_, 0, 1}; }
  std::shared_ptr<const RankSet> set_;
};

TEST_F(ParseContentTest, ManifestWithoutRankBitsSharesTheNodesRankSet) {
  absl::StatusOr<std::shared_ptr<const Content>> c =
      ParseContent(Node(), 3, 8, FullForm("g", 0, 0b101));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ((*c)->ranks.get(), set_.get());
  EXPECT_EQ((*c)->rank_count, 2);
  ASSERT_EQ((*c)->dtypes.size(), 3u);
  EXPECT_NE((*c)->dtypes[0], 0);
  EXPECT_EQ((*c)->dtypes[1], 0);
  EXPECT_NE((*c)->dtypes[2], 0);
  EXPECT_NE((*c)->key, 0u);  // computed when the sender sent none
}

TEST_F(ParseContentTest, SameContentGivesTheSameKey) {
  auto a = ParseContent(Node(), 3, 8, FullForm("g", 0, 0b101));
  auto b = ParseContent(Node(), 3, 8, FullForm("g", 7, 0b101));
  auto c = ParseContent(Node(), 3, 8, FullForm("g", 0, 0b001));
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  EXPECT_EQ((*a)->key, (*b)->key);
  EXPECT_NE((*a)->key, (*c)->key);
}

// Contents decoded before the coordinator's lock (PredecodeContent, then
// ContentFromPredecoded with the registration's count) are ParseContent's,
// and whatever ParseContent refuses is left to it, on random manifests of
// every form: uniform or per-parameter dtypes, counts that do or do not
// match, bits past the count, bad dtypes, rank bits, rank detail, no key.
TEST_F(ParseContentTest, PredecodedContentsAreParseContentsOnRandomManifests) {
  std::mt19937 rng(7);
  const v1::DType dtypes[] = {v1::FLOAT32, v1::BFLOAT16, v1::FLOAT16, v1::DTYPE_UNSPECIFIED,
                              v1::INT32};
  int decoded = 0, left = 0;
  for (int iter = 0; iter < 20000; ++iter) {
    const size_t registered = 1 + rng() % 20;
    const size_t sent = rng() % 4 == 0 ? 1 + rng() % 20 : registered;  // sometimes wrong
    v1::Manifest m;
    m.set_group_id("g");
    m.set_step(rng() % 16 == 0 ? -1 : 3);
    std::string bits((sent + 7) / 8, '\0');
    std::string masks;
    for (size_t i = 0; i < sent; ++i) {
      const bool used = rng() % 3 != 0;
      if (used) bits[i / 8] = static_cast<char>(bits[i / 8] | (1 << (i % 8)));
      const int roll = static_cast<int>(rng() % 40);
      // Mostly consistent masks; sometimes one that disagrees with the bit
      // or is not a float.
      masks.push_back(static_cast<char>(roll == 0   ? 0x80
                                        : roll == 1 ? !used
                                        : used      ? 1 << (roll % 3)
                                                    : 0));
    }
    if (rng() % 10 == 0 && !bits.empty()) bits.back() = static_cast<char>(bits.back() | 0x80);
    m.set_used_bits(bits);
    if (rng() % 2 == 0) {
      m.set_dtype_masks(masks);
      if (rng() % 20 == 0) m.set_uniform_dtype(v1::FLOAT32);  // both: refused
    } else {
      m.set_uniform_dtype(dtypes[rng() % 5]);
    }
    if (rng() % 5 != 0) m.set_cache_key(1 + rng());
    if (rng() % 10 == 0) m.set_rank_bits(wire::RankSetToBits(*set_));
    if (rng() % 10 == 0) {
      v1::RankUsage* u = m.add_rank_detail();
      u->set_rank(2);
      u->set_used_bits(std::string((registered + 7) / 8, '\0'));
    }
    SCOPED_TRACE(m.ShortDebugString() + " registered " + std::to_string(registered));
    absl::StatusOr<std::shared_ptr<const Content>> parsed = ParseContent(Node(), registered, 8, m);
    PredecodedContent pre = PredecodeContent(m);
    std::shared_ptr<const Content> fast = ContentFromPredecoded(Node(), registered, m, pre);
    if (fast == nullptr) {
      ++left;
      continue;
    }
    ++decoded;
    ASSERT_TRUE(parsed.ok()) << "predecoded a manifest ParseContent refuses: " << parsed.status();
    const Content& a = *fast;
    const Content& b = **parsed;
    ASSERT_EQ(a.key, b.key);
    ASSERT_EQ(std::vector<DTypeMask>(a.dtypes.begin(), a.dtypes.end()),
              std::vector<DTypeMask>(b.dtypes.begin(), b.dtypes.end()));
    ASSERT_EQ(a.ranks.get(), b.ranks.get());
    ASSERT_EQ(a.rank_count, b.rank_count);
    ASSERT_EQ(a.word_lo, b.word_lo);
    ASSERT_EQ(a.word_hi, b.word_hi);
    ASSERT_EQ(a.detail.size(), b.detail.size());
  }
  // Both paths were taken often.
  EXPECT_GT(decoded, 2500);
  EXPECT_GT(left, 2000);
}

TEST_F(ParseContentTest, RankBitsNamingAnotherNodesRankAreRefused) {
  v1::Manifest m = FullForm("g", 4, 0b1);
  RankSet foreign(8);
  foreign.Add(2);
  foreign.Add(5);
  m.set_rank_bits(wire::RankSetToBits(foreign));
  absl::StatusOr<std::shared_ptr<const Content>> c = ParseContent(Node(), 3, 8, m);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(c.status().message(), HasSubstr("group \"g\" step 4"));
  EXPECT_THAT(c.status().message(), HasSubstr("rank_bits name ranks 5"));
  EXPECT_THAT(c.status().message(), HasSubstr("node \"n\" does not serve"));
}

TEST_F(ParseContentTest, IntegerGradientIsANonFloatDtypeError) {
  absl::StatusOr<std::shared_ptr<const Content>> c =
      ParseContent(Node(), 3, 8, FullForm("g", 0, 0b1, v1::INT32));
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(wire::KindOf(c.status()), v1::NON_FLOAT_DTYPE);
}

TEST_F(ParseContentTest, RankDetailForAnUncoveredRankIsRefused) {
  v1::Manifest m = FullForm("g", 1, 0b1);
  v1::RankUsage* u = m.add_rank_detail();
  u->set_rank(6);
  u->set_used_bits(std::string(1, '\0'));
  absl::StatusOr<std::shared_ptr<const Content>> c = ParseContent(Node(), 3, 8, m);
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(), HasSubstr("rank_detail for rank 6"));
}

TEST_F(ParseContentTest, ANodeWithoutRanksCannotSendAManifest) {
  std::shared_ptr<const RankSet> none = std::make_shared<RankSet>(8);
  absl::StatusOr<std::shared_ptr<const Content>> c =
      ParseContent(ServedRanks{"empty", 0, none, 0, 0}, 3, 8, FullForm("g", 0, 0b1));
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(), HasSubstr("node \"empty\" serves no rank"));
}

TEST(ContentCacheTest, RepeatResolvesOnlyTheCachedKey) {
  ContentCache cache;
  EXPECT_EQ(cache.Repeat(42), nullptr);  // nothing cached yet
  auto c = ContentWithKey(42, 3);
  EXPECT_EQ(cache.Replace(c), 0);
  EXPECT_EQ(cache.Repeat(42), c.get());
  EXPECT_EQ(cache.Repeat(43), nullptr);
  EXPECT_EQ(cache.key(), 42u);
  EXPECT_EQ(cache.rank_count(), 3);
}

TEST(ContentCacheTest, AReplacedContentIsRetainedWhileAPendingStepNamesIt) {
  ContentCache cache;
  auto first = ContentWithKey(1);
  cache.Replace(first);
  cache.AddStep(10);  // step 10 named `first`
  auto second = ContentWithKey(2);
  EXPECT_EQ(cache.Replace(second), 1);
  cache.AddStep(11);
  EXPECT_EQ(cache.retained(), 1u);
  EXPECT_EQ(cache.Owner(first.get()), first);
  EXPECT_EQ(cache.Owner(second.get()), second);
  EXPECT_TRUE(cache.Contributed(10));
  EXPECT_FALSE(cache.Contributed(12));
  // Step 10 decided: `first` is named by no pending step any more.
  EXPECT_EQ(cache.Prune(10), 1);
  EXPECT_EQ(cache.retained(), 0u);
  EXPECT_EQ(cache.Owner(first.get()), nullptr);
  EXPECT_FALSE(cache.Contributed(10));
  EXPECT_TRUE(cache.Contributed(11));
}

TEST(ContentCacheTest, AReplacedContentNoStepNamedIsNotRetained) {
  ContentCache cache;
  cache.Replace(ContentWithKey(1));
  EXPECT_EQ(cache.Replace(ContentWithKey(2)), 0);
  EXPECT_EQ(cache.retained(), 0u);
}

TEST(ContentCacheTest, SkipCountsFoldRunsOfContributions) {
  ContentCache cache;
  auto c = std::make_shared<Content>();
  c->key = 9;
  c->dtypes = {MaskOf(DType::kFloat32), 0};            // param 1 unused by the whole node
  c->detail.push_back(RankDetail{4, {false, false}});  // rank 4 did not use param 0 either
  cache.Replace(c);
  cache.CountSkips();
  cache.CountSkips();
  cache.CountSkips();
  cache.FlushSkips();
  EXPECT_THAT(cache.node_skips(), ElementsAre(0, 3));
  ASSERT_TRUE(cache.rank_extra_skips().contains(4));
  EXPECT_THAT(cache.rank_extra_skips().at(4), ElementsAre(3, 0));
  cache.FlushSkips();  // idempotent
  EXPECT_THAT(cache.node_skips(), ElementsAre(0, 3));
}

}  // namespace
}  // namespace accord::daemon
