// ChildProcess (client/testing/local_cluster.h): readiness lines, exit codes,
// termination; no daemons needed.
#include "absl/time/clock.h"
#include "client/testing/local_cluster.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace accord::testing {
namespace {

using ::testing::HasSubstr;

TEST(ChildProcessTest, WaitForLineReturnsTheWholeLineAndWaitTheExitCode) {
  auto p = ChildProcess::Spawn({"/bin/sh", "-c", "echo hello; echo ready on 1.2.3.4:5; exit 3"},
                               "sh", /*echo=*/false);
  ASSERT_TRUE(p.ok()) << p.status();
  absl::StatusOr<std::string> line = (*p)->WaitForLine("ready on", absl::InfiniteFuture());
  ASSERT_TRUE(line.ok()) << line.status();
  EXPECT_EQ(*line, "ready on 1.2.3.4:5");
  absl::StatusOr<int> code = (*p)->Wait(absl::InfiniteFuture());
  ASSERT_TRUE(code.ok());
  EXPECT_EQ(*code, 3);
  EXPECT_THAT((*p)->FinalOutput(), HasSubstr("hello\n"));
}

TEST(ChildProcessTest, ExitBeforeTheLineIsUnavailableWithTheOutput) {
  auto p = ChildProcess::Spawn({"/bin/sh", "-c", "echo boom >&2; exit 1"}, "sh", false);
  ASSERT_TRUE(p.ok());
  absl::StatusOr<std::string> line = (*p)->WaitForLine("ready", absl::InfiniteFuture());
  EXPECT_EQ(line.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(line.status().message(), HasSubstr("boom"));
}

TEST(ChildProcessTest, TerminateStopsAProcessThatIgnoresNothing) {
  auto p = ChildProcess::Spawn({"/bin/sleep", "1000"}, "sleep", false);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ((*p)->Wait(absl::Now()).status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ((*p)->Terminate(absl::Seconds(10)), 128 + 15);
}

TEST(ChildProcessTest, TerminateKillsAProcessThatIgnoresSigterm) {
  auto p = ChildProcess::Spawn(
      {"/bin/sh", "-c", "trap '' TERM; echo armed; while :; do read x < /dev/zero; done"}, "sh",
      false);
  ASSERT_TRUE(p.ok());
  ASSERT_TRUE((*p)->WaitForLine("armed", absl::InfiniteFuture()).ok());
  EXPECT_EQ((*p)->Terminate(absl::Milliseconds(200)), 128 + 9);
}

TEST(ChildProcessTest, MissingBinaryExitsWith127) {
  auto p = ChildProcess::Spawn({"/nonexistent/accord-x"}, "x", false);
  ASSERT_TRUE(p.ok());
  absl::StatusOr<int> code = (*p)->Wait(absl::InfiniteFuture());
  ASSERT_TRUE(code.ok());
  EXPECT_EQ(*code, 127);
}

TEST(LocalClusterTest, MissingDaemonBinariesAreNamed) {
  LocalClusterOptions o;
  o.bin_dir = "/nonexistent-accord-bin";
  absl::StatusOr<std::unique_ptr<LocalCluster>> c = LocalCluster::Start(o);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(c.status().message(), HasSubstr("accord-coordinator"));
}

}  // namespace
}  // namespace accord::testing
