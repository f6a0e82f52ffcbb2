#include "daemon/coordinator/kv_store.h"

#include "absl/strings/match.h"
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
  ASSERT_TRUE(kv.Set("j", "a", "1").ok());
  Result r1, r2;
  kv.Get("j", {"a"}, absl::ZeroDuration(), r1.Callback());
  ASSERT_TRUE(r1.done.HasBeenNotified());
  ASSERT_TRUE(r1.value.ok());
  EXPECT_EQ((*r1.value)[0], "1");
  kv.Get("j", {"a", "b"}, absl::ZeroDuration(), r2.Callback());
  ASSERT_TRUE(r2.done.HasBeenNotified());
  EXPECT_EQ(r2.value.status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(absl::StrContains(r2.value.status().message(), "b"));
}

TEST(KvStoreTest, WaitingGetCompletesWhenTheLastKeyIsSet) {
  FakeClock clock;
  KvStore kv(KvOptions(), &clock);
  Result r;
  kv.Get("j", {"a", "b"}, absl::Seconds(5), r.Callback());
  EXPECT_FALSE(r.done.HasBeenNotified());
  ASSERT_TRUE(kv.Set("j", "a", "x").ok());
  EXPECT_FALSE(r.done.HasBeenNotified());
  ASSERT_TRUE(kv.Set("j", "b", "y").ok());
  ASSERT_TRUE(r.done.HasBeenNotified());
  ASSERT_TRUE(r.value.ok());
  EXPECT_EQ(*r.value, (std::vector<std::string>{"x", "y"}));
}

TEST(KvStoreTest, WaitingGetTimesOutOnTheInjectedClockNamingMissingKeys) {
  FakeClock clock;
  KvStore kv(KvOptions(), &clock);
  Result r;
  kv.Get("j", {"a", "nccl_id"}, absl::Seconds(5), r.Callback());
  ASSERT_TRUE(kv.Set("j", "a", "x").ok());
  clock.Advance(absl::Seconds(6));
  r.done.WaitForNotification();
  EXPECT_EQ(r.value.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(absl::StrContains(r.value.status().message(), "nccl_id"));
  EXPECT_FALSE(absl::StrContains(r.value.status().message(), "a,"));
}

TEST(KvStoreTest, JobsAreIsolated) {
  FakeClock clock;
  KvStore kv(KvOptions(), &clock);
  ASSERT_TRUE(kv.Set("job1", "k", "one").ok());
  Result r;
  kv.Get("job2", {"k"}, absl::Seconds(1), r.Callback());
  EXPECT_FALSE(r.done.HasBeenNotified());
  ASSERT_TRUE(kv.Set("job2", "k", "two").ok());
  ASSERT_TRUE(r.done.HasBeenNotified());
  EXPECT_EQ((*r.value)[0], "two");
}

TEST(KvStoreTest, StopWakesWaitersWithUnavailable) {
  FakeClock clock;
  KvStore kv(KvOptions(), &clock);
  Result r;
  kv.Get("j", {"k"}, absl::Hours(1), r.Callback());
  kv.Stop();
  ASSERT_TRUE(r.done.HasBeenNotified());
  EXPECT_EQ(r.value.status().code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace accord::daemon
