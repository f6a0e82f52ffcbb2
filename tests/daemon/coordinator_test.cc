#include "daemon/coordinator/coordinator.h"

#include <map>
#include <memory>
#include <optional>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "daemon/common/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/wire.h"
#include "tests/daemon/test_util.h"

namespace accord::daemon {
namespace {

using testing::Batch;
using testing::FakeNodeSink;
using testing::Hello;
using testing::MakeSpec;
using testing::NodeManifest;
using testing::Registration;
using testing::Repeat;

constexpr auto kBf16 = DType::kBFloat16;
constexpr auto kFp16 = DType::kFloat16;
constexpr auto kFp32 = DType::kFloat32;
constexpr std::nullopt_t kNone = std::nullopt;

// Two nodes of a world of 4: node "a" serves ranks 0,1 and node "b" ranks 2,3.
class CoordinatorTest : public ::testing::Test {
 protected:
  CoordinatorTest() : coord_(Options(), &clock_) {}

  static CoordinatorOptions Options() {
    CoordinatorOptions o;
    o.deadline = absl::Seconds(60);
    o.start_timer_thread = false;
    return o;
  }

  void Join(const std::string& job = "job1") {
    a_ = coord_.OpenSession(&sink_a_);
    b_ = coord_.OpenSession(&sink_b_);
    coord_.HandleMessage(a_, Hello(job, "a", 4, {0, 1}));
    coord_.HandleMessage(b_, Hello(job, "b", 4, {2, 3}));
  }
  void RegisterAll(const GroupSpec& spec) {
    coord_.HandleMessage(a_, Registration(spec, {0, 1}));
    coord_.HandleMessage(b_, Registration(spec, {2, 3}));
  }

