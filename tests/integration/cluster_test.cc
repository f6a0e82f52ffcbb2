// Whole-job tests through the real daemons: one coordinator, 2 sidecars, 8
// rank processes (accord-rank-scenario) started by LocalCluster. Every test
// also checks that all ranks saw identical decisions (their digests).
#include <map>
#include <regex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/testing/local_cluster.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace accord::testing {
namespace {

using ::testing::HasSubstr;

constexpr int kWorld = 8;
constexpr int kSidecars = 2;

class ClusterTest : public ::testing::Test {
 protected:
  void StartCluster(std::vector<std::string> coordinator_flags = {}) {
    LocalClusterOptions o;
    o.num_sidecars = kSidecars;
    o.coordinator_flags = std::move(coordinator_flags);
    absl::StatusOr<std::unique_ptr<LocalCluster>> c = LocalCluster::Start(o);
    ASSERT_TRUE(c.ok()) << c.status();
    cluster_ = *std::move(c);
  }

  // Runs the scenario on every rank; returns the results.
  std::vector<RankResult> Run(const std::vector<std::string>& flags, const std::string& job = "job",
                              int world = kWorld) {
    std::vector<std::string> cmd = {ACCORD_RANK_SCENARIO, "--socket={socket}",
                                    "--rank={rank}",      "--world={world}",
                                    "--job={job}",        "--local_rank={local_rank}"};
    cmd.insert(cmd.end(), flags.begin(), flags.end());
    absl::StatusOr<std::vector<RankResult>> r =
        cluster_->RunRanks(cmd, world, job, absl::Seconds(120));
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? *r : std::vector<RankResult>();
  }

  static void ExpectAllSucceeded(const std::vector<RankResult>& results) {
    for (const RankResult& r : results) {
      EXPECT_EQ(r.exit_code, 0) << "rank " << r.rank << " output:\n" << r.output;
    }
  }

  // The digest each rank printed ("rank R digest HEX"), by rank.
  static std::map<int, std::string> Digests(const std::vector<RankResult>& results) {
    std::map<int, std::string> out;
    const std::regex re("rank (\\d+) digest ([0-9a-f]+)");
    for (const RankResult& r : results) {
      std::smatch m;
      if (std::regex_search(r.output, m, re)) out[std::stoi(m[1])] = m[2];
    }
    return out;
  }

  // Every rank (but `except`) printed the same digest; returns it.
  static std::string ExpectSameDigest(const std::vector<RankResult>& results, int except = -1) {
    std::map<int, std::string> d = Digests(results);
    std::string first;
    for (const RankResult& r : results) {
      if (r.rank == except) continue;
      auto it = d.find(r.rank);
      EXPECT_NE(it, d.end()) << "rank " << r.rank << " printed no digest:\n" << r.output;
      if (it == d.end()) continue;
      if (first.empty()) first = it->second;
      EXPECT_EQ(it->second, first) << "rank " << r.rank << " decided differently:\n" << r.output;
    }
    return first;
  }

