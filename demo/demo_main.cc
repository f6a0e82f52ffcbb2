// accord-demo: the main job on one machine. Starts a local cluster (one
// coordinator, two sidecars), runs eight demo ranks that train the synthetic
// model with the real data path, checks every rank's report, asks the
// coordinator's observe API for the skip matrix and status, scrapes the
// metrics, and prints a readable summary. Exit code 0 only when every reduced
// shard matched its float64 reference and every rank saw the same decisions.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "accord/v1/observe.grpc.pb.h"
#include "cli/format.h"
#include "client/testing/local_cluster.h"
#include "demo/report.pb.h"
#include "google/protobuf/util/json_util.h"
#include "grpcpp/grpcpp.h"
#include "observe/http_client.h"

ABSL_FLAG(int, ranks, 8, "Rank processes (the world size).");
ABSL_FLAG(int, sidecars, 2, "Sidecars (nodes).");
ABSL_FLAG(int, steps, 20, "Training steps.");
ABSL_FLAG(std::string, bin_dir, "", "Where the accord binaries are (default: the build tree).");
ABSL_FLAG(std::string, work_dir, "", "Where reports and the event log go (default: a temp dir).");
ABSL_FLAG(std::string, job, "demo", "Job id.");
ABSL_FLAG(int, timeout_s, 120, "Bound on the whole training run.");
ABSL_FLAG(bool, quiet, false, "Do not echo the daemons' and ranks' output.");

namespace accord::demo {
namespace {

// "metrics on http://127.0.0.1:PORT/metrics" in a daemon's output.
std::vector<std::string> MetricsUrls(const std::string& output) {
  std::vector<std::string> urls;
  for (absl::string_view line : absl::StrSplit(output, '\n')) {
    const size_t at = line.find("http://");
    if (at != absl::string_view::npos && line.find("/metrics") != absl::string_view::npos) {
      absl::string_view url = line.substr(at);
      url = url.substr(0, url.find_first_of(" \t\r"));
      urls.emplace_back(url);
    }
  }
  return urls;
}

double MetricSum(const std::string& text, const std::string& name) {
  double sum = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (!absl::StartsWith(line, name)) continue;
    const char next = line.size() > name.size() ? line[name.size()] : ' ';
    if (next != '{' && next != ' ') continue;
    const size_t sp = line.rfind(' ');
    double v;
    if (sp != absl::string_view::npos && absl::SimpleAtod(line.substr(sp + 1), &v)) sum += v;
  }
  return sum;
}

double Percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(q * v.size()))];
}

// --work_dir, or a fresh temporary directory.
absl::StatusOr<std::string> WorkDir() {
  std::string dir = absl::GetFlag(FLAGS_work_dir);
  if (dir.empty()) {
    std::string tmpl = std::filesystem::temp_directory_path() / "accord-demo-XXXXXX";
    if (::mkdtemp(tmpl.data()) == nullptr) {
      return absl::InternalError("cannot create a temporary directory");
    }
    dir = tmpl;
  }
  std::filesystem::create_directories(dir);
  return dir;
}

// One coordinator (its event log in `dir`) and --sidecars sidecars, with
// metrics on ephemeral ports.
absl::StatusOr<std::unique_ptr<testing::LocalCluster>> StartCluster(const std::string& dir) {
  testing::LocalClusterOptions options;
  options.bin_dir = absl::GetFlag(FLAGS_bin_dir);
  options.num_sidecars = absl::GetFlag(FLAGS_sidecars);
  options.echo = !absl::GetFlag(FLAGS_quiet);
  options.coordinator_flags = {"--metrics_port=0",
                               absl::StrCat("--event_log=", dir, "/events.jsonl")};
  options.sidecar_flags = {"--metrics_port=0"};
  std::printf("accord demo: starting 1 coordinator, %d sidecars, %d ranks (job %s, %d steps)\n",
              options.num_sidecars, absl::GetFlag(FLAGS_ranks), absl::GetFlag(FLAGS_job).c_str(),
              absl::GetFlag(FLAGS_steps));
  std::fflush(stdout);
  absl::StatusOr<std::unique_ptr<testing::LocalCluster>> cluster =
      testing::LocalCluster::Start(options);
  if (!cluster.ok()) return cluster;
  std::printf("accord demo: coordinator at %s; sidecars at %s\n",
              (*cluster)->coordinator_address().c_str(),
              absl::StrJoin((*cluster)->sidecar_sockets(), ", ").c_str());
  std::fflush(stdout);
  return cluster;
}

