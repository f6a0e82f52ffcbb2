#include "daemon/sidecar/sidecar_jobs.h"

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "daemon/common/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/wire.h"

namespace accord::daemon {
namespace {

using ::testing::ElementsAre;

class FakeRankSink : public RankSink {
 public:
  void Send(std::shared_ptr<const v1::RankReply> reply) override { replies.push_back(*reply); }
  void Close(const absl::Status& status) override { closed = status; }
  bool welcomed() const { return !replies.empty() && replies[0].has_welcome(); }
  std::vector<v1::RankReply> replies;
  std::optional<absl::Status> closed;
};

// One job's stream: records what its Sidecar sends; counts its destruction.
class FakeUpstream : public UpstreamSink {
 public:
  explicit FakeUpstream(int* destroyed) : destroyed_(destroyed) {}
  ~FakeUpstream() override { ++*destroyed_; }
  void Send(v1::NodeMessage m) override { sent.push_back(std::move(m)); }
  void Reset(std::vector<v1::NodeMessage> m) override {}
  void Reconnect() override { ++reconnects; }
  std::vector<v1::NodeHello> hellos() const {
    std::vector<v1::NodeHello> out;
    for (const auto& m : sent) {
      if (m.has_hello()) out.push_back(m.hello());
    }
    return out;
  }
  int manifests() const {
    int n = 0;
    for (const auto& m : sent) n += m.manifests().manifests_size();
    return n;
  }
  std::vector<v1::NodeMessage> sent;
  int reconnects = 0;

 private:
  int* destroyed_;
};

v1::RankMessage Hello(const std::string& job, int rank, int world) {
  v1::RankMessage m;
  m.mutable_hello()->set_job_id(job);
  m.mutable_hello()->set_rank(rank);
  m.mutable_hello()->set_world_size(world);
  return m;
}

GroupSpec Spec() { return GroupSpec{"g", {ParamSpec{"a", 8, 64}}}; }

v1::RankMessage Reg() {
  v1::RankMessage m;
  *m.mutable_registration() = wire::GroupSpecToProto(Spec(), Policy());
  return m;
}

v1::RankMessage Man(int64_t step, int rank, int world) {
  v1::RankMessage m;
  wire::ManifestToProto("g", RankManifest(step, rank, world, {DType::kBFloat16}), false,
                        m.mutable_manifests()->add_manifests());
  return m;
}

class SidecarJobsTest : public ::testing::Test {
 protected:
  explicit SidecarJobsTest(int max_ranks = 64) {
    SidecarJobsOptions o;
    o.sidecar.node_id = "n0";
    o.sidecar.max_ranks = max_ranks;
    o.sidecar.clock = &clock_;
    o.sidecar.start_timer_thread = false;
    o.handover_timeout = absl::Seconds(10);
    o.start_thread = false;
    jobs_ = std::make_unique<SidecarJobs>(o, [this](Sidecar* job) {
      auto up = std::make_unique<FakeUpstream>(&destroyed_);
      opened_.push_back(up.get());
      sidecars_.push_back(job);
      job->SetUpstream(up.get());
      return up;
    });
  }

  // A rank stream that says hello.
  struct Rank {
    FakeRankSink sink;
    SidecarJobs::SessionId id = 0;
  };
  std::unique_ptr<Rank> Connect(const std::string& job, int rank, int world) {
    auto r = std::make_unique<Rank>();
    r->id = jobs_->OpenRank(&r->sink);
    jobs_->HandleRankMessage(r->id, Hello(job, rank, world));
    return r;
  }
  // The stream that carries job `job`'s NodeHello (nullptr: none).
  FakeUpstream* StreamOf(const std::string& job, size_t nth = 0) {
    for (FakeUpstream* up : opened_) {
      for (const v1::NodeHello& h : up->hellos()) {
        if (h.job_id() == job && nth-- == 0) return up;
      }
    }
    return nullptr;
  }

