// accord-coordinator: decides, per group and step, what every rank of a job
// packs for its reduce-scatter; also serves the job's key-value rendezvous.
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "core/lock_checks.h"
#include "core/log.h"
#include "daemon/common/auth_tokens.h"
#include "daemon/common/clock.h"
#include "daemon/common/flags_env.h"
#include "daemon/common/metrics_flags.h"
#include "daemon/common/server_credentials.h"
#include "daemon/common/signals.h"
#include "daemon/common/token_flags.h"
#include "daemon/coordinator/coordinator.h"
#include "daemon/coordinator/grpc_coordinator_service.h"
#include "daemon/coordinator/kv_store.h"
#include "daemon/coordinator/metrics_coordinator.h"
#include "daemon/coordinator/observe_service.h"
#include "grpcpp/generic/async_generic_service.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "observe/event_log.h"
#include "observe/http_server.h"
#include "observe/metrics.h"

ABSL_FLAG(int64_t, stream_queue_low_watermark, 1024,
          "messages queued for one stream's reader past which it is logged as slow");
ABSL_FLAG(int64_t, stream_queue_high_watermark, 16384,
          "messages queued for one stream's reader past which it is cut off "
          "(RESOURCE_EXHAUSTED) instead of growing memory");
ABSL_FLAG(std::string, listen, "127.0.0.1:7070",
          "host:port to serve CoordinatorService, KeyValueService, ObserveService and gRPC health "
          "on (port 0: any free port; the bound address is printed on stdout). A non-loopback "
          "address needs TLS (--tls_cert/--tls_key) or an explicit --plaintext");
ABSL_FLAG(int, health_port, 0,
          "also serve grpc.health.v1.Health alone, in plaintext, on this port of the --listen "
          "host (for kubelet gRPC probes, which cannot speak TLS); 0 = off");
ABSL_FLAG(absl::Duration, deadline, absl::Seconds(60),
          "a (group, step) that has not heard from every rank this long after its first "
          "manifest fails the job with MISSING_RANKS, naming the ranks and their last steps; so "
          "does a group not registered by every rank this long after its first registration. "
          "No key-value Get waits longer: it fails naming the ranks expected to set its keys");
ABSL_FLAG(absl::Duration, keepalive_time, absl::Seconds(10),
          "ping each sidecar connection this often (gRPC keepalive); a sidecar gone without "
          "closing its connection (half-open) is dropped, with its job when it was the job's "
          "last node, within --keepalive_time + --keepalive_timeout. Give the sidecars the "
          "same value; pings from them are accepted as often as every --keepalive_time / 2");
ABSL_FLAG(absl::Duration, keepalive_timeout, absl::Seconds(10),
          "a keepalive ping not answered within this closes the connection");
ABSL_FLAG(int, metrics_port, 9090,
          "serve Prometheus metrics (/metrics) and /healthz over HTTP on this port (0: any free "
          "port; -1: off). The URL is printed on stdout");
ABSL_FLAG(std::string, metrics_host, "0.0.0.0", "address the metrics endpoint binds");
ABSL_FLAG(bool, param_skip_metrics, false,
          "also export accord_param_skips_total{job,group,param,rank} (one series per parameter "
          "and rank: large)");
ABSL_FLAG(int, max_message_bytes, 4 << 20,
          "largest gRPC message received or sent; larger ones fail with RESOURCE_EXHAUSTED");
ABSL_FLAG(int, max_jobs, 1024,
          "jobs (runs) served at once, key-value entries included; one more is refused with "
          "LIMIT_EXCEEDED. A run's state and keys are dropped when it ends, so this bounds live "
          "runs, not job ids ever seen");
ABSL_FLAG(int64_t, usage_window_steps, 1000,
          "observe API: decided steps of per-step usage kept per group (skip matrix)");
ABSL_FLAG(int64_t, usage_window_bytes, 16 << 20,
          "observe API: approximate bytes one group's usage window may keep alive");
