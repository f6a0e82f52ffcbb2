// accord-relay: one tier between the sidecars of a rack and the coordinator
// (docs/ARCHITECTURE.md, "Relays"). Sidecars connect to it exactly as to a
// coordinator (--coordinator=<relay>); it merges their node manifests per
// (group, step) into one upstream manifest and fans decisions back out.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "core/lock_checks.h"
#include "core/log.h"
#include "daemon/common/auth_tokens.h"
#include "daemon/common/flags_env.h"
#include "daemon/common/metrics_flags.h"
#include "daemon/common/server_credentials.h"
#include "daemon/common/signals.h"
#include "daemon/common/token_flags.h"
#include "daemon/common/upstream_channel.h"
#include "daemon/coordinator/grpc_coordinator_service.h"
#include "daemon/relay/metrics_relay.h"
#include "daemon/relay/relay.h"
#include "daemon/sidecar/grpc_sidecar.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "observe/http_server.h"
#include "observe/metrics.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:7071",
          "host:port the sidecars connect to (port 0: any free port, printed). A non-loopback "
          "address needs TLS (--tls_cert/--tls_key) or an explicit --plaintext");
ABSL_FLAG(std::string, coordinator, "localhost:7070",
          "coordinator (or upper relay) host:port. A non-loopback address needs TLS "
          "(--upstream_tls_ca) or an explicit --upstream_plaintext");
ABSL_FLAG(std::string, relay_id, "",
          "this relay's node id upstream (default: relay-<hostname>); one per relay");
ABSL_FLAG(std::string, token, "",
          "the job token sent upstream (prefer --token_file or ACCORD_TOKEN); default: the first "
          "sidecar's");
ABSL_FLAG(std::string, token_file, "", "file holding the job token; wins over --token");
ABSL_FLAG(std::string, tokens_file, "",
          "job tokens file (the coordinator's format): every sidecar's NodeHello must carry its "
          "job's token (PERMISSION_DENIED otherwise). Re-read on SIGHUP");
ABSL_FLAG(std::string, tls_cert, "", "server certificate (PEM) for the sidecars; with --tls_key");
ABSL_FLAG(std::string, tls_key, "", "server private key (PEM)");
ABSL_FLAG(std::string, tls_ca, "",
          "CA bundle (PEM) that signs the sidecars' client certificates (mutual TLS)");
ABSL_FLAG(bool, plaintext, false, "serve a non-loopback --listen without TLS");
ABSL_FLAG(std::string, upstream_tls_ca, "",
          "CA bundle (PEM) to verify the coordinator's certificate; enables TLS upstream");
ABSL_FLAG(std::string, upstream_tls_cert, "", "client certificate (PEM) for mutual TLS upstream");
ABSL_FLAG(std::string, upstream_tls_key, "", "client private key (PEM) for mutual TLS upstream");
ABSL_FLAG(bool, upstream_plaintext, false, "connect to a non-loopback --coordinator without TLS");
ABSL_FLAG(absl::Duration, node_reconnect_grace, absl::Seconds(10),
          "how long a sidecar whose stream ended keeps its place before its ranks are reported "
          "as left upstream; use the coordinator's value");
ABSL_FLAG(absl::Duration, upstream_loss_limit, absl::Seconds(60),
          "while the relay serves a job, the coordinator may go unanswered this long; past it "
          "every sidecar of the job here gets one UNAVAILABLE error for its ranks, the words a "
          "sidecar uses for its own node above (0: wait for ever; docs/RELIABILITY.md, \"Node "
          "above lost\")");
ABSL_FLAG(absl::Duration, keepalive_time, absl::Seconds(10),
          "gRPC keepalive on both sides; use the coordinator's value");
ABSL_FLAG(absl::Duration, keepalive_timeout, absl::Seconds(10),
          "a keepalive ping not answered within this closes the connection");
ABSL_FLAG(absl::Duration, reconnect_max_backoff, absl::Seconds(5),
          "upper bound of the jittered exponential backoff between upstream reconnects");
ABSL_FLAG(absl::Duration, kv_slack, absl::Seconds(60),
          "how long a forwarded key-value request may take beyond its own wait");
ABSL_FLAG(int, max_ranks, 65536,
          "largest world size a sidecar's NodeHello may say (as the coordinator's --max_ranks)");
