// SidecarJob alone: no lock, no thread, no gRPC, no clock. The test passes
// the time in and records the effects (replies and stream ends per session,
// the timer's due times) and what goes upstream.
#include "daemon/sidecar/sidecar_job.h"

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "proto/wire.h"
#include "tests/daemon/fake_sinks.h"

namespace accord::daemon {
namespace {

class FakeEffects : public SidecarEffects {
 public:
  void SendToSession(SessionId session, std::shared_ptr<const v1::RankReply> reply) override {
    replies[session].push_back(*reply);
  }
  void CloseSession(SessionId session, const absl::Status& status) override {
    closed[session] = status;
  }
  void ArmTimer(absl::Time at) override {
    armed.push_back(at);
    due = std::min(due, at);
  }
  bool TimerArmed() const override { return due != absl::InfiniteFuture(); }

  // The decisions session `session` received, in order.
  std::vector<v1::Decision> decisions(SessionId session) {
    std::vector<v1::Decision> out;
    for (const v1::RankReply& r : replies[session]) {
      for (const v1::Decision& d : r.decisions().decisions()) out.push_back(d);
    }
    return out;
  }

  std::map<SessionId, std::vector<v1::RankReply>> replies;
  std::map<SessionId, absl::Status> closed;
  std::vector<absl::Time> armed;
  absl::Time due = absl::InfiniteFuture();  // the earliest time armed, until fired
};

using testing::FakeUpstream;

v1::RankMessage Hello(int rank, int world, bool reconnects = false) {
  v1::RankMessage m;
  m.mutable_hello()->set_job_id("j");
  m.mutable_hello()->set_rank(rank);
  m.mutable_hello()->set_world_size(world);
  m.mutable_hello()->set_reconnects(reconnects);
  return m;
}

GroupSpec Spec() { return GroupSpec{"g", {ParamSpec{"a", 8, 64}, ParamSpec{"b", 8, 64}}}; }

v1::RankMessage Reg() {
  v1::RankMessage m;
  *m.mutable_registration() = wire::GroupSpecToProto(Spec(), Policy());
  return m;
}

v1::RankMessage Man(int64_t step) {
  v1::RankMessage m;
  wire::ManifestToProto("g", RankManifest(step, 0, 4, {DType::kBFloat16, DType::kBFloat16}), false,
                        m.mutable_manifests()->add_manifests());
  return m;
}

v1::CoordinatorMessage Welcome(int64_t deadline_ms) {
  v1::CoordinatorMessage m;
  m.mutable_welcome()->set_run_id("r1");
  m.mutable_welcome()->set_deadline_ms(deadline_ms);
  return m;
}

// Ranks 0 and 1 of a world of 4 on this node, both registered to "g".
class SidecarJobTest : public ::testing::Test {
 protected:
  SidecarJobTest() : SidecarJobTest(SidecarOptions{"n0", "", 64}) {}
  explicit SidecarJobTest(SidecarOptions options)
      : options_(std::move(options)), job_(options_, effects_) {
    job_.SetUpstream(&up_);
  }

  void StartTwoRanks(bool reconnects = false) {
    s0_ = job_.OpenSession();
    s1_ = job_.OpenSession();
    job_.HandleRankMessage(t0_, s0_, Hello(0, 4, reconnects));
    job_.HandleRankMessage(t0_, s1_, Hello(1, 4, reconnects));
    job_.HandleRankMessage(t0_, s0_, Reg());
    job_.HandleRankMessage(t0_, s1_, Reg());
  }

