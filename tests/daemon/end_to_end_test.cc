// The real coordinator gRPC server (port 0) and a real sidecar (temp Unix
// socket) in one process, driven through raw RankService streams for 2 ranks.
#include <stdlib.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "daemon/common/clock.h"
#include "daemon/common/upstream_health.h"
#include "daemon/coordinator/coordinator.h"
#include "daemon/coordinator/grpc_coordinator_service.h"
#include "daemon/coordinator/kv_store.h"
#include "daemon/sidecar/grpc_sidecar.h"
#include "daemon/sidecar/sidecar.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "proto/wire.h"
#include "tests/daemon/test_util.h"

namespace accord::daemon {
namespace {

using RankStream = grpc::ClientReaderWriter<v1::RankMessage, v1::RankReply>;

class EndToEndTest : public ::testing::Test {
 protected:
  void SetUp() override {
    coordinator_ = std::make_unique<Coordinator>(CoordinatorOptions(), RealClock::Get());
    kv_ = std::make_unique<KvStore>(KvOptions(), RealClock::Get());
    coord_service_ = std::make_unique<CoordinatorGrpcService>(coordinator_.get());
    kv_service_ = std::make_unique<KeyValueGrpcService>(kv_.get());
    grpc::ServerBuilder cb;
    cb.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    cb.RegisterService(coord_service_.get());
    cb.RegisterService(kv_service_.get());
    coord_server_ = cb.BuildAndStart();
    ASSERT_NE(coord_server_, nullptr);
    ASSERT_GT(port_, 0);

    char dir[] = "/tmp/accord-e2e-XXXXXX";
    ASSERT_NE(mkdtemp(dir), nullptr);
    dir_ = dir;
    socket_ = "unix:" + dir_ + "/sidecar.sock";
    auto channel = grpc::CreateChannel("127.0.0.1:" + std::to_string(port_),
                                       grpc::InsecureChannelCredentials());
    SidecarOptions so;
    so.node_id = "node0";
    // These tests follow each decision through the coordinator (its cache,
    // its stats); local decisions have their own tests
    // (local_decisions_test.cc, tests/integration/local_decisions_test.cc).
    so.local_decisions = false;
    sidecar_ = std::make_unique<Sidecar>(so);
    upstream_ = std::make_unique<GrpcUpstream>(channel, sidecar_.get(), absl::Seconds(1));
    sidecar_->SetUpstream(upstream_.get());
    rank_service_ = std::make_unique<RankGrpcService>(sidecar_.get());
    kv_forwarder_ = std::make_unique<KeyValueForwarder>(channel, "");
    grpc::ServerBuilder sb;
    sb.AddListeningPort(socket_, grpc::InsecureServerCredentials());
    sb.RegisterService(rank_service_.get());
    sb.RegisterService(kv_forwarder_.get());
    sidecar_server_ = sb.BuildAndStart();
    ASSERT_NE(sidecar_server_, nullptr);
    upstream_->Start();
    rank_channel_ = grpc::CreateChannel(socket_, grpc::InsecureChannelCredentials());
  }

  void TearDown() override {
    if (rank_service_) rank_service_->FinishAll();
    if (sidecar_server_) sidecar_server_->Shutdown(Deadline(5));
    if (sidecar_) sidecar_->Stop();  // its timer sends upstream
    if (upstream_) upstream_->Stop();
    if (coord_service_) coord_service_->FinishAll();
    if (kv_) kv_->Stop();
    if (coord_server_) coord_server_->Shutdown(Deadline(5));
    if (coordinator_) coordinator_->Stop();
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }

  static std::chrono::system_clock::time_point Deadline(int seconds) {
    return std::chrono::system_clock::now() + std::chrono::seconds(seconds);
  }

  struct Rank {
    grpc::ClientContext context;
    std::unique_ptr<RankStream> stream;
  };
  std::unique_ptr<Rank> Connect(int rank, int world) {
    auto r = std::make_unique<Rank>();
    r->context.set_deadline(Deadline(30));
    r->stream = v1::RankService::NewStub(rank_channel_)->Session(&r->context);
    v1::RankMessage hello;
    hello.mutable_hello()->set_job_id("job-e2e");
    hello.mutable_hello()->set_rank(rank);
    hello.mutable_hello()->set_world_size(world);
    EXPECT_TRUE(r->stream->Write(hello));
    return r;
  }
  static v1::RankReply Next(Rank& r) {
    v1::RankReply reply;
    EXPECT_TRUE(r.stream->Read(&reply)) << "stream ended early";
    return reply;
  }
  static v1::RankMessage ManifestMsg(const std::string& group, int64_t step,
                                     const std::vector<std::optional<DType>>& dtypes) {
    Manifest m = RankManifest(step, 0, 2, dtypes);
    v1::RankMessage msg;
    wire::ManifestToProto(group, m, /*with_ranks=*/false, msg.mutable_manifests()->add_manifests());
    return msg;
  }