// The command line of one demo rank (LocalCluster fills the {placeholders}),
// its report written to `dir`.
std::vector<std::string> RankCommand(const std::string& dir) {
  std::string bin = absl::GetFlag(FLAGS_bin_dir);
  if (bin.empty()) {
    const char* env = std::getenv("ACCORD_BIN_DIR");
    bin = env ? env : "";
  }
  const std::string rank_bin =
      bin.empty()
          ? (std::filesystem::path(std::filesystem::read_symlink("/proc/self/exe")).parent_path() /
             "accord-demo-rank")
                .string()
          : bin + "/accord-demo-rank";
  return {rank_bin,
          "--socket={socket}",
          "--rank={rank}",
          "--world_size={world}",
          "--local_rank={local_rank}",
          "--job={job}",
          absl::StrCat("--steps=", absl::GetFlag(FLAGS_steps)),
          absl::StrCat("--report=", dir, "/rank-{rank}.json")};
}

// Every rank's report (an empty one for a rank that failed or wrote none,
// which clears `ok`).
std::vector<RankReport> ReadReports(const std::vector<testing::RankResult>& results,
                                    const std::string& dir, bool& ok) {
  std::vector<RankReport> reports(absl::GetFlag(FLAGS_ranks));
  for (const testing::RankResult& r : results) {
    if (r.exit_code != 0) {
      ok = false;
      std::fprintf(stderr, "demo: rank %d exited with %d:\n%s\n", r.rank, r.exit_code,
                   r.output.c_str());
      continue;
    }
    std::ifstream in(absl::StrCat(dir, "/rank-", r.rank, ".json"));
    std::stringstream ss;
    ss << in.rdbuf();
    if (!google::protobuf::util::JsonStringToMessage(ss.str(), &reports[r.rank]).ok()) {
      ok = false;
      std::fprintf(stderr, "demo: rank %d wrote no readable report\n", r.rank);
    }
  }
  return reports;
}

// What the ranks' reports add up to.
struct Totals {
  int64_t checked = 0;
  int64_t mismatches = 0;
  int64_t bytes = 0;
  double worst = 0;
  std::vector<double> latencies;
  std::set<std::string> digests;
};

Totals AddUp(const std::vector<RankReport>& reports) {
  Totals t;
  for (const RankReport& r : reports) {
    t.checked += r.elements_checked();
    t.mismatches += r.mismatches();
    t.bytes += r.bytes_reduced();
    t.worst = std::max(t.worst, r.worst_error_ratio());
    t.latencies.insert(t.latencies.end(), r.latencies_us().begin(), r.latencies_us().end());
    if (!r.decision_digest().empty()) t.digests.insert(r.decision_digest());
  }
  return t;
}

// Per group: wire dtypes, zero-fills, skips (from rank 0's record of the
// decisions, which every rank shares, and every rank's local zero-fills).
void PrintGroupTable(const std::vector<RankReport>& reports) {
  if (reports.empty() || reports[0].groups_size() == 0) return;
  std::printf("\nDecisions per group (%d steps, %d ranks):\n", absl::GetFlag(FLAGS_steps),
              absl::GetFlag(FLAGS_ranks));
  std::printf("  %-8s %-28s %-22s %-20s\n", "GROUP", "WIRE DTYPES (steps)",
              "ZERO-FILLED (rank-steps)", "SKIPPED (param-steps)");
  for (int g = 0; g < reports[0].groups_size(); ++g) {
    const GroupReport& gr = reports[0].groups(g);
    std::map<std::string, int> wires;
    int skipped = 0;
    for (const GroupStep& s : gr.steps()) {
      ++wires[s.wire()];
      skipped += s.skipped();
    }
    int64_t zero_filled = 0;
    for (const RankReport& r : reports) {
      if (g < r.groups_size()) {
        for (const GroupStep& s : r.groups(g).steps()) zero_filled += s.local_zero_filled();
      }
    }
    std::vector<std::string> w;
    for (const auto& [name, n] : wires) w.push_back(absl::StrCat(name, " x", n));
    std::printf("  %-8s %-28s %-22lld %-20d\n", gr.group().c_str(), absl::StrJoin(w, ", ").c_str(),
                static_cast<long long>(zero_filled), skipped);
  }
}

