// Job isolation over real gRPC (loopback TCP, port 0): an in-process
// coordinator with a tokens table. NodeHello, key-value and observe requests
// with a wrong, missing or other job's token are refused with
// PERMISSION_DENIED; one job can neither read nor change another's entries.
// Also: the gRPC message size limit, and the sidecar's key-value forwarder.
#include <memory>
#include <string>

#include "absl/time/clock.h"
#include "daemon/common/auth_tokens.h"
#include "daemon/common/clock.h"
#include "daemon/coordinator/coordinator.h"
#include "daemon/coordinator/grpc_coordinator_service.h"
#include "daemon/coordinator/kv_store.h"
#include "daemon/sidecar/grpc_sidecar.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#ifdef ACCORD_HAVE_OBSERVE_SERVICE
#include "accord/v1/observe.grpc.pb.h"
#include "daemon/coordinator/observe_service.h"
#endif

namespace accord::daemon {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

JobTokens::Table Table() {
  absl::StatusOr<JobTokens::Table> t =
      JobTokens::Parse("job-a tokA\njob-b tokB\n* admin\n", "test tokens");
  EXPECT_TRUE(t.ok());
  return *t;
}

class GrpcAuthTest : public ::testing::Test {
 protected:
  void SetUp() override { Start(4 << 20); }
  void TearDown() override { Stop(); }

  void Start(int max_message_bytes) {
    CoordinatorOptions o;
    o.start_timer_thread = false;
    coordinator_ = std::make_unique<Coordinator>(o, RealClock::Get());
    kv_ = std::make_unique<KvStore>(KvOptions(), RealClock::Get());
    coordinator_service_ = std::make_unique<CoordinatorGrpcService>(coordinator_.get(), &tokens_);
    kv_service_ = std::make_unique<KeyValueGrpcService>(kv_.get(), &tokens_);
    grpc::ServerBuilder b;
    int port = 0;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    b.SetMaxReceiveMessageSize(max_message_bytes);
    b.SetMaxSendMessageSize(max_message_bytes);
    b.RegisterService(coordinator_service_.get());
    b.RegisterService(kv_service_.get());
#ifdef ACCORD_HAVE_OBSERVE_SERVICE
    observe_service_ = std::make_unique<ObserveGrpcService>(
        coordinator_.get(), [this](const std::string& job, const std::string& token) {
          return job.empty() ? tokens_.CheckAdmin(token, "observe request about every job")
                             : tokens_.CheckJobRead(job, token, "observe request");
        });
    b.RegisterService(observe_service_.get());
#endif
    server_ = b.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    address_ = "127.0.0.1:" + std::to_string(port);
    channel_ = grpc::CreateChannel(address_, grpc::InsecureChannelCredentials());
  }

  void Stop() {
    if (server_ == nullptr) return;
    coordinator_service_->FinishAll();
    kv_->Stop();
    server_->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    coordinator_->Stop();
    server_.reset();
  }

  // Opens a node session, sends a hello, returns the first reply and the
  // stream's final status.
  std::pair<v1::CoordinatorMessage, grpc::Status> Hello(const std::string& job,
                                                        const std::string& token, bool expect_end) {
    auto stub = v1::CoordinatorService::NewStub(channel_);
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
    auto stream = stub->Session(&ctx);
    v1::NodeMessage m;
    m.mutable_hello()->set_job_id(job);
    m.mutable_hello()->set_node_id("n1");
    m.mutable_hello()->set_world_size(1);
    m.mutable_hello()->add_ranks(0);
    m.mutable_hello()->set_token(token);
    EXPECT_TRUE(stream->Write(m));
    v1::CoordinatorMessage reply;
    EXPECT_TRUE(stream->Read(&reply));
    stream->WritesDone();
    if (expect_end) {
      v1::CoordinatorMessage extra;
      EXPECT_FALSE(stream->Read(&extra)) << extra.DebugString();
    } else {
      ctx.TryCancel();
      while (stream->Read(&reply)) {
      }
    }
    return {reply, stream->Finish()};
  }

  grpc::Status KvSet(const std::string& job, const std::string& token, const std::string& key,
                     const std::string& value) {
    auto stub = v1::KeyValueService::NewStub(channel_);
    grpc::ClientContext ctx;
    v1::KeyValueSetRequest req;
    req.set_job_id(job);
    req.set_key(key);
    req.set_value(value);
    req.set_token(token);
    v1::KeyValueSetResponse resp;
    return stub->Set(&ctx, req, &resp);
  }

  absl::StatusOr<std::string> KvGet(std::shared_ptr<grpc::Channel> channel, const std::string& job,
                                    const std::string& token, const std::string& key) {
    auto stub = v1::KeyValueService::NewStub(channel);
    grpc::ClientContext ctx;
    v1::KeyValueGetRequest req;
    req.set_job_id(job);
    req.add_keys(key);
    req.set_token(token);
    v1::KeyValueGetResponse resp;
    grpc::Status s = stub->Get(&ctx, req, &resp);
    if (!s.ok())
      return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
    return resp.values(0);
  }

