// accord-sidecar: serves the local ranks of a node over a Unix socket, merges
// their manifests and keeps one stream to the coordinator per job it serves
// (several jobs at once, docs/ARCHITECTURE.md, "Jobs on one sidecar").
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
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "core/lock_checks.h"
#include "core/log.h"
#include "daemon/common/flags_env.h"
#include "daemon/common/metrics_flags.h"
#include "daemon/common/signals.h"
#include "daemon/common/token_flags.h"
#include "daemon/common/upstream_channel.h"
#include "daemon/sidecar/grpc_sidecar.h"
#include "daemon/sidecar/metrics_sidecar.h"
#include "daemon/sidecar/sidecar.h"
#include "daemon/sidecar/sidecar_jobs.h"
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
ABSL_FLAG(std::string, job, "",
          "accept only ranks of this job (default: any; several jobs at once, each with its own "
          "stream to the coordinator)");
ABSL_FLAG(absl::Duration, job_handover_timeout, absl::Seconds(10),
          "a rank that starts a new launch of a job id this node serves (a restart, or the next "
          "run under the same id) waits until the previous launch's ranks here have left, at "
          "most this long; then it is refused. Its hello is answered as soon as they have left");
ABSL_FLAG(std::string, token, "",
          "the job's token, sent to the coordinator (prefer --token_file or ACCORD_TOKEN: a "
          "flag is visible in the process list)");
ABSL_FLAG(std::string, token_file, "",
          "file holding the job's token (surrounding whitespace ignored); wins over --token");
ABSL_FLAG(bool, require_rank_token, false,
          "refuse ranks whose RankHello carries no token (a rank with a different token is "
          "always refused)");
ABSL_FLAG(int, max_ranks, 64,
          "ranks served at once, over every job; one more is refused with LIMIT_EXCEEDED");
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
ABSL_FLAG(absl::Duration, rank_reconnect_grace, absl::ZeroDuration(),
          "a rank whose stream ends, and whose client reconnects, keeps its place this long "
          "before it counts as gone: a dropped stream is survived, a killed rank is named this "
          "much later (0: at once; docs/RELIABILITY.md, \"Sidecar restart\")");
ABSL_FLAG(absl::Duration, upstream_loss_limit, absl::Seconds(60),
          "while this node serves a job, the coordinator (or relay) above may go unanswered "
          "this long; past it every rank of the job here gets one UNAVAILABLE error instead of "
          "waiting for its own timeout (0: wait for ever; docs/RELIABILITY.md, \"Node above "
          "lost\")");
ABSL_FLAG(int, local_decision_lag, 4,
          "locally decided steps per group that may wait for the coordinator's confirming "
          "decision; past it ranks wait for the coordinator");

