// ReleaseCoalescer (daemon/sidecar/release_coalescer.h): sync classes, the
// n-th release counting, index order, the hold limit, leave and resume
// flushes, and batches without a key.
#include "daemon/sidecar/release_coalescer.h"

#include <deque>
#include <string>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace accord::daemon {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;
using Batch = ReleaseCoalescer::Batch;

constexpr uint64_t kKey = 0x5eed;
constexpr uint64_t kOtherKey = 0x0dd;
const absl::Time kT0 = absl::FromUnixSeconds(1000);
constexpr absl::Duration kLimit = absl::Seconds(5);

class ReleaseCoalescerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (int i = 0; i < 4; ++i) {
      groups_.emplace_back();
      groups_.back().group_id = "g" + std::to_string(i);
      groups_.back().index = i;
    }
    c_.SetHoldLimit(kLimit);
  }

  // Node manifests of groups `indexes` at `step`.
  Batch Items(std::vector<int> indexes, int64_t step) {
    Batch b;
    for (int i : indexes) b.push_back(OutgoingManifest{&groups_[i], step, true, 1, nullptr});
    return b;
  }

  // Rank `rank`'s batch with `key` completing `completed`: the batches sent.
  std::vector<Batch> Send(int rank, uint64_t key, Batch completed, absl::Time now = kT0) {
    const ReleaseCoalescer::Release r = c_.NoteRelease(rank, key);
    std::vector<Batch> out;
    c_.Complete(now, r, completed, &out);
    return out;
  }

  // Each batch as its groups' indexes.
  static std::vector<std::vector<int>> Shape(const std::vector<Batch>& batches) {
    std::vector<std::vector<int>> out;
    for (const Batch& b : batches) {
      out.emplace_back();
      for (const OutgoingManifest& o : b) out.back().push_back(o.group->index);
    }
    return out;
  }

  std::deque<LocalGroup> groups_;
  ReleaseCoalescer c_;
};

// Four ranks, two member sets (groups 0 and 1: ranks {0, 2}; groups 2 and 3:
// ranks {1, 3}), one key: each set completes at its second rank's release,
// and the step goes up as one batch in index order once all four sent it,
// whichever set completed first. The first step goes as it completes: the
// class is the ranks that sent the key so far.
TEST_F(ReleaseCoalescerTest, TwoMemberSetsOfOneClassGoUpAsOneBatchInIndexOrder) {
  EXPECT_THAT(Send(0, kKey, {}), IsEmpty());
  EXPECT_THAT(Send(2, kKey, Items({0, 1}, 0)), ElementsAre(::testing::SizeIs(2)));
  EXPECT_THAT(Send(1, kKey, {}), IsEmpty());
  EXPECT_THAT(Send(3, kKey, Items({2, 3}, 0)), ElementsAre(::testing::SizeIs(2)));
  for (int64_t step = 1; step < 4; ++step) {
    EXPECT_THAT(Send(1, kKey, {}), IsEmpty());
    EXPECT_THAT(Send(3, kKey, Items({2, 3}, step)), IsEmpty());  // rank 0 and 2 not yet
    EXPECT_THAT(Send(0, kKey, {}), IsEmpty());
    const std::vector<Batch> out = Send(2, kKey, Items({0, 1}, step));
    EXPECT_THAT(Shape(out), ElementsAre(ElementsAre(0, 1, 2, 3))) << "step " << step;
    EXPECT_EQ(c_.held_manifests(), 0u);
  }
  EXPECT_EQ(c_.classes(), 1u);
}

