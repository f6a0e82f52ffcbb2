// Relays through the real daemons (docs/ARCHITECTURE.md, "Relays"): a
// coordinator, accord-relay processes and sidecars behind them, rank
// processes (accord-rank-scenario). A relayed job must decide exactly as
// the same job without relays (the ranks' digests), the coordinator must
// see one node per relay, and the observe API's skip matrix must stay per
// rank (accordctl against the coordinator).
#include <map>
#include <regex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/testing/local_cluster.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "observe/http_client.h"

namespace accord::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

constexpr int kWorld = 8;

std::unique_ptr<LocalCluster> StartCluster(int sidecars, int sidecars_per_relay) {
  LocalClusterOptions o;
  o.num_sidecars = sidecars;
  o.sidecars_per_relay = sidecars_per_relay;
  o.echo = false;
  absl::StatusOr<std::unique_ptr<LocalCluster>> c = LocalCluster::Start(o);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *std::move(c) : nullptr;
}

std::vector<RankResult> RunJob(LocalCluster& cluster, const std::vector<std::string>& flags,
                               const std::string& job, int world = kWorld) {
  std::vector<std::string> cmd = {ACCORD_RANK_SCENARIO, "--socket={socket}",
                                  "--rank={rank}",      "--world={world}",
                                  "--job={job}",        "--local_rank={local_rank}"};
  cmd.insert(cmd.end(), flags.begin(), flags.end());
  absl::StatusOr<std::vector<RankResult>> r = cluster.RunRanks(cmd, world, job, absl::Seconds(120));
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? *r : std::vector<RankResult>();
}

// The value of an unlabelled series in a Prometheus text page (-1: absent).
double Series(const std::string& page, const std::string& name) {
  std::smatch m;
  if (!std::regex_search(page, m, std::regex("\n" + name + " ([0-9.e+]+)"))) return -1;
  return std::stod(m[1]);
}

std::string Digest(const RankResult& r) {
  std::smatch m;
  if (std::regex_search(r.output, m, std::regex("rank \\d+ digest ([0-9a-f]+)"))) return m[1];
  return "";
}

// Every rank succeeded with one digest; returns it ("" on failure).
std::string CommonDigest(const std::vector<RankResult>& results) {
  std::string first;
  for (const RankResult& r : results) {
    EXPECT_EQ(r.exit_code, 0) << "rank " << r.rank << ":\n" << r.output;
    const std::string d = Digest(r);
    EXPECT_FALSE(d.empty()) << "rank " << r.rank << " printed no digest:\n" << r.output;
    if (first.empty()) first = d;
    EXPECT_EQ(d, first) << "rank " << r.rank << " decided differently:\n" << r.output;
  }
  return first;
}

// Skips on some ranks only, a late bf16 gradient, a param nobody has: the
// decisions depend on every rank's manifest.
const std::vector<std::string> kFlags = {"--steps=5", "--groups=3",
                                         "--rules=1:0:*:none 4:3:1:bfloat16 6:2:2:none *:3:4:none"};

TEST(RelayTest, TwoRelaysOfTwoSidecarsDecideExactlyAsTheDirectJob) {
  std::unique_ptr<LocalCluster> direct = StartCluster(4, 0);
  ASSERT_NE(direct, nullptr);
  const std::string want = CommonDigest(RunJob(*direct, kFlags, "direct"));
  ASSERT_FALSE(want.empty());
  direct.reset();

  std::unique_ptr<LocalCluster> relayed = StartCluster(4, 2);
  ASSERT_NE(relayed, nullptr);
  ASSERT_EQ(relayed->num_relays(), 2);
  EXPECT_EQ(CommonDigest(RunJob(*relayed, kFlags, "relayed")), want);
  // The coordinator saw the relays, never a sidecar.
  const std::string log = relayed->CoordinatorOutput();
  EXPECT_THAT(log, HasSubstr("by node \"relay")) << log;
  EXPECT_THAT(log, Not(HasSubstr("node \"node"))) << log;
}

