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
#include <memory>
#include <optional>
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

// The sizes of the cases a rank times.
struct Cases {
  int iters = 0;
  int params = 0;        // of the single group "big"
  int batch_groups = 0;  // groups "b<i>" in the batch case
  int batch_params = 0;  // parameters of each
};

// Connects this rank and registers "big" and the batch groups.
absl::StatusOr<std::unique_ptr<Client>> ConnectAndRegister(int rank, int world, const Cases& cases,
                                                           absl::Duration wait) {
  ClientOptions o;
  o.socket_path = absl::GetFlag(FLAGS_socket);
  o.job_id = "bench";
  o.rank = rank;
  o.world_size = world;
  absl::StatusOr<std::unique_ptr<Client>> c = Client::Connect(o);
  if (!c.ok()) return c.status();
  GroupSpec big{"big", {}};
  for (int i = 0; i < cases.params; ++i) {
    big.params.push_back({absl::StrCat("p", i), 64, 64 * 64});
  }
  if (absl::Status s = (*c)->RegisterGroup(big, Policy(), absl::Now() + wait); !s.ok()) return s;
  for (int g = 0; g < cases.batch_groups; ++g) {
    GroupSpec spec{absl::StrCat("b", g), {}};
    for (int i = 0; i < cases.batch_params; ++i) {
      spec.params.push_back({absl::StrCat("q", i), 64, 64});
    }
    if (absl::Status s = (*c)->RegisterGroup(spec, Policy(), absl::Now() + wait); !s.ok()) {
      return s;
    }
  }
  return c;
}

// Times Submit -> Wait of "big" at successive steps; `vary` leaves a
// different parameter unused each step, so every step is a cache miss.
class SingleGroupTimer {
 public:
  SingleGroupTimer(Client& client, int params, absl::Duration wait)
      : client_(client), params_(params), wait_(wait) {}

  absl::StatusOr<double> One(bool vary) {
    GroupSubmission sub{"big", step_, std::vector<std::optional<DType>>(params_, DType::kFloat32)};
    if (vary) sub.grad_dtypes[step_ % params_] = std::nullopt;
    const absl::Time t0 = absl::Now();
    DecisionFuture f = client_.Submit(sub);
    absl::StatusOr<Decision> d = client_.Wait(f, absl::Now() + wait_);
    const absl::Time t1 = absl::Now();
    ++step_;
    if (!d.ok()) return d.status();
    return Micros(t0, t1);
  }
  // `iters` timed steps.
  absl::StatusOr<std::vector<double>> Many(bool vary, int iters) {
    std::vector<double> us;
    for (int i = 0; i < iters; ++i) {
      absl::StatusOr<double> one = One(vary);
      if (!one.ok()) return one.status();
      us.push_back(*one);
    }
    return us;
  }
  int64_t step() const { return step_; }

 private:
  Client& client_;
  const int params_;
  const absl::Duration wait_;
  int64_t step_ = 0;
};

// Times SubmitBatch -> every Wait of the batch groups from `step` on; the
// first batch fills the cache and is not counted.
absl::StatusOr<std::vector<double>> TimeBatches(Client& client, const Cases& cases, int64_t step,
                                                absl::Duration wait) {
  std::vector<double> batch;
  for (int i = 0; i < cases.iters + 1; ++i, ++step) {
    std::vector<GroupSubmission> subs;
    for (int g = 0; g < cases.batch_groups; ++g) {
      subs.push_back({absl::StrCat("b", g), step,
                      std::vector<std::optional<DType>>(cases.batch_params, DType::kFloat32)});
    }
    const absl::Time t0 = absl::Now();
    std::vector<DecisionFuture> fs = client.SubmitBatch(subs);
    for (const DecisionFuture& f : fs) {
      absl::StatusOr<Decision> d = client.Wait(f, absl::Now() + wait);
      if (!d.ok()) return d.status();
    }
    if (i > 0) batch.push_back(Micros(t0, absl::Now()));
  }
  return batch;
}

