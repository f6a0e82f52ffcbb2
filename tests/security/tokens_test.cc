// Job tokens (--tokens_file) and the TLS/plaintext rule, as pure logic.
#include <cstdio>
#include <fstream>
#include <string>

#include "daemon/common/auth_tokens.h"
#include "daemon/common/tls.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace accord::daemon {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

constexpr char kFile[] =
    "# accord job tokens\n"
    "job-a  tokA\n"
    "\n"
    "job-b\ttokB\n"
    "job-b tokB2   # not a comment: a third field\n";

TEST(JobTokensTest, ParseRejectsMalformedLineNamingItWithoutEchoingTokens) {
  absl::StatusOr<JobTokens::Table> t = JobTokens::Parse(kFile, "tokens");
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(t.status().message(), HasSubstr("tokens line 5"));
  EXPECT_THAT(t.status().message(), Not(HasSubstr("tokB2")));
}

JobTokens Tokens() {
  absl::StatusOr<JobTokens::Table> t =
      JobTokens::Parse("# c\njob-a tokA\n\njob-b\ttokB\njob-b tokB2\n* admin\n", "tokens");
  EXPECT_TRUE(t.ok()) << t.status();
  return JobTokens(*t);
}

TEST(JobTokensTest, RightTokenAcceptedIncludingASecondRotationToken) {
  JobTokens tokens = Tokens();
  EXPECT_TRUE(tokens.CheckJob("job-a", "tokA", "test").ok());
  EXPECT_TRUE(tokens.CheckJob("job-b", "tokB", "test").ok());
  EXPECT_TRUE(tokens.CheckJob("job-b", "tokB2", "test").ok());
  EXPECT_EQ(tokens.jobs(), 2);
  EXPECT_EQ(tokens.denied(), 0);
}