  FakeClock clock_;
  Coordinator coord_;
  FakeNodeSink sink_a_, sink_b_;
  Coordinator::SessionId a_ = 0, b_ = 0;
};

TEST_F(CoordinatorTest, HelloIsWelcomed) {
  Join();
  ASSERT_FALSE(sink_a_.messages().empty());
  EXPECT_TRUE(sink_a_.messages()[0].has_welcome());
  EXPECT_TRUE(sink_b_.messages()[0].has_welcome());
}

TEST_F(CoordinatorTest, RegistrationAnsweredOnlyWhenEveryRankRegistered) {
  Join();
  GroupSpec spec = MakeSpec("g0", 3);
  coord_.HandleMessage(a_, Registration(spec, {0, 1}));
  EXPECT_TRUE(sink_a_.registrations().empty());
  coord_.HandleMessage(b_, Registration(spec, {2}));
  EXPECT_TRUE(sink_a_.registrations().empty());
  coord_.HandleMessage(b_, Registration(spec, {3}));
  for (FakeNodeSink* s : {&sink_a_, &sink_b_}) {
    ASSERT_EQ(s->registrations().size(), 1u);
    EXPECT_FALSE(s->registrations()[0].has_error());
    EXPECT_EQ(s->registrations()[0].spec_fingerprint(), SpecFingerprint(spec));
  }
}

TEST_F(CoordinatorTest, RegistrationMismatchSendsTheSameErrorToEveryNode) {
  Join();
  GroupSpec spec = MakeSpec("g0", 3);
  GroupSpec other = spec;
  other.params[1].numel = 128;
  coord_.HandleMessage(a_, Registration(spec, {0, 1}));
  coord_.HandleMessage(b_, Registration(other, {2, 3}));
  ASSERT_EQ(sink_a_.registrations().size(), 1u);
  ASSERT_EQ(sink_b_.registrations().size(), 1u);
  const v1::DecisionError ea = sink_a_.registrations()[0].error();
  const v1::DecisionError eb = sink_b_.registrations()[0].error();
  EXPECT_EQ(ea.SerializeAsString(), eb.SerializeAsString());
  EXPECT_EQ(ea.kind(), v1::REGISTRATION_MISMATCH);
  EXPECT_EQ(ea.param_index(), 1);
  EXPECT_EQ(ea.param_name(), "layer1.weight");
  EXPECT_TRUE(absl::StrContains(ea.message(), "2-3")) << ea.message();
  EXPECT_EQ(std::vector<int>(ea.ranks().begin(), ea.ranks().end()), (std::vector<int>{0, 2, 3}));
  // Manifests for the failed group get the same error.
  coord_.HandleMessage(a_, Batch({NodeManifest("g0", 0, {kBf16, kNone, kNone}, 4, {0, 1})}));
  ASSERT_EQ(sink_a_.decisions().size(), 1u);
  EXPECT_EQ(sink_a_.decisions()[0].error().kind(), v1::REGISTRATION_MISMATCH);
}

TEST_F(CoordinatorTest, PolicyMismatchIsARegistrationMismatch) {
  Join();
  GroupSpec spec = MakeSpec("g0", 2);
  Policy p;
  p.reduce_dtype = DType::kFloat32;
  coord_.HandleMessage(a_, Registration(spec, {0, 1}));
  coord_.HandleMessage(b_, Registration(spec, {2, 3}, p));
  ASSERT_EQ(sink_b_.registrations().size(), 1u);
  EXPECT_EQ(sink_b_.registrations()[0].error().kind(), v1::REGISTRATION_MISMATCH);
  EXPECT_TRUE(absl::StrContains(sink_b_.registrations()[0].error().message(), "polic"));
}

// A restarted relay resends in parts what it sent as one manifest
// (docs/ARCHITECTURE.md, "Relays"): a part naming only ranks the node already
// reported is a no-op; one overlapping them with new ranks is still an error.
TEST_F(CoordinatorTest, AResentSubsetOfANodesContributionIsANoOpAnOverlapIsAnError) {
  Join();
  RegisterAll(MakeSpec("g0", 3));
  sink_a_.Clear();
  coord_.HandleMessage(a_, Batch({NodeManifest("g0", 0, {kBf16, kNone, kNone}, 4, {0, 1})}));
  // Rank 1 alone, with other content: ignored (rank 1 is already covered).
  coord_.HandleMessage(a_, Batch({NodeManifest("g0", 0, {kFp16, kFp16, kNone}, 4, {0, 1}, {1})}));
  EXPECT_TRUE(sink_a_.decisions().empty()) << "no error, no decision yet";
  // Ranks 1 and 2 (2 belongs to node b): refused as before.
  coord_.HandleMessage(b_, Batch({NodeManifest("g0", 0, {kBf16, kNone, kNone}, 4, {2, 3}, {2})}));
  coord_.HandleMessage(b_,
                       Batch({NodeManifest("g0", 0, {kBf16, kNone, kNone}, 4, {2, 3}, {2, 3})}));
  ASSERT_EQ(sink_b_.decisions().size(), 1u);
  EXPECT_EQ(sink_b_.decisions()[0].error().kind(), v1::INVALID_MANIFEST);
  EXPECT_TRUE(
      absl::StrContains(sink_b_.decisions()[0].error().message(), "second, different manifest"))
      << sink_b_.decisions()[0].error().message();
}

TEST_F(CoordinatorTest, DecidesOnlyWhenEveryRankIsCoveredAndBroadcasts) {
  Join();
  RegisterAll(MakeSpec("g0", 3));
  sink_a_.Clear();
  sink_b_.Clear();
  coord_.HandleMessage(a_, Batch({NodeManifest("g0", 0, {kBf16, kNone, kNone}, 4, {0, 1})}));
  EXPECT_TRUE(sink_a_.decisions().empty());
  coord_.HandleMessage(b_, Batch({NodeManifest("g0", 0, {kFp16, kFp16, kNone}, 4, {2, 3})}));
  for (FakeNodeSink* s : {&sink_a_, &sink_b_}) {
    ASSERT_EQ(s->decisions().size(), 1u);
    const v1::Decision d = s->decisions()[0];
    ASSERT_TRUE(d.has_ok()) << d.DebugString();
    EXPECT_EQ(d.ok().wire_dtype(), v1::FLOAT32);  // bf16 v fp16
    EXPECT_EQ(d.ok().num_included(), 2);
    EXPECT_EQ(d.ok().included_bits(), std::string(1, '\x03'));
    EXPECT_FALSE(d.same_as_previous());
  }
}

TEST_F(CoordinatorTest, ExplicitRankBitsCoverPartOfANode) {
  Join();
  RegisterAll(MakeSpec("g0", 1));
  sink_a_.Clear();
  coord_.HandleMessage(a_, Batch({NodeManifest("g0", 0, {kBf16}, 4, {0, 1}, {0})}));
  coord_.HandleMessage(b_, Batch({NodeManifest("g0", 0, {kBf16}, 4, {2, 3})}));
  EXPECT_TRUE(sink_a_.decisions().empty());  // rank 1 not yet covered
  coord_.HandleMessage(a_, Batch({NodeManifest("g0", 0, {kNone}, 4, {0, 1}, {1})}));
  ASSERT_EQ(sink_a_.decisions().size(), 1u);
  EXPECT_TRUE(sink_a_.decisions()[0].has_ok());
}

TEST_F(CoordinatorTest, RepeatedManifestsGetSameAsPreviousAndCountCacheHits) {
  Join();
  RegisterAll(MakeSpec("g0", 2));
  v1::Manifest ma = NodeManifest("g0", 0, {kBf16, kNone}, 4, {0, 1});
  v1::Manifest mb = NodeManifest("g0", 0, {kBf16, kNone}, 4, {2, 3});
  coord_.HandleMessage(a_, Batch({ma}));
  coord_.HandleMessage(b_, Batch({mb}));
  sink_a_.Clear();
  coord_.HandleMessage(a_, Batch({Repeat("g0", 1, ma.cache_key())}));
  coord_.HandleMessage(b_, Batch({Repeat("g0", 1, mb.cache_key())}));
  ASSERT_EQ(sink_a_.decisions().size(), 1u);
  EXPECT_TRUE(sink_a_.decisions()[0].same_as_previous());
  EXPECT_FALSE(sink_a_.decisions()[0].has_ok());
  EXPECT_EQ(sink_a_.decisions()[0].step(), 1);
  CoordinatorStats st = coord_.stats();
  EXPECT_EQ(st.cache_hits, 2);
  EXPECT_EQ(st.cache_misses, 2);
  EXPECT_EQ(st.same_as_previous, 1);
  EXPECT_EQ(st.decisions, 2);
}

TEST_F(CoordinatorTest, OneFullManifestAmongRepeatsGivesAFullDecision) {
  Join();
  RegisterAll(MakeSpec("g0", 2));
  v1::Manifest ma = NodeManifest("g0", 0, {kBf16, kNone}, 4, {0, 1});
  coord_.HandleMessage(a_, Batch({ma}));
  coord_.HandleMessage(b_, Batch({NodeManifest("g0", 0, {kBf16, kNone}, 4, {2, 3})}));
  sink_a_.Clear();
  coord_.HandleMessage(a_, Batch({Repeat("g0", 1, ma.cache_key())}));
  coord_.HandleMessage(b_, Batch({NodeManifest("g0", 1, {kBf16, kBf16}, 4, {2, 3})}));
  ASSERT_EQ(sink_a_.decisions().size(), 1u);
  ASSERT_TRUE(sink_a_.decisions()[0].has_ok());
  EXPECT_EQ(sink_a_.decisions()[0].ok().num_included(), 2);
}

TEST_F(CoordinatorTest, RepeatWithUnknownKeyAsksOnlyThatNodeForTheFullForm) {
  Join();
  RegisterAll(MakeSpec("g0", 2));
  sink_a_.Clear();
  sink_b_.Clear();
  coord_.HandleMessage(a_, Batch({Repeat("g0", 0, 1234)}));
  ASSERT_EQ(sink_a_.decisions().size(), 1u);
  EXPECT_EQ(sink_a_.decisions()[0].error().kind(), v1::INVALID_MANIFEST);
  EXPECT_TRUE(absl::StrContains(sink_a_.decisions()[0].error().message(), "full form"));
  EXPECT_TRUE(sink_a_.decisions()[0].error().resend_full_form());
  EXPECT_TRUE(sink_b_.decisions().empty());
  EXPECT_EQ(coord_.stats().repeat_key_mismatches, 1);
}

TEST_F(CoordinatorTest, InvalidManifestGoesToTheSenderOnly) {
  Join();
  RegisterAll(MakeSpec("g0", 2));
  sink_b_.Clear();
  v1::Manifest bad = NodeManifest("g0", 0, {kBf16, kNone}, 4, {0, 1});
  bad.set_used_bits(std::string(3, '\x01'));
  coord_.HandleMessage(a_, Batch({bad}));
  ASSERT_EQ(sink_a_.decisions().size(), 1u);
  EXPECT_EQ(sink_a_.decisions()[0].error().kind(), v1::INVALID_MANIFEST);
  EXPECT_FALSE(sink_a_.decisions()[0].error().resend_full_form());
  EXPECT_TRUE(sink_b_.decisions().empty());
}

TEST_F(CoordinatorTest, ForeignRankBitsAreRejected) {
  Join();
  RegisterAll(MakeSpec("g0", 1));
  coord_.HandleMessage(a_, Batch({NodeManifest("g0", 0, {kBf16}, 4, {0, 1}, {2})}));
  ASSERT_EQ(sink_a_.decisions().size(), 1u);
  EXPECT_TRUE(absl::StrContains(sink_a_.decisions()[0].error().message(), "does not serve"));
}

TEST_F(CoordinatorTest, ResentIdenticalManifestIsANoOp) {
  Join();
  RegisterAll(MakeSpec("g0", 1));
  v1::Manifest ma = NodeManifest("g0", 0, {kBf16}, 4, {0, 1});
  coord_.HandleMessage(a_, Batch({ma}));
  coord_.HandleMessage(a_, Batch({ma}));  // e.g. after a reconnect
  EXPECT_TRUE(sink_a_.decisions().empty());
  coord_.HandleMessage(b_, Batch({NodeManifest("g0", 0, {kBf16}, 4, {2, 3})}));
  ASSERT_EQ(sink_a_.decisions().size(), 1u);
  EXPECT_TRUE(sink_a_.decisions()[0].has_ok());
  // A resend of the decided step is answered again, to the sender only.
  sink_b_.Clear();
  coord_.HandleMessage(a_, Batch({ma}));
  ASSERT_EQ(sink_a_.decisions().size(), 2u);
  EXPECT_TRUE(sink_a_.decisions()[1].has_ok());
  EXPECT_TRUE(sink_b_.decisions().empty());
}

TEST_F(CoordinatorTest, StepOlderThanLastDecidedIsARegression) {
  Join();
  RegisterAll(MakeSpec("g0", 1));
  coord_.HandleMessage(a_, Batch({NodeManifest("g0", 5, {kBf16}, 4, {0, 1})}));
  coord_.HandleMessage(b_, Batch({NodeManifest("g0", 5, {kBf16}, 4, {2, 3})}));
  sink_a_.Clear();
  sink_b_.Clear();
  coord_.HandleMessage(b_, Batch({NodeManifest("g0", 3, {kBf16}, 4, {2, 3})}));
  ASSERT_EQ(sink_b_.decisions().size(), 1u);
  EXPECT_EQ(sink_b_.decisions()[0].error().kind(), v1::STEP_REGRESSION);
  EXPECT_TRUE(absl::StrContains(sink_b_.decisions()[0].error().message(), "last decided step 5"));
  EXPECT_TRUE(sink_a_.decisions().empty());
}

// Decisions across a coordinator restart (docs/ARCHITECTURE.md): node b got
// step 3's decision, node a's copy was lost with its stream, and the
// coordinator lost the run's state. A fresh coordinator (this fixture's)
// gets a's step 3 as it was and b's flagged `decided`: it decides the step
// again, for a.
v1::Manifest Decided(v1::Manifest m) {
  m.set_decided(true);
  return m;
}

TEST_F(CoordinatorTest, AStepDecidedBeforeARestartIsDecidedAgainWithTheDecidedNodesManifest) {
  Join();
  RegisterAll(MakeSpec("g0", 2));
  coord_.HandleMessage(b_, Batch({Decided(NodeManifest("g0", 3, {kFp32, kBf16}, 4, {2, 3}))}));
  EXPECT_TRUE(sink_a_.decisions().empty());
  EXPECT_TRUE(sink_b_.decisions().empty());
  coord_.HandleMessage(a_, Batch({NodeManifest("g0", 3, {kBf16, kNone}, 4, {0, 1})}));
  ASSERT_EQ(sink_a_.decisions().size(), 1u);
  const v1::Decision d = sink_a_.decisions()[0];
  EXPECT_EQ(d.step(), 3);
  ASSERT_TRUE(d.has_ok()) << d.DebugString();
  EXPECT_EQ(d.ok().wire_dtype(), v1::FLOAT32) << "b's fp32 gradient counts";
  // The same decision, as a node that did not lose it already had it.
  coord_.HandleMessage(a_, Batch({NodeManifest("g0", 4, {kBf16, kNone}, 4, {0, 1})}));
  coord_.HandleMessage(b_, Batch({NodeManifest("g0", 4, {kFp32, kBf16}, 4, {2, 3})}));
  ASSERT_EQ(sink_b_.decisions().size(), 2u);
  EXPECT_EQ(sink_b_.decisions()[1].step(), 4);
  EXPECT_TRUE(sink_b_.decisions()[1].has_ok());
}

// Every node already holds the decision: the steps only flagged manifests
// speak for wait without a deadline (nobody waits for them), and a missing
// node is not named for them; the next step goes on as usual.
TEST_F(CoordinatorTest, AStepOnlyDecidedManifestsSpeakForHasNoDeadline) {
  Join();
  RegisterAll(MakeSpec("g0", 1));
  coord_.HandleMessage(a_, Batch({Decided(NodeManifest("g0", 3, {kBf16}, 4, {0, 1}))}));
  clock_.Advance(absl::Seconds(120));
  coord_.CheckDeadlines();
  EXPECT_TRUE(sink_a_.decisions().empty());
  EXPECT_TRUE(sink_b_.decisions().empty());
  coord_.HandleMessage(a_, Batch({NodeManifest("g0", 4, {kBf16}, 4, {0, 1})}));
  coord_.HandleMessage(b_, Batch({NodeManifest("g0", 4, {kBf16}, 4, {2, 3})}));
  ASSERT_EQ(sink_a_.decisions().size(), 1u);
  EXPECT_EQ(sink_a_.decisions()[0].step(), 4);
  EXPECT_TRUE(sink_a_.decisions()[0].has_ok());
}

// A node that waits for a step only flagged manifests spoke for starts its
// clock: the deadline counts from that node's manifest, and names the rest.
TEST_F(CoordinatorTest, AWaitingNodesManifestStartsTheClockOfAStepOnlyDecidedOnesSpokeFor) {
  Join();
  RegisterAll(MakeSpec("g0", 1));
  coord_.HandleMessage(a_, Batch({Decided(NodeManifest("g0", 3, {kBf16}, 4, {0, 1}))}));
  clock_.Advance(absl::Seconds(30));
  coord_.HandleMessage(a_, Batch({NodeManifest("g0", 3, {kBf16}, 4, {0, 1})}));
  coord_.HandleMessage(b_, Batch({Decided(NodeManifest("g0", 2, {kBf16}, 4, {2, 3}))}));
  clock_.Advance(absl::Seconds(59));
  coord_.CheckDeadlines();
  EXPECT_TRUE(sink_a_.decisions().empty()) << "the clock started 59 s ago, not 89";
  clock_.Advance(absl::Seconds(2));
  coord_.CheckDeadlines();
  ASSERT_EQ(sink_a_.decisions().size(), 1u);
  const v1::DecisionError e = sink_a_.decisions()[0].error();
  EXPECT_EQ(e.kind(), v1::MISSING_RANKS) << e.DebugString();
  EXPECT_EQ(e.step(), 3) << "not b's step 2, which nobody waits for";
  EXPECT_THAT(e.ranks(), ::testing::ElementsAre(2, 3));
}

// A coordinator that kept the run's state ignores a flagged manifest of a
// step it decided or of an earlier one, without an answer (an unflagged one
// gets the decision again, or STEP_REGRESSION).
TEST_F(CoordinatorTest, ADecidedManifestOfAStepDecidedHereGetsNoAnswer) {
  Join();
  RegisterAll(MakeSpec("g0", 1));
  coord_.HandleMessage(a_, Batch({NodeManifest("g0", 5, {kBf16}, 4, {0, 1})}));
  coord_.HandleMessage(b_, Batch({NodeManifest("g0", 5, {kBf16}, 4, {2, 3})}));
  sink_a_.Clear();
  sink_b_.Clear();
  coord_.HandleMessage(b_, Batch({Decided(NodeManifest("g0", 5, {kBf16}, 4, {2, 3})),
                                  Decided(NodeManifest("g0", 4, {kBf16}, 4, {2, 3}))}));
  EXPECT_TRUE(sink_b_.messages().empty());
  coord_.HandleMessage(b_, Batch({Decided(NodeManifest("g9", 5, {kBf16}, 4, {2, 3}))}));
  EXPECT_TRUE(sink_b_.messages().empty()) << "a group the node did not register";
  coord_.HandleMessage(b_, Batch({NodeManifest("g0", 5, {kBf16}, 4, {2, 3})}));
  ASSERT_EQ(sink_b_.decisions().size(), 1u);
  EXPECT_TRUE(sink_b_.decisions()[0].has_ok());
}

TEST_F(CoordinatorTest, DuplicateRankIsRefusedToTheOffender) {
  Join();
  FakeNodeSink sink_c;
  auto c = coord_.OpenSession(&sink_c);
  coord_.HandleMessage(c, Hello("job1", "c", 4, {1}));
  ASSERT_EQ(sink_c.errors().size(), 1u);
  EXPECT_EQ(sink_c.errors()[0].kind(), v1::DUPLICATE_RANK);
  EXPECT_EQ(sink_c.errors()[0].ranks(0), 1);
  EXPECT_TRUE(absl::StrContains(sink_c.errors()[0].message(), "node \"a\""));
  EXPECT_TRUE(sink_a_.errors().empty());
}

TEST_F(CoordinatorTest, WorldSizeMismatchIsPrecise) {
  Join();
  FakeNodeSink sink_c;
  auto c = coord_.OpenSession(&sink_c);
  coord_.HandleMessage(c, Hello("job1", "c", 8, {5}));
  ASSERT_EQ(sink_c.errors().size(), 1u);
  EXPECT_EQ(sink_c.errors()[0].kind(), v1::WORLD_SIZE_MISMATCH);
  EXPECT_TRUE(absl::StrContains(sink_c.errors()[0].message(), "world size 8"));
  EXPECT_TRUE(absl::StrContains(sink_c.errors()[0].message(), "world size 4"));
}

TEST_F(CoordinatorTest, ReconnectedNodeTakesItsRanksBack) {
  Join();
  coord_.CloseSession(a_);
  FakeNodeSink sink_a2;
  auto a2 = coord_.OpenSession(&sink_a2);
  coord_.HandleMessage(a2, Hello("job1", "a", 4, {0, 1}));
  ASSERT_FALSE(sink_a2.messages().empty());
  EXPECT_TRUE(sink_a2.messages()[0].has_welcome());
}

TEST_F(CoordinatorTest, DeadlineNamesMissingRanksAndTheirLastStepsAndFailsTheJob) {
  Join();
  RegisterAll(MakeSpec("g0", 1));
  RegisterAll(MakeSpec("g1", 1));
  // Step 0 decided; node a reaches step 1 in g0, node b never does.
  coord_.HandleMessage(a_, Batch({NodeManifest("g0", 0, {kBf16}, 4, {0, 1})}));
  coord_.HandleMessage(b_, Batch({NodeManifest("g0", 0, {kBf16}, 4, {2, 3})}));
  coord_.HandleMessage(a_, Batch({NodeManifest("g0", 1, {kBf16}, 4, {0, 1}),
                                  NodeManifest("g1", 1, {kBf16}, 4, {0, 1})}));
  sink_a_.Clear();
  sink_b_.Clear();
  clock_.Advance(absl::Seconds(59));
  coord_.CheckDeadlines();
  EXPECT_TRUE(sink_a_.decisions().empty());
  clock_.Advance(absl::Seconds(2));
  coord_.CheckDeadlines();
  for (FakeNodeSink* s : {&sink_a_, &sink_b_}) {
    std::vector<v1::Decision> ds = s->decisions();
    ASSERT_EQ(ds.size(), 2u);
    int missing = 0, failed = 0;
    for (const v1::Decision& d : ds) {
      if (d.error().kind() == v1::MISSING_RANKS) {
        ++missing;
        EXPECT_EQ(std::vector<int>(d.error().ranks().begin(), d.error().ranks().end()),
                  (std::vector<int>{2, 3}));
        EXPECT_EQ(
            std::vector<int64_t>(d.error().last_steps().begin(), d.error().last_steps().end()),
            (std::vector<int64_t>{0, 0}));
        EXPECT_TRUE(absl::StrContains(d.error().message(), "node \"b\"")) << d.error().message();
      } else {
        EXPECT_EQ(d.error().kind(), v1::JOB_FAILED);
        ++failed;
      }
    }
    EXPECT_EQ(missing, 1);
    EXPECT_EQ(failed, 1);
  }
  // Later manifests are refused at once: nobody waits on a failed job.
  sink_b_.Clear();
  coord_.HandleMessage(b_, Batch({NodeManifest("g0", 1, {kBf16}, 4, {2, 3})}));
  ASSERT_EQ(sink_b_.decisions().size(), 1u);
  EXPECT_EQ(sink_b_.decisions()[0].error().kind(), v1::JOB_FAILED);
}

// Two nodes of a world of 4: a (ranks 0, 1) and b (ranks 2, 3), whose
// sidecar answers progress queries; group "g". Node a submits `step`.
class CoordinatorProgressTest : public ::testing::Test {
 protected:
  void Start(absl::Duration deadline, int64_t step) {
    CoordinatorOptions o;
    o.deadline = deadline;
    o.start_timer_thread = false;
    coord_ = std::make_unique<Coordinator>(o, &clock_);
    a_ = coord_->OpenSession(&sa_);
    b_ = coord_->OpenSession(&sb_);
    v1::NodeMessage hb = Hello("j", "b", 4, {2, 3});
    hb.mutable_hello()->set_answers_progress(true);
    coord_->HandleMessage(a_, Hello("j", "a", 4, {0, 1}));
    coord_->HandleMessage(b_, hb);
    GroupSpec spec = MakeSpec("g", 1);
    coord_->HandleMessage(a_, Registration(spec, {0, 1}));
    coord_->HandleMessage(b_, Registration(spec, {2, 3}));
    coord_->HandleMessage(a_, Batch({NodeManifest("g", step, {kBf16}, 4, {0, 1})}));
    sa_.Clear();
    sb_.Clear();
  }
  FakeClock clock_;
  std::unique_ptr<Coordinator> coord_;
  FakeNodeSink sa_, sb_;
  Coordinator::SessionId a_ = 0, b_ = 0;
};

// Past the deadline the coordinator asks node b which ranks submitted, and
// names only the rank that really is missing, with the last step its sidecar
// saw from it.
TEST_F(CoordinatorProgressTest, DeadlineAsksTheNodeAndNamesOnlyTheRankThatIsMissing) {
  Start(absl::Seconds(8), /*step=*/4);
  clock_.Advance(absl::Seconds(9));
  coord_->CheckDeadlines();
  // Nobody failed yet; node b (not a: its ranks all reported) was asked.
  EXPECT_TRUE(sa_.messages().empty());
  std::vector<v1::CoordinatorMessage> asked = sb_.messages();
  ASSERT_EQ(asked.size(), 1u);
  ASSERT_TRUE(asked[0].has_progress_query());
  EXPECT_EQ(asked[0].progress_query().group_id(), "g");
  EXPECT_EQ(asked[0].progress_query().step(), 4);
  sb_.Clear();
  // Rank 2 submitted step 4; rank 3 is stuck at step 3. A claim about rank 0
  // (not b's) is ignored.
  v1::NodeMessage answer;
  v1::NodeProgress* p = answer.mutable_progress();
  p->set_group_id("g");
  p->set_step(4);
  p->add_reported(2);
  p->add_reported(0);
  p->add_ranks(2);
  p->add_last_steps(4);
  p->add_ranks(3);
  p->add_last_steps(3);
  coord_->HandleMessage(b_, answer);
  coord_->CheckDeadlines();  // the answer is complete: fails now, no grace wait
  for (FakeNodeSink* s : {&sa_, &sb_}) {
    std::vector<v1::Decision> ds = s->decisions();
    ASSERT_EQ(ds.size(), 1u);
    const v1::DecisionError& e = ds[0].error();
    EXPECT_EQ(e.kind(), v1::MISSING_RANKS);
    EXPECT_EQ(std::vector<int>(e.ranks().begin(), e.ranks().end()), (std::vector<int>{3}));
    EXPECT_EQ(std::vector<int64_t>(e.last_steps().begin(), e.last_steps().end()),
              (std::vector<int64_t>{3}));
    EXPECT_TRUE(absl::StrContains(e.message(), "rank 3 (last step 3, node \"b\")")) << e.message();
  }
}

// A node that never answers: the step fails at the end of the grace (a
// quarter of the deadline, at most 1 s), naming all of that node's ranks.
TEST_F(CoordinatorProgressTest, UnansweredQueryFailsAfterTheGraceNamingTheWholeNode) {
  Start(absl::Seconds(2), /*step=*/0);
  clock_.Advance(absl::Milliseconds(2100));
  coord_->CheckDeadlines();
  EXPECT_TRUE(sa_.decisions().empty());
  // An answer from a node that was not asked (a) does not end the grace.
  v1::NodeMessage unasked;
  unasked.mutable_progress()->set_group_id("g");
  unasked.mutable_progress()->set_step(0);
  coord_->HandleMessage(a_, unasked);
  coord_->CheckDeadlines();
  EXPECT_TRUE(sa_.decisions().empty());
  clock_.Advance(absl::Milliseconds(300));  // grace = 500 ms
  coord_->CheckDeadlines();
  EXPECT_TRUE(sa_.decisions().empty());
  clock_.Advance(absl::Milliseconds(200));
  coord_->CheckDeadlines();
  std::vector<v1::Decision> ds = sa_.decisions();
  ASSERT_EQ(ds.size(), 1u);
  EXPECT_EQ(ds[0].error().kind(), v1::MISSING_RANKS);
  EXPECT_EQ(std::vector<int>(ds[0].error().ranks().begin(), ds[0].error().ranks().end()),
            (std::vector<int>{2, 3}));
}

// One node (ranks 0, 1) whose rank 1 never submits step 3: no node manifest
// goes up, only the sidecar's partial-step report, which starts the clock at
// the node's first submission (1.5 s before it arrived).
TEST(CoordinatorPartialProgressTest, PartialReportStartsTheClockAtTheNodesFirstSubmission) {
  FakeClock clock;
  CoordinatorOptions o;
  o.deadline = absl::Seconds(2);
  o.start_timer_thread = false;
  Coordinator coord(o, &clock);
  FakeNodeSink sa;
  auto a = coord.OpenSession(&sa);
  v1::NodeMessage hello = Hello("j", "a", 2, {0, 1});
  hello.mutable_hello()->set_answers_progress(true);
  coord.HandleMessage(a, hello);
  ASSERT_FALSE(sa.messages().empty());
  EXPECT_EQ(sa.messages()[0].welcome().deadline_ms(), 2000);
  coord.HandleMessage(a, Registration(MakeSpec("g", 1), {0, 1}));
  sa.Clear();
  v1::NodeMessage partial;
  v1::NodeProgress* p = partial.mutable_progress();
  p->set_group_id("g");
  p->set_step(3);
  p->set_partial(true);
  p->set_waited_us(1500000);
  p->add_reported(0);
  coord.HandleMessage(a, partial);
  clock.Advance(absl::Milliseconds(400));
  coord.CheckDeadlines();
  EXPECT_TRUE(sa.messages().empty()) << "asked before the deadline";
  clock.Advance(absl::Milliseconds(200));  // 2.1 s after the first submission
  coord.CheckDeadlines();
  std::vector<v1::CoordinatorMessage> asked = sa.messages();
  ASSERT_EQ(asked.size(), 1u);
  ASSERT_TRUE(asked[0].has_progress_query());
  EXPECT_EQ(asked[0].progress_query().step(), 3);
  sa.Clear();
  v1::NodeMessage answer;
  p = answer.mutable_progress();
  p->set_group_id("g");
  p->set_step(3);
  p->add_reported(0);
  p->add_ranks(0);
  p->add_last_steps(3);
  p->add_ranks(1);
  p->add_last_steps(2);
  coord.HandleMessage(a, answer);
  coord.CheckDeadlines();
  std::vector<v1::Decision> ds = sa.decisions();
  ASSERT_EQ(ds.size(), 1u);
  const v1::DecisionError& e = ds[0].error();
  EXPECT_EQ(e.kind(), v1::MISSING_RANKS);
  EXPECT_EQ(std::vector<int>(e.ranks().begin(), e.ranks().end()), std::vector<int>{1});
  EXPECT_EQ(e.message(),
            "job j group \"g\" step 3: not every rank reported within 2s of the step's first "
            "submission (--deadline); missing ranks 1: rank 1 (last step 2, node \"a\"); ranks 0 "
            "submitted it. Check the missing ranks' processes and their sidecars' logs; the job "
            "is failed");
}

// A partial report for a step already decided, for an unknown group, or
// claiming ranks of another node changes nothing.
TEST(CoordinatorPartialProgressTest, StaleOrForeignPartialReportsAreIgnored) {
  FakeClock clock;
  CoordinatorOptions o;
  o.deadline = absl::Seconds(2);
  o.start_timer_thread = false;
  Coordinator coord(o, &clock);
  FakeNodeSink sa, sb;
  auto a = coord.OpenSession(&sa);
  auto b = coord.OpenSession(&sb);
  coord.HandleMessage(a, Hello("j", "a", 2, {0}));
  coord.HandleMessage(b, Hello("j", "b", 2, {1}));
  GroupSpec spec = MakeSpec("g", 1);
  coord.HandleMessage(a, Registration(spec, {0}));
  coord.HandleMessage(b, Registration(spec, {1}));
  coord.HandleMessage(a, Batch({NodeManifest("g", 0, {kBf16}, 2, {0})}));
  coord.HandleMessage(b, Batch({NodeManifest("g", 0, {kBf16}, 2, {1})}));
  sa.Clear();
  sb.Clear();
  for (auto [group, step] : {std::pair<std::string, int64_t>{"g", 0}, {"nope", 1}}) {
    v1::NodeMessage partial;
    partial.mutable_progress()->set_group_id(group);
    partial.mutable_progress()->set_step(step);
    partial.mutable_progress()->set_partial(true);
    partial.mutable_progress()->add_reported(0);
    coord.HandleMessage(a, partial);
  }
  clock.Advance(absl::Seconds(10));
  coord.CheckDeadlines();
  EXPECT_TRUE(sa.messages().empty());
  EXPECT_TRUE(sb.messages().empty());
}

TEST(CoordinatorTimerTest, TimerThreadFiresTheDeadlineOnTheInjectedClock) {
  FakeClock clock;
  CoordinatorOptions o;
  o.deadline = absl::Seconds(10);
  Coordinator coord(o, &clock);
  FakeNodeSink sa, sb;
  auto a = coord.OpenSession(&sa);
  auto b = coord.OpenSession(&sb);
  coord.HandleMessage(a, Hello("j", "a", 2, {0}));
  coord.HandleMessage(b, Hello("j", "b", 2, {1}));
  GroupSpec spec = MakeSpec("g", 1);
  coord.HandleMessage(a, Registration(spec, {0}));
  coord.HandleMessage(b, Registration(spec, {1}));
  coord.HandleMessage(a, Batch({NodeManifest("g", 0, {kBf16}, 2, {0})}));
  clock.Advance(absl::Seconds(11));
  sb.AwaitDecisions(1);
  ASSERT_EQ(sb.decisions().size(), 1u);
  EXPECT_EQ(sb.decisions()[0].error().kind(), v1::MISSING_RANKS);
  EXPECT_EQ(sb.decisions()[0].error().ranks(0), 1);
  EXPECT_EQ(sb.decisions()[0].error().last_steps(0), -1);
  coord.Stop();
}

v1::NodeMessage RankLeft(int rank, int64_t last_step) {
  v1::NodeMessage left;
  left.mutable_rank_event()->set_rank(rank);
  left.mutable_rank_event()->set_joined(false);
  left.mutable_rank_event()->set_last_step(last_step);
  return left;
}

// Rank 3 leaves while step 0 waits for it: the job fails at once, naming
// rank 3 only. Rank 2 (connected, not submitted yet) is no culprit, and the
// leave's last step (7, over all of the rank's groups) is not the group's.
TEST_F(CoordinatorTest, RankLeavingFailsPendingStepsThatNeedItAtOnceNamingOnlyIt) {
  Join();
  RegisterAll(MakeSpec("g0", 1));
  coord_.HandleMessage(a_, Batch({NodeManifest("g0", 0, {kBf16}, 4, {0, 1})}));
  coord_.HandleMessage(b_, RankLeft(3, 7));
  for (FakeNodeSink* s : {&sink_a_, &sink_b_}) {
    ASSERT_EQ(s->decisions().size(), 1u);
    const v1::DecisionError e = s->decisions()[0].error();
    EXPECT_EQ(e.kind(), v1::MISSING_RANKS);
    EXPECT_EQ(e.message(),
              "job job1 group \"g0\" step 0: rank 3 left (its stream to the sidecar on node \"b\" "
              "ended); missing ranks 3: rank 3 (last step -1, node \"b\"); ranks 0-1 submitted "
              "it; not yet heard from ranks 2, which are still connected. Check the missing "
              "ranks' processes and their sidecars' logs; the job is failed");
    EXPECT_THAT(e.ranks(), ::testing::ElementsAre(3));
    EXPECT_THAT(e.last_steps(), ::testing::ElementsAre(-1));
  }
}

// A leave that says why (from a relay: the rank's node is the relay) is
// named in those words, cut to 256 bytes.
TEST_F(CoordinatorTest, ALeavesCauseNamesTheFailure) {
  Join();
  RegisterAll(MakeSpec("g0", 1));
  coord_.HandleMessage(a_, Batch({NodeManifest("g0", 0, {kBf16}, 4, {0, 1})}));
  v1::NodeMessage left = RankLeft(3, 7);
  left.mutable_rank_event()->set_cause("its sidecar on node \"n7\" was lost" +
                                       std::string(400, '.'));
  coord_.HandleMessage(b_, left);
  ASSERT_EQ(sink_a_.decisions().size(), 1u);
  const std::string message = sink_a_.decisions()[0].error().message();
  const std::string expected_start =
      "job job1 group \"g0\" step 0: rank 3 left (its sidecar on "
      "node \"n7\" was lost";
  EXPECT_EQ(message.substr(0, expected_start.size()), expected_start) << message;
  const std::string cut = "its sidecar on node \"n7\" was lost" + std::string(400, '.');
  EXPECT_THAT(message, ::testing::HasSubstr(cut.substr(0, 256) + "); missing ranks 3")) << message;
}

// The guard's group ("~seq") is many steps ahead of "g0": a missing rank's
// last step is its step of "g0", and it skipped nothing.
TEST_F(CoordinatorTest, MissingRankLastStepIsItsStepOfTheFailedGroupNotOfAnother) {
  Join();
  RegisterAll(MakeSpec("g0", 1));
  RegisterAll(MakeSpec("~seq", 1));
  for (int64_t step = 0; step <= 15; ++step) {
    for (int node = 0; node < 2; ++node) {
      const std::vector<int> ranks = node == 0 ? std::vector<int>{0, 1} : std::vector<int>{2, 3};
      std::vector<v1::Manifest> batch = {NodeManifest("~seq", step, {kBf16}, 4, ranks)};
      if (step <= 1) batch.push_back(NodeManifest("g0", step, {kBf16}, 4, ranks));
      coord_.HandleMessage(node == 0 ? a_ : b_, Batch(batch));
    }
  }
  sink_a_.Clear();
  coord_.HandleMessage(a_, Batch({NodeManifest("g0", 2, {kBf16}, 4, {0, 1})}));
  coord_.HandleMessage(b_, Batch({NodeManifest("g0", 2, {kBf16}, 4, {2, 3}, {2})}));
  coord_.HandleMessage(b_, RankLeft(3, 15));
  ASSERT_EQ(sink_a_.decisions().size(), 1u);
  const v1::DecisionError e = sink_a_.decisions()[0].error();
  EXPECT_EQ(e.message(),
            "job job1 group \"g0\" step 2: rank 3 left (its stream to the sidecar on node \"b\" "
            "ended); missing ranks 3: rank 3 (last step 1, node \"b\"); ranks 0-2 submitted it. "
            "Check the missing ranks' processes and their sidecars' logs; the job is failed");
  EXPECT_THAT(e.last_steps(), ::testing::ElementsAre(1));
}

// "Skipped" only for a rank known to have submitted a later step of the
// same group: rank 3 submitted step 3 of "g0" but not step 2.
TEST_F(CoordinatorTest, SkippedIsSaidOnlyOfARankThatSubmittedALaterStepOfTheGroup) {
  Join();
  RegisterAll(MakeSpec("g0", 1));
  coord_.HandleMessage(a_, Batch({NodeManifest("g0", 2, {kBf16}, 4, {0, 1})}));
  coord_.HandleMessage(b_, Batch({NodeManifest("g0", 2, {kBf16}, 4, {2, 3}, {2})}));
  coord_.HandleMessage(b_, Batch({NodeManifest("g0", 3, {kBf16}, 4, {2, 3}, {3})}));
  coord_.HandleMessage(b_, RankLeft(3, 3));
  ASSERT_EQ(sink_a_.decisions().size(), 2u);  // step 2 names it, step 3 JOB_FAILED
  const v1::DecisionError e = sink_a_.decisions()[0].error();
  EXPECT_EQ(e.step(), 2);
  EXPECT_EQ(e.message(),
            "job job1 group \"g0\" step 2: rank 3 left (its stream to the sidecar on node \"b\" "
            "ended); missing ranks 3: rank 3 (last step 3, node \"b\", past this step: it "
            "skipped it); ranks 0-2 submitted it. Check the missing ranks' processes and their "
            "sidecars' logs; the job is failed");
}

// A rank that left between steps (so no step failed when it left) fails the
// next step the moment it starts, without waiting for the deadline, and is
// the one named; rank 2, alive but not yet at the step (e.g. blocked in a
// collective with rank 3), is not.
TEST_F(CoordinatorTest, StepAfterARankLeftBetweenStepsFailsAtOnceNamingItNotALiveRank) {
  Join();
  RegisterAll(MakeSpec("g0", 1));
  coord_.HandleMessage(a_, Batch({NodeManifest("g0", 0, {kBf16}, 4, {0, 1})}));
  coord_.HandleMessage(b_, Batch({NodeManifest("g0", 0, {kBf16}, 4, {2, 3})}));
  coord_.HandleMessage(b_, RankLeft(3, 0));  // nothing pending: nothing fails
  EXPECT_TRUE(sink_a_.decisions().size() == 1u && sink_a_.decisions()[0].has_ok());
  sink_a_.Clear();
  coord_.HandleMessage(a_, Batch({NodeManifest("g0", 1, {kBf16}, 4, {0, 1})}));
  ASSERT_EQ(sink_a_.decisions().size(), 1u);  // no clock advanced: at once
  const v1::DecisionError e = sink_a_.decisions()[0].error();
  EXPECT_EQ(e.message(),
            "job job1 group \"g0\" step 1: rank 3 left (its stream to the sidecar on node \"b\" "
            "ended); missing ranks 3: rank 3 (last step 0, node \"b\"); ranks 0-1 submitted it; "
            "not yet heard from ranks 2, which are still connected. Check the missing ranks' "
            "processes and their sidecars' logs; the job is failed");
  EXPECT_THAT(e.ranks(), ::testing::ElementsAre(3));
}

// Every wait names who is missing: a group that rank 3 never registers fails
// the job at the deadline after its first registration, with the same
// MISSING_RANKS registration result on every node naming rank 3 (node,
// connected); a pending step of another group gets it as JOB_FAILED, and
// rank 3's late registration gets the group's error.
TEST_F(CoordinatorTest, AGroupARankNeverRegistersFailsTheJobAtTheDeadlineNamingTheRank) {
  Join();
  RegisterAll(MakeSpec("g0", 1));
  const size_t agreed = sink_a_.registrations().size();
  coord_.HandleMessage(a_, Registration(MakeSpec("g1", 1), {0, 1}));  // g1's clock starts
  coord_.HandleMessage(b_, Registration(MakeSpec("g1", 1), {2}));
  clock_.Advance(absl::Seconds(30));
  coord_.HandleMessage(a_, Batch({NodeManifest("g0", 0, {kBf16}, 4, {0, 1})}));
  sink_a_.Clear();
  sink_b_.Clear();
  clock_.Advance(absl::Seconds(29));
  coord_.CheckDeadlines();
  EXPECT_TRUE(sink_a_.registrations().empty());
  EXPECT_TRUE(sink_a_.decisions().empty());
  clock_.Advance(absl::Seconds(2));
  coord_.CheckDeadlines();
  const std::string expected =
      "job job1 group \"g1\": not every rank registered the group within 1m of its first "
      "registration (--deadline); missing ranks 3: rank 3 (node \"b\", connected); ranks 0-2 "
      "registered it. Check that the missing ranks run and register this group (every rank must "
      "build and wrap the same model), their processes and their sidecars' logs; the job is "
      "failed";
  for (FakeNodeSink* s : {&sink_a_, &sink_b_}) {
    ASSERT_EQ(s->registrations().size(), 1u);
    const v1::RegistrationResult r = s->registrations()[0];
    EXPECT_EQ(r.group_id(), "g1");
    EXPECT_EQ(r.error().kind(), v1::MISSING_RANKS);
    EXPECT_EQ(r.error().code(), static_cast<int>(absl::StatusCode::kDeadlineExceeded));
    EXPECT_EQ(r.error().message(), expected);
    EXPECT_EQ(r.error().group_id(), "g1");
    EXPECT_THAT(r.error().ranks(), ::testing::ElementsAre(3));
    EXPECT_THAT(r.error().last_steps(), ::testing::ElementsAre(-1));
    ASSERT_EQ(s->decisions().size(), 1u);  // g0 step 0
    EXPECT_EQ(s->decisions()[0].error().kind(), v1::JOB_FAILED);
    EXPECT_EQ(s->decisions()[0].error().message(), expected);
  }
  EXPECT_EQ(coord_.stats().errors, 1);
  EXPECT_EQ(agreed, 1u);
  sink_b_.Clear();
  coord_.HandleMessage(b_, Registration(MakeSpec("g1", 1), {3}));
  ASSERT_EQ(sink_b_.registrations().size(), 1u);
  EXPECT_EQ(sink_b_.registrations()[0].error().message(), expected);
  EXPECT_EQ(sink_b_.registrations()[0].error().kind(), v1::MISSING_RANKS);
}

// A rank that left, one whose node's stream is down and one no sidecar ever
// announced are named with why they are not connected.
TEST_F(CoordinatorTest, ARegistrationDeadlineSaysWhyEachMissingRankIsNotConnected) {
  FakeNodeSink sink_c;
  a_ = coord_.OpenSession(&sink_a_);
  b_ = coord_.OpenSession(&sink_b_);
  const Coordinator::SessionId c = coord_.OpenSession(&sink_c);
  coord_.HandleMessage(a_, Hello("job1", "a", 6, {0, 1}));
  coord_.HandleMessage(b_, Hello("job1", "b", 6, {2, 3}));
  coord_.HandleMessage(c, Hello("job1", "c", 6, {4}));
  coord_.HandleMessage(a_, Registration(MakeSpec("g0", 1), {0}));
  coord_.HandleMessage(b_, RankLeft(3, -1));
  coord_.CloseSession(c);
  clock_.Advance(absl::Seconds(61));
  coord_.CheckDeadlines();
  ASSERT_EQ(sink_a_.registrations().size(), 1u);
  EXPECT_EQ(sink_a_.registrations()[0].error().message(),
            "job job1 group \"g0\": not every rank registered the group within 1m of its first "
            "registration (--deadline); missing ranks 1-5: rank 1 (node \"a\", connected), rank 2 "
            "(node \"b\", connected), rank 3 (node \"b\", not connected: it left its sidecar), "
            "rank 4 (node \"c\", not connected: the node's stream to the coordinator is down), "
            "rank 5 (not connected: no sidecar has announced it); ranks 0 registered it. Check "
            "that the missing ranks run and register this group (every rank must build and wrap "
            "the same model), their processes and their sidecars' logs; the job is failed");
}

// A job that fails for a missing manifest fails every registration still
// collecting (JOB_FAILED, the step's message), so no rank waits for one.
TEST_F(CoordinatorTest, AJobFailureEndsEveryRegistrationStillCollecting) {
  Join();
  RegisterAll(MakeSpec("g0", 1));
  coord_.HandleMessage(a_, Batch({NodeManifest("g0", 0, {kBf16}, 4, {0, 1})}));
  clock_.Advance(absl::Seconds(1));
  coord_.HandleMessage(a_, Registration(MakeSpec("g1", 1), {0, 1}));
  sink_a_.Clear();
  sink_b_.Clear();
  clock_.Advance(absl::Milliseconds(59500));  // past step 0's deadline, not g1's
  coord_.CheckDeadlines();
  ASSERT_EQ(sink_a_.decisions().size(), 1u);
  const v1::DecisionError step_error = sink_a_.decisions()[0].error();
  EXPECT_EQ(step_error.kind(), v1::MISSING_RANKS);
  for (FakeNodeSink* s : {&sink_a_, &sink_b_}) {
    ASSERT_EQ(s->registrations().size(), 1u);
    EXPECT_EQ(s->registrations()[0].group_id(), "g1");
    EXPECT_EQ(s->registrations()[0].error().kind(), v1::JOB_FAILED);
    EXPECT_EQ(s->registrations()[0].error().message(), step_error.message());
  }
  // A group first registered after the failure gets the job's failure too.
  sink_b_.Clear();
  coord_.HandleMessage(b_, Registration(MakeSpec("g2", 1), {2, 3}));
  ASSERT_EQ(sink_b_.registrations().size(), 1u);
  EXPECT_EQ(sink_b_.registrations()[0].group_id(), "g2");
  EXPECT_EQ(sink_b_.registrations()[0].error().kind(), v1::JOB_FAILED);
  EXPECT_EQ(sink_b_.registrations()[0].error().message(), step_error.message());
}

// The timer thread is woken for a registration's deadline.
TEST(CoordinatorTimerTest, TimerThreadFiresARegistrationDeadlineOnTheInjectedClock) {
  FakeClock clock;
  CoordinatorOptions o;
  o.deadline = absl::Seconds(5);
  Coordinator coord(o, &clock);
  FakeNodeSink sink;
  const Coordinator::SessionId s = coord.OpenSession(&sink);
  coord.HandleMessage(s, Hello("job1", "a", 2, {0, 1}));
  coord.HandleMessage(s, Registration(MakeSpec("g0", 1), {0}));
  clock.AwaitWaiters(1);
  clock.Advance(absl::Seconds(6));
  sink.AwaitRegistrations(1);
  ASSERT_EQ(sink.registrations().size(), 1u);
  EXPECT_EQ(sink.registrations()[0].error().kind(), v1::MISSING_RANKS);
  EXPECT_THAT(sink.registrations()[0].error().ranks(), ::testing::ElementsAre(1));
  coord.Stop();
}

TEST_F(CoordinatorTest, JobsNeverMix) {
  Join("job1");
  FakeNodeSink sx, sy;
  auto x = coord_.OpenSession(&sx);
  auto y = coord_.OpenSession(&sy);
  coord_.HandleMessage(x, Hello("job2", "a", 2, {0}));  // same node id, other job
  coord_.HandleMessage(y, Hello("job2", "b", 2, {1}));
  GroupSpec spec = MakeSpec("g0", 1);
  RegisterAll(spec);
  coord_.HandleMessage(x, Registration(spec, {0}));
  coord_.HandleMessage(y, Registration(spec, {1}));
  sink_a_.Clear();
  sx.Clear();
  coord_.HandleMessage(a_, Batch({NodeManifest("g0", 0, {kBf16}, 4, {0, 1})}));
  coord_.HandleMessage(x, Batch({NodeManifest("g0", 0, {kFp16}, 2, {0})}));
  EXPECT_TRUE(sink_a_.decisions().empty());
  EXPECT_TRUE(sx.decisions().empty());
  coord_.HandleMessage(y, Batch({NodeManifest("g0", 0, {kFp16}, 2, {1})}));
  ASSERT_EQ(sx.decisions().size(), 1u);
  EXPECT_EQ(sx.decisions()[0].ok().wire_dtype(), v1::FLOAT16);
  EXPECT_TRUE(sink_a_.decisions().empty());
  coord_.HandleMessage(b_, Batch({NodeManifest("g0", 0, {kBf16}, 4, {2, 3})}));
  ASSERT_EQ(sink_a_.decisions().size(), 1u);
  EXPECT_EQ(sink_a_.decisions()[0].ok().wire_dtype(), v1::BFLOAT16);
  EXPECT_EQ(sx.decisions().size(), 1u);
}

TEST_F(CoordinatorTest, SkipCountsPerRankUseNodeUsageAndRankDetail) {
  Join();
  RegisterAll(MakeSpec("g0", 2));
  // Node a: rank 0 used both, rank 1 used only param 0 (detail). Node b: only param 0.
  for (int step = 0; step < 3; ++step) {
    v1::Manifest ma = NodeManifest("g0", step, {kBf16, kBf16}, 4, {0, 1});
    v1::RankUsage* u = ma.add_rank_detail();
    u->set_rank(1);
    u->set_used_bits(std::string(1, '\x01'));
    coord_.HandleMessage(a_, Batch({ma}));
    coord_.HandleMessage(b_, Batch({NodeManifest("g0", step, {kBf16, kNone}, 4, {2, 3})}));
  }
  absl::StatusOr<SkipMatrix> m = coord_.SkipCounts("job1", "g0");
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->skips[0], (std::vector<int64_t>{0, 0}));
  EXPECT_EQ(m->skips[1], (std::vector<int64_t>{0, 3}));
  EXPECT_EQ(m->skips[2], (std::vector<int64_t>{0, 3}));
  EXPECT_EQ(m->skips[3], (std::vector<int64_t>{0, 3}));
  absl::StatusOr<std::vector<int64_t>> last = coord_.RankLastSteps("job1");
  ASSERT_TRUE(last.ok());
  EXPECT_EQ(*last, (std::vector<int64_t>{2, 2, 2, 2}));
}

TEST_F(CoordinatorTest, ManifestForUnregisteredGroupIsUnknownGroup) {
  Join();
  coord_.HandleMessage(a_, Batch({NodeManifest("nope", 0, {kBf16}, 4, {0, 1})}));
  ASSERT_EQ(sink_a_.decisions().size(), 1u);
  EXPECT_EQ(sink_a_.decisions()[0].error().kind(), v1::UNKNOWN_GROUP);
}

TEST_F(CoordinatorTest, JobStateIsDroppedWhenTheLastNodeLeaves) {
  Join();
  coord_.CloseSession(a_);
  EXPECT_EQ(coord_.stats().jobs, 1);
  coord_.CloseSession(b_);
  EXPECT_EQ(coord_.stats().jobs, 0);
  // The id can be reused with another world size.
  FakeNodeSink s;
  auto c = coord_.OpenSession(&s);
  coord_.HandleMessage(c, Hello("job1", "c", 2, {0, 1}));
  EXPECT_TRUE(s.messages()[0].has_welcome());
}

// A batch repeat record for `pairs` (group, cache key) at `step`.
v1::NodeMessage BatchRepeat(int64_t step,
                            const std::vector<std::pair<std::string, uint64_t>>& pairs) {
  wire::BatchKeyHasher hasher;
  for (const auto& [group, key] : pairs) hasher.Add(group, key);
  v1::NodeMessage m;
  m.mutable_manifests()->set_repeat_step(step);
  m.mutable_manifests()->set_repeat_batch_key(hasher.Finish());
  return m;
}

TEST_F(CoordinatorTest, BatchRepeatStandsForThePreviousBatchInRepeatForm) {
  Join();
  EXPECT_TRUE(sink_a_.messages()[0].welcome().batch_repeat());
  RegisterAll(MakeSpec("g0", 2));
  RegisterAll(MakeSpec("g1", 2));
  v1::Manifest a0 = NodeManifest("g0", 0, {kBf16, kNone}, 4, {0, 1});
  v1::Manifest a1 = NodeManifest("g1", 0, {kFp16, kFp16}, 4, {0, 1});
  v1::Manifest b0 = NodeManifest("g0", 0, {kBf16, kNone}, 4, {2, 3});
  v1::Manifest b1 = NodeManifest("g1", 0, {kNone, kFp16}, 4, {2, 3});
  coord_.HandleMessage(a_, Batch({a0, a1}));
  coord_.HandleMessage(b_, Batch({b0, b1}));
  sink_a_.Clear();
  // Step 1: node a as one record, node b per manifest; step 2: both records.
  coord_.HandleMessage(a_, BatchRepeat(1, {{"g0", a0.cache_key()}, {"g1", a1.cache_key()}}));
  coord_.HandleMessage(b_,
                       Batch({Repeat("g0", 1, b0.cache_key()), Repeat("g1", 1, b1.cache_key())}));
  coord_.HandleMessage(a_, BatchRepeat(2, {{"g0", a0.cache_key()}, {"g1", a1.cache_key()}}));
  coord_.HandleMessage(b_, BatchRepeat(2, {{"g0", b0.cache_key()}, {"g1", b1.cache_key()}}));
  std::vector<v1::Decision> d = sink_a_.decisions();
  ASSERT_EQ(d.size(), 4u);
  for (size_t i = 0; i < d.size(); ++i) {
    EXPECT_TRUE(d[i].same_as_previous()) << i;
    EXPECT_EQ(d[i].step(), i < 2 ? 1 : 2);
  }
  EXPECT_EQ(sink_b_.decisions().size(), 6u);  // step 0 as well
  CoordinatorStats st = coord_.stats();
  EXPECT_EQ(st.cache_hits, 8);
  EXPECT_EQ(st.cache_misses, 4);
  EXPECT_EQ(st.same_as_previous, 4);
  EXPECT_EQ(st.errors, 0);
}

TEST_F(CoordinatorTest, BatchRepeatThatDoesNotMatchThePreviousBatchIsAnErrorToTheSender) {
  Join();
  RegisterAll(MakeSpec("g0", 2));
  sink_a_.Clear();
  sink_b_.Clear();
  // No previous batch on this stream.
  coord_.HandleMessage(a_, BatchRepeat(0, {{"g0", 1234}}));
  ASSERT_EQ(sink_a_.messages().size(), 1u);
  EXPECT_EQ(sink_a_.messages()[0].error().kind(), v1::INVALID_REQUEST);
  v1::Manifest a0 = NodeManifest("g0", 0, {kBf16, kNone}, 4, {0, 1});
  coord_.HandleMessage(a_, Batch({a0}));
  coord_.HandleMessage(b_, Batch({NodeManifest("g0", 0, {kBf16, kNone}, 4, {2, 3})}));
  sink_a_.Clear();
  // Wrong key: names both keys, goes to the sender only, decides nothing.
  coord_.HandleMessage(a_, BatchRepeat(1, {{"g0", a0.cache_key() + 1}}));
  ASSERT_EQ(sink_a_.messages().size(), 1u);
  EXPECT_EQ(sink_a_.messages()[0].error().kind(), v1::INVALID_REQUEST);
  EXPECT_TRUE(absl::StrContains(sink_a_.messages()[0].error().message(), "previous batch"));
  EXPECT_EQ(sink_b_.decisions().size(), 1u);
  // A reconnected node starts a new stream without a previous batch.
  FakeNodeSink sink_a2;
  Coordinator::SessionId a2 = coord_.OpenSession(&sink_a2);
  coord_.HandleMessage(a2, Hello("job1", "a", 4, {0, 1}));
  coord_.HandleMessage(a2, BatchRepeat(1, {{"g0", a0.cache_key()}}));
  ASSERT_EQ(sink_a2.messages().size(), 2u);
  EXPECT_EQ(sink_a2.messages()[1].error().kind(), v1::INVALID_REQUEST);
}

}  // namespace
}  // namespace accord::daemon

