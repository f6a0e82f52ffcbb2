// The coordinator's observe side with real components: the logic class on a
// fake clock, CoordinatorMetrics over a real registry and event log file, and
// ObserveService served in-process over gRPC (port 0).
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "daemon/common/clock.h"
#include "daemon/coordinator/coordinator.h"
#include "daemon/coordinator/metrics_coordinator.h"
#include "daemon/coordinator/observe_service.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "observe/event_log.h"
#include "observe/metrics.h"
#include "tests/daemon/test_util.h"

namespace accord::daemon {
namespace {

using testing::Batch;
using ::testing::ElementsAre;
using testing::FakeNodeSink;
using ::testing::HasSubstr;
using testing::Hello;
using testing::MakeSpec;
using testing::NodeManifest;
using testing::Registration;
using testing::Repeat;

constexpr auto kBf16 = DType::kBFloat16;
constexpr std::nullopt_t kNone = std::nullopt;

std::string ReadAll(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The value of one sample line `name{labels}` in the exposition text; -1 when
// absent.
double Sample(const std::string& text, const std::string& series) {
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (absl::StartsWith(line, series + " ")) {
      double v = -1;
      if (absl::SimpleAtod(line.substr(series.size() + 1), &v)) return v;
    }
  }
  return -1;
}

std::vector<int64_t> Counts(const v1::SkipRow& row) {
  return std::vector<int64_t>(row.counts().begin(), row.counts().end());
}

// World 4 on nodes "a" (ranks 0,1) and "b" (ranks 2,3); group g with 4
// parameters. Node a never has p1; node b lacks p2 from step 1 on; nobody has
// p3. Steps 0..2 are decided (step 1: a repeats; step 2: both repeat, so
// same_as_previous).
class ObserveTest : public ::testing::Test {
 protected:
  ObserveTest() {
    dir_ = std::filesystem::temp_directory_path() /
           absl::StrCat("accord-observe-test-", ::getpid(), "-",
                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
    EventLog::Options lo;
    lo.path = dir_ + "/events.jsonl";
    log_ = *EventLog::Open(lo);
    CoordinatorMetricsOptions mo;
    mo.event_log = log_.get();
    mo.param_skip_metrics = true;
    mo.clock = &clock_;
    mo.series_grace = absl::Minutes(10);
    metrics_ = std::make_unique<CoordinatorMetrics>(&registry_, mo);
    CoordinatorOptions o;
    o.deadline = absl::Seconds(60);
    o.start_timer_thread = false;
    o.observer = metrics_.get();
    coord_ = std::make_unique<Coordinator>(o, &clock_);
  }
  ~ObserveTest() override {
    coord_.reset();
    std::filesystem::remove_all(dir_);
  }

  void RunScenario() {
    a_ = coord_->OpenSession(&sink_a_);
    b_ = coord_->OpenSession(&sink_b_);
    coord_->HandleMessage(a_, Hello("job1", "a", 4, {0, 1}));
    coord_->HandleMessage(b_, Hello("job1", "b", 4, {2, 3}));
    const GroupSpec spec = MakeSpec("g", 4);
    coord_->HandleMessage(a_, Registration(spec, {0, 1}));
    coord_->HandleMessage(b_, Registration(spec, {2, 3}));
    const v1::Manifest a0 = NodeManifest("g", 0, {kBf16, kNone, kBf16, kNone}, 4, {0, 1});
    const v1::Manifest b0 = NodeManifest("g", 0, {kBf16, kBf16, kBf16, kNone}, 4, {2, 3});
    const v1::Manifest b1 = NodeManifest("g", 1, {kBf16, kBf16, kNone, kNone}, 4, {2, 3});
    coord_->HandleMessage(a_, Batch({a0}));
    clock_.Advance(absl::Milliseconds(3));
    coord_->HandleMessage(b_, Batch({b0}));
    coord_->HandleMessage(a_, Batch({Repeat("g", 1, a0.cache_key())}));
    coord_->HandleMessage(b_, Batch({b1}));
    coord_->HandleMessage(a_, Batch({Repeat("g", 2, a0.cache_key())}));
    coord_->HandleMessage(b_, Batch({Repeat("g", 2, b1.cache_key())}));
    ASSERT_EQ(sink_a_.decisions().size(), 3u);
  }

  std::string Metrics() {
    metrics_->Refresh(*coord_);
    return registry_.Render();
  }

  std::string dir_;
  FakeClock clock_;
  MetricsRegistry registry_;
  std::unique_ptr<EventLog> log_;
  std::unique_ptr<CoordinatorMetrics> metrics_;
  std::unique_ptr<Coordinator> coord_;
  FakeNodeSink sink_a_, sink_b_;
  Coordinator::SessionId a_ = 0, b_ = 0;
};

TEST_F(ObserveTest, MetricsCountDecisionsSkipsZeroFillsAndCache) {
  RunScenario();
  const std::string text = Metrics();
  EXPECT_EQ(Sample(text, R"(accord_decisions_total{job="job1",group="g"})"), 3);
  // p3 is left out of every step.
  EXPECT_EQ(Sample(text, R"(accord_skips_total{job="job1",group="g"})"), 3);
  // step 0: p1 on ranks 0,1 (2); steps 1 and 2: p1 on 0,1 and p2 on 2,3 (4 each).
  EXPECT_EQ(Sample(text, R"(accord_zero_fills_total{job="job1",group="g"})"), 10);
  EXPECT_EQ(Sample(text, R"(accord_cache_hits_total{job="job1"})"), 3);
  EXPECT_EQ(Sample(text, R"(accord_cache_misses_total{job="job1"})"), 3);
  EXPECT_EQ(Sample(text, R"(accord_negotiation_wait_seconds_count{job="job1"})"), 3);
  EXPECT_EQ(Sample(text, R"(accord_connected_sidecars{job="job1"})"), 2);
  EXPECT_EQ(Sample(text, R"(accord_stalled_groups{job="job1"})"), 0);
  EXPECT_EQ(
      Sample(text,
             R"(accord_param_skips_total{job="job1",group="g",param="layer1.weight",rank="0"})"),
      3);
  EXPECT_EQ(
      Sample(text,
             R"(accord_param_skips_total{job="job1",group="g",param="layer2.weight",rank="3"})"),
      2);
  EXPECT_EQ(
      Sample(text,
             R"(accord_param_skips_total{job="job1",group="g",param="layer0.weight",rank="2"})"),
      0);
}

TEST_F(ObserveTest, SkipMatrixCountsEveryKeptStepAndWindows) {
  RunScenario();
  absl::StatusOr<v1::SkipMatrixResponse> all = coord_->ObserveSkipMatrix("job1", "", 0);
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_EQ(all->world_size(), 4);
  ASSERT_EQ(all->groups_size(), 1);
  const v1::GroupSkipMatrix& m = all->groups(0);
  EXPECT_EQ(m.steps(), 3);
  EXPECT_EQ(m.first_step(), 0);
  EXPECT_EQ(m.last_step(), 2);
  ASSERT_EQ(m.rows_size(), 4);
  EXPECT_EQ(m.rows(1).param_name(), "layer1.weight");
  EXPECT_THAT(Counts(m.rows(0)), ElementsAre(0, 0, 0, 0));
  EXPECT_THAT(Counts(m.rows(1)), ElementsAre(3, 3, 0, 0));
  EXPECT_THAT(Counts(m.rows(2)), ElementsAre(0, 0, 2, 2));
  EXPECT_THAT(Counts(m.rows(3)), ElementsAre(3, 3, 3, 3));
  EXPECT_EQ(m.rows(3).skipped_everywhere(), 3);
  EXPECT_EQ(m.rows(1).skipped_everywhere(), 0);

  absl::StatusOr<v1::SkipMatrixResponse> last2 = coord_->ObserveSkipMatrix("job1", "g", 2);
  ASSERT_TRUE(last2.ok()) << last2.status();
  const v1::GroupSkipMatrix& w = last2->groups(0);
  EXPECT_EQ(w.steps(), 2);
  EXPECT_EQ(w.first_step(), 1);
  EXPECT_EQ(w.last_step(), 2);
  EXPECT_THAT(Counts(w.rows(1)), ElementsAre(2, 2, 0, 0));
  EXPECT_THAT(Counts(w.rows(2)), ElementsAre(0, 0, 2, 2));
  EXPECT_EQ(w.rows(3).skipped_everywhere(), 2);

  absl::StatusOr<v1::SkipMatrixResponse> last1 = coord_->ObserveSkipMatrix("job1", "g", 1);
  ASSERT_TRUE(last1.ok());
  EXPECT_EQ(last1->groups(0).first_step(), 2);
  EXPECT_THAT(Counts(last1->groups(0).rows(2)), ElementsAre(0, 0, 1, 1));
}

TEST_F(ObserveTest, SkipMatrixRejectsUnknownJobGroupAndNegativeWindow) {
  RunScenario();
  absl::StatusOr<v1::SkipMatrixResponse> r = coord_->ObserveSkipMatrix("nojob", "", 0);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(r.status().message(), HasSubstr("\"nojob\""));
  r = coord_->ObserveSkipMatrix("job1", "nogroup", 0);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(r.status().message(), HasSubstr("\"nogroup\""));
  r = coord_->ObserveSkipMatrix("job1", "", -1);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(ObserveTest, UsageWindowIsBoundedToTheConfiguredSteps) {
  CoordinatorOptions o;
  o.start_timer_thread = false;
  o.usage_window_steps = 2;
  coord_ = std::make_unique<Coordinator>(o, &clock_);
  RunScenario();
  absl::StatusOr<v1::SkipMatrixResponse> all = coord_->ObserveSkipMatrix("job1", "g", 0);
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(all->groups(0).steps(), 2);
  EXPECT_EQ(all->groups(0).first_step(), 1);
  EXPECT_THAT(Counts(all->groups(0).rows(1)), ElementsAre(2, 2, 0, 0));
}

TEST_F(ObserveTest, StatusReportsNodesRanksAndGroups) {
  RunScenario();
  absl::StatusOr<v1::StatusResponse> s = coord_->ObserveStatus("job1");
  ASSERT_TRUE(s.ok()) << s.status();
  ASSERT_EQ(s->jobs_size(), 1);
  const v1::JobStatus& j = s->jobs(0);
  EXPECT_EQ(j.world_size(), 4);
  ASSERT_EQ(j.nodes_size(), 2);
  EXPECT_EQ(j.nodes(0).node_id(), "a");
  EXPECT_TRUE(j.nodes(0).connected());
  EXPECT_THAT(std::vector<int>(j.nodes(1).ranks().begin(), j.nodes(1).ranks().end()),
              ElementsAre(2, 3));
  ASSERT_EQ(j.ranks_size(), 4);
  EXPECT_EQ(j.ranks(3).node_id(), "b");
  EXPECT_EQ(j.ranks(3).last_step(), 2);
  EXPECT_TRUE(j.ranks(3).connected());
  ASSERT_EQ(j.groups_size(), 1);
  const v1::GroupStatus& g = j.groups(0);
  EXPECT_EQ(g.num_params(), 4);
  EXPECT_EQ(g.last_decided_step(), 2);
  EXPECT_EQ(g.decisions(), 3);
  EXPECT_EQ(g.cache_hits(), 3);
  EXPECT_EQ(g.cache_misses(), 3);
  EXPECT_EQ(g.last_wire_dtype(), "bfloat16");
  EXPECT_EQ(g.last_num_skipped(), 1);
  EXPECT_FALSE(g.failed());
  EXPECT_EQ(coord_->ObserveStatus("other").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(ObserveTest, EndedJobStaysVisibleWithDisconnectedNodes) {
  RunScenario();
  coord_->CloseSession(a_);
  coord_->CloseSession(b_);
  absl::StatusOr<v1::StatusResponse> s = coord_->ObserveStatus("");
  ASSERT_TRUE(s.ok());
  ASSERT_EQ(s->jobs_size(), 1);
  EXPECT_FALSE(s->jobs(0).nodes(0).connected());
  EXPECT_EQ(s->jobs(0).groups(0).decisions(), 3);
  absl::StatusOr<v1::SkipMatrixResponse> m = coord_->ObserveSkipMatrix("job1", "", 0);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_THAT(Counts(m->groups(0).rows(1)), ElementsAre(3, 3, 0, 0));
  const std::string text = Metrics();
  EXPECT_EQ(Sample(text, R"(accord_decisions_total{job="job1",group="g"})"), 3);
  EXPECT_EQ(Sample(text, R"(accord_connected_sidecars{job="job1"})"), 0);
  log_->Flush();
  const std::string log = ReadAll(dir_ + "/events.jsonl");
  EXPECT_THAT(log, HasSubstr(R"("event":"node_disconnected")"));
}

// A run can end while its nodes are still connected: here node a's ranks
// were restarted (a NEW hello under another epoch) while node b still held
// its stream. The ended run is listed with nothing connected: its streams
// were detached from it, and no later disconnect reaches it (chaos seed 3021
// found a node and a rank listed as connected for good).
TEST_F(ObserveTest, ARunEndedWhileItsNodesWereConnectedIsListedWithNothingConnected) {
  RunScenario();
  FakeNodeSink a_new;
  const Coordinator::SessionId a2 = coord_->OpenSession(&a_new);
  v1::NodeMessage restarted = Hello("job1", "a", 4, {0, 1});
  restarted.mutable_hello()->set_run_start(v1::NodeHello::RUN_START_NEW);
  restarted.mutable_hello()->set_node_epoch(99);
  coord_->HandleMessage(a2, restarted);
  ASSERT_TRUE(sink_b_.messages().back().has_error());
  EXPECT_EQ(sink_b_.messages().back().error().kind(), v1::RUN_ENDED);
  coord_->CloseSession(a2);  // the new run's only node leaves; node b's stream stays open
  absl::StatusOr<v1::StatusResponse> s = coord_->ObserveStatus("job1");
  ASSERT_TRUE(s.ok()) << s.status();
  ASSERT_EQ(s->jobs_size(), 1);
  const v1::JobStatus& j = s->jobs(0);
  EXPECT_EQ(j.groups(0).decisions(), 3);  // the ended run, kept for the observe API
  ASSERT_EQ(j.nodes_size(), 2);
  for (const v1::NodeStatus& n : j.nodes()) EXPECT_FALSE(n.connected()) << n.node_id();
  ASSERT_EQ(j.ranks_size(), 4);
  for (const v1::RankStatus& r : j.ranks()) EXPECT_FALSE(r.connected()) << "rank " << r.rank();
}

TEST_F(ObserveTest, StallIsReportedOnceThenTheDeadlineFailsTheJob) {
  RunScenario();
  coord_->HandleMessage(
      a_, Batch({Repeat(
              "g", 3, NodeManifest("g", 0, {kBf16, kNone, kBf16, kNone}, 4, {0, 1}).cache_key())}));
  clock_.Advance(absl::Seconds(31));
  coord_->CheckDeadlines();
  coord_->CheckDeadlines();  // a second check reports nothing new
  absl::StatusOr<v1::StallsResponse> st = coord_->ObserveStalls("job1");
  ASSERT_TRUE(st.ok()) << st.status();
  ASSERT_EQ(st->stalls_size(), 1);
  const v1::Stall& s = st->stalls(0);
  EXPECT_EQ(s.group_id(), "g");
  EXPECT_EQ(s.step(), 3);
  EXPECT_EQ(s.waiting_ms(), 31000);
  EXPECT_EQ(s.deadline_in_ms(), 29000);
  EXPECT_THAT(std::vector<int>(s.missing_ranks().begin(), s.missing_ranks().end()),
              ElementsAre(2, 3));
  EXPECT_THAT(std::vector<int64_t>(s.missing_last_steps().begin(), s.missing_last_steps().end()),
              ElementsAre(2, 2));
  EXPECT_EQ(s.reported_ranks(), 2);
  std::string text = Metrics();
  EXPECT_EQ(Sample(text, R"(accord_stalled_groups{job="job1"})"), 1);
  EXPECT_EQ(Sample(text, R"(accord_stalls_total{job="job1"})"), 1);

  clock_.Advance(absl::Seconds(30));
  coord_->CheckDeadlines();
  text = Metrics();
  EXPECT_EQ(Sample(text, R"(accord_missing_rank_events_total{job="job1"})"), 2);
  EXPECT_EQ(Sample(text, R"(accord_errors_total{job="job1",kind="MISSING_RANKS"})"), 1);
  EXPECT_EQ(Sample(text, R"(accord_stalled_groups{job="job1"})"), 0);
  absl::StatusOr<v1::StatusResponse> status = coord_->ObserveStatus("job1");
  ASSERT_TRUE(status.ok());
  EXPECT_TRUE(status->jobs(0).failed());
  EXPECT_THAT(status->jobs(0).error(), HasSubstr("missing ranks"));
  EXPECT_EQ(coord_->ObserveStalls("job1")->stalls_size(), 0);
  EXPECT_EQ(coord_->ObserveStalls("nojob").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(ObserveTest, EventLogHoldsChangedDecisionsStallsFailuresAndNodes) {
  RunScenario();
  coord_->HandleMessage(a_, Batch({NodeManifest("g", 3, {kBf16, kBf16, kBf16, kBf16}, 4, {0, 1})}));
  clock_.Advance(absl::Seconds(31));
  coord_->CheckDeadlines();
  clock_.Advance(absl::Seconds(30));
  coord_->CheckDeadlines();
  std::vector<std::string> lines;
  log_->Flush();
  for (absl::string_view l :
       absl::StrSplit(ReadAll(dir_ + "/events.jsonl"), '\n', absl::SkipEmpty())) {
    lines.emplace_back(l);
  }
  auto count = [&](const std::string& needle) {
    int n = 0;
    for (const auto& l : lines) n += absl::StrContains(l, needle) ? 1 : 0;
    return n;
  };
  EXPECT_EQ(count(R"("event":"node_connected")"), 2);
  // Steps 1 and 2 decided the same wire and included set as step 0.
  ASSERT_EQ(count(R"("event":"decision_changed")"), 1);
  EXPECT_EQ(
      count(
          R"("step":0,"wire":"bfloat16","included":3,"skipped":1,"skipped_params":["layer3.weight"])"),
      1);
  EXPECT_EQ(count(R"("event":"stall")"), 1);
  EXPECT_EQ(count(R"("event":"deadline_failure")"), 1);
  EXPECT_EQ(count(R"("kind":"MISSING_RANKS")"), 1);
  EXPECT_EQ(count(R"("ranks":[2,3],"last_steps":[2,2])"), 3);  // stall, failure, error
}

// ObserveService over real gRPC on an ephemeral port.
TEST_F(ObserveTest, GrpcServiceServesTheViewsAndValidatesRequests) {
  RunScenario();
  ObserveGrpcService service(coord_.get(), [](const std::string& job, const std::string& token) {
    return token == "secret" ? absl::OkStatus()
                             : absl::PermissionDeniedError(absl::StrCat("bad token for ", job));
  });
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  auto stub = v1::ObserveService::NewStub(
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials()));

  v1::SkipMatrixRequest req;
  req.set_job_id("job1");
  req.set_token("secret");
  v1::SkipMatrixResponse resp;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub->SkipMatrix(&ctx, req, &resp).ok());
  }
  EXPECT_THAT(Counts(resp.groups(0).rows(2)), ElementsAre(0, 0, 2, 2));
  {
    grpc::ClientContext ctx;
    req.set_token("wrong");
    EXPECT_EQ(stub->SkipMatrix(&ctx, req, &resp).error_code(), grpc::StatusCode::PERMISSION_DENIED);
  }
  {
    grpc::ClientContext ctx;
    v1::StatusRequest sreq;
    sreq.set_job_id("missing-job");
    sreq.set_token("secret");
    v1::StatusResponse sresp;
    grpc::Status s = stub->Status(&ctx, sreq, &sresp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
    EXPECT_THAT(s.error_message(), HasSubstr("missing-job"));
  }
  {
    grpc::ClientContext ctx;
    req.set_token("secret");
    req.set_window_steps(-5);
    EXPECT_EQ(stub->SkipMatrix(&ctx, req, &resp).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  }
  {
    grpc::ClientContext ctx;
    v1::StallsRequest sreq;
    sreq.set_token("secret");
    v1::StallsResponse sresp;
    ASSERT_TRUE(stub->Stalls(&ctx, sreq, &sresp).ok());
    EXPECT_EQ(sresp.stalls_size(), 0);
  }
  server->Shutdown();
}

TEST_F(ObserveTest, AnEndedJobsSeriesAreRemovedAfterTheGraceUnlessItCameBack) {
  RunScenario();
  const std::string live = Metrics();
  ASSERT_NE(live.find("job=\"job1\""), std::string::npos);
  const size_t with_job = registry_.NumSeries();
  coord_->CloseSession(a_);
  coord_->CloseSession(b_);
  clock_.Advance(absl::Minutes(9));
  EXPECT_NE(Metrics().find("job=\"job1\""), std::string::npos) << "kept within the grace";
  EXPECT_EQ(metrics_->NumJobsWithSeries(), 1u);
  clock_.Advance(absl::Minutes(2));
  const std::string after = Metrics();
  EXPECT_EQ(after.find("job=\"job1\""), std::string::npos) << after;
  EXPECT_LT(registry_.NumSeries(), with_job);
  EXPECT_EQ(metrics_->NumJobsWithSeries(), 0u);
  // A job id that comes back within the grace keeps its series.
  FakeNodeSink sink;
  const auto s = coord_->OpenSession(&sink);
  coord_->HandleMessage(s, Hello("job2", "a", 1, {0}));
  coord_->CloseSession(s);
  clock_.Advance(absl::Minutes(5));
  const auto s2 = coord_->OpenSession(&sink);
  coord_->HandleMessage(s2, Hello("job2", "a", 1, {0}));
  clock_.Advance(absl::Minutes(20));
  EXPECT_NE(Metrics().find("job=\"job2\""), std::string::npos);
  coord_->CloseSession(s2);
}

}  // namespace
}  // namespace accord::daemon