// A hold waits for the n-th release of every rank of the class, not for any
// later one: ranks count their own releases.
TEST_F(ReleaseCoalescerTest, HoldWaitsForTheNthReleaseOfEveryClassRank) {
  EXPECT_THAT(Send(0, kKey, {}), IsEmpty());
  EXPECT_THAT(Send(1, kKey, {}), IsEmpty());
  EXPECT_THAT(Shape(Send(2, kKey, Items({0, 1}, 0))), ElementsAre(ElementsAre(0, 1)));
  // Second releases: rank 2's is missing.
  EXPECT_THAT(Send(0, kKey, {}), IsEmpty());
  EXPECT_THAT(Send(1, kKey, Items({0}, 1)), IsEmpty());
  // Ranks 0 and 1 send their third release: the second hold still waits.
  EXPECT_THAT(Send(0, kKey, {}), IsEmpty());
  EXPECT_THAT(Send(1, kKey, {}), IsEmpty());
  EXPECT_EQ(c_.held_manifests(), 1u);
  // Rank 2's second release completes the other group of step 1: one batch.
  EXPECT_THAT(Shape(Send(2, kKey, Items({1}, 1))), ElementsAre(ElementsAre(0, 1)));
}

TEST_F(ReleaseCoalescerTest, BatchWithoutKeyGoesAtOnce) {
  EXPECT_THAT(Send(0, kKey, {}), IsEmpty());
  EXPECT_THAT(Shape(Send(1, 0, Items({3, 1}, 0))), ElementsAre(ElementsAre(3, 1)));
  EXPECT_EQ(c_.classes(), 1u);  // rank 1 is in no class
  // ... so a keyed release of rank 0 alone is ready at once.
  EXPECT_THAT(Shape(Send(0, kKey, Items({0}, 0))), ElementsAre(ElementsAre(0)));
}

TEST_F(ReleaseCoalescerTest, NothingIsHeldWithoutAHoldLimit) {
  c_.SetHoldLimit(absl::ZeroDuration());
  EXPECT_THAT(Send(0, kKey, {}), IsEmpty());
  EXPECT_THAT(Send(1, kKey, {}), IsEmpty());
  // Rank 1's second release, rank 0's not yet: it would be held.
  EXPECT_THAT(Shape(Send(1, kKey, Items({1}, 0))), ElementsAre(ElementsAre(1)));
}

// A silent rank holds its class for the hold limit, no longer.
TEST_F(ReleaseCoalescerTest, HoldIsFlushedAtTheHoldLimit) {
  EXPECT_THAT(Send(0, kKey, {}), IsEmpty());
  EXPECT_THAT(Send(1, kKey, {}), IsEmpty());
  EXPECT_THAT(Send(1, kKey, Items({0}, 0), kT0 + absl::Seconds(1)), IsEmpty());
  std::vector<Batch> out;
  EXPECT_EQ(c_.CheckHolds(kT0 + absl::Seconds(5), &out), kT0 + absl::Seconds(6));
  EXPECT_THAT(out, IsEmpty());
  EXPECT_EQ(c_.CheckHolds(kT0 + absl::Seconds(6), &out), absl::InfiniteFuture());
  EXPECT_THAT(Shape(out), ElementsAre(ElementsAre(0)));
  EXPECT_EQ(c_.expired(), 1);
}

TEST_F(ReleaseCoalescerTest, LeaveOfAClassRankFlushesAndStopsWaitingForIt) {
  EXPECT_THAT(Send(0, kKey, {}), IsEmpty());
  EXPECT_THAT(Send(1, kKey, {}), IsEmpty());
  EXPECT_THAT(Send(1, kKey, Items({2}, 0)), IsEmpty());  // waits for rank 0's second
  std::vector<Batch> out;
  c_.RemoveRank(0, &out);
  EXPECT_THAT(Shape(out), ElementsAre(ElementsAre(2)));
  // Rank 1 alone in the class now.
  EXPECT_THAT(Shape(Send(1, kKey, Items({2}, 1))), ElementsAre(ElementsAre(2)));
}

