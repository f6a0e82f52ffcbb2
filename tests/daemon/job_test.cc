// The Job engine on its own (daemon/coordinator/job.h): no lock, no thread,
// no coordinator; every effect lands in a fake JobEffects that records it,
// and time is passed in.
#include "daemon/coordinator/job.h"

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "daemon/common/worker_pool.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/wire.h"
#include "tests/daemon/fake_job_effects.h"
#include "tests/daemon/test_util.h"

namespace accord::daemon {
namespace {

using testing::FakeEffects;
using testing::FakeNodeSink;
using testing::Hello;
using testing::MakeSpec;
using testing::NodeManifest;
using testing::Registration;
using testing::Repeat;

constexpr auto kDeadline = absl::Seconds(30);
const absl::Time kStart = absl::UnixEpoch() + absl::Hours(1);

CoordinatorOptions Options() {
  CoordinatorOptions o;
  o.deadline = kDeadline;
  o.start_timer_thread = false;
  return o;
}

// A job of world 4 on two nodes (ranks 0-1 on "a", 2-3 on "b"), driven with
// one FakeEffects per event, as the coordinator does.
class JobTest : public ::testing::Test {
 protected:
  JobTest() : options_(Options()), pool_(1), job_("job", "run1", 4, options_, nullptr, &pool_) {
    Job::StreamId replaced = 0;
    a_ = &job_.Connect(1, &sink_a_, Hello("job", "a", 4, {0, 1}).hello(), {0, 1}, fx_, &replaced);
    b_ = &job_.Connect(2, &sink_b_, Hello("job", "b", 4, {2, 3}).hello(), {2, 3}, fx_, &replaced);
  }

  void RegisterGroup(const std::string& group, int params) {
    const GroupSpec spec = MakeSpec(group, params);
    job_.HandleRegistration(*a_, Registration(spec, {0, 1}).registration(), kStart, fx_);
    job_.HandleRegistration(*b_, Registration(spec, {2, 3}).registration(), kStart, fx_);
  }
  // A full-form manifest of `params` parameters, all with a gradient.
  static v1::Manifest Full(const std::string& group, int64_t step, const std::vector<int>& ranks,
                           int params = 2) {
    std::vector<std::optional<DType>> dtypes(params, DType::kFloat32);
    dtypes[0] = DType::kBFloat16;
    return NodeManifest(group, step, dtypes, 4, ranks);
  }
  static v1::ManifestBatch BatchOf(std::vector<v1::Manifest> manifests) {
    v1::ManifestBatch batch;
    for (auto& m : manifests) *batch.add_manifests() = std::move(m);
    return batch;
  }
  static v1::ManifestBatch BatchRepeat(int64_t step, const std::vector<v1::Manifest>& record) {
    wire::BatchKeyHasher hasher;
    for (const v1::Manifest& m : record) hasher.Add(m.group_id(), m.cache_key());
    v1::ManifestBatch batch;
    batch.set_repeat_step(step);
    batch.set_repeat_batch_key(hasher.Finish());
    return batch;
  }

