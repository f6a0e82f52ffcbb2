// The Job engine with groups with members (docs/MEMBERS.md 2.7): a job of 6
// ranks on three nodes, a {0, 1}, b {2, 3}, c {4, 5}, shaped like two
// pipeline stages: member set A = ranks 0-2, B = ranks 3-5; node b serves
// both. Effects land in a FakeEffects; time is passed in.
#include <memory>
#include <string>
#include <vector>

#include "daemon/common/worker_pool.h"
#include "daemon/coordinator/job.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/wire.h"
#include "tests/daemon/fake_job_effects.h"
#include "tests/daemon/test_util.h"

namespace accord::daemon {
namespace {

using ::testing::ElementsAre;
using testing::FakeEffects;
using testing::FakeNodeSink;
using ::testing::HasSubstr;
using testing::Hello;
using testing::MakeSpec;
using testing::NodeManifest;
using testing::Registration;

constexpr int kWorld = 6;
constexpr auto kDeadline = absl::Seconds(30);
const absl::Time kStart = absl::UnixEpoch() + absl::Hours(1);

GroupSpec Spec(const std::string& id, std::vector<int> members) {
  GroupSpec spec = MakeSpec(id, 2);
  absl::StatusOr<MemberSet> m = MemberSet::FromRanks(std::move(members), kWorld);
  EXPECT_TRUE(m.ok()) << m.status();
  spec.members = std::make_shared<const MemberSet>(*std::move(m));
  return spec;
}

class JobMembersTest : public ::testing::Test {
 protected:
  JobMembersTest() : pool_(1), job_("job", "run1", kWorld, Options(), nullptr, &pool_) {
    Job::StreamId replaced = 0;
    a_ = &job_.Connect(1, &sink_a_, Hello("job", "a", kWorld, {0, 1}).hello(), {0, 1}, fx_,
                       &replaced);
    b_ = &job_.Connect(2, &sink_b_, Hello("job", "b", kWorld, {2, 3}).hello(), {2, 3}, fx_,
                       &replaced);
    c_ = &job_.Connect(3, &sink_c_, Hello("job", "c", kWorld, {4, 5}).hello(), {4, 5}, fx_,
                       &replaced);
  }
  static const CoordinatorOptions& Options() {
    static const CoordinatorOptions* options = [] {
      auto* o = new CoordinatorOptions;
      o->deadline = kDeadline;
      o->start_timer_thread = false;
      return o;
    }();
    return *options;
  }
  void Register(NodeStream* node, const GroupSpec& spec, std::vector<int> ranks) {
    job_.HandleRegistration(*node, Registration(spec, std::move(ranks)).registration(), kStart,
                            fx_);
  }
  // The registration results sent to `sink` since the last Clear.
  std::vector<v1::RegistrationResult> ResultsTo(const FakeNodeSink* sink) const {
    std::vector<v1::RegistrationResult> out;
    for (const auto& [s, m] : fx_.sent) {
      if (s == sink && m.has_registration()) out.push_back(m.registration());
    }
    return out;
  }
  void Clear() { fx_ = FakeEffects(); }
  // A node manifest without rank_bits (the node's member ranks of the group).
  void Submit(NodeStream* node, const std::string& group, int64_t step) {
    v1::ManifestBatch batch;
    *batch.add_manifests() =
        NodeManifest(group, step, {DType::kFloat32, std::nullopt}, kWorld, node->node->ranks);
    job_.HandleManifests(*node, batch, nullptr, kStart, fx_);
  }
  void Leave(NodeStream* node, int rank) {
    v1::RankEvent left;
    left.set_rank(rank);
    left.set_joined(false);
    left.set_last_step(-1);
    job_.HandleRankEvent(*node, left, fx_);
  }
  // Both stages registered: A by nodes a and b, B by nodes b and c.
  void RegisterStages() {
    Register(a_, kA, {0, 1});
    Register(b_, kA, {2});
    Register(b_, kB, {3});
    Register(c_, kB, {4, 5});
    Clear();
  }

  const GroupSpec kA = Spec("g@ranks0..2", {0, 1, 2});
  const GroupSpec kB = Spec("g@ranks3..5", {3, 4, 5});

