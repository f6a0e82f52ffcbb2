#include "daemon/coordinator/kv_store.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/sync.h"
#include "daemon/common/clock.h"
#include "gtest/gtest.h"

namespace accord::daemon {
namespace {

struct Result {
  accord::Notification done;
  absl::StatusOr<std::vector<std::string>> value;
  KvStore::GetCallback Callback() {
    return [this](absl::StatusOr<std::vector<std::string>> v) {
      value = std::move(v);
      done.Notify();
    };
  }
};

TEST(KvStoreTest, GetWithoutWaitReturnsValuesOrNotFound) {
  FakeClock clock;
  KvStore kv(KvOptions(), &clock);
  ASSERT_TRUE(kv.Set("j", "r1", "a", "1").ok());
  Result r1, r2;
  kv.Get("j", "r1", {"a"}, absl::ZeroDuration(), r1.Callback());
  ASSERT_TRUE(r1.done.HasBeenNotified());
  ASSERT_TRUE(r1.value.ok());
  EXPECT_EQ((*r1.value)[0], "1");
  kv.Get("j", "r1", {"a", "b"}, absl::ZeroDuration(), r2.Callback());
  ASSERT_TRUE(r2.done.HasBeenNotified());
  EXPECT_EQ(r2.value.status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(absl::StrContains(r2.value.status().message(), "b"));
}

TEST(KvStoreTest, WaitingGetCompletesWhenTheLastKeyIsSet) {
  FakeClock clock;
  KvStore kv(KvOptions(), &clock);
  Result r;
  kv.Get("j", "r1", {"a", "b"}, absl::Seconds(5), r.Callback());
  EXPECT_FALSE(r.done.HasBeenNotified());
  ASSERT_TRUE(kv.Set("j", "r1", "a", "x").ok());
  EXPECT_FALSE(r.done.HasBeenNotified());
  ASSERT_TRUE(kv.Set("j", "r1", "b", "y").ok());
  ASSERT_TRUE(r.done.HasBeenNotified());
  ASSERT_TRUE(r.value.ok());
  EXPECT_EQ(*r.value, (std::vector<std::string>{"x", "y"}));
}

TEST(KvStoreTest, WaitingGetTimesOutOnTheInjectedClockNamingMissingKeys) {
  FakeClock clock;
  KvStore kv(KvOptions(), &clock);
  Result r;
  kv.Get("j", "r1", {"a", "nccl_id"}, absl::Seconds(5), r.Callback());
  ASSERT_TRUE(kv.Set("j", "r1", "a", "x").ok());
  clock.Advance(absl::Seconds(6));
  r.done.WaitForNotification();
  EXPECT_EQ(r.value.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(absl::StrContains(r.value.status().message(), "nccl_id"));
  EXPECT_FALSE(absl::StrContains(r.value.status().message(), "a,"));
}

TEST(KvStoreTest, JobsAreIsolated) {
  FakeClock clock;
  KvStore kv(KvOptions(), &clock);
  ASSERT_TRUE(kv.Set("job1", "r1", "k", "one").ok());
  Result r;
  kv.Get("job2", "r1", {"k"}, absl::Seconds(1), r.Callback());
  EXPECT_FALSE(r.done.HasBeenNotified());
  ASSERT_TRUE(kv.Set("job2", "r1", "k", "two").ok());
  ASSERT_TRUE(r.done.HasBeenNotified());
  EXPECT_EQ((*r.value)[0], "two");
}

TEST(KvStoreTest, StopWakesWaitersWithUnavailable) {
  FakeClock clock;
  KvStore kv(KvOptions(), &clock);
  Result r;
  kv.Get("j", "r1", {"k"}, absl::Hours(1), r.Callback());
  kv.Stop();
  ASSERT_TRUE(r.done.HasBeenNotified());
  EXPECT_EQ(r.value.status().code(), absl::StatusCode::kUnavailable);
}

TEST(KvStoreTest, RunsOfOneJobAreIsolated) {
  FakeClock clock;
  KvStore kv(KvOptions(), &clock);
  ASSERT_TRUE(kv.Set("j", "run-old", "nccl_unique_id", "old").ok());
  Result r;
  kv.Get("j", "run-new", {"nccl_unique_id"}, absl::ZeroDuration(), r.Callback());
  ASSERT_TRUE(r.done.HasBeenNotified());
  EXPECT_EQ(r.value.status().code(), absl::StatusCode::kNotFound);
}

TEST(KvStoreTest, AKeyIsWriteOncePerRunButAnIdenticalRetryIsAccepted) {
  FakeClock clock;
  KvStore kv(KvOptions(), &clock);
  ASSERT_TRUE(kv.Set("j", "r1", "nccl_unique_id", "A").ok());
  EXPECT_TRUE(kv.Set("j", "r1", "nccl_unique_id", "A").ok());
  absl::Status second = kv.Set("j", "r1", "nccl_unique_id", "B");
  EXPECT_EQ(second.code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(second.message(),
            "job j run r1: key \"nccl_unique_id\" was already set in this run with another "
            "value; bootstrap keys are write-once per run. Check that only one rank publishes "
            "it (e.g. rank 0 for the NCCL unique id) and that no rank of an earlier run is "
            "still running");
  // Another run of the job may set it.
  EXPECT_TRUE(kv.Set("j", "r2", "nccl_unique_id", "B").ok());
}

TEST(KvStoreTest, DropRunDeletesItsKeysAndFailsItsWaiters) {
  FakeClock clock;
  KvStore kv(KvOptions(), &clock);
  ASSERT_TRUE(kv.Set("j", "r1", "a", "1").ok());
  ASSERT_TRUE(kv.Set("j", "r2", "a", "2").ok());
  Result waiting;
  kv.Get("j", "r1", {"b"}, absl::Hours(1), waiting.Callback());
  EXPECT_EQ(kv.NumRuns(), 2);
  EXPECT_EQ(kv.NumKeys(), 2);
  kv.DropRun("j", "r1", absl::FailedPreconditionError("job j run r1 ended"));
  ASSERT_TRUE(waiting.done.HasBeenNotified());
  EXPECT_EQ(waiting.value.status().message(), "job j run r1 ended");
  EXPECT_EQ(kv.NumRuns(), 1);
  EXPECT_EQ(kv.NumKeys(), 1);
  Result r;
  kv.Get("j", "r1", {"a"}, absl::ZeroDuration(), r.Callback());
  EXPECT_EQ(r.value.status().code(), absl::StatusCode::kNotFound);
}

TEST(KvStoreTest, SetKeepsWorkingAfterMoreThanMaxJobsRunsEnded) {
  FakeClock clock;
  KvOptions options;
  options.max_jobs = 4;
  KvStore kv(options, &clock);
  for (int i = 0; i < 40; ++i) {
    const std::string job = absl::StrCat("job", i);
    ASSERT_TRUE(kv.Set(job, "r", "k", "v").ok()) << i;
    kv.DropRun(job, "r", absl::FailedPreconditionError("ended"));
  }
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(kv.Set(absl::StrCat("live", i), "r", "k", "v").ok());
  EXPECT_EQ(kv.Set("one-too-many", "r", "k", "v").code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(kv.NumRuns(), 4);
}

TEST(KvStoreTest, AFailedRunsWaitersMoveToItsFreshScope) {
  FakeClock clock;
  KvStore kv(KvOptions(), &clock);
  ASSERT_TRUE(kv.Set("j", "r1", "nccl_unique_id", "x").ok());
  Result waiting;
  kv.Get("j", "r1", {"done/1"}, absl::Hours(1), waiting.Callback());
  kv.DropRun("j", "r1", absl::AbortedError("failed"), "r1/after-failure");
  EXPECT_FALSE(waiting.done.HasBeenNotified());
  EXPECT_EQ(kv.NumKeys(), 0);
  ASSERT_TRUE(kv.Set("j", "r1/after-failure", "done/1", "1").ok());
  ASSERT_TRUE(waiting.done.HasBeenNotified());
  ASSERT_TRUE(waiting.value.ok()) << waiting.value.status();
  EXPECT_EQ((*waiting.value)[0], "1");
}

}  // namespace
}  // namespace accord::daemon
