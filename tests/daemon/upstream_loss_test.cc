// The upstream loss clock (daemon/common/upstream_loss.h) the sidecar and the
// relay share, driven alone: time passed in, the error returned.
#include "daemon/common/upstream_loss.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace accord::daemon {
namespace {

using ::testing::HasSubstr;

const absl::Time kT0 = absl::FromUnixSeconds(1000);
constexpr absl::Duration kLimit = absl::Seconds(60);

TEST(UpstreamLossClockTest, StartReturnsTheDueTimeAndCheckWaitsUntilThen) {
  UpstreamLossClock clock(kLimit);
  EXPECT_EQ(clock.Start(kT0), kT0 + kLimit);
  EXPECT_TRUE(clock.counting());
  absl::Time next;
  EXPECT_FALSE(clock.Check(kT0 + absl::Seconds(59), true, "job-a", &next).has_value());
  EXPECT_EQ(next, kT0 + kLimit);
}

TEST(UpstreamLossClockTest, PastTheLimitTheJobGetsOneUnavailableErrorNamingIt) {
  UpstreamLossClock clock(kLimit);
  clock.Start(kT0);
  absl::Time next;
  std::optional<v1::DecisionError> lost = clock.Check(kT0 + kLimit, true, "job-a", &next);
  ASSERT_TRUE(lost.has_value());
  EXPECT_EQ(lost->kind(), v1::UNAVAILABLE);
  EXPECT_EQ(lost->job_id(), "job-a");
  EXPECT_THAT(lost->message(), HasSubstr("--upstream_loss_limit"));
  EXPECT_EQ(next, absl::InfiniteFuture());
  // Once per job: a new stream does not start it again.
  EXPECT_EQ(clock.Start(kT0 + absl::Minutes(2)), absl::InfiniteFuture());
  EXPECT_FALSE(clock.Check(kT0 + absl::Minutes(10), true, "job-a", &next).has_value());
}

TEST(UpstreamLossClockTest, AStartWhileCountingKeepsTheEarlierTime) {
  UpstreamLossClock clock(kLimit);
  clock.Start(kT0);
  EXPECT_EQ(clock.Start(kT0 + absl::Seconds(30)), absl::InfiniteFuture());
  absl::Time next;
  EXPECT_TRUE(clock.Check(kT0 + kLimit, true, "job-a", &next).has_value());
}

TEST(UpstreamLossClockTest, AnAnswerStopsTheClock) {
  UpstreamLossClock clock(kLimit);
  clock.Start(kT0);
  clock.Answered();
  EXPECT_FALSE(clock.counting());
  absl::Time next;
  EXPECT_FALSE(clock.Check(kT0 + absl::Hours(1), true, "job-a", &next).has_value());
  EXPECT_EQ(next, absl::InfiniteFuture());
}

TEST(UpstreamLossClockTest, TheNextJobMayBeReportedAfterEndJob) {
  UpstreamLossClock clock(kLimit);
  clock.Start(kT0);
  absl::Time next;
  ASSERT_TRUE(clock.Check(kT0 + kLimit, true, "job-a", &next).has_value());
  clock.EndJob();
  const absl::Time later = kT0 + absl::Hours(1);
  EXPECT_EQ(clock.Start(later), later + kLimit);
  EXPECT_TRUE(clock.Check(later + kLimit, true, "job-b", &next).has_value());
}

TEST(UpstreamLossClockTest, NoJobOrNoLimitNeverCounts) {
  UpstreamLossClock off(absl::ZeroDuration());
  EXPECT_EQ(off.Start(kT0), absl::InfiniteFuture());
  absl::Time next;
  EXPECT_FALSE(off.Check(kT0 + absl::Hours(1), true, "job-a", &next).has_value());
  UpstreamLossClock clock(kLimit);
  clock.Start(kT0);
  EXPECT_FALSE(clock.Check(kT0 + absl::Hours(1), /*has_job=*/false, "", &next).has_value());
  EXPECT_EQ(next, absl::InfiniteFuture());
}

}  // namespace
}  // namespace accord::daemon
