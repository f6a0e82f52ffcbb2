// Each configurable limit refuses one more with LIMIT_EXCEEDED /
// RESOURCE_EXHAUSTED and a message naming the flag to raise (logic classes;
// the message size limit is tested over a real socket in grpc_auth_test).
#include <memory>
#include <string>
#include <vector>

#include "daemon/coordinator/coordinator.h"
#include "daemon/sidecar/sidecar.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/daemon/test_util.h"

namespace accord::daemon {
namespace {

using testing::Batch;
using testing::FakeNodeSink;
using ::testing::HasSubstr;
using testing::Hello;
using testing::MakeSpec;
using testing::NodeManifest;
using testing::Registration;

CoordinatorOptions Options() {
  CoordinatorOptions o;
  o.start_timer_thread = false;
  return o;
}

// The last error any message carried.
v1::DecisionError LastError(FakeNodeSink& sink) {
  v1::DecisionError last;
  for (const v1::CoordinatorMessage& m : sink.messages()) {
    if (m.has_error()) last = m.error();
    if (m.has_registration() && m.registration().has_error()) last = m.registration().error();
    if (m.has_decisions()) {
      for (const v1::Decision& d : m.decisions().decisions()) {
        if (d.has_error()) last = d.error();
      }
    }
  }
  return last;
}

void ExpectLimit(const v1::DecisionError& e, const std::string& flag, const std::string& value) {
  EXPECT_EQ(e.kind(), v1::LIMIT_EXCEEDED) << e.DebugString();
  EXPECT_EQ(e.code(), static_cast<int>(absl::StatusCode::kResourceExhausted));
  EXPECT_THAT(e.message(), HasSubstr(flag));
  EXPECT_THAT(e.message(), HasSubstr(value));
}

TEST(CoordinatorLimitsTest, JobsPerCoordinator) {
  CoordinatorOptions o = Options();
  o.max_jobs = 2;
  FakeClock clock;
  Coordinator coord(o, &clock);
  FakeNodeSink a, b, c;
  coord.HandleMessage(coord.OpenSession(&a), Hello("job1", "n", 1, {0}));
  coord.HandleMessage(coord.OpenSession(&b), Hello("job2", "n", 1, {0}));
  EXPECT_TRUE(a.errors().empty());
  EXPECT_TRUE(b.errors().empty());
  coord.HandleMessage(coord.OpenSession(&c), Hello("job3", "n", 1, {0}));
  ExpectLimit(LastError(c), "--max_jobs", "2 jobs");
}

TEST(CoordinatorLimitsTest, RanksPerJob) {
  CoordinatorOptions o = Options();
  o.max_world_size = 8;
  FakeClock clock;
  Coordinator coord(o, &clock);
  FakeNodeSink ok, big;
  coord.HandleMessage(coord.OpenSession(&ok), Hello("job1", "n", 8, {0}));
  EXPECT_TRUE(ok.errors().empty());
  coord.HandleMessage(coord.OpenSession(&big), Hello("job2", "n", 9, {0}));
  ExpectLimit(LastError(big), "--max_ranks=8", "world size 9");
}

TEST(CoordinatorLimitsTest, GroupsPerJob) {
  CoordinatorOptions o = Options();
  o.max_groups_per_job = 2;
  FakeClock clock;
  Coordinator coord(o, &clock);
  FakeNodeSink sink;
  const auto s = coord.OpenSession(&sink);
  coord.HandleMessage(s, Hello("job1", "n", 1, {0}));
  coord.HandleMessage(s, Registration(MakeSpec("g0", 2), {0}));
  coord.HandleMessage(s, Registration(MakeSpec("g1", 2), {0}));
  EXPECT_EQ(sink.registrations().size(), 2u);
  EXPECT_TRUE(LastError(sink).message().empty());
  coord.HandleMessage(s, Registration(MakeSpec("g2", 2), {0}));
  ExpectLimit(LastError(sink), "--max_groups_per_job=2", "g2");
}

TEST(CoordinatorLimitsTest, ParamsPerGroup) {
  CoordinatorOptions o = Options();
  o.max_params_per_group = 3;
  FakeClock clock;
  Coordinator coord(o, &clock);
  FakeNodeSink sink;
  const auto s = coord.OpenSession(&sink);
  coord.HandleMessage(s, Hello("job1", "n", 1, {0}));
  coord.HandleMessage(s, Registration(MakeSpec("ok", 3), {0}));
  EXPECT_TRUE(LastError(sink).message().empty());
  coord.HandleMessage(s, Registration(MakeSpec("big", 4), {0}));
  ExpectLimit(LastError(sink), "--max_params_per_group=3", "4 parameters");
}

TEST(CoordinatorLimitsTest, PendingStepsPerGroup) {
  CoordinatorOptions o = Options();
  o.max_pending_steps = 2;
  FakeClock clock;
  Coordinator coord(o, &clock);
  FakeNodeSink a, b;
  const auto sa = coord.OpenSession(&a);
  const auto sb = coord.OpenSession(&b);
  coord.HandleMessage(sa, Hello("job1", "a", 2, {0}));
  coord.HandleMessage(sb, Hello("job1", "b", 2, {1}));
  const GroupSpec spec = MakeSpec("g", 2);
  coord.HandleMessage(sa, Registration(spec, {0}));
  coord.HandleMessage(sb, Registration(spec, {1}));
  // Node a runs ahead; node b never reports: steps 0 and 1 wait, 2 is refused.
  for (int64_t step = 0; step < 3; ++step) {
    coord.HandleMessage(
        sa, Batch({NodeManifest("g", step, {DType::kFloat32, DType::kFloat32}, 2, {0})}));
  }
  ExpectLimit(LastError(a), "--max_pending_steps", "2 steps");
}

// Sidecar: ranks per sidecar.
class RecordingRankSink : public RankSink {
 public:
  void Send(std::shared_ptr<const v1::RankReply> reply) override { replies.push_back(*reply); }
  void Close(const absl::Status& status) override { closed = status; }
  std::vector<v1::RankReply> replies;
  absl::Status closed;
};

class NullUpstream : public UpstreamSink {
 public:
  void Send(v1::NodeMessage m) override { sent.push_back(std::move(m)); }
  void Reset(std::vector<v1::NodeMessage> m) override {}
  void Reconnect() override {}
  std::vector<v1::NodeMessage> sent;
};

v1::RankMessage RankHello(int rank, int world, const std::string& token = "") {
  v1::RankMessage m;
  m.mutable_hello()->set_job_id("job1");
  m.mutable_hello()->set_rank(rank);
  m.mutable_hello()->set_world_size(world);
  m.mutable_hello()->set_token(token);
  return m;
}

TEST(SidecarLimitsTest, RanksPerSidecar) {
  SidecarOptions o;
  o.node_id = "n";
  o.max_ranks = 2;
  Sidecar sidecar(o);
  NullUpstream up;
  sidecar.SetUpstream(&up);
  RecordingRankSink r0, r1, r2;
  sidecar.HandleRankMessage(sidecar.OpenRank(&r0), RankHello(0, 8));
  sidecar.HandleRankMessage(sidecar.OpenRank(&r1), RankHello(1, 8));
  ASSERT_EQ(r1.replies.size(), 1u);
  EXPECT_TRUE(r1.replies[0].has_welcome());
  sidecar.HandleRankMessage(sidecar.OpenRank(&r2), RankHello(2, 8));
  ASSERT_EQ(r2.replies.size(), 1u);
  ASSERT_TRUE(r2.replies[0].has_error());
  ExpectLimit(r2.replies[0].error(), "--max_ranks", "2 ranks");
  EXPECT_EQ(r2.closed.code(), absl::StatusCode::kResourceExhausted);
}

// Sidecar: a rank's token must match the sidecar's.
TEST(SidecarTokenTest, RankWithAnotherTokenIsRefusedAndTheSidecarTokenGoesUpstream) {
  SidecarOptions o;
  o.node_id = "n";
  o.token = "tokA";
  Sidecar sidecar(o);
  NullUpstream up;
  sidecar.SetUpstream(&up);
  RecordingRankSink bad, good, none;
  sidecar.HandleRankMessage(sidecar.OpenRank(&bad), RankHello(0, 4, "tokB"));
  ASSERT_EQ(bad.replies.size(), 1u);
  ASSERT_TRUE(bad.replies[0].has_error());
  EXPECT_EQ(bad.replies[0].error().kind(), v1::PERMISSION_DENIED);
  EXPECT_EQ(bad.closed.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(bad.replies[0].error().message(), ::testing::Not(HasSubstr("tokA")));
  EXPECT_TRUE(up.sent.empty());

  sidecar.HandleRankMessage(sidecar.OpenRank(&good), RankHello(0, 4, "tokA"));
  ASSERT_EQ(good.replies.size(), 1u);
  EXPECT_TRUE(good.replies[0].has_welcome());
  // Without --require_rank_token a rank without a token is admitted (the
  // socket's permissions are the boundary on the node).
  sidecar.HandleRankMessage(sidecar.OpenRank(&none), RankHello(1, 4));
  ASSERT_EQ(none.replies.size(), 1u);
  EXPECT_TRUE(none.replies[0].has_welcome());
  ASSERT_FALSE(up.sent.empty());
  ASSERT_TRUE(up.sent[0].has_hello());
  EXPECT_EQ(up.sent[0].hello().token(), "tokA");
}

TEST(SidecarTokenTest, RequireRankTokenRefusesARankWithoutOne) {
  SidecarOptions o;
  o.node_id = "n";
  o.token = "tokA";
  o.require_rank_token = true;
  Sidecar sidecar(o);
  NullUpstream up;
  sidecar.SetUpstream(&up);
  RecordingRankSink none;
  sidecar.HandleRankMessage(sidecar.OpenRank(&none), RankHello(0, 4));
  ASSERT_EQ(none.replies.size(), 1u);
  ASSERT_TRUE(none.replies[0].has_error());
  EXPECT_EQ(none.replies[0].error().kind(), v1::PERMISSION_DENIED);
  EXPECT_THAT(none.replies[0].error().message(), HasSubstr("--require_rank_token"));
}

TEST(SidecarTokenTest, WithoutItsOwnTokenTheFirstRanksTokenBindsTheOthers) {
  SidecarOptions o;
  o.node_id = "n";
  Sidecar sidecar(o);
  NullUpstream up;
  sidecar.SetUpstream(&up);
  RecordingRankSink first, other;
  sidecar.HandleRankMessage(sidecar.OpenRank(&first), RankHello(0, 4, "tokA"));
  ASSERT_FALSE(up.sent.empty());
  EXPECT_EQ(up.sent[0].hello().token(), "tokA");
  sidecar.HandleRankMessage(sidecar.OpenRank(&other), RankHello(1, 4, "tokB"));
  ASSERT_EQ(other.replies.size(), 1u);
  ASSERT_TRUE(other.replies[0].has_error());
  EXPECT_EQ(other.replies[0].error().kind(), v1::PERMISSION_DENIED);
}

}  // namespace
}  // namespace accord::daemon