TEST(RelayTest, ARelayedJobRunsAgainUnderTheSameIdAndRepeatsGoUpInRepeatForm) {
  std::unique_ptr<LocalCluster> relayed = StartCluster(2, 2);
  ASSERT_NE(relayed, nullptr);
  const std::string first = CommonDigest(RunJob(*relayed, {"--steps=6", "--groups=2"}, "again"));
  ASSERT_FALSE(first.empty());
  // The relay dropped the job when its sidecars left; the same id starts a
  // new run through it and decides the same.
  EXPECT_EQ(CommonDigest(RunJob(*relayed, {"--steps=6", "--groups=2"}, "again")), first);
  // Steady-state steps repeat: the coordinator answered same_as_previous,
  // and the relay's batches that repeated its previous one went up as batch
  // repeats, decided as repeat waves.
  std::string stats = relayed->StopCoordinator();
  std::smatch m;
  ASSERT_TRUE(std::regex_search(stats, m, std::regex("same_as_previous=(\\d+)"))) << stats;
  EXPECT_GT(std::stoi(m[1]), 0) << stats;
  ASSERT_TRUE(std::regex_search(stats, m, std::regex("repeat_waves=(\\d+)"))) << stats;
  EXPECT_GT(std::stoi(m[1]), 0) << stats;

  // The relay's own Prometheus counters, scraped over HTTP.
  const std::string out = relayed->RelayOutput(0);
  ASSERT_TRUE(
      std::regex_search(out, m, std::regex("metrics on http://127\\.0\\.0\\.1:(\\d+)/metrics")))
      << out;
  absl::StatusOr<HttpResponse> page = HttpGet("127.0.0.1", std::stoi(m[1]), "/metrics");
  ASSERT_TRUE(page.ok()) << page.status();
  const std::string& body = page->body;
  // 2 runs x 6 steps x 2 groups from each of the 2 sidecars.
  EXPECT_EQ(Series(body, "accord_relay_manifests_in_total"), 48) << body;
  EXPECT_GT(Series(body, "accord_relay_batch_repeats_in_total"), 0) << body;
  EXPECT_GT(Series(body, "accord_relay_batch_repeats_up_total"), 0) << body;
  EXPECT_GT(Series(body, "accord_relay_merges_reused_total"), 0) << body;
  EXPECT_GT(Series(body, "accord_relay_decision_batches_total"), 0) << body;
  EXPECT_EQ(Series(body, "accord_relay_sidecars"), 0) << "both runs ended\n" << body;
}

TEST(RelayTest, SkipMatrixStaysPerRankThroughARelay) {
  std::unique_ptr<LocalCluster> relayed = StartCluster(2, 2);
  ASSERT_NE(relayed, nullptr);
  // As in observe_test: nobody has p3; rank 1 never has p1; rank 2 lacks p2
  // at step 0 only. Ranks 0,1 are on node0 and 2,3 on node1, both behind
  // relay0, so the per-rank detail must survive two merges.
  std::vector<RankResult> results =
      RunJob(*relayed,
             {"--groups=1", "--params=4", "--steps=5", "--rules=*:3:*:none,1:1:*:none,2:2:0:none"},
             "obsjob", /*world=*/4);
  ASSERT_EQ(results.size(), 4u);
  CommonDigest(results);
  absl::StatusOr<std::unique_ptr<ChildProcess>> ctl =
      ChildProcess::Spawn({ACCORD_ACCORDCTL, "--coordinator=" + relayed->coordinator_address(),
                           "skips", "--job=obsjob", "--full"},
                          "accordctl", false);
  ASSERT_TRUE(ctl.ok()) << ctl.status();
  absl::StatusOr<int> code = (*ctl)->Wait(absl::Now() + absl::Seconds(30));
  const std::string table = (*ctl)->FinalOutput();
  ASSERT_TRUE(code.ok() && *code == 0) << table;
  EXPECT_EQ(table,
            "job obsjob group g0: 5 steps (0..4); cell = steps the rank had no gradient for the "
            "parameter\n"
            "  PARAM  r0  r1  r2  r3  NOWHERE\n"
            "  p0     .   .   .   .   .\n"
            "  p1     .   5   .   .   .\n"
            "  p2     .   .   1   .   .\n"
            "  p3     5   5   5   5   5\n");
}

}  // namespace
}  // namespace accord::testing