ABSL_FLAG(int64_t, usage_window_total_bytes, 256 << 20,
          "observe API: approximate bytes all usage windows together may keep alive (retired "
          "jobs' windows are dropped first)");
ABSL_FLAG(absl::Duration, metrics_series_grace, absl::Minutes(10),
          "metric series of a job are removed this long after its last run ended (unless the "
          "job id came back meanwhile)");
ABSL_FLAG(absl::Duration, node_reconnect_grace, absl::Seconds(10),
          "a node whose stream ended while a pending step needs its ranks fails the job (every "
          "rank gets UNAVAILABLE naming it) once it has not come back for this long");
ABSL_FLAG(absl::Duration, run_start_timeout, absl::Minutes(5),
          "a run started by a key-value request ends (its keys dropped) when no node joins it "
          "within this long (see docs/ARCHITECTURE.md, Runs)");
ABSL_FLAG(int, max_groups_per_job, 16384,
          "groups registered per job; one more is refused with LIMIT_EXCEEDED");
ABSL_FLAG(int64_t, max_params_per_group, 1 << 20,
          "parameters per group; a larger registration is refused with LIMIT_EXCEEDED");
ABSL_FLAG(int, max_ranks, 65536, "world size of a job; a larger NodeHello is refused");
ABSL_FLAG(int, max_pending_steps, 64,
          "steps of one group waiting for ranks at once; one more fails with LIMIT_EXCEEDED");
ABSL_FLAG(bool, repeat_waves, true,
          "decide a step where every node repeats its whole batch in O(groups) after O(1) per "
          "node, with the same decisions (see docs/ARCHITECTURE.md, Repeat waves); false: "
          "entry by entry");
ABSL_FLAG(int, decide_threads, 1,
          "threads that handle the manifests of one batch and decide the groups it completes "
          "side by side, the handling thread included (docs/ARCHITECTURE.md, More than one "
          "core); 0: one per hardware thread, at most 8. Decisions do not depend on it");
ABSL_FLAG(int64_t, parallel_min_entries, 64,
          "with --decide_threads > 1: the fewest manifests in a batch handled side by side");
ABSL_FLAG(int64_t, parallel_decide_min_contents, 4096,
          "with --decide_threads > 1: the fewest node contents the steps a batch completes must "
          "merge together for their decisions to be computed side by side");
ABSL_FLAG(std::string, log_level, "info", "debug, info, warning or error (debug = info for now)");
ABSL_FLAG(std::string, event_log, "",
          "append JSON-lines events (changed decisions, errors, stalls, deadline failures, nodes "
          "connecting and leaving) to this file; empty = off");
ABSL_FLAG(int64_t, event_log_max_bytes, 64 << 20,
          "rotate the event log when it would pass this size");
ABSL_FLAG(int, event_log_max_files, 3, "rotated event log files kept besides the live one");
ABSL_FLAG(std::string, tls_cert, "", "server certificate (PEM); with --tls_key enables TLS");
ABSL_FLAG(std::string, tls_key, "", "server private key (PEM)");
ABSL_FLAG(std::string, tls_ca, "",
          "CA bundle (PEM): require and verify sidecar client certificates (mutual TLS)");
ABSL_FLAG(bool, plaintext, false,
          "serve without TLS on a non-loopback --listen (job tokens and manifests in clear "
          "text). Without TLS flags, plaintext is allowed implicitly only on loopback");
ABSL_FLAG(std::string, tokens_file, "",
          "job tokens file: lines \"job_id token\" (# comments; \"* token\" = admin token "
          "for observe requests about every job). When set, every NodeHello, key-value and "
          "observe request must carry its job's token (PERMISSION_DENIED otherwise). Re-read "
          "on SIGHUP");

