// accord-sidecar: serves the local ranks of a node over a Unix socket, merges
// their manifests and keeps one stream to the coordinator.
#include <grp.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>

#include "absl/flags/flag.h"
#include "absl/time/time.h"
#include "core/log.h"
#include "daemon/common/flags_env.h"
#include "daemon/common/signals.h"
#include "daemon/common/tls.h"
#include "daemon/sidecar/grpc_sidecar.h"
#include "daemon/sidecar/sidecar.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"

ABSL_FLAG(std::string, coordinator, "localhost:7070", "coordinator host:port");
ABSL_FLAG(std::string, socket, "/run/accord/sidecar.sock",
          "Unix socket the ranks connect to (parent directory created, stale socket removed, "
          "mode 0660)");
ABSL_FLAG(std::string, socket_group, "", "group to own the socket (optional)");
ABSL_FLAG(std::string, node_id, "", "this node's id (default: the hostname)");
ABSL_FLAG(std::string, job, "", "accept only ranks of this job (default: any, one at a time)");
ABSL_FLAG(std::string, tokens, "", "job token (reserved; TODO(security): not checked yet)");
ABSL_FLAG(std::string, token_file, "", "file holding the job token (reserved)");
ABSL_FLAG(int, max_ranks, 64, "ranks served at once");
ABSL_FLAG(int, metrics_port, 0, "Prometheus metrics port (reserved; 0 = off)");
ABSL_FLAG(std::string, tls_ca, "", "CA bundle (PEM) to verify the coordinator; enables TLS");
ABSL_FLAG(std::string, tls_cert, "", "client certificate (PEM) for mutual TLS");
ABSL_FLAG(std::string, tls_key, "", "client private key (PEM) for mutual TLS");
ABSL_FLAG(bool, plaintext, true, "allow a plaintext coordinator connection when no --tls_ca");
ABSL_FLAG(absl::Duration, reconnect_max_backoff, absl::Seconds(5),
          "upper bound of the exponential backoff between coordinator reconnects");

namespace accord::daemon {
namespace {

int Main(int argc, char** argv) {
  ParseFlagsWithEnv(argc, argv,
                    {"coordinator", "socket", "socket_group", "node_id", "job", "tokens",
                     "token_file", "max_ranks", "metrics_port", "tls_ca", "tls_cert", "tls_key",
                     "plaintext", "reconnect_max_backoff"},
                    "serves the local ranks of a node over a Unix socket and speaks for them to "
                    "the coordinator.\nEvery flag --name may also be set as the environment "
                    "variable ACCORD_<NAME>.");
  BlockTerminationSignals();
  std::string node_id = absl::GetFlag(FLAGS_node_id);
  if (node_id.empty()) {
    char host[256] = {};
    gethostname(host, sizeof(host) - 1);
    node_id = host;
  }

  std::shared_ptr<grpc::ChannelCredentials> creds;
  if (!absl::GetFlag(FLAGS_tls_ca).empty()) {
    grpc::SslCredentialsOptions ssl;
    absl::StatusOr<std::string> ca = ReadPemFile(absl::GetFlag(FLAGS_tls_ca), "tls_ca");
    if (!ca.ok()) {
      ACCORD_LOG(ERROR) << ca.status().ToString();
      return 2;
    }
    ssl.pem_root_certs = *ca;
    if (!absl::GetFlag(FLAGS_tls_cert).empty()) {
      absl::StatusOr<std::string> cert = ReadPemFile(absl::GetFlag(FLAGS_tls_cert), "tls_cert");
      absl::StatusOr<std::string> key = ReadPemFile(absl::GetFlag(FLAGS_tls_key), "tls_key");
      if (!cert.ok() || !key.ok()) {
        ACCORD_LOG(ERROR) << (cert.ok() ? key.status() : cert.status()).ToString();
        return 2;
      }
      ssl.pem_cert_chain = *cert;
      ssl.pem_private_key = *key;
    }
    creds = grpc::SslCredentials(ssl);
  } else if (absl::GetFlag(FLAGS_plaintext)) {
    creds = grpc::InsecureChannelCredentials();
  } else {
    ACCORD_LOG(ERROR) << "--plaintext=false but no --tls_ca given";
    return 2;
  }
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH, 64 << 20);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 10000);
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  std::shared_ptr<grpc::Channel> channel =
      grpc::CreateCustomChannel(absl::GetFlag(FLAGS_coordinator), creds, args);

  SidecarOptions options;
  options.node_id = node_id;
  options.job = absl::GetFlag(FLAGS_job);
  options.max_ranks = absl::GetFlag(FLAGS_max_ranks);
  Sidecar sidecar(options);
  GrpcUpstream upstream(channel, &sidecar, absl::GetFlag(FLAGS_reconnect_max_backoff));
  sidecar.SetUpstream(&upstream);
  RankGrpcService rank_service(&sidecar);
  KeyValueForwarder kv_service(channel, options.job);

  const std::string path = absl::GetFlag(FLAGS_socket);
  std::error_code ec;
  std::filesystem::path parent = std::filesystem::path(path).parent_path();
  if (!parent.empty()) std::filesystem::create_directories(parent, ec);
  if (ec) {
    ACCORD_LOG(ERROR) << "cannot create " << parent << " for --socket: " << ec.message();
    return 1;
  }
  if (::unlink(path.c_str()) == 0) {
    ACCORD_LOG(INFO) << "removed stale socket " << path;
  }

  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  builder.AddListeningPort("unix:" + path, grpc::InsecureServerCredentials());
  builder.RegisterService(&rank_service);
  builder.RegisterService(&kv_service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr) {
    ACCORD_LOG(ERROR) << "cannot serve on unix:" << path << " (--socket); check the directory's "
                      << "permissions";
    return 1;
  }
  if (::chmod(path.c_str(), 0660) != 0) {
    ACCORD_LOG(WARNING) << "chmod 0660 " << path << ": " << std::strerror(errno);
  }
  if (const std::string group = absl::GetFlag(FLAGS_socket_group); !group.empty()) {
    struct group* g = ::getgrnam(group.c_str());
    if (g == nullptr || ::chown(path.c_str(), static_cast<uid_t>(-1), g->gr_gid) != 0) {
      ACCORD_LOG(ERROR) << "cannot give " << path << " to group " << group
                        << " (--socket_group): " << std::strerror(errno);
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
  upstream.Stop();
  ::unlink(path.c_str());
  return 0;
}

}  // namespace
}  // namespace accord::daemon

int main(int argc, char** argv) { return accord::daemon::Main(argc, argv); }