namespace accord::daemon {
namespace {

// Runs (docs/ARCHITECTURE.md, "Runs").
class CoordinatorRunTest : public ::testing::Test {
 protected:
  CoordinatorRunTest() : coord_(Options(), &clock_) {}
  CoordinatorOptions Options() {
    CoordinatorOptions o;
    o.start_timer_thread = false;
    o.run_start_timeout = absl::Seconds(30);
    o.on_run_ended = [this](const std::string& job, const std::string& run, const absl::Status& why,
                            const std::string& successor) {
      ended_.push_back(absl::StrCat(job, "/", run, ": ", why.message()));
    };
    o.waits_cut = [this](const std::string& job, const std::string& scope) {
      std::vector<std::pair<int, absl::Status>> out;
      for (const auto& [key, words] : cut_) {
        if (key.first == absl::StrCat(job, "/", scope)) out.emplace_back(key.second, words);
      }
      return out;
    };
    return o;
  }
  static v1::NodeMessage NewHello(const std::string& node, std::vector<int> ranks, uint64_t epoch,
                                  const std::string& job = "job") {
    v1::NodeMessage m = testing::Hello(job, node, 2, std::move(ranks));
    m.mutable_hello()->set_run_start(v1::NodeHello::RUN_START_NEW);
    m.mutable_hello()->set_node_epoch(epoch);
    return m;
  }
  static std::string WelcomeRun(FakeNodeSink& sink) {
    for (const v1::CoordinatorMessage& m : sink.messages()) {
      if (m.has_welcome()) return m.welcome().run_id();
    }
    return "";
  }
  // A new stream of `node` saying NEW: its session, and the run it was
  // welcomed to in `run` ("" when refused).
  Coordinator::SessionId JoinNew(FakeNodeSink& sink, const std::string& node,
                                 std::vector<int> ranks, uint64_t epoch, std::string* run,
                                 const std::string& job = "job") {
    const Coordinator::SessionId s = coord_.OpenSession(&sink);
    coord_.HandleMessage(s, NewHello(node, std::move(ranks), epoch, job));
    *run = WelcomeRun(sink);
    return s;
  }

