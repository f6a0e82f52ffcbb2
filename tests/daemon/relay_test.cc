// The relay's logic with fakes: sidecar sessions are FakeNodeSinks, the
// upstream is a recording FakeUpstream, time is a FakeClock (no timer
// thread; CheckTimers is called by hand).
#include "daemon/relay/relay.h"

#include <memory>
#include <string>
#include <vector>

#include "core/group.h"
#include "core/manifest.h"
#include "daemon/common/decision_errors.h"
#include "daemon/common/upstream_health.h"
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

GroupSpec Spec() {
  return GroupSpec{"g", {ParamSpec{"a", 8, 64}, ParamSpec{"b", 8, 64}, ParamSpec{"c", 8, 64}}};
}

// A sidecar's node manifest for `ranks`, every rank using the params in
// `used` unless `detail` gives a rank's own bits.
// `with_ranks`: with rank_bits (a sidecar names its ranks when they are not
// all the ranks it announced).
v1::Manifest NodeManifest(int64_t step, const std::vector<int>& ranks, std::vector<bool> used,
                          std::vector<std::pair<int, std::vector<bool>>> detail = {},
                          bool with_ranks = false) {
  Manifest m;
  m.step = step;
  m.ranks = RankSet(kWorld);
  for (int r : ranks) m.ranks.Add(r);
  for (bool u : used) m.dtypes.push_back(u ? MaskOf(DType::kFloat32) : 0);
  v1::Manifest out;
  wire::ManifestToProto("g", m, with_ranks, &out);
  for (auto& [r, bits] : detail) {
    v1::RankUsage* u = out.add_rank_detail();
    u->set_rank(r);
    u->set_used_bits(wire::PackBits(bits));
  }
  return out;
}

// A relay "relay0" on `clock`, with no timer thread (CheckTimers by hand).
RelayOptions TestOptions(FakeClock* clock) {
  RelayOptions o;
  o.relay_id = "relay0";
  o.clock = clock;
  o.start_timer_thread = false;
  return o;
}