TEST(JobTokensTest, WrongMissingOtherJobsAndAdminTokensAreDeniedForAJob) {
  JobTokens tokens = Tokens();
  for (const char* token : {"wrong", "", "tokB", "admin", "tokA "}) {
    absl::Status s = tokens.CheckJob("job-a", token, "NodeHello from node n1");
    EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << token;
    EXPECT_THAT(s.message(), HasSubstr("job job-a"));
    EXPECT_THAT(s.message(), HasSubstr("NodeHello from node n1"));
    if (*token != '\0') {
      EXPECT_THAT(s.message(), Not(HasSubstr(token)));
    }
  }
  // A job missing from the file, and the admin pseudo-job itself.
  EXPECT_EQ(tokens.CheckJob("job-c", "tokA", "t").code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(tokens.CheckJob("*", "admin", "t").code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(tokens.denied(), 7);
}

TEST(JobTokensTest, ObserveReadsNeedTheJobsTokenOrAdminAndListingAllNeedsAdmin) {
  JobTokens tokens = Tokens();
  EXPECT_TRUE(tokens.CheckJobRead("job-a", "tokA", "observe").ok());
  EXPECT_TRUE(tokens.CheckJobRead("job-a", "admin", "observe").ok());
  EXPECT_EQ(tokens.CheckJobRead("job-a", "tokB", "observe").code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(tokens.CheckAdmin("admin", "status of every job").ok());
  absl::Status s = tokens.CheckAdmin("tokA", "status of every job");
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(s.message(), HasSubstr("admin token"));
}

TEST(JobTokensTest, DeniedCallbackSeesEachRefusal) {
  JobTokens tokens = Tokens();
  std::vector<std::string> jobs;
  tokens.SetDeniedCallback(
      [&jobs](const std::string& job, const std::string& message) { jobs.push_back(job); });
  (void)tokens.CheckJob("job-a", "tokB", "t");
  (void)tokens.CheckAdmin("tokA", "t");
  EXPECT_THAT(jobs, ::testing::ElementsAre("job-a", ""));
}

TEST(JobTokensTest, ReloadPicksUpNewLinesAndKeepsOldTableOnError) {
  const std::string path = ::testing::TempDir() + "/tokens_reload";
  std::ofstream(path) << "job-a tokA\n";
  absl::StatusOr<std::unique_ptr<JobTokens>> tokens = JobTokens::Load(path);
  ASSERT_TRUE(tokens.ok()) << tokens.status();
  EXPECT_EQ((*tokens)->CheckJob("job-z", "tokZ", "t").code(), absl::StatusCode::kPermissionDenied);
  std::ofstream(path) << "job-a tokA\njob-z tokZ\n";
  ASSERT_TRUE((*tokens)->Reload().ok());
  EXPECT_TRUE((*tokens)->CheckJob("job-z", "tokZ", "t").ok());
  std::ofstream(path) << "broken line with three\n";
  EXPECT_EQ((*tokens)->Reload().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE((*tokens)->CheckJob("job-z", "tokZ", "t").ok());
  std::remove(path.c_str());
  EXPECT_EQ((*tokens)->Reload().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE((*tokens)->CheckJob("job-a", "tokA", "t").ok());
}

TEST(JobTokensTest, LoadNamesTheFlagForAMissingFile) {
  absl::StatusOr<std::unique_ptr<JobTokens>> t = JobTokens::Load("/nonexistent/accord-tokens");
  ASSERT_FALSE(t.ok());
  EXPECT_THAT(t.status().message(), HasSubstr("--tokens_file=/nonexistent/accord-tokens"));
}

TEST(TokensEqualTest, ComparesWholeStrings) {
  EXPECT_TRUE(TokensEqual("abc", "abc"));
  EXPECT_FALSE(TokensEqual("abc", "abd"));
  EXPECT_FALSE(TokensEqual("abc", "abcd"));
  EXPECT_FALSE(TokensEqual("", "a"));
  EXPECT_TRUE(TokensEqual("", ""));
}

TEST(PlaintextRuleTest, LoopbackAddresses) {
  for (const char* a :
       {"127.0.0.1:7070", "localhost:7070", "[::1]:7070", "127.1.2.3:1",
        "unix:/run/accord/sidecar.sock", "ipv4:127.0.0.1:5", "dns:///localhost:1", "LOCALHOST:2"}) {
    EXPECT_TRUE(IsLoopbackAddress(a)) << a;
  }
  for (const char* a : {"0.0.0.0:7070", "[::]:7070", "10.0.0.1:7070", "accord-coordinator:7070",
                        "accord-coordinator.accord.svc:7070", "128.0.0.1:1", "127.0.0.1.evil:1",
                        "localhost.example.com:1"}) {
    EXPECT_FALSE(IsLoopbackAddress(a)) << a;
  }
}

TEST(PlaintextRuleTest, ServerNeedsTlsOrExplicitPlaintextOffLoopback) {
  EXPECT_TRUE(CheckServerPlaintext("127.0.0.1:7070", false, false).ok());
  absl::Status s = CheckServerPlaintext("0.0.0.0:7070", false, false);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("--plaintext"));
  EXPECT_THAT(s.message(), HasSubstr("--tls_cert"));
  EXPECT_TRUE(CheckServerPlaintext("0.0.0.0:7070", true, false).ok());
  EXPECT_TRUE(CheckServerPlaintext("0.0.0.0:7070", false, true).ok());
  EXPECT_EQ(CheckServerPlaintext("0.0.0.0:7070", true, true).code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(PlaintextRuleTest, ClientNeedsTlsOrExplicitPlaintextOffLoopback) {
  EXPECT_TRUE(CheckClientPlaintext("localhost:7070", false, false).ok());
  absl::Status s = CheckClientPlaintext("accord-coordinator.accord.svc:7070", false, false);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("--tls_ca"));
  EXPECT_TRUE(CheckClientPlaintext("accord-coordinator:7070", true, false).ok());
  EXPECT_TRUE(CheckClientPlaintext("accord-coordinator:7070", false, true).ok());
  EXPECT_FALSE(CheckClientPlaintext("localhost:7070", true, true).ok());
}

}  // namespace
}  // namespace accord::daemon
