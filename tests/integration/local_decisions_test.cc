// Local decisions through real processes (docs/ARCHITECTURE.md, "Local
// decisions"): a single-node job is answered by its sidecar, every step is
// still decided by the coordinator and confirmed, and the ranks see exactly
// the decisions the coordinator alone gives (the same digest with
// --local_decisions=false). A job across two nodes is never decided locally.
#include <cstdio>
#include <regex>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/testing/local_cluster.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "observe/http_client.h"
#include "tests/fault/gate.h"

namespace accord::testing {
namespace {

constexpr int kWorld = 4;
constexpr int kGroups = 3;
constexpr int kSteps = 12;
// Parameter 3 used nowhere, rank 1 never has p1, rank 2 has p2 in bf16 from
// step 4 (the others in fp32), rank 3 has no gradient at all at step 7.
constexpr char kRules[] = "--rules=*:3:*:none,1:1:*:none,2:2:*:none,2:2:4:bfloat16,3:*:7:none";

std::vector<std::string> ScenarioCommand() {
  return {ACCORD_RANK_SCENARIO,
          "--socket={socket}",
          "--rank={rank}",
          "--world={world}",
          "--job={job}",
          "--local_rank={local_rank}",
          absl::StrCat("--groups=", kGroups),
          "--params=4",
          absl::StrCat("--steps=", kSteps),
          kRules};
}

std::string Digest(const std::string& output) {
  static const std::regex digest_re("digest ([0-9a-f]+)");
  std::smatch m;
  return std::regex_search(output, m, digest_re) ? m[1].str() : "";
}

struct JobRun {
  std::vector<std::string> digests;  // per rank
  double made = 0, confirmed = 0, mismatched = 0;
};

// The value of `name{...outcome="<outcome>"...}` in a Prometheus text page.
double Counter(const std::string& page, const std::string& outcome) {
  const std::regex re("accord_sidecar_local_decisions_total\\{[^}]*outcome=\"" + outcome +
                      "\"[^}]*\\} ([0-9.e+]+)");
  std::smatch m;
  double v = 0;
  if (std::regex_search(page, m, re)) (void)absl::SimpleAtod(m[1].str(), &v);
  return v;
}

JobRun RunJob(int sidecars, std::vector<std::string> sidecar_flags) {
  JobRun run;
  LocalClusterOptions o;
  o.num_sidecars = sidecars;
  sidecar_flags.push_back("--metrics_port=0");
  sidecar_flags.push_back("--metrics_host=127.0.0.1");
  o.sidecar_flags = sidecar_flags;
  o.echo = false;
  absl::StatusOr<std::unique_ptr<LocalCluster>> c = LocalCluster::Start(o);
  EXPECT_TRUE(c.ok()) << c.status();
  if (!c.ok()) return run;
  absl::StatusOr<std::vector<RankResult>> r =
      (*c)->RunRanks(ScenarioCommand(), kWorld, "localjob", absl::Seconds(120));
  EXPECT_TRUE(r.ok()) << r.status();
  if (!r.ok()) return run;
  for (const RankResult& rr : *r) {
    EXPECT_EQ(rr.exit_code, 0) << "rank " << rr.rank << ":\n" << rr.output;
    run.digests.push_back(Digest(rr.output));
    EXPECT_NE(run.digests.back(), "") << rr.output;
  }
  // The first sidecar's counters, once every local decision was confirmed
  // or refused (the last confirmations may still be on their way).
  const std::regex addr_re("metrics on http://127\\.0\\.0\\.1:([0-9]+)/metrics");
  std::smatch m;
  const std::string out = (*c)->SidecarOutput(0);
  EXPECT_TRUE(std::regex_search(out, m, addr_re)) << out;
  if (m.size() < 2) return run;
  const int port = std::stoi(m[1].str());
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  do {
    absl::StatusOr<HttpResponse> page = HttpGet("127.0.0.1", port, "/metrics");
    EXPECT_TRUE(page.ok()) << page.status();
    if (!page.ok()) break;
    run.made = Counter(page->body, "made");
    run.confirmed = Counter(page->body, "confirmed");
    run.mismatched = Counter(page->body, "mismatched");
    if (run.confirmed + run.mismatched >= run.made) break;
    absl::SleepFor(absl::Milliseconds(100));  // poll interval, not synchronisation
  } while (absl::Now() < deadline);
  return run;
}

TEST(LocalDecisionsIntegrationTest, ASingleNodeJobIsDecidedByItsSidecarAndConfirmed) {
  const JobRun local = RunJob(1, {});
  const JobRun remote = RunJob(1, {"--local_decisions=false"});
  ASSERT_EQ(local.digests.size(), static_cast<size_t>(kWorld));
  ASSERT_EQ(remote.digests.size(), static_cast<size_t>(kWorld));
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_EQ(local.digests[r], local.digests[0]) << "rank " << r;
    EXPECT_EQ(local.digests[r], remote.digests[0])
        << "rank " << r << ": local decisions differ from the coordinator's";
  }
  // Every step may be decided locally; under load the coordinator may fall
  // more than --local_decision_lag steps behind, and those steps wait for it.
  std::printf("local decisions: made %g, confirmed %g, mismatched %g of %d steps x groups\n",
              local.made, local.confirmed, local.mismatched, kGroups * kSteps);
  EXPECT_GE(local.made, 1);
  EXPECT_LE(local.made, kGroups * kSteps);
  EXPECT_EQ(local.confirmed, local.made);
  EXPECT_EQ(local.mismatched, 0);
  EXPECT_EQ(remote.made, 0);
}

TEST(LocalDecisionsIntegrationTest, AJobAcrossTwoNodesIsDecidedByTheCoordinatorOnly) {
  const JobRun run = RunJob(2, {});
  ASSERT_EQ(run.digests.size(), static_cast<size_t>(kWorld));
  for (int r = 1; r < kWorld; ++r) EXPECT_EQ(run.digests[r], run.digests[0]) << "rank " << r;
  EXPECT_EQ(run.made, 0);
}

// The coordinator dies (SIGKILL) while a single-node job runs on local
// decisions and comes back on the same address: the sidecar resends every
// step the coordinator has not confirmed, the ranks go on (at most
// --local_decision_lag steps per group ahead of it) and finish with the
// decisions of an undisturbed coordinator-only run.
TEST(LocalDecisionsIntegrationTest, CoordinatorKilledUnderASingleNodeJobLosesNothing) {
  const JobRun reference = RunJob(1, {"--local_decisions=false"});
  ASSERT_EQ(reference.digests.size(), static_cast<size_t>(kWorld));

  LocalClusterOptions o;
  o.echo = false;
  absl::StatusOr<std::unique_ptr<LocalCluster>> c = LocalCluster::Start(o);
  ASSERT_TRUE(c.ok()) << c.status();
  Gate gate;
  std::vector<std::string> cmd = ScenarioCommand();
  cmd.insert(cmd.end(), {"--gate_rank=2", "--gate_step=6", "--gate_fifo=" + gate.path()});
  absl::StatusOr<std::vector<std::unique_ptr<ChildProcess>>> procs =
      (*c)->StartRanks(cmd, kWorld, "localjob");
  ASSERT_TRUE(procs.ok()) << procs.status();
  // Rank 2 holds step 6 back; steps 0-5 were decided (locally or not).
  const absl::Time give_up = absl::Now() + absl::Seconds(60);
  while ((*procs)[2]->Output().find("waiting at gate") == std::string::npos &&
         absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(20));  // poll interval, not synchronisation
  }
  ASSERT_NE((*procs)[2]->Output().find("waiting at gate"), std::string::npos)
      << (*procs)[2]->Output();
  (*c)->KillCoordinator();
  ASSERT_TRUE((*c)->RestartCoordinator().ok());
  ASSERT_TRUE(gate.Release());
  std::vector<RankResult> results =
      LocalCluster::WaitRanks(*procs, absl::Now() + absl::Seconds(120));
  ASSERT_EQ(results.size(), static_cast<size_t>(kWorld));
  for (const RankResult& rr : results) {
    EXPECT_EQ(rr.exit_code, 0) << "rank " << rr.rank << ":\n" << rr.output;
    EXPECT_EQ(Digest(rr.output), reference.digests[0]) << "rank " << rr.rank << ":\n" << rr.output;
  }
}

}  // namespace
}  // namespace accord::testing
