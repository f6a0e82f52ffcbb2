// accord-sidecar: serves the local ranks of a node over a Unix socket, merges
// their manifests and keeps one stream to the coordinator.
#include <grp.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>

#include "absl/flags/flag.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "core/log.h"
#include "daemon/common/flags_env.h"
#include "daemon/common/signals.h"
#include "daemon/common/tls.h"
#include "daemon/sidecar/grpc_sidecar.h"
#include "daemon/sidecar/metrics_sidecar.h"
#include "daemon/sidecar/sidecar.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "observe/http_server.h"
#include "observe/metrics.h"

ABSL_FLAG(int64_t, stream_queue_low_watermark, 1024,
          "messages queued for one stream's reader past which it is logged as slow");
ABSL_FLAG(int64_t, stream_queue_high_watermark, 16384,
          "messages queued for one stream's reader past which it is cut off "
          "(RESOURCE_EXHAUSTED) instead of growing memory");
ABSL_FLAG(std::string, coordinator, "localhost:7070",
          "coordinator host:port. A non-loopback address needs TLS (--tls_ca) or an explicit "
          "--plaintext");
ABSL_FLAG(std::string, socket, "/run/accord/sidecar.sock",
          "Unix socket the ranks connect to (parent directory created, stale socket removed); "
          "created with mode 0660, so only the sidecar's user and group may connect");
ABSL_FLAG(std::string, socket_group, "",
          "group to own the socket (name or number), so ranks running as another user in that "
          "group may connect; empty: the sidecar's own group");
ABSL_FLAG(std::string, node_id, "", "this node's id (default: the hostname)");
ABSL_FLAG(std::string, job, "", "accept only ranks of this job (default: any, one at a time)");
ABSL_FLAG(std::string, token, "",
          "the job's token, sent to the coordinator (prefer --token_file or ACCORD_TOKEN: a "
          "flag is visible in the process list)");
ABSL_FLAG(std::string, token_file, "",
          "file holding the job's token (surrounding whitespace ignored); wins over --token");
ABSL_FLAG(bool, require_rank_token, false,
          "refuse ranks whose RankHello carries no token (a rank with a different token is "
          "always refused)");
ABSL_FLAG(int, max_ranks, 64, "ranks served at once; one more is refused with LIMIT_EXCEEDED");
ABSL_FLAG(int, metrics_port, 9091,
          "serve Prometheus metrics (/metrics) and /healthz over HTTP on this port (0: any free "
          "port; -1: off). The URL is printed on stdout");
ABSL_FLAG(std::string, metrics_host, "0.0.0.0", "address the metrics endpoint binds");
ABSL_FLAG(std::string, tls_ca, "",
          "CA bundle (PEM) to verify the coordinator's certificate; enables TLS");
ABSL_FLAG(std::string, tls_cert, "",
          "client certificate (PEM) for mutual TLS (needed when the coordinator has --tls_ca)");
ABSL_FLAG(std::string, tls_key, "", "client private key (PEM) for mutual TLS");
ABSL_FLAG(bool, plaintext, false,
          "connect to a non-loopback --coordinator without TLS (the job token and manifests in "
          "clear text). Without TLS flags, plaintext is allowed implicitly only on loopback");
ABSL_FLAG(absl::Duration, deadline, absl::Seconds(60),
          "how long a key-value request forwarded to the coordinator may take beyond its own "
          "wait; the per-step deadline itself is the coordinator's --deadline");
ABSL_FLAG(absl::Duration, keepalive_time, absl::Seconds(10),
          "ping the coordinator connection this often (gRPC keepalive); a coordinator gone "
          "without closing the connection is noticed, and reconnected to, within "
          "--keepalive_time + --keepalive_timeout. Use the coordinator's values");
ABSL_FLAG(absl::Duration, keepalive_timeout, absl::Seconds(10),
          "a keepalive ping not answered within this closes the connection");
