// Bad input over a sidecar's socket, through raw RankService stubs: each gets
// a precise error, and the sidecars then serve a good job undisturbed. A
// sidecar serves one job at a time (see daemon/sidecar/sidecar.h), so the
// good job runs once the bad sessions are gone and the sidecar has reset.
#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "accord/v1/accord.grpc.pb.h"
#include "client/testing/local_cluster.h"
#include "gmock/gmock.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "gtest/gtest.h"
#include "proto/wire.h"

namespace accord::testing {
namespace {

using ::testing::HasSubstr;

// One raw Session stream. An "error" is what the peer says is wrong: an error
// reply, an error decision, a failed registration, or the stream's final
// status.
class RawSession {
 public:
  explicit RawSession(const std::string& socket) {
    channel_ = grpc::CreateChannel("unix:" + socket, grpc::InsecureChannelCredentials());
    stub_ = v1::RankService::NewStub(channel_);
    ctx_.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    stream_ = stub_->Session(&ctx_);
  }
  ~RawSession() {
    ctx_.TryCancel();
    if (!finished_) stream_->Finish();
  }

  bool Send(const v1::RankMessage& m) { return stream_->Write(m); }
  bool Hello(const std::string& job, int rank, int world) {
    v1::RankMessage m;
    m.mutable_hello()->set_job_id(job);
    m.mutable_hello()->set_rank(rank);
    m.mutable_hello()->set_world_size(world);
    return Send(m);
  }
  // The next reply; std::nullopt when the stream ended (status in final_).
  std::optional<v1::RankReply> Next() {
    v1::RankReply r;
    if (stream_->Read(&r)) return r;
    final_ = stream_->Finish();
    finished_ = true;
    return std::nullopt;
  }
  // Reads until an error of any form; returns {code, message}.
  std::pair<absl::StatusCode, std::string> NextError() {
    while (std::optional<v1::RankReply> r = Next()) {
      if (r->has_error()) return {Code(r->error()), r->error().message()};
      if (r->has_registration() && r->registration().has_error()) {
        return {Code(r->registration().error()), r->registration().error().message()};
      }
      if (r->has_decisions()) {
        for (const v1::Decision& d : r->decisions().decisions()) {
          if (d.has_error()) return {Code(d.error()), d.error().message()};
        }
      }
    }
    return {static_cast<absl::StatusCode>(final_.error_code()), final_.error_message()};
  }
  bool Welcomed() {
    std::optional<v1::RankReply> r = Next();
    return r.has_value() && r->has_welcome();
  }