  FakeClock clock_;
  int destroyed_ = 0;
  std::vector<FakeUpstream*> opened_;  // owned by jobs_ until destroyed
  std::vector<Sidecar*> sidecars_;     // opened_[i]'s Sidecar
  std::unique_ptr<SidecarJobs> jobs_;
};

// Two 4-GPU jobs on one 8-GPU node: each has its own Sidecar and stream,
// their manifests never mix, and each is answered at once.
TEST_F(SidecarJobsTest, TwoJobsAtOnceEachGetTheirOwnStream) {
  ASSERT_EQ(opened_.size(), 1u);  // the spare, opened ahead
  std::vector<std::unique_ptr<Rank>> a, b;
  for (int r = 0; r < 4; ++r) a.push_back(Connect("a", r, 4));
  for (int r = 0; r < 4; ++r) b.push_back(Connect("b", r, 4));
  for (const auto& r : a) EXPECT_TRUE(r->sink.welcomed());
  for (const auto& r : b) EXPECT_TRUE(r->sink.welcomed());
  EXPECT_EQ(opened_.size(), 3u);  // a's, b's and a new spare
  FakeUpstream* up_a = StreamOf("a");
  FakeUpstream* up_b = StreamOf("b");
  ASSERT_NE(up_a, nullptr);
  ASSERT_NE(up_b, nullptr);
  EXPECT_NE(up_a, up_b);
  EXPECT_THAT(up_a->hellos()[0].ranks(), ElementsAre(0));  // then joins
  // Every rank registers before any submits (RegisterGroup returns once all
  // did): a rank's manifest for a step already sent would go up on its own.
  for (int r = 0; r < 4; ++r) jobs_->HandleRankMessage(a[r]->id, Reg());
  for (int r = 0; r < 4; ++r) jobs_->HandleRankMessage(a[r]->id, Man(0, r, 4));
  EXPECT_EQ(up_a->manifests(), 1);  // one node manifest for a's four ranks
  EXPECT_EQ(up_b->manifests(), 0);
  SidecarJobsStats st = jobs_->stats();
  ASSERT_EQ(st.jobs.size(), 2u);
  EXPECT_EQ(st.jobs[0].job_id, "a");
  EXPECT_EQ(st.jobs[0].ranks, 4);
  EXPECT_EQ(st.jobs[0].rank_manifests, 4);
  EXPECT_EQ(st.jobs[1].job_id, "b");
  EXPECT_EQ(st.jobs[1].rank_manifests, 0);
  EXPECT_EQ(st.sessions, 8);
  EXPECT_EQ(st.launches, 2);
}

// Job b's rank arrives while job a's last rank is still leaving: b is served
// at once; a's launch is retired (its stream destroyed) when its rank left.
TEST_F(SidecarJobsTest, AnotherJobNeverWaitsForAJobWhoseRanksAreLeaving) {
  auto a0 = Connect("a", 0, 1);
  auto b0 = Connect("b", 0, 1);
  EXPECT_TRUE(b0->sink.welcomed());
  EXPECT_FALSE(b0->sink.closed.has_value());
  jobs_->CloseRank(a0->id);
  EXPECT_EQ(StreamOf("a")->reconnects, 0);  // retired, not reused
  EXPECT_EQ(destroyed_, 0);                 // destroyed off the closing thread ...
  jobs_->CheckHeld();
  EXPECT_EQ(destroyed_, 1);  // ... by the next check
}

// The next run under the same id: its rank 0 arrives while the previous
// run's ranks 0 and 1 are still connected. It is held, not refused, and
// welcomed by a fresh Sidecar (new stream, new node epoch) once both left.
TEST_F(SidecarJobsTest, ARankOfANewLaunchIsHeldUntilThePreviousLaunchsRanksLeft) {
  auto old0 = Connect("j", 0, 2);
  auto old1 = Connect("j", 1, 2);
  auto new0 = Connect("j", 0, 2);
  EXPECT_TRUE(new0->sink.replies.empty());
  EXPECT_FALSE(new0->sink.closed.has_value());
  // A message sent before the welcome waits with the hello.
  jobs_->HandleRankMessage(new0->id, Reg());
  // A rank new to the previous launch still waits behind the held one: it
  // belongs to the new launch.
  auto new1 = Connect("j", 1, 2);
  EXPECT_TRUE(new1->sink.replies.empty());
  EXPECT_EQ(jobs_->stats().held, 2);
  jobs_->CloseRank(old0->id);
  EXPECT_TRUE(new0->sink.replies.empty());
  jobs_->CloseRank(old1->id);
  EXPECT_TRUE(new0->sink.welcomed());
  EXPECT_TRUE(new1->sink.welcomed());
  EXPECT_FALSE(new0->sink.closed.has_value());
  FakeUpstream* first = StreamOf("j", 0);
  FakeUpstream* second = StreamOf("j", 1);
  ASSERT_NE(second, nullptr);
  EXPECT_NE(first, second);
  EXPECT_NE(first->hellos()[0].node_epoch(), second->hellos()[0].node_epoch());
  // The held registration went to the new launch, after its hello.
  int registrations = 0;
  for (const auto& m : second->sent) registrations += m.has_registration() ? 1 : 0;
  EXPECT_EQ(registrations, 1);
  EXPECT_EQ(jobs_->stats().held, 0);
  EXPECT_EQ(jobs_->stats().launches, 2);
}

// A late rank of a launch whose other ranks all left continues their
// incarnation (chaos seed 7713: rank 0 was killed 19 ms into the job, before
// rank 1 of its node connected; the node then said NEW under a fresh epoch
// and the relay ended the run as restarted ranks, so the other node's ranks
// got RUN_ENDED instead of the leave of rank 0). Its stream's hello resumes
// their run under their node epoch. A rank the launch had, a rank of another
// launch and a rank with no launch id start a new incarnation.
TEST_F(SidecarJobsTest, ALateRankOfALaunchWhoseRanksLeftContinuesTheirIncarnation) {
  auto connect = [&](int rank, const std::string& launch) {
    auto r = std::make_unique<Rank>();
    r->id = jobs_->OpenRank(&r->sink);
    v1::RankMessage hello = Hello("j", rank, 4);
    hello.mutable_hello()->set_launch_id(launch);
    jobs_->HandleRankMessage(r->id, hello);
    return r;
  };
  auto upstream_hello = [&](size_t nth) {
    FakeUpstream* up = StreamOf("j", nth);
    return up == nullptr ? v1::NodeHello() : up->hellos()[0];
  };
  auto early = connect(0, "L");
  ASSERT_TRUE(early->sink.welcomed());
  const v1::NodeHello first = upstream_hello(0);
  ASSERT_NE(first.node_epoch(), 0u);
  EXPECT_EQ(first.run_start(), v1::NodeHello::RUN_START_NEW);
  v1::CoordinatorMessage welcome;
  welcome.mutable_welcome()->set_run_id("run1");
  for (size_t i = 0; i < opened_.size(); ++i) {
    if (opened_[i] == StreamOf("j", 0)) sidecars_[i]->HandleCoordinatorMessage(welcome);
  }
  jobs_->CloseRank(early->id);  // killed: the launch retires

  auto late = connect(1, "L");
  ASSERT_TRUE(late->sink.welcomed());
  EXPECT_EQ(late->sink.replies[0].welcome().node_epoch(), first.node_epoch());
  const v1::NodeHello second = upstream_hello(1);
  EXPECT_EQ(second.node_epoch(), first.node_epoch());
  EXPECT_EQ(second.run_start(), v1::NodeHello::RUN_START_RESUME);
  EXPECT_EQ(second.run_id(), "run1");
  // A rank of the continued launch, back while the launch lives, is a new
  // launch: held until the late rank leaves.
  auto again = connect(0, "L");
  EXPECT_TRUE(again->sink.replies.empty());
  jobs_->CloseRank(late->id);
  ASSERT_TRUE(again->sink.welcomed());
  const v1::NodeHello third = upstream_hello(2);
  EXPECT_NE(third.node_epoch(), first.node_epoch()) << "rank 0 restarted";
  EXPECT_EQ(third.run_start(), v1::NodeHello::RUN_START_NEW);

  // Live: a rank of another launch waits for the current one to leave.
  auto other = connect(2, "M");
  EXPECT_TRUE(other->sink.replies.empty());
  jobs_->CloseRank(again->id);
  ASSERT_TRUE(other->sink.welcomed());
  EXPECT_NE(upstream_hello(3).node_epoch(), third.node_epoch());
  jobs_->CloseRank(other->id);
  // Retired: a rank with no launch id cannot be told from a new launch.
  auto unnamed = connect(3, "");
  ASSERT_TRUE(unnamed->sink.welcomed());
  EXPECT_NE(upstream_hello(4).node_epoch(), upstream_hello(3).node_epoch());
  EXPECT_EQ(upstream_hello(4).run_start(), v1::NodeHello::RUN_START_NEW);
  EXPECT_EQ(jobs_->stats().launches, 5);
}

// A launch id may repeat (torchrun run again with the same --rdzv-id): a
// rank of a retired launch's id that it never had continues it only within
// --job_handover_timeout of the retirement; later it is a new launch.
TEST_F(SidecarJobsTest, ALateRankContinuesItsLaunchOnlyWithinTheHandoverTimeout) {
  auto connect = [&](int rank) {
    auto r = std::make_unique<Rank>();
    r->id = jobs_->OpenRank(&r->sink);
    v1::RankMessage hello = Hello("j", rank, 4);
    hello.mutable_hello()->set_launch_id("torchrun:job7:0");
    jobs_->HandleRankMessage(r->id, hello);
    return r;
  };
  auto first = connect(0);
  ASSERT_TRUE(first->sink.welcomed());
  const uint64_t epoch = StreamOf("j", 0)->hellos()[0].node_epoch();
  jobs_->CloseRank(first->id);
  clock_.Advance(absl::Seconds(10) + absl::Milliseconds(1));  // past the 10 s default
  auto rerun = connect(1);
  ASSERT_TRUE(rerun->sink.welcomed());
  const v1::NodeHello second = StreamOf("j", 1)->hellos()[0];
  EXPECT_NE(second.node_epoch(), epoch) << "the same launch id this late is a new launch";
  EXPECT_EQ(second.run_start(), v1::NodeHello::RUN_START_NEW);
  jobs_->CloseRank(rerun->id);
  clock_.Advance(absl::Seconds(9));
  auto late = connect(2);
  ASSERT_TRUE(late->sink.welcomed());
  EXPECT_EQ(StreamOf("j", 2)->hellos()[0].node_epoch(), second.node_epoch())
      << "within the timeout a rank the launch never had is a late one of it";
}

// A held rank whose own rank is still connected after the handover timeout:
// DUPLICATE_RANK (a previous launch that does not leave, or two processes
// with one RANK). Checked on the test's clock; nothing sleeps.
TEST_F(SidecarJobsTest, AHeldRankIsRefusedAfterTheHandoverTimeoutNamingWhatIsStillConnected) {
  auto old0 = Connect("j", 0, 2);
  auto old1 = Connect("j", 1, 2);
  auto new1 = Connect("j", 1, 2);
  clock_.Advance(absl::Seconds(9));
  jobs_->CheckHeld();
  EXPECT_FALSE(new1->sink.closed.has_value());
  clock_.Advance(absl::Seconds(1));
  jobs_->CheckHeld();
  ASSERT_TRUE(new1->sink.closed.has_value());
  EXPECT_EQ(new1->sink.closed->code(), absl::StatusCode::kAlreadyExists);
  ASSERT_EQ(new1->sink.replies.size(), 1u);
  const v1::DecisionError& e = new1->sink.replies[0].error();
  EXPECT_EQ(e.kind(), v1::DUPLICATE_RANK);
  EXPECT_EQ(e.message(),
            "job j: rank 1 waited 10s (--job_handover_timeout) for the rank 1 already connected to "
            "this sidecar to leave, but it is still connected: a previous launch of the job is "
            "still running here, or two local processes have RANK 1; stop the previous launch's "
            "processes or check RANK");
  EXPECT_THAT(e.ranks(), ElementsAre(1));
  jobs_->CloseRank(new1->id);
  // Its own rank left, another did not: FAILED_PRECONDITION naming it.
  jobs_->CloseRank(old0->id);
  auto new0 = Connect("j", 0, 2);
  clock_.Advance(absl::Seconds(10));
  jobs_->CheckHeld();
  ASSERT_TRUE(new0->sink.closed.has_value());
  EXPECT_EQ(new0->sink.closed->code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(new0->sink.replies[0].error().message(),
            "job j: rank 0 starts a new launch of the job on this node and waited 10s "
            "(--job_handover_timeout) for the previous launch's ranks 1 to leave, but they are "
            "still connected; stop the previous launch's processes");
  // The previous launch goes on undisturbed.
  EXPECT_FALSE(old1->sink.closed.has_value());
}

// Refusals that need no job state open no stream; --max_ranks counts every
// job's ranks, held ones included; nothing before a hello is accepted.
TEST(SidecarJobsLimitsTest, RefusalsOpenNoStreamAndMaxRanksCountsEveryJob) {
  FakeClock clock;
  SidecarJobsOptions o;
  o.sidecar.node_id = "n0";
  o.sidecar.job = "";
  o.sidecar.max_ranks = 2;
  o.sidecar.clock = &clock;
  o.sidecar.start_timer_thread = false;
  o.start_thread = false;
  int opened = 0, destroyed = 0;
  SidecarJobs jobs(o, [&](Sidecar* job) {
    ++opened;
    auto up = std::make_unique<FakeUpstream>(&destroyed);
    job->SetUpstream(up.get());
    return up;
  });
  FakeRankSink bad, early, a, b, c;
  auto s = jobs.OpenRank(&bad);
  jobs.HandleRankMessage(s, Hello("j", 3, 2));  // rank outside the world
  ASSERT_TRUE(bad.closed.has_value());
  EXPECT_EQ(bad.replies[0].error().message(), "job j: rank 3 outside 0..1");
  s = jobs.OpenRank(&early);
  jobs.HandleRankMessage(s, Reg());
  ASSERT_TRUE(early.closed.has_value());
  EXPECT_EQ(early.replies[0].error().message(), "send RankHello first");
  EXPECT_EQ(opened, 1);  // the spare only
  jobs.HandleRankMessage(jobs.OpenRank(&a), Hello("x", 0, 1));
  jobs.HandleRankMessage(jobs.OpenRank(&b), Hello("y", 0, 1));
  jobs.HandleRankMessage(jobs.OpenRank(&c), Hello("z", 0, 1));
  EXPECT_TRUE(a.welcomed());
  EXPECT_TRUE(b.welcomed());
  ASSERT_TRUE(c.closed.has_value());
  EXPECT_EQ(c.replies[0].error().kind(), v1::LIMIT_EXCEEDED);
  EXPECT_EQ(c.replies[0].error().message(), "this sidecar already serves 2 ranks (--max_ranks)");
}

// A job id's counters add up over its launches, and an ended job keeps its
// final counters (for its metric series) among the last kEndedJobsKept.
TEST_F(SidecarJobsTest, CountersOfAJobIdAddUpOverItsLaunchesAndEndedJobsAreBounded) {
  for (int run = 0; run < 2; ++run) {
    auto r = Connect("j", 0, 1);
    jobs_->HandleRankMessage(r->id, Reg());
    jobs_->HandleRankMessage(r->id, Man(0, 0, 1));
    jobs_->CloseRank(r->id);
  }
  SidecarJobsStats st = jobs_->stats();
  ASSERT_EQ(st.jobs.size(), 1u);
  EXPECT_EQ(st.jobs[0].job_id, "j");
  EXPECT_EQ(st.jobs[0].rank_manifests, 2);
  EXPECT_EQ(st.jobs[0].ranks, 0);
  for (int i = 0; i < SidecarJobs::kEndedJobsKept + 3; ++i) {
    auto r = Connect("other-" + std::to_string(i), 0, 1);
    jobs_->CloseRank(r->id);
  }
  jobs_->CheckHeld();
  st = jobs_->stats();
  EXPECT_EQ(st.jobs.size(), static_cast<size_t>(SidecarJobs::kEndedJobsKept));
  EXPECT_EQ(st.jobs.back().job_id, "other-9");  // by id; "j" and the oldest went
  EXPECT_EQ(destroyed_, 2 + SidecarJobs::kEndedJobsKept + 3);
}

}  // namespace
}  // namespace accord::daemon
