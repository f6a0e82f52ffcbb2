// A reader that stops reading, end to end through real daemons: a rank that
// keeps submitting but never reads its replies is cut off by its sidecar
// once more than --stream_queue_high_watermark replies wait for it
// (docs/ARCHITECTURE.md, "Bounds"), with a RESOURCE_EXHAUSTED status naming
// the flag, instead of growing the sidecar's memory; the sidecar then serves
// the next job.
#include <chrono>
#include <memory>
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

constexpr int kHigh = 64;

TEST(SlowReaderTest, ARankThatStopsReadingIsCutOffAndTheSidecarServesTheNextJob) {
  LocalClusterOptions o;
  o.sidecar_flags = {"--stream_queue_low_watermark=16",
                     absl::StrCat("--stream_queue_high_watermark=", kHigh)};
  o.echo = false;
  absl::StatusOr<std::unique_ptr<LocalCluster>> cluster = LocalCluster::Start(o);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  const std::string socket = (*cluster)->sidecar_sockets()[0];

  // The rank's receive window stays at gRPC's default (no BDP growth), so
  // the sidecar's writes stall after a bounded number of replies.
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  auto channel =
      grpc::CreateCustomChannel("unix:" + socket, grpc::InsecureChannelCredentials(), args);
  auto stub = v1::RankService::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
  auto stream = stub->Session(&ctx);
  v1::RankMessage hello;
  hello.mutable_hello()->set_job_id("slow");
  hello.mutable_hello()->set_rank(0);
  hello.mutable_hello()->set_world_size(1);
  ASSERT_TRUE(stream->Write(hello));
  v1::RankReply reply;
  ASSERT_TRUE(stream->Read(&reply));
  ASSERT_TRUE(reply.has_welcome()) << reply.DebugString();
  const GroupSpec spec{"g", {{"a", 4, 8}, {"b", 4, 4}}};
  v1::RankMessage reg;
  *reg.mutable_registration() = wire::GroupSpecToProto(spec, Policy());
  ASSERT_TRUE(stream->Write(reg));
  ASSERT_TRUE(stream->Read(&reply));
  ASSERT_TRUE(reply.has_registration()) << reply.DebugString();
  ASSERT_FALSE(reply.registration().has_error()) << reply.DebugString();

  // Submit step after step without reading a single decision, until the
  // sidecar ends the stream (a write fails) or 200,000 steps went out.
  int64_t written = 0;
  for (int64_t step = 0; step < 200000; ++step) {
    v1::RankMessage m;
    v1::Manifest* pm = m.mutable_manifests()->add_manifests();
    pm->set_group_id("g");
    pm->set_step(step);
    pm->set_used_bits(std::string(1, step % 2 == 0 ? '\x03' : '\x01'));  // a new decision each step
    pm->set_uniform_dtype(v1::FLOAT32);
    if (!stream->Write(m)) break;
    ++written;
  }
  ASSERT_TRUE(
      (*cluster)
          ->WaitForSidecarOutput(0, "did not read its stream", 1, absl::Now() + absl::Seconds(60))
          .ok())
      << (*cluster)->SidecarOutput(0);

  // What was queued before the cut is still delivered, then the status.
  int64_t decisions = 0;
  while (stream->Read(&reply)) decisions += reply.decisions().decisions_size();
  const grpc::Status status = stream->Finish();
  std::printf("wrote %lld steps, read %lld decisions before the cut\n",
              static_cast<long long>(written), static_cast<long long>(decisions));
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
  EXPECT_THAT(status.error_message(),
              HasSubstr(absl::StrCat("did not read its stream: more than ", kHigh,
                                     " messages were queued for it "
                                     "(--stream_queue_high_watermark), so it was cut off instead "
                                     "of growing the daemon's memory")));
  EXPECT_LT(decisions, written) << "the rank was cut off before all its decisions were queued";

  // The node is free again: a job of two ranks runs to the end.
  ASSERT_TRUE(
      (*cluster)
          ->WaitForSidecarOutput(0, "no rank left on this node", 1, absl::Now() + absl::Seconds(30))
          .ok());
  std::vector<std::string> cmd = {ACCORD_RANK_SCENARIO, "--socket={socket}", "--rank={rank}",
                                  "--world={world}", "--job={job}"};
  absl::StatusOr<std::vector<RankResult>> r =
      (*cluster)->RunRanks(cmd, 2, "next", absl::Seconds(60));
  ASSERT_TRUE(r.ok()) << r.status();
  for (const RankResult& res : *r) EXPECT_EQ(res.exit_code, 0) << res.output;
}

}  // namespace
}  // namespace accord::testing
