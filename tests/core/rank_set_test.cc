// RankSet bit handling at word boundaries, FromWords validation, FormatRanks.
#include "core/rank_set.h"

#include <vector>

#include "gtest/gtest.h"

namespace accord {
namespace {

TEST(RankSetTest, AddContainsCountAcrossWordBoundaries) {
  for (int world : {0, 1, 63, 64, 65, 128, 130}) {
    RankSet s(world);
    EXPECT_EQ(s.world_size(), world);
    EXPECT_EQ(s.Count(), 0);
    EXPECT_EQ(s.Full(), world == 0);
    std::vector<int> added;
    for (int r = 0; r < world; r += 3) {
      s.Add(r);
      added.push_back(r);
    }
    if (world > 0) {
      s.Add(world - 1);
      if (added.back() != world - 1) added.push_back(world - 1);
    }
    EXPECT_EQ(s.Members(), added) << world;
    EXPECT_EQ(s.Count(), static_cast<int>(added.size()));
    EXPECT_FALSE(s.Contains(-1));
    EXPECT_FALSE(s.Contains(world));
    std::vector<int> missing = s.Missing();
    EXPECT_EQ(missing.size() + added.size(), static_cast<size_t>(world));
    for (int r : missing) s.Add(r);
    EXPECT_TRUE(s.Full());
  }
}

// Full and Empty agree with Count for every single-rank gap and every
// single rank, across word boundaries.
TEST(RankSetTest, FullAndEmptyAgreeWithCount) {
  for (int world : {1, 2, 63, 64, 65, 127, 128, 129, 200}) {
    for (int hole = 0; hole < world; ++hole) {
      RankSet all_but(world), only(world);
      for (int r = 0; r < world; ++r) {
        if (r != hole) all_but.Add(r);
      }
      only.Add(hole);
      EXPECT_FALSE(all_but.Full()) << world << " " << hole;
      EXPECT_EQ(all_but.Empty(), world == 1) << world << " " << hole;
      EXPECT_EQ(only.Full(), world == 1) << world << " " << hole;
      EXPECT_FALSE(only.Empty()) << world << " " << hole;
      all_but.Add(hole);
      EXPECT_TRUE(all_but.Full()) << world;
      EXPECT_EQ(all_but.Count(), world);
    }
    EXPECT_TRUE(RankSet(world).Empty());
  }
  EXPECT_TRUE(RankSet(0).Empty());
  EXPECT_TRUE(RankSet(0).Full());
}

TEST(RankSetTest, UnionAndIntersects) {
  RankSet a(70), b(70);
  a.Add(1);
  a.Add(65);
  b.Add(2);
  EXPECT_FALSE(a.Intersects(b));
  b.Add(65);
  EXPECT_TRUE(a.Intersects(b));
  a.Union(b);
  EXPECT_EQ(a.Members(), (std::vector<int>{1, 2, 65}));
}

TEST(RankSetTest, FromWordsRejectsWrongLengthAndStrayBits) {
  RankSet out;
  EXPECT_TRUE(RankSet::FromWords(65, {0x1, 0x1}, &out));
  EXPECT_EQ(out.Members(), (std::vector<int>{0, 64}));
  EXPECT_FALSE(RankSet::FromWords(65, {0x1}, &out));            // too short
  EXPECT_FALSE(RankSet::FromWords(65, {0x1, 0x0, 0x0}, &out));  // too long
  EXPECT_FALSE(RankSet::FromWords(65, {0x1, 0x2}, &out));       // rank 65 past the world
  EXPECT_FALSE(RankSet::FromWords(3, {0x8}, &out));
  EXPECT_TRUE(RankSet::FromWords(64, {~uint64_t{0}}, &out));
  EXPECT_TRUE(out.Full());
  EXPECT_TRUE(RankSet::FromWords(0, {}, &out));
  EXPECT_FALSE(RankSet::FromWords(-1, {}, &out));
}

TEST(FormatRanksTest, CompactRanges) {
  EXPECT_EQ(FormatRanks({}), "none");
  EXPECT_EQ(FormatRanks({4}), "4");
  EXPECT_EQ(FormatRanks({2, 5, 6, 7}), "2,5-7");
  EXPECT_EQ(FormatRanks({0, 1, 2, 3, 5, 7, 8, 9}), "0-3,5,7-9");
}

}  // namespace
}  // namespace accord
