// Observability through the real daemons: a local cluster (1 coordinator, 2
// sidecars, 4 rank processes) runs a scenario with known skips, then
//  - accordctl (a subprocess) prints the coordinator's skip matrix, as a table
//    and as JSON, with exactly the expected counts;
//  - Debian's real Prometheus scrapes both daemons' /metrics every second and
//    its query API returns the run's own counts.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <regex>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "client/testing/local_cluster.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "observe/http_client.h"

namespace accord::testing {
namespace {

using ::testing::HasSubstr;

constexpr int kWorld = 4;
constexpr int kSteps = 5;
constexpr char kJob[] = "obsjob";
// Nobody has p3 (skipped at every step); rank 1 never has p1; rank 2 lacks p2
// at step 0 only.
constexpr char kRules[] = "--rules=*:3:*:none,1:1:*:none,2:2:0:none";

std::string UrlEncode(const std::string& s) {
  std::string out;
  for (unsigned char c : s) {
    if (std::isalnum(c) || c == '_' || c == '-' || c == '.') {
      out += static_cast<char>(c);
    } else {
      absl::StrAppend(&out, "%", absl::Hex(c, absl::kZeroPad2));
    }
  }
  return out;
}

// A free loopback port (bound and released; Prometheus cannot report an
// ephemeral one).
int FreePort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
  socklen_t len = sizeof addr;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  ::close(fd);
  return ntohs(addr.sin_port);
}

// "host:port" of every "... metrics on http://HOST:PORT/metrics" line.
std::vector<std::string> MetricsTargets(const std::string& output) {
  std::vector<std::string> out;
  const std::regex re("metrics on http://([^/ ]+)/metrics");
  for (std::sregex_iterator it(output.begin(), output.end(), re), end; it != end; ++it) {
    out.push_back((*it)[1]);
  }
  return out;
}

class ObserveIntegrationTest : public ::testing::Test {
 protected:
  void SetUp() override {
    LocalClusterOptions o;
    o.num_sidecars = 2;
    o.coordinator_flags = {"--metrics_port=0"};
    o.sidecar_flags = {"--metrics_port=0"};
    o.echo = false;
    absl::StatusOr<std::unique_ptr<LocalCluster>> c = LocalCluster::Start(o);
    ASSERT_TRUE(c.ok()) << c.status();
    cluster_ = *std::move(c);
  }

  void RunScenario() {
    std::vector<std::string> cmd = {ACCORD_RANK_SCENARIO,
                                    "--socket={socket}",
                                    "--rank={rank}",
                                    "--world={world}",
                                    "--job={job}",
                                    "--local_rank={local_rank}",
                                    "--groups=1",
                                    "--params=4",
                                    absl::StrCat("--steps=", kSteps),
                                    kRules};
    absl::StatusOr<std::vector<RankResult>> r =
        cluster_->RunRanks(cmd, kWorld, kJob, absl::Seconds(120));
    ASSERT_TRUE(r.ok()) << r.status();
    for (const RankResult& rr : *r) {
      ASSERT_EQ(rr.exit_code, 0) << "rank " << rr.rank << ":\n" << rr.output;
    }
  }

  // Runs accordctl with `args`; its exit code and output.
  std::pair<int, std::string> Accordctl(std::vector<std::string> args) {
    args.insert(args.begin(),
                {ACCORD_ACCORDCTL, "--coordinator=" + cluster_->coordinator_address()});
    absl::StatusOr<std::unique_ptr<ChildProcess>> p = ChildProcess::Spawn(args, "accordctl", false);
    if (!p.ok()) return {-1, std::string(p.status().message())};
    absl::StatusOr<int> code = (*p)->Wait(absl::Now() + absl::Seconds(30));
    return {code.ok() ? *code : -1, (*p)->FinalOutput()};
  }