// What the coordinator says about the job: its skip matrix (printed), its
// cache hit rate (-1: unknown) and its metrics.
struct CoordinatorView {
  double hit_rate = -1;
  double metric_skips = -1;
  std::vector<std::string> metrics_urls;  // the coordinator's and the sidecars'
};

void PrintSkipMatrix(v1::ObserveService::Stub& stub, const std::string& job) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  v1::SkipMatrixRequest req;
  req.set_job_id(job);
  v1::SkipMatrixResponse resp;
  grpc::Status s = stub.SkipMatrix(&ctx, req, &resp);
  std::printf("\nSkip matrix from the coordinator (accordctl skips --job=%s):\n", job.c_str());
  if (s.ok()) {
    cli::SkipFormatOptions fo;
    fo.full = true;
    std::printf("%s", cli::FormatSkips(resp, fo).c_str());
  } else {
    std::printf("  (observe API unavailable: %s)\n", s.error_message().c_str());
  }
}

// The job's cache hit rate by the observe API's status; -1 when unknown.
double StatusHitRate(v1::ObserveService::Stub& stub, const std::string& job) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  v1::StatusRequest req;
  req.set_job_id(job);
  v1::StatusResponse resp;
  if (!stub.Status(&ctx, req, &resp).ok()) return -1;
  int64_t hits = 0, misses = 0;
  for (const auto& j : resp.jobs()) {
    for (const auto& g : j.groups()) {
      hits += g.cache_hits();
      misses += g.cache_misses();
    }
  }
  return hits + misses > 0 ? static_cast<double>(hits) / (hits + misses) : -1;
}

// Scrapes the coordinator's /metrics at `url` for its skips (and the hit
// rate, when the observe API gave none).
void ScrapeCoordinatorMetrics(const std::string& url, CoordinatorView& view) {
  std::string hostport = url.substr(7);
  hostport = hostport.substr(0, hostport.find('/'));
  const size_t colon = hostport.rfind(':');
  int port = 0;
  if (colon == std::string::npos || !absl::SimpleAtoi(hostport.substr(colon + 1), &port)) return;
  absl::StatusOr<HttpResponse> r = HttpGet(hostport.substr(0, colon), port, "/metrics");
  const std::string text = r.ok() ? r->body : "";
  view.metric_skips = MetricSum(text, "accord_skips_total");
  if (view.hit_rate < 0) {
    const double h = MetricSum(text, "accord_cache_hits_total");
    const double m = MetricSum(text, "accord_cache_misses_total");
    if (h + m > 0) view.hit_rate = h / (h + m);
  }
}

CoordinatorView AskCoordinator(testing::LocalCluster& cluster) {
  const std::string job = absl::GetFlag(FLAGS_job);
  auto stub = v1::ObserveService::NewStub(
      grpc::CreateChannel(cluster.coordinator_address(), grpc::InsecureChannelCredentials()));
  PrintSkipMatrix(*stub, job);
  CoordinatorView view;
  view.hit_rate = StatusHitRate(*stub, job);
  const std::vector<std::string> coord_urls = MetricsUrls(cluster.CoordinatorOutput());
  view.metrics_urls = coord_urls;
  for (int i = 0; i < absl::GetFlag(FLAGS_sidecars); ++i) {
    for (const std::string& u : MetricsUrls(cluster.SidecarOutput(i))) {
      view.metrics_urls.push_back(u);
    }
  }
  if (!coord_urls.empty()) ScrapeCoordinatorMetrics(coord_urls[0], view);
  return view;
}

