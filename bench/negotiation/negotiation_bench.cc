// accord_negotiation_bench: the cost of one negotiation round trip for 8
// ranks on one node, through the real sidecar and coordinator, compared in
// the same run with what DDP does to agree on unused parameters: a Gloo
// allreduce (TCP loopback, 8 processes) of the usage bitmap and dtype codes.
//
//   accord_negotiation_bench [--ranks=8] [--iterations=200] [--gloo=false]
//                            [--paths=local,coordinator]
//
// Both decision paths are timed in one run: "local", where the sidecar of
// this single-node job decides itself (docs/ARCHITECTURE.md, "Local
// decisions"), and "coordinator" (--local_decisions=false), the path every
// multi-node job takes.
//
// Two more baseline rows, measured by the launcher before the ranks start: a
// bare gRPC bidirectional-stream ping-pong (64 B) over a Unix socket and over
// TCP loopback, the two hops a rank -> sidecar -> coordinator round trip
// takes. The cache-hit p50 is compared with their sum.
//
// The launcher starts a LocalCluster (1 coordinator, 1 sidecar) and runs this
// program again once per rank (--role=rank). Rank 0 prints the table.
// Measured per step on each rank: Submit -> Wait returning (which includes
// waiting for the slowest rank, as the allreduce does).
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "bench/negotiation/pingpong.grpc.pb.h"
#include "client/client.h"
#include "client/testing/local_cluster.h"
#include "gloo/allreduce.h"
#include "gloo/barrier.h"
#include "gloo/rendezvous/context.h"
#include "gloo/rendezvous/file_store.h"
#include "gloo/transport/tcp/device.h"
#include "grpcpp/grpcpp.h"

ABSL_FLAG(std::string, role, "launcher", "launcher or rank");
ABSL_FLAG(int, ranks, 8, "rank processes");
ABSL_FLAG(int, iterations, 200, "measured steps per case");
ABSL_FLAG(int, params, 1000, "parameters of the single group");
ABSL_FLAG(int, batch_groups, 200, "groups in the batch case");
ABSL_FLAG(int, batch_params, 10, "parameters per group in the batch case");
ABSL_FLAG(bool, gloo, true, "run the Gloo baseline (off: accord cases only, e.g. for profiling)");
ABSL_FLAG(std::string, bin_dir, "", "daemon binaries (default: the build tree)");
ABSL_FLAG(std::string, paths, "local,coordinator",
          "which decision paths to time: local (the sidecar decides a single-node job, "
          "--local_decisions) and/or coordinator (--local_decisions=false)");
ABSL_FLAG(std::string, label, "", "rank role: the path being timed, printed in its rows");
// Rank role.
ABSL_FLAG(std::string, socket, "", "");
ABSL_FLAG(int, rank, 0, "");
ABSL_FLAG(std::string, store_dir, "", "Gloo file store directory");
ABSL_FLAG(double, hops_us, 0, "launcher -> rank 0: p50 UDS + TCP ping-pong (us)");