 private:
  static absl::StatusCode Code(const v1::DecisionError& e) { return wire::ErrorToStatus(e).code(); }
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::RankService::Stub> stub_;
  grpc::ClientContext ctx_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::RankMessage, v1::RankReply>> stream_;
  grpc::Status final_;
  bool finished_ = false;
};

v1::RankMessage Registration(const std::string& group) {
  v1::RankMessage m;
  GroupSpec spec{group, {{"a", 4, 8}, {"b", 4, 4}}};
  *m.mutable_registration() = wire::GroupSpecToProto(spec, Policy());
  return m;
}

v1::RankMessage ManifestMsg(const std::string& group, int64_t step, std::string used_bits) {
  v1::RankMessage m;
  v1::Manifest* pm = m.mutable_manifests()->add_manifests();
  pm->set_group_id(group);
  pm->set_step(step);
  pm->set_used_bits(std::move(used_bits));
  pm->set_uniform_dtype(v1::FLOAT32);
  return m;
}

class BadInputTest : public ::testing::Test {
 protected:
  void SetUp() override {
    LocalClusterOptions o;
    o.num_sidecars = 2;
    absl::StatusOr<std::unique_ptr<LocalCluster>> c = LocalCluster::Start(o);
    ASSERT_TRUE(c.ok()) << c.status();
    cluster_ = *std::move(c);
  }
  // Waits until sidecar `i` dropped the bad job (its ranks all left).
  void WaitReset(int i) {
    absl::Status s = cluster_->WaitForSidecarOutput(i, "no rank left on this node", 1,
                                                    absl::Now() + absl::Seconds(30));
    ASSERT_TRUE(s.ok()) << s;
  }
  // A good job of 4 ranks on the same sidecars must still work.
  void ExpectGoodJobUndisturbed() {
    std::vector<std::string> cmd = {ACCORD_RANK_SCENARIO, "--socket={socket}",
                                    "--rank={rank}",      "--world={world}",
                                    "--job={job}",        "--rules=1:1:*:none"};
    absl::StatusOr<std::vector<RankResult>> r =
        cluster_->RunRanks(cmd, 4, "good", absl::Seconds(60));
    ASSERT_TRUE(r.ok()) << r.status();
    for (const RankResult& res : *r) EXPECT_EQ(res.exit_code, 0) << res.output;
  }
  std::unique_ptr<LocalCluster> cluster_;
};

TEST_F(BadInputTest, DuplicateRankIsAlreadyExists) {
  {
    RawSession a(cluster_->sidecar_sockets()[0]);
    ASSERT_TRUE(a.Hello("bad", 0, 2));
    ASSERT_TRUE(a.Welcomed());
    RawSession b(cluster_->sidecar_sockets()[0]);
    b.Hello("bad", 0, 2);
    auto [code, msg] = b.NextError();
    EXPECT_EQ(code, absl::StatusCode::kAlreadyExists) << msg;
    EXPECT_THAT(msg, HasSubstr("rank 0 "));
  }
  WaitReset(0);
  ExpectGoodJobUndisturbed();
}

TEST_F(BadInputTest, HelloWithoutAJobIsInvalidArgument) {
  RawSession a(cluster_->sidecar_sockets()[0]);
  a.Hello("", 0, 2);
  auto [code, msg] = a.NextError();
  EXPECT_EQ(code, absl::StatusCode::kInvalidArgument) << msg;
  ExpectGoodJobUndisturbed();
}

TEST_F(BadInputTest, RankOutsideTheWorldIsInvalidArgument) {
  RawSession a(cluster_->sidecar_sockets()[1]);
  a.Hello("bad", 7, 2);
  auto [code, msg] = a.NextError();
  EXPECT_EQ(code, absl::StatusCode::kInvalidArgument) << msg;
  EXPECT_THAT(msg, HasSubstr("7"));
}

TEST_F(BadInputTest, ManifestForAnUnknownGroupNamesIt) {
  {
    RawSession a(cluster_->sidecar_sockets()[0]);
    ASSERT_TRUE(a.Hello("bad", 0, 1));
    ASSERT_TRUE(a.Welcomed());
    a.Send(ManifestMsg("no-such-group", 0, std::string(1, '\x03')));
    auto [code, msg] = a.NextError();
    EXPECT_EQ(code, absl::StatusCode::kNotFound) << msg;
    EXPECT_THAT(msg, HasSubstr("no-such-group"));
  }
  WaitReset(0);
  ExpectGoodJobUndisturbed();
}

TEST_F(BadInputTest, WrongBitsetLengthAndStepGoingBackwardsArePreciseErrors) {
  {
    RawSession a(cluster_->sidecar_sockets()[0]);
    ASSERT_TRUE(a.Hello("bad", 0, 1));
    ASSERT_TRUE(a.Welcomed());
    a.Send(Registration("g"));
    std::optional<v1::RankReply> reg = a.Next();
    ASSERT_TRUE(reg.has_value() && reg->has_registration());
    ASSERT_FALSE(reg->registration().has_error()) << reg->registration().error().message();

    a.Send(ManifestMsg("g", 0, std::string("\x03\x00", 2)));  // 2 bytes for 2 params
    auto [code, msg] = a.NextError();
    EXPECT_EQ(code, absl::StatusCode::kInvalidArgument) << msg;
    EXPECT_THAT(msg, HasSubstr("\"g\""));

    a.Send(ManifestMsg("g", 5, std::string(1, '\x03')));
    std::optional<v1::RankReply> ok = a.Next();
    ASSERT_TRUE(ok.has_value() && ok->has_decisions()) << (ok ? ok->DebugString() : "ended");
    a.Send(ManifestMsg("g", 3, std::string(1, '\x03')));
    auto [code2, msg2] = a.NextError();
    EXPECT_EQ(code2, absl::StatusCode::kFailedPrecondition) << msg2;  // STEP_REGRESSION
    EXPECT_THAT(msg2, HasSubstr("step 3: older than the last decided step 5"));
  }
  WaitReset(0);
  ExpectGoodJobUndisturbed();
}

TEST_F(BadInputTest, OversizedMessageIsRefused) {
  {
    RawSession a(cluster_->sidecar_sockets()[1]);
    ASSERT_TRUE(a.Hello("bad", 0, 1));
    ASSERT_TRUE(a.Welcomed());
    a.Send(Registration(std::string(64 << 20, 'x')));  // 64 MiB group id
    auto [code, msg] = a.NextError();
    // gRPC refuses it before the sidecar sees it.
    EXPECT_EQ(code, absl::StatusCode::kResourceExhausted)
        << absl::StatusCodeToString(code) << ": " << msg;
  }
  WaitReset(1);
  ExpectGoodJobUndisturbed();
}

}  // namespace
}  // namespace accord::testing