  FakeClock clock_;
  std::vector<std::string> ended_;
  // (job/scope, rank) -> the words of its key-value wait cut at the deadline
  // (what KvStore::WaitsCut answers).
  std::map<std::pair<std::string, int>, absl::Status> cut_;
  Coordinator coord_;
};

TEST_F(CoordinatorRunTest, NodesOfOneLaunchShareARunAndItEndsWithItsLastNode) {
  FakeNodeSink a, b;
  const auto sa = coord_.OpenSession(&a);
  const auto sb = coord_.OpenSession(&b);
  coord_.HandleMessage(sa, NewHello("a", {0}, 11));
  coord_.HandleMessage(sb, NewHello("b", {1}, 22));
  const std::string run = WelcomeRun(a);
  ASSERT_FALSE(run.empty());
  EXPECT_EQ(WelcomeRun(b), run);
  EXPECT_EQ(coord_.CurrentRun("job"), run);
  coord_.CloseSession(sa);
  EXPECT_TRUE(ended_.empty());
  coord_.CloseSession(sb);
  ASSERT_EQ(ended_.size(), 1u);
  EXPECT_EQ(ended_[0],
            absl::StrCat("job/", run, ": job job run ", run, " ended: its last node left"));
  EXPECT_EQ(coord_.CurrentRun("job"), "");
  EXPECT_EQ(coord_.stats().runs, 0);
}

// A node of a launch that never got its Welcome (it reached a relay, or this
// coordinator, only after the run's other streams had ended) says NEW. Moments
// after the run's last node left, that NEW takes the run's id again instead
// of starting a second run of the launch (chaos seed 3048: the two halves of
// one launch each failed naming the other). Past the node grace, or after a
// failed run, a NEW starts a new run as before.
TEST_F(CoordinatorRunTest, ANewMomentsAfterTheRunsLastNodeLeftTakesThatRunsId) {
  const absl::Duration grace = CoordinatorOptions().node_reconnect_grace;
  ASSERT_GT(grace, absl::ZeroDuration());
  FakeNodeSink a, b, a_back;
  std::string run, b_run;
  coord_.CloseSession(JoinNew(a, "a", {0}, 11, &run));  // its stream ends (cut, or stopped)
  ASSERT_FALSE(run.empty());
  EXPECT_EQ(coord_.CurrentRun("job"), "");
  clock_.Advance(grace / 2);
  const auto sb = JoinNew(b, "b", {1}, 22, &b_run);
  EXPECT_EQ(b_run, run);
  // Node a comes back and resumes the run it was welcomed to: the same one.
  const auto sab = coord_.OpenSession(&a_back);
  v1::NodeMessage resume = NewHello("a", {0}, 11);
  resume.mutable_hello()->set_run_start(v1::NodeHello::RUN_START_RESUME);
  resume.mutable_hello()->set_run_id(run);
  coord_.HandleMessage(sab, resume);
  EXPECT_EQ(WelcomeRun(a_back), run);
  EXPECT_EQ(coord_.CurrentRun("job"), run);
  coord_.CloseSession(sab);
  coord_.CloseSession(sb);

  // Past the grace: a new run.
  clock_.Advance(grace);
  FakeNodeSink c, d, e;
  std::string later, d_run, after_failure;
  const auto sc = JoinNew(c, "c", {0}, 33, &later);
  ASSERT_FALSE(later.empty());
  EXPECT_NE(later, run);

  // A failed run's id is never taken again, however soon a NEW comes.
  const auto sd = JoinNew(d, "d", {1}, 44, &d_run);
  coord_.HandleMessage(sc, testing::Registration(testing::MakeSpec("g", 2), {0}));
  clock_.Advance(CoordinatorOptions().deadline + absl::Seconds(1));
  coord_.CheckDeadlines();  // rank 1 never registered g: the run fails
  coord_.CloseSession(sc);
  coord_.CloseSession(sd);
  JoinNew(e, "e", {0}, 55, &after_failure);
  ASSERT_FALSE(after_failure.empty());
  EXPECT_NE(after_failure, later);
}

// A failed run's end drops its fresh key scope with the run's failure: a
// rank that reached the run late and waits there for keys ends with the
// words the run's other ranks got, not with "its last node left" (chaos
// seed 3048).
TEST_F(CoordinatorRunTest, AFailedRunEndsWithItsFailuresWords) {
  FakeNodeSink a, b;
  std::string run, b_run;
  const auto sa = JoinNew(a, "a", {0}, 11, &run);
  const auto sb = JoinNew(b, "b", {1}, 22, &b_run);
  coord_.HandleMessage(sa, testing::Registration(testing::MakeSpec("g", 2), {0}));
  clock_.Advance(CoordinatorOptions().deadline + absl::Seconds(1));
  coord_.CheckDeadlines();       // rank 1 never registered g: the run fails
  ASSERT_EQ(ended_.size(), 1u);  // its keys are dropped at the failure
  const std::string failure = ended_[0].substr(ended_[0].find(": ") + 2);
  EXPECT_THAT(failure, ::testing::HasSubstr("not every rank registered the group"));
  coord_.CloseSession(sa);
  coord_.CloseSession(sb);
  ASSERT_EQ(ended_.size(), 2u);
  EXPECT_EQ(ended_[1], absl::StrCat("job/", run, "/after-failure: ", failure));
}

TEST_F(CoordinatorRunTest, ANodeWhoseRanksRestartedSupersedesTheRunEvenWithAStaleStream) {
  FakeNodeSink a_old, b, a_new;
  const auto sa_old = coord_.OpenSession(&a_old);
  const auto sb = coord_.OpenSession(&b);
  coord_.HandleMessage(sa_old, NewHello("a", {0}, 11));
  coord_.HandleMessage(sb, NewHello("b", {1}, 22));
  const std::string old_run = WelcomeRun(a_old);
  // Node a's old stream lingers (never closed); its ranks come back under a
  // new epoch on a new stream.
  const auto sa_new = coord_.OpenSession(&a_new);
  b.Clear();
  coord_.HandleMessage(sa_new, NewHello("a", {0}, 33));
  const std::string new_run = WelcomeRun(a_new);
  ASSERT_FALSE(new_run.empty());
  EXPECT_NE(new_run, old_run);
  const std::string want = absl::StrCat(
      "job job run ", old_run,
      " ended: node \"a\" started a new run of the same job id (its ranks were restarted), so "
      "this run gets no more decisions; stop the ranks of the old run");
  for (FakeNodeSink* s : {&a_old, &b}) {
    ASSERT_FALSE(s->messages().empty());
    const v1::CoordinatorMessage last = s->messages().back();
    ASSERT_TRUE(last.has_error());
    EXPECT_EQ(last.error().kind(), v1::RUN_ENDED);
    EXPECT_EQ(last.error().code(), static_cast<int>(absl::StatusCode::kFailedPrecondition));
    EXPECT_EQ(last.error().message(), want);
  }
  ASSERT_EQ(ended_.size(), 1u);
  EXPECT_EQ(ended_[0], absl::StrCat("job/", old_run, ": ", want));
  // The old run's streams are detached: node b's old ranks reconnecting with
  // the old run id are refused; b's new ranks join the new run.
  FakeNodeSink b_resume;
  const auto sbr = coord_.OpenSession(&b_resume);
  v1::NodeMessage resume = NewHello("b", {1}, 22);
  resume.mutable_hello()->set_run_start(v1::NodeHello::RUN_START_RESUME);
  resume.mutable_hello()->set_run_id(old_run);
  coord_.HandleMessage(sbr, resume);
  // It gets the very error the old run's other nodes got, so every rank of
  // the old run ends with one error.
  ASSERT_EQ(b_resume.messages().size(), 1u);
  EXPECT_EQ(b_resume.messages()[0].error().kind(), v1::RUN_ENDED);
  EXPECT_EQ(b_resume.messages()[0].error().message(), want);
  FakeNodeSink b_new;
  const auto sbn = coord_.OpenSession(&b_new);
  coord_.HandleMessage(sbn, NewHello("b", {1}, 44));
  EXPECT_EQ(WelcomeRun(b_new), new_run);
  // The stale stream finally closes: the new run is untouched.
  coord_.CloseSession(sa_old);
  EXPECT_EQ(coord_.CurrentRun("job"), new_run);
}

// A run that failed and is then superseded (a node's ranks restarted) ends
// with its failure: a rank of it that is late (stopped, say) gets the words
// the run's other ranks got, not news of the restart (chaos seed 6311).
TEST_F(CoordinatorRunTest, AFailedRunSupersededByARestartEndsWithItsFailure) {
  FakeNodeSink a, b, a_new;
  std::string run, b_run, new_run;
  const auto sa = JoinNew(a, "a", {0}, 11, &run);
  JoinNew(b, "b", {1}, 22, &b_run);
  coord_.HandleMessage(sa, testing::Registration(testing::MakeSpec("g", 2), {0}));
  clock_.Advance(CoordinatorOptions().deadline + absl::Seconds(1));
  coord_.CheckDeadlines();  // rank 1 never registered g: the run fails
  std::string failure;
  for (const v1::CoordinatorMessage& m : b.messages()) {
    if (m.has_registration() && m.registration().has_error()) {
      failure = m.registration().error().message();
    }
  }
  ASSERT_THAT(failure, ::testing::HasSubstr("not every rank registered the group"));
  JoinNew(a_new, "a", {0}, 33, &new_run);  // node a's ranks restarted
  ASSERT_FALSE(new_run.empty());
  EXPECT_NE(new_run, run);
  ASSERT_FALSE(b.messages().empty());
  ASSERT_TRUE(b.messages().back().has_error());
  EXPECT_EQ(b.messages().back().error().message(), failure);
  absl::StatusOr<std::string> late = coord_.RunForKeyValue("job", {run, "b", 22});
  EXPECT_EQ(late.status().message(), failure);
}

TEST_F(CoordinatorRunTest, AHealthyRunWhoseLastNodeOnlyLostItsConnectionIsResumed) {
  FakeNodeSink a, again;
  const auto sa = coord_.OpenSession(&a);
  coord_.HandleMessage(sa, NewHello("a", {0, 1}, 11));
  const std::string run = WelcomeRun(a);
  coord_.CloseSession(sa);  // e.g. dropped by keepalive while half-open
  const auto s2 = coord_.OpenSession(&again);
  v1::NodeMessage resume = NewHello("a", {0, 1}, 11);
  resume.mutable_hello()->set_run_start(v1::NodeHello::RUN_START_RESUME);
  resume.mutable_hello()->set_run_id(run);
  coord_.HandleMessage(s2, resume);
  EXPECT_EQ(WelcomeRun(again), run);
}

TEST_F(CoordinatorRunTest, AResumedStreamKeepsItsRunAcrossACoordinatorRestart) {
  FakeNodeSink a;
  const auto sa = coord_.OpenSession(&a);
  v1::NodeMessage resume = NewHello("a", {0, 1}, 11);
  resume.mutable_hello()->set_run_start(v1::NodeHello::RUN_START_RESUME);
  resume.mutable_hello()->set_run_id("r-from-before");
  coord_.HandleMessage(sa, resume);
  EXPECT_EQ(WelcomeRun(a), "r-from-before");
}

TEST_F(CoordinatorRunTest, KeyValueRequestsShareTheRunOfTheirNodeAndAStaleOneIsRefused) {
  Coordinator::KeyValueOrigin from_a{"", "a", 11};
  // A key-value request may arrive before the node's hello: it starts the run.
  absl::StatusOr<std::string> kv_run = coord_.RunForKeyValue("job", from_a);
  ASSERT_TRUE(kv_run.ok()) << kv_run.status();
  FakeNodeSink a;
  const auto sa = coord_.OpenSession(&a);
  coord_.HandleMessage(sa, NewHello("a", {0, 1}, 11));
  EXPECT_EQ(WelcomeRun(a), *kv_run);
  Coordinator::KeyValueOrigin stale{"r-old", "a", 11};
  absl::StatusOr<std::string> refused = coord_.RunForKeyValue("job", stale);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(wire::KindOf(refused.status()), v1::RUN_ENDED);
}

// Every node of a run that has ended, back too late, gets the same words,
// so its ranks end with one error: the words name no node (chaos seed 7591:
// each node's ranks read their own node's name). Here the job's current run
// was taken over by a RESUME (as after a coordinator restart), so it adopts
// no other id.
TEST_F(CoordinatorRunTest, NodesResumingARunThatHasEndedAllGetTheSameWords) {
  auto resume = [&](FakeNodeSink& sink, const std::string& node, std::vector<int> ranks,
                    uint64_t epoch, const std::string& run) {
    const auto s = coord_.OpenSession(&sink);
    v1::NodeMessage hello = NewHello(node, std::move(ranks), epoch);
    hello.mutable_hello()->set_run_start(v1::NodeHello::RUN_START_RESUME);
    hello.mutable_hello()->set_run_id(run);
    coord_.HandleMessage(s, hello);
  };
  FakeNodeSink c;
  resume(c, "c", {0, 1}, 33, "r-current");
  ASSERT_EQ(WelcomeRun(c), "r-current");
  std::vector<std::string> words;
  for (const auto& [node, epoch] : {std::pair<std::string, uint64_t>{"a", 11}, {"b", 22}}) {
    FakeNodeSink sink;
    resume(sink, node, {}, epoch, "r-old");
    ASSERT_EQ(sink.messages().size(), 1u);
    ASSERT_TRUE(sink.messages()[0].has_error());
    EXPECT_EQ(sink.messages()[0].error().kind(), v1::RUN_ENDED);
    words.push_back(sink.messages()[0].error().message());
  }
  EXPECT_EQ(words[0],
            "job job run r-old has ended (the job's current run is r-current, started by a "
            "restart under the same job id); its ranks still speak for the old run: stop them");
  EXPECT_EQ(words[1], words[0]);
}

TEST_F(CoordinatorRunTest, AFailedRunDropsItsKeysAndLaterKeysGoToAFreshScope) {
  FakeNodeSink a, b;
  const auto sa = coord_.OpenSession(&a);
  const auto sb = coord_.OpenSession(&b);
  coord_.HandleMessage(sa, NewHello("a", {0}, 11));
  coord_.HandleMessage(sb, NewHello("b", {1}, 22));
  const std::string run = WelcomeRun(a);
  const GroupSpec spec = testing::MakeSpec("g0", 2);
  coord_.HandleMessage(sa, testing::Registration(spec, {0}));
  coord_.HandleMessage(sb, testing::Registration(spec, {1}));
  ASSERT_EQ(*coord_.RunForKeyValue("job", {run, "a", 11}), run);
  // Node b never submits step 0: the run fails at the deadline.
  coord_.HandleMessage(sa,
                       testing::Batch({testing::NodeManifest("g0", 0, {kBf16, kNone}, 2, {0})}));
  clock_.Advance(absl::Seconds(61));
  coord_.CheckDeadlines();
  clock_.Advance(absl::Seconds(2));
  coord_.CheckDeadlines();
  ASSERT_EQ(ended_.size(), 1u);
  EXPECT_TRUE(
      absl::StartsWith(ended_[0], absl::StrCat("job/", run, ": job job group \"g0\" step 0")))
      << ended_[0];
  EXPECT_EQ(*coord_.RunForKeyValue("job", {run, "a", 11}), absl::StrCat(run, "/after-failure"));
  coord_.CloseSession(sa);
  coord_.CloseSession(sb);
  ASSERT_EQ(ended_.size(), 2u);
  EXPECT_TRUE(absl::StartsWith(ended_[1], absl::StrCat("job/", run, "/after-failure: ")))
      << ended_[1];
}

TEST_F(CoordinatorRunTest, ALateRequestOfAFailedRunThatEndedIsRefusedNotRevived) {
  FakeNodeSink a, b;
  const auto sa = coord_.OpenSession(&a);
  const auto sb = coord_.OpenSession(&b);
  coord_.HandleMessage(sa, NewHello("a", {0}, 11));
  coord_.HandleMessage(sb, NewHello("b", {1}, 22));
  const std::string run = WelcomeRun(a);
  const GroupSpec spec = testing::MakeSpec("g0", 2);
  coord_.HandleMessage(sa, testing::Registration(spec, {0}));
  coord_.HandleMessage(sb, testing::Registration(spec, {1}));
  coord_.HandleMessage(sa,
                       testing::Batch({testing::NodeManifest("g0", 0, {kBf16, kNone}, 2, {0})}));
  clock_.Advance(absl::Seconds(61));
  coord_.CheckDeadlines();
  clock_.Advance(absl::Seconds(2));
  coord_.CheckDeadlines();  // node b never submitted: the run failed
  coord_.CloseSession(sa);
  coord_.CloseSession(sb);  // ... and ended
  // The late request gets the run's failure, the error its ranks got.
  absl::StatusOr<std::string> late = coord_.RunForKeyValue("job", {run, "a", 11});
  EXPECT_EQ(wire::KindOf(late.status()), v1::MISSING_RANKS) << late.status();
  EXPECT_THAT(std::string(late.status().message()),
              ::testing::StartsWith("job job group \"g0\" step 0: not every rank reported within "
                                    "1m of the step's first submission (--deadline); missing "
                                    "ranks 1: rank 1"));
  EXPECT_EQ(coord_.CurrentRun("job"), "") << "not revived";
  EXPECT_EQ(coord_.stats().runs, 0);
}

// A coordinator that restarts before every node of a launch was welcomed
// sees that launch's nodes arrive two ways: a node (or a key-value request)
// that never got its Welcome says NEW and starts a run here; a node that was
// welcomed RESUMEs the id the previous coordinator drew. While the run drawn
// here has decided nothing, it adopts that id: both halves are one run, and
// each node keeps the id it has (chaos seed 3013: the halves split, one
// ended with "run ... has ended", the other at the key-value deadline).
// Once it has decided, or for a run taken over by a RESUME, another id is a
// run that ended, as before; and a run that fails remembers its failure
// under every id it answered to.
TEST_F(CoordinatorRunTest, ARunDrawnHereAdoptsTheIdAWelcomedNodeResumesUntilItDecides) {
  // Node b's key-value request, made before any Welcome, starts the run.
  absl::StatusOr<std::string> scope = coord_.RunForKeyValue("job", {"", "b", 22});
  ASSERT_TRUE(scope.ok()) << scope.status();
  const std::string run = coord_.CurrentRun("job");
  ASSERT_FALSE(run.empty());
  FakeNodeSink a, b;
  const auto sa = coord_.OpenSession(&a);
  v1::NodeMessage resume = NewHello("a", {0}, 11);
  resume.mutable_hello()->set_run_start(v1::NodeHello::RUN_START_RESUME);
  resume.mutable_hello()->set_run_id("r-before");
  coord_.HandleMessage(sa, resume);
  EXPECT_EQ(WelcomeRun(a), "r-before");  // the id it has
  EXPECT_EQ(coord_.CurrentRun("job"), run);
  // Its key-value requests, stamped with that id, share the run's keys.
  absl::StatusOr<std::string> a_scope = coord_.RunForKeyValue("job", {"r-before", "a", 11});
  ASSERT_TRUE(a_scope.ok()) << a_scope.status();
  EXPECT_EQ(*a_scope, *scope);
  std::string b_run;
  const auto sb = JoinNew(b, "b", {1}, 22, &b_run);
  EXPECT_EQ(b_run, run);
  // One job: the step is decided for both nodes.
  const GroupSpec spec = testing::MakeSpec("g", 2);
  coord_.HandleMessage(sa, testing::Registration(spec, {0}));
  coord_.HandleMessage(sb, testing::Registration(spec, {1}));
  coord_.HandleMessage(
      sa, testing::Batch({testing::NodeManifest("g", 0, {DType::kFloat32, std::nullopt}, 2, {0})}));
  coord_.HandleMessage(
      sb,
      testing::Batch({testing::NodeManifest("g", 0, {DType::kFloat32, DType::kFloat32}, 2, {1})}));
  for (FakeNodeSink* s : {&a, &b}) {
    ASSERT_EQ(s->decisions().size(), 1u);
    EXPECT_FALSE(s->decisions()[0].has_error());
  }
  // A run that has decided adopts no other id.
  absl::StatusOr<std::string> other = coord_.RunForKeyValue("job", {"r-other", "c", 33});
  EXPECT_EQ(wire::KindOf(other.status()), v1::RUN_ENDED);

  // A run taken over by a RESUME adopts none: two resumed ids are two launches.
  FakeNodeSink c;
  const auto sc = coord_.OpenSession(&c);
  v1::NodeMessage taken = NewHello("c", {0}, 33);
  taken.mutable_hello()->set_job_id("job2");
  taken.mutable_hello()->set_run_start(v1::NodeHello::RUN_START_RESUME);
  taken.mutable_hello()->set_run_id("r-x");
  coord_.HandleMessage(sc, taken);
  EXPECT_EQ(WelcomeRun(c), "r-x");
  EXPECT_EQ(wire::KindOf(coord_.RunForKeyValue("job2", {"r-y", "d", 44}).status()), v1::RUN_ENDED);

  // A run that adopted an id and then failed: a late RESUME of either id
  // gets the failure's words.
  FakeNodeSink e;
  std::string e_run;
  const auto se = JoinNew(e, "e", {0}, 55, &e_run, "job3");
  ASSERT_TRUE(coord_.RunForKeyValue("job3", {"r-adopted", "f", 66}).ok());
  coord_.HandleMessage(se, testing::Registration(spec, {0}));
  clock_.Advance(CoordinatorOptions().deadline + absl::Seconds(1));
  coord_.CheckDeadlines();  // rank 1 never registered g: the run fails
  coord_.CloseSession(se);
  for (const std::string& id : {e_run, std::string("r-adopted")}) {
    absl::StatusOr<std::string> late = coord_.RunForKeyValue("job3", {id, "f", 66});
    EXPECT_THAT(std::string(late.status().message()),
                ::testing::HasSubstr("not every rank registered the group"))
        << id;
  }
}

// A rank whose key-value wait was cut at the deadline and that then leaves
// without asking again has ended the rendezvous for every rank: the run
// fails with the words its wait ended with, so a rank that reaches the run
// later (it was stopped, or slow) gets those words too, not its own wait's
// words naming the rank that left (chaos seed 3048). Gone means: its leave,
// its node lost past the node grace, or the run's last node leaving. A cut
// rank still here fails nothing: it may ask again.
TEST_F(CoordinatorRunTest, ARankThatLeavesAfterItsKeyWaitWasCutFailsTheRunWithThoseWords) {
  const absl::Status words = absl::DeadlineExceededError(
      "job job: keys still not set after 2s (the coordinator's --deadline): boot/0; missing "
      "ranks 0 ...");
  const absl::Duration grace = CoordinatorOptions().node_reconnect_grace;
  const GroupSpec spec = testing::MakeSpec("g", 2);
  auto registration_error = [](FakeNodeSink& sink) {
    for (const v1::CoordinatorMessage& m : sink.messages()) {
      if (m.has_registration() && m.registration().has_error()) return m.registration().error();
    }
    return v1::DecisionError();
  };
  {  // its leave (node b keeps another rank, so the leave goes up as such)
    FakeNodeSink a, b;
    std::string run, b_run;
    const auto sa = JoinNew(a, "a", {0}, 11, &run);
    const auto sb = JoinNew(b, "b", {1}, 22, &b_run);
    coord_.HandleMessage(sa, testing::Registration(spec, {0}));
    cut_[{absl::StrCat("job/", run), 1}] = words;
    coord_.CheckDeadlines();  // still here: nothing fails
    EXPECT_TRUE(registration_error(a).message().empty());
    v1::NodeMessage leave;
    leave.mutable_rank_event()->set_rank(1);
    leave.mutable_rank_event()->set_joined(false);
    coord_.HandleMessage(sb, leave);
    const v1::DecisionError e = registration_error(a);
    EXPECT_EQ(e.message(), words.message());
    EXPECT_EQ(e.code(), static_cast<int>(absl::StatusCode::kDeadlineExceeded));
    coord_.CloseSession(sa);
    coord_.CloseSession(sb);
    // A rank of the run that comes back late gets those very words.
    absl::StatusOr<std::string> late = coord_.RunForKeyValue("job", {run, "a", 11});
    EXPECT_EQ(late.status().code(), absl::StatusCode::kDeadlineExceeded);
    EXPECT_EQ(late.status().message(), words.message());
    cut_.clear();
  }
  {  // its node lost past the grace
    FakeNodeSink a, b;
    std::string run, b_run;
    const auto sa = JoinNew(a, "a", {0}, 33, &run, "job2");
    const auto sb = JoinNew(b, "b", {1}, 44, &b_run, "job2");
    coord_.HandleMessage(sa, testing::Registration(spec, {0}));
    cut_[{absl::StrCat("job2/", run), 1}] = words;
    coord_.CloseSession(sb);
    clock_.Advance(grace / 2);
    coord_.CheckDeadlines();
    EXPECT_TRUE(registration_error(a).message().empty());  // it may come back
    clock_.Advance(grace);
    coord_.CheckDeadlines();
    EXPECT_EQ(registration_error(a).message(), words.message());
    coord_.CloseSession(sa);
    cut_.clear();
  }
  {  // the run's last node leaves: the run ends failed, with those words
    FakeNodeSink a;
    std::string run;
    const auto sa = JoinNew(a, "a", {0, 1}, 55, &run, "job3");
    cut_[{absl::StrCat("job3/", run), 0}] = words;
    coord_.CloseSession(sa);
    absl::StatusOr<std::string> late = coord_.RunForKeyValue("job3", {run, "a", 55});
    EXPECT_EQ(late.status().message(), words.message());
    // Not revived by a NEW either: a failed run's id is never taken again.
    FakeNodeSink b;
    std::string b_run;
    JoinNew(b, "b", {1}, 66, &b_run, "job3");
    EXPECT_NE(b_run, run);
  }
}

TEST_F(CoordinatorRunTest, ARunNoNodeJoinsEndsAfterTheStartTimeout) {
  ASSERT_TRUE(coord_.RunForKeyValue("job", {}).ok());
  EXPECT_EQ(coord_.stats().runs, 1);
  clock_.Advance(absl::Seconds(29));
  coord_.CheckDeadlines();
  EXPECT_TRUE(ended_.empty());
  clock_.Advance(absl::Seconds(2));
  coord_.CheckDeadlines();
  ASSERT_EQ(ended_.size(), 1u);
  EXPECT_THAT(ended_[0], ::testing::HasSubstr("ended: no node joined it within 30s "
                                              "(--run_start_timeout)"));
  EXPECT_EQ(coord_.stats().runs, 0);
}

TEST_F(CoordinatorRunTest, MoreThanMaxJobsDistinctJobsOverTimeAreServed) {
  for (int i = 0; i < 3000; ++i) {
    FakeNodeSink a;
    const auto sa = coord_.OpenSession(&a);
    v1::NodeMessage hello = NewHello("a", {0, 1}, 11);
    hello.mutable_hello()->set_job_id(absl::StrCat("job", i));
    coord_.HandleMessage(sa, hello);
    ASSERT_TRUE(a.messages().at(0).has_welcome()) << i;
    ASSERT_TRUE(coord_.RunForKeyValue(absl::StrCat("job", i), {"", "a", 11}).ok());
    coord_.CloseSession(sa);
  }
  EXPECT_EQ(coord_.stats().runs, 0);
  EXPECT_EQ(coord_.stats().jobs, 0);
}

}  // namespace
}  // namespace accord::daemon