namespace accord::daemon {
namespace {

// The upstream channel's flags: --tls_* here are client credentials
// (daemon/common/upstream_channel.h).
UpstreamFlags UpstreamFlagsFromFlags() {
  UpstreamFlags f;
  f.target = absl::GetFlag(FLAGS_coordinator);
  f.plaintext = absl::GetFlag(FLAGS_plaintext);
  f.tls_flag_prefix = "tls_";
  f.ca_path = absl::GetFlag(FLAGS_tls_ca);
  f.cert_path = absl::GetFlag(FLAGS_tls_cert);
  f.key_path = absl::GetFlag(FLAGS_tls_key);
  f.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  f.keepalive_time = absl::GetFlag(FLAGS_keepalive_time);
  f.keepalive_timeout = absl::GetFlag(FLAGS_keepalive_timeout);
  f.reconnect_max_backoff = absl::GetFlag(FLAGS_reconnect_max_backoff);
  return f;
}

absl::StatusOr<SidecarOptions> OptionsFromFlags(std::string token) {
  SidecarOptions options;
  options.node_id = absl::GetFlag(FLAGS_node_id);
  if (options.node_id.empty()) {
    char host[256] = {};
    gethostname(host, sizeof(host) - 1);
    options.node_id = host;
  }
  options.job = absl::GetFlag(FLAGS_job);
  options.max_ranks = absl::GetFlag(FLAGS_max_ranks);
  options.token = std::move(token);
  options.require_rank_token = absl::GetFlag(FLAGS_require_rank_token);
  options.local_decisions = absl::GetFlag(FLAGS_local_decisions);
  options.local_decision_lag = absl::GetFlag(FLAGS_local_decision_lag);
  options.rank_reconnect_grace = absl::GetFlag(FLAGS_rank_reconnect_grace);
  options.upstream_loss_limit = absl::GetFlag(FLAGS_upstream_loss_limit);
  if (options.upstream_loss_limit < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--upstream_loss_limit must not be negative (got ",
                     absl::FormatDuration(options.upstream_loss_limit), ")"));
  }
  if (options.local_decision_lag < 1) {
    return absl::InvalidArgumentError(absl::StrCat("--local_decision_lag must be at least 1 (got ",
                                                   options.local_decision_lag, ")"));
  }
  return options;
}

// --socket_group as a group id (-1: not set), resolved before anything is
// created.
absl::StatusOr<gid_t> SocketGroup() {
  const std::string group = absl::GetFlag(FLAGS_socket_group);
  if (group.empty()) return static_cast<gid_t>(-1);
  if (struct group* g = ::getgrnam(group.c_str()); g != nullptr) return g->gr_gid;
  int numeric = 0;
  if (absl::SimpleAtoi(group, &numeric) && numeric >= 0) return static_cast<gid_t>(numeric);
  return absl::NotFoundError(
      absl::StrCat("--socket_group=", group, ": no such group on this machine"));
}

// Serves `services` on the Unix socket `path`, mode 0660 from its creation
// and owned by `gid` when set.
absl::StatusOr<std::unique_ptr<grpc::Server>> ServeRanks(const std::string& path, gid_t gid,
                                                         std::vector<grpc::Service*> services) {
  std::error_code ec;
  const std::filesystem::path parent = std::filesystem::path(path).parent_path();
  if (!parent.empty()) std::filesystem::create_directories(parent, ec);
  if (ec) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot create ", parent.string(), " for --socket: ", ec.message()));
  }
  if (::unlink(path.c_str()) == 0) {
    ACCORD_LOG(INFO) << "removed stale socket " << path;
  }
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  builder.AddListeningPort("unix:" + path, grpc::InsecureServerCredentials());
  builder.SetMaxReceiveMessageSize(absl::GetFlag(FLAGS_max_message_bytes));
  builder.SetMaxSendMessageSize(absl::GetFlag(FLAGS_max_message_bytes));
  for (grpc::Service* service : services) builder.RegisterService(service);
  // The socket is created by bind() inside BuildAndStart: with umask 0117 it
  // is born 0660, so there is no moment at which others may connect.
  const mode_t old_umask = ::umask(0117);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ::umask(old_umask);
  if (server == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "cannot serve on unix:", path, " (--socket); check the directory's permissions"));
  }
  if (::chmod(path.c_str(), 0660) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("chmod 0660 ", path, ": ", std::strerror(errno)));
  }
  if (gid != static_cast<gid_t>(-1) && ::chown(path.c_str(), static_cast<uid_t>(-1), gid) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot give ", path, " to group ", absl::GetFlag(FLAGS_socket_group),
                     " (--socket_group): ", std::strerror(errno),
                     "; the sidecar must be a member of that group (or root)"));
  }
  return server;
}

// Configuration errors exit with 2, failures to serve with 1.
int Fail(int code, const absl::Status& status) {
  ACCORD_LOG(ERROR) << status.message();
  return code;
}