  WorkerPool pool_;
  Job job_;
  FakeNodeSink sink_a_;
  FakeNodeSink sink_b_;
  FakeNodeSink sink_c_;
  FakeEffects fx_;
  NodeStream* a_ = nullptr;
  NodeStream* b_ = nullptr;
  NodeStream* c_ = nullptr;
};

TEST_F(JobMembersTest, TheWelcomeSaysTheCoordinatorTakesMembers) {
  ASSERT_FALSE(fx_.sent.empty());
  ASSERT_TRUE(fx_.sent[0].second.has_welcome());
  EXPECT_TRUE(fx_.sent[0].second.welcome().members());
}

// Each stage's group completes with its own members; its result goes to the
// nodes serving them, never to a node without a member, and never waits for
// the other stage.
TEST_F(JobMembersTest, ARegistrationCompletesWithItsMembersAndIsAnsweredToTheirNodesOnly) {
  Clear();
  const GroupSpec a = Spec("g@ranks0..2", {0, 1, 2});
  Register(a_, a, {0, 1});
  EXPECT_TRUE(ResultsTo(&sink_a_).empty());
  Register(b_, a, {2});
  EXPECT_TRUE(fx_.broadcasts.empty());
  ASSERT_EQ(ResultsTo(&sink_a_).size(), 1u);
  ASSERT_EQ(ResultsTo(&sink_b_).size(), 1u);
  EXPECT_TRUE(ResultsTo(&sink_c_).empty());
  EXPECT_EQ(ResultsTo(&sink_a_)[0].spec_fingerprint(), SpecFingerprint(a));
  EXPECT_FALSE(ResultsTo(&sink_a_)[0].has_error());
  Clear();
  const GroupSpec b = Spec("g@ranks3..5", {3, 4, 5});
  Register(c_, b, {4, 5});
  Register(b_, b, {3});
  EXPECT_TRUE(ResultsTo(&sink_a_).empty());
  EXPECT_EQ(ResultsTo(&sink_b_).size(), 1u);
  EXPECT_EQ(ResultsTo(&sink_c_).size(), 1u);
  EXPECT_TRUE(fx_.errors.empty());
}

TEST_F(JobMembersTest, ARankRegisteringAGroupItIsNotAMemberOfIsRefusedToItsNode) {
  Clear();
  Register(b_, Spec("g@ranks3..5", {3, 4, 5}), {2, 3});
  const std::vector<v1::RegistrationResult> results = ResultsTo(&sink_b_);
  ASSERT_EQ(results.size(), 1u);
  const v1::DecisionError& e = results[0].error();
  EXPECT_EQ(e.kind(), v1::INVALID_REQUEST);
  EXPECT_THAT(e.message(), HasSubstr("rank 2 is not among the members it registered (ranks 3-5)"));
  EXPECT_THAT(e.ranks(), ElementsAre(2, 3));
  EXPECT_FALSE(job_.core().failed());
}

TEST_F(JobMembersTest, TwoMemberSetsUnderOneIdFailTheGroupToTheNodesOfBoth) {
  Clear();
  Register(a_, Spec("g", {0, 1, 2}), {0, 1});
  Register(c_, Spec("g", {3, 4, 5}), {4, 5});
  for (const FakeNodeSink* sink : {&sink_a_, &sink_b_, &sink_c_}) {
    ASSERT_EQ(ResultsTo(sink).size(), 1u);
    EXPECT_EQ(ResultsTo(sink)[0].error().kind(), v1::REGISTRATION_MISMATCH);
    EXPECT_THAT(ResultsTo(sink)[0].error().message(),
                HasSubstr("rank 0 registered it with members ranks 0-2, rank 4 with members "
                          "ranks 3-5"));
  }
  ASSERT_EQ(fx_.errors.size(), 1u);
}

// The registration deadline names the members that did not register, not
// the ranks of the other stage, which never register this group.
TEST_F(JobMembersTest, TheRegistrationDeadlineNamesOnlyMissingMembers) {
  Register(a_, Spec("g@ranks0..2", {0, 1, 2}), {0, 1});
  Clear();
  job_.CheckDeadlines(kStart + kDeadline, fx_);
  ASSERT_TRUE(job_.core().failed());
  const v1::DecisionError& e = job_.core().failure;
  EXPECT_EQ(e.kind(), v1::MISSING_RANKS);
  EXPECT_THAT(e.ranks(), ElementsAre(2));
  EXPECT_THAT(e.message(), HasSubstr("not every member (ranks 0-2) registered the group"));
  EXPECT_THAT(e.message(), HasSubstr("missing ranks 2: rank 2 (node \"b\", connected)"));
  EXPECT_THAT(e.message(), HasSubstr("ranks 0-1 registered it"));
}

// Node b's manifest without rank_bits stands for rank 2 in stage A (and
// rank 3 in B): each stage completes with its own members and decides over
// them.
TEST_F(JobMembersTest, AStepCompletesWhenItsMembersSubmittedAndIsDecidedOverThem) {
  RegisterStages();
  Submit(a_, kA.group_id, 0);
  EXPECT_EQ(fx_.decisions.decisions_size(), 0);
  Submit(b_, kA.group_id, 0);
  ASSERT_EQ(fx_.decisions.decisions_size(), 1);
  const v1::Decision& d = fx_.decisions.decisions(0);
  EXPECT_EQ(d.group_id(), kA.group_id);
  ASSERT_TRUE(d.has_ok()) << d.ShortDebugString();
  absl::StatusOr<Decision> core = wire::DecisionFromProto(0, d.ok(), 2);
  ASSERT_TRUE(core.ok()) << core.status();
  EXPECT_EQ(core->layout_fingerprint, LayoutFingerprint(kA, 3, core->included, core->wire_dtype));
  Clear();
  Submit(c_, kB.group_id, 0);
  Submit(b_, kB.group_id, 0);
  ASSERT_EQ(fx_.decisions.decisions_size(), 1);
  EXPECT_TRUE(fx_.decisions.decisions(0).has_ok());
  EXPECT_FALSE(job_.core().failed());
}

TEST_F(JobMembersTest, ASilentMemberIsNamedAndNoRankOfTheOtherStage) {
  RegisterStages();
  Submit(a_, kA.group_id, 0);
  Submit(c_, kB.group_id, 0);
  job_.CheckDeadlines(kStart + kDeadline + absl::Seconds(2), fx_);
  ASSERT_TRUE(job_.core().failed());
  const v1::DecisionError& e = job_.core().failure;
  EXPECT_EQ(e.kind(), v1::MISSING_RANKS);
  EXPECT_THAT(e.ranks(), ElementsAre(2));
  EXPECT_THAT(e.message(), HasSubstr("ranks 0-1 submitted it"));
  EXPECT_TRUE(e.job_failed());
}

// A rank of stage B leaving fails nothing of stage A; a member leaving does.
TEST_F(JobMembersTest, ALeaveFailsOnlyTheStepsOfItsMemberSets) {
  RegisterStages();
  Submit(a_, kA.group_id, 0);
  Leave(c_, 4);
  EXPECT_FALSE(job_.core().failed());
  // A step of A that starts after rank 4 left does not wait for it either.
  Submit(a_, kA.group_id, 1);
  EXPECT_FALSE(job_.core().failed());
  Submit(b_, kA.group_id, 0);
  ASSERT_GE(fx_.decisions.decisions_size(), 1);
  EXPECT_TRUE(fx_.decisions.decisions(0).has_ok());
  Leave(b_, 2);
  ASSERT_TRUE(job_.core().failed());
  EXPECT_THAT(job_.core().failure.ranks(), ElementsAre(2));
  EXPECT_THAT(job_.core().failure.message(), HasSubstr("rank 2 left"));
}

// The step of B that starts after rank 4 left fails at once, named by it.
TEST_F(JobMembersTest, AStepStartingAfterAMemberLeftFailsAtOnce) {
  RegisterStages();
  Leave(c_, 4);
  Submit(b_, kB.group_id, 0);
  ASSERT_TRUE(job_.core().failed());
  EXPECT_THAT(job_.core().failure.ranks(), ElementsAre(4));
}

TEST_F(JobMembersTest, ANodeLostPastItsGraceFailsOnlyStepsThatNeedItsMembers) {
  RegisterStages();
  Submit(a_, kA.group_id, 0);
  job_.Disconnect(*c_, kStart, fx_);
  job_.CheckDeadlines(kStart + Options().node_reconnect_grace + absl::Seconds(1), fx_);
  EXPECT_FALSE(job_.core().failed());
  Submit(b_, kB.group_id, 0);
  job_.CheckDeadlines(kStart + Options().node_reconnect_grace + absl::Seconds(2), fx_);
  ASSERT_TRUE(job_.core().failed());
  EXPECT_THAT(job_.core().failure.message(), HasSubstr("node \"c\""));
}

// A manifest naming a rank outside the group's members is refused.
TEST_F(JobMembersTest, RankBitsOutsideTheMembersAreAnInvalidManifest) {
  RegisterStages();
  v1::ManifestBatch batch;
  *batch.add_manifests() =
      NodeManifest(kA.group_id, 0, {DType::kFloat32, std::nullopt}, kWorld, {2, 3}, {2, 3});
  job_.HandleManifests(*b_, batch, nullptr, kStart, fx_);
  ASSERT_EQ(fx_.replies[&sink_b_].decisions_size(), 1);
  EXPECT_EQ(fx_.replies[&sink_b_].decisions(0).error().kind(), v1::INVALID_MANIFEST);
  EXPECT_THAT(fx_.replies[&sink_b_].decisions(0).error().message(),
              HasSubstr("rank_bits name ranks 3 that node \"b\" does not serve among the group's "
                        "members"));
}

// Stage A's silent member fails the job; every node gets the verdict after
// the answers to the steps, so stage B's ranks, which wait for nothing,
// learn it too.
TEST_F(JobMembersTest, TheJobsFailureGoesToEveryNodeAfterTheAnswersToItsSteps) {
  RegisterStages();
  Submit(a_, kA.group_id, 0);
  job_.CheckDeadlines(kStart + kDeadline + absl::Seconds(2), fx_);
  ASSERT_TRUE(job_.core().failed());
  ASSERT_EQ(fx_.decisions.decisions_size(), 1);
  EXPECT_EQ(fx_.decisions.decisions(0).error().kind(), v1::MISSING_RANKS);
  ASSERT_EQ(fx_.last_broadcasts.size(), 1u);
  const v1::DecisionError& verdict = fx_.last_broadcasts[0].error();
  EXPECT_TRUE(verdict.job_failed());
  EXPECT_EQ(verdict.kind(), v1::JOB_FAILED);
  EXPECT_EQ(verdict.message(), job_.core().failure.message());
  EXPECT_EQ(verdict.code(), job_.core().failure.code());
  EXPECT_THAT(verdict.ranks(), ElementsAre(2));
  ASSERT_EQ(fx_.errors.size(), 1u);  // counted once
}

}  // namespace
}  // namespace accord::daemon
