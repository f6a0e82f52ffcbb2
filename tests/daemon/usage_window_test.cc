#include "daemon/coordinator/usage_window.h"

#include <memory>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace accord::daemon {
namespace {

using ::testing::ElementsAre;

// A content of `world` ranks served by `ranks`, with a gradient (any dtype)
// for the parameters whose `used` entry is true.
std::shared_ptr<const Content> MakeContent(int world, std::vector<int> ranks,
                                           std::vector<bool> used) {
  auto c = std::make_shared<Content>();
  auto set = std::make_shared<RankSet>(world);
  for (int r : ranks) set->Add(r);
  c->ranks = set;
  c->rank_count = static_cast<int>(ranks.size());
  for (bool u : used) c->dtypes.push_back(u ? MaskOf(DType::kFloat32) : 0);
  c->word_hi = static_cast<int>(set->words().size());
  return c;
}

std::vector<std::shared_ptr<const Content>> One(std::shared_ptr<const Content> c) {
  return {std::move(c)};
}

TEST(UsageWindowTest, IdenticalConsecutiveStepsShareOneRun) {
  UsageWindow w;
  auto c = MakeContent(2, {0, 1}, {true, false});
  const int64_t first = w.Record(0, /*same=*/false, [&] { return One(c); });
  EXPECT_EQ(first, UsageWindow::ContentBytes(One(c)));
  EXPECT_GT(first, 0);
  EXPECT_EQ(w.Record(1, /*same=*/true, [&] { return One(c); }), 0);
  EXPECT_EQ(w.Record(2, /*same=*/true, [&] { return One(c); }), 0);
  ASSERT_EQ(w.runs().size(), 1u);
  EXPECT_EQ(w.runs()[0].first_step, 0);
  EXPECT_EQ(w.runs()[0].steps, 3);
  EXPECT_EQ(w.steps(), 3);
  EXPECT_EQ(w.bytes(), first);
}

TEST(UsageWindowTest, ASameStepAfterAGapStartsARun) {
  UsageWindow w;
  auto c = MakeContent(2, {0, 1}, {true});
  w.Record(0, false, [&] { return One(c); });
  w.Record(5, /*same=*/true, [&] { return One(c); });  // step 1..4 were not decided here
  ASSERT_EQ(w.runs().size(), 2u);
  EXPECT_EQ(w.runs()[1].first_step, 5);
  EXPECT_EQ(w.steps(), 2);
}

TEST(UsageWindowTest, StepLimitTrimsTheOldestRunPartially) {
  UsageWindow w;
  auto a = MakeContent(2, {0, 1}, {true});
  auto b = MakeContent(2, {0, 1}, {false});
  for (int s = 0; s < 4; ++s) w.Record(s, s > 0, [&] { return One(a); });
  w.Record(4, false, [&] { return One(b); });
  int64_t total = w.bytes();
  UsageWindow::Limits limits;
  limits.steps = 3;
  w.Trim(limits, total);
  EXPECT_EQ(w.steps(), 3);
  ASSERT_EQ(w.runs().size(), 2u);
  EXPECT_EQ(w.runs()[0].first_step, 2);  // steps 0 and 1 dropped
  EXPECT_EQ(w.runs()[0].steps, 2);
  EXPECT_EQ(total, w.bytes());  // nothing freed: the run's contents are still kept
}

TEST(UsageWindowTest, ByteLimitDropsOldestRunsButKeepsTheNewest) {
  UsageWindow w;
  for (int s = 0; s < 4; ++s) {
    w.Record(s, false, [&] { return One(MakeContent(2, {0, 1}, {s % 2 == 0})); });
  }
  int64_t total = w.bytes() + 1000;  // other windows keep 1000 bytes
  UsageWindow::Limits limits;
  limits.bytes = 1;  // less than one run
  w.Trim(limits, total);
  ASSERT_EQ(w.runs().size(), 1u);
  EXPECT_EQ(w.runs()[0].first_step, 3);
  EXPECT_EQ(w.bytes(), w.runs()[0].bytes);
  EXPECT_EQ(total, w.bytes() + 1000);
}

TEST(UsageWindowTest, TotalCapShrinksTheWindowToItsNewestRun) {
  UsageWindow w;
  for (int s = 0; s < 3; ++s) {
    w.Record(s, false, [&] { return One(MakeContent(2, {0}, {true})); });
  }
  int64_t total = w.bytes() + 10;
  UsageWindow::Limits limits;
  limits.total_bytes = 1;  // far below what the windows keep
  w.Trim(limits, total);
  EXPECT_EQ(w.runs().size(), 1u);
  EXPECT_EQ(w.steps(), 1);
  EXPECT_EQ(total, w.bytes() + 10);
}

TEST(UsageWindowTest, NewestCoversTheRequestedSteps) {
  UsageWindow w;
  auto a = MakeContent(2, {0, 1}, {true});
  auto b = MakeContent(2, {0, 1}, {false});
  w.Record(0, false, [&] { return One(a); });
  w.Record(1, true, [&] { return One(a); });
  w.Record(2, false, [&] { return One(b); });
  EXPECT_EQ(w.Newest(1).size(), 1u);
  EXPECT_EQ(w.Newest(2).size(), 2u);  // the newest step and one of the older run
  EXPECT_EQ(w.Newest(0).size(), 2u);  // everything
}

TEST(UsageWindowTest, TakeLeavesTheWindowEmpty) {
  UsageWindow w;
  w.Record(0, false, [&] { return One(MakeContent(2, {0}, {true})); });
  const int64_t bytes = w.bytes();
  UsageWindow taken = w.Take();
  EXPECT_EQ(taken.bytes(), bytes);
  EXPECT_EQ(taken.steps(), 1);
  EXPECT_EQ(w.bytes(), 0);
  EXPECT_EQ(w.steps(), 0);
  EXPECT_TRUE(w.runs().empty());
}

TEST(UsageWindowTest, MatrixCountsSkipsPerRankAndEverywhere) {
  UsageWindow w;
  // Node of ranks 0,1 has param 0 only; rank 1 did not use it (rank_detail).
  auto n0 = std::make_shared<Content>(*MakeContent(3, {0, 1}, {true, false}));
  n0->detail.push_back(RankDetail{1, {false, false}});
  auto n1 = MakeContent(3, {2}, {true, false});
  std::vector<std::shared_ptr<const Content>> step = {n0, n1};
  w.Record(7, false, [&] { return step; });
  w.Record(8, true, [&] { return step; });
  v1::GroupSkipMatrix m = UsageWindow::MatrixOf("g", {"w", "b"}, 3, w.runs(), 0);
  EXPECT_EQ(m.steps(), 2);
  EXPECT_EQ(m.first_step(), 7);
  EXPECT_EQ(m.last_step(), 8);
  ASSERT_EQ(m.rows_size(), 2);
  EXPECT_THAT(m.rows(0).counts(), ElementsAre(0, 2, 0));
  EXPECT_EQ(m.rows(0).skipped_everywhere(), 0);
  EXPECT_THAT(m.rows(1).counts(), ElementsAre(2, 2, 2));
  EXPECT_EQ(m.rows(1).skipped_everywhere(), 2);
  // A window of one step weighs the run once.
  EXPECT_THAT(UsageWindow::MatrixOf("g", {"w", "b"}, 3, w.runs(), 1).rows(0).counts(),
              ElementsAre(0, 1, 0));
}

}  // namespace
}  // namespace accord::daemon