  std::unique_ptr<LocalCluster> cluster_;
};

TEST_F(ObserveIntegrationTest, AccordctlPrintsTheExactSkipMatrixAsTableAndJson) {
  RunScenario();
  auto [code, table] = Accordctl({"skips", absl::StrCat("--job=", kJob), "--full"});
  ASSERT_EQ(code, 0) << table;
  // '.' = 0: every rank had the gradient.
  EXPECT_EQ(table,
            "job obsjob group g0: 5 steps (0..4); cell = steps the rank had no gradient for the "
            "parameter\n"
            "  PARAM  r0  r1  r2  r3  NOWHERE\n"
            "  p0     .   .   .   .   .\n"
            "  p1     .   5   .   .   .\n"
            "  p2     .   .   1   .   .\n"
            "  p3     5   5   5   5   5\n");

  auto [jcode, json] = Accordctl({"--json", "skips", absl::StrCat("--job=", kJob)});
  ASSERT_EQ(jcode, 0) << json;
  std::string compact;
  for (char c : json) {
    if (c != ' ' && c != '\n') compact += c;
  }
  EXPECT_THAT(compact,
              HasSubstr(R"("param_name":"p1","counts":["0","5","0","0"],"skipped_everywhere":"0")"))
      << json;
  EXPECT_THAT(compact,
              HasSubstr(R"("param_name":"p2","counts":["0","0","1","0"],"skipped_everywhere":"0")"))
      << json;
  EXPECT_THAT(compact,
              HasSubstr(R"("param_name":"p3","counts":["5","5","5","5"],"skipped_everywhere":"5")"))
      << json;
  EXPECT_THAT(compact, HasSubstr(R"("steps":"5","first_step":"0","last_step":"4")")) << json;

  auto [scode, status] = Accordctl({"--json", "status", absl::StrCat("--job=", kJob)});
  ASSERT_EQ(scode, 0) << status;
  EXPECT_THAT(status, HasSubstr(R"("decisions": "5")")) << status;

  auto [ncode, missing] = Accordctl({"skips", "--job=nosuchjob"});
  EXPECT_NE(ncode, 0);
  EXPECT_THAT(missing, HasSubstr("nosuchjob"));
}

TEST_F(ObserveIntegrationTest, PrometheusScrapesTheRunsOwnCounts) {
  const std::string prometheus = "/usr/bin/prometheus";
  if (!std::filesystem::exists(prometheus)) {
    GTEST_SKIP() << prometheus << " is not installed (Debian package prometheus)";
  }
  std::vector<std::string> targets = MetricsTargets(cluster_->CoordinatorOutput());
  ASSERT_EQ(targets.size(), 1u) << cluster_->CoordinatorOutput();
  for (int i = 0; i < 2; ++i) {
    std::vector<std::string> t = MetricsTargets(cluster_->SidecarOutput(i));
    ASSERT_EQ(t.size(), 1u) << cluster_->SidecarOutput(i);
    targets.push_back(t[0]);
  }
  const std::string dir =
      std::filesystem::temp_directory_path() / absl::StrCat("accord-prometheus-", ::getpid());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir + "/data");
  {
    std::ofstream cfg(dir + "/prometheus.yml");
    cfg << "global:\n  scrape_interval: 1s\n  scrape_timeout: 900ms\nscrape_configs:\n"
        << "  - job_name: accord\n    honor_labels: true\n    static_configs:\n"
        << "      - targets: ['" << targets[0] << "', '" << targets[1] << "', '" << targets[2]
        << "']\n";
  }
  const int port = FreePort();
  absl::StatusOr<std::unique_ptr<ChildProcess>> prom = ChildProcess::Spawn(
      {prometheus, "--config.file=" + dir + "/prometheus.yml",
       "--storage.tsdb.path=" + dir + "/data",
       absl::StrCat("--web.listen-address=127.0.0.1:", port), "--log.level=warn"},
      "prometheus", false);
  ASSERT_TRUE(prom.ok()) << prom.status();

  RunScenario();

  // The query's single value once it equals `want` (polling until the scrape
  // caught up, bounded).
  auto query = [&](const std::string& q, double want) {
    const absl::Time deadline = absl::Now() + absl::Seconds(60);
    std::string body;
    double got = -1;
    while (absl::Now() < deadline) {
      absl::StatusOr<HttpResponse> r =
          HttpGet("127.0.0.1", port, "/api/v1/query?query=" + UrlEncode(q));
      body = r.ok() ? r->body : r.status().ToString();
      std::smatch m;
      static const std::regex value_re(R"re("value":\[[0-9.]+,"([^"]+)"\])re");
      if (std::regex_search(body, m, value_re) && absl::SimpleAtod(m[1].str(), &got) &&
          got == want) {
        return got;
      }
      absl::SleepFor(absl::Milliseconds(200));  // poll interval, not synchronisation
    }
    ADD_FAILURE() << q << ": expected " << want << ", Prometheus answered: " << body;
    return got;
  };
  EXPECT_EQ(query("sum(accord_decisions_total)", kSteps), kSteps);
  EXPECT_EQ(query("sum(accord_skips_total)", kSteps), kSteps);
  // Rank 1 zero-fills p1 at every step, rank 2 p2 at step 0.
  EXPECT_EQ(query("sum(accord_zero_fills_total)", kSteps + 1), kSteps + 1);
  // One node manifest per sidecar and step.
  EXPECT_EQ(query("sum(accord_cache_hits_total) + sum(accord_cache_misses_total)", 2 * kSteps),
            2 * kSteps);
  EXPECT_EQ(query("sum(accord_negotiation_wait_seconds_count)", kSteps), kSteps);
  EXPECT_EQ(query(absl::StrCat("sum(accord_sidecar_rank_manifests_total{job=\"", kJob, "\"})"),
                  kWorld * kSteps),
            kWorld * kSteps);

  // The coordinator's own stats line at SIGTERM agrees with what Prometheus saw.
  const std::string out = cluster_->StopCoordinator();
  std::smatch m;
  ASSERT_TRUE(std::regex_search(out, m, std::regex("cache_hits=(\\d+)"))) << out;
  const int hits = std::stoi(m[1]);
  // The coordinator's series are stale now: read their last scraped values.
  EXPECT_EQ(query("sum(max_over_time(accord_cache_hits_total[10m]))", hits), hits);
  EXPECT_THAT(out, HasSubstr(absl::StrCat("decisions=", kSteps)));
  (*prom)->Terminate(absl::Seconds(10));
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace accord::testing