  const absl::Time t0_ = absl::FromUnixSeconds(1000);
  SidecarOptions options_;
  FakeEffects effects_;
  FakeUpstream up_;
  SidecarJob job_;
  SidecarJob::SessionId s0_ = 0, s1_ = 0;
};

TEST_F(SidecarJobTest, AHelloIsWelcomedOnItsSessionAndAnnouncedUpstream) {
  StartTwoRanks();
  ASSERT_FALSE(effects_.replies[s0_].empty());
  EXPECT_TRUE(effects_.replies[s0_][0].has_welcome());
  EXPECT_EQ(effects_.replies[s0_][0].welcome().server_version(), SidecarJob::kServerVersion);
  ASSERT_GE(up_.sent.size(), 2u);
  EXPECT_TRUE(up_.sent[0].has_hello());
  EXPECT_TRUE(up_.sent[1].rank_event().joined());
  EXPECT_EQ(job_.ConnectedRanks(), (std::vector<int>{0, 1}));
  EXPECT_TRUE(job_.HadRank(1));
  EXPECT_FALSE(job_.HadRank(2));
}

TEST_F(SidecarJobTest, AMessageBeforeTheHelloIsRefusedAndEndsOnlyItsSession) {
  StartTwoRanks();
  const SidecarJob::SessionId s = job_.OpenSession();
  job_.HandleRankMessage(t0_, s, Reg());
  ASSERT_EQ(effects_.replies[s].size(), 1u);
  EXPECT_EQ(effects_.replies[s][0].error().kind(), v1::INVALID_REQUEST);
  ASSERT_EQ(effects_.closed.count(s), 1u);
  EXPECT_EQ(effects_.closed.count(s0_), 0u);
}

TEST_F(SidecarJobTest, OneNodeManifestGoesUpOnceEveryLocalRankSubmitted) {
  StartTwoRanks();
  job_.HandleRankMessage(t0_, s0_, Man(0));
  EXPECT_TRUE(up_.manifests().empty());
  job_.HandleRankMessage(t0_, s1_, Man(0));
  ASSERT_EQ(up_.manifests().size(), 1u);
  EXPECT_EQ(up_.manifests()[0].step(), 0);
  EXPECT_EQ(job_.stats().rank_manifests, 2);
  EXPECT_EQ(job_.stats().node_manifests_full, 1);
}

TEST_F(SidecarJobTest, TheCoordinatorsDecisionGoesToEverySession) {
  StartTwoRanks();
  job_.HandleRankMessage(t0_, s0_, Man(0));
  job_.HandleRankMessage(t0_, s1_, Man(0));
  v1::CoordinatorMessage m;
  v1::Decision* d = m.mutable_decisions()->add_decisions();
  d->set_group_id("g");
  d->set_step(0);
  d->mutable_ok();
  job_.HandleCoordinatorMessage(t0_, &m);
  ASSERT_EQ(effects_.decisions(s0_).size(), 1u);
  ASSERT_EQ(effects_.decisions(s1_).size(), 1u);
  EXPECT_EQ(effects_.decisions(s1_)[0].step(), 0);
  EXPECT_EQ(job_.stats().decisions_in, 1);
}

// Half the Welcome's deadline after a step's first rank, by the time passed
// in: reported upstream as partial, once; the timer was armed for it.
TEST_F(SidecarJobTest, APartialStepIsReportedAtHalfTheDeadlineByTheTimePassedIn) {
  StartTwoRanks();
  job_.HandleCoordinatorMessage(t0_, Welcome(2000));
  effects_.due = absl::InfiniteFuture();  // the Welcome's check ran
  const absl::Time t1 = t0_ + absl::Seconds(3);
  job_.HandleRankMessage(t1, s0_, Man(0));
  EXPECT_EQ(effects_.due, t1 + absl::Seconds(1));
  up_.sent.clear();
  EXPECT_EQ(job_.CheckTimers(t1 + absl::Milliseconds(999)), t1 + absl::Seconds(1));
  EXPECT_TRUE(up_.sent.empty());
  EXPECT_EQ(job_.CheckTimers(t1 + absl::Seconds(1)), absl::InfiniteFuture());
  ASSERT_EQ(up_.sent.size(), 1u);
  EXPECT_TRUE(up_.sent[0].progress().partial());
  EXPECT_EQ(up_.sent[0].progress().step(), 0);
  EXPECT_EQ(up_.sent[0].progress().waited_us(), 1000000);
  job_.CheckTimers(t1 + absl::Seconds(5));
  EXPECT_EQ(up_.sent.size(), 1u) << "reported once per stream";
}

class SidecarJobGraceTest : public SidecarJobTest {
 protected:
  static SidecarOptions WithGrace() {
    SidecarOptions o{"n0", "", 64};
    o.rank_reconnect_grace = absl::Seconds(2);
    return o;
  }
  SidecarJobGraceTest() : SidecarJobTest(WithGrace()) {}
};

// A rank that said it reconnects is detached when its stream ends; its
// leave goes upstream when its grace ends by the time passed in.
TEST_F(SidecarJobGraceTest, ADetachedRankLeavesWhenItsGraceEnds) {
  StartTwoRanks(/*reconnects=*/true);
  up_.sent.clear();
  const absl::Time t1 = t0_ + absl::Seconds(1);
  job_.CloseSession(t1, s1_);
  EXPECT_EQ(effects_.armed.back(), t1 + absl::Seconds(2));
  EXPECT_EQ(job_.ConnectedRanks(), std::vector<int>{0});
  EXPECT_TRUE(up_.sent.empty());
  EXPECT_EQ(job_.CheckTimers(t1 + absl::Seconds(1)), t1 + absl::Seconds(2));
  EXPECT_TRUE(up_.sent.empty());
  job_.CheckTimers(t1 + absl::Seconds(2));
  ASSERT_EQ(up_.sent.size(), 1u);
  EXPECT_FALSE(up_.sent[0].rank_event().joined());
  EXPECT_EQ(up_.sent[0].rank_event().rank(), 1);
}

class SidecarJobLossTest : public SidecarJobTest {
 protected:
  static SidecarOptions WithLossLimit() {
    SidecarOptions o{"n0", "", 64};
    o.upstream_loss_limit = absl::Seconds(10);
    return o;
  }
  SidecarJobLossTest() : SidecarJobTest(WithLossLimit()) {}
};

// No Welcome since the job's first rank: at the loss limit every rank gets
// UNAVAILABLE and its session ends.
TEST_F(SidecarJobLossTest, TheRanksAreFailedWhenTheNodeAboveStaysSilentPastTheLimit) {
  StartTwoRanks();
  EXPECT_EQ(effects_.armed.front(), t0_ + absl::Seconds(10));
  job_.CheckTimers(t0_ + absl::Seconds(9));
  EXPECT_TRUE(effects_.closed.empty());
  job_.CheckTimers(t0_ + absl::Seconds(10));
  ASSERT_EQ(effects_.closed.size(), 2u);
  EXPECT_EQ(effects_.closed[s0_].code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(effects_.replies[s1_].back().error().kind(), v1::UNAVAILABLE);
}

TEST_F(SidecarJobLossTest, AWelcomeStopsTheLossClock) {
  StartTwoRanks();
  job_.HandleCoordinatorMessage(t0_ + absl::Seconds(1), Welcome(0));
  job_.CheckTimers(t0_ + absl::Seconds(60));
  EXPECT_TRUE(effects_.closed.empty());
}

}  // namespace
}  // namespace accord::daemon