ABSL_FLAG(int, max_message_bytes, 4 << 20, "largest gRPC message received or sent");
ABSL_FLAG(int64_t, stream_queue_low_watermark, 1024,
          "messages queued for one sidecar stream past which it is logged as slow");
ABSL_FLAG(int64_t, stream_queue_high_watermark, 16384,
          "messages queued for one sidecar stream past which it is cut off");
ABSL_FLAG(std::string, log_level, "info", "debug, info, warning or error");
ABSL_FLAG(int, metrics_port, 9092,
          "serve Prometheus metrics (/metrics) and /healthz over HTTP on this port (0: any free "
          "port; -1: off)");
ABSL_FLAG(std::string, metrics_host, "0.0.0.0", "address the metrics endpoint binds");

namespace accord::daemon {
namespace {

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

// The upstream channel's flags (daemon/common/upstream_channel.h).
UpstreamFlags UpstreamFlagsFromFlags() {
  UpstreamFlags f;
  f.target = absl::GetFlag(FLAGS_coordinator);
  f.plaintext = absl::GetFlag(FLAGS_upstream_plaintext);
  f.tls_flag_prefix = "upstream_tls_";
  f.ca_path = absl::GetFlag(FLAGS_upstream_tls_ca);
  f.cert_path = absl::GetFlag(FLAGS_upstream_tls_cert);
  f.key_path = absl::GetFlag(FLAGS_upstream_tls_key);
  f.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  f.keepalive_time = absl::GetFlag(FLAGS_keepalive_time);
  f.keepalive_timeout = absl::GetFlag(FLAGS_keepalive_timeout);
  f.reconnect_max_backoff = absl::GetFlag(FLAGS_reconnect_max_backoff);
  return f;
}

RelayOptions RelayOptionsFromFlags(const std::string& token) {
  RelayOptions options;
  options.relay_id = absl::GetFlag(FLAGS_relay_id);
  if (options.relay_id.empty()) {
    char host[256] = {};
    gethostname(host, sizeof(host) - 1);
    options.relay_id = absl::StrCat("relay-", host);
  }
  options.token = token;
  options.node_reconnect_grace = absl::GetFlag(FLAGS_node_reconnect_grace);
  options.max_world_size = absl::GetFlag(FLAGS_max_ranks);
  options.upstream_loss_limit = absl::GetFlag(FLAGS_upstream_loss_limit);
  return options;
}

// The sidecars' server on --listen (null when it cannot listen); its port
// in `port`. It keeps alive as the upstream does (the keepalive flags were
// checked with the upstream channel).
std::unique_ptr<grpc::Server> StartServer(const std::shared_ptr<grpc::ServerCredentials>& creds,
                                          const std::vector<grpc::Service*>& services, int* port) {
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  builder.AddListeningPort(absl::GetFlag(FLAGS_listen), creds, port);
  builder.SetMaxReceiveMessageSize(absl::GetFlag(FLAGS_max_message_bytes));
  builder.SetMaxSendMessageSize(absl::GetFlag(FLAGS_max_message_bytes));
  if (absl::Status s = AddServerKeepalive(builder, absl::GetFlag(FLAGS_keepalive_time),
                                          absl::GetFlag(FLAGS_keepalive_timeout));
      !s.ok()) {
    ACCORD_LOG(ERROR) << s.message();
    return nullptr;
  }
  for (grpc::Service* service : services) builder.RegisterService(service);
  return builder.BuildAndStart();
}

void PrintStats(const RelayStats& stats) {
  std::printf(
      "accord-relay stats: manifests_in=%lld up_full=%lld up_repeat=%lld up_batch_repeats=%lld "
      "batches=%lld\n",
      static_cast<long long>(stats.node_manifests_in),
      static_cast<long long>(stats.manifests_up_full),
      static_cast<long long>(stats.manifests_up_repeat),
      static_cast<long long>(stats.batch_repeats_up),
      static_cast<long long>(stats.decision_batches));
  std::fflush(stdout);
}

// The error of a negative --upstream_loss_limit; OK otherwise.
absl::Status LossLimitFlagError() {
  if (absl::GetFlag(FLAGS_upstream_loss_limit) >= absl::ZeroDuration()) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("--upstream_loss_limit must not be negative (got ",
                   absl::FormatDuration(absl::GetFlag(FLAGS_upstream_loss_limit)), ")"));
}

WriteQueueLimits QueueLimitsFromFlags() {
  WriteQueueLimits limits;
  limits.low = static_cast<size_t>(absl::GetFlag(FLAGS_stream_queue_low_watermark));
  limits.high = static_cast<size_t>(absl::GetFlag(FLAGS_stream_queue_high_watermark));
  return limits;
}

int Main(int argc, char** argv) {
  ConfigureLockChecks();
  ParseFlagsWithEnv(argc, argv, __FILE__,
                    "relays the node streams of many sidecars (a rack) to the coordinator as one "
                    "node: one merged manifest per group and step upstream, decisions fanned "
                    "back out. Sidecars point --coordinator at it.\nEvery flag --name may also "
                    "be set as the environment variable ACCORD_<NAME> (the command line wins).");
  BlockTerminationSignals();
  const absl::Status log_level = ApplyLogLevel(absl::GetFlag(FLAGS_log_level));
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> server_creds =
      ServerCredentials(ServerTlsFromFlags());
  absl::StatusOr<std::shared_ptr<grpc::Channel>> channel =
      UpstreamChannel(UpstreamFlagsFromFlags());
  absl::StatusOr<std::string> token =
      JobTokenFrom(absl::GetFlag(FLAGS_token_file), absl::GetFlag(FLAGS_token));
  absl::StatusOr<std::unique_ptr<JobTokens>> loaded =
      LoadTokensFile(absl::GetFlag(FLAGS_tokens_file));
  for (const absl::Status& s : {log_level, server_creds.status(), channel.status(), token.status(),
                                loaded.status(), LossLimitFlagError()}) {
    if (!s.ok()) {
      ACCORD_LOG(ERROR) << s.message();
      return 2;
    }
  }
  std::unique_ptr<JobTokens> tokens = *std::move(loaded);
  RelayOptions relay_options = RelayOptionsFromFlags(*token);
  // One view of whether the coordinator answers, for the relay's jobs and its
  // key-value forwarder (a call made after the loss ends with its words).
  UpstreamHealth upstream_health(relay_options.upstream_loss_limit);
  relay_options.upstream_health = &upstream_health;
  Relay relay(std::move(relay_options));
  GrpcUpstream upstream(*channel, &relay, absl::GetFlag(FLAGS_reconnect_max_backoff));
  relay.SetUpstream(&upstream);
  CoordinatorGrpcService node_service(&relay, tokens.get(), QueueLimitsFromFlags());
  // Key-value requests pass through unchanged (the sidecar stamped them).
  KeyValueForwarder kv_service(*channel, /*only_job=*/"", /*token=*/"",
                               absl::GetFlag(FLAGS_kv_slack));
  kv_service.SetHealth(&upstream_health);
  kv_service.SetRunOf([&relay](const std::string& job_id) { return relay.CurrentRun(job_id); });

  const std::string listen = absl::GetFlag(FLAGS_listen);
  int port = 0;
  std::unique_ptr<grpc::Server> server =
      StartServer(*server_creds, {&node_service, &kv_service}, &port);
  if (server == nullptr || port == 0) {
    ACCORD_LOG(ERROR) << "cannot listen on " << listen
                      << " (--listen); is the port in use or the address not local?";
    return 1;
  }
  MetricsRegistry registry;
  RelayMetrics metrics(&registry);
  MetricsHttpServer metrics_server([&] {
    metrics.Refresh(relay.stats());
    return registry.Render();
  });
  if (absl::Status s = StartMetricsEndpoint(
          metrics_server, "accord-relay",
          MetricsFlags{absl::GetFlag(FLAGS_metrics_port), absl::GetFlag(FLAGS_metrics_host)});
      !s.ok()) {
    ACCORD_LOG(ERROR) << s.message();
    return 1;
  }
  upstream.Start();
  const std::string host = listen.substr(0, listen.rfind(':'));
  std::printf("accord-relay listening on %s:%d\n", host.c_str(), port);
  std::fflush(stdout);

  ACCORD_LOG(INFO) << "signal " << WaitForStopReloadingTokens(tokens.get()) << ": stopping";
  node_service.FinishAll();
  kv_service.Stop();  // forwarded key-value calls must not hold the stop
  server->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  relay.Stop();  // its timer sends upstream
  upstream.Stop();
  metrics_server.Stop();
  PrintStats(relay.stats());
  return 0;
}

}  // namespace
}  // namespace accord::daemon

int main(int argc, char** argv) { return accord::daemon::Main(argc, argv); }