namespace accord::daemon {
namespace {

// A node that stays ahead of the others with changing content keeps only the
// contents its pending steps still name (NodeGroupState::retained).
TEST_F(CoordinatorTest, RetainedContentsStayBoundedWhileANodeStaysAheadWithChangingContent) {
  Join();
  RegisterAll(MakeSpec("g0", 3));
  constexpr int kAhead = 3;
  auto a_step = [&](int64_t step) {
    // The content changes every step (the dtype of parameter 0 alternates).
    coord_.HandleMessage(
        a_, Batch({NodeManifest("g0", step, {step % 2 ? kBf16 : kFp16, kNone, kNone}, 4, {0, 1})}));
  };
  for (int64_t s = 0; s < kAhead; ++s) a_step(s);
  int64_t most = 0;
  for (int64_t s = 0; s < 1000; ++s) {
    a_step(s + kAhead);
    coord_.HandleMessage(b_, Batch({NodeManifest("g0", s, {kFp16, kNone, kNone}, 4, {2, 3})}));
    most = std::max(most, coord_.stats().retained_contents);
  }
  EXPECT_LE(most, kAhead + 1);
  EXPECT_EQ(sink_b_.decisions().size(), 1000u);
  for (const v1::Decision& d : sink_b_.decisions()) ASSERT_FALSE(d.has_error()) << d.DebugString();
  coord_.CloseSession(a_);
  coord_.CloseSession(b_);
  EXPECT_EQ(coord_.stats().retained_contents, 0);
}

}  // namespace
}  // namespace accord::daemon