namespace accord::daemon {
namespace {

void ParseCoordinatorFlags(int argc, char** argv) {
  ParseFlagsWithEnv(
      argc, argv, __FILE__,
      "agrees, per group and step, on the reduce-scatter layout and dtype of every rank of a "
      "job.\n\nWith no flags it serves on 127.0.0.1:7070 in plaintext (loopback only). To serve "
      "the network give --listen=0.0.0.0:7070 with --tls_cert/--tls_key (and --tls_ca for mutual "
      "TLS), or --plaintext to accept clear text explicitly. --tokens_file makes every job prove "
      "its token.\nEvery flag --name may also be set as the environment variable ACCORD_<NAME> "
      "(the command line wins).");
}

// The --tls_* / --plaintext flags (daemon/common/server_credentials.h).
ServerTlsFlags ServerTlsFromFlags() {
  ServerTlsFlags tls;
  tls.listen = absl::GetFlag(FLAGS_listen);
  tls.plaintext = absl::GetFlag(FLAGS_plaintext);
  tls.cert_path = absl::GetFlag(FLAGS_tls_cert);
  tls.key_path = absl::GetFlag(FLAGS_tls_key);
  tls.ca_path = absl::GetFlag(FLAGS_tls_ca);
  return tls;
}

// The --event_log; nullptr without one.
absl::StatusOr<std::unique_ptr<EventLog>> OpenEventLog() {
  const std::string path = absl::GetFlag(FLAGS_event_log);
  if (path.empty()) return std::unique_ptr<EventLog>();
  EventLog::Options log_options;
  log_options.path = path;
  log_options.max_bytes = absl::GetFlag(FLAGS_event_log_max_bytes);
  log_options.max_files = absl::GetFlag(FLAGS_event_log_max_files);
  absl::StatusOr<std::unique_ptr<EventLog>> opened = EventLog::Open(log_options);
  if (!opened.ok()) {
    return absl::Status(opened.status().code(),
                        absl::StrCat("--event_log: ", opened.status().message()));
  }
  return opened;
}

CoordinatorOptions CoordinatorOptionsFromFlags(CoordinatorObserver* observer, KvStore* kv) {
  CoordinatorOptions options;
  options.observer = observer;
  options.deadline = absl::GetFlag(FLAGS_deadline);
  options.max_jobs = absl::GetFlag(FLAGS_max_jobs);
  options.max_groups_per_job = absl::GetFlag(FLAGS_max_groups_per_job);
  options.max_params_per_group = absl::GetFlag(FLAGS_max_params_per_group);
  options.max_pending_steps = absl::GetFlag(FLAGS_max_pending_steps);
  options.max_world_size = absl::GetFlag(FLAGS_max_ranks);
  options.repeat_waves = absl::GetFlag(FLAGS_repeat_waves);
  options.decide_threads = absl::GetFlag(FLAGS_decide_threads);
  options.parallel_min_entries = absl::GetFlag(FLAGS_parallel_min_entries);
  options.parallel_decide_min_contents = absl::GetFlag(FLAGS_parallel_decide_min_contents);
  // Runs own the key-value entries: a run's keys go when it ends or fails.
  options.on_run_ended = [kv](const std::string& job_id, const std::string& run_id,
                              const absl::Status& why, const std::string& successor) {
    kv->DropRun(job_id, run_id, why, successor);
  };
  options.waits_cut = [kv](const std::string& job_id, const std::string& scope) {
    return kv->WaitsCut(job_id, scope);
  };
  options.run_start_timeout = absl::GetFlag(FLAGS_run_start_timeout);
  options.node_reconnect_grace = absl::GetFlag(FLAGS_node_reconnect_grace);
  options.usage_window_steps = absl::GetFlag(FLAGS_usage_window_steps);
  options.usage_window_bytes = absl::GetFlag(FLAGS_usage_window_bytes);
  options.usage_total_bytes = absl::GetFlag(FLAGS_usage_window_total_bytes);
  return options;
}

// The main server on --listen with every service; `port` gets the bound port.
// Exit code 2 for bad flags, 1 when it cannot listen.
struct Started {
  std::unique_ptr<grpc::Server> server;
  int exit_code = 0;
};
Started StartServer(const std::shared_ptr<grpc::ServerCredentials>& creds,
                    const std::vector<grpc::Service*>& services, int& port) {
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  const std::string listen = absl::GetFlag(FLAGS_listen);
  builder.AddListeningPort(listen, creds, &port);
  builder.SetMaxReceiveMessageSize(absl::GetFlag(FLAGS_max_message_bytes));
  builder.SetMaxSendMessageSize(absl::GetFlag(FLAGS_max_message_bytes));
  // Liveness (docs/ARCHITECTURE.md, "Liveness"): both ends ping, so a
  // half-open node stream ends within keepalive_time + keepalive_timeout and
  // CloseSession drops the node (and the job with its last node).
  if (absl::Status s = AddServerKeepalive(builder, absl::GetFlag(FLAGS_keepalive_time),
                                          absl::GetFlag(FLAGS_keepalive_timeout));
      !s.ok()) {
    ACCORD_LOG(ERROR) << s.message();
    return {nullptr, 2};
  }
  for (grpc::Service* service : services) builder.RegisterService(service);
  Started started{builder.BuildAndStart(), 0};
  if (started.server == nullptr || port == 0) {
    ACCORD_LOG(ERROR) << "cannot listen on " << listen
                      << " (--listen); is the port in use or the address not local?";
    return {nullptr, 1};
  }
  return started;
}

// The health-only plaintext server of --health_port (nullptr when off): it
// registers no service of ours, so nothing but grpc.health.v1.Health is
// reachable on it. `unimplemented` answers every other method and gives the
// builder the callback queue it insists on before the health service is
// added at start. Exit code 1 when it cannot listen.
Started StartHealthServer(const std::string& host, grpc::CallbackGenericService* unimplemented) {
  const int health_port = absl::GetFlag(FLAGS_health_port);
  if (health_port == 0) return {};
  grpc::ServerBuilder health_builder;
  health_builder.RegisterCallbackGenericService(unimplemented);
  int bound = 0;
  health_builder.AddListeningPort(absl::StrCat(host, ":", health_port),
                                  grpc::InsecureServerCredentials(), &bound);
  Started started{health_builder.BuildAndStart(), 0};
  if (started.server == nullptr || bound == 0) {
    ACCORD_LOG(ERROR) << "cannot listen on " << host << ":" << health_port
                      << " (--health_port); is the port in use?";
    return {nullptr, 1};
  }
  std::printf("accord-coordinator health on %s:%d\n", host.c_str(), bound);
  return started;
}

// What the bounds of docs/ARCHITECTURE.md ("Bounds") keep in check, set at
// each scrape.
class BoundsGauges {
 public:
  explicit BoundsGauges(MetricsRegistry& registry)
      : runs_(registry.AddGauge("accord_runs", "Live runs (jobs' incarnations).").Get()),
        kv_runs_(registry.AddGauge("accord_kv_runs", "Runs holding key-value entries.").Get()),
        kv_keys_(registry.AddGauge("accord_kv_keys", "Key-value entries held.").Get()),
        streams_(
            registry.AddGauge("accord_node_streams", "Sidecar streams open on the coordinator.")
                .Get()),
        retained_(registry
                      .AddGauge("accord_retained_contents",
                                "Node manifest contents kept for pending steps.")
                      .Get()),
        usage_(registry
                   .AddGauge("accord_usage_window_bytes",
                             "Approximate bytes the usage windows keep alive.")
                   .Get()),
        waves_(registry
                   .AddCounter("accord_repeat_waves_total",
                               "Steps decided as one repeat wave (docs/ARCHITECTURE.md, Repeat "
                               "waves).")
                   .Get()),
        batches_(registry
                     .AddCounter("accord_node_batches_total",
                                 "Manifest batches with manifests received from nodes.")
                     .Get()),
        batch_repeats_(registry
                           .AddCounter("accord_node_batch_repeats_total",
                                       "Batch repeats received from nodes: one record standing "
                                       "for the node stream's previous batch at a new step.")
                           .Get()) {}

