#include "daemon/coordinator/run_registry.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/wire.h"

namespace accord::daemon {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

const absl::Time kT0 = absl::UnixEpoch() + absl::Hours(1);

absl::Status Why(absl::string_view message) { return wire::KindError(v1::RUN_ENDED, message); }

TEST(RunRegistryTest, AStartedRunIsStartingWithAFreshIdOrTheGivenOne) {
  RunRegistry runs(7);
  ::accord::daemon::Run& a = runs.Start("a", "", kT0);
  EXPECT_EQ(a.state, RunState::kStarting);
  EXPECT_EQ(a.started, kT0);
  EXPECT_EQ(a.run_id.size(), 17u);  // "r" and 16 hex digits
  ::accord::daemon::Run& b = runs.Start("b", "", kT0);
  EXPECT_NE(b.run_id, runs.Find("a")->run_id);
  EXPECT_EQ(runs.Start("c", "r-resumed", kT0).run_id, "r-resumed");
  EXPECT_EQ(runs.size(), 3u);
  EXPECT_EQ(runs.Find("d"), nullptr);
}

TEST(RunRegistryTest, RunningOnlyFromStarting) {
  ::accord::daemon::Run run;
  run.SetRunning();
  EXPECT_EQ(run.state, RunState::kRunning);
  run.SetFailed(v1::DecisionError());
  run.SetRunning();
  EXPECT_EQ(run.state, RunState::kFailed);  // a failed run stays failed
}

TEST(RunRegistryTest, EndingErasesTheCurrentRunOnlyAndQueuesItsEnd) {
  RunRegistry runs(1);
  const std::string id = runs.Start("job", "", kT0).run_id;
  EXPECT_FALSE(runs.End("job", "not-" + id, Why("stale")));
  EXPECT_NE(runs.Find("job"), nullptr);
  EXPECT_TRUE(runs.End("job", id, Why("last node left")));
  EXPECT_EQ(runs.Find("job"), nullptr);
  std::vector<EndedRun> ended = runs.TakeEnded();
  ASSERT_EQ(ended.size(), 1u);
  EXPECT_EQ(ended[0].job_id, "job");
  EXPECT_EQ(ended[0].run_id, id);
  EXPECT_EQ(ended[0].why.message(), "last node left");
  EXPECT_THAT(runs.TakeEnded(), IsEmpty());
}

TEST(RunRegistryTest, AFailureDropsTheKeysOnceAndMovesLaterOnesToAFreshScope) {
  RunRegistry runs(1);
  const std::string id = runs.Start("job", "", kT0).run_id;
  v1::DecisionError error = wire::MakeError(v1::MISSING_RANKS, absl::DeadlineExceededError("x"));
  runs.Fail("job", id, error);
  runs.Fail("job", id, error);  // once only
  const ::accord::daemon::Run& run = *runs.Find("job");
  EXPECT_EQ(run.state, RunState::kFailed);
  EXPECT_EQ(RunRegistry::KeyScopeOf(run), id + "/after-failure");
  std::vector<EndedRun> ended = runs.TakeEnded();
  ASSERT_EQ(ended.size(), 1u);
  EXPECT_EQ(ended[0].run_id, id);
  EXPECT_EQ(ended[0].successor, id + "/after-failure");
  EXPECT_EQ(ended[0].why.code(), absl::StatusCode::kDeadlineExceeded);
  // Its end drops the fresh scope.
  EXPECT_TRUE(runs.End("job", id, Why("ended")));
  EXPECT_EQ(runs.TakeEnded()[0].run_id, id + "/after-failure");
}

TEST(RunRegistryTest, TheLastEndsReasonCanBeReplaced) {
  RunRegistry runs(1);
  const std::string id = runs.Start("job", "", kT0).run_id;
  runs.End("job", id, Why("its last node left"));
  runs.SetLastEndReason("other-scope", Why("ignored"));
  runs.SetLastEndReason(id, Why("superseded"));
  EXPECT_EQ(runs.TakeEnded()[0].why.message(), "superseded");
}

v1::DecisionError Failure(const std::string& message) {
  v1::DecisionError e;
  e.set_kind(v1::MISSING_RANKS);
  e.set_message(message);
  return e;
}

TEST(RunRegistryTest, RememberedRunsAreBoundedAndKeepTheErrorTheyEndedWith) {
  RunRegistry runs(1);
  runs.Remember("job", "r0", Failure("rank 3 left"));
  EXPECT_TRUE(runs.Remembered("job", "r0"));
  ASSERT_NE(runs.RememberedError("job", "r0"), nullptr);
  EXPECT_EQ(runs.RememberedError("job", "r0")->message(), "rank 3 left");
  EXPECT_EQ(runs.RememberedError("job", "r0")->kind(), v1::MISSING_RANKS);
  EXPECT_FALSE(runs.Remembered("job", "r1"));
  EXPECT_EQ(runs.RememberedError("job", "r1"), nullptr);
  EXPECT_FALSE(runs.Remembered("other", "r0"));
  for (size_t i = 1; i <= RunRegistry::kRemembered; ++i) {
    runs.Remember("job", "r" + std::to_string(i), Failure("r" + std::to_string(i)));
  }
  EXPECT_FALSE(runs.Remembered("job", "r0"));  // the oldest went first
  EXPECT_EQ(runs.RememberedError("job", "r0"), nullptr);
  EXPECT_TRUE(runs.Remembered("job", "r1"));
  EXPECT_EQ(runs.RememberedError("job", "r1")->message(), "r1");
  EXPECT_TRUE(runs.Remembered("job", "r" + std::to_string(RunRegistry::kRemembered)));
}

TEST(RunRegistryTest, OnlyStartingRunsExpireAtTheirTimeout) {
  RunRegistry runs(1);
  runs.Start("early", "", kT0);
  runs.Start("late", "", kT0 + absl::Minutes(2));
  runs.Start("joined", "", kT0).SetRunning();
  absl::Time next = absl::InfiniteFuture();
  EXPECT_THAT(runs.StartingPast(kT0 + absl::Minutes(5), absl::Minutes(5), next),
              ElementsAre("early"));
  EXPECT_EQ(next, kT0 + absl::Minutes(7));
  next = absl::InfiniteFuture();
  EXPECT_THAT(
      runs.StartingPast(kT0 + absl::Minutes(5) - absl::Microseconds(1), absl::Minutes(5), next),
      IsEmpty());
  EXPECT_EQ(next, kT0 + absl::Minutes(5));
}

}  // namespace
}  // namespace accord::daemon
