// A relay's groups with members (docs/MEMBERS.md 2.6): its Welcome says
// `members` when the coordinator's did; a sidecar's part without rank_bits
// stands for that sidecar's ranks among the group's members; a merge leaves
// rank_bits out iff it covers the relay's announced ranks among them.
#include <memory>
#include <string>
#include <vector>

#include "core/group.h"
#include "core/manifest.h"
#include "daemon/relay/relay.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/wire.h"
#include "tests/daemon/fake_sinks.h"
#include "tests/daemon/test_util.h"

namespace accord::daemon {
namespace {

using ::testing::ElementsAre;
using testing::FakeNodeSink;
using testing::FakeUpstream;

constexpr int kWorld = 4;
constexpr char kGroup[] = "g@ranks1..3";

GroupSpec MembersSpec() {
  GroupSpec spec{kGroup, {ParamSpec{"a", 8, 64}, ParamSpec{"b", 8, 64}}};
  spec.members = std::make_shared<const MemberSet>(*MemberSet::FromRanks({1, 2, 3}, kWorld));
  return spec;
}

// A sidecar's node manifest of kGroup covering `ranks` (named in rank_bits
// when `with_ranks`), every rank using the params in `used`.
v1::Manifest NodeManifest(int64_t step, const std::vector<int>& ranks, std::vector<bool> used,
                          bool with_ranks) {
  Manifest m;
  m.step = step;
  m.ranks = RankSet(kWorld);
  for (int r : ranks) m.ranks.Add(r);
  for (bool u : used) m.dtypes.push_back(u ? MaskOf(DType::kFloat32) : 0);
  v1::Manifest out;
  wire::ManifestToProto(kGroup, m, with_ranks, &out);
  return out;
}

RankSet Ranks(std::vector<int> ranks) {
  RankSet out(kWorld);
  for (int r : ranks) out.Add(r);
  return out;
}

// node0 serves ranks {0, 1}, node1 {2, 3}; kGroup's members are {1, 2, 3}.
class RelayMembersTest : public ::testing::Test {
 protected:
  void Start(bool coordinator_takes_members) {
    RelayOptions o;
    o.relay_id = "relay0";
    o.clock = &clock_;
    o.start_timer_thread = false;
    relay_ = std::make_unique<Relay>(o);
    relay_->SetUpstream(&up_);
    relay_->OnUpstreamConnected();
    a_ = Join("node0", {0, 1}, &sink_a_);
    b_ = Join("node1", {2, 3}, &sink_b_);
    v1::CoordinatorMessage w;
    w.mutable_welcome()->set_run_id("run1");
    w.mutable_welcome()->set_members(coordinator_takes_members);
    relay_->HandleCoordinatorMessage(&w);
  }

  Relay::SessionId Join(const std::string& node, const std::vector<int>& ranks,
                        FakeNodeSink* sink) {
    const Relay::SessionId id = relay_->OpenSession(sink);
    v1::NodeMessage hello;
    hello.mutable_hello()->set_job_id("j");
    hello.mutable_hello()->set_node_id(node);
    hello.mutable_hello()->set_world_size(kWorld);
    hello.mutable_hello()->set_answers_progress(true);
    hello.mutable_hello()->set_run_start(v1::NodeHello::RUN_START_NEW);
    hello.mutable_hello()->set_node_epoch(7);
    for (int r : ranks) hello.mutable_hello()->add_ranks(r);
    relay_->HandleMessage(id, hello);
    return id;
  }

  void Register(Relay::SessionId id, const std::vector<int>& ranks) {
    v1::NodeMessage reg;
    *reg.mutable_registration()->mutable_registration() =
        wire::GroupSpecToProto(MembersSpec(), Policy());
    for (int r : ranks) reg.mutable_registration()->add_ranks(r);
    relay_->HandleMessage(id, reg);
  }

  void Submit(Relay::SessionId id, const v1::Manifest& m) {
    v1::NodeMessage msg;
    *msg.mutable_manifests()->add_manifests() = m;
    relay_->HandleMessage(id, msg);
  }

  FakeClock clock_;
  FakeUpstream up_;
  FakeNodeSink sink_a_, sink_b_;
  std::unique_ptr<Relay> relay_;
  Relay::SessionId a_ = 0, b_ = 0;
};

TEST_F(RelayMembersTest, TheSidecarsWelcomeSaysMembersWhenTheCoordinatorsDid) {
  Start(true);
  std::vector<v1::CoordinatorMessage> got = sink_a_.messages();
  ASSERT_FALSE(got.empty());
  ASSERT_TRUE(got[0].has_welcome());
  EXPECT_TRUE(got[0].welcome().members());
}

TEST_F(RelayMembersTest, TheSidecarsWelcomeSaysNoMembersWhenTheCoordinatorsDidNot) {
  Start(false);
  std::vector<v1::CoordinatorMessage> got = sink_b_.messages();
  ASSERT_FALSE(got.empty());
  ASSERT_TRUE(got[0].has_welcome());
  EXPECT_FALSE(got[0].welcome().members());
}

TEST_F(RelayMembersTest, NoBitsMeanTheSidecarsRanksAmongTheMembersAtArrivalAndInTheMerge) {
  Start(true);
  Register(a_, {1});
  Register(b_, {2, 3});
  std::vector<v1::NodeRegistration> forwarded;
  for (const v1::NodeMessage& m : up_.sent) {
    if (m.has_registration()) forwarded.push_back(m.registration());
  }
  ASSERT_EQ(forwarded.size(), 2u);
  EXPECT_TRUE(forwarded[0].registration().has_members()) << "forwarded unchanged";
  // Step 0: both parts without rank_bits: node0's stands for {1}, not {0, 1};
  // the merge {1, 2, 3} is every announced member, so it has no rank_bits,
  // and only rank 1's usage differs from it.
  Submit(a_, NodeManifest(0, {1}, {true, false}, /*with_ranks=*/false));
  Submit(b_, NodeManifest(0, {2, 3}, {true, true}, /*with_ranks=*/false));
  // Step 1: node1 names rank 2 alone, so the merge names {1, 2}.
  Submit(a_, NodeManifest(1, {1}, {true, true}, /*with_ranks=*/false));
  Submit(b_, NodeManifest(1, {2}, {true, true}, /*with_ranks=*/true));
  const std::vector<v1::Manifest> up = up_.manifests();
  ASSERT_EQ(up.size(), 2u);
  EXPECT_EQ(up[0].step(), 0);
  EXPECT_TRUE(up[0].rank_bits().empty());
  ASSERT_EQ(up[0].rank_detail_size(), 1);
  EXPECT_EQ(up[0].rank_detail(0).rank(), 1);
  EXPECT_EQ(up[1].step(), 1);
  EXPECT_EQ(up[1].rank_bits(), wire::RankSetToBits(Ranks({1, 2})));
  EXPECT_EQ(up[1].rank_detail_size(), 0);
}

}  // namespace
}  // namespace accord::daemon