ABSL_FLAG(int, max_message_bytes, 4 << 20,
          "largest gRPC message received or sent, on the rank socket and to the coordinator");
ABSL_FLAG(std::string, log_level, "info", "debug, info, warning or error (debug = info for now)");
ABSL_FLAG(absl::Duration, reconnect_max_backoff, absl::Seconds(5),
          "upper bound of the exponential backoff between coordinator reconnects");
ABSL_FLAG(bool, local_decisions, true,
          "when every rank of the job is on this node, decide complete steps here and answer "
          "the ranks at once; the coordinator still gets every manifest and must decide the "
          "same (docs/ARCHITECTURE.md, \"Local decisions\")");
ABSL_FLAG(int, local_decision_lag, 4,
          "locally decided steps per group that may wait for the coordinator's confirming "
          "decision; past it ranks wait for the coordinator");

namespace accord::daemon {
namespace {

// Channel credentials from the --tls_* / --plaintext flags and the plaintext
// rule (daemon/common/tls.h).
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentials() {
  const std::string ca_path = absl::GetFlag(FLAGS_tls_ca);
  const std::string cert_path = absl::GetFlag(FLAGS_tls_cert);
  const std::string key_path = absl::GetFlag(FLAGS_tls_key);
  const bool tls = !ca_path.empty() || !cert_path.empty() || !key_path.empty();
  if (absl::Status s = CheckClientPlaintext(absl::GetFlag(FLAGS_coordinator),
                                            absl::GetFlag(FLAGS_plaintext), tls);
      !s.ok()) {
    return s;
  }
  if (!tls) return grpc::InsecureChannelCredentials();
  grpc::SslCredentialsOptions ssl;
  if (ca_path.empty()) {
    ACCORD_LOG(WARNING) << "TLS without --tls_ca: the coordinator is verified against the "
                           "system's CA store";
  } else {
    absl::StatusOr<std::string> ca = ReadPemFile(ca_path, "tls_ca");
    if (!ca.ok()) return ca.status();
    ssl.pem_root_certs = *ca;
  }
  if (cert_path.empty() != key_path.empty()) {
    return absl::InvalidArgumentError(
        "mutual TLS needs both --tls_cert and --tls_key (or neither)");
  }
  if (!cert_path.empty()) {
    absl::StatusOr<std::string> cert = ReadPemFile(cert_path, "tls_cert");
    if (!cert.ok()) return cert.status();
    absl::StatusOr<std::string> key = ReadPemFile(key_path, "tls_key");
    if (!key.ok()) return key.status();
    ssl.pem_cert_chain = *cert;
    ssl.pem_private_key = *key;
  }
  return grpc::SslCredentials(ssl);
}

// The job token from --token_file (whitespace trimmed), else --token /
// ACCORD_TOKEN.
absl::StatusOr<std::string> JobToken() {
  if (const std::string path = absl::GetFlag(FLAGS_token_file); !path.empty()) {
    absl::StatusOr<std::string> text = ReadPemFile(path, "token_file");
    if (!text.ok()) return text.status();
    std::string token(absl::StripAsciiWhitespace(*text));
    if (token.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("--token_file=", path, " is empty"));
    }
    return token;
  }
  return absl::GetFlag(FLAGS_token);
}

int Main(int argc, char** argv) {
  ParseFlagsWithEnv(
      argc, argv,
      {"coordinator",
       "socket",
       "socket_group",
       "node_id",
       "job",
       "token",
       "token_file",
       "require_rank_token",
       "max_ranks",
       "metrics_port",
       "metrics_host",
       "tls_ca",
       "tls_cert",
       "tls_key",
       "plaintext",
       "deadline",
       "max_message_bytes",
       "log_level",
       "reconnect_max_backoff",
       "keepalive_time",
       "keepalive_timeout"},
      "serves the local ranks of a node over a Unix socket and speaks for them to the "
      "coordinator.\n\nWith only --coordinator=localhost:PORT it connects in plaintext "
      "(loopback only). A remote coordinator needs --tls_ca (plus --tls_cert/--tls_key for "
      "mutual TLS) or an explicit --plaintext. The rank socket is created with mode 0660 "
      "(--socket_group).\nEvery flag --name may also be set as the environment variable "
      "ACCORD_<NAME> (the command line wins).");
  BlockTerminationSignals();
  if (absl::Status s = ApplyLogLevel(absl::GetFlag(FLAGS_log_level)); !s.ok()) {
    ACCORD_LOG(ERROR) << s.message();
    return 2;
  }
  std::string node_id = absl::GetFlag(FLAGS_node_id);
  if (node_id.empty()) {
    char host[256] = {};
    gethostname(host, sizeof(host) - 1);
    node_id = host;
  }
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> creds = ChannelCredentials();
  if (!creds.ok()) {
    ACCORD_LOG(ERROR) << creds.status().message();
    return 2;
  }
  absl::StatusOr<std::string> token = JobToken();
  if (!token.ok()) {
    ACCORD_LOG(ERROR) << token.status().message();
    return 2;
  }
  const int max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH, max_message_bytes);
  args.SetInt(GRPC_ARG_MAX_SEND_MESSAGE_LENGTH, max_message_bytes);
  // Liveness (docs/ARCHITECTURE.md, "Liveness"): matched with the
  // coordinator's --keepalive_time/--keepalive_timeout; pings continue on an
  // idle stream (no limit on pings without data).
  const int64_t keepalive_ms = absl::ToInt64Milliseconds(absl::GetFlag(FLAGS_keepalive_time));
  const int64_t keepalive_timeout_ms =
      absl::ToInt64Milliseconds(absl::GetFlag(FLAGS_keepalive_timeout));
  if (keepalive_ms < 1 || keepalive_timeout_ms < 1 || keepalive_ms > INT32_MAX ||
      keepalive_timeout_ms > INT32_MAX) {
    ACCORD_LOG(ERROR) << "--keepalive_time and --keepalive_timeout must be between 1ms and "
                         "about 24 days";
    return 2;
  }
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, static_cast<int>(keepalive_ms));
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, static_cast<int>(keepalive_timeout_ms));
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  // gRPC's own reconnect backoff grows to 120 s by default; keep it within
  // ours so a restarted coordinator is found again quickly.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(
      GRPC_ARG_MAX_RECONNECT_BACKOFF_MS,
      static_cast<int>(absl::ToInt64Milliseconds(absl::GetFlag(FLAGS_reconnect_max_backoff))));
  std::shared_ptr<grpc::Channel> channel =
      grpc::CreateCustomChannel(absl::GetFlag(FLAGS_coordinator), *creds, args);

  SidecarOptions options;
  options.node_id = node_id;
  options.job = absl::GetFlag(FLAGS_job);
  options.max_ranks = absl::GetFlag(FLAGS_max_ranks);
  options.token = *token;
  options.require_rank_token = absl::GetFlag(FLAGS_require_rank_token);
  options.local_decisions = absl::GetFlag(FLAGS_local_decisions);
  options.local_decision_lag = absl::GetFlag(FLAGS_local_decision_lag);
  if (options.local_decision_lag < 1) {
    ACCORD_LOG(ERROR) << "--local_decision_lag must be at least 1 (got "
                      << options.local_decision_lag << ")";
    return 2;
  }
  Sidecar sidecar(options);
  GrpcUpstream upstream(channel, &sidecar, absl::GetFlag(FLAGS_reconnect_max_backoff));
  sidecar.SetUpstream(&upstream);
  WriteQueueLimits queue_limits;
  queue_limits.low = static_cast<size_t>(absl::GetFlag(FLAGS_stream_queue_low_watermark));
  queue_limits.high = static_cast<size_t>(absl::GetFlag(FLAGS_stream_queue_high_watermark));
  RankGrpcService rank_service(&sidecar, queue_limits);
  KeyValueForwarder kv_service(channel, options.job, options.token, absl::GetFlag(FLAGS_deadline));
  kv_service.SetSidecar(&sidecar);

  const std::string path = absl::GetFlag(FLAGS_socket);
  std::error_code ec;
  std::filesystem::path parent = std::filesystem::path(path).parent_path();
  if (!parent.empty()) std::filesystem::create_directories(parent, ec);
  if (ec) {
    ACCORD_LOG(ERROR) << "cannot create " << parent << " for --socket: " << ec.message();
    return 1;
  }
  // Resolve --socket_group before creating anything.
  gid_t socket_gid = static_cast<gid_t>(-1);
  if (const std::string group = absl::GetFlag(FLAGS_socket_group); !group.empty()) {
    int numeric = 0;
    if (struct group* g = ::getgrnam(group.c_str()); g != nullptr) {
      socket_gid = g->gr_gid;
    } else if (absl::SimpleAtoi(group, &numeric) && numeric >= 0) {
      socket_gid = static_cast<gid_t>(numeric);
    } else {
      ACCORD_LOG(ERROR) << "--socket_group=" << group << ": no such group on this machine";
      return 1;
    }
  }
  if (::unlink(path.c_str()) == 0) {
    ACCORD_LOG(INFO) << "removed stale socket " << path;
  }

  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  builder.AddListeningPort("unix:" + path, grpc::InsecureServerCredentials());
  builder.SetMaxReceiveMessageSize(max_message_bytes);
  builder.SetMaxSendMessageSize(max_message_bytes);
  builder.RegisterService(&rank_service);
  builder.RegisterService(&kv_service);
  // The socket is created by bind() inside BuildAndStart: with umask 0117 it
  // is born 0660, so there is no moment at which others may connect.
  const mode_t old_umask = ::umask(0117);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ::umask(old_umask);
  if (server == nullptr) {
    ACCORD_LOG(ERROR) << "cannot serve on unix:" << path << " (--socket); check the directory's "
                      << "permissions";
    return 1;
  }
  if (::chmod(path.c_str(), 0660) != 0) {
    ACCORD_LOG(ERROR) << "chmod 0660 " << path << ": " << std::strerror(errno);
    return 1;
  }
  if (socket_gid != static_cast<gid_t>(-1) &&
      ::chown(path.c_str(), static_cast<uid_t>(-1), socket_gid) != 0) {
    ACCORD_LOG(ERROR) << "cannot give " << path << " to group " << absl::GetFlag(FLAGS_socket_group)
                      << " (--socket_group): " << std::strerror(errno)
                      << "; the sidecar must be a member of that group (or root)";
    return 1;
  }
  MetricsRegistry registry;
  SidecarMetrics metrics(&registry);
  MetricsHttpServer metrics_server([&] {
    metrics.Refresh(sidecar.stats());
    return registry.Render();
  });
  if (const int metrics_port = absl::GetFlag(FLAGS_metrics_port); metrics_port >= 0) {
    absl::StatusOr<int> bound = metrics_server.StartForDaemon(
        "accord-sidecar", absl::GetFlag(FLAGS_metrics_host), metrics_port);
    if (!bound.ok()) {
      ACCORD_LOG(ERROR) << bound.status().message();
      return 1;
    }
  }
  upstream.Start();
  std::printf("accord-sidecar serving unix:%s\n", path.c_str());
  std::fflush(stdout);

  const int sig = WaitForTerminationSignal();
  ACCORD_LOG(INFO) << "signal " << sig << ": stopping";
  rank_service.FinishAll();
  server->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  sidecar.Stop();  // its timer sends upstream
  upstream.Stop();
  metrics_server.Stop();
  ::unlink(path.c_str());
  return 0;
}

}  // namespace
}  // namespace accord::daemon

int main(int argc, char** argv) { return accord::daemon::Main(argc, argv); }