  std::unique_ptr<LocalCluster> cluster_;
};

TEST_F(ClusterTest, EveryoneUsesEverything) {
  StartCluster();
  auto results = Run({"--expect_wire=float32", "--expect_skipped=-"});
  ExpectAllSucceeded(results);
  ExpectSameDigest(results);
}

TEST_F(ClusterTest, OneRankSkipsAParamWhichIsZeroFilledOnThatRankOnly) {
  StartCluster();
  auto results = Run({"--rules=3:1:*:none", "--expect_skipped=-"});
  ExpectAllSucceeded(results);
  ExpectSameDigest(results);
  ASSERT_EQ(results.size(), static_cast<size_t>(kWorld));
  EXPECT_THAT(results[3].output, HasSubstr("zero_fill_here=1"));
  EXPECT_THAT(results[2].output, HasSubstr("zero_fill_here=0"));
  EXPECT_THAT(results[2].output, ::testing::Not(HasSubstr("zero_fill_here=1")));
}

TEST_F(ClusterTest, EveryRankSkipsAParamWhichIsSkippedEverywhere) {
  StartCluster();
  auto results = Run({"--rules=*:1:*:none", "--expect_skipped=1"});
  ExpectAllSucceeded(results);
  ExpectSameDigest(results);
  EXPECT_THAT(results[0].output, HasSubstr("skipped=[p1]"));
}

TEST_F(ClusterTest, Fp32AccumulationsPlusOneLateBf16GradientGoAsFp32) {
  StartCluster();
  auto results = Run({"--steps=4", "--rules=5:2:2:bfloat16", "--expect_wire=float32"});
  ExpectAllSucceeded(results);
  ExpectSameDigest(results);
}

TEST_F(ClusterTest, Fp16OnOneRankAndBf16OnAnotherGoAsFp32) {
  StartCluster();
  auto results = Run({"--dtype=float16", "--rules=6:*:*:bfloat16", "--expect_wire=float32"});
  ExpectAllSucceeded(results);
  ExpectSameDigest(results);
}

TEST_F(ClusterTest, UniformBf16StaysBf16) {
  StartCluster();
  auto results = Run({"--dtype=bfloat16", "--expect_wire=bfloat16"});
  ExpectAllSucceeded(results);
  ExpectSameDigest(results);
}

TEST_F(ClusterTest, RegistrationMismatchGivesTheSameErrorOnAllRanks) {
  StartCluster();
  auto results = Run(
      {"--mismatch_rank=2", "--expect_error=FAILED_PRECONDITION", "--expect_error_contains=p0"});
  ExpectAllSucceeded(results);
  ExpectSameDigest(results);
}

TEST_F(ClusterTest, ARankThatNeverSubmitsIsNamedInTheDeadlineErrorOnEveryOtherRank) {
  StartCluster({"--deadline=2s"});
  // Only rank 5 is named, not its node-mates 4, 6 and 7 (their sidecar tells
  // the coordinator they did submit), with the last step it submitted: none.
  auto results = Run({"--silent_rank=5", "--expect_error=DEADLINE_EXCEEDED",
                      "--expect_error_contains=missing ranks 5: rank 5 (last step -1, node"});
  ExpectAllSucceeded(results);
  ExpectSameDigest(results, /*except=*/5);
}

TEST_F(ClusterTest, RepeatedStepsHitTheCoordinatorsCache) {
  StartCluster();
  constexpr int kSteps = 5;
  auto results = Run({absl::StrCat("--steps=", kSteps), "--groups=2"});
  ExpectAllSucceeded(results);
  ExpectSameDigest(results);
  const std::string out = cluster_->StopCoordinator();
  std::smatch m;
  if (!std::regex_search(out, m, std::regex("cache_hits=(\\d+)"))) {
    GTEST_SKIP() << "the coordinator printed no cache_hits=N stats line at exit";
  }
  // Steps 1..4 of both groups repeat step 0's content on every node.
  EXPECT_GE(std::stoll(m[1]), (kSteps - 1) * 2 * kSidecars) << out;
}

TEST_F(ClusterTest, ARestartedCoordinatorGivesTheSameDecisionsForTheSameManifests) {
  StartCluster();
  const std::vector<std::string> flags = {"--steps=3", "--rules=1:0:*:none 4:3:1:bfloat16"};
  auto before = Run(flags, "job-a");
  ExpectAllSucceeded(before);
  const std::string d1 = ExpectSameDigest(before);
  cluster_->StopCoordinator();
  ASSERT_TRUE(cluster_->RestartCoordinator().ok());
  auto after = Run(flags, "job-b");
  ExpectAllSucceeded(after);
  EXPECT_EQ(ExpectSameDigest(after), d1);
}

}  // namespace
}  // namespace accord::testing