class RelayTest : public ::testing::Test {
 protected:
  void SetUp() override {
    RelayOptions o = TestOptions(&clock_);
    o.node_reconnect_grace = absl::Seconds(10);
    relay_ = std::make_unique<Relay>(o);
    relay_->SetUpstream(&up_);
    relay_->OnUpstreamConnected();
    a_ = Join("node0", {0, 1}, &sink_a_);
    b_ = Join("node1", {2, 3}, &sink_b_);
    Welcome(/*deadline_ms=*/2000);
    for (auto [id, ranks] : {std::pair{a_, std::vector<int>{0, 1}}, {b_, {2, 3}}}) {
      v1::NodeMessage reg;
      *reg.mutable_registration()->mutable_registration() =
          wire::GroupSpecToProto(Spec(), Policy());
      for (int r : ranks) reg.mutable_registration()->add_ranks(r);
      relay_->HandleMessage(id, reg);
    }
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

  void Welcome(int64_t deadline_ms, bool batch_repeat = false) {
    v1::CoordinatorMessage w;
    w.mutable_welcome()->set_deadline_ms(deadline_ms);
    w.mutable_welcome()->set_batch_repeat(batch_repeat);
    w.mutable_welcome()->set_run_id("run1");
    relay_->HandleCoordinatorMessage(&w);
  }

  // The coordinator decides `step` of group "g" (float32 on the wire).
  void DecideOk(int64_t step) {
    v1::CoordinatorMessage m;
    v1::Decision* d = m.mutable_decisions()->add_decisions();
    d->set_group_id("g");
    d->set_step(step);
    d->mutable_ok()->set_wire_dtype(v1::FLOAT32);
    relay_->HandleCoordinatorMessage(&m);
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

TEST_F(RelayTest, HelloUpstreamAnnouncesEverySidecarsRanksAndEachSidecarIsWelcomed) {
  std::vector<int> announced;
  for (const v1::NodeMessage& m : up_.sent) {
    if (m.has_hello()) {
      EXPECT_EQ(m.hello().node_id(), "relay0");
      EXPECT_TRUE(m.hello().answers_progress());
      announced.insert(announced.end(), m.hello().ranks().begin(), m.hello().ranks().end());
    }
    if (m.has_rank_event() && m.rank_event().joined()) announced.push_back(m.rank_event().rank());
  }
  EXPECT_THAT(announced, ElementsAre(0, 1, 2, 3));
  for (FakeNodeSink* s : {&sink_a_, &sink_b_}) {
    ASSERT_EQ(s->messages().size(), 1u);
    EXPECT_EQ(s->messages()[0].welcome().run_id(), "run1");
    EXPECT_EQ(s->messages()[0].welcome().deadline_ms(), 2000);
    EXPECT_TRUE(s->messages()[0].welcome().batch_repeat());
  }
}

TEST_F(RelayTest, TwoSidecarsMergeIntoOneManifestWithPerRankDetailThenRepeatForm) {
  // node0: rank 1 lacks param b. node1: nobody has c.
  Submit(a_, NodeManifest(0, {0, 1}, {true, true, false}, {{1, {true, false, false}}}));
  EXPECT_TRUE(up_.manifests().empty()) << "waits for node1";
  Submit(b_, NodeManifest(0, {2, 3}, {true, true, false}));
  ASSERT_EQ(up_.manifests().size(), 1u);
  const v1::Manifest m = up_.manifests()[0];
  EXPECT_EQ(m.step(), 0);
  EXPECT_FALSE(m.repeat());
  EXPECT_TRUE(m.rank_bits().empty()) << "covers every announced rank";
  EXPECT_EQ(m.used_bits(), wire::PackBits({true, true, false}));
  ASSERT_EQ(m.rank_detail_size(), 1);
  EXPECT_EQ(m.rank_detail(0).rank(), 1);
  EXPECT_EQ(m.rank_detail(0).used_bits(), wire::PackBits({true, false, false}));

  // Step 1: the same content, in repeat form from both sidecars.
  for (Relay::SessionId id : {a_, b_}) {
    v1::Manifest r;
    r.set_group_id("g");
    r.set_step(1);
    r.set_repeat(true);
    r.set_cache_key(
        id == a_
            ? NodeManifest(0, {0, 1}, {true, true, false}, {{1, {true, false, false}}}).cache_key()
            : NodeManifest(0, {2, 3}, {true, true, false}).cache_key());
    Submit(id, r);
  }
  ASSERT_EQ(up_.manifests().size(), 2u);
  EXPECT_TRUE(up_.manifests()[1].repeat());
  EXPECT_EQ(up_.manifests()[1].cache_key(), m.cache_key());
  EXPECT_EQ(up_.manifests()[1].step(), 1);
}

v1::Manifest RepeatOf(const v1::Manifest& m, int64_t step) {
  v1::Manifest r;
  r.set_group_id(m.group_id());
  r.set_step(step);
  r.set_repeat(true);
  r.set_cache_key(m.cache_key());
  return r;
}

TEST_F(RelayTest, ABatchThatRepeatsThePreviousGoesUpAsOneBatchRepeatWhenOffered) {
  Welcome(2000, /*batch_repeat=*/true);
  const v1::Manifest a = NodeManifest(0, {0, 1}, {true, false, true});
  const v1::Manifest b = NodeManifest(0, {2, 3}, {true, true, false});
  Submit(a_, a);
  Submit(b_, b);
  ASSERT_EQ(up_.manifests().size(), 1u);
  const v1::Manifest merged = up_.manifests()[0];
  ASSERT_FALSE(merged.repeat());
  // Steps 1 and 2 repeat it: one batch repeat record each, keyed as the
  // coordinator keys the stream's previous batch.
  wire::BatchKeyHasher hasher;
  hasher.Add("g", merged.cache_key());
  for (int64_t step = 1; step <= 2; ++step) {
    up_.sent.clear();
    Submit(a_, RepeatOf(a, step));
    Submit(b_, RepeatOf(b, step));
    ASSERT_EQ(up_.sent.size(), 1u) << step;
    const v1::ManifestBatch& got = up_.sent[0].manifests();
    EXPECT_EQ(got.manifests_size(), 0) << step;
    EXPECT_EQ(got.repeat_step(), step);
    EXPECT_EQ(got.repeat_batch_key(), hasher.Finish());
  }
  EXPECT_EQ(relay_->stats().batch_repeats_up, 2);
  // Changed usage on node1: the full merged form goes, and becomes the record.
  up_.sent.clear();
  Submit(a_, RepeatOf(a, 3));
  Submit(b_, NodeManifest(3, {2, 3}, {true, true, true}));
  ASSERT_EQ(up_.manifests().size(), 1u);
  EXPECT_FALSE(up_.manifests()[0].repeat());
  EXPECT_EQ(up_.sent[0].manifests().repeat_batch_key(), 0u);

  // A new upstream stream: nothing in batch-repeat form until its Welcome
  // offers it again.
  relay_->OnUpstreamConnected();
  up_.sent.clear();
  Submit(a_, RepeatOf(a, 4));
  Submit(b_, RepeatOf(NodeManifest(0, {2, 3}, {true, true, true}), 4));
  ASSERT_EQ(up_.manifests().size(), 1u);
  EXPECT_EQ(up_.sent[0].manifests().repeat_batch_key(), 0u);
  EXPECT_EQ(relay_->stats().batch_repeats_up, 2);
}

TEST_F(RelayTest, RepeatedPartsReuseTheLastMergeUntilTheRanksChange) {
  const v1::Manifest a = NodeManifest(0, {0, 1}, {true, false, true});
  const v1::Manifest b = NodeManifest(0, {2, 3}, {true, true, false});
  Submit(a_, a);
  Submit(b_, b);
  const v1::Manifest merged = up_.manifests()[0];
  for (int64_t step = 1; step <= 3; ++step) {
    // Either order: the parts are the same set.
    Submit(step % 2 ? a_ : b_, RepeatOf(step % 2 ? a : b, step));
    Submit(step % 2 ? b_ : a_, RepeatOf(step % 2 ? b : a, step));
  }
  ASSERT_EQ(up_.manifests().size(), 4u);
  for (int i = 1; i < 4; ++i) {
    EXPECT_TRUE(up_.manifests()[i].repeat()) << i;
    EXPECT_EQ(up_.manifests()[i].cache_key(), merged.cache_key()) << i;
  }
  // Step 0's parts were full forms with the same keys: steps 1-3 reuse it.
  EXPECT_EQ(relay_->stats().merges_reused, 3);
  // Rank 3 leaves: node1 now names its one rank, so the relay merges again
  // and sends the new content in full form, naming the ranks it covers.
  v1::NodeMessage leave;
  leave.mutable_rank_event()->set_rank(3);
  leave.mutable_rank_event()->set_joined(false);
  relay_->HandleMessage(b_, leave);
  const v1::Manifest b2 = NodeManifest(4, {2}, {true, true, false}, {}, /*with_ranks=*/true);
  Submit(a_, RepeatOf(a, 4));
  Submit(b_, b2);
  ASSERT_EQ(up_.manifests().size(), 5u);
  const v1::Manifest after = up_.manifests()[4];
  EXPECT_FALSE(after.repeat());
  EXPECT_NE(after.cache_key(), merged.cache_key());
  EXPECT_EQ(relay_->stats().merges_reused, 3);
  // ... and the new merge is reused from then on.
  Submit(a_, RepeatOf(a, 5));
  Submit(b_, RepeatOf(b2, 5));
  ASSERT_EQ(up_.manifests().size(), 6u);
  EXPECT_TRUE(up_.manifests()[5].repeat());
  EXPECT_EQ(up_.manifests()[5].cache_key(), after.cache_key());
  EXPECT_EQ(relay_->stats().merges_reused, 4);
}

v1::NodeMessage BatchRepeatOf(const std::vector<v1::Manifest>& previous, int64_t step) {
  wire::BatchKeyHasher hasher;
  for (const v1::Manifest& m : previous) hasher.Add(m.group_id(), m.cache_key());
  v1::NodeMessage msg;
  msg.mutable_manifests()->set_repeat_step(step);
  msg.mutable_manifests()->set_repeat_batch_key(hasher.Finish());
  return msg;
}

TEST_F(RelayTest, ASidecarsBatchRepeatStandsForItsPreviousBatch) {
  const v1::Manifest a = NodeManifest(0, {0, 1}, {true, false, true});
  const v1::Manifest b = NodeManifest(0, {2, 3}, {true, true, false});
  Submit(a_, a);
  Submit(b_, b);
  const v1::Manifest merged = up_.manifests()[0];
  // Steps 1-2: both sidecars send 16-byte batch repeats; the relay expands
  // each into its previous batch at the new step.
  for (int64_t step = 1; step <= 2; ++step) {
    relay_->HandleMessage(a_, BatchRepeatOf({a}, step));
    relay_->HandleMessage(b_, BatchRepeatOf({b}, step));
  }
  ASSERT_EQ(up_.manifests().size(), 3u);
  for (int i = 1; i < 3; ++i) {
    EXPECT_TRUE(up_.manifests()[i].repeat()) << i;
    EXPECT_EQ(up_.manifests()[i].step(), i);
    EXPECT_EQ(up_.manifests()[i].cache_key(), merged.cache_key());
  }
  EXPECT_EQ(relay_->stats().node_manifests_in, 6);
  // A batch repeat whose key is not the stream's previous batch is refused
  // with an error naming both keys; nothing goes up.
  relay_->HandleMessage(a_, BatchRepeatOf({b}, 3));
  ASSERT_FALSE(sink_a_.messages().empty());
  const v1::CoordinatorMessage e = sink_a_.messages().back();
  ASSERT_TRUE(e.has_error());
  EXPECT_EQ(e.error().kind(), v1::INVALID_REQUEST);
  EXPECT_THAT(e.error().message(), ::testing::HasSubstr("disagree on the stream's history"));
  EXPECT_EQ(up_.manifests().size(), 3u);
  // A new stream of node0 starts without a previous batch.
  sink_a_.Clear();
  relay_->CloseSession(a_);
  a_ = Join("node0", {0, 1}, &sink_a_);
  relay_->HandleMessage(a_, BatchRepeatOf({a}, 3));
  ASSERT_FALSE(sink_a_.messages().empty());
  EXPECT_TRUE(sink_a_.messages().back().has_error());
}

TEST_F(RelayTest, NoBatchRepeatUpstreamUnlessTheWelcomeOffersIt) {
  const v1::Manifest a = NodeManifest(0, {0, 1}, {true, false, true});
  const v1::Manifest b = NodeManifest(0, {2, 3}, {true, true, false});
  Submit(a_, a);
  Submit(b_, b);
  for (int64_t step = 1; step <= 2; ++step) {
    Submit(a_, RepeatOf(a, step));
    Submit(b_, RepeatOf(b, step));
  }
  ASSERT_EQ(up_.manifests().size(), 3u);
  EXPECT_TRUE(up_.manifests()[2].repeat());
  EXPECT_EQ(relay_->stats().batch_repeats_up, 0);
}

TEST_F(RelayTest, DecisionsFanOutAsOneSharedMessageToEverySidecar) {
  Submit(a_, NodeManifest(0, {0, 1}, {true, true, true}));
  Submit(b_, NodeManifest(0, {2, 3}, {true, true, true}));
  v1::CoordinatorMessage d;
  v1::Decision* dec = d.mutable_decisions()->add_decisions();
  dec->set_group_id("g");
  dec->set_step(0);
  dec->mutable_ok()->set_num_included(3);
  relay_->HandleCoordinatorMessage(&d);
  std::vector<const v1::CoordinatorMessage*> got;
  for (FakeNodeSink* s : {&sink_a_, &sink_b_}) {
    ASSERT_EQ(s->decisions().size(), 1u);
    EXPECT_EQ(s->decisions()[0].ok().num_included(), 3);
    got.push_back(s->last_sent().get());
  }
  // One object for every stream: nothing is copied per sidecar.
  EXPECT_EQ(got[0], got[1]);
}

TEST_F(RelayTest, UnresolvableRepeatFromASidecarAsksItForTheFullForm) {
  v1::Manifest r;
  r.set_group_id("g");
  r.set_step(0);
  r.set_repeat(true);
  r.set_cache_key(1234);
  Submit(a_, r);
  ASSERT_EQ(sink_a_.decisions().size(), 1u);
  EXPECT_TRUE(sink_a_.decisions()[0].error().resend_full_form());
  EXPECT_TRUE(up_.manifests().empty());
}

TEST_F(RelayTest, AStepOnlySomeSidecarsSubmittedIsReportedPartialAtHalfTheDeadline) {
  Submit(a_, NodeManifest(0, {0, 1}, {true, true, true}));
  relay_->CheckTimers();
  EXPECT_TRUE(up_.progress().empty());
  clock_.Advance(absl::Seconds(1));
  relay_->CheckTimers();
  ASSERT_EQ(up_.progress().size(), 1u);
  const v1::NodeProgress p = up_.progress()[0];
  EXPECT_TRUE(p.partial());
  EXPECT_EQ(p.step(), 0);
  EXPECT_THAT(p.reported(), ElementsAre(0, 1));
  EXPECT_EQ(p.waited_us(), 1000000);
  relay_->CheckTimers();
  EXPECT_EQ(up_.progress().size(), 1u) << "once per step";
}

TEST_F(RelayTest, ProgressQueryIsAnsweredFromContributionsAndTheAskedSidecarNamingItsNode) {
  Submit(a_, NodeManifest(0, {0, 1}, {true, true, true}));
  v1::CoordinatorMessage q;
  q.mutable_progress_query()->set_group_id("g");
  q.mutable_progress_query()->set_step(0);
  relay_->HandleCoordinatorMessage(&q);
  // Only node1 (no contribution) is asked.
  EXPECT_TRUE(sink_a_.messages().back().has_welcome());
  ASSERT_TRUE(sink_b_.messages().back().has_progress_query());
  EXPECT_TRUE(up_.progress().empty());
  v1::NodeMessage answer;
  answer.mutable_progress()->set_group_id("g");
  answer.mutable_progress()->set_step(0);
  answer.mutable_progress()->add_reported(2);
  answer.mutable_progress()->add_ranks(2);
  answer.mutable_progress()->add_ranks(3);
  answer.mutable_progress()->add_last_steps(0);
  answer.mutable_progress()->add_last_steps(-1);
  relay_->HandleMessage(b_, answer);
  ASSERT_EQ(up_.progress().size(), 1u);
  const v1::NodeProgress p = up_.progress()[0];
  EXPECT_FALSE(p.partial());
  EXPECT_THAT(p.reported(), ElementsAre(0, 1, 2));
  EXPECT_THAT(p.ranks(), ElementsAre(2, 3));
  EXPECT_THAT(p.last_steps(), ElementsAre(0, -1));
  EXPECT_THAT(p.rank_nodes(), ElementsAre("node1", "node1"));
}

// The ranks the i-th upstream manifest covers, as the coordinator reads
// them: a repeat stands for the last full form with its key; a full form's
// rank_bits, or without them every rank the relay announced (all four).
std::vector<int> CoveredUpstream(const std::vector<v1::Manifest>& sent, size_t i) {
  const v1::Manifest* m = &sent.at(i);
  for (size_t j = i + 1; m->repeat() && j-- > 0;) {
    if (!sent[j].repeat() && sent[j].cache_key() == m->cache_key()) m = &sent[j];
  }
  if (m->repeat()) return {-1};  // unresolvable
  if (m->rank_bits().empty()) return {0, 1, 2, 3};
  absl::StatusOr<RankSet> set = wire::RankSetFromBits(m->rank_bits(), kWorld, "rank_bits");
  return set.ok() ? set->Members() : std::vector<int>{-1};
}

// A step some of the relay's ranks did not submit never goes up as if they
// had, whatever came between: a rank's leave (the coordinator keeps a rank
// that left as the relay's), a sidecar back with fewer ranks (a restart),
// or a sidecar's join after its manifest arrived.
TEST_F(RelayTest, AMergeStandsForTheRanksThatSubmittedItWhateverTheirSidecarsDidSince) {
  const std::vector<bool> used{true, true, false};
  // Rank 1 leaves node0; node0 then submits for rank 0 alone, as a sidecar
  // does (it names the rank: its announced ranks still include rank 1).
  v1::NodeMessage leave;
  leave.mutable_rank_event()->set_rank(1);
  leave.mutable_rank_event()->set_joined(false);
  leave.mutable_rank_event()->set_last_step(-1);
  relay_->HandleMessage(a_, leave);
  Submit(a_, NodeManifest(0, {0}, used, {}, /*with_ranks=*/true));
  Submit(b_, NodeManifest(0, {2, 3}, used));
  ASSERT_EQ(up_.manifests().size(), 1u);
  EXPECT_THAT(CoveredUpstream(up_.manifests(), 0), ElementsAre(0, 2, 3));

  // node0's sidecar restarts and comes back with rank 0 only: its manifests
  // without rank_bits now stand for rank 0.
  FakeNodeSink sink_a2;
  const Relay::SessionId a2 = Join("node0", {0}, &sink_a2);
  Submit(a2, NodeManifest(1, {0}, used));
  Submit(b_, NodeManifest(1, {2, 3}, used));
  ASSERT_EQ(up_.manifests().size(), 2u);
  EXPECT_THAT(CoveredUpstream(up_.manifests(), 1), ElementsAre(0, 2, 3));

  // node0's manifest of step 2 arrives before rank 1 joins node0 again: it
  // still stands for rank 0 alone when node1's part completes the step.
  Submit(a2, NodeManifest(2, {0}, used));
  v1::NodeMessage join;
  join.mutable_rank_event()->set_rank(1);
  join.mutable_rank_event()->set_joined(true);
  relay_->HandleMessage(a2, join);
  Submit(b_, NodeManifest(2, {2, 3}, used));
  ASSERT_EQ(up_.manifests().size(), 3u);
  EXPECT_THAT(CoveredUpstream(up_.manifests(), 2), ElementsAre(0, 2, 3));

  // With every rank back and submitting, the merge covers all four again.
  Submit(a2, NodeManifest(3, {0, 1}, used));
  Submit(b_, NodeManifest(3, {2, 3}, used));
  ASSERT_EQ(up_.manifests().size(), 4u);
  EXPECT_THAT(CoveredUpstream(up_.manifests(), 3), ElementsAre(0, 1, 2, 3));
}

TEST_F(RelayTest, ASidecarGonePastTheGraceHasItsRanksReportedAsLeft) {
  relay_->CloseSession(b_);
  clock_.Advance(absl::Seconds(9));
  relay_->CheckTimers();
  auto lefts = [&] {
    std::vector<int> out;
    for (const v1::NodeMessage& m : up_.sent) {
      if (m.has_rank_event() && !m.rank_event().joined()) out.push_back(m.rank_event().rank());
    }
    return out;
  };
  EXPECT_TRUE(lefts().empty()) << "still within the grace";
  clock_.Advance(absl::Seconds(1));
  relay_->CheckTimers();
  EXPECT_THAT(lefts(), ElementsAre(2, 3));
  // The coordinator knows these ranks as the relay's: the leave says which
  // sidecar was lost, and why.
  for (const v1::NodeMessage& m : up_.sent) {
    if (!m.has_rank_event() || m.rank_event().joined()) continue;
    EXPECT_EQ(m.rank_event().cause(),
              "its sidecar on node \"node1\" lost its stream to relay \"relay0\" and did not "
              "come back within 10s (the relay's --node_reconnect_grace)");
  }
  // node0 alone now completes steps by itself, naming its ranks: the
  // coordinator still counts ranks 2 and 3 as the relay's (left).
  Submit(a_, NodeManifest(0, {0, 1}, {true, true, true}));
  ASSERT_EQ(up_.manifests().size(), 1u);
  EXPECT_THAT(CoveredUpstream(up_.manifests(), 0), ElementsAre(0, 1));
}

// A rank that leaves its sidecar goes up as a leave whose cause names that
// sidecar (upstream the relay is the rank's node); a cause a relay below
// already gave is kept.
TEST_F(RelayTest, ARanksLeaveGoesUpNamingItsSidecar) {
  v1::NodeMessage left;
  left.mutable_rank_event()->set_rank(1);
  left.mutable_rank_event()->set_joined(false);
  left.mutable_rank_event()->set_last_step(4);
  relay_->HandleMessage(a_, left);
  left.mutable_rank_event()->set_rank(3);
  left.mutable_rank_event()->set_cause("said below");
  relay_->HandleMessage(b_, left);
  std::vector<v1::RankEvent> events;
  for (const v1::NodeMessage& m : up_.sent) {
    if (m.has_rank_event() && !m.rank_event().joined()) events.push_back(m.rank_event());
  }
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0].rank(), 1);
  EXPECT_EQ(events[0].last_step(), 4);
  EXPECT_EQ(events[0].cause(), "its stream to the sidecar on node \"node0\" ended");
  EXPECT_EQ(events[1].cause(), "said below");
}

TEST_F(RelayTest, AReconnectResendsOneRegistrationPerSpecAndTheUndecidedMergedManifest) {
  Submit(a_, NodeManifest(0, {0, 1}, {true, true, false}));
  Submit(b_, NodeManifest(0, {2, 3}, {true, false, false}));
  ASSERT_EQ(up_.manifests().size(), 1u);
  relay_->OnUpstreamConnected();
  int hellos = 0;
  std::vector<v1::NodeRegistration> regs;
  std::vector<v1::Manifest> resent;
  for (const v1::NodeMessage& m : up_.reset) {
    hellos += m.has_hello() ? 1 : 0;
    if (m.has_registration()) regs.push_back(m.registration());
    for (const v1::Manifest& x : m.manifests().manifests()) resent.push_back(x);
  }
  EXPECT_EQ(hellos, 1);
  ASSERT_EQ(regs.size(), 1u) << "both sidecars registered the same spec";
  EXPECT_THAT(regs[0].ranks(), ElementsAre(0, 1, 2, 3));
  ASSERT_EQ(resent.size(), 1u);
  EXPECT_FALSE(resent[0].repeat()) << "a new stream gets the full form";
  EXPECT_EQ(resent[0].SerializeAsString(), up_.manifests()[0].SerializeAsString());
}

// Decisions across a coordinator restart (docs/ARCHITECTURE.md): a relay
// resends its own last decided merge flagged `decided`, and never forwards a
// sidecar's flagged part (which stands for ranks its own merge covers).
TEST_F(RelayTest, AReconnectResendsTheLastDecidedMergeFlaggedAndASidecarsFlaggedPartStaysHere) {
  Submit(a_, NodeManifest(0, {0, 1}, {true, true, false}));
  Submit(b_, NodeManifest(0, {2, 3}, {true, false, false}));
  ASSERT_EQ(up_.manifests().size(), 1u);
  const v1::Manifest merged = up_.manifests()[0];
  DecideOk(0);
  sink_a_.Clear();
  // A sidecar's new stream to the relay resends its step 0 flagged.
  v1::Manifest part = NodeManifest(0, {0, 1}, {true, true, false});
  part.set_decided(true);
  up_.sent.clear();
  Submit(a_, part);
  EXPECT_TRUE(up_.manifests().empty()) << "a sidecar's flagged part goes no further";
  EXPECT_TRUE(sink_a_.decisions().empty()) << "and gets no answer";
  relay_->OnUpstreamConnected();
  std::vector<v1::Manifest> resent;
  for (const v1::NodeMessage& m : up_.reset) {
    for (const v1::Manifest& x : m.manifests().manifests()) resent.push_back(x);
  }
  ASSERT_EQ(resent.size(), 1u);
  EXPECT_TRUE(resent[0].decided());
  resent[0].set_decided(false);
  EXPECT_EQ(resent[0].SerializeAsString(), merged.SerializeAsString());
}

// A relay restarted after a decision reached one sidecar and not the other
// (chaos seed 8525): the sidecar that holds it resends the step flagged,
// the one that lost it resends it unflagged and waits. The relay never saw
// the step decided, so the flagged part is that sidecar's contribution: the
// step goes up whole and is decided again; before, the relay dropped the
// flagged part and waited for node0's step for ever. A step only flagged
// parts speak for has nobody waiting: no partial report, and it goes up
// flagged (also when resent on a new upstream stream).
TEST_F(RelayTest, AFlaggedPartOfAStepThisRelayNeverSawDecidedIsItsSidecarsContribution) {
  v1::Manifest held = NodeManifest(0, {0, 1}, {true, true, false});
  held.set_decided(true);
  Submit(a_, held);
  Submit(a_, NodeManifest(1, {0, 1}, {true, true, false}));
  clock_.Advance(absl::Seconds(2));
  relay_->CheckTimers();
  for (const v1::NodeProgress& p : up_.progress()) {
    EXPECT_NE(p.step(), 0) << "nobody waits for a step only flagged parts speak for";
  }
  EXPECT_TRUE(up_.manifests().empty()) << "step 0 still needs node1";
  Submit(b_, NodeManifest(0, {2, 3}, {true, false, false}));
  ASSERT_EQ(up_.manifests().size(), 1u);
  const v1::Manifest step0 = up_.manifests()[0];
  EXPECT_EQ(step0.step(), 0);
  EXPECT_FALSE(step0.decided()) << "node1's ranks wait for it";
  EXPECT_TRUE(step0.rank_bits().empty())
      << "the merge covers every rank the relay announced: both sidecars' parts";
  DecideOk(0);
  ASSERT_EQ(sink_b_.decisions().size(), 1u);
  EXPECT_EQ(sink_b_.decisions()[0].step(), 0);

  // Both sidecars hold step 1's decision: it goes up flagged, and stays so.
  up_.sent.clear();
  v1::Manifest b1 = NodeManifest(1, {2, 3}, {true, false, false});
  b1.set_decided(true);
  Submit(b_, b1);
  std::vector<v1::Manifest> up = up_.manifests();
  ASSERT_EQ(up.size(), 1u) << "node0's step 1 was in already";
  EXPECT_FALSE(up[0].decided()) << "node0's ranks wait for step 1";
  up_.sent.clear();
  v1::Manifest a2 = NodeManifest(2, {0, 1}, {true, true, false});
  a2.set_decided(true);
  v1::Manifest b2 = NodeManifest(2, {2, 3}, {true, false, false});
  b2.set_decided(true);
  Submit(a_, a2);
  Submit(b_, b2);
  up = up_.manifests();
  ASSERT_EQ(up.size(), 1u);
  EXPECT_EQ(up[0].step(), 2);
  EXPECT_TRUE(up[0].decided());
  relay_->OnUpstreamConnected();
  std::vector<v1::Manifest> resent;
  for (const v1::NodeMessage& m : up_.reset) {
    for (const v1::Manifest& x : m.manifests().manifests()) resent.push_back(x);
  }
  bool found = false;
  for (const v1::Manifest& m : resent) {
    if (m.step() != 2) continue;
    found = true;
    EXPECT_TRUE(m.decided()) << "a resend keeps the flag";
  }
  EXPECT_TRUE(found);
}

TEST_F(RelayTest, ASidecarWhoseRanksRestartedEndsTheRunForEveryOtherSidecar) {
  // node0 joined under epoch 7; it comes back NEW under epoch 8.
  FakeNodeSink again;
  const Relay::SessionId id = relay_->OpenSession(&again);
  v1::NodeMessage hello;
  hello.mutable_hello()->set_job_id("j");
  hello.mutable_hello()->set_node_id("node0");
  hello.mutable_hello()->set_world_size(kWorld);
  hello.mutable_hello()->set_run_start(v1::NodeHello::RUN_START_NEW);
  hello.mutable_hello()->set_node_epoch(8);
  hello.mutable_hello()->add_ranks(0);
  hello.mutable_hello()->add_ranks(1);
  relay_->HandleMessage(id, hello);
  for (FakeNodeSink* s : {&sink_a_, &sink_b_}) {
    ASSERT_EQ(s->errors().size(), 1u);
    EXPECT_EQ(s->errors()[0].kind(), v1::RUN_ENDED);
    EXPECT_EQ(s->errors()[0].message(),
              "job j run run1 ended: node \"node0\" started a new run of the same job id (its "
              "ranks were restarted), so this run gets no more decisions; stop the ranks of the "
              "old run");
  }
  EXPECT_EQ(up_.reconnects, 1);
  // The new run goes up NEW, for the restarted node's ranks only.
  relay_->OnUpstreamConnected();
  ASSERT_FALSE(up_.reset.empty());
  const v1::NodeHello& up_hello = up_.reset[0].hello();
  EXPECT_EQ(up_hello.run_start(), v1::NodeHello::RUN_START_NEW);
  EXPECT_THAT(up_hello.ranks(), ElementsAre(0, 1));
}

// The same when the sidecar was gone past the relay's grace first (its
// ranks reported as left, its entry dropped): it comes back NEW under
// another epoch, its ranks restarted, so the run is over (chaos seed 5837:
// a restarted rank, taken for the old one coming back, rejoined the run it
// had left at step 2, submitted step 0 and waited for it past the bound).
TEST_F(RelayTest, ASidecarDroppedPastTheGraceThatComesBackUnderAnotherEpochEndsTheRun) {
  auto hello = [](uint64_t epoch) {
    v1::NodeMessage h;
    h.mutable_hello()->set_job_id("j");
    h.mutable_hello()->set_node_id("node0");
    h.mutable_hello()->set_world_size(kWorld);
    h.mutable_hello()->set_run_start(v1::NodeHello::RUN_START_NEW);
    h.mutable_hello()->set_node_epoch(epoch);
    h.mutable_hello()->add_ranks(0);
    h.mutable_hello()->add_ranks(1);
    return h;
  };
  relay_->CloseSession(a_);
  clock_.Advance(absl::Seconds(11));
  relay_->CheckTimers();  // node0 dropped: ranks 0 and 1 reported as left
  EXPECT_TRUE(sink_b_.errors().empty());
  FakeNodeSink restarted;
  relay_->HandleMessage(relay_->OpenSession(&restarted), hello(8));
  ASSERT_EQ(sink_b_.errors().size(), 1u);
  EXPECT_EQ(sink_b_.errors()[0].kind(), v1::RUN_ENDED);
  EXPECT_THAT(sink_b_.errors()[0].message(),
              ::testing::HasSubstr("node \"node0\" started a new run of the same job id"));
  EXPECT_EQ(up_.reconnects, 1);
}

// A sidecar that comes back past the grace (its ranks reported as left)
// resuming the run resends a step the group decided without it. Every such
// manifest gets an answer (chaos seed 34: a restarted sidecar's ranks waited
// for step 0 for ever while the job had failed at step 1): the job's error
// when the group's last decision is one, else STEP_REGRESSION naming it; the
// last decided step gets its decision again.
TEST_F(RelayTest, AStepDecidedWithoutASidecarBackPastTheGraceIsAnsweredNeverDropped) {
  auto decide = [&](int64_t step, bool ok) {
    v1::CoordinatorMessage m;
    v1::Decision* d = m.mutable_decisions()->add_decisions();
    d->set_group_id("g");
    d->set_step(step);
    if (ok) {
      d->mutable_ok()->set_wire_dtype(v1::FLOAT32);
    } else {
      *d->mutable_error() = KindedError(v1::MISSING_RANKS, "job j group \"g\" step 1: rank 0 left");
      d->mutable_error()->set_step(step);
    }
    relay_->HandleCoordinatorMessage(&m);
  };
  auto come_back = [&](FakeNodeSink* sink) {
    v1::NodeMessage h;
    h.mutable_hello()->set_job_id("j");
    h.mutable_hello()->set_node_id("node0");
    h.mutable_hello()->set_world_size(kWorld);
    h.mutable_hello()->set_run_start(v1::NodeHello::RUN_START_RESUME);
    h.mutable_hello()->set_run_id("run1");
    h.mutable_hello()->set_node_epoch(7);
    h.mutable_hello()->add_ranks(0);
    h.mutable_hello()->add_ranks(1);
    const Relay::SessionId id = relay_->OpenSession(sink);
    relay_->HandleMessage(id, h);
    return id;
  };
  Submit(a_, NodeManifest(0, {0, 1}, {true, true, true}));
  Submit(b_, NodeManifest(0, {2, 3}, {true, true, true}));
  decide(0, /*ok=*/true);
  relay_->CloseSession(a_);  // its ranks never got step 0's decision
  clock_.Advance(absl::Seconds(11));
  relay_->CheckTimers();  // node0 dropped: ranks 0 and 1 reported as left
  Submit(b_, NodeManifest(1, {2, 3}, {true, true, true}));

  for (bool failed : {false, true}) {
    SCOPED_TRACE(failed ? "the job failed at step 1" : "step 1 decided without node0");
    decide(1, /*ok=*/!failed);
    FakeNodeSink back;
    const Relay::SessionId id = come_back(&back);
    back.Clear();
    Submit(id, NodeManifest(0, {0, 1}, {true, true, true}));
    Submit(id, NodeManifest(1, {0, 1}, {true, true, true}));
    const std::vector<v1::Decision> got = back.decisions();
    ASSERT_EQ(got.size(), 2u);
    EXPECT_EQ(got[0].step(), 0);
    ASSERT_TRUE(got[0].has_error());
    EXPECT_EQ(got[1].step(), 1);
    if (failed) {
      EXPECT_EQ(got[0].error().kind(), v1::MISSING_RANKS);
      EXPECT_EQ(got[0].error().message(), "job j group \"g\" step 1: rank 0 left");
      EXPECT_EQ(got[1].error().SerializeAsString(), got[0].error().SerializeAsString());
    } else {
      EXPECT_EQ(got[0].error().kind(), v1::STEP_REGRESSION);
      EXPECT_EQ(got[0].error().message(),
                "job j group \"g\" step 0: node \"node0\" sent it to relay \"relay0\" after the "
                "group decided step 1 without it; its ranks missed this step (was their sidecar "
                "gone past the relay's --node_reconnect_grace?)");
      EXPECT_TRUE(got[1].has_ok()) << "the last decided step is answered again";
    }
    relay_->CloseSession(id);
  }
}

TEST_F(RelayTest, TheJobsVerdictFromTheCoordinatorReachesEverySidecar) {
  v1::CoordinatorMessage verdict;
  verdict.mutable_error()->set_kind(v1::JOB_FAILED);
  verdict.mutable_error()->set_message("job j: rank 3 left; the job is failed");
  verdict.mutable_error()->set_job_failed(true);
  relay_->HandleCoordinatorMessage(&verdict);
  for (FakeNodeSink* sink : {&sink_a_, &sink_b_}) {
    const std::vector<v1::DecisionError> errors = sink->errors();
    ASSERT_EQ(errors.size(), 1u);
    EXPECT_TRUE(errors[0].job_failed());
    EXPECT_EQ(errors[0].message(), "job j: rank 3 left; the job is failed");
  }
}

TEST_F(RelayTest, ASecondJobIsRefusedWhileOneIsServed) {
  FakeNodeSink other;
  const Relay::SessionId id = relay_->OpenSession(&other);
  v1::NodeMessage hello;
  hello.mutable_hello()->set_job_id("other");
  hello.mutable_hello()->set_node_id("node9");
  hello.mutable_hello()->set_world_size(2);
  relay_->HandleMessage(id, hello);
  ASSERT_EQ(other.errors().size(), 1u);
  EXPECT_EQ(other.errors()[0].kind(), v1::LIMIT_EXCEEDED);
  EXPECT_THAT(other.errors()[0].message(), ::testing::HasSubstr("serves job j now"));
}

// The coordinator refuses such a hello (node_hello.h); a relay used to drop
// the second copy and accept it.
TEST(RelayHelloTest, AHelloAnnouncingARankTwiceIsRefusedWithTheCoordinatorsError) {
  FakeClock clock;
  FakeUpstream up;
  Relay relay(TestOptions(&clock));
  relay.SetUpstream(&up);
  relay.OnUpstreamConnected();
  FakeNodeSink twice;
  const Relay::SessionId id = relay.OpenSession(&twice);
  v1::NodeMessage hello;
  hello.mutable_hello()->set_job_id("j");
  hello.mutable_hello()->set_node_id("node0");
  hello.mutable_hello()->set_world_size(kWorld);
  hello.mutable_hello()->add_ranks(1);
  hello.mutable_hello()->add_ranks(1);
  relay.HandleMessage(id, hello);
  ASSERT_EQ(twice.errors().size(), 1u);
  EXPECT_EQ(twice.errors()[0].kind(), v1::INVALID_REQUEST);
  EXPECT_EQ(twice.errors()[0].code(), static_cast<int>(wire::CodeOfKind(v1::INVALID_REQUEST)));
  // The coordinator's own words.
  EXPECT_EQ(twice.errors()[0].message(),
            "job j: node \"node0\" announced rank 1 twice or outside 0..3");
  EXPECT_EQ(twice.messages().size(), 1u) << "no Welcome";
  EXPECT_TRUE(up.sent.empty()) << "no job started: nothing goes upstream";
  EXPECT_EQ(relay.stats().job_id, "");
}

}  // namespace
// The errors each sidecar got (messages with an error body).
std::vector<v1::DecisionError> ErrorsOf(FakeNodeSink& sink) {
  std::vector<v1::DecisionError> out;
  for (const v1::CoordinatorMessage& m : sink.messages()) {
    if (m.has_error()) out.push_back(m.error());
  }
  return out;
}

