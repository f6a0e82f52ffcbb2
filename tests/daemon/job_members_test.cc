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

}  // namespace
}  // namespace accord::daemon
