#include "daemon/coordinator/membership.h"

#include <memory>
#include <vector>

#include "daemon/coordinator/member_sets.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace accord::daemon {
namespace {

using ::testing::ElementsAre;

// A world of 4: node "a" connects with ranks 0,1 and node "b" with 2,3.
class MembershipTest : public ::testing::Test {
 protected:
  MembershipTest() : members_(4) {
    a_ = &Connect("a", {0, 1}, 1);
    b_ = &Connect("b", {2, 3}, 2);
  }
  NodeState& Connect(const std::string& id, std::vector<int> ranks, uint64_t session) {
    uint64_t replaced = 0;
    return members_.Connect(id, ranks, session, nullptr, true, &replaced);
  }
  Membership members_;
  NodeState* a_;
  NodeState* b_;
};

TEST_F(MembershipTest, OwnersAreTheConnectingNodes) {
  EXPECT_EQ(members_.OwnerOf(0), a_);
  EXPECT_EQ(members_.OwnerOf(1), a_);
  EXPECT_EQ(members_.OwnerOf(3), b_);
  EXPECT_EQ(members_.connected(), 2);
  EXPECT_TRUE(members_.all_connected());
  EXPECT_TRUE(a_->rank_set->Contains(1));
  EXPECT_FALSE(a_->rank_set->Contains(2));
}

TEST_F(MembershipTest, ARankOfAConnectedNodeIsHeldElsewhere) {
  EXPECT_EQ(members_.HeldElsewhere("c", {1, 2}), 1);
  EXPECT_EQ(members_.HeldElsewhere("a", {0, 1}), -1);  // its own ranks
  EXPECT_EQ(members_.JoinRank(*b_, 0), Membership::Join::kHeldElsewhere);
  EXPECT_EQ(members_.OwnerOf(0), a_);  // unchanged
}

TEST_F(MembershipTest, ARankOfADisconnectedNodeMovesToItsNewNode) {
  members_.Disconnect(*a_, absl::UnixEpoch());
  EXPECT_EQ(members_.connected(), 1);
  EXPECT_FALSE(members_.all_connected());
  EXPECT_TRUE(a_->lost());
  EXPECT_EQ(members_.HeldElsewhere("c", {1}), -1);
  NodeState& c = Connect("c", {1}, 3);
  EXPECT_EQ(members_.OwnerOf(1), &c);
  EXPECT_THAT(a_->ranks, ElementsAre(0));
}

TEST_F(MembershipTest, AReconnectTakesTheNodesStateOverAndNamesTheOldSession) {
  a_->last_step = 7;
  uint64_t replaced = 0;
  NodeState& again = members_.Connect("a", {0, 1}, 9, nullptr, true, &replaced);
  EXPECT_EQ(&again, a_);
  EXPECT_EQ(replaced, 1u);  // still connected on session 1
  EXPECT_EQ(members_.connected(), 2);
  EXPECT_EQ(again.last_step, 7);
  EXPECT_EQ(again.session, 9u);
}

TEST_F(MembershipTest, AReconnectWithFewerRanksReleasesTheOthers) {
  members_.Disconnect(*a_, absl::UnixEpoch());
  Connect("a", {0}, 5);
  EXPECT_EQ(members_.OwnerOf(0), a_);
  EXPECT_EQ(members_.OwnerOf(1), nullptr);
}

TEST_F(MembershipTest, RankLeaveAndRejoin) {
  b_->last_step = 4;
  EXPECT_FALSE(members_.LeaveRank(*a_, 3, 10));  // not a's rank: nothing recorded
  EXPECT_FALSE(members_.Left(3));
  EXPECT_TRUE(members_.LeaveRank(*b_, 3, 6));
  EXPECT_TRUE(members_.Left(3));
  EXPECT_EQ(members_.LastStep(3), 6);  // its own last step, past its node's
  EXPECT_EQ(members_.LastStep(2), 4);  // its node's
  EXPECT_EQ(members_.JoinRank(*b_, 3), Membership::Join::kAlreadyServed);
  EXPECT_FALSE(members_.Left(3));  // joined again
}

TEST_F(MembershipTest, LeftBeforeAStepWithMembersLooksAtTheMembersOnly) {
  const MemberSet first_two = *MemberSet::FromRanks({0, 1}, 4);
  const MemberSet last_two = *MemberSet::FromRanks({2, 3}, 4);
  EXPECT_EQ(members_.LeftBefore(5, &first_two), -1);
  ASSERT_TRUE(members_.LeaveRank(*b_, 3, 2));
  EXPECT_EQ(members_.LeftBefore(5), 3);
  EXPECT_EQ(members_.LeftBefore(5, &first_two), -1);
  EXPECT_EQ(members_.LeftBefore(5, &last_two), 3);
  EXPECT_EQ(members_.LeftBefore(2, &last_two), -1);  // it reached step 2
}

// The member sets a job's groups name: interned, and each node's ranks
// among each, kept current when a node connects.
TEST_F(MembershipTest, MemberSetsInternEqualSetsAndKeepEachNodesMemberRanks) {
  MemberSets sets;
  auto stage = [](std::vector<int> r) {
    return std::make_shared<const MemberSet>(*MemberSet::FromRanks(std::move(r), 4));
  };
  std::shared_ptr<const MemberSet> one = sets.Intern(stage({1, 2}), members_);
  EXPECT_EQ(sets.Intern(stage({1, 2}), members_), one);
  EXPECT_EQ(sets.Intern(nullptr, members_), nullptr);
  EXPECT_EQ(sets.size(), 1);
  const NodeMembers* on_a = MemberSets::Of(*a_, *one);
  ASSERT_NE(on_a, nullptr);
  EXPECT_EQ(on_a->count, 1);
  EXPECT_EQ(on_a->set->Members(), std::vector<int>{1});
  ASSERT_NE(MemberSets::Of(*b_, *one), nullptr);
  EXPECT_EQ(MemberSets::Of(*b_, *one)->set->Members(), std::vector<int>{2});
  // Node b comes back serving rank 3 only: it serves no member any more.
  NodeState& b = Connect("b", {3}, 3);
  sets.Refresh(b);
  EXPECT_EQ(MemberSets::Of(b, *one), nullptr);
}

// A rank that leaves before submitting anything (last step -1, as a relay
// reports the ranks of a sidecar it dropped) has left all the same, and is
// gone; so is a rank no node serves or whose node's stream is down.
TEST_F(MembershipTest, ARankIsGoneWhenItLeftAtAnyStepOrItsNodeIsDown) {
  EXPECT_FALSE(members_.Gone(2));
  EXPECT_TRUE(members_.LeaveRank(*b_, 2, -1));
  EXPECT_TRUE(members_.Left(2));
  EXPECT_TRUE(members_.Gone(2));
  EXPECT_EQ(members_.JoinRank(*b_, 2), Membership::Join::kAlreadyServed);
  EXPECT_FALSE(members_.Gone(2));
  members_.Disconnect(*a_, absl::UnixEpoch());
  EXPECT_TRUE(members_.Gone(0));
  EXPECT_FALSE(members_.Left(0));
}

TEST_F(MembershipTest, ARankJoiningAnotherNodeAfterItsNodeLeft) {
  members_.Disconnect(*b_, absl::UnixEpoch());
  EXPECT_EQ(members_.JoinRank(*a_, 2), Membership::Join::kJoined);
  EXPECT_EQ(members_.OwnerOf(2), a_);
  EXPECT_THAT(a_->ranks, ElementsAre(0, 1, 2));
  EXPECT_TRUE(a_->rank_set->Contains(2));
  EXPECT_THAT(b_->ranks, ElementsAre(3));
}

// How an error names a rank: its node, and why it is not connected.
TEST(MembershipDescribeTest, ARankIsDescribedWithItsNodeAndWhetherItIsConnected) {
  Membership m(5);
  uint64_t replaced = 0;
  m.Connect("a", {0, 1}, 1, nullptr, false, &replaced);
  NodeState& b = m.Connect("b", {2}, 2, nullptr, false, &replaced);
  ASSERT_TRUE(m.LeaveRank(*m.OwnerOf(1), 1, -1));
  m.Disconnect(b, absl::UnixEpoch());
  EXPECT_EQ(m.Describe(0), "rank 0 (node \"a\", connected)");
  EXPECT_EQ(m.Describe(1), "rank 1 (node \"a\", not connected: it left its sidecar)");
  EXPECT_EQ(m.Describe(2),
            "rank 2 (node \"b\", not connected: the node's stream to the coordinator is down)");
  EXPECT_EQ(m.Describe(4), "rank 4 (not connected: no sidecar has announced it)");
}

// A leave that says why (a relay naming the rank's sidecar) is described in
// its words until the rank joins again.
TEST(MembershipDescribeTest, ALeavesCauseDescribesTheRankUntilItJoinsAgain) {
  Membership m(2);
  uint64_t replaced = 0;
  NodeState& relay = m.Connect("relay0", {0, 1}, 1, nullptr, false, &replaced);
  ASSERT_TRUE(m.LeaveRank(relay, 1, 3, "its stream to the sidecar on node \"n1\" ended"));
  EXPECT_EQ(m.LeftCause(1), "its stream to the sidecar on node \"n1\" ended");
  EXPECT_EQ(m.Describe(1),
            "rank 1 (node \"relay0\", not connected: its stream to the sidecar on node \"n1\" "
            "ended)");
  EXPECT_EQ(m.JoinRank(relay, 1), Membership::Join::kAlreadyServed);
  EXPECT_EQ(m.LeftCause(1), "");
  EXPECT_EQ(m.Describe(1), "rank 1 (node \"relay0\", connected)");
}

TEST_F(MembershipTest, RankSetWordBoundsCoverOnlyTheNodesWords) {
  Membership wide(256);
  uint64_t replaced = 0;
  NodeState& n = wide.Connect("n", {130, 140}, 1, nullptr, false, &replaced);
  EXPECT_EQ(n.word_lo, 2);
  EXPECT_EQ(n.word_hi, 3);
}

}  // namespace
}  // namespace accord::daemon