// docs/RELIABILITY.md, "Node above lost": the sidecars behind a relay hear
// from the relay, so their own loss limit never runs; the relay counts the
// coordinator's silence and, past its limit, gives every sidecar one error
// in a sidecar's words. A Welcome in time stops the clock; repeated stream
// attempts do not restart it.
TEST_F(RelayTest, ACoordinatorUnansweredPastTheLossLimitFailsEverySidecarOnceInASidecarsWords) {
  const absl::Duration limit = RelayOptions().upstream_loss_limit;
  // The stream ended; a new one is tried and not welcomed for most of the
  // limit, then welcomed.
  relay_->OnUpstreamConnected();
  clock_.Advance(limit - absl::Seconds(1));
  relay_->CheckTimers();
  Welcome(/*deadline_ms=*/2000);
  clock_.Advance(limit);
  relay_->CheckTimers();
  EXPECT_THAT(ErrorsOf(sink_a_), ::testing::IsEmpty());
  // It ends again; attempts every few seconds are one loss, counted from
  // the first.
  relay_->OnUpstreamConnected();
  for (int i = 0; i < 5; ++i) {
    clock_.Advance(limit / 6);
    relay_->OnUpstreamConnected();
    relay_->CheckTimers();
  }
  EXPECT_THAT(ErrorsOf(sink_a_), ::testing::IsEmpty());
  clock_.Advance(limit / 6);
  relay_->CheckTimers();
  for (FakeNodeSink* sink : {&sink_a_, &sink_b_}) {
    const std::vector<v1::DecisionError> errors = ErrorsOf(*sink);
    ASSERT_EQ(errors.size(), 1u);
    EXPECT_EQ(errors[0].kind(), v1::UNAVAILABLE);
    EXPECT_EQ(errors[0].job_id(), "j");
    EXPECT_EQ(errors[0].message(), UpstreamHealth::LostMessage("j", limit));
  }
  // Said once per job.
  clock_.Advance(limit * 2);
  relay_->OnUpstreamConnected();
  clock_.Advance(limit * 2);
  relay_->CheckTimers();
  EXPECT_EQ(ErrorsOf(sink_a_).size(), 1u);
}

