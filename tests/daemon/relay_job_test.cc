// RelayJob alone: no lock, no thread, no gRPC, no clock. The test passes
// the time in and records the effects (messages per sidecar session, the
// timer's due times) and what goes upstream.
#include "daemon/relay/relay_job.h"

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/group.h"
#include "core/manifest.h"
#include "gtest/gtest.h"
#include "proto/wire.h"
#include "tests/daemon/fake_sinks.h"

namespace accord::daemon {
namespace {

class FakeEffects : public RelayEffects {
 public:
  void SendToSession(SessionId session,
                     std::shared_ptr<const v1::CoordinatorMessage> message) override {
    messages[session].push_back(*message);
  }
  void ArmTimer(absl::Time at) override { armed.push_back(at); }
  bool TimerArmed() const override { return !armed.empty(); }

  std::map<SessionId, std::vector<v1::CoordinatorMessage>> messages;
  std::vector<absl::Time> armed;
};

using testing::FakeUpstream;

constexpr int kWorld = 4;

GroupSpec Spec() { return GroupSpec{"g", {ParamSpec{"a", 8, 64}, ParamSpec{"b", 8, 64}}}; }

v1::NodeMessage Hello(const std::string& node, const std::vector<int>& ranks) {
  v1::NodeMessage m;
  m.mutable_hello()->set_job_id("j");
  m.mutable_hello()->set_node_id(node);
  m.mutable_hello()->set_world_size(kWorld);
  m.mutable_hello()->set_answers_progress(true);
  m.mutable_hello()->set_run_start(v1::NodeHello::RUN_START_NEW);
  m.mutable_hello()->set_node_epoch(7);
  for (int r : ranks) m.mutable_hello()->add_ranks(r);
  return m;
}

v1::NodeMessage Registration(const std::vector<int>& ranks) {
  v1::NodeMessage m;
  *m.mutable_registration()->mutable_registration() = wire::GroupSpecToProto(Spec(), Policy());
  for (int r : ranks) m.mutable_registration()->add_ranks(r);
  return m;
}

v1::NodeMessage Manifests(int64_t step, const std::vector<int>& ranks) {
  Manifest m;
  m.step = step;
  m.ranks = RankSet(kWorld);
  for (int r : ranks) m.ranks.Add(r);
  m.dtypes = {MaskOf(DType::kFloat32), MaskOf(DType::kFloat32)};
  v1::NodeMessage out;
  wire::ManifestToProto("g", m, /*with_ranks=*/false, out.mutable_manifests()->add_manifests());
  return out;
}

v1::CoordinatorMessage Welcome(int64_t deadline_ms) {
  v1::CoordinatorMessage w;
  w.mutable_welcome()->set_deadline_ms(deadline_ms);
  w.mutable_welcome()->set_run_id("run1");
  return w;
}

RelayOptions Options() {
  RelayOptions o;
  o.relay_id = "relay0";
  o.node_reconnect_grace = absl::Seconds(10);
  o.upstream_loss_limit = absl::Seconds(30);
  return o;
}

// Two sidecars, node0 (ranks 0, 1) and node1 (ranks 2, 3), both registered
// to "g"; the coordinator's Welcome says a deadline of 2 s.
class RelayJobTest : public ::testing::Test {
 protected:
  RelayJobTest() : options_(Options()), job_(options_, effects_) {
    job_.SetUpstream(&up_);
    job_.OnUpstreamConnected(t0_);
    a_ = job_.OpenSession();
    b_ = job_.OpenSession();
    job_.HandleMessage(t0_, a_, Hello("node0", {0, 1}));
    job_.HandleMessage(t0_, b_, Hello("node1", {2, 3}));
    v1::CoordinatorMessage w = Welcome(2000);
    job_.HandleCoordinatorMessage(&w);
    job_.HandleMessage(t0_, a_, Registration({0, 1}));
    job_.HandleMessage(t0_, b_, Registration({2, 3}));
  }