int Main(int argc, char** argv) {
  ConfigureLockChecks();
  ParseFlagsWithEnv(
      argc, argv, __FILE__,
      "serves the local ranks of a node over a Unix socket and speaks for them to the "
      "coordinator.\n\nWith only --coordinator=localhost:PORT it connects in plaintext "
      "(loopback only). A remote coordinator needs --tls_ca (plus --tls_cert/--tls_key for "
      "mutual TLS) or an explicit --plaintext. The rank socket is created with mode 0660 "
      "(--socket_group).\nEvery flag --name may also be set as the environment variable "
      "ACCORD_<NAME> (the command line wins).");
  BlockTerminationSignals();
  if (absl::Status s = ApplyLogLevel(absl::GetFlag(FLAGS_log_level)); !s.ok()) return Fail(2, s);
  absl::StatusOr<std::shared_ptr<grpc::Channel>> channel =
      UpstreamChannel(UpstreamFlagsFromFlags());
  if (!channel.ok()) return Fail(2, channel.status());
  absl::StatusOr<std::string> token =
      JobTokenFrom(absl::GetFlag(FLAGS_token_file), absl::GetFlag(FLAGS_token));
  if (!token.ok()) return Fail(2, token.status());
  absl::StatusOr<SidecarOptions> options = OptionsFromFlags(*std::move(token));
  if (!options.ok()) return Fail(2, options.status());
  absl::StatusOr<gid_t> gid = SocketGroup();
  if (!gid.ok()) return Fail(1, gid.status());

  UpstreamHealth upstream_health(options->upstream_loss_limit);
  options->upstream_health = &upstream_health;
  SidecarJobsOptions jobs_options;
  jobs_options.sidecar = *options;
  jobs_options.handover_timeout = absl::GetFlag(FLAGS_job_handover_timeout);
  if (jobs_options.handover_timeout < absl::ZeroDuration()) {
    return Fail(2, absl::InvalidArgumentError("--job_handover_timeout must not be negative"));
  }
  const absl::Duration max_backoff = absl::GetFlag(FLAGS_reconnect_max_backoff);
  // Each job's Sidecar gets its own stream to the coordinator.
  SidecarJobs jobs(jobs_options, [channel = *channel, max_backoff](Sidecar* job) {
    auto upstream = std::make_unique<GrpcUpstream>(channel, job, max_backoff);
    job->SetUpstream(upstream.get());
    upstream->Start();
    return std::unique_ptr<UpstreamSink>(std::move(upstream));
  });
  WriteQueueLimits queue_limits;
  queue_limits.low = static_cast<size_t>(absl::GetFlag(FLAGS_stream_queue_low_watermark));
  queue_limits.high = static_cast<size_t>(absl::GetFlag(FLAGS_stream_queue_high_watermark));
  RankGrpcService rank_service(&jobs, queue_limits);
  KeyValueForwarder kv_service(*channel, options->job, options->token,
                               absl::GetFlag(FLAGS_deadline));
  kv_service.SetJobs(&jobs);
  kv_service.SetHealth(&upstream_health);
  const std::string path = absl::GetFlag(FLAGS_socket);
  absl::StatusOr<std::unique_ptr<grpc::Server>> server =
      ServeRanks(path, *gid, {&rank_service, &kv_service});
  if (!server.ok()) return Fail(1, server.status());

  MetricsRegistry registry;
  SidecarMetrics metrics(&registry);
  MetricsHttpServer metrics_server([&] {
    metrics.Refresh(jobs.stats());
    return registry.Render();
  });
  if (absl::Status s = StartMetricsEndpoint(
          metrics_server, "accord-sidecar",
          MetricsFlags{absl::GetFlag(FLAGS_metrics_port), absl::GetFlag(FLAGS_metrics_host)});
      !s.ok()) {
    return Fail(1, s);
  }
  std::printf("accord-sidecar serving unix:%s\n", path.c_str());
  std::fflush(stdout);

  const int sig = WaitForTerminationSignal();
  ACCORD_LOG(INFO) << "signal " << sig << ": stopping";
  rank_service.FinishAll();
  kv_service.Stop();  // forwarded key-value calls must not hold the stop
  (*server)->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  jobs.Stop();  // each job's timer, then its stream
  metrics_server.Stop();
  ::unlink(path.c_str());
  return 0;
}

}  // namespace
}  // namespace accord::daemon

int main(int argc, char** argv) { return accord::daemon::Main(argc, argv); }