TEST_F(ReleaseCoalescerTest, DetachFlushesAndKeepsTheRanksCount) {
  EXPECT_THAT(Send(0, kKey, {}), IsEmpty());
  EXPECT_THAT(Send(1, kKey, {}), IsEmpty());
  EXPECT_THAT(Send(1, kKey, Items({2}, 0)), IsEmpty());
  std::vector<Batch> out;
  c_.FlushClassesOf(0, &out);
  EXPECT_THAT(Shape(out), ElementsAre(ElementsAre(2)));
  // Rank 0 is still in the class: rank 1's third release waits for its third.
  EXPECT_THAT(Send(1, kKey, Items({2}, 1)), IsEmpty());
  EXPECT_THAT(Send(0, kKey, {}), IsEmpty());
  EXPECT_THAT(Shape(Send(0, kKey, {})), ElementsAre(ElementsAre(2)));
}

// A resumed rank's next release is numbered with the class's next one,
// whether its release before the resume arrived or not.
TEST_F(ReleaseCoalescerTest, ResumeFlushesAndAlignsTheRanksCount) {
  EXPECT_THAT(Send(0, kKey, {}), IsEmpty());
  EXPECT_THAT(Send(1, kKey, {}), IsEmpty());
  EXPECT_THAT(Send(1, kKey, Items({0}, 0)), IsEmpty());
  EXPECT_THAT(Send(1, kKey, Items({1}, 1)), IsEmpty());  // rank 1 is two releases ahead
  std::vector<Batch> out;
  c_.RestartRank(0, &out);  // rank 0's second release was lost with its stream
  EXPECT_THAT(Shape(out), ElementsAre(ElementsAre(0), ElementsAre(1)));
  // Both send their next release: one batch.
  EXPECT_THAT(Send(1, kKey, {}), IsEmpty());
  EXPECT_THAT(Shape(Send(0, kKey, Items({0, 1}, 2))), ElementsAre(ElementsAre(0, 1)));
}

// Classes are independent: one class's silent rank does not hold the other.
TEST_F(ReleaseCoalescerTest, ClassesHoldIndependently) {
  EXPECT_THAT(Send(0, kKey, {}), IsEmpty());
  EXPECT_THAT(Send(1, kKey, {}), IsEmpty());
  EXPECT_THAT(Send(1, kKey, Items({0}, 0)), IsEmpty());  // waits for rank 0's second
  EXPECT_THAT(Send(2, kOtherKey, {}), IsEmpty());
  EXPECT_THAT(Shape(Send(3, kOtherKey, Items({2, 3}, 0))), ElementsAre(ElementsAre(2, 3)));
  EXPECT_EQ(c_.held_manifests(), 1u);
  EXPECT_EQ(c_.classes(), 2u);
}

// A manifest never overtakes an earlier one of its group: a batch without
// key naming a held group flushes the hold first.
TEST_F(ReleaseCoalescerTest, UnkeyedManifestOfAHeldGroupFlushesItsHoldFirst) {
  EXPECT_THAT(Send(0, kKey, {}), IsEmpty());
  EXPECT_THAT(Send(1, kKey, {}), IsEmpty());
  EXPECT_THAT(Send(1, kKey, Items({1}, 0)), IsEmpty());
  const std::vector<Batch> out = Send(2, 0, Items({1}, 1));
  ASSERT_THAT(Shape(out), ElementsAre(ElementsAre(1), ElementsAre(1)));
  EXPECT_EQ(out[0][0].step, 0);
  EXPECT_EQ(out[1][0].step, 1);
}

TEST_F(ReleaseCoalescerTest, DropHoldsKeepsCounts) {
  EXPECT_THAT(Send(0, kKey, {}), IsEmpty());
  EXPECT_THAT(Send(1, kKey, {}), IsEmpty());
  EXPECT_THAT(Send(1, kKey, Items({0}, 0)), IsEmpty());
  c_.DropHolds();
  EXPECT_EQ(c_.held_manifests(), 0u);
  // Rank 1's third release waits for rank 0's third (counts 3 and 1).
  EXPECT_THAT(Send(1, kKey, Items({1}, 1)), IsEmpty());
  EXPECT_EQ(c_.held_manifests(), 1u);
}

}  // namespace
}  // namespace accord::daemon
