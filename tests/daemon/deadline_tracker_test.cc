#include "daemon/coordinator/deadline_tracker.h"

#include <vector>

#include "daemon/common/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace accord::daemon {
namespace {

using ::testing::ElementsAre;
using ::testing::Pair;
using Due = StepDeadline::Due;
using Answered = StepDeadline::Answered;

// Two nodes to ask; only their addresses matter.
const NodeState* const kNodeA = reinterpret_cast<const NodeState*>(0x10);
const NodeState* const kNodeB = reinterpret_cast<const NodeState*>(0x20);

class StepDeadlineTest : public ::testing::Test {
 protected:
  Due CheckNow(StepDeadline& d, bool stalls = false) {
    next_ = absl::InfiniteFuture();
    return d.Check(clock_.Now(), stalls, next_);
  }
  FakeClock clock_;
  absl::Time next_;
};

TEST_F(StepDeadlineTest, NothingIsDueBeforeTheDeadlineAndTheNextCheckIsAtIt) {
  StepDeadline d(clock_.Now(), absl::Seconds(10));
  EXPECT_EQ(CheckNow(d), Due::kNothing);
  EXPECT_EQ(next_, clock_.Now() + absl::Seconds(10));
  clock_.Advance(absl::Seconds(10) - absl::Milliseconds(1));
  EXPECT_EQ(CheckNow(d), Due::kNothing);
}

TEST_F(StepDeadlineTest, TheDeadlineFiresAtTheFirstSubmissionPlusTheDeadline) {
  // The clock started 4 s ago (a sidecar's partial report: waited_us).
  StepDeadline d(clock_.Now() - absl::Seconds(4), absl::Seconds(10));
  clock_.Advance(absl::Seconds(6) - absl::Microseconds(1));
  EXPECT_EQ(CheckNow(d), Due::kNothing);
  clock_.Advance(absl::Microseconds(1));
  EXPECT_EQ(CheckNow(d), Due::kAsk);
  EXPECT_EQ(d.phase(), StepDeadline::Phase::kRunning);  // until someone is asked
}

TEST_F(StepDeadlineTest, AStallIsDueOnceAtHalfTheDeadline) {
  StepDeadline d(clock_.Now(), absl::Seconds(10));
  EXPECT_EQ(CheckNow(d, /*stalls=*/true), Due::kNothing);
  EXPECT_EQ(next_, clock_.Now() + absl::Seconds(5));
  clock_.Advance(absl::Seconds(5));
  EXPECT_EQ(CheckNow(d, true), Due::kStall);
  EXPECT_EQ(CheckNow(d, true), Due::kNothing);  // reported already
  EXPECT_EQ(next_, d.deadline());
}

TEST_F(StepDeadlineTest, AfterAskingTheStepFailsWhenEveryAskedNodeAnswered) {
  StepDeadline d(clock_.Now(), absl::Seconds(4));
  clock_.Advance(absl::Seconds(4));
  ASSERT_EQ(CheckNow(d), Due::kAsk);
  d.Ask({kNodeA, kNodeB}, clock_.Now() + absl::Seconds(1));
  EXPECT_EQ(d.phase(), StepDeadline::Phase::kAsking);
  EXPECT_EQ(CheckNow(d), Due::kNothing);
  EXPECT_EQ(next_, clock_.Now() + absl::Seconds(1));
  clock_.Advance(absl::Milliseconds(100));
  EXPECT_EQ(d.Answer(kNodeA, clock_.Now()), Answered::kMore);
  EXPECT_EQ(d.Answer(kNodeA, clock_.Now()), Answered::kIgnored);  // answered already
  EXPECT_EQ(CheckNow(d), Due::kNothing);
  clock_.Advance(absl::Milliseconds(100));
  EXPECT_EQ(d.Answer(kNodeB, clock_.Now()), Answered::kAll);
  EXPECT_EQ(d.grace_end(), clock_.Now());  // no need to wait for the grace
  EXPECT_EQ(CheckNow(d), Due::kFail);
}

TEST_F(StepDeadlineTest, AfterAskingTheStepFailsAtTheGraceWithoutAnswers) {
  StepDeadline d(clock_.Now(), absl::Seconds(4));
  clock_.Advance(absl::Seconds(4));
  ASSERT_EQ(CheckNow(d), Due::kAsk);
  d.Ask({kNodeA}, clock_.Now() + absl::Seconds(1));
  clock_.Advance(absl::Seconds(1) - absl::Microseconds(1));
  EXPECT_EQ(CheckNow(d), Due::kNothing);
  clock_.Advance(absl::Microseconds(1));
  EXPECT_EQ(CheckNow(d), Due::kFail);
}

TEST_F(StepDeadlineTest, AnAnswerBeforeAnyQuestionIsIgnored) {
  StepDeadline d(clock_.Now(), absl::Seconds(4));
  EXPECT_EQ(d.Answer(kNodeA, clock_.Now()), Answered::kIgnored);
  d.Ask({kNodeA}, clock_.Now() + absl::Seconds(1));
  EXPECT_EQ(d.Answer(kNodeB, clock_.Now()), Answered::kIgnored);  // not asked
}

TEST_F(StepDeadlineTest, KeepsWhatSidecarsSaidOfTheirRanks) {
  StepDeadline d(clock_.Now(), absl::Seconds(4));
  d.AddReported(3);
  d.AddLastStep(5, 41);
  EXPECT_THAT(d.reported(), ElementsAre(3));
  EXPECT_THAT(d.last_steps(), ElementsAre(Pair(5, 41)));
}

}  // namespace
}  // namespace accord::daemon