void PrintSummary(bool ok, const std::vector<RankReport>& reports, const Totals& t,
                  const CoordinatorView& view, const std::string& dir, absl::Duration train_time) {
  const double p50 = Percentile(t.latencies, 0.5), p99 = Percentile(t.latencies, 0.99);
  const std::string hit_rate =
      view.hit_rate < 0 ? "unknown" : absl::StrFormat("%.0f%%", 100 * view.hit_rate);
  std::printf(
      "\nNegotiation latency (submit of all groups -> every decision), %zu samples: "
      "p50 %.0f us, p99 %.0f us\n",
      t.latencies.size(), p50, p99);
  std::printf("Cache hit rate: %s\n", hit_rate.c_str());
  if (view.metric_skips >= 0) {
    std::printf("accord_skips_total (coordinator metrics): %.0f\n", view.metric_skips);
  }
  std::printf("Metrics served at: %s\n", view.metrics_urls.empty()
                                             ? "(none reported)"
                                             : absl::StrJoin(view.metrics_urls, "  ").c_str());
  std::printf("Event log: %s/events.jsonl; rank reports: %s/rank-*.json\n", dir.c_str(),
              dir.c_str());
  double initial = 0, final_loss = 0;
  if (!reports.empty()) {
    initial = reports[0].initial_loss();
    final_loss = reports[0].final_loss();
  }
  std::printf("Loss: %.5f -> %.5f\n", initial, final_loss);
  std::printf(
      "\ndemo: %s - %d ranks x %d steps on %d nodes; %lld reduced elements (%.1f MiB "
      "reduce-scatter "
      "input) checked against float64 references, %lld mismatches (worst error %.2f of the "
      "bound); identical decisions on every rank: %s; negotiation p50 %.0f us p99 %.0f us; cache "
      "hit rate %s; loss %.4f -> %.4f; %.1f s\n",
      ok ? "PASSED" : "FAILED", absl::GetFlag(FLAGS_ranks), absl::GetFlag(FLAGS_steps),
      absl::GetFlag(FLAGS_sidecars), static_cast<long long>(t.checked), t.bytes / 1048576.0,
      static_cast<long long>(t.mismatches), t.worst, t.digests.size() == 1 ? "yes" : "NO", p50, p99,
      hit_rate.c_str(), initial, final_loss, absl::ToDoubleSeconds(train_time));
}

int Run() {
  absl::StatusOr<std::string> dir = WorkDir();
  if (!dir.ok()) {
    std::fprintf(stderr, "demo: %s\n", std::string(dir.status().message()).c_str());
    return 1;
  }
  ::setenv("ACCORD_LOG_LEVEL", "warning", 0);
  const absl::Time start = absl::Now();
  absl::StatusOr<std::unique_ptr<testing::LocalCluster>> cluster = StartCluster(*dir);
  if (!cluster.ok()) {
    std::fprintf(stderr, "demo: FAILED to start the local cluster: %s\n",
                 cluster.status().ToString().c_str());
    return 1;
  }
  absl::StatusOr<std::vector<testing::RankResult>> results =
      (*cluster)->RunRanks(RankCommand(*dir), absl::GetFlag(FLAGS_ranks), absl::GetFlag(FLAGS_job),
                           absl::Seconds(absl::GetFlag(FLAGS_timeout_s)));
  const absl::Duration train_time = absl::Now() - start;
  if (!results.ok()) {
    std::fprintf(stderr, "demo: FAILED to run the ranks: %s\n",
                 results.status().ToString().c_str());
    return 1;
  }
  bool ok = true;
  const std::vector<RankReport> reports = ReadReports(*results, *dir, ok);
  const Totals totals = AddUp(reports);
  if (totals.mismatches > 0) ok = false;
  if (totals.digests.size() > 1) {
    ok = false;
    std::fprintf(stderr, "demo: ranks received different decisions (%zu distinct digests)\n",
                 totals.digests.size());
  }
  std::printf("\n==================== accord demo summary ====================\n");
  PrintGroupTable(reports);
  const CoordinatorView view = AskCoordinator(**cluster);
  PrintSummary(ok, reports, totals, view, *dir, train_time);
  return ok ? 0 : 1;
}

}  // namespace
}  // namespace accord::demo

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return accord::demo::Run();
}
