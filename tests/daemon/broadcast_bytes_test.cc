// A broadcast is serialized once for every node stream (SerializedOnce in the
// coordinator's gRPC adapter; the relay's fan-out uses the same adapter). The
// unit tests pin the cache; the end-to-end test runs a Coordinator behind its
// real gRPC service with three node streams and fails if a decision reached
// the streams as different bytes, or was serialized once per stream.
#include <memory>
#include <string>
#include <vector>

#include "daemon/common/clock.h"
#include "daemon/common/serialized_once.h"
#include "daemon/coordinator/coordinator.h"
#include "daemon/coordinator/grpc_coordinator_service.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/daemon/test_util.h"

namespace accord::daemon {
namespace {

using testing::Batch;
using testing::Hello;
using testing::MakeSpec;
using testing::NodeManifest;
using testing::Registration;

std::string BytesOf(const grpc::ByteBuffer& b) {
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(b.Dump(&slices).ok());
  std::string out;
  for (const grpc::Slice& s : slices)
    out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return out;
}

v1::CoordinatorMessage Decisions(int n) {
  v1::CoordinatorMessage m;
  for (int i = 0; i < n; ++i) {
    v1::Decision* d = m.mutable_decisions()->add_decisions();
    d->set_group_id("g" + std::to_string(i));
    d->set_step(7);
    d->mutable_ok()->set_num_included(i);
  }
  return m;
}

TEST(SerializedOnceTest, TheSameMessageObjectGetsTheSameBytesObject) {
  SerializedOnce<v1::CoordinatorMessage> once;
  auto msg = std::make_shared<const v1::CoordinatorMessage>(Decisions(3));
  std::shared_ptr<const grpc::ByteBuffer> a = once.Get(msg);
  std::shared_ptr<const grpc::ByteBuffer> b = once.Get(msg);
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a, b);
  EXPECT_EQ(once.serializations(), 1);
  EXPECT_EQ(once.hits(), 1);
  EXPECT_EQ(BytesOf(*a), msg->SerializeAsString());
}

TEST(SerializedOnceTest, AnEqualButDistinctMessageIsSerializedAgain) {
  SerializedOnce<v1::CoordinatorMessage> once;
  auto first = std::make_shared<const v1::CoordinatorMessage>(Decisions(2));
  auto second = std::make_shared<const v1::CoordinatorMessage>(Decisions(5));
  std::shared_ptr<const grpc::ByteBuffer> a = once.Get(first);
  std::shared_ptr<const grpc::ByteBuffer> b = once.Get(second);
  EXPECT_NE(a, b);
  EXPECT_EQ(once.serializations(), 2);
  EXPECT_EQ(BytesOf(*a), first->SerializeAsString());
  EXPECT_EQ(BytesOf(*b), second->SerializeAsString());
}

class BroadcastBytesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    CoordinatorOptions o;
    o.start_timer_thread = false;
    coordinator_ = std::make_unique<Coordinator>(o, RealClock::Get());
    service_ = std::make_unique<CoordinatorGrpcService>(coordinator_.get());
    grpc::ServerBuilder b;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    b.RegisterService(service_.get());
    server_ = b.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    channel_ = grpc::CreateChannel("127.0.0.1:" + std::to_string(port_),
                                   grpc::InsecureChannelCredentials());
  }
  void TearDown() override {
    service_->FinishAll();
    server_->Shutdown();
    coordinator_->Stop();
  }

  std::unique_ptr<Coordinator> coordinator_;
  std::unique_ptr<CoordinatorGrpcService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::shared_ptr<grpc::Channel> channel_;
  int port_ = 0;
};

TEST_F(BroadcastBytesTest, EveryNodeStreamGetsTheSameDecisionBytesSerializedOnce) {
  constexpr int kNodes = 3;
  const GroupSpec spec = MakeSpec("g", 4);
  auto stub = v1::CoordinatorService::NewStub(channel_);
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts;
  std::vector<std::unique_ptr<grpc::ClientReaderWriter<v1::NodeMessage, v1::CoordinatorMessage>>>
      streams;
  for (int n = 0; n < kNodes; ++n) {
    contexts.push_back(std::make_unique<grpc::ClientContext>());
    streams.push_back(stub->Session(contexts.back().get()));
    ASSERT_TRUE(streams[n]->Write(Hello("j", "node" + std::to_string(n), kNodes, {n})));
    v1::CoordinatorMessage welcome;
    ASSERT_TRUE(streams[n]->Read(&welcome));
    ASSERT_TRUE(welcome.has_welcome()) << welcome.DebugString();
  }
  for (int n = 0; n < kNodes; ++n) ASSERT_TRUE(streams[n]->Write(Registration(spec, {n})));
  for (int n = 0; n < kNodes; ++n) {
    v1::CoordinatorMessage result;
    ASSERT_TRUE(streams[n]->Read(&result));
    ASSERT_TRUE(result.has_registration()) << result.DebugString();
  }
  const int64_t before = service_->serializations();
  for (int n = 0; n < kNodes; ++n) {
    // Node n lacks parameter n: the decision depends on every node.
    std::vector<std::optional<DType>> dtypes(4, DType::kFloat32);
    dtypes[n] = std::nullopt;
    ASSERT_TRUE(streams[n]->Write(Batch({NodeManifest("g", 0, dtypes, kNodes, {n})})));
  }
  std::vector<std::string> got;
  for (int n = 0; n < kNodes; ++n) {
    v1::CoordinatorMessage d;
    ASSERT_TRUE(streams[n]->Read(&d));
    ASSERT_TRUE(d.has_decisions()) << d.DebugString();
    got.push_back(d.SerializeAsString());
  }
  for (int n = 1; n < kNodes; ++n) EXPECT_EQ(got[n], got[0]) << "node " << n;
  // One serialization for the broadcast, reused by the other streams.
  EXPECT_EQ(service_->serializations() - before, 1);
  EXPECT_GE(service_->serialization_reuses(), kNodes - 1);
  for (auto& s : streams) s->WritesDone();
}

}  // namespace
}  // namespace accord::daemon