namespace accord::daemon {
namespace {

TEST(CoordinatorUsageTest, EveryUsageWindowTogetherStaysUnderTheGlobalCap) {
  FakeClock clock;
  CoordinatorOptions o;
  o.start_timer_thread = false;
  o.usage_window_steps = 1000;
  o.usage_window_bytes = 1 << 20;
  o.usage_total_bytes = 2000;
  Coordinator coord(o, &clock);
  FakeNodeSink sink;
  const auto s = coord.OpenSession(&sink);
  coord.HandleMessage(s, testing::Hello("job", "a", 2, {0, 1}));
  constexpr int kGroups = 4;
  for (int g = 0; g < kGroups; ++g) {
    coord.HandleMessage(s,
                        testing::Registration(testing::MakeSpec(absl::StrCat("g", g), 3), {0, 1}));
  }
  int64_t entry_bytes = 0;
  for (int64_t step = 0; step < 200; ++step) {
    for (int g = 0; g < kGroups; ++g) {
      // New content every step: one usage entry per step.
      coord.HandleMessage(
          s,
          testing::Batch({testing::NodeManifest(
              absl::StrCat("g", g), step, {step % 2 ? kBf16 : kFp16, kNone, kNone}, 2, {0, 1})}));
    }
    if (step == 0) entry_bytes = coord.stats().usage_bytes / kGroups;
    ASSERT_LE(coord.stats().usage_bytes, o.usage_total_bytes + kGroups * entry_bytes) << step;
  }
  EXPECT_EQ(sink.decisions().size(), 200u * kGroups);
  EXPECT_GT(coord.stats().usage_bytes, o.usage_total_bytes / 2);
  coord.CloseSession(s);  // retired: still counted, and still under the cap
  EXPECT_LE(coord.stats().usage_bytes, o.usage_total_bytes + kGroups * entry_bytes);
}

}  // namespace
}  // namespace accord::daemon