// DDP's unused-parameter agreement: one Gloo allreduce of the usage flags and
// dtype codes (int32 per parameter, as DDP's local_used_map).
std::vector<double> TimeGlooAllreduce(int rank, int world, const Cases& cases) {
  const int n = cases.params;
  gloo::transport::tcp::attr attr;
  attr.hostname = "127.0.0.1";
  auto dev = gloo::transport::tcp::CreateDevice(attr);
  gloo::rendezvous::FileStore store(absl::GetFlag(FLAGS_store_dir));
  auto ctx = std::make_shared<gloo::rendezvous::Context>(rank, world);
  ctx->connectFullMesh(store, dev);
  std::vector<int32_t> buf(2 * n);
  std::vector<double> us;
  for (int i = 0; i < cases.iters + 10; ++i) {
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
    if (i >= 10) us.push_back(Micros(t0, t1));
  }
  return us;
}

// What rank 0 measured, in microseconds per round.
struct Timings {
  std::vector<double> miss, hit, batch, gloo;
};

void PrintRows(int world, const Cases& cases, const Timings& t) {
  const Percentiles m = Summarize(t.miss), h = Summarize(t.hit), b = Summarize(t.batch),
                    g = Summarize(t.gloo);
  const int n = cases.params;
  const std::string label = absl::GetFlag(FLAGS_label);
  printf("negotiation, %d ranks, 1 node, %d iterations (rank 0's view), %s path\n", world,
         cases.iters, label.c_str());
  printf("%-52s %10s %10s\n", "case", "p50 us", "p99 us");
  printf("%-52s %10.1f %10.1f\n",
         absl::StrCat("accord 1 group x ", n, " params, cache miss, ", label).c_str(), m.p50_us,
         m.p99_us);
  printf("%-52s %10.1f %10.1f\n",
         absl::StrCat("accord 1 group x ", n, " params, cache hit, ", label).c_str(), h.p50_us,
         h.p99_us);
  printf("%-52s %10.1f %10.1f\n",
         absl::StrCat("accord batch of ", cases.batch_groups, " groups x ", cases.batch_params,
                      " params (hit), ", label)
             .c_str(),
         b.p50_us, b.p99_us);
  if (!t.gloo.empty()) {
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

// The accord cases in order: cache misses (after a warm-up), cache hits
// (after one step that fills the cache), batches.
absl::Status TimeAccord(Client& client, const Cases& cases, absl::Duration wait, Timings& t) {
  SingleGroupTimer single(client, cases.params, wait);
  for (int i = 0; i < 10; ++i) (void)single.One(true);  // warm-up
  absl::StatusOr<std::vector<double>> miss = single.Many(true, cases.iters);
  if (!miss.ok()) return miss.status();
  t.miss = *std::move(miss);
  (void)single.One(false);
  absl::StatusOr<std::vector<double>> hit = single.Many(false, cases.iters);
  if (!hit.ok()) return hit.status();
  t.hit = *std::move(hit);
  absl::StatusOr<std::vector<double>> batch = TimeBatches(client, cases, single.step(), wait);
  if (!batch.ok()) return batch.status();
  t.batch = *std::move(batch);
  return absl::OkStatus();
}

int RunRank() {
  const int rank = absl::GetFlag(FLAGS_rank);
  const int world = absl::GetFlag(FLAGS_ranks);
  const Cases cases{absl::GetFlag(FLAGS_iterations), absl::GetFlag(FLAGS_params),
                    absl::GetFlag(FLAGS_batch_groups), absl::GetFlag(FLAGS_batch_params)};
  const absl::Duration wait = absl::Seconds(60);
  absl::StatusOr<std::unique_ptr<Client>> c = ConnectAndRegister(rank, world, cases, wait);
  if (!c.ok()) {
    fprintf(stderr, "rank %d: %s\n", rank, c.status().ToString().c_str());
    return 1;
  }
  Timings t;
  if (absl::Status s = TimeAccord(**c, cases, wait, t); !s.ok()) {
    fprintf(stderr, "%s\n", s.ToString().c_str());
    return 1;
  }
  if (absl::GetFlag(FLAGS_gloo)) t.gloo = TimeGlooAllreduce(rank, world, cases);
  if (rank == 0) PrintRows(world, cases, t);
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
