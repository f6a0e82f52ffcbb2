#include "daemon/coordinator/group_agreement.h"

#include <memory>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/wire.h"
#include "tests/daemon/test_util.h"

namespace accord::daemon {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using testing::MakeSpec;

RankSet Ranks(int world, std::vector<int> ranks) {
  RankSet set(world);
  for (int r : ranks) set.Add(r);
  return set;
}

// A node content for `ranks` of `world` with float32 gradients where `used`.
Content NodeContent(int world, std::vector<int> ranks, std::vector<bool> used) {
  Content c;
  auto set = std::make_shared<RankSet>(Ranks(world, ranks));
  c.ranks = set;
  c.rank_count = static_cast<int>(ranks.size());
  c.word_hi = static_cast<int>(set->words().size());
  for (bool u : used) c.dtypes.push_back(u ? MaskOf(DType::kFloat32) : 0);
  return c;
}

TEST(GroupRegistrationTest, CollectsUntilEveryRankRegistered) {
  GroupRegistration reg(4, "job", "g");
  const GroupRegistration::Added a = reg.Add(MakeSpec("g", 3), Policy(), Ranks(4, {0, 1}));
  EXPECT_EQ(a.variant, 0);
  EXPECT_FALSE(a.completed);
  EXPECT_EQ(reg.state(), GroupRegistration::State::kCollecting);
}

GroupSpec WithMembers(GroupSpec spec, std::vector<int> members, int world) {
  absl::StatusOr<MemberSet> m = MemberSet::FromRanks(std::move(members), world);
  EXPECT_TRUE(m.ok()) << m.status();
  spec.members = std::make_shared<const MemberSet>(*std::move(m));
  return spec;
}

TEST(GroupRegistrationTest, CollectsUntilEveryMemberRegisteredAndNamesOnlyMembersMissing) {
  GroupRegistration reg(6, "job", "g@ranks0..2");
  const GroupSpec spec = WithMembers(MakeSpec("g@ranks0..2", 3), {0, 1, 2}, 6);
  EXPECT_FALSE(reg.Add(spec, Policy(), Ranks(6, {0})).completed);
  EXPECT_EQ(reg.member_count(), 3);
  EXPECT_THAT(reg.Unregistered(), ElementsAre(1, 2));
  EXPECT_THAT(reg.Registered(), ElementsAre(0));
  EXPECT_FALSE(reg.Add(spec, Policy(), Ranks(6, {1})).completed);
  const GroupRegistration::Added last = reg.Add(spec, Policy(), Ranks(6, {2}));
  EXPECT_TRUE(last.completed);
  EXPECT_EQ(reg.state(), GroupRegistration::State::kAgreed);
  EXPECT_EQ(reg.fingerprint(), SpecFingerprint(spec));
  EXPECT_NE(reg.fingerprint(), SpecFingerprint(MakeSpec("g@ranks0..2", 3)));
  EXPECT_TRUE(reg.Unregistered().empty());
}

TEST(GroupRegistrationTest, AnotherMemberSetUnderTheSameIdFailsTheGroupAtOnceNamingBoth) {
  GroupRegistration reg(4, "job", "g");
  reg.Add(WithMembers(MakeSpec("g", 2), {0, 1}, 4), Policy(), Ranks(4, {0}));
  const GroupRegistration::Added other =
      reg.Add(WithMembers(MakeSpec("g", 2), {2, 3}, 4), Policy(), Ranks(4, {2}));
  EXPECT_TRUE(other.completed);
  EXPECT_EQ(reg.state(), GroupRegistration::State::kFailed);
  EXPECT_EQ(reg.error().kind(), v1::REGISTRATION_MISMATCH);
  EXPECT_THAT(reg.error().message(),
              HasSubstr("job job: registration mismatch for group \"g\": rank 0 registered it "
                        "with members ranks 0-1, rank 2 with members ranks 2-3; a group id must "
                        "name one member set"));
  EXPECT_THAT(reg.error().ranks(), ElementsAre(0, 2));
}

TEST(GroupRegistrationTest, MembersAfterAJobWideRegistrationAreAMismatch) {
  GroupRegistration reg(4, "job", "g");
  reg.Add(MakeSpec("g", 2), Policy(), Ranks(4, {0, 1}));
  reg.Add(WithMembers(MakeSpec("g", 2), {2, 3}, 4), Policy(), Ranks(4, {2, 3}));
  EXPECT_EQ(reg.state(), GroupRegistration::State::kFailed);
  EXPECT_THAT(reg.error().message(),
              HasSubstr("rank 0 registered it with members every rank, rank 2 with members "
                        "ranks 2-3"));
}

TEST(GroupRegistrationTest, IdenticalRegistrationsAgreeOnTheSpecFingerprint) {
  GroupRegistration reg(4, "job", "g");
  reg.Add(MakeSpec("g", 3), Policy(), Ranks(4, {0, 1}));
  const GroupRegistration::Added b = reg.Add(MakeSpec("g", 3), Policy(), Ranks(4, {2, 3}));
  EXPECT_EQ(b.variant, 0);
  EXPECT_TRUE(b.completed);
  EXPECT_EQ(reg.state(), GroupRegistration::State::kAgreed);
  EXPECT_EQ(reg.fingerprint(), SpecFingerprint(MakeSpec("g", 3)));
  EXPECT_TRUE(reg.IsAgreed(0));
}

TEST(GroupRegistrationTest, MismatchNamesTheFirstDifferingParameterAndTheRanks) {
  GroupRegistration reg(4, "job", "g");
  GroupSpec other = MakeSpec("g", 3);
  other.params[1].numel = 128;
  reg.Add(MakeSpec("g", 3), Policy(), Ranks(4, {0, 1}));
  reg.Add(other, Policy(), Ranks(4, {3}));
  const GroupRegistration::Added last = reg.Add(MakeSpec("g", 3), Policy(), Ranks(4, {2}));
  EXPECT_TRUE(last.completed);
  ASSERT_EQ(reg.state(), GroupRegistration::State::kFailed);
  const v1::DecisionError& e = reg.error();
  EXPECT_EQ(e.kind(), v1::REGISTRATION_MISMATCH);
  EXPECT_EQ(e.code(), static_cast<int>(absl::StatusCode::kFailedPrecondition));
  EXPECT_EQ(e.job_id(), "job");
  EXPECT_EQ(e.group_id(), "g");
  EXPECT_EQ(e.param_index(), 1);
  EXPECT_EQ(e.param_name(), "layer1.weight");
  EXPECT_THAT(e.ranks(), ElementsAre(0, 3));  // the reference rank, then the differing ones
  EXPECT_THAT(e.message(), HasSubstr("ranks 3 differ from rank 0"));
}

TEST(GroupRegistrationTest, DifferentPoliciesAreAMismatchToo) {
  GroupRegistration reg(2, "job", "g");
  Policy bf16;
  bf16.reduce_dtype = DType::kBFloat16;
  reg.Add(MakeSpec("g", 2), Policy(), Ranks(2, {0}));
  reg.Add(MakeSpec("g", 2), bf16, Ranks(2, {1}));
  ASSERT_EQ(reg.state(), GroupRegistration::State::kFailed);
  EXPECT_EQ(reg.error().param_index(), -1);
  EXPECT_THAT(reg.error().message(), HasSubstr("different reduce policies"));
}

TEST(GroupRegistrationTest, ALaterRegistrationIsCheckedAgainstTheAgreedOne) {
  GroupRegistration reg(2, "job", "g");
  reg.Add(MakeSpec("g", 2), Policy(), Ranks(2, {0, 1}));
  ASSERT_EQ(reg.state(), GroupRegistration::State::kAgreed);
  const GroupRegistration::Added same = reg.Add(MakeSpec("g", 2), Policy(), Ranks(2, {1}));
  EXPECT_FALSE(same.completed);
  EXPECT_TRUE(reg.IsAgreed(same.variant));
  const GroupRegistration::Added other = reg.Add(MakeSpec("g", 5), Policy(), Ranks(2, {1}));
  EXPECT_FALSE(other.completed);
  EXPECT_FALSE(reg.IsAgreed(other.variant));
  EXPECT_EQ(reg.state(), GroupRegistration::State::kAgreed);  // the agreement stands
}

TEST(StepMergerTest, DecidesOnceEveryNodeIsIn) {
  GroupRegistration reg(4, "job", "g");
  reg.Add(MakeSpec("g", 3), Policy(), Ranks(4, {0, 1, 2, 3}));
  StepMerger merger(3, 4, /*step=*/7);
  merger.Add(NodeContent(4, {0, 1}, {true, false, false}));
  merger.Add(NodeContent(4, {2, 3}, {false, false, true}));
  absl::StatusOr<Decision> d = merger.Decide(reg.reference());
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->step, 7);
  EXPECT_EQ(d->wire_dtype, DType::kFloat32);
  EXPECT_THAT(d->included, ElementsAre(true, false, true));
}

TEST(StepMergerTest, AMissingNodeIsNamedByTheDecision) {
  GroupRegistration reg(4, "job", "g");
  reg.Add(MakeSpec("g", 1), Policy(), Ranks(4, {0, 1, 2, 3}));
  StepMerger merger(1, 4, 0);
  merger.Add(NodeContent(4, {0, 1}, {true}));
  absl::StatusOr<Decision> d = merger.Decide(reg.reference());
  ASSERT_FALSE(d.ok());
  EXPECT_THAT(d.status().message(), HasSubstr("2"));
}

}  // namespace
}  // namespace accord::daemon
