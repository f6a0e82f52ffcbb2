// UpstreamNode, the upstream side of the node protocol shared by the sidecar
// and the relay, with a recording sink.
#include "daemon/common/upstream_node.h"

#include <memory>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/wire.h"

namespace accord::daemon {
namespace {

using ::testing::ElementsAre;

class RecordingSink : public UpstreamSink {
 public:
  void Send(v1::NodeMessage m) override { sent.push_back(std::move(m)); }
  void Reset(std::vector<v1::NodeMessage> m) override { reset = std::move(m); }
  void Reconnect() override {}
  std::vector<v1::NodeMessage> sent;
  std::vector<v1::NodeMessage> reset;
};

v1::Manifest Full(const std::string& group, uint64_t key) {
  v1::Manifest m;
  m.set_group_id(group);
  m.set_cache_key(key);
  m.set_used_bits("\x01");
  return m;
}

v1::ManifestBatch Repeats(int64_t step, const std::vector<std::pair<std::string, uint64_t>>& e) {
  v1::ManifestBatch b;
  for (const auto& [group, key] : e) {
    v1::Manifest* m = b.add_manifests();
    m->set_group_id(group);
    m->set_cache_key(key);
    m->set_repeat(true);
    m->set_step(step);
  }
  return b;
}

class UpstreamNodeTest : public ::testing::Test {
 protected:
  void SetUp() override { node_.SetSink(&sink_); }
  RecordingSink sink_;
  UpstreamNode node_{"n0"};
};

TEST_F(UpstreamNodeTest, TheFirstRanksGoInTheHelloLaterOnesAsJoins) {
  node_.StartJob("j", 4, "tok");
  node_.AnnounceRanks({1, 0});
  node_.AnnounceRanks({0, 2});
  ASSERT_EQ(sink_.sent.size(), 2u);
  const v1::NodeHello& h = sink_.sent[0].hello();
  EXPECT_EQ(h.job_id(), "j");
  EXPECT_EQ(h.node_id(), "n0");
  EXPECT_EQ(h.token(), "tok");
  EXPECT_THAT(h.ranks(), ElementsAre(0, 1));
  EXPECT_EQ(h.run_start(), v1::NodeHello::RUN_START_NEW);
  EXPECT_NE(h.node_epoch(), 0u);
  EXPECT_TRUE(h.answers_progress());
  EXPECT_EQ(sink_.sent[1].rank_event().rank(), 2);
  EXPECT_TRUE(sink_.sent[1].rank_event().joined());
}

TEST_F(UpstreamNodeTest, ALeaveKeepsTheRankAnnouncedAndAJoinAfterItGoesUp) {
  node_.StartJob("j", 4, "");
  node_.AnnounceRanks({0, 1, 2});
  RankSet all(4), some(4);
  for (int r : {0, 1, 2}) all.Add(r);
  for (int r : {0, 2}) some.Add(r);
  EXPECT_TRUE(node_.IsAnnounced(all));
  // Receivers keep a rank that left as the node's: a manifest of the others
  // must name them, whether the node saw the leave or forwarded it.
  node_.LeaveRank(1, 5);
  EXPECT_FALSE(node_.IsAnnounced(some));
  EXPECT_TRUE(node_.IsAnnounced(all));
  v1::RankEvent left;
  left.set_rank(2);
  left.set_joined(false);
  node_.ForwardRankEvent(left);
  EXPECT_TRUE(node_.IsAnnounced(all));
  // Back again: each sends a join (the receiver marked it left).
  const size_t before = sink_.sent.size();
  node_.AnnounceRanks({1, 2, 0});
  ASSERT_EQ(sink_.sent.size(), before + 2);
  EXPECT_EQ(sink_.sent[before].rank_event().rank(), 1);
  EXPECT_TRUE(sink_.sent[before].rank_event().joined());
  EXPECT_EQ(sink_.sent[before + 1].rank_event().rank(), 2);
  node_.AnnounceRanks({1});
  EXPECT_EQ(sink_.sent.size(), before + 2) << "announced and not left: no join";
  // A new stream's hello lists every announced rank.
  node_.LeaveRank(2, 6);
  node_.Connected({}, {});
  EXPECT_THAT(sink_.reset[0].hello().ranks(), ElementsAre(0, 1, 2));
  EXPECT_TRUE(node_.IsAnnounced(all));
}

TEST_F(UpstreamNodeTest, ANewStreamGetsTheHelloRegistrationsAndInflightAndResumesTheRun) {
  node_.StartJob("j", 4, "tok");
  node_.AnnounceRanks({0, 1});
  v1::Welcome w;
  w.set_run_id("r1");
  w.set_batch_repeat(true);
  node_.OnWelcome(w);
  GroupRegistrations regs;
  v1::GroupRegistration spec;
  spec.set_group_id("g");
  regs.Add(spec, {1});
  regs.Add(spec, {0});
  InflightManifests inflight;
  inflight.Add(5, std::make_shared<const v1::Manifest>(Full("g", 7)), 2);
  inflight.Add(6, std::make_shared<const v1::Manifest>(Full("g", 7)), 2);
  inflight.DropUpTo(5);
  std::vector<v1::NodeMessage> resend_regs;
  regs.AppendResend([](int r) { return r == 0; }, &resend_regs);
  v1::ManifestBatch resend;
  inflight.AppendAll(node_, nullptr, &resend);
  node_.Connected(std::move(resend_regs), std::move(resend));
  ASSERT_EQ(sink_.reset.size(), 3u);
  EXPECT_EQ(sink_.reset[0].hello().run_start(), v1::NodeHello::RUN_START_RESUME);
  EXPECT_EQ(sink_.reset[0].hello().run_id(), "r1");
  EXPECT_THAT(sink_.reset[1].registration().ranks(), ElementsAre(0));
  // The last decided step's manifest first, flagged (docs/ARCHITECTURE.md,
  // "Decisions across a coordinator restart"), then the undecided one.
  ASSERT_EQ(sink_.reset[2].manifests().manifests_size(), 2);
  EXPECT_EQ(sink_.reset[2].manifests().manifests(0).step(), 5);
  EXPECT_TRUE(sink_.reset[2].manifests().manifests(0).decided());
  EXPECT_EQ(sink_.reset[2].manifests().manifests(1).step(), 6);
  EXPECT_FALSE(sink_.reset[2].manifests().manifests(1).decided());
  EXPECT_FALSE(node_.batch_repeat()) << "until the new stream's Welcome offers them";
}

// Only the last decided step is kept (one per group: a node can be at most
// one decided step ahead of a node whose copy of the decision was lost,
// since the next step needs that node's manifest); an older step answered
// again changes nothing.
TEST_F(UpstreamNodeTest, InflightKeepsTheLastDecidedStepOnly) {
  node_.StartJob("j", 2, "");
  node_.AnnounceRanks({0, 1});
  InflightManifests inflight;
  for (int64_t step : {3, 4, 4, 5}) {
    inflight.Add(step, std::make_shared<const v1::Manifest>(Full("g", 7)), 2);
  }
  auto steps = [&] {
    v1::ManifestBatch out;
    inflight.AppendAll(node_, nullptr, &out);
    std::vector<std::pair<int64_t, bool>> v;
    for (const v1::Manifest& m : out.manifests()) v.emplace_back(m.step(), m.decided());
    return v;
  };
  EXPECT_THAT(steps(),
              ElementsAre(std::pair<int64_t, bool>{3, false}, std::pair<int64_t, bool>{4, false},
                          std::pair<int64_t, bool>{4, false}, std::pair<int64_t, bool>{5, false}));
  inflight.DropUpTo(3);
  inflight.DropUpTo(4);
  EXPECT_EQ(inflight.decided_step(), 4);
  EXPECT_THAT(steps(),
              ElementsAre(std::pair<int64_t, bool>{4, true}, std::pair<int64_t, bool>{4, true},
                          std::pair<int64_t, bool>{5, false}));
  inflight.DropUpTo(2);  // an older step answered again
  EXPECT_EQ(steps().size(), 3u);
  inflight.DropUpTo(7);  // decided without this node's manifest: nothing of it kept
  EXPECT_TRUE(steps().empty());
  EXPECT_EQ(inflight.decided_step(), 7);
}

// A manifest without rank_bits stands for the ranks announced when it was
// built. Resent after more ranks were announced (a rank resumed on a
// restarted sidecar while the stream was down), it must still say those
// ranks, not the larger set the new stream's hello lists.
TEST_F(UpstreamNodeTest, AResentManifestKeepsTheRanksItWasBuiltFor) {
  node_.StartJob("j", 8, "");
  node_.AnnounceRanks({5});
  InflightManifests inflight;
  inflight.Add(1, std::make_shared<const v1::Manifest>(Full("g", 7)), node_.announced().size());
  node_.AnnounceRanks({4});
  inflight.Add(2, std::make_shared<const v1::Manifest>(Full("g", 8)), node_.announced().size());
  v1::ManifestBatch resend;
  inflight.AppendAll(node_, nullptr, &resend);
  ASSERT_EQ(resend.manifests_size(), 2);
  RankSet five(8);
  five.Add(5);
  EXPECT_EQ(resend.manifests(0).rank_bits(), wire::RankSetToBits(five));
  EXPECT_TRUE(resend.manifests(1).rank_bits().empty()) << "built for every rank announced now";
  v1::ManifestBatch one;
  ASSERT_TRUE(inflight.AppendStep(1, node_, nullptr, &one));
  EXPECT_EQ(one.manifests(0).rank_bits(), wire::RankSetToBits(five));
  EXPECT_EQ(one.manifests(0).step(), 1);
}

std::shared_ptr<const MemberSet> Members(std::vector<int> ranks, int world) {
  absl::StatusOr<MemberSet> m = MemberSet::FromRanks(std::move(ranks), world);
  EXPECT_TRUE(m.ok()) << m.status();
  return std::make_shared<const MemberSet>(*std::move(m));
}

RankSet Ranks(int world, std::vector<int> ranks) {
  RankSet out(world);
  for (int r : ranks) out.Add(r);
  return out;
}

// docs/MEMBERS.md 2.5: a manifest of a group with members leaves rank_bits
// out iff it covers the announced ranks among the members; with no members
// the rule is the announced set, as before.
TEST_F(UpstreamNodeTest, WithoutRankBitsMeansTheAnnouncedRanksAmongTheGroupsMembers) {
  node_.StartJob("j", 8, "");
  node_.AnnounceRanks({0, 1, 2, 3});
  const auto stage1 = Members({2, 3, 6, 7}, 8);
  EXPECT_TRUE(node_.IsAnnounced(Ranks(8, {2, 3}), stage1.get()));
  EXPECT_FALSE(node_.IsAnnounced(Ranks(8, {2}), stage1.get()));
  EXPECT_FALSE(node_.IsAnnounced(Ranks(8, {0, 1, 2, 3}), stage1.get())) << "0 and 1 are no members";
  EXPECT_TRUE(node_.IsAnnounced(std::vector<int>{2, 3}, stage1.get()));
  EXPECT_FALSE(node_.IsAnnounced(std::vector<int>{3}, stage1.get()));
  EXPECT_FALSE(node_.IsAnnounced(std::vector<int>{2, 3, 6}, stage1.get()));
  EXPECT_TRUE(node_.IsAnnounced(std::vector<int>{0, 1, 2, 3}, nullptr));
  EXPECT_FALSE(node_.IsAnnounced(std::vector<int>{2, 3}, nullptr));
  EXPECT_TRUE(node_.IsAnnounced(Ranks(8, {0, 1, 2, 3}), nullptr));
}

// A no-bits manifest of a group with members, resent after another member
// was announced, names the members announced at its build only.
TEST_F(UpstreamNodeTest, AResentManifestOfAGroupWithMembersNamesItsMembersOfThen) {
  node_.StartJob("j", 8, "");
  node_.AnnounceRanks({0, 2});
  const auto evens = Members({0, 2, 4, 6}, 8);
  InflightManifests inflight;
  inflight.Add(1, std::make_shared<const v1::Manifest>(Full("g", 7)), node_.announced().size());
  node_.AnnounceRanks({4, 5});
  v1::ManifestBatch resend;
  inflight.AppendAll(node_, evens.get(), &resend);
  ASSERT_EQ(resend.manifests_size(), 1);
  EXPECT_EQ(resend.manifests(0).rank_bits(), wire::RankSetToBits(Ranks(8, {0, 2})));
  EXPECT_EQ(node_.FirstAnnounced(4, evens.get()), Ranks(8, {0, 2, 4}));
}

TEST_F(UpstreamNodeTest, TheWelcomeSaysWhetherTheNodeAboveTakesMembersKeptAcrossReconnects) {
  node_.StartJob("j", 2, "");
  node_.AnnounceRanks({0});
  EXPECT_FALSE(node_.takes_members().has_value());
  v1::Welcome w;
  w.set_members(true);
  node_.OnWelcome(w);
  EXPECT_EQ(node_.takes_members(), std::optional<bool>(true));
  node_.Connected({}, v1::ManifestBatch());
  EXPECT_EQ(node_.takes_members(), std::optional<bool>(true));
  node_.OnWelcome(v1::Welcome());
  EXPECT_EQ(node_.takes_members(), std::optional<bool>(false));
  node_.EndJob();
  EXPECT_FALSE(node_.takes_members().has_value());
}

TEST_F(UpstreamNodeTest, ABatchGoesAsABatchRepeatOnlyWhenOfferedAndTheSameAsThePrevious) {
  node_.StartJob("j", 2, "");
  node_.AnnounceRanks({0, 1});
  EXPECT_FALSE(node_.SendBatch(Repeats(1, {{"a", 1}, {"b", 2}})));
  EXPECT_FALSE(node_.SendBatch(Repeats(2, {{"a", 1}, {"b", 2}}))) << "not offered";
  v1::Welcome w;
  w.set_batch_repeat(true);
  node_.OnWelcome(w);
  EXPECT_TRUE(node_.SendBatch(Repeats(3, {{"a", 1}, {"b", 2}})));
  EXPECT_EQ(sink_.sent.back().manifests().repeat_step(), 3);
  EXPECT_FALSE(node_.SendBatch(Repeats(4, {{"a", 1}, {"b", 3}}))) << "another key";
  EXPECT_FALSE(node_.SendBatch(v1::ManifestBatch()));
}

TEST_F(UpstreamNodeTest, EndJobForgetsTheJobTheRanksAndTheStreamsBatch) {
  node_.StartJob("j", 2, "", "r0");
  node_.AnnounceRanks({0});
  node_.SendBatch(Repeats(1, {{"a", 1}}));
  node_.EndJob();
  EXPECT_FALSE(node_.has_job());
  EXPECT_TRUE(node_.announced().empty());
  EXPECT_EQ(node_.previous_batch().size(), 0u);
  node_.Connected({}, {});
  EXPECT_TRUE(sink_.reset.empty()) << "no job: nothing to resend";
}

TEST(RepeatFormTest, RepeatsOnlyTheHeldKeyAndShape) {
  RepeatFormOf<ManifestShape> f;
  const ManifestShape s{"", {RankUsageBits{3, "\x01"}}};
  const ManifestShape t{"", {RankUsageBits{3, "\x02"}}};
  EXPECT_FALSE(f.Repeats(1, ManifestShape{}));
  f.Sent(1, s);
  EXPECT_TRUE(f.Repeats(1, s));
  EXPECT_FALSE(f.Repeats(1, t));
  EXPECT_FALSE(f.Repeats(1, ManifestShape{"\x0f", s.detail})) << "other ranks named";
  EXPECT_FALSE(f.Repeats(2, s));
  f.Forget();
  EXPECT_FALSE(f.Repeats(1, s));
}

}  // namespace
}  // namespace accord::daemon