// A job whose first sidecar arrives while the coordinator has never answered
// counts from that sidecar's hello; a limit of zero never fails it.
TEST(RelayLossLimitTest, CountsFromTheFirstSidecarAndZeroWaitsForEver) {
  for (absl::Duration limit : {absl::Seconds(5), absl::ZeroDuration()}) {
    FakeClock clock;
    FakeUpstream up;
    FakeNodeSink sink;
    RelayOptions o = TestOptions(&clock);
    o.upstream_loss_limit = limit;
    Relay relay(o);
    relay.SetUpstream(&up);
    relay.OnUpstreamConnected();
    clock.Advance(absl::Hours(1));  // no job yet: nothing counts
    const Relay::SessionId id = relay.OpenSession(&sink);
    v1::NodeMessage hello;
    hello.mutable_hello()->set_job_id("j");
    hello.mutable_hello()->set_node_id("node0");
    hello.mutable_hello()->set_world_size(kWorld);
    hello.mutable_hello()->set_run_start(v1::NodeHello::RUN_START_NEW);
    hello.mutable_hello()->add_ranks(0);
    relay.HandleMessage(id, hello);
    clock.Advance(absl::Seconds(4));
    relay.CheckTimers();
    EXPECT_THAT(ErrorsOf(sink), ::testing::IsEmpty()) << limit;
    clock.Advance(absl::Seconds(2));
    relay.CheckTimers();
    EXPECT_EQ(ErrorsOf(sink).size(), limit > absl::ZeroDuration() ? 1u : 0u) << limit;
  }
}

}  // namespace accord::daemon
