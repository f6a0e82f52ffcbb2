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

// A wait in a failed run that ends without its keys (a rank still at the
// run's rendezvous when the run failed, or asking after it) ends with the
// run's failure, the words every rank of the run got, marked as the job's
// verdict; a wait its keys complete still gets them.
TEST(KvStoreTest, AWaitInAFailedRunEndsWithTheRunsFailure) {
  FakeClock clock;
  KvStore kv(KvOptions(), &clock);
  ASSERT_TRUE(kv.Set("j", "r1", "boot/0", "x").ok());
  Result before, after, completed;
  kv.Get("j", "r1", {"boot/0", "boot/1"}, absl::Seconds(5), before.Callback());
  const absl::Status why = absl::DeadlineExceededError("job j group g: rank 1 is missing");
  kv.DropRun("j", "r1", why, "r1/after-failure");
  kv.Get("j", "r1/after-failure", {"boot/1"}, absl::Seconds(5), after.Callback());
  kv.Get("j", "r1/after-failure", {"done/0"}, absl::Seconds(5), completed.Callback());
  ASSERT_TRUE(kv.Set("j", "r1/after-failure", "done/0", "1").ok());
  ASSERT_TRUE(completed.done.HasBeenNotified());
  EXPECT_TRUE(completed.value.ok()) << completed.value.status();
  clock.Advance(absl::Seconds(6));
  for (Result* r : {&before, &after}) {
    r->done.WaitForNotification();
    EXPECT_EQ(r->value.status().code(), why.code());
    EXPECT_EQ(r->value.status().message(), why.message());
    EXPECT_TRUE(IsJobVerdict(r->value.status()));
  }
  // When the run ends, its fresh scope goes, and so does what it recalled.
  kv.DropRun("j", "r1/after-failure", absl::FailedPreconditionError("ended"));
  Result later;
  kv.Get("j", "r1/after-failure", {"x"}, absl::Seconds(1), later.Callback());
  clock.Advance(absl::Seconds(2));
  later.done.WaitForNotification();
  EXPECT_EQ(later.value.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_FALSE(IsJobVerdict(later.value.status()));
}

// A job of `world` ranks, each on node "n<rank / 2>", all connected.
class FakeRankDirectory : public RankDirectory {
 public:
  explicit FakeRankDirectory(int world) : world_(world) {}
  int WorldSize(const std::string& job_id) override { return job_id == "j" ? world_ : 0; }
  std::vector<std::string> DescribeRanks(const std::string& job_id,
                                         const std::vector<int>& ranks) override {
    std::vector<std::string> out;
    for (int r : ranks)
      out.push_back(absl::StrCat("rank ", r, " (node \"n", r / 2, "\", connected)"));
    return out;
  }

 private:
  const int world_;
};

KvOptions Bounded() {
  KvOptions o;
  o.wait_bound = absl::Seconds(2);
  return o;
}

// One rank publishes a key (as rank 0 the NCCL unique id) and never does:
// every Get waiting for it ends at the bound naming rank 0, the one rank
// that neither set a key under "boot/" nor asked for one.
TEST(KvStoreTest, AWaitEndsAtTheBoundNamingTheRankThatNeitherSetNorAskedUnderThePrefix) {
  FakeClock clock;
  KvStore kv(Bounded(), &clock);
  FakeRankDirectory ranks(3);
  kv.SetRankDirectory(&ranks);
  ASSERT_TRUE(kv.Set("j", "r1", "other/x", "1", 0).ok());  // another prefix: does not count
  Result r1, r2;
  kv.Get("j", "r1", {"boot/nccl_id"}, absl::Seconds(30), r1.Callback(), 1);
  kv.Get("j", "r1", {"boot/nccl_id"}, absl::Seconds(30), r2.Callback(), 2);
  clock.Advance(absl::Milliseconds(1999));
  EXPECT_FALSE(r1.done.HasBeenNotified());
  clock.Advance(absl::Milliseconds(1));
  for (Result* r : {&r1, &r2}) {
    r->done.WaitForNotification();
    EXPECT_EQ(r->value.status().code(), absl::StatusCode::kDeadlineExceeded);
    EXPECT_EQ(r->value.status().message(),
              "job j: keys still not set after 2s (the coordinator's --deadline): boot/nccl_id; "
              "missing ranks 0 (neither set a key under \"boot/\" nor asked for one): rank 0 "
              "(node \"n0\", connected); no rank set one, ranks 1-2 asked for one. Check the "
              "missing ranks' processes and their sidecars' logs: the rank that publishes these "
              "keys is among them; a rank only slower than the wait can ask again");
  }
}

// Every rank publishes its own key under a prefix and reads all of them:
// the rank that did not publish is named, with the Get's own (shorter)
// timeout said as such.
TEST(KvStoreTest, AnAllGatherNamesTheRankThatDidNotSetItsKey) {
  FakeClock clock;
  KvStore kv(Bounded(), &clock);
  FakeRankDirectory ranks(4);
  kv.SetRankDirectory(&ranks);
  const std::vector<std::string> keys = {"g/0", "g/1", "g/2", "g/3"};
  std::vector<Result> results(3);
  for (int r = 0; r < 3; ++r) {
    if (r != 2) {
      ASSERT_TRUE(kv.Set("j", "r1", keys[r], "v", r).ok());
    }
    kv.Get("j", "r1", keys, absl::Seconds(1), results[r].Callback(), r);
  }
  ASSERT_TRUE(kv.Set("j", "r1", "g/2", "v", 2).ok());
  clock.Advance(absl::Seconds(1));
  for (Result& r : results) {
    r.done.WaitForNotification();
    EXPECT_EQ(r.value.status().message(),
              "job j: keys still not set after the wait (1s, this Get's timeout): g/3; missing "
              "ranks 3 (neither set a key under \"g/\" nor asked for one): rank 3 (node \"n1\", "
              "connected); ranks 0-2 set one, ranks 0-2 asked for one. Check the missing ranks' "
              "processes and their sidecars' logs: the rank that publishes these keys is among "
              "them; a rank only slower than the wait can ask again");
  }
}

// Consecutive ranks start, start + 1, ... in the members' arithmetic form.
MembersForm Arithmetic(int start, int count) {
  MembersForm form;
  form.start = start;
  form.count = count;
  form.stride = 1;
  return form;
}

// A Get among a member set (a guard's comparison of ranks 2 and 3 in a job
// of 6): the member that did not write is named, never ranks outside the set;
// when every member wrote or asked, the set is what the error says.
TEST(KvStoreTest, AGetAmongAMemberSetNamesOnlyItsMembers) {
  FakeClock clock;
  KvStore kv(Bounded(), &clock);
  FakeRankDirectory ranks(6);
  kv.SetRankDirectory(&ranks);
  const MembersForm pair = Arithmetic(2, 2);  // ranks 2, 3
  ASSERT_TRUE(kv.Set("j", "r1", "cmp/2", "v", 2).ok());
  Result among, whole;
  kv.Get("j", "r1", {"cmp/2", "cmp/3"}, absl::Seconds(1), among.Callback(), 2, pair);
  kv.Get("j", "r1", {"cmp/2", "cmp/3"}, absl::Seconds(1), whole.Callback(), 2);
  clock.Advance(absl::Seconds(1));
  among.done.WaitForNotification();
  EXPECT_EQ(among.value.status().message(),
            "job j: keys still not set after the wait (1s, this Get's timeout): cmp/3; missing "
            "ranks 3 of the Get's member set (ranks 2-3) (neither set a key under \"cmp/\" nor "
            "asked for one): rank 3 (node \"n1\", connected); ranks 2 set one, ranks 2 asked for "
            "one. Check the missing ranks' processes and their sidecars' logs: the rank that "
            "publishes these keys is among them; a rank only slower than the wait can ask again");
  whole.done.WaitForNotification();  // every rank of the job: 0, 1, 3, 4, 5
  EXPECT_TRUE(absl::StrContains(whole.value.status().message(), "missing ranks 0-1,3-5 ("))
      << whole.value.status().message();

  ASSERT_TRUE(kv.Set("j", "r1", "cmp/3x", "v", 3).ok());
  Result named_key;
  kv.Get("j", "r1", {"cmp/3"}, absl::Seconds(1), named_key.Callback(), 2, pair);
  clock.Advance(absl::Seconds(1));
  named_key.done.WaitForNotification();
  EXPECT_TRUE(absl::StrContains(named_key.value.status().message(),
                                "every rank of the Get's member set (ranks 2-3) set a key under "
                                "\"cmp/\" or asked for one"))
      << named_key.value.status().message();
}

// A member set that is not one of the job's (a rank past its world size) is
// said as such, and the ranks of the whole job are named instead.
TEST(KvStoreTest, AGetAmongRanksOutsideTheJobSaysSoAndNamesEveryRank) {
  FakeClock clock;
  KvStore kv(Bounded(), &clock);
  FakeRankDirectory ranks(2);
  kv.SetRankDirectory(&ranks);
  const MembersForm outside = Arithmetic(1, 3);  // ranks 1-3 of a job of 2
  Result r;
  kv.Get("j", "r1", {"k/1"}, absl::Seconds(1), r.Callback(), 0, outside);
  clock.Advance(absl::Seconds(1));
  r.done.WaitForNotification();
  const std::string msg(r.value.status().message());
  EXPECT_TRUE(absl::StrContains(msg,
                                "missing ranks 1 of the job (the Get's member set is not "
                                "one of a job of 2 ranks: "))
      << msg;
}

// Nobody is left to name: every rank set a key under the prefix or asked
// for one, so the key's name is what to check.
TEST(KvStoreTest, AKeyNoRankIsLeftToSetSaysToCheckItsName) {
  FakeClock clock;
  KvStore kv(Bounded(), &clock);
  FakeRankDirectory ranks(2);
  kv.SetRankDirectory(&ranks);
  ASSERT_TRUE(kv.Set("j", "r1", "boot/nccl_uid", "v", 0).ok());
  Result r;
  kv.Get("j", "r1", {"boot/nccl_id"}, absl::Seconds(30), r.Callback(), 1);
  clock.Advance(absl::Seconds(2));
  r.done.WaitForNotification();
  EXPECT_EQ(r.value.status().message(),
            "job j: keys still not set after 2s (the coordinator's --deadline): boot/nccl_id; "
            "every rank of the job set a key under \"boot/\" or asked for one (ranks 0 set one, "
            "ranks 1 asked for one), so no rank is expected to set these: check the keys' names "
            "against the ones the publishing rank sets");
}

// Who cannot be named says why: a client that did not say its rank, a job
// with no node here, no rank directory at all.
TEST(KvStoreTest, AWaitThatCannotNameRanksSaysWhy) {
  FakeClock clock;
  KvStore kv(Bounded(), &clock);
  FakeRankDirectory ranks(2);
  Result no_directory;
  kv.Get("j", "r1", {"k"}, absl::Seconds(30), no_directory.Callback(), 1);
  clock.Advance(absl::Seconds(2));
  no_directory.done.WaitForNotification();
  EXPECT_EQ(no_directory.value.status().message(),
            "job j: keys still not set after 2s (the coordinator's --deadline): k; who should "
            "set them is not named: no sidecar of job j is connected to this coordinator, so its "
            "ranks are not known here. Check that the rank that publishes them runs and reaches "
            "the point where it sets them");
  kv.SetRankDirectory(&ranks);
  Result old_client, unknown_job;
  kv.Get("j", "r1", {"k"}, absl::Seconds(30), old_client.Callback());
  kv.Get("other", "r1", {"k"}, absl::Seconds(30), unknown_job.Callback(), 0);
  clock.Advance(absl::Seconds(2));
  old_client.done.WaitForNotification();
  unknown_job.done.WaitForNotification();
  EXPECT_EQ(old_client.value.status().message(),
            "job j: keys still not set after 2s (the coordinator's --deadline): k; who should "
            "set them is not named: this Get did not say its rank (a client older than this "
            "coordinator). Check that the rank that publishes them runs and reaches the point "
            "where it sets them");
  EXPECT_TRUE(absl::StrContains(unknown_job.value.status().message(),
                                "no sidecar of job other is connected"));
}

// The prefixes' records go with the run, like its keys.
// A Get cut at the bound is the asking rank's last word in the run until it
// asks (or sets) again: the coordinator fails the run with it if the rank
// then leaves (docs/ARCHITECTURE.md, "Every wait names who is missing"). A
// Get that ends at its own shorter timeout is not recorded, nor is one that
// did not say its rank.
TEST(KvStoreTest, AGetCutAtTheBoundIsTheRanksLastWordUntilItAsksAgain) {
  FakeClock clock;
  KvStore kv(Bounded(), &clock);
  FakeRankDirectory ranks(3);
  kv.SetRankDirectory(&ranks);
  Result cut, own_timeout, unsaid;
  kv.Get("j", "r1", {"gather/0"}, absl::Seconds(30), cut.Callback(), 1);
  kv.Get("j", "r1", {"gather/0"}, absl::Seconds(1), own_timeout.Callback(), 2);
  kv.Get("j", "r1", {"gather/0"}, absl::Seconds(30), unsaid.Callback());
  EXPECT_TRUE(kv.WaitsCut("j", "r1").empty());
  clock.Advance(absl::Seconds(2));
  for (Result* r : {&cut, &own_timeout, &unsaid}) r->done.WaitForNotification();
  std::vector<std::pair<int, absl::Status>> waits = kv.WaitsCut("j", "r1");
  ASSERT_EQ(waits.size(), 1u);
  EXPECT_EQ(waits[0].first, 1);
  EXPECT_EQ(waits[0].second.code(), cut.value.status().code());
  EXPECT_EQ(waits[0].second.message(), cut.value.status().message());
  EXPECT_TRUE(kv.WaitsCut("j", "r2").empty());  // another run
  // Rank 1 asks again: the cut is no longer its last word.
  Result again;
  kv.Get("j", "r1", {"gather/0"}, absl::ZeroDuration(), again.Callback(), 1);
  again.done.WaitForNotification();
  EXPECT_TRUE(kv.WaitsCut("j", "r1").empty());
  // Cut again: a key under another prefix (saying it is done) is not asking
  // again; a Set under the prefix it missed is. The run's drop forgets it.
  Result cut2;
  kv.Get("j", "r1", {"gather/0"}, absl::Seconds(30), cut2.Callback(), 1);
  clock.Advance(absl::Seconds(2));
  cut2.done.WaitForNotification();
  ASSERT_EQ(kv.WaitsCut("j", "r1").size(), 1u);
  ASSERT_TRUE(kv.Set("j", "r1", "done/1", "1", 1).ok());
  ASSERT_EQ(kv.WaitsCut("j", "r1").size(), 1u);
  ASSERT_TRUE(kv.Set("j", "r1", "gather/1", "x", 1).ok());
  EXPECT_TRUE(kv.WaitsCut("j", "r1").empty());
  Result cut3;
  kv.Get("j", "r1", {"gather/0"}, absl::Seconds(30), cut3.Callback(), 1);
  clock.Advance(absl::Seconds(2));
  cut3.done.WaitForNotification();
  ASSERT_EQ(kv.WaitsCut("j", "r1").size(), 1u);
  kv.DropRun("j", "r1", absl::FailedPreconditionError("ended"));
  EXPECT_TRUE(kv.WaitsCut("j", "r1").empty());
}

// A directory whose description of a rank changes: rank 3 connects after
// the first cut (chaos seed 7122: its sidecar was stopped).
class ChangingRankDirectory : public RankDirectory {
 public:
  int WorldSize(const std::string& job_id) override { return job_id == "j" ? 4 : 0; }
  std::vector<std::string> DescribeRanks(const std::string& job_id,
                                         const std::vector<int>& ranks) override {
    std::vector<std::string> out;
    for (int r : ranks) {
      out.push_back(
          absl::StrCat("rank ", r, connected ? " (node \"n0\", connected)" : " (not connected)"));
    }
    return out;
  }
  bool connected = false;
};

// Ranks whose Gets are cut at the bound at different moments all end with
// the first cut's words, whatever changed meanwhile (a rank connected, or
// another rank set its key): one cut ends the rendezvous for every rank
// alike. Once no cut stands (every cut rank asked again), a later cut says
// what holds then.
TEST(KvStoreTest, RanksCutAtTheBoundAtDifferentMomentsEndWithTheFirstCutsWords) {
  FakeClock clock;
  KvStore kv(Bounded(), &clock);
  ChangingRankDirectory ranks;
  kv.SetRankDirectory(&ranks);
  Result first, second, third;
  kv.Get("j", "r1", {"boot/3"}, absl::Seconds(30), first.Callback(), 0);
  clock.Advance(absl::Seconds(1));
  kv.Get("j", "r1", {"boot/3"}, absl::Seconds(30), second.Callback(), 1);
  kv.Get("j", "r1", {"boot/2", "boot/3"}, absl::Seconds(30), third.Callback(), 2);
  clock.Advance(absl::Seconds(1));
  first.done.WaitForNotification();
  ASSERT_EQ(first.value.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(absl::StrContains(first.value.status().message(), "rank 3 (not connected)"));
  ranks.connected = true;
  ASSERT_TRUE(kv.Set("j", "r1", "boot/2", "x", 2).ok());
  clock.Advance(absl::Seconds(1));
  for (Result* r : {&second, &third}) {
    r->done.WaitForNotification();
    EXPECT_EQ(r->value.status().code(), absl::StatusCode::kDeadlineExceeded);
    EXPECT_EQ(r->value.status().message(), first.value.status().message());
  }
  std::vector<std::pair<int, absl::Status>> waits = kv.WaitsCut("j", "r1");
  ASSERT_EQ(waits.size(), 3u);
  for (const auto& [rank, words] : waits)
    EXPECT_EQ(words.message(), first.value.status().message());
  // Every cut rank asks again: no cut stands, so the next one is fresh.
  for (int r : {0, 1, 2}) {
    Result again;
    kv.Get("j", "r1", {"boot/3"}, absl::ZeroDuration(), again.Callback(), r);
    again.done.WaitForNotification();
  }
  ASSERT_TRUE(kv.WaitsCut("j", "r1").empty());
  Result later;
  kv.Get("j", "r1", {"boot/3"}, absl::Seconds(30), later.Callback(), 0);
  clock.Advance(absl::Seconds(2));
  later.done.WaitForNotification();
  EXPECT_TRUE(absl::StrContains(later.value.status().message(), "rank 3 (node \"n0\", connected)"));
}

TEST(KvStoreTest, DropRunForgetsWhoSetAndAskedUnderEachPrefix) {
  FakeClock clock;
  KvStore kv(Bounded(), &clock);
  FakeRankDirectory ranks(2);
  kv.SetRankDirectory(&ranks);
  ASSERT_TRUE(kv.Set("j", "r1", "boot/a", "v", 0).ok());
  kv.DropRun("j", "r1", absl::FailedPreconditionError("ended"));
  Result r;
  kv.Get("j", "r1", {"boot/b"}, absl::Seconds(30), r.Callback(), 1);
  clock.Advance(absl::Seconds(2));
  r.done.WaitForNotification();
  EXPECT_TRUE(absl::StrContains(r.value.status().message(),
                                "missing ranks 0 (neither set a key under \"boot/\""))
      << r.value.status();
}

}  // namespace
}  // namespace accord::daemon