  CoordinatorOptions options_;
  WorkerPool pool_;
  Job job_;
  FakeNodeSink sink_a_;
  FakeNodeSink sink_b_;
  FakeEffects fx_;
  NodeStream* a_ = nullptr;
  NodeStream* b_ = nullptr;
};

TEST_F(JobTest, ConnectWelcomesEachNodeThroughTheEffects) {
  ASSERT_EQ(fx_.sent.size(), 2u);
  EXPECT_EQ(fx_.sent[0].first, &sink_a_);
  EXPECT_TRUE(fx_.sent[0].second.has_welcome());
  EXPECT_EQ(fx_.sent[0].second.welcome().run_id(), "run1");
  EXPECT_EQ(fx_.sent[0].second.welcome().deadline_ms(), absl::ToInt64Milliseconds(kDeadline));
  EXPECT_EQ(fx_.sent[1].first, &sink_b_);
  EXPECT_EQ(job_.core().members.connected(), 2);
}

TEST_F(JobTest, FirstRegistrationWakesAtItsDeadlineAndTheLastBroadcastsTheFingerprint) {
  const GroupSpec spec = MakeSpec("g", 2);
  job_.HandleRegistration(*a_, Registration(spec, {0, 1}).registration(), kStart, fx_);
  EXPECT_THAT(fx_.wakes, ::testing::ElementsAre(kStart + kDeadline));
  EXPECT_TRUE(fx_.broadcasts.empty());
  job_.HandleRegistration(*b_, Registration(spec, {2, 3}).registration(), kStart, fx_);
  ASSERT_EQ(fx_.broadcasts.size(), 1u);
  EXPECT_EQ(fx_.broadcasts[0].registration().group_id(), "g");
  EXPECT_NE(fx_.broadcasts[0].registration().spec_fingerprint(), 0u);
  EXPECT_TRUE(fx_.errors.empty());
}

TEST_F(JobTest, CompleteStepIsDecidedOnceIntoTheBroadcastDecisions) {
  RegisterGroup("g", 2);
  job_.HandleManifests(*a_, BatchOf({Full("g", 0, {0, 1})}), nullptr, kStart, fx_);
  EXPECT_EQ(fx_.decisions.decisions_size(), 0);
  EXPECT_THAT(fx_.wakes, ::testing::Contains(kStart + kDeadline));  // the pending step's clock
  job_.HandleManifests(*b_, BatchOf({Full("g", 0, {2, 3})}), nullptr,
                       kStart + absl::Milliseconds(5), fx_);
  ASSERT_EQ(fx_.decisions.decisions_size(), 1);
  const v1::Decision& d = fx_.decisions.decisions(0);
  EXPECT_EQ(d.group_id(), "g");
  EXPECT_EQ(d.step(), 0);
  EXPECT_TRUE(d.has_ok());
  EXPECT_EQ(d.wait_us(), 5000);
  const GroupState& g = job_.core().groups.at("g");
  EXPECT_EQ(g.last_decided_step(), 0);
  EXPECT_TRUE(g.pending.empty());
  EXPECT_EQ(fx_.counters.decisions, 1);
  EXPECT_EQ(fx_.counters.manifests, 2);
}

TEST_F(JobTest, StepWhereEveryNodeRepeatsIsSameAsPrevious) {
  RegisterGroup("g", 2);
  const v1::Manifest ma = Full("g", 0, {0, 1});
  const v1::Manifest mb = Full("g", 0, {2, 3});
  job_.HandleManifests(*a_, BatchOf({ma}), nullptr, kStart, fx_);
  job_.HandleManifests(*b_, BatchOf({mb}), nullptr, kStart, fx_);
  job_.HandleManifests(*a_, BatchOf({Repeat("g", 1, ma.cache_key())}), nullptr, kStart, fx_);
  job_.HandleManifests(*b_, BatchOf({Repeat("g", 1, mb.cache_key())}), nullptr, kStart, fx_);
  ASSERT_EQ(fx_.decisions.decisions_size(), 2);
  EXPECT_TRUE(fx_.decisions.decisions(1).same_as_previous());
  EXPECT_EQ(job_.core().groups.at("g").last_decided_step(), 1);
  EXPECT_EQ(fx_.counters.same_as_previous, 1);
  EXPECT_EQ(fx_.counters.cache_hits, 2);
}

TEST_F(JobTest, BatchRepeatsOfEveryNodeAreDecidedAsOneWave) {
  RegisterGroup("g0", 2);
  RegisterGroup("g1", 3);
  const std::vector<v1::Manifest> ra = {Full("g0", 0, {0, 1}), Full("g1", 0, {0, 1}, 3)};
  const std::vector<v1::Manifest> rb = {Full("g0", 0, {2, 3}), Full("g1", 0, {2, 3}, 3)};
  job_.HandleManifests(*a_, BatchOf(ra), nullptr, kStart, fx_);
  job_.HandleManifests(*b_, BatchOf(rb), nullptr, kStart, fx_);
  ASSERT_EQ(fx_.decisions.decisions_size(), 2);
  // Step 1: node a's repeat is held back (nothing decided, a wake for the
  // wave's deadline); node b's completes the wave.
  const absl::Time t1 = kStart + absl::Seconds(1);
  EXPECT_TRUE(job_.TryJoinWave(
      *a_, BatchRepeat(1, ra), [&] { return t1; }, fx_));
  EXPECT_EQ(fx_.decisions.decisions_size(), 2);
  EXPECT_THAT(fx_.wakes, ::testing::Contains(t1 + kDeadline));
  EXPECT_TRUE(job_.TryJoinWave(
      *b_, BatchRepeat(1, rb), [&] { return t1 + absl::Milliseconds(2); }, fx_));
  ASSERT_EQ(fx_.decisions.decisions_size(), 4);
  for (int i = 2; i < 4; ++i) {
    EXPECT_TRUE(fx_.decisions.decisions(i).same_as_previous());
    EXPECT_EQ(fx_.decisions.decisions(i).step(), 1);
    EXPECT_EQ(fx_.decisions.decisions(i).wait_us(), 2000);
  }
  EXPECT_EQ(fx_.counters.repeat_waves, 1);
  EXPECT_EQ(job_.core().groups.at("g0").last_decided_step(), 1);
  EXPECT_EQ(job_.core().groups.at("g1").last_decided_step(), 1);
}

TEST_F(JobTest, BrokenWaveStartsItsStepsAtTheFirstArrival) {
  RegisterGroup("g", 2);
  const std::vector<v1::Manifest> ra = {Full("g", 0, {0, 1})};
  const std::vector<v1::Manifest> rb = {Full("g", 0, {2, 3})};
  job_.HandleManifests(*a_, BatchOf(ra), nullptr, kStart, fx_);
  job_.HandleManifests(*b_, BatchOf(rb), nullptr, kStart, fx_);
  const absl::Time t1 = kStart + absl::Seconds(1);
  ASSERT_TRUE(job_.TryJoinWave(
      *a_, BatchRepeat(1, ra), [&] { return t1; }, fx_));
  // Any other event (here: a deadline check at the wave's wake) hands the
  // held-back repeat to the entry-by-entry path: its step started at t1.
  const absl::Time next = job_.CheckDeadlines(t1 + kDeadline, fx_);
  const GroupState& g = job_.core().groups.at("g");
  // The step was due at t1 + kDeadline: nobody answers progress queries, so
  // the job failed naming node b's ranks.
  EXPECT_TRUE(job_.failed());
  EXPECT_TRUE(g.pending.empty());
  EXPECT_EQ(next, absl::InfiniteFuture());
  ASSERT_EQ(fx_.run_failures.size(), 1u);
  EXPECT_EQ(fx_.run_failures[0].kind(), v1::MISSING_RANKS);
  EXPECT_EQ(fx_.run_failures[0].step(), 1);
  EXPECT_THAT(fx_.run_failures[0].ranks(), ::testing::ElementsAre(2, 3));
}

TEST_F(JobTest, DeadlineCheckReturnsTheNextWakeBeforeAndFailsTheJobAtTheDeadline) {
  RegisterGroup("g", 2);
  job_.HandleManifests(*a_, BatchOf({Full("g", 3, {0, 1})}), nullptr, kStart, fx_);
  EXPECT_EQ(job_.CheckDeadlines(kStart + absl::Seconds(1), fx_), kStart + kDeadline);
  EXPECT_FALSE(job_.failed());
  job_.CheckDeadlines(kStart + kDeadline, fx_);
  EXPECT_TRUE(job_.failed());
  ASSERT_EQ(fx_.decisions.decisions_size(), 1);
  const v1::DecisionError& e = fx_.decisions.decisions(0).error();
  EXPECT_EQ(e.kind(), v1::MISSING_RANKS);
  EXPECT_EQ(e.step(), 3);
  EXPECT_THAT(e.ranks(), ::testing::ElementsAre(2, 3));
  EXPECT_EQ(fx_.errors.size(), 1u);  // counted once
  ASSERT_EQ(fx_.run_failures.size(), 1u);
  // A later manifest gets the job's failure again, not a new error.
  job_.HandleManifests(*b_, BatchOf({Full("g", 3, {2, 3})}), nullptr, kStart + kDeadline, fx_);
  EXPECT_EQ(fx_.replies[&sink_b_].decisions(0).error().kind(), v1::JOB_FAILED);
  EXPECT_EQ(fx_.errors.size(), 1u);
}

TEST_F(JobTest, RankThatLeavesWhileAStepNeedsItFailsTheJobAtOnce) {
  RegisterGroup("g", 2);
  job_.HandleManifests(*a_, BatchOf({Full("g", 0, {0, 1})}), nullptr, kStart, fx_);
  v1::RankEvent left;
  left.set_rank(3);
  left.set_joined(false);
  left.set_last_step(-1);
  job_.HandleRankEvent(*b_, left, fx_);
  EXPECT_TRUE(job_.failed());
  ASSERT_EQ(fx_.decisions.decisions_size(), 1);
  EXPECT_EQ(fx_.decisions.decisions(0).error().kind(), v1::MISSING_RANKS);
  EXPECT_THAT(fx_.decisions.decisions(0).error().ranks(), ::testing::ElementsAre(3));
}

// A rank that left never submits a later step: that step fails the job the
// moment it starts, whatever arrives first (the rank's own node-mates, the
// other node, or a partial report), never at the deadline.
class LeftRankTest : public JobTest, public ::testing::WithParamInterface<int> {
 protected:
  static v1::RankEvent Left(int rank, int64_t last_step) {
    v1::RankEvent e;
    e.set_rank(rank);
    e.set_joined(false);
    e.set_last_step(last_step);
    return e;
  }
  static v1::NodeProgress Partial(const std::string& group, int64_t step,
                                  const std::vector<int>& reported) {
    v1::NodeProgress p;
    p.set_group_id(group);
    p.set_step(step);
    p.set_partial(true);
    p.set_waited_us(1000);
    for (int r : reported) p.add_reported(r);
    return p;
  }
  void DecideStepZero() {
    job_.HandleManifests(*a_, BatchOf({Full("g", 0, {0, 1})}), nullptr, kStart, fx_);
    job_.HandleManifests(*b_, BatchOf({Full("g", 0, {2, 3})}), nullptr, kStart, fx_);
    ASSERT_EQ(fx_.decisions.decisions_size(), 1);
    ASSERT_TRUE(fx_.decisions.decisions(0).has_ok());
  }
};

TEST_P(LeftRankTest, StepStartedAfterTheLeaveFailsTheJobAtOnceNamingTheRank) {
  RegisterGroup("g", 2);
  ASSERT_NO_FATAL_FAILURE(DecideStepZero());
  // Rank 3 leaves after step 0, before anything of step 1 arrived.
  job_.HandleRankEvent(*b_, Left(3, 0), fx_);
  EXPECT_FALSE(job_.failed());  // no step needs it yet
  const absl::Time t = kStart + absl::Seconds(1);
  switch (GetParam()) {
    case 0:  // its node-mate's step 1 (complete from the sidecar's view)
      job_.HandleManifests(
          *b_, BatchOf({NodeManifest("g", 1, {DType::kFloat32, DType::kFloat32}, 4, {2, 3}, {2})}),
          nullptr, t, fx_);
      break;
    case 1:  // the other node's step 1
      job_.HandleManifests(*a_, BatchOf({Full("g", 1, {0, 1})}), nullptr, t, fx_);
      break;
    case 2:  // the other node's partial report of step 1
      job_.HandleProgress(*a_, Partial("g", 1, {0}), t, fx_);
      break;
  }
  ASSERT_TRUE(job_.failed());
  ASSERT_EQ(fx_.decisions.decisions_size(), 2);
  const v1::DecisionError& e = fx_.decisions.decisions(1).error();
  EXPECT_EQ(e.kind(), v1::MISSING_RANKS);
  EXPECT_EQ(e.step(), 1);
  EXPECT_THAT(e.ranks(), ::testing::ElementsAre(3));  // never a live rank
  EXPECT_THAT(e.message(), ::testing::HasSubstr("step 1: rank 3 left (its stream to the sidecar on "
                                                "node \"b\" ended); missing ranks 3: rank 3"));
  EXPECT_EQ(fx_.errors.size(), 1u);
}

INSTANTIATE_TEST_SUITE_P(ArrivalOrders, LeftRankTest, ::testing::Values(0, 1, 2));

TEST_F(LeftRankTest, StepTheRankMayHaveSubmittedOrARankThatCameBackDoesNotFail) {
  RegisterGroup("g", 2);
  ASSERT_NO_FATAL_FAILURE(DecideStepZero());
  // Rank 3 left at step 1: what it submitted of step 1 may still come from
  // its node, so step 1 waits (its deadline stays the bound).
  job_.HandleRankEvent(*b_, Left(3, 1), fx_);
  job_.HandleManifests(*a_, BatchOf({Full("g", 1, {0, 1})}), nullptr, kStart, fx_);
  EXPECT_FALSE(job_.failed());
  job_.HandleManifests(*b_, BatchOf({Full("g", 1, {2, 3})}), nullptr, kStart, fx_);
  EXPECT_FALSE(job_.failed());
  ASSERT_EQ(fx_.decisions.decisions_size(), 2);
  // Rank 2 leaves at step 1 and joins again: step 2 waits for it as usual.
  job_.HandleRankEvent(*b_, Left(2, 1), fx_);
  v1::RankEvent joined;
  joined.set_rank(2);
  joined.set_joined(true);
  job_.HandleRankEvent(*b_, joined, fx_);
  joined.set_rank(3);
  job_.HandleRankEvent(*b_, joined, fx_);
  job_.HandleManifests(*a_, BatchOf({Full("g", 2, {0, 1})}), nullptr, kStart, fx_);
  EXPECT_FALSE(job_.failed());
  job_.HandleManifests(*b_, BatchOf({Full("g", 2, {2, 3})}), nullptr, kStart, fx_);
  EXPECT_FALSE(job_.failed());
  EXPECT_EQ(fx_.decisions.decisions_size(), 3);
  EXPECT_TRUE(fx_.errors.empty());
}

TEST_F(JobTest, LastStreamToDisconnectEmptiesTheJob) {
  EXPECT_FALSE(job_.Disconnect(*a_, kStart, fx_));
  EXPECT_THAT(fx_.wakes,
              ::testing::Contains(kStart + options_.node_reconnect_grace));  // its grace
  EXPECT_TRUE(job_.Disconnect(*b_, kStart, fx_));
  EXPECT_EQ(job_.core().members.connected(), 0);
}

}  // namespace
}  // namespace accord::daemon