  const absl::Time t0_ = absl::FromUnixSeconds(1000);
  RelayOptions options_;
  FakeEffects effects_;
  FakeUpstream up_;
  RelayJob job_;
  RelayJob::SessionId a_ = 0, b_ = 0;
};

TEST_F(RelayJobTest, EachSidecarIsWelcomedOnItsSessionOnceTheCoordinatorWelcomedTheRelay) {
  for (RelayJob::SessionId s : {a_, b_}) {
    ASSERT_EQ(effects_.messages[s].size(), 1u);
    EXPECT_EQ(effects_.messages[s][0].welcome().run_id(), "run1");
    EXPECT_EQ(effects_.messages[s][0].welcome().deadline_ms(), 2000);
  }
  EXPECT_EQ(job_.stats().nodes, 2);
  EXPECT_EQ(job_.CurrentRun("j"), "run1");
  EXPECT_EQ(job_.CurrentRun("other"), std::nullopt);
}

TEST_F(RelayJobTest, AMessageBeforeTheHelloIsRefusedOnItsSession) {
  const RelayJob::SessionId s = job_.OpenSession();
  job_.HandleMessage(t0_, s, Registration({0}));
  ASSERT_EQ(effects_.messages[s].size(), 1u);
  EXPECT_EQ(effects_.messages[s][0].error().kind(), v1::INVALID_REQUEST);
}

TEST_F(RelayJobTest, OneMergedManifestGoesUpOnceEverySidecarContributedAndTheDecisionFansOut) {
  job_.HandleMessage(t0_, a_, Manifests(0, {0, 1}));
  EXPECT_TRUE(up_.manifests().empty());
  job_.HandleMessage(t0_, b_, Manifests(0, {2, 3}));
  ASSERT_EQ(up_.manifests().size(), 1u);
  EXPECT_EQ(up_.manifests()[0].step(), 0);
  EXPECT_TRUE(up_.manifests()[0].rank_bits().empty()) << "covers every announced rank";
  v1::CoordinatorMessage m;
  v1::Decision* d = m.mutable_decisions()->add_decisions();
  d->set_group_id("g");
  d->set_step(0);
  d->mutable_ok()->set_wire_dtype(v1::FLOAT32);
  job_.HandleCoordinatorMessage(&m);
  for (RelayJob::SessionId s : {a_, b_}) {
    ASSERT_EQ(effects_.messages[s].size(), 2u);
    EXPECT_EQ(effects_.messages[s][1].decisions().decisions(0).step(), 0);
  }
  EXPECT_EQ(job_.stats().decision_batches, 1);
}

// Half the deadline after the first contribution, by the time passed in:
// the step goes up as partial with the ranks that contributed.
TEST_F(RelayJobTest, APartialStepIsReportedAtHalfTheDeadlineByTheTimePassedIn) {
  const absl::Time t1 = t0_ + absl::Seconds(5);
  job_.HandleMessage(t1, a_, Manifests(0, {0, 1}));
  EXPECT_EQ(effects_.armed.back(), t1 + absl::Seconds(1));
  up_.sent.clear();
  EXPECT_EQ(job_.CheckTimers(t1 + absl::Milliseconds(999)), t1 + absl::Seconds(1));
  EXPECT_TRUE(up_.sent.empty());
  job_.CheckTimers(t1 + absl::Seconds(1));
  ASSERT_EQ(up_.sent.size(), 1u);
  const v1::NodeProgress& p = up_.sent[0].progress();
  EXPECT_TRUE(p.partial());
  EXPECT_EQ(p.step(), 0);
  EXPECT_EQ(std::vector<int>(p.reported().begin(), p.reported().end()), (std::vector<int>{0, 1}));
}

// A sidecar whose stream ended keeps its place for the grace; past it, by
// the time passed in, its ranks go up as leaves.
TEST_F(RelayJobTest, ASidecarPastItsGraceHasItsRanksReportedAsLeft) {
  const absl::Time t1 = t0_ + absl::Seconds(1);
  job_.CloseSession(t1, b_);
  EXPECT_EQ(effects_.armed.back(), t1 + absl::Seconds(10));
  up_.sent.clear();
  EXPECT_EQ(job_.CheckTimers(t1 + absl::Seconds(9)), t1 + absl::Seconds(10));
  EXPECT_TRUE(up_.sent.empty());
  job_.CheckTimers(t1 + absl::Seconds(10));
  std::vector<int> left;
  for (const v1::NodeMessage& m : up_.sent) {
    if (m.has_rank_event() && !m.rank_event().joined()) left.push_back(m.rank_event().rank());
  }
  EXPECT_EQ(left, (std::vector<int>{2, 3}));
  EXPECT_EQ(job_.stats().nodes, 1);
}

// A new upstream stream that is never welcomed: past the loss limit every
// sidecar gets one UNAVAILABLE error.
TEST_F(RelayJobTest, TheSidecarsAreToldWhenTheCoordinatorStaysSilentPastTheLimit) {
  const absl::Time t1 = t0_ + absl::Seconds(2);
  job_.OnUpstreamConnected(t1);
  EXPECT_EQ(effects_.armed.back(), t1 + absl::Seconds(30));
  job_.CheckTimers(t1 + absl::Seconds(29));
  EXPECT_EQ(effects_.messages[a_].size(), 1u);
  job_.CheckTimers(t1 + absl::Seconds(30));
  for (RelayJob::SessionId s : {a_, b_}) {
    ASSERT_EQ(effects_.messages[s].size(), 2u);
    EXPECT_EQ(effects_.messages[s][1].error().kind(), v1::UNAVAILABLE);
  }
}

}  // namespace
}  // namespace accord::daemon
