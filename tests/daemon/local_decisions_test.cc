// Local decisions (docs/ARCHITECTURE.md, "Local decisions"): a sidecar that
// holds every rank of its job answers complete steps itself, still sends the
// node manifest upstream, and compares the coordinator's decision with its own.
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/decide.h"
#include "daemon/sidecar/sidecar.h"
#include "gtest/gtest.h"
#include "proto/wire.h"
#include "tests/daemon/fake_sinks.h"

namespace accord::daemon {
namespace {

using testing::FakeRankSink;
using testing::FakeUpstream;

// Manifests sent upstream, a batch repeat counting as one.
int SentManifests(const FakeUpstream& up) {
  int n = 0;
  for (const auto& m : up.sent) {
    n += m.manifests().manifests_size() +
         (m.has_manifests() && m.manifests().repeat_batch_key() != 0);
  }
  return n;
}

const GroupSpec kSpec{"g", {ParamSpec{"a", 8, 64}, ParamSpec{"b", 8, 32}, ParamSpec{"c", 8, 16}}};

v1::RankMessage Hello(int rank, int world) {
  v1::RankMessage m;
  m.mutable_hello()->set_job_id("j");
  m.mutable_hello()->set_rank(rank);
  m.mutable_hello()->set_world_size(world);
  return m;
}

v1::RankMessage Man(int64_t step, int rank, int world, std::vector<std::optional<DType>> d) {
  v1::RankMessage m;
  wire::ManifestToProto("g", RankManifest(step, rank, world, d), false,
                        m.mutable_manifests()->add_manifests());
  return m;
}

// What the coordinator decides for the merged manifest (the same function).
v1::DecisionOk Expected(int world, int64_t step, std::vector<DTypeMask> merged) {
  Manifest m;
  m.step = step;
  m.dtypes = std::move(merged);
  m.ranks = RankSet(world);
  for (int r = 0; r < world; ++r) m.ranks.Add(r);
  absl::StatusOr<Decision> d = Decide(kSpec, world, m, Policy());
  EXPECT_TRUE(d.ok()) << d.status();
  v1::DecisionOk ok;
  wire::DecisionToProto(*d, &ok);
  return ok;
}

v1::CoordinatorMessage CoordinatorDecision(int64_t step, std::optional<v1::DecisionOk> ok) {
  v1::CoordinatorMessage c;
  v1::Decision* d = c.mutable_decisions()->add_decisions();
  d->set_group_id("g");
  d->set_step(step);
  if (ok.has_value()) {
    *d->mutable_ok() = *ok;
  } else {
    d->set_same_as_previous(true);
  }
  return c;
}

// `world` ranks, `local` of them on this node, registered and welcomed.
class LocalDecisionsTest : public ::testing::Test {
 protected:
  void Start(int world, int local, SidecarOptions o = SidecarOptions{"n0", "", 64}) {
    o.start_timer_thread = false;
    sidecar_ = std::make_unique<Sidecar>(o);
    sidecar_->SetUpstream(&up_);
    sinks_.resize(local);
    for (int r = 0; r < local; ++r) {
      sessions_.push_back(sidecar_->OpenRank(&sinks_[r]));
      sidecar_->HandleRankMessage(sessions_[r], Hello(r, world));
    }
    v1::CoordinatorMessage welcome;
    welcome.mutable_welcome()->set_run_id("run-1");
    sidecar_->HandleCoordinatorMessage(welcome);
    for (int r = 0; r < local; ++r) {
      v1::RankMessage reg;
      *reg.mutable_registration() = wire::GroupSpecToProto(kSpec, Policy());
      sidecar_->HandleRankMessage(sessions_[r], reg);
    }
    v1::CoordinatorMessage result;
    result.mutable_registration()->set_group_id("g");
    sidecar_->HandleCoordinatorMessage(result);
    world_ = world;
  }
  // Every local rank submits `step`: rank 0 has a bf16 gradient for a, the
  // others for a and b; c is used nowhere.
  void Submit(int64_t step) {
    for (int r = 0; r < static_cast<int>(sessions_.size()); ++r) {
      std::vector<std::optional<DType>> d = {DType::kBFloat16, std::nullopt, std::nullopt};
      if (r > 0) d[1] = DType::kFloat32;
      sidecar_->HandleRankMessage(sessions_[r], Man(step, r, world_, d));
    }
  }
  v1::DecisionOk Ours(int64_t step) {
    return Expected(world_, step, {MaskOf(DType::kBFloat16), MaskOf(DType::kFloat32), 0});
  }