  void Set(const CoordinatorStats& st, KvStore& kv) {
    runs_.Set(static_cast<double>(st.runs));
    streams_.Set(static_cast<double>(st.sessions));
    retained_.Set(static_cast<double>(st.retained_contents));
    usage_.Set(static_cast<double>(st.usage_bytes));
    // Scrapes may overlap: each adds what no other added yet.
    int64_t seen = waves_seen_.load();
    while (seen < st.repeat_waves && !waves_seen_.compare_exchange_weak(seen, st.repeat_waves)) {
    }
    if (seen < st.repeat_waves) waves_.Increment(static_cast<double>(st.repeat_waves - seen));
    batches_.SetTotal(static_cast<double>(st.manifest_batches));
    batch_repeats_.SetTotal(static_cast<double>(st.batch_repeats));
    kv_runs_.Set(kv.NumRuns());
    kv_keys_.Set(static_cast<double>(kv.NumKeys()));
  }

 private:
  Gauge& runs_;
  Gauge& kv_runs_;
  Gauge& kv_keys_;
  Gauge& streams_;
  Gauge& retained_;
  Gauge& usage_;
  Counter& waves_;
  std::atomic<int64_t> waves_seen_{0};
  Counter& batches_;
  Counter& batch_repeats_;
};

void PrintStats(const CoordinatorStats& stats) {
  std::printf(
      "accord-coordinator stats: decisions=%lld same_as_previous=%lld manifests=%lld "
      "cache_hits=%lld cache_misses=%lld errors=%lld repeat_waves=%lld batches=%lld "
      "batch_repeats=%lld\n",
      static_cast<long long>(stats.decisions), static_cast<long long>(stats.same_as_previous),
      static_cast<long long>(stats.manifests), static_cast<long long>(stats.cache_hits),
      static_cast<long long>(stats.cache_misses), static_cast<long long>(stats.errors),
      static_cast<long long>(stats.repeat_waves), static_cast<long long>(stats.manifest_batches),
      static_cast<long long>(stats.batch_repeats));
  std::fflush(stdout);
}

void ReportDeniedTokens(JobTokens* tokens, CoordinatorMetrics& metrics) {
  if (tokens == nullptr) return;
  tokens->SetDeniedCallback([&metrics](const std::string& job_id, const std::string& message) {
    ObserveEvent e;
    e.type = ObserveEvent::Type::kError;
    e.job_id = job_id;
    e.kind = v1::PERMISSION_DENIED;
    e.message = message;
    metrics.OnEvent(e);
  });
}

// Everything after flag parsing: servers up, serve until a signal, stop.
int Serve(std::shared_ptr<grpc::ServerCredentials> creds, std::unique_ptr<JobTokens> tokens,
          std::unique_ptr<EventLog> event_log) {
  MetricsRegistry registry;
  CoordinatorMetricsOptions metrics_options;
  metrics_options.param_skip_metrics = absl::GetFlag(FLAGS_param_skip_metrics);
  metrics_options.event_log = event_log.get();
  metrics_options.series_grace = absl::GetFlag(FLAGS_metrics_series_grace);
  CoordinatorMetrics metrics(&registry, metrics_options);
  ReportDeniedTokens(tokens.get(), metrics);
  KvOptions kv_options;
  kv_options.max_jobs = absl::GetFlag(FLAGS_max_jobs);
  // No key-value wait outlasts the deadline of a step (docs/ARCHITECTURE.md,
  // "Every wait names who is missing").
  kv_options.wait_bound = absl::GetFlag(FLAGS_deadline);
  KvStore kv(kv_options, RealClock::Get());
  Coordinator coordinator(CoordinatorOptionsFromFlags(&metrics, &kv), RealClock::Get());
  kv.SetRankDirectory(&coordinator);
  WriteQueueLimits queue_limits;
  queue_limits.low = static_cast<size_t>(absl::GetFlag(FLAGS_stream_queue_low_watermark));
  queue_limits.high = static_cast<size_t>(absl::GetFlag(FLAGS_stream_queue_high_watermark));
  CoordinatorGrpcService coordinator_service(&coordinator, tokens.get(), queue_limits);
  KeyValueGrpcService kv_service(&kv, tokens.get(), &coordinator);
  ObserveGrpcService observe_service(
      &coordinator, [&tokens](const std::string& job_id, const std::string& token) {
        if (tokens == nullptr) return absl::OkStatus();
        return job_id.empty() ? tokens->CheckAdmin(token, "observe request about every job")
                              : tokens->CheckJobRead(job_id, token, "observe request");
      });
  int port = 0;
  Started main_server =
      StartServer(creds, {&coordinator_service, &kv_service, &observe_service}, port);
  if (main_server.server == nullptr) return main_server.exit_code;
  const std::string listen = absl::GetFlag(FLAGS_listen);
  const std::string host = listen.substr(0, listen.rfind(':'));
  grpc::CallbackGenericService unimplemented;
  Started health = StartHealthServer(host, &unimplemented);
  if (health.exit_code != 0) return health.exit_code;
  BoundsGauges bounds(registry);
  MetricsHttpServer metrics_server([&] {
    metrics.Refresh(coordinator);
    bounds.Set(coordinator.stats(), kv);
    return registry.Render();
  });
  if (absl::Status s = StartMetricsEndpoint(
          metrics_server, "accord-coordinator",
          MetricsFlags{absl::GetFlag(FLAGS_metrics_port), absl::GetFlag(FLAGS_metrics_host)});
      !s.ok()) {
    ACCORD_LOG(ERROR) << s.message();
    return 1;
  }
  std::printf("accord-coordinator listening on %s:%d\n", host.c_str(), port);
  std::fflush(stdout);

  const int sig = WaitForStopReloadingTokens(tokens.get());
  ACCORD_LOG(INFO) << "signal " << sig << ": stopping (finishing in-flight replies)";
  for (grpc::Server* srv : {main_server.server.get(), health.server.get()}) {
    if (srv == nullptr) continue;
    if (auto* health_service = srv->GetHealthCheckService(); health_service != nullptr) {
      health_service->SetServingStatus(false);
    }
  }
  coordinator_service.FinishAll();
  kv.Stop();
  main_server.server->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  if (health.server != nullptr) health.server->Shutdown(absl::ToChronoTime(absl::Now()));
  coordinator.Stop();
  metrics_server.Stop();
  PrintStats(coordinator.stats());
  ACCORD_LOG(INFO) << "stopped";
  return 0;
}

int Main(int argc, char** argv) {
  ConfigureLockChecks();
  ParseCoordinatorFlags(argc, argv);
  BlockTerminationSignals();
  if (absl::Status s = ApplyLogLevel(absl::GetFlag(FLAGS_log_level)); !s.ok()) {
    ACCORD_LOG(ERROR) << s.message();
    return 2;
  }
  if (const int threads = absl::GetFlag(FLAGS_decide_threads); threads < 0 || threads > 256) {
    ACCORD_LOG(ERROR) << "--decide_threads=" << threads
                      << " must be between 0 (one per hardware thread, at most 8) and 256";
    return 2;
  }
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> creds =
      ServerCredentials(ServerTlsFromFlags());
  absl::StatusOr<std::unique_ptr<JobTokens>> tokens =
      creds.ok() ? LoadTokensFile(absl::GetFlag(FLAGS_tokens_file))
                 : absl::StatusOr<std::unique_ptr<JobTokens>>(creds.status());
  absl::StatusOr<std::unique_ptr<EventLog>> event_log =
      tokens.ok() ? OpenEventLog() : absl::StatusOr<std::unique_ptr<EventLog>>(tokens.status());
  if (!event_log.ok()) {
    ACCORD_LOG(ERROR) << event_log.status().message();
    return 2;
  }
  return Serve(*std::move(creds), *std::move(tokens), *std::move(event_log));
}

}  // namespace
}  // namespace accord::daemon

int main(int argc, char** argv) { return accord::daemon::Main(argc, argv); }