  int port_ = 0;
  std::string dir_, socket_;
  std::unique_ptr<Coordinator> coordinator_;
  std::unique_ptr<KvStore> kv_;
  std::unique_ptr<CoordinatorGrpcService> coord_service_;
  std::unique_ptr<KeyValueGrpcService> kv_service_;
  std::unique_ptr<grpc::Server> coord_server_;
  std::unique_ptr<Sidecar> sidecar_;
  std::unique_ptr<GrpcUpstream> upstream_;
  std::unique_ptr<RankGrpcService> rank_service_;
  std::unique_ptr<KeyValueForwarder> kv_forwarder_;
  std::unique_ptr<grpc::Server> sidecar_server_;
  std::shared_ptr<grpc::Channel> rank_channel_;
};

// A key-value call forwarded while nothing above answers (the coordinator
// just died, and the node's stream has not tried again yet, so nothing has
// marked the node above unanswered) waits for a channel that may never come
// up. It ends with the loss words once the node above counts as lost, not at
// the call's own deadline (chaos seeds 5182, 5619: ranks blocked in a Get
// past the bound their peers had ended at).
TEST(KeyValueForwarderTest, ACallForwardedWhileNothingAboveAnswersEndsAtTheLossLimit) {
  char dir[] = "/tmp/accord-kvf-XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  const std::string socket = absl::StrCat("unix:", dir, "/sidecar.sock");
  UpstreamHealth health(absl::Seconds(1));  // fresh: as if it had just answered
  // Nothing listens at the node above.
  KeyValueForwarder forwarder(grpc::CreateChannel(absl::StrCat("unix:", dir, "/nobody.sock"),
                                                  grpc::InsecureChannelCredentials()),
                              "");
  forwarder.SetHealth(&health);
  grpc::ServerBuilder sb;
  sb.AddListeningPort(socket, grpc::InsecureServerCredentials());
  sb.RegisterService(&forwarder);
  std::unique_ptr<grpc::Server> server = sb.BuildAndStart();
  ASSERT_NE(server, nullptr);
  auto stub =
      v1::KeyValueService::NewStub(grpc::CreateChannel(socket, grpc::InsecureChannelCredentials()));
  v1::KeyValueGetRequest request;
  request.set_job_id("j");
  request.add_keys("boot/0");
  request.set_timeout_ms(30000);
  v1::KeyValueGetResponse response;
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  const absl::Time start = absl::Now();
  grpc::Status s = stub->Get(&context, request, &response);
  // A liveness bound: the loss limit (1 s) and slack, far below the call's 30 s.
  EXPECT_LT(absl::Now() - start, absl::Seconds(15));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
  EXPECT_EQ(s.error_message(), UpstreamHealth::LostMessage("j", absl::Seconds(1)));
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
}

TEST_F(EndToEndTest, TwoRanksRegisterAgreeAndGetSameAsPreviousOnRepeat) {
  auto r0 = Connect(0, 2);
  auto r1 = Connect(1, 2);
  ASSERT_TRUE(Next(*r0).has_welcome());
  ASSERT_TRUE(Next(*r1).has_welcome());

  GroupSpec spec = testing::MakeSpec("g0", 2);
  v1::RankMessage reg;
  *reg.mutable_registration() = wire::GroupSpecToProto(spec, Policy());
  ASSERT_TRUE(r0->stream->Write(reg));
  ASSERT_TRUE(r1->stream->Write(reg));
  for (Rank* r : {r0.get(), r1.get()}) {
    v1::RankReply res = Next(*r);
    ASSERT_TRUE(res.has_registration()) << res.DebugString();
    EXPECT_FALSE(res.registration().has_error()) << res.DebugString();
    EXPECT_EQ(res.registration().spec_fingerprint(), SpecFingerprint(spec));
  }

  // Step 0: rank 0 has a bf16 gradient for param 0, rank 1 an fp16 one for param 1.
  ASSERT_TRUE(r0->stream->Write(ManifestMsg("g0", 0, {DType::kBFloat16, std::nullopt})));
  ASSERT_TRUE(r1->stream->Write(ManifestMsg("g0", 0, {std::nullopt, DType::kFloat16})));
  for (Rank* r : {r0.get(), r1.get()}) {
    v1::RankReply d = Next(*r);
    ASSERT_TRUE(d.has_decisions()) << d.DebugString();
    ASSERT_EQ(d.decisions().decisions_size(), 1);
    const v1::Decision& dec = d.decisions().decisions(0);
    ASSERT_TRUE(dec.has_ok()) << dec.DebugString();
    EXPECT_EQ(dec.ok().wire_dtype(), v1::FLOAT32);
    EXPECT_EQ(dec.ok().num_included(), 2);
  }

  // Step 1: the same usage: the node sends a repeat, the reply is same_as_previous.
  ASSERT_TRUE(r0->stream->Write(ManifestMsg("g0", 1, {DType::kBFloat16, std::nullopt})));
  ASSERT_TRUE(r1->stream->Write(ManifestMsg("g0", 1, {std::nullopt, DType::kFloat16})));
  for (Rank* r : {r0.get(), r1.get()}) {
    v1::RankReply d = Next(*r);
    ASSERT_EQ(d.decisions().decisions_size(), 1);
    EXPECT_TRUE(d.decisions().decisions(0).same_as_previous()) << d.DebugString();
    EXPECT_EQ(d.decisions().decisions(0).step(), 1);
  }
  EXPECT_EQ(coordinator_->stats().cache_hits, 1);
  EXPECT_EQ(coordinator_->stats().same_as_previous, 1);

  // An invalid manifest is answered to its sender only.
  v1::RankMessage bad = ManifestMsg("g0", 2, {DType::kBFloat16, std::nullopt});
  bad.mutable_manifests()->mutable_manifests(0)->set_used_bits("\x01\x01");
  ASSERT_TRUE(r0->stream->Write(bad));
  v1::RankReply e = Next(*r0);
  ASSERT_EQ(e.decisions().decisions_size(), 1);
  EXPECT_EQ(e.decisions().decisions(0).error().kind(), v1::INVALID_MANIFEST);
  // ...and rank 0 can still complete step 2 with a valid one.
  ASSERT_TRUE(r0->stream->Write(ManifestMsg("g0", 2, {DType::kBFloat16, DType::kBFloat16})));
  ASSERT_TRUE(r1->stream->Write(ManifestMsg("g0", 2, {std::nullopt, DType::kBFloat16})));
  for (Rank* r : {r0.get(), r1.get()}) {
    v1::RankReply d = Next(*r);
    ASSERT_EQ(d.decisions().decisions_size(), 1);
    ASSERT_TRUE(d.decisions().decisions(0).has_ok()) << d.DebugString();
    EXPECT_EQ(d.decisions().decisions(0).ok().wire_dtype(), v1::BFLOAT16);
  }

  // A second process claiming rank 1 is refused; the others are undisturbed.
  auto dup = Connect(1, 2);
  v1::RankReply refused = Next(*dup);
  ASSERT_TRUE(refused.has_error());
  EXPECT_EQ(refused.error().kind(), v1::DUPLICATE_RANK);
  v1::RankReply extra;
  EXPECT_FALSE(dup->stream->Read(&extra));
  EXPECT_EQ(dup->stream->Finish().error_code(), grpc::StatusCode::ALREADY_EXISTS);

  for (Rank* r : {r0.get(), r1.get()}) {
    r->stream->WritesDone();
    v1::RankReply rest;
    while (r->stream->Read(&rest)) {
    }
    EXPECT_TRUE(r->stream->Finish().ok());
  }
}

TEST_F(EndToEndTest, KeyValueThroughTheSidecarReachesTheCoordinator) {
  auto stub = v1::KeyValueService::NewStub(rank_channel_);
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline(10));
    v1::KeyValueSetRequest req;
    req.set_job_id("job-e2e");
    req.set_key("nccl_id");
    req.set_value("abc");
    v1::KeyValueSetResponse resp;
    ASSERT_TRUE(stub->Set(&ctx, req, &resp).ok());
  }
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline(10));
    v1::KeyValueGetRequest req;
    req.set_job_id("job-e2e");
    req.add_keys("nccl_id");
    req.set_timeout_ms(1000);
    v1::KeyValueGetResponse resp;
    grpc::Status s = stub->Get(&ctx, req, &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
    ASSERT_EQ(resp.values_size(), 1);
    EXPECT_EQ(resp.values(0), "abc");
  }
  {
    // Another job does not see the key.
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline(10));
    v1::KeyValueGetRequest req;
    req.set_job_id("other-job");
    req.add_keys("nccl_id");
    v1::KeyValueGetResponse resp;
    EXPECT_EQ(stub->Get(&ctx, req, &resp).error_code(), grpc::StatusCode::NOT_FOUND);
  }
}

}  // namespace
}  // namespace accord::daemon
