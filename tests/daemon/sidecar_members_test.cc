// A sidecar's groups with members (docs/MEMBERS.md 2.5): registrations held
// until the node above says it takes members, a rank outside its members
// refused, node manifests that leave rank_bits out only for the announced
// ranks among the members, resends, and decisions of groups no local rank
// registered ignored and counted.
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "daemon/sidecar/sidecar.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/wire.h"
#include "tests/daemon/fake_sinks.h"

namespace accord::daemon {
namespace {

using ::testing::ElementsAre;
using testing::FakeRankSink;
using testing::FakeUpstream;
using ::testing::HasSubstr;

constexpr int kWorld = 4;

v1::RankMessage Hello(int rank) {
  v1::RankMessage m;
  m.mutable_hello()->set_job_id("j");
  m.mutable_hello()->set_rank(rank);
  m.mutable_hello()->set_world_size(kWorld);
  return m;
}

GroupSpec SpecWith(const std::string& id, std::vector<int> members) {
  GroupSpec spec{id, {ParamSpec{"a", 8, 64}, ParamSpec{"b", 8, 32}}};
  if (!members.empty()) {
    absl::StatusOr<MemberSet> m = MemberSet::FromRanks(std::move(members), kWorld);
    EXPECT_TRUE(m.ok()) << m.status();
    spec.members = std::make_shared<const MemberSet>(*std::move(m));
  }
  return spec;
}

v1::RankMessage Reg(const GroupSpec& spec) {
  v1::RankMessage m;
  *m.mutable_registration() = wire::GroupSpecToProto(spec, Policy());
  return m;
}

v1::RankMessage Man(const std::string& group, int64_t step, int rank) {
  v1::RankMessage m;
  wire::ManifestToProto(group, RankManifest(step, rank, kWorld, {DType::kBFloat16, std::nullopt}),
                        false, m.mutable_manifests()->add_manifests());
  return m;
}

v1::CoordinatorMessage WelcomeFromAbove(bool members) {
  v1::CoordinatorMessage c;
  c.mutable_welcome()->set_run_id("run-1");
  c.mutable_welcome()->set_members(members);
  return c;
}

v1::CoordinatorMessage Result(const std::string& group) {
  v1::CoordinatorMessage c;
  c.mutable_registration()->set_group_id(group);
  return c;
}

std::vector<v1::NodeRegistration> Registrations(const FakeUpstream& up) {
  std::vector<v1::NodeRegistration> out;
  for (const v1::NodeMessage& m : up.sent) {
    if (m.has_registration()) out.push_back(m.registration());
  }
  return out;
}

RankSet Ranks(std::vector<int> ranks) {
  RankSet out(kWorld);
  for (int r : ranks) out.Add(r);
  return out;
}

// Ranks 0 and 1 of a world of 4 on this node; no Welcome from above yet.
class SidecarMembersTest : public ::testing::Test {
 protected:
  SidecarMembersTest() : sidecar_(Options()) {
    sidecar_.SetUpstream(&up_);
    s0_ = sidecar_.OpenRank(&r0_);
    s1_ = sidecar_.OpenRank(&r1_);
    sidecar_.HandleRankMessage(s0_, Hello(0));
    sidecar_.HandleRankMessage(s1_, Hello(1));
  }
  static SidecarOptions Options() {
    SidecarOptions o{"n0", "", 64};
    o.start_timer_thread = false;
    return o;
  }
  Sidecar sidecar_;
  FakeUpstream up_;
  FakeRankSink r0_, r1_;
  Sidecar::SessionId s0_, s1_;
};

TEST_F(SidecarMembersTest, ARegistrationWithMembersWaitsForTheWelcomeFromAboveThenGoesUp) {
  ASSERT_TRUE(r0_.replies[0].has_welcome());
  EXPECT_TRUE(r0_.replies[0].welcome().members()) << "the sidecar takes members itself";
  sidecar_.HandleRankMessage(s0_, Reg(SpecWith("g@m", {0, 2})));
  sidecar_.HandleRankMessage(s0_, Reg(SpecWith("h", {})));
  // A group of every rank goes up at once; one with members waits.
  ASSERT_EQ(Registrations(up_).size(), 1u);
  EXPECT_EQ(Registrations(up_)[0].registration().group_id(), "h");
  sidecar_.HandleCoordinatorMessage(WelcomeFromAbove(true));
  const std::vector<v1::NodeRegistration> regs = Registrations(up_);
  ASSERT_EQ(regs.size(), 2u);
  EXPECT_EQ(regs[1].registration().group_id(), "g@m");
  EXPECT_TRUE(regs[1].registration().has_members());
  EXPECT_THAT(regs[1].ranks(), ElementsAre(0));
  // Later ones go up at once.
  sidecar_.HandleRankMessage(s1_, Reg(SpecWith("k@m", {1, 3})));
  EXPECT_EQ(Registrations(up_).size(), 3u);
}

TEST_F(SidecarMembersTest, AHeldRegistrationOfARankThatLeftIsDropped) {
  sidecar_.HandleRankMessage(s1_, Reg(SpecWith("g@m", {1, 2})));
  sidecar_.CloseRank(s1_);
  sidecar_.HandleCoordinatorMessage(WelcomeFromAbove(true));
  EXPECT_TRUE(Registrations(up_).empty());
}

TEST_F(SidecarMembersTest, ANodeAboveWithoutMembersRefusesThemWithFailedPrecondition) {
  sidecar_.HandleRankMessage(s0_, Reg(SpecWith("g@m", {0, 2})));
  sidecar_.HandleCoordinatorMessage(WelcomeFromAbove(false));
  sidecar_.HandleRankMessage(s1_, Reg(SpecWith("k@m", {1, 3})));
  EXPECT_TRUE(Registrations(up_).empty()) << "nothing a job-wide receiver would misread";
  for (FakeRankSink* sink : {&r0_, &r1_}) {
    ASSERT_TRUE(sink->replies.back().has_registration());
    const v1::DecisionError& e = sink->replies.back().registration().error();
    EXPECT_EQ(e.kind(), v1::INVALID_REQUEST);
    EXPECT_EQ(e.code(), static_cast<int>(absl::StatusCode::kFailedPrecondition));
    EXPECT_THAT(e.message(), HasSubstr("older than groups with members; upgrade it"));
    EXPECT_FALSE(sink->closed.has_value());
  }
  EXPECT_THAT(r0_.replies.back().registration().error().message(),
              HasSubstr("group \"g@m\" has members (ranks 0,2) but the coordinator or relay "
                        "above sidecar \"n0\""));
}

TEST_F(SidecarMembersTest, ARankOutsideItsGroupsMembersIsRefusedAndNothingGoesUp) {
  sidecar_.HandleCoordinatorMessage(WelcomeFromAbove(true));
  sidecar_.HandleRankMessage(s1_, Reg(SpecWith("g@m", {0, 2})));
  EXPECT_TRUE(Registrations(up_).empty());
  ASSERT_TRUE(r1_.replies.back().has_registration());
  const v1::DecisionError& e = r1_.replies.back().registration().error();
  EXPECT_EQ(e.kind(), v1::INVALID_REQUEST);
  EXPECT_EQ(e.message(),
            "job j rank 1 group \"g@m\": rank 1 is not among its members (ranks 0,2); a rank "
            "registers only the groups it reduces");
  // Members in a non-canonical form: INVALID_REQUEST too.
  v1::RankMessage bad = Reg(SpecWith("x", {}));
  bad.mutable_registration()->mutable_members()->add_ranks(0);
  bad.mutable_registration()->mutable_members()->add_ranks(1);
  sidecar_.HandleRankMessage(s0_, bad);
  EXPECT_EQ(r0_.replies.back().registration().error().kind(), v1::INVALID_REQUEST);
  EXPECT_TRUE(Registrations(up_).empty());
}

// Announced {0, 1}. g's members {1, 3}: rank 1 alone covers the announced
// members, so no rank_bits. h's members {0, 1, 2} registered by rank 0 only:
// its manifest covers {0}, not the announced members {0, 1}, so it names them.
TEST_F(SidecarMembersTest, ANodeManifestLeavesRankBitsOutIffItCoversTheAnnouncedMembers) {
  sidecar_.HandleCoordinatorMessage(WelcomeFromAbove(true));
  sidecar_.HandleRankMessage(s1_, Reg(SpecWith("g@m", {1, 3})));
  sidecar_.HandleRankMessage(s0_, Reg(SpecWith("h@m", {0, 1, 2})));
  sidecar_.HandleRankMessage(s1_, Man("g@m", 0, 1));
  sidecar_.HandleRankMessage(s0_, Man("h@m", 0, 0));
  const std::vector<v1::Manifest> sent = up_.manifests();
  ASSERT_EQ(sent.size(), 2u);
  EXPECT_EQ(sent[0].group_id(), "g@m");
  EXPECT_TRUE(sent[0].rank_bits().empty());
  EXPECT_EQ(sent[1].group_id(), "h@m");
  EXPECT_EQ(sent[1].rank_bits(), wire::RankSetToBits(Ranks({0})));
}

// A no-bits manifest resent after a rank of another member set joined
// still names the members it stood for.
TEST_F(SidecarMembersTest, AResendAfterANewRankNamesTheMembersTheManifestStoodFor) {
  sidecar_.HandleCoordinatorMessage(WelcomeFromAbove(true));
  sidecar_.HandleRankMessage(s1_, Reg(SpecWith("g@m", {1, 3})));
  sidecar_.HandleRankMessage(s1_, Man("g@m", 0, 1));
  ASSERT_TRUE(up_.manifests()[0].rank_bits().empty());
  FakeRankSink r2;
  sidecar_.HandleRankMessage(sidecar_.OpenRank(&r2), Hello(2));
  sidecar_.OnUpstreamConnected();
  std::vector<v1::Manifest> resent;
  for (const v1::NodeMessage& m : up_.reset) {
    for (const v1::Manifest& x : m.manifests().manifests()) resent.push_back(x);
  }
  ASSERT_EQ(resent.size(), 1u);
  EXPECT_EQ(resent[0].rank_bits(), wire::RankSetToBits(Ranks({1})));
  // The registration is resent with its members.
  bool registration = false;
  for (const v1::NodeMessage& m : up_.reset) {
    registration |= m.has_registration() && m.registration().registration().has_members();
  }
  EXPECT_TRUE(registration);
}

// Rank 0 serves g (members {0, 2}), rank 1 serves k (members {1, 3}); a
// shared decision batch also names "other", which nobody here registered.
TEST_F(SidecarMembersTest, EachRankGetsItsGroupsDecisionsAndUnknownGroupsAreIgnoredAndCounted) {
  sidecar_.HandleCoordinatorMessage(WelcomeFromAbove(true));
  sidecar_.HandleRankMessage(s0_, Reg(SpecWith("g@m", {0, 2})));
  sidecar_.HandleRankMessage(s1_, Reg(SpecWith("k@m", {1, 3})));
  sidecar_.HandleCoordinatorMessage(Result("g@m"));
  sidecar_.HandleCoordinatorMessage(Result("k@m"));
  sidecar_.HandleRankMessage(s0_, Man("g@m", 0, 0));
  sidecar_.HandleRankMessage(s1_, Man("k@m", 0, 1));
  v1::CoordinatorMessage c;
  for (const char* group : {"other", "g@m", "k@m"}) {
    v1::Decision* d = c.mutable_decisions()->add_decisions();
    d->set_group_id(group);
    d->set_step(0);
    d->mutable_ok()->set_wire_dtype(v1::BFLOAT16);
  }
  sidecar_.HandleCoordinatorMessage(c);
  ASSERT_EQ(r0_.decisions().size(), 1u);
  EXPECT_EQ(r0_.decisions()[0].group_id(), "g@m");
  ASSERT_EQ(r1_.decisions().size(), 1u);
  EXPECT_EQ(r1_.decisions()[0].group_id(), "k@m");
  EXPECT_EQ(sidecar_.stats().decisions_ignored, 1);
  EXPECT_EQ(sidecar_.stats().decisions_in, 3);
}

}  // namespace
}  // namespace accord::daemon