  JobTokens tokens_{Table()};
  std::unique_ptr<Coordinator> coordinator_;
  std::unique_ptr<KvStore> kv_;
  std::unique_ptr<CoordinatorGrpcService> coordinator_service_;
  std::unique_ptr<KeyValueGrpcService> kv_service_;
#ifdef ACCORD_HAVE_OBSERVE_SERVICE
  std::unique_ptr<ObserveGrpcService> observe_service_;
#endif
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
  std::shared_ptr<grpc::Channel> channel_;
};

TEST_F(GrpcAuthTest, NodeHelloWithTheJobsTokenIsWelcomed) {
  auto [reply, status] = Hello("job-a", "tokA", /*expect_end=*/false);
  EXPECT_TRUE(reply.has_welcome()) << reply.DebugString();
}

TEST_F(GrpcAuthTest, NodeHelloWithWrongMissingOrOtherJobsTokenIsDenied) {
  for (const char* token : {"wrong", "", "tokB", "admin"}) {
    auto [reply, status] = Hello("job-a", token, /*expect_end=*/true);
    ASSERT_TRUE(reply.has_error()) << token << ": " << reply.DebugString();
    EXPECT_EQ(reply.error().kind(), v1::PERMISSION_DENIED);
    EXPECT_EQ(reply.error().job_id(), "job-a");
    EXPECT_THAT(reply.error().message(), HasSubstr("--tokens_file"));
    EXPECT_EQ(status.error_code(), grpc::StatusCode::PERMISSION_DENIED) << token;
  }
  EXPECT_EQ(tokens_.denied(), 4);
  // The refused hellos created no job.
  EXPECT_EQ(coordinator_->stats().jobs, 0);
}

TEST_F(GrpcAuthTest, KeyValueCrossJobReadAndWriteAreDenied) {
  ASSERT_TRUE(KvSet("job-a", "tokA", "nccl_id", "A-secret").ok());
  ASSERT_TRUE(KvSet("job-b", "tokB", "nccl_id", "B-secret").ok());
  // Job b's token cannot read or overwrite job a's entry.
  absl::StatusOr<std::string> read = KvGet(channel_, "job-a", "tokB", "nccl_id");
  EXPECT_EQ(read.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(read.status().message(), Not(HasSubstr("A-secret")));
  grpc::Status write = KvSet("job-a", "tokB", "nccl_id", "forged");
  EXPECT_EQ(write.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(KvSet("job-a", "", "k", "v").error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(KvSet("job-a", "admin", "k", "v").error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(KvGet(channel_, "job-a", "", "nccl_id").status().code(),
            absl::StatusCode::kPermissionDenied);
  // Each job still sees exactly its own value.
  EXPECT_EQ(KvGet(channel_, "job-a", "tokA", "nccl_id").value_or("?"), "A-secret");
  EXPECT_EQ(KvGet(channel_, "job-b", "tokB", "nccl_id").value_or("?"), "B-secret");
}

TEST_F(GrpcAuthTest, SidecarForwarderRefusesAnotherTokenAndSendsItsOwn) {
  // A sidecar holding job a's token, serving on a second in-process server.
  KeyValueForwarder forwarder(channel_, "", "tokA");
  grpc::ServerBuilder b;
  int port = 0;
  b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  b.RegisterService(&forwarder);
  std::unique_ptr<grpc::Server> sidecar = b.BuildAndStart();
  ASSERT_NE(sidecar, nullptr);
  auto local =
      grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials());
  ASSERT_TRUE(KvSet("job-a", "tokA", "k", "v").ok());
  // A rank without a token gets through with the sidecar's token.
  EXPECT_EQ(KvGet(local, "job-a", "", "k").value_or("?"), "v");
  // A rank with another token is refused by the sidecar itself.
  EXPECT_EQ(KvGet(local, "job-a", "tokB", "k").status().code(),
            absl::StatusCode::kPermissionDenied);
  // Job b's keys stay out of reach: the coordinator refuses job a's token.
  ASSERT_TRUE(KvSet("job-b", "tokB", "k", "b").ok());
  EXPECT_EQ(KvGet(local, "job-b", "", "k").status().code(), absl::StatusCode::kPermissionDenied);
  sidecar->Shutdown(absl::ToChronoTime(absl::Now()));
}

TEST_F(GrpcAuthTest, MessageOverTheSizeLimitIsResourceExhausted) {
  Stop();
  Start(/*max_message_bytes=*/1024);
  grpc::Status s = KvSet("job-a", "tokA", "big", std::string(4096, 'x'));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("1024"));
  EXPECT_TRUE(KvSet("job-a", "tokA", "small", std::string(100, 'x')).ok());
}

#ifdef ACCORD_HAVE_OBSERVE_SERVICE
TEST_F(GrpcAuthTest, ObserveCrossJobReadIsDeniedAndListingAllNeedsAdmin) {
  auto [welcome, unused] = Hello("job-a", "tokA", /*expect_end=*/false);
  ASSERT_TRUE(welcome.has_welcome());
  auto stub = v1::ObserveService::NewStub(channel_);
  auto status = [&](const std::string& job, const std::string& token) {
    grpc::ClientContext ctx;
    v1::StatusRequest req;
    req.set_job_id(job);
    req.set_token(token);
    v1::StatusResponse resp;
    return stub->Status(&ctx, req, &resp);
  };
  EXPECT_EQ(status("job-a", "tokB").error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(status("job-a", "").error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(status("", "tokA").error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_NE(status("job-a", "tokA").error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_NE(status("job-a", "admin").error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_TRUE(status("", "admin").ok());
  grpc::ClientContext ctx;
  v1::SkipMatrixRequest req;
  req.set_job_id("job-a");
  req.set_token("tokB");
  v1::SkipMatrixResponse resp;
  EXPECT_EQ(stub->SkipMatrix(&ctx, req, &resp).error_code(), grpc::StatusCode::PERMISSION_DENIED);
  grpc::ClientContext ctx2;
  v1::StallsRequest sreq;
  sreq.set_token("tokA");
  v1::StallsResponse sresp;
  EXPECT_EQ(stub->Stalls(&ctx2, sreq, &sresp).error_code(), grpc::StatusCode::PERMISSION_DENIED);
}
#endif

}  // namespace
}  // namespace accord::daemon