namespace accord {
namespace {

struct Percentiles {
  double p50_us = 0, p99_us = 0;
};

Percentiles Summarize(std::vector<double> us) {
  std::sort(us.begin(), us.end());
  Percentiles p;
  if (us.empty()) return p;
  p.p50_us = us[us.size() / 2];
  p.p99_us = us[std::min(us.size() - 1, us.size() * 99 / 100)];
  return p;
}

double Micros(absl::Time a, absl::Time b) { return absl::ToDoubleMicroseconds(b - a); }

// Echo server for the ping-pong baseline (sync API, one stream at a time).
class PingPongService final : public bench::PingPong::Service {
  grpc::Status Stream(grpc::ServerContext*,
                      grpc::ServerReaderWriter<bench::Ping, bench::Ping>* stream) override {
    bench::Ping p;
    while (stream->Read(&p)) {
      if (!stream->Write(p)) break;
    }
    return grpc::Status::OK;
  }
};

// p50/p99 of `iters` 64-byte round trips over one stream to `target`.
absl::StatusOr<Percentiles> PingPong(const std::string& listen, const std::string& target,
                                     int iters) {
  PingPongService service;
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(listen, grpc::InsecureServerCredentials(),
                           listen.rfind("unix:", 0) == 0 ? nullptr : &port);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr) return absl::UnavailableError(absl::StrCat("cannot listen on ", listen));
  const std::string addr = port > 0 ? absl::StrCat("127.0.0.1:", port) : target;
  auto channel = grpc::CreateChannel(addr, grpc::InsecureChannelCredentials());
  auto stub = bench::PingPong::NewStub(channel);
  grpc::ClientContext ctx;
  auto stream = stub->Stream(&ctx);
  bench::Ping ping, pong;
  ping.set_payload(std::string(64, 'x'));
  std::vector<double> us;
  for (int i = 0; i < iters + 20; ++i) {
    const absl::Time t0 = absl::Now();
    if (!stream->Write(ping) || !stream->Read(&pong)) {
      return absl::UnavailableError(absl::StrCat("ping-pong over ", addr, " broke"));
    }
    if (i >= 20) us.push_back(Micros(t0, absl::Now()));
  }
  stream->WritesDone();
  (void)stream->Finish();
  server->Shutdown();
  return Summarize(std::move(us));
}

int RunRank() {
  const int rank = absl::GetFlag(FLAGS_rank);
  const int world = absl::GetFlag(FLAGS_ranks);
  const int iters = absl::GetFlag(FLAGS_iterations);
  const int n = absl::GetFlag(FLAGS_params);
  const int ng = absl::GetFlag(FLAGS_batch_groups);
  const int nbp = absl::GetFlag(FLAGS_batch_params);

  ClientOptions o;
  o.socket_path = absl::GetFlag(FLAGS_socket);
  o.job_id = "bench";
  o.rank = rank;
  o.world_size = world;
  absl::StatusOr<std::unique_ptr<Client>> c = Client::Connect(o);
  if (!c.ok()) {
    fprintf(stderr, "rank %d: %s\n", rank, c.status().ToString().c_str());
    return 1;
  }
  const absl::Duration wait = absl::Seconds(60);
  GroupSpec big{"big", {}};
  for (int i = 0; i < n; ++i) big.params.push_back({absl::StrCat("p", i), 64, 64 * 64});
  if (absl::Status s = (*c)->RegisterGroup(big, Policy(), absl::Now() + wait); !s.ok()) {
    fprintf(stderr, "rank %d: %s\n", rank, s.ToString().c_str());
    return 1;
  }
  for (int g = 0; g < ng; ++g) {
    GroupSpec spec{absl::StrCat("b", g), {}};
    for (int i = 0; i < nbp; ++i) spec.params.push_back({absl::StrCat("q", i), 64, 64});
    if (absl::Status s = (*c)->RegisterGroup(spec, Policy(), absl::Now() + wait); !s.ok()) {
      fprintf(stderr, "rank %d: %s\n", rank, s.ToString().c_str());
      return 1;
    }
  }

  int64_t step = 0;
  auto one = [&](bool vary) -> absl::StatusOr<double> {
    GroupSubmission sub{"big", step, std::vector<std::optional<DType>>(n, DType::kFloat32)};
    // A changing unused parameter makes every step a cache miss.
    if (vary) sub.grad_dtypes[step % n] = std::nullopt;
    const absl::Time t0 = absl::Now();
    DecisionFuture f = (*c)->Submit(sub);
    absl::StatusOr<Decision> d = (*c)->Wait(f, absl::Now() + wait);
    const absl::Time t1 = absl::Now();
    ++step;
    if (!d.ok()) return d.status();
    return Micros(t0, t1);
  };
  std::vector<double> miss, hit, batch;
  for (int i = 0; i < 10; ++i) (void)one(true);  // warm-up
  for (int i = 0; i < iters; ++i) {
    absl::StatusOr<double> us = one(true);
    if (!us.ok()) return fprintf(stderr, "%s\n", us.status().ToString().c_str()), 1;
    miss.push_back(*us);
  }
  (void)one(false);
  for (int i = 0; i < iters; ++i) {
    absl::StatusOr<double> us = one(false);
    if (!us.ok()) return fprintf(stderr, "%s\n", us.status().ToString().c_str()), 1;
    hit.push_back(*us);
  }
  for (int i = 0; i < iters + 1; ++i) {
    std::vector<GroupSubmission> subs;
    for (int g = 0; g < ng; ++g) {
      subs.push_back(
          {absl::StrCat("b", g), step, std::vector<std::optional<DType>>(nbp, DType::kFloat32)});
    }
    const absl::Time t0 = absl::Now();
    std::vector<DecisionFuture> fs = (*c)->SubmitBatch(subs);
    for (const DecisionFuture& f : fs) {
      absl::StatusOr<Decision> d = (*c)->Wait(f, absl::Now() + wait);
      if (!d.ok()) return fprintf(stderr, "%s\n", d.status().ToString().c_str()), 1;
    }
    const absl::Time t1 = absl::Now();
    ++step;
    if (i > 0) batch.push_back(Micros(t0, t1));  // the first batch fills the cache
  }

  // Baseline: DDP's unused-parameter agreement, one allreduce of the usage
  // flags and dtype codes (int32 per parameter, as DDP's local_used_map).
  std::vector<double> gloo_us;
  if (absl::GetFlag(FLAGS_gloo)) {
    gloo::transport::tcp::attr attr;
    attr.hostname = "127.0.0.1";
    auto dev = gloo::transport::tcp::CreateDevice(attr);
    gloo::rendezvous::FileStore store(absl::GetFlag(FLAGS_store_dir));
    auto ctx = std::make_shared<gloo::rendezvous::Context>(rank, world);
    ctx->connectFullMesh(store, dev);
    std::vector<int32_t> buf(2 * n);
    for (int i = 0; i < iters + 10; ++i) {
      for (int p = 0; p < n; ++p) {
        buf[p] = 1;
        buf[n + p] = static_cast<int32_t>(DType::kFloat32);
      }
      gloo::AllreduceOptions opts(ctx);
      opts.setOutput(buf.data(), buf.size());
      opts.setReduceFunction(
          static_cast<void (*)(void*, const void*, const void*, size_t)>(&gloo::sum<int32_t>));
      const absl::Time t0 = absl::Now();
      gloo::allreduce(opts);
      const absl::Time t1 = absl::Now();
      if (i >= 10) gloo_us.push_back(Micros(t0, t1));
    }
  }

  if (rank == 0) {
    const Percentiles m = Summarize(miss), h = Summarize(hit), b = Summarize(batch),
                      g = Summarize(gloo_us);
    const std::string label = absl::GetFlag(FLAGS_label);
    printf("negotiation, %d ranks, 1 node, %d iterations (rank 0's view), %s path\n", world, iters,
           label.c_str());
    printf("%-52s %10s %10s\n", "case", "p50 us", "p99 us");
    printf("%-52s %10.1f %10.1f\n",
           absl::StrCat("accord 1 group x ", n, " params, cache miss, ", label).c_str(), m.p50_us,
           m.p99_us);
    printf("%-52s %10.1f %10.1f\n",
           absl::StrCat("accord 1 group x ", n, " params, cache hit, ", label).c_str(), h.p50_us,
           h.p99_us);
    printf(
        "%-52s %10.1f %10.1f\n",
        absl::StrCat("accord batch of ", ng, " groups x ", nbp, " params (hit), ", label).c_str(),
        b.p50_us, b.p99_us);
    if (!gloo_us.empty()) {
      printf("%-52s %10.1f %10.1f\n",
             absl::StrCat("gloo allreduce ", 2 * n, " x int32 (baseline)").c_str(), g.p50_us,
             g.p99_us);
      printf("%s: cache-hit p50 / gloo p50 = %.2fx (target <= 1.0x)\n", label.c_str(),
             h.p50_us / g.p50_us);
    }
    const double hops = absl::GetFlag(FLAGS_hops_us);
    if (hops > 0) {
      printf("%s: cache-hit p50 / (UDS + TCP ping-pong p50) = %.2fx (target <= 1.3x)\n",
             label.c_str(), h.p50_us / hops);
    }
    printf("%s: batch p50 / single-group hit p50 = %.2fx (target <= 5x)\n", label.c_str(),
           b.p50_us / h.p50_us);
    fflush(stdout);
  }
  return 0;
}

// One cluster whose sidecar decides locally (path "local") or leaves every
// decision to the coordinator ("coordinator"); the ranks print their rows.
// Returns the number of failed ranks.
int RunPath(const char* self, const std::string& path, bool gloo, double hops_us) {
  testing::LocalClusterOptions o;
  o.bin_dir = absl::GetFlag(FLAGS_bin_dir);
  o.num_sidecars = 1;
  o.echo = false;
  o.sidecar_flags = {path == "local" ? "--local_decisions=true" : "--local_decisions=false"};
  absl::StatusOr<std::unique_ptr<testing::LocalCluster>> cluster = testing::LocalCluster::Start(o);
  if (!cluster.ok()) {
    fprintf(stderr, "accord_negotiation_bench: %s\n", cluster.status().ToString().c_str());
    return 1;
  }
  char tmpl[] = "/tmp/accord-negbench-XXXXXX";
  const std::string store_dir = mkdtemp(tmpl);
  std::vector<std::string> cmd = {
      self,
      "--role=rank",
      "--label=" + path,
      "--socket={socket}",
      "--rank={rank}",
      absl::StrCat("--ranks=", absl::GetFlag(FLAGS_ranks)),
      absl::StrCat("--iterations=", absl::GetFlag(FLAGS_iterations)),
      absl::StrCat("--params=", absl::GetFlag(FLAGS_params)),
      absl::StrCat("--batch_groups=", absl::GetFlag(FLAGS_batch_groups)),
      absl::StrCat("--batch_params=", absl::GetFlag(FLAGS_batch_params)),
      absl::StrCat("--gloo=", gloo ? "true" : "false"),
      absl::StrCat("--hops_us=", hops_us),
      "--store_dir=" + store_dir};
  absl::StatusOr<std::vector<testing::RankResult>> results =
      (*cluster)->RunRanks(cmd, absl::GetFlag(FLAGS_ranks), "bench", absl::Minutes(10));
  std::string rm = "rm -rf " + store_dir;
  (void)!system(rm.c_str());
  if (!results.ok()) {
    fprintf(stderr, "accord_negotiation_bench: %s\n", results.status().ToString().c_str());
    return 1;
  }
  int failed = 0;
  for (const testing::RankResult& r : *results) {
    if (r.rank == 0 || r.exit_code != 0) fputs(r.output.c_str(), stdout);
    if (r.exit_code != 0) ++failed;
  }
  fflush(stdout);
  return failed;
}

int RunLauncher(const char* self) {
  // The two hops' floor, before anything else runs.
  char sock_tmpl[] = "/tmp/accord-pingpong-XXXXXX";
  const std::string sock_dir = mkdtemp(sock_tmpl);
  const std::string uds = absl::StrCat("unix:", sock_dir, "/pp.sock");
  absl::StatusOr<Percentiles> uds_pp = PingPong(uds, uds, absl::GetFlag(FLAGS_iterations));
  absl::StatusOr<Percentiles> tcp_pp = PingPong("127.0.0.1:0", "", absl::GetFlag(FLAGS_iterations));
  (void)!system(("rm -rf " + sock_dir).c_str());
  if (!uds_pp.ok() || !tcp_pp.ok()) {
    fprintf(stderr, "accord_negotiation_bench: ping-pong baseline: %s\n",
            (!uds_pp.ok() ? uds_pp.status() : tcp_pp.status()).ToString().c_str());
    return 1;
  }
  const std::string hop_rows = absl::StrCat(
      absl::StrFormat("%-44s %10.1f %10.1f\n", "grpc bidi ping-pong 64 B, UDS (baseline)",
                      uds_pp->p50_us, uds_pp->p99_us),
      absl::StrFormat("%-44s %10.1f %10.1f\n", "grpc bidi ping-pong 64 B, TCP (baseline)",
                      tcp_pp->p50_us, tcp_pp->p99_us));
  fputs(hop_rows.c_str(), stdout);
  fflush(stdout);
  int failed = 0;
  bool gloo = absl::GetFlag(FLAGS_gloo);  // the baseline runs once
  for (absl::string_view path : absl::StrSplit(absl::GetFlag(FLAGS_paths), ',')) {
    if (path != "local" && path != "coordinator") {
      fprintf(stderr,
              "accord_negotiation_bench: --paths: unknown path \"%s\" (local, coordinator)\n",
              std::string(path).c_str());
      return 2;
    }
    failed += RunPath(self, std::string(path), gloo, uds_pp->p50_us + tcp_pp->p50_us);
    gloo = false;
  }
  return failed == 0 ? 0 : 1;
}

}  // namespace
}  // namespace accord

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  if (absl::GetFlag(FLAGS_role) == "rank") return accord::RunRank();
  return accord::RunLauncher(argv[0]);
}