  std::unique_ptr<Sidecar> sidecar_;
  FakeUpstream up_;
  std::vector<FakeRankSink> sinks_;
  std::vector<Sidecar::SessionId> sessions_;
  int world_ = 0;
};

TEST_F(LocalDecisionsTest, EveryRankHereIsAnsweredAtOnceAndTheCoordinatorStillGetsTheManifest) {
  Start(2, 2);
  Submit(0);
  for (const FakeRankSink& s : sinks_) {
    ASSERT_EQ(s.decisions().size(), 1u);
    const v1::Decision d = s.decisions()[0];
    EXPECT_EQ(d.step(), 0);
    ASSERT_TRUE(d.has_ok()) << d.DebugString();
    EXPECT_EQ(d.ok().SerializeAsString(), Ours(0).SerializeAsString());
  }
  EXPECT_EQ(SentManifests(up_), 1) << "the node manifest still goes to the coordinator";
  EXPECT_EQ(sidecar_->stats().local_decisions, 1);

  // The coordinator's decision confirms it: nothing more reaches the ranks.
  sidecar_->HandleCoordinatorMessage(CoordinatorDecision(0, Ours(0)));
  EXPECT_EQ(sinks_[0].decisions().size(), 1u);
  EXPECT_EQ(sidecar_->stats().local_confirmed, 1);

  // The same content next step: `same_as_previous`, confirmed by the
  // coordinator's own `same_as_previous`.
  Submit(1);
  ASSERT_EQ(sinks_[1].decisions().size(), 2u);
  EXPECT_TRUE(sinks_[1].decisions()[1].same_as_previous());
  sidecar_->HandleCoordinatorMessage(CoordinatorDecision(1, std::nullopt));
  EXPECT_EQ(sidecar_->stats().local_confirmed, 2);
  EXPECT_EQ(sidecar_->stats().local_mismatches, 0);
  EXPECT_FALSE(sinks_[0].closed.has_value());
}

TEST_F(LocalDecisionsTest, ACoordinatorDecisionThatDiffersFailsTheJobOnEveryRank) {
  Start(2, 2);
  Submit(0);
  v1::DecisionOk other = Ours(0);
  other.set_wire_dtype(v1::FLOAT64);
  sidecar_->HandleCoordinatorMessage(CoordinatorDecision(0, other));
  EXPECT_EQ(sidecar_->stats().local_mismatches, 1);
  for (const FakeRankSink& s : sinks_) {
    ASSERT_TRUE(s.closed.has_value());
    EXPECT_EQ(s.closed->code(), absl::StatusCode::kInternal);
    ASSERT_TRUE(s.replies.back().has_error());
    EXPECT_EQ(s.replies.back().error().kind(), v1::JOB_FAILED);
    EXPECT_EQ(s.replies.back().error().message(),
              "job j group \"g\" step 0: node \"n0\" decided the step locally "
              "(--local_decisions) but the coordinator decided otherwise; the ranks may have "
              "reduced differently, so the job is failed. Report this as a bug, and run the "
              "sidecar with --local_decisions=false meanwhile");
  }
}

TEST_F(LocalDecisionsTest, ACoordinatorErrorForALocallyDecidedStepReachesEveryRank) {
  Start(2, 2);
  Submit(0);
  v1::CoordinatorMessage c;
  v1::Decision* d = c.mutable_decisions()->add_decisions();
  d->set_group_id("g");
  d->set_step(0);
  d->mutable_error()->set_kind(v1::RUN_ENDED);
  d->mutable_error()->set_code(static_cast<int>(absl::StatusCode::kFailedPrecondition));
  d->mutable_error()->set_message("run ended");
  sidecar_->HandleCoordinatorMessage(c);
  for (const FakeRankSink& s : sinks_) {
    ASSERT_TRUE(s.closed.has_value());
    EXPECT_EQ(s.replies.back().error().kind(), v1::RUN_ENDED);
    EXPECT_EQ(s.replies.back().error().message(), "run ended");
  }
}

TEST_F(LocalDecisionsTest, RanksOnOtherNodesMeanTheCoordinatorDecides) {
  Start(4, 2);
  Submit(0);
  EXPECT_TRUE(sinks_[0].decisions().empty());
  EXPECT_EQ(sidecar_->stats().local_decisions, 0);
  const v1::DecisionOk ok = Expected(4, 0, {MaskOf(DType::kBFloat16), MaskOf(DType::kFloat32), 0});
  sidecar_->HandleCoordinatorMessage(CoordinatorDecision(0, ok));
  ASSERT_EQ(sinks_[0].decisions().size(), 1u);
  EXPECT_EQ(sinks_[0].decisions()[0].ok().SerializeAsString(), ok.SerializeAsString());
}

TEST_F(LocalDecisionsTest, TurnedOffTheCoordinatorDecides) {
  SidecarOptions o{"n0", "", 64};
  o.local_decisions = false;
  Start(2, 2, o);
  Submit(0);
  EXPECT_TRUE(sinks_[0].decisions().empty());
  sidecar_->HandleCoordinatorMessage(CoordinatorDecision(0, Ours(0)));
  EXPECT_EQ(sinks_[0].decisions().size(), 1u);
}

// With the coordinator silent, at most --local_decision_lag steps per group
// are decided here; later ones wait for the coordinator, and every locally
// decided step stays queued for resending until it is confirmed.
TEST_F(LocalDecisionsTest, AtMostLagStepsRunAheadOfTheCoordinator) {
  SidecarOptions o{"n0", "", 64};
  o.local_decision_lag = 2;
  Start(2, 2, o);
  Submit(0);
  Submit(1);
  Submit(2);
  ASSERT_EQ(sinks_[0].decisions().size(), 2u);
  EXPECT_EQ(sidecar_->stats().local_decisions, 2);
  // A reconnect resends all three (none confirmed yet).
  sidecar_->OnUpstreamConnected();
  int resent = 0;
  for (const auto& m : up_.reset) resent += m.manifests().manifests_size();
  EXPECT_EQ(resent, 3);
  // Confirmations for 0 and 1, then the coordinator's decision for 2 is
  // delivered as usual.
  sidecar_->HandleCoordinatorMessage(CoordinatorDecision(0, Ours(0)));
  sidecar_->HandleCoordinatorMessage(CoordinatorDecision(1, std::nullopt));
  EXPECT_EQ(sinks_[0].decisions().size(), 2u);
  sidecar_->HandleCoordinatorMessage(CoordinatorDecision(2, std::nullopt));
  ASSERT_EQ(sinks_[0].decisions().size(), 3u);
  EXPECT_EQ(sinks_[0].decisions()[2].step(), 2);
  EXPECT_EQ(sidecar_->stats().local_confirmed, 2);
  // Decided here again once the coordinator caught up.
  Submit(3);
  ASSERT_EQ(sinks_[0].decisions().size(), 4u);
  EXPECT_EQ(sidecar_->stats().local_decisions, 3);
}

// docs/MEMBERS.md 2.5: a group is decided here when every one of its
// members is here, even when other ranks of the job are not. Ranks 0 and 1
// of 4 here; g's members {0, 1} are all here, h's {1, 2} are not.
TEST(LocalDecisionsMembersTest, AGroupIsDecidedHereWhenEveryMemberIsHere) {
  SidecarOptions o{"n0", "", 64};
  o.start_timer_thread = false;
  Sidecar sidecar(o);
  FakeUpstream up;
  sidecar.SetUpstream(&up);
  std::vector<FakeRankSink> sinks(2);
  std::vector<Sidecar::SessionId> sessions;
  for (int r = 0; r < 2; ++r) {
    sessions.push_back(sidecar.OpenRank(&sinks[r]));
    sidecar.HandleRankMessage(sessions[r], Hello(r, 4));
  }
  v1::CoordinatorMessage welcome;
  welcome.mutable_welcome()->set_run_id("run-1");
  welcome.mutable_welcome()->set_members(true);
  sidecar.HandleCoordinatorMessage(welcome);
  auto with_members = [](const std::string& id, std::vector<int> ranks) {
    GroupSpec spec = kSpec;
    spec.group_id = id;
    spec.members = std::make_shared<const MemberSet>(*MemberSet::FromRanks(std::move(ranks), 4));
    return spec;
  };
  const GroupSpec g = with_members("g@m", {0, 1});
  const GroupSpec h = with_members("h@m", {1, 2});
  auto reg = [&](int r, const GroupSpec& spec) {
    v1::RankMessage m;
    *m.mutable_registration() = wire::GroupSpecToProto(spec, Policy());
    sidecar.HandleRankMessage(sessions[r], m);
    v1::CoordinatorMessage result;
    result.mutable_registration()->set_group_id(spec.group_id);
    sidecar.HandleCoordinatorMessage(result);
  };
  reg(0, g);
  reg(1, g);
  reg(1, h);
  auto man = [&](const std::string& id, int r) {
    v1::RankMessage m;
    wire::ManifestToProto(id, RankManifest(0, r, 4, {DType::kBFloat16, std::nullopt, std::nullopt}),
                          false, m.mutable_manifests()->add_manifests());
    sidecar.HandleRankMessage(sessions[r], m);
  };
  man("g@m", 0);
  man("g@m", 1);
  man("h@m", 1);
  EXPECT_EQ(sidecar.stats().local_decisions, 1) << "g only";
  Manifest merged;
  merged.step = 0;
  merged.dtypes = {MaskOf(DType::kBFloat16), 0, 0};
  merged.ranks = RankSet(4);
  merged.ranks.Add(0);
  merged.ranks.Add(1);
  absl::StatusOr<Decision> expected = Decide(g, 4, merged, Policy());
  ASSERT_TRUE(expected.ok()) << expected.status();
  v1::DecisionOk ok;
  wire::DecisionToProto(*expected, &ok);
  for (const FakeRankSink& s : sinks) {
    ASSERT_EQ(s.decisions().size(), 1u);
    EXPECT_EQ(s.decisions()[0].group_id(), "g@m");
    EXPECT_TRUE(s.decisions()[0].local());
    EXPECT_EQ(s.decisions()[0].ok().SerializeAsString(), ok.SerializeAsString());
  }
  EXPECT_EQ(SentManifests(up), 2) << "both node manifests still go to the coordinator";
}

}  // namespace
}  // namespace accord::daemon
