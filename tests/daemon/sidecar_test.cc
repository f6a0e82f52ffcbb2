#include "daemon/sidecar/sidecar.h"

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "daemon/common/clock.h"
#include "gtest/gtest.h"
#include "proto/wire.h"
#include "tests/daemon/fake_sinks.h"

namespace accord::daemon {
namespace {

using testing::FakeRankSink;
using testing::FakeUpstream;

v1::RankMessage Hello(int rank, int world) {
  v1::RankMessage m;
  m.mutable_hello()->set_job_id("j");
  m.mutable_hello()->set_rank(rank);
  m.mutable_hello()->set_world_size(world);
  return m;
}

GroupSpec Spec(int numel1 = 64) {
  return GroupSpec{"g", {ParamSpec{"a", 8, 64}, ParamSpec{"b", 8, numel1}}};
}

v1::RankMessage Reg(const GroupSpec& spec) {
  v1::RankMessage m;
  *m.mutable_registration() = wire::GroupSpecToProto(spec, Policy());
  return m;
}

v1::RankMessage Man(int64_t step, std::vector<std::optional<DType>> d) {
  v1::RankMessage m;
  wire::ManifestToProto("g", RankManifest(step, 0, 4, d), false,
                        m.mutable_manifests()->add_manifests());
  return m;
}

// Ranks 0 and 1 of a world of 4 on this node.
class SidecarTest : public ::testing::Test {
 protected:
  SidecarTest() : sidecar_(SidecarOptions{"n0", "", 64}) {
    sidecar_.SetUpstream(&up_);
    s0_ = sidecar_.OpenRank(&r0_);
    s1_ = sidecar_.OpenRank(&r1_);
    sidecar_.HandleRankMessage(s0_, Hello(0, 4));
    sidecar_.HandleRankMessage(s1_, Hello(1, 4));
  }
  Sidecar sidecar_;
  FakeUpstream up_;
  FakeRankSink r0_, r1_;
  Sidecar::SessionId s0_, s1_;
};

TEST_F(SidecarTest, HelloThenRankJoinedGoUpstream) {
  ASSERT_EQ(up_.sent.size(), 2u);
  EXPECT_TRUE(up_.sent[0].has_hello());
  EXPECT_EQ(up_.sent[0].hello().world_size(), 4);
  EXPECT_TRUE(up_.sent[1].rank_event().joined());
  EXPECT_EQ(up_.sent[1].rank_event().rank(), 1);
  EXPECT_TRUE(r0_.replies[0].has_welcome());
}

TEST_F(SidecarTest, TheWelcomeGivesEachRankTheNodeEpochOfTheHello) {
  const uint64_t epoch = up_.sent[0].hello().node_epoch();
  EXPECT_NE(epoch, 0u);
  EXPECT_EQ(r0_.replies[0].welcome().node_epoch(), epoch);
  EXPECT_EQ(r1_.replies[0].welcome().node_epoch(), epoch);
}

// A sidecar restarted before the coordinator's welcome reached it: its
// ranks resume with no run id, only the epoch of their welcome. The new
// sidecar goes on as that incarnation (same epoch), so its NEW hello is a
// reconnect of the same node, not restarted ranks that would end the run
// (chaos seed 7502). Ranks that are new processes say no resume: a fresh
// epoch, as before.
TEST(SidecarRestartedTest, RanksResumingWithoutARunKeepTheirEpochAndNewRanksDrawAFreshOne) {
  for (const bool resume : {true, false}) {
    Sidecar sidecar(SidecarOptions{"n0", "", 64});
    FakeUpstream up;
    FakeRankSink r0;
    sidecar.SetUpstream(&up);
    const Sidecar::SessionId s0 = sidecar.OpenRank(&r0);
    v1::RankMessage hello = Hello(0, 4);
    if (resume) hello.mutable_hello()->mutable_resume()->set_node_epoch(0x1234567);
    sidecar.HandleRankMessage(s0, hello);
    ASSERT_FALSE(up.sent.empty());
    ASSERT_TRUE(up.sent[0].has_hello());
    const v1::NodeHello& h = up.sent[0].hello();
    EXPECT_EQ(h.run_start(), v1::NodeHello::RUN_START_NEW);
    if (resume) {
      EXPECT_EQ(h.node_epoch(), 0x1234567u);
    } else {
      EXPECT_NE(h.node_epoch(), 0x1234567u);
      EXPECT_NE(h.node_epoch(), 0u);
    }
    ASSERT_FALSE(r0.replies.empty());
    EXPECT_EQ(r0.replies[0].welcome().node_epoch(), h.node_epoch());
  }
}

TEST_F(SidecarTest, DuplicateRankIsRefusedAndOnlyItsStreamCloses) {
  FakeRankSink dup;
  auto s = sidecar_.OpenRank(&dup);
  sidecar_.HandleRankMessage(s, Hello(1, 4));
  ASSERT_TRUE(dup.closed.has_value());
  EXPECT_EQ(dup.closed->code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(dup.replies[0].error().kind(), v1::DUPLICATE_RANK);
  EXPECT_FALSE(r1_.closed.has_value());
}

TEST_F(SidecarTest, WorldSizeMismatchIsRefused) {
  FakeRankSink other;
  auto s = sidecar_.OpenRank(&other);
  sidecar_.HandleRankMessage(s, Hello(2, 8));
  ASSERT_TRUE(other.closed.has_value());
  EXPECT_EQ(other.replies[0].error().kind(), v1::WORLD_SIZE_MISMATCH);
}

TEST_F(SidecarTest, MergesLocalRanksIntoOneNodeManifestThenRepeats) {
  sidecar_.HandleRankMessage(s0_, Reg(Spec()));
  sidecar_.HandleRankMessage(s1_, Reg(Spec()));
  sidecar_.HandleRankMessage(s0_, Man(0, {DType::kBFloat16, std::nullopt}));
  EXPECT_TRUE(up_.manifests().empty());  // rank 1 not yet reported
  sidecar_.HandleRankMessage(s1_, Man(0, {DType::kBFloat16, DType::kBFloat16}));
  ASSERT_EQ(up_.manifests().size(), 1u);
  v1::Manifest m0 = up_.manifests()[0];
  EXPECT_FALSE(m0.repeat());
  EXPECT_TRUE(m0.rank_bits().empty());  // covers every announced rank
  EXPECT_EQ(m0.used_bits(), std::string(1, '\x03'));
  ASSERT_EQ(m0.rank_detail_size(), 1);  // rank 0 differs from the merge
  EXPECT_EQ(m0.rank_detail(0).rank(), 0);
  sidecar_.HandleRankMessage(s0_, Man(1, {DType::kBFloat16, std::nullopt}));
  sidecar_.HandleRankMessage(s1_, Man(1, {DType::kBFloat16, DType::kBFloat16}));
  ASSERT_EQ(up_.manifests().size(), 2u);
  EXPECT_TRUE(up_.manifests()[1].repeat());
  EXPECT_EQ(up_.manifests()[1].cache_key(), m0.cache_key());
  EXPECT_EQ(sidecar_.stats().node_manifests_repeat, 1);
}

TEST_F(SidecarTest, AnswersTheCoordinatorsProgressQueryWithWhoSubmittedAndLastSteps) {
  EXPECT_TRUE(up_.sent[0].hello().answers_progress());
  sidecar_.HandleRankMessage(s0_, Reg(Spec()));
  sidecar_.HandleRankMessage(s1_, Reg(Spec()));
  sidecar_.HandleRankMessage(s0_, Man(0, {DType::kBFloat16, std::nullopt}));
  sidecar_.HandleRankMessage(s1_, Man(0, {DType::kBFloat16, DType::kBFloat16}));
  sidecar_.HandleRankMessage(s0_, Man(1, {DType::kBFloat16, std::nullopt}));  // rank 1 lags
  up_.sent.clear();
  v1::CoordinatorMessage q;
  q.mutable_progress_query()->set_group_id("g");
  q.mutable_progress_query()->set_step(1);
  sidecar_.HandleCoordinatorMessage(q);
  ASSERT_EQ(up_.sent.size(), 1u);
  ASSERT_TRUE(up_.sent[0].has_progress());
  const v1::NodeProgress& p = up_.sent[0].progress();
  EXPECT_EQ(p.group_id(), "g");
  EXPECT_EQ(p.step(), 1);
  EXPECT_EQ(std::vector<int>(p.reported().begin(), p.reported().end()), std::vector<int>{0});
  EXPECT_EQ(std::vector<int>(p.ranks().begin(), p.ranks().end()), (std::vector<int>{0, 1}));
  EXPECT_EQ(std::vector<int64_t>(p.last_steps().begin(), p.last_steps().end()),
            (std::vector<int64_t>{1, 0}));
  // An unknown group or step: nobody submitted it.
  up_.sent.clear();
  q.mutable_progress_query()->set_group_id("nope");
  sidecar_.HandleCoordinatorMessage(q);
  ASSERT_EQ(up_.sent.size(), 1u);
  EXPECT_EQ(up_.sent[0].progress().reported_size(), 0);
}

// Two groups whose steps advance at different rates (like the guard's
// sequence group beside a reduce-scatter group): the answer about one group
// gives each rank's last step of that group, not of the other.
TEST_F(SidecarTest, ProgressAnswersGiveEachRanksLastStepOfTheAskedGroupOnly) {
  GroupSpec fast = Spec();
  fast.group_id = "~seq";
  for (auto s : {s0_, s1_}) {
    sidecar_.HandleRankMessage(s, Reg(Spec()));
    sidecar_.HandleRankMessage(s, Reg(fast));
  }
  auto man = [](const std::string& group, int64_t step) {
    v1::RankMessage m;
    wire::ManifestToProto(group, RankManifest(step, 0, 4, {DType::kBFloat16, std::nullopt}), false,
                          m.mutable_manifests()->add_manifests());
    return m;
  };
  sidecar_.HandleRankMessage(s0_, man("g", 0));
  sidecar_.HandleRankMessage(s1_, man("g", 0));
  sidecar_.HandleRankMessage(s0_, man("g", 1));  // rank 1 stops before step 1
  for (int64_t step = 0; step <= 15; ++step) {
    sidecar_.HandleRankMessage(s0_, man("~seq", step));
    sidecar_.HandleRankMessage(s1_, man("~seq", step));
  }
  up_.sent.clear();
  v1::CoordinatorMessage q;
  q.mutable_progress_query()->set_group_id("g");
  q.mutable_progress_query()->set_step(1);
  sidecar_.HandleCoordinatorMessage(q);
  ASSERT_EQ(up_.sent.size(), 1u);
  const v1::NodeProgress& p = up_.sent[0].progress();
  EXPECT_EQ(std::vector<int>(p.reported().begin(), p.reported().end()), std::vector<int>{0});
  EXPECT_EQ(std::vector<int>(p.ranks().begin(), p.ranks().end()), (std::vector<int>{0, 1}));
  EXPECT_EQ(std::vector<int64_t>(p.last_steps().begin(), p.last_steps().end()),
            (std::vector<int64_t>{1, 0}));
  // A group not registered here: no rank has a step of it.
  up_.sent.clear();
  q.mutable_progress_query()->set_group_id("other");
  sidecar_.HandleCoordinatorMessage(q);
  ASSERT_EQ(up_.sent.size(), 1u);
  EXPECT_EQ(std::vector<int64_t>(up_.sent[0].progress().last_steps().begin(),
                                 up_.sent[0].progress().last_steps().end()),
            (std::vector<int64_t>{-1, -1}));
}

// Ranks 0 and 1 on one node; rank 1 never submits step 1. Once the step is
// half the coordinator's deadline old (Welcome.deadline_ms), the sidecar
// reports it upstream as partial, once; complete steps are never reported.
TEST(SidecarPartialTest, StepSomeRanksSubmittedIsReportedOnceAfterHalfTheDeadline) {
  FakeClock clock;
  SidecarOptions o{"n0", "", 64};
  o.clock = &clock;
  o.start_timer_thread = false;
  Sidecar sidecar(o);
  FakeUpstream up;
  sidecar.SetUpstream(&up);
  FakeRankSink r0, r1;
  auto s0 = sidecar.OpenRank(&r0);
  auto s1 = sidecar.OpenRank(&r1);
  sidecar.HandleRankMessage(s0, Hello(0, 4));
  sidecar.HandleRankMessage(s1, Hello(1, 4));
  v1::CoordinatorMessage welcome;
  welcome.mutable_welcome()->set_deadline_ms(2000);
  sidecar.HandleCoordinatorMessage(welcome);
  sidecar.HandleRankMessage(s0, Reg(Spec()));
  sidecar.HandleRankMessage(s1, Reg(Spec()));
  sidecar.HandleRankMessage(s0, Man(0, {DType::kBFloat16, std::nullopt}));
  sidecar.HandleRankMessage(s1, Man(0, {DType::kBFloat16, std::nullopt}));
  sidecar.HandleRankMessage(s0, Man(1, {DType::kBFloat16, std::nullopt}));
  up.sent.clear();
  auto partials = [&] {
    std::vector<v1::NodeProgress> out;
    for (const auto& m : up.sent) {
      if (m.has_progress()) out.push_back(m.progress());
    }
    return out;
  };
  clock.Advance(absl::Milliseconds(999));
  sidecar.CheckPartialSteps();
  EXPECT_TRUE(partials().empty()) << "step 0 is complete and step 1 is young";
  clock.Advance(absl::Milliseconds(1));
  sidecar.CheckPartialSteps();
  std::vector<v1::NodeProgress> got = partials();
  ASSERT_EQ(got.size(), 1u);
  EXPECT_TRUE(got[0].partial());
  EXPECT_EQ(got[0].group_id(), "g");
  EXPECT_EQ(got[0].step(), 1);
  EXPECT_EQ(got[0].waited_us(), 1000000);
  EXPECT_EQ(std::vector<int>(got[0].reported().begin(), got[0].reported().end()),
            std::vector<int>{0});
  EXPECT_EQ(std::vector<int64_t>(got[0].last_steps().begin(), got[0].last_steps().end()),
            (std::vector<int64_t>{1, 0}));
  clock.Advance(absl::Seconds(5));
  sidecar.CheckPartialSteps();
  EXPECT_EQ(partials().size(), 1u) << "reported once per stream";
  // A new stream (e.g. a restarted coordinator) hears of it again.
  sidecar.OnUpstreamConnected();
  sidecar.HandleCoordinatorMessage(welcome);
  up.sent.clear();
  sidecar.CheckPartialSteps();
  ASSERT_EQ(partials().size(), 1u);
  EXPECT_EQ(partials()[0].waited_us(), 6000000);
}

TEST(SidecarPartialTest, NothingIsReportedToACoordinatorThatDidNotSayItsDeadline) {
  FakeClock clock;
  SidecarOptions o{"n0", "", 64};
  o.clock = &clock;
  o.start_timer_thread = false;
  Sidecar sidecar(o);
  FakeUpstream up;
  sidecar.SetUpstream(&up);
  FakeRankSink r0, r1;
  auto s0 = sidecar.OpenRank(&r0);
  auto s1 = sidecar.OpenRank(&r1);
  sidecar.HandleRankMessage(s0, Hello(0, 4));
  sidecar.HandleRankMessage(s1, Hello(1, 4));
  sidecar.HandleCoordinatorMessage(v1::CoordinatorMessage());  // no Welcome.deadline_ms
  sidecar.HandleRankMessage(s0, Reg(Spec()));
  sidecar.HandleRankMessage(s1, Reg(Spec()));
  sidecar.HandleRankMessage(s0, Man(0, {DType::kBFloat16, std::nullopt}));
  up.sent.clear();
  clock.Advance(absl::Hours(1));
  sidecar.CheckPartialSteps();
  EXPECT_TRUE(up.sent.empty());
}

// The coordinator asks for a full-form resend with a field, not with words:
// an INVALID_MANIFEST whose message merely mentions the full form is passed
// to the ranks.
TEST_F(SidecarTest, ResendsInFullFormOnlyWhenTheErrorSaysSoInItsField) {
  sidecar_.HandleRankMessage(s0_, Reg(Spec()));
  sidecar_.HandleRankMessage(s1_, Reg(Spec()));
  for (int64_t step : {0, 1, 2}) {
    sidecar_.HandleRankMessage(s0_, Man(step, {DType::kBFloat16, std::nullopt}));
    sidecar_.HandleRankMessage(s1_, Man(step, {DType::kBFloat16, std::nullopt}));
  }
  ASSERT_TRUE(up_.manifests().back().repeat());
  up_.sent.clear();
  v1::CoordinatorMessage reply;
  v1::Decision* d = reply.mutable_decisions()->add_decisions();
  d->set_group_id("g");
  d->set_step(1);
  *d->mutable_error() = wire::MakeError(
      v1::INVALID_MANIFEST, absl::FailedPreconditionError("unknown key; resend in full form"));
  sidecar_.HandleCoordinatorMessage(reply);
  EXPECT_TRUE(up_.manifests().empty()) << "keyed on the text";
  EXPECT_EQ(r0_.decisions().back().error().kind(), v1::INVALID_MANIFEST);
  d->set_step(2);
  d->mutable_error()->set_resend_full_form(true);
  const size_t delivered = r0_.decisions().size();
  sidecar_.HandleCoordinatorMessage(reply);
  ASSERT_EQ(up_.manifests().size(), 1u);
  EXPECT_FALSE(up_.manifests()[0].repeat());
  EXPECT_EQ(up_.manifests()[0].step(), 2);
  EXPECT_EQ(r0_.decisions().size(), delivered) << "the ranks wait for the real decision";
}

TEST_F(SidecarTest, LocalRegistrationsAreForwardedPerVariantForTheCoordinatorToCompare) {
  sidecar_.HandleRankMessage(s0_, Reg(Spec()));
  sidecar_.HandleRankMessage(s1_, Reg(Spec(128)));
  int regs = 0;
  for (const auto& m : up_.sent) {
    if (!m.has_registration()) continue;
    ++regs;
    EXPECT_EQ(m.registration().ranks_size(), 1);
  }
  EXPECT_EQ(regs, 2);
}

// A registration error naming ranks is about those ranks' own registration
// (they alone get it) unless it is the group's or the job's failure, whose
// ranks are the ranks at fault: MISSING_RANKS names ranks 2 and 3 (that never
// registered), and both local ranks, which did, get it.
TEST_F(SidecarTest, ARegistrationErrorNamingTheRanksAtFaultReachesEveryRankThatRegistered) {
  sidecar_.HandleRankMessage(s0_, Reg(Spec()));
  sidecar_.HandleRankMessage(s1_, Reg(Spec()));
  auto result = [](v1::ErrorKind kind, std::vector<int> ranks) {
    v1::CoordinatorMessage m;
    m.mutable_registration()->set_group_id("g");
    v1::DecisionError* e = m.mutable_registration()->mutable_error();
    e->set_kind(kind);
    e->set_code(static_cast<int>(wire::CodeOfKind(kind)));
    e->set_message("about ranks");
    for (int r : ranks) e->add_ranks(r);
    return m;
  };
  auto registration_errors = [](const FakeRankSink& sink) {
    int n = 0;
    for (const v1::RankReply& r : sink.replies) n += r.registration().has_error() ? 1 : 0;
    return n;
  };
  sidecar_.HandleCoordinatorMessage(result(v1::INVALID_REQUEST, {1}));
  EXPECT_EQ(registration_errors(r0_), 0);
  EXPECT_EQ(registration_errors(r1_), 1);
  sidecar_.HandleCoordinatorMessage(result(v1::MISSING_RANKS, {2, 3}));
  EXPECT_EQ(registration_errors(r0_), 1);
  EXPECT_EQ(registration_errors(r1_), 1);  // it had its result already
}

TEST_F(SidecarTest, InvalidManifestAnswersThatRankOnly) {
  sidecar_.HandleRankMessage(s0_, Reg(Spec()));
  sidecar_.HandleRankMessage(s1_, Reg(Spec()));
  v1::RankMessage bad = Man(0, {DType::kBFloat16, std::nullopt});
  bad.mutable_manifests()->mutable_manifests(0)->set_uniform_dtype(v1::INT32);
  sidecar_.HandleRankMessage(s0_, bad);
  ASSERT_EQ(r0_.decisions().size(), 1u);
  EXPECT_EQ(r0_.decisions()[0].error().kind(), v1::NON_FLOAT_DTYPE);
  EXPECT_TRUE(r1_.decisions().empty());
  EXPECT_FALSE(r0_.closed.has_value());
}

TEST_F(SidecarTest, SameAsPreviousIsExpandedForARankThatMissedThePreviousDecision) {
  sidecar_.HandleRankMessage(s0_, Reg(Spec()));
  v1::CoordinatorMessage d0;
  v1::Decision* d = d0.mutable_decisions()->add_decisions();
  d->set_group_id("g");
  d->set_step(0);
  d->mutable_ok()->set_wire_dtype(v1::BFLOAT16);
  sidecar_.HandleCoordinatorMessage(d0);
  sidecar_.HandleRankMessage(s1_, Reg(Spec()));  // rank 1 registers late
  v1::CoordinatorMessage d1;
  d = d1.mutable_decisions()->add_decisions();
  d->set_group_id("g");
  d->set_step(1);
  d->set_same_as_previous(true);
  sidecar_.HandleCoordinatorMessage(d1);
  ASSERT_EQ(r0_.decisions().size(), 2u);
  EXPECT_TRUE(r0_.decisions()[1].same_as_previous());
  ASSERT_EQ(r1_.decisions().size(), 1u);
  EXPECT_FALSE(r1_.decisions()[0].same_as_previous());
  EXPECT_EQ(r1_.decisions()[0].ok().wire_dtype(), v1::BFLOAT16);
}

TEST_F(SidecarTest, ReconnectResendsHelloRegistrationsAndUndecidedManifestsInFullForm) {
  sidecar_.HandleRankMessage(s0_, Reg(Spec()));
  sidecar_.HandleRankMessage(s1_, Reg(Spec()));
  sidecar_.HandleRankMessage(s0_, Man(0, {DType::kBFloat16, std::nullopt}));
  sidecar_.HandleRankMessage(s1_, Man(0, {DType::kBFloat16, std::nullopt}));
  sidecar_.OnUpstreamConnected();
  ASSERT_GE(up_.reset.size(), 3u);
  EXPECT_TRUE(up_.reset[0].has_hello());
  EXPECT_EQ(up_.reset[0].hello().ranks_size(), 2);
  EXPECT_TRUE(up_.reset[1].has_registration());
  EXPECT_EQ(up_.reset[1].registration().ranks_size(), 2);
  const v1::NodeMessage& last = up_.reset.back();
  ASSERT_EQ(last.manifests().manifests_size(), 1);
  EXPECT_FALSE(last.manifests().manifests(0).repeat());
}

TEST_F(SidecarTest, RankLeavingIsReportedAndCompletesStepsWaitingOnlyForIt) {
  sidecar_.HandleRankMessage(s0_, Reg(Spec()));
  sidecar_.HandleRankMessage(s1_, Reg(Spec()));
  sidecar_.HandleRankMessage(s0_, Man(0, {DType::kBFloat16, std::nullopt}));
  up_.sent.clear();
  sidecar_.CloseRank(s1_);
  // The step rank 0 submitted goes up before rank 1's leave, so the
  // coordinator knows rank 0 submitted it when the leave fails the step.
  ASSERT_EQ(up_.sent.size(), 2u);
  EXPECT_EQ(up_.sent[0].manifests().manifests_size(), 1);
  ASSERT_TRUE(up_.sent[1].has_rank_event());
  EXPECT_FALSE(up_.sent[1].rank_event().joined());
  EXPECT_EQ(up_.sent[1].rank_event().rank(), 1);
  ASSERT_EQ(up_.manifests().size(), 1u);
  EXPECT_FALSE(up_.manifests()[0].rank_bits().empty());  // explicit: only rank 0
  up_.sent.clear();
  sidecar_.CloseRank(s0_);
  EXPECT_EQ(up_.reconnects, 1);  // last rank gone: the node is free for another job
  // The last rank's leave goes up before the stream ends, so the coordinator
  // names it at once rather than after the node's reconnect grace.
  ASSERT_EQ(up_.sent_before_reconnect, 1u);
  ASSERT_TRUE(up_.sent[0].has_rank_event());
  EXPECT_FALSE(up_.sent[0].rank_event().joined());
  EXPECT_EQ(up_.sent[0].rank_event().rank(), 0);
}

TEST_F(SidecarTest, RepeatedBatchGoesUpAsABatchRepeatOnlyWhenTheCoordinatorAcceptsIt) {
  sidecar_.HandleRankMessage(s0_, Reg(Spec()));
  sidecar_.HandleRankMessage(s1_, Reg(Spec()));
  auto step = [&](int64_t s) {
    sidecar_.HandleRankMessage(s0_, Man(s, {DType::kBFloat16, std::nullopt}));
    sidecar_.HandleRankMessage(s1_, Man(s, {DType::kBFloat16, std::nullopt}));
    return up_.sent.back();
  };
  const uint64_t key = step(0).manifests().manifests(0).cache_key();
  // No Welcome with batch_repeat yet: per-manifest repeat form.
  v1::NodeMessage m1 = step(1);
  ASSERT_EQ(m1.manifests().manifests_size(), 1);
  EXPECT_TRUE(m1.manifests().manifests(0).repeat());
  EXPECT_EQ(m1.manifests().repeat_batch_key(), 0u);
  v1::CoordinatorMessage welcome;
  welcome.mutable_welcome()->set_batch_repeat(true);
  sidecar_.HandleCoordinatorMessage(welcome);
  v1::NodeMessage m2 = step(2);
  wire::BatchKeyHasher hasher;
  hasher.Add("g", key);
  EXPECT_EQ(m2.manifests().manifests_size(), 0);
  EXPECT_EQ(m2.manifests().repeat_step(), 2);
  EXPECT_EQ(m2.manifests().repeat_batch_key(), hasher.Finish());
  EXPECT_EQ(sidecar_.stats().node_batch_repeats, 1);
  EXPECT_EQ(sidecar_.stats().node_manifests_repeat, 2);
  // A new stream: full form again, and no batch repeat before its Welcome.
  sidecar_.OnUpstreamConnected();
  v1::NodeMessage m3 = step(3);
  ASSERT_EQ(m3.manifests().manifests_size(), 1);
  EXPECT_FALSE(m3.manifests().manifests(0).repeat());
  sidecar_.HandleCoordinatorMessage(welcome);
  // The previous batch (step 3, full form) had the same groups and keys.
  EXPECT_EQ(step(4).manifests().repeat_step(), 4);
  EXPECT_EQ(sidecar_.stats().node_batch_repeats, 2);
}

// The coordinator failed the job while rank 0's step 0 waited here for
// rank 1 (the coordinator never saw the step): the verdict answers it at
// once, for both ranks, and every later manifest too.
TEST_F(SidecarTest, AFailedJobsVerdictAnswersEveryStepItsRanksWaitFor) {
  sidecar_.HandleRankMessage(s0_, Reg(Spec()));
  sidecar_.HandleRankMessage(s1_, Reg(Spec()));
  sidecar_.HandleRankMessage(s0_, Man(0, {DType::kBFloat16, std::nullopt}));
  ASSERT_TRUE(up_.manifests().empty()) << "the step waits for rank 1";
  v1::CoordinatorMessage failed;
  v1::Decision* d = failed.mutable_decisions()->add_decisions();
  d->set_group_id("other");  // a group pending at the coordinator
  d->set_step(3);
  d->mutable_error()->set_kind(v1::MISSING_RANKS);
  d->mutable_error()->set_code(4);
  d->mutable_error()->set_message("job j: rank 3 left; the job is failed");
  d->mutable_error()->set_job_failed(true);
  sidecar_.HandleCoordinatorMessage(failed);
  for (FakeRankSink* r : {&r0_, &r1_}) {
    ASSERT_EQ(r->decisions().size(), 1u);
    const v1::Decision got = r->decisions()[0];
    EXPECT_EQ(got.group_id(), "g");
    EXPECT_EQ(got.step(), 0);
    EXPECT_EQ(got.error().kind(), v1::JOB_FAILED);
    EXPECT_EQ(got.error().message(), "job j: rank 3 left; the job is failed");
    EXPECT_EQ(got.error().code(), 4);
  }
  // Rank 1's manifest of step 0, and rank 0's of step 1, come after it.
  sidecar_.HandleRankMessage(s1_, Man(0, {DType::kBFloat16, std::nullopt}));
  sidecar_.HandleRankMessage(s0_, Man(1, {DType::kBFloat16, std::nullopt}));
  ASSERT_EQ(r1_.decisions().size(), 2u);
  EXPECT_EQ(r1_.decisions()[1].step(), 0);
  EXPECT_EQ(r1_.decisions()[1].error().message(), "job j: rank 3 left; the job is failed");
  ASSERT_EQ(r0_.decisions().size(), 2u);
  EXPECT_EQ(r0_.decisions()[1].step(), 1);
  EXPECT_EQ(r0_.decisions()[1].error().kind(), v1::JOB_FAILED);
  EXPECT_EQ(r0_.decisions()[1].error().message(), "job j: rank 3 left; the job is failed");
}

// The coordinator pushes the job's verdict to every node: ranks that wait
// for nothing get it as RankReply.error; a rank waiting for a step the
// coordinator never saw gets that step answered first.
TEST_F(SidecarTest, AJobVerdictReachesRanksWaitingForNothing) {
  sidecar_.HandleRankMessage(s0_, Reg(Spec()));
  sidecar_.HandleRankMessage(s1_, Reg(Spec()));
  sidecar_.HandleRankMessage(s0_, Man(0, {DType::kBFloat16, std::nullopt}));
  v1::CoordinatorMessage verdict;
  v1::DecisionError* e = verdict.mutable_error();
  e->set_kind(v1::JOB_FAILED);
  e->set_code(4);
  e->set_message("job j group \"h@ranks2..3\" step 5: rank 3 left; the job is failed");
  e->set_group_id("h@ranks2..3");
  e->set_step(5);
  e->set_job_failed(true);
  sidecar_.HandleCoordinatorMessage(verdict);
  ASSERT_EQ(r0_.decisions().size(), 1u);
  EXPECT_EQ(r0_.decisions()[0].step(), 0);
  EXPECT_EQ(r0_.decisions()[0].error().kind(), v1::JOB_FAILED);
  EXPECT_EQ(r0_.decisions()[0].error().message(), e->message());
  for (FakeRankSink* r : {&r0_, &r1_}) {
    ASSERT_FALSE(r->replies.empty());
    ASSERT_TRUE(r->replies.back().has_error());
    EXPECT_TRUE(r->replies.back().error().job_failed());
    EXPECT_EQ(r->replies.back().error().message(), e->message());
    EXPECT_FALSE(r->closed.has_value()) << "the rank keeps its stream";
  }
}

v1::RankMessage Counts(int64_t speculated, int64_t repaired, int64_t redone) {
  v1::RankMessage m;
  m.mutable_adapter_counts()->set_speculated(speculated);
  m.mutable_adapter_counts()->set_repaired(repaired);
  m.mutable_adapter_counts()->set_redone(redone);
  return m;
}

TEST_F(SidecarTest, AdapterCountsAddUpOverRanksAndOverARanksNewProcess) {
  sidecar_.HandleRankMessage(s0_, Counts(10, 2, 1));
  sidecar_.HandleRankMessage(s1_, Counts(10, 2, 1));
  sidecar_.HandleRankMessage(s0_, Counts(16, 3, 1));  // rank 0's totals grew
  SidecarStats s = sidecar_.stats();
  EXPECT_EQ(s.adapter_speculated, 26);
  EXPECT_EQ(s.adapter_repaired, 5);
  EXPECT_EQ(s.adapter_redone, 2);
  // Smaller totals: a new process of rank 1, added whole.
  sidecar_.HandleRankMessage(s1_, Counts(4, 1, 1));
  // Counts that cannot be (more repaired than speculated) are ignored.
  sidecar_.HandleRankMessage(s0_, Counts(1, 2, 0));
  sidecar_.HandleRankMessage(s0_, Counts(20, 3, -1));
  s = sidecar_.stats();
  EXPECT_EQ(s.adapter_speculated, 30);
  EXPECT_EQ(s.adapter_repaired, 6);
  EXPECT_EQ(s.adapter_redone, 3);
  EXPECT_FALSE(r0_.closed.has_value()) << "counts never end a rank's stream";
}

// Release coalescing (docs/MEMBERS.md 2.11): ranks 0..3 of a TP 2 x DP 2
// job on one sidecar, dp member sets {0, 2} (group "a") and {1, 3} (group
// "b"); every rank's release batch carries `sync_key`.
class SidecarSyncTest : public ::testing::Test {
 protected:
  static constexpr int kWorld = 4;

  SidecarSyncTest() : sidecar_(Options(&clock_)) {
    sidecar_.SetUpstream(&up_);
    v1::CoordinatorMessage welcome;
    welcome.mutable_welcome()->set_members(true);
    welcome.mutable_welcome()->set_batch_repeat(true);
    welcome.mutable_welcome()->set_deadline_ms(2000);
    for (int r = 0; r < kWorld; ++r) {
      sessions_.push_back(sidecar_.OpenRank(&sinks_[r]));
      sidecar_.HandleRankMessage(sessions_[r], Hello(r, kWorld));
    }
    sidecar_.HandleCoordinatorMessage(welcome);
    for (int r = 0; r < kWorld; ++r) sidecar_.HandleRankMessage(sessions_[r], Reg(GroupOf(r)));
  }

  static SidecarOptions Options(FakeClock* clock) {
    SidecarOptions o{"n0", "", 64};
    o.clock = clock;
    o.start_timer_thread = false;
    return o;
  }
  static GroupSpec GroupOf(int rank) {
    GroupSpec spec{rank % 2 == 0 ? "a" : "b", {ParamSpec{"w", 8, 64}}};
    spec.members =
        std::make_shared<const MemberSet>(*MemberSet::FromRanks({rank % 2, rank % 2 + 2}, kWorld));
    return spec;
  }
  // Rank `rank`'s release of `step` with `key`.
  void Release(int rank, int64_t step, uint64_t key) {
    v1::RankMessage m;
    wire::ManifestToProto(GroupOf(rank).group_id,
                          RankManifest(step, rank, kWorld, {DType::kBFloat16}), false,
                          m.mutable_manifests()->add_manifests());
    m.mutable_manifests()->set_sync_key(key);
    sidecar_.HandleRankMessage(sessions_[rank], m);
  }
  // The manifest batches sent upstream since the last call.
  std::vector<v1::ManifestBatch> Batches() {
    std::vector<v1::ManifestBatch> out;
    for (const v1::NodeMessage& m : up_.sent) {
      if (m.has_manifests()) out.push_back(m.manifests());
    }
    up_.sent.clear();
    return out;
  }
  static std::vector<std::string> Groups(const v1::ManifestBatch& b) {
    std::vector<std::string> out;
    for (const v1::Manifest& m : b.manifests()) out.push_back(m.group_id());
    return out;
  }

  FakeClock clock_;
  Sidecar sidecar_;
  FakeUpstream up_;
  FakeRankSink sinks_[kWorld];
  std::vector<Sidecar::SessionId> sessions_;
};

TEST_F(SidecarSyncTest, OneKeyGoesUpAsOneBatchPerStepAndTheNextEqualStepAsABatchRepeat) {
  constexpr uint64_t kKey = 0x5eed;
  // Step 0: the class is the ranks that sent the key so far; each member
  // set's node manifest goes as it completes.
  for (int r = 0; r < kWorld; ++r) Release(r, 0, kKey);
  EXPECT_EQ(Batches().size(), 2u);
  // Then one batch per step in registration order, whichever member set
  // completes first (odd steps arrive in the opposite rank order).
  for (int64_t step = 1; step < 5; ++step) {
    for (int i = 0; i < kWorld; ++i) Release(step % 2 == 1 ? kWorld - 1 - i : i, step, kKey);
    const std::vector<v1::ManifestBatch> sent = Batches();
    ASSERT_EQ(sent.size(), 1u) << "step " << step;
    if (step == 1) {
      EXPECT_EQ(Groups(sent[0]), (std::vector<std::string>{"a", "b"}));
    } else {
      EXPECT_EQ(sent[0].manifests_size(), 0) << "step " << step;
      EXPECT_EQ(sent[0].repeat_step(), step);
    }
  }
  EXPECT_EQ(sidecar_.stats().node_batch_repeats, 3);
  EXPECT_EQ(sidecar_.stats().release_held, 0);
}

TEST_F(SidecarSyncTest, WithoutAKeyEachMemberSetGoesUpAsItCompletes) {
  for (int64_t step = 0; step < 4; ++step) {
    for (int i = 0; i < kWorld; ++i) Release(step % 2 == 1 ? kWorld - 1 - i : i, step, 0);
    EXPECT_EQ(Batches().size(), 2u) << "step " << step;
  }
}

// A silent rank holds its class's other member set for half the deadline.
TEST_F(SidecarSyncTest, AHoldWaitingForASilentRankGoesAtHalfTheDeadline) {
  constexpr uint64_t kKey = 0x5eed;
  for (int r = 0; r < kWorld; ++r) Release(r, 0, kKey);
  Batches();
  for (int r : {1, 2, 3}) Release(r, 1, kKey);  // "b" complete; rank 0 silent
  EXPECT_TRUE(Batches().empty());
  EXPECT_EQ(sidecar_.stats().release_held, 1);
  clock_.Advance(absl::Milliseconds(999));
  sidecar_.CheckPartialSteps();
  EXPECT_TRUE(Batches().empty());
  clock_.Advance(absl::Milliseconds(1));
  sidecar_.CheckPartialSteps();
  // Rank 0's own group is reported partial, as without holds.
  ASSERT_EQ(up_.progress().size(), 1u);
  EXPECT_EQ(up_.progress()[0].group_id(), "a");
  // "b" alone: the previous batch (step 0's second) again, a batch repeat.
  const std::vector<v1::ManifestBatch> sent = Batches();
  ASSERT_EQ(sent.size(), 1u);
  EXPECT_EQ(sent[0].manifests_size(), 0);
  EXPECT_EQ(sent[0].repeat_step(), 1);
  EXPECT_EQ(sidecar_.stats().release_holds_expired, 1);
}

TEST_F(SidecarSyncTest, AClassRankLeavingFlushesItsClass) {
  constexpr uint64_t kKey = 0x5eed;
  for (int r = 0; r < kWorld; ++r) Release(r, 0, kKey);
  Batches();
  for (int r : {1, 3, 2}) Release(r, 1, kKey);  // "b" held for rank 0
  EXPECT_TRUE(Batches().empty());
  sidecar_.CloseRank(sessions_[0]);
  // The held "b" first (step 0's second batch again: a batch repeat), then
  // "a", which waited only for rank 0.
  const std::vector<v1::ManifestBatch> sent = Batches();
  ASSERT_EQ(sent.size(), 2u);
  EXPECT_EQ(sent[0].repeat_step(), 1);
  EXPECT_EQ(Groups(sent[1]), (std::vector<std::string>{"a"}));
  EXPECT_EQ(sent[1].manifests(0).step(), 1);
}

TEST(UsageDetailTest, ListsOnlyTheRanksWhoseUsageDiffersFromTheMergeWithTheirUsedBits) {
  LocalStep st;
  st.ranks = {2, 5, 7};
  // 9 parameters (two bytes of bits): rank 2 uses all, rank 5 none of 1 and
  // 8, rank 7 all but 0.
  const DTypeMask f = MaskOf(DType::kFloat32);
  std::vector<DTypeMask> all(9, f);
  std::vector<DTypeMask> r5 = all;
  r5[1] = r5[8] = 0;
  std::vector<DTypeMask> r7 = all;
  r7[0] = 0;
  for (const auto* row : {&all, &r5, &r7}) st.rows.insert(st.rows.end(), row->begin(), row->end());
  st.merged = all;
  UsageDetail detail;
  UsageDetailOf(st, 9, &detail);
  ASSERT_EQ(detail.size(), 2u);
  EXPECT_EQ(detail[0].rank, 5);
  EXPECT_EQ(detail[0].used_bits, std::string("\xfd\x00", 2));
  EXPECT_EQ(detail[1].rank, 7);
  EXPECT_EQ(detail[1].used_bits, std::string("\xfe\x01", 2));
  // Called again, it starts over.
  st.rows = std::vector<DTypeMask>(27, f);
  UsageDetailOf(st, 9, &detail);
  EXPECT_TRUE(detail.empty());
}

}  // namespace
}  // namespace accord::daemon
