// The upstream channel's flag checks (daemon/common/upstream_channel.h),
// shared by the sidecar and the relay: each bad combination is refused with
// a message naming the daemon's own flags.
#include "daemon/common/upstream_channel.h"

#include <cstdio>
#include <fstream>
#include <string>

#include "absl/strings/match.h"
#include "daemon/common/token_flags.h"
#include "gtest/gtest.h"

namespace accord::daemon {
namespace {

std::string TempFile(const std::string& name, const std::string& text) {
  const std::string path = ::testing::TempDir() + "/" + name;
  std::ofstream(path) << text;
  return path;
}

TEST(UpstreamChannelTest, LoopbackPlaintextNeedsNoFlags) {
  UpstreamFlags f;
  f.target = "127.0.0.1:7070";
  absl::StatusOr<std::shared_ptr<grpc::Channel>> c = UpstreamChannel(f);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_NE(*c, nullptr);
}

TEST(UpstreamChannelTest, RemotePlaintextWithoutTheFlagIsRefused) {
  UpstreamFlags f;
  f.target = "coordinator.example:7070";
  absl::StatusOr<std::shared_ptr<grpc::Channel>> c = UpstreamChannel(f);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kFailedPrecondition) << c.status();
  f.plaintext = true;
  EXPECT_TRUE(UpstreamChannel(f).ok());
}

TEST(UpstreamChannelTest, HalfAKeyPairNamesTheDaemonsOwnFlags) {
  const std::string cert = TempFile("upstream_cert.pem", "not really a certificate\n");
  UpstreamFlags f;
  f.target = "127.0.0.1:7070";
  f.cert_path = cert;
  f.tls_flag_prefix = "upstream_tls_";
  absl::StatusOr<std::shared_ptr<grpc::Channel>> c = UpstreamChannel(f);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(c.status().message(), "--upstream_tls_cert and --upstream_tls_key"))
      << c.status();
}

TEST(UpstreamChannelTest, PlaintextRuleNamesTheRelaysUpstreamFlags) {
  UpstreamFlags f;
  f.target = "coordinator.example:7070";
  f.tls_flag_prefix = "upstream_tls_";
  absl::StatusOr<std::shared_ptr<grpc::Channel>> c = UpstreamChannel(f);
  ASSERT_FALSE(c.ok());
  EXPECT_TRUE(absl::StrContains(c.status().message(), "give --upstream_tls_ca")) << c.status();
  EXPECT_TRUE(absl::StrContains(c.status().message(), "or --upstream_plaintext")) << c.status();
  f.plaintext = true;
  f.ca_path = "/nonexistent/ca.pem";
  c = UpstreamChannel(f);
  ASSERT_FALSE(c.ok());
  EXPECT_TRUE(
      absl::StrContains(c.status().message(), "--upstream_plaintext contradicts --upstream_tls_ca"))
      << c.status();
}

TEST(UpstreamChannelTest, UnreadableCaNamesTheFlagAndThePath) {
  UpstreamFlags f;
  f.target = "127.0.0.1:7070";
  f.ca_path = "/nonexistent/ca.pem";
  absl::StatusOr<std::shared_ptr<grpc::Channel>> c = UpstreamChannel(f);
  ASSERT_FALSE(c.ok());
  EXPECT_TRUE(absl::StrContains(c.status().message(), "tls_ca")) << c.status();
  EXPECT_TRUE(absl::StrContains(c.status().message(), "/nonexistent/ca.pem")) << c.status();
}

TEST(UpstreamChannelTest, KeepaliveOutOfRangeIsRefused) {
  UpstreamFlags f;
  f.target = "127.0.0.1:7070";
  f.keepalive_time = absl::ZeroDuration();
  absl::StatusOr<std::shared_ptr<grpc::Channel>> c = UpstreamChannel(f);
  ASSERT_FALSE(c.ok());
  EXPECT_TRUE(absl::StrContains(c.status().message(), "--keepalive_time")) << c.status();
  EXPECT_FALSE(KeepaliveMillis(absl::Seconds(1), absl::Hours(24 * 30)).ok());
  absl::StatusOr<std::pair<int, int>> ms = KeepaliveMillis(absl::Seconds(10), absl::Seconds(5));
  ASSERT_TRUE(ms.ok());
  EXPECT_EQ(ms->first, 10000);
  EXPECT_EQ(ms->second, 5000);
}

TEST(UpstreamChannelTest, JobTokenFromAFileIsTrimmedAndAnEmptyFileIsRefused) {
  EXPECT_EQ(JobTokenFrom("", "flag-token").value_or(""), "flag-token");
  EXPECT_EQ(JobTokenFrom(TempFile("token", "  secret\n"), "ignored").value_or(""), "secret");
  absl::StatusOr<std::string> empty = JobTokenFrom(TempFile("empty_token", " \n"), "x");
  ASSERT_FALSE(empty.ok());
  EXPECT_EQ(empty.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(empty.status().message(), "is empty")) << empty.status();
}

}  // namespace
}  // namespace accord::daemon
