// accord-coordinator: decides, per group and step, what every rank of a job
// packs for its reduce-scatter; also serves the job's key-value rendezvous.
#include <cstdio>
#include <memory>
#include <string>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "core/log.h"
#include "daemon/common/clock.h"
#include "daemon/common/flags_env.h"
#include "daemon/common/signals.h"
#include "daemon/common/tls.h"
#include "daemon/coordinator/coordinator.h"
#include "daemon/coordinator/grpc_coordinator_service.h"
#include "daemon/coordinator/kv_store.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"

ABSL_FLAG(std::string, listen, "0.0.0.0:7070",
          "host:port to serve CoordinatorService, KeyValueService and gRPC health on (port 0: "
          "any free port; the bound address is printed on stdout)");
ABSL_FLAG(absl::Duration, deadline, absl::Seconds(60),
          "a (group, step) that has not heard from every rank this long after its first "
          "manifest fails the job with MISSING_RANKS, naming the ranks and their last steps");
ABSL_FLAG(int, metrics_port, 0, "Prometheus metrics port (reserved; 0 = off)");
ABSL_FLAG(int, max_message_bytes, 4 << 20, "largest gRPC message accepted or sent");
ABSL_FLAG(int, max_jobs, 1024, "jobs served at once");
ABSL_FLAG(int, max_groups_per_job, 16384, "registered groups per job");
ABSL_FLAG(int64_t, max_params_per_group, 1 << 20, "parameters per group");
ABSL_FLAG(int, max_pending_steps, 64, "steps of one group waiting for ranks at once");
ABSL_FLAG(std::string, event_log, "", "structured event log path (reserved)");
ABSL_FLAG(std::string, tls_cert, "", "server certificate (PEM); with --tls_key enables TLS");
ABSL_FLAG(std::string, tls_key, "", "server private key (PEM)");
ABSL_FLAG(std::string, tls_ca, "",
          "CA bundle (PEM) to verify sidecar client certificates (mutual TLS when set)");
ABSL_FLAG(bool, plaintext, true,
          "allow serving without TLS when no --tls_cert is given (set false to require TLS)");
ABSL_FLAG(std::string, tokens_file, "",
          "job tokens file (reserved; TODO(security): tokens are not checked yet)");

namespace accord::daemon {
namespace {

int Main(int argc, char** argv) {
  ParseFlagsWithEnv(argc, argv,
                    {"listen", "deadline", "metrics_port", "max_message_bytes", "max_jobs",
                     "max_groups_per_job", "max_params_per_group", "max_pending_steps", "event_log",
                     "tls_cert", "tls_key", "tls_ca", "plaintext", "tokens_file"},
                    "agrees, per group and step, on the reduce-scatter "
                    "layout and dtype of every rank of a job.\nEvery flag --name may also be "
                    "set as the environment variable ACCORD_<NAME>.");
  BlockTerminationSignals();

  std::shared_ptr<grpc::ServerCredentials> creds;
  if (!absl::GetFlag(FLAGS_tls_cert).empty()) {
    absl::StatusOr<std::string> cert = ReadPemFile(absl::GetFlag(FLAGS_tls_cert), "tls_cert");
    absl::StatusOr<std::string> key = ReadPemFile(absl::GetFlag(FLAGS_tls_key), "tls_key");
    if (!cert.ok() || !key.ok()) {
      ACCORD_LOG(ERROR) << (cert.ok() ? key.status() : cert.status()).ToString();
      return 2;
    }
    grpc::SslServerCredentialsOptions ssl(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
    ssl.pem_key_cert_pairs.push_back({*key, *cert});
    if (!absl::GetFlag(FLAGS_tls_ca).empty()) {
      absl::StatusOr<std::string> ca = ReadPemFile(absl::GetFlag(FLAGS_tls_ca), "tls_ca");
      if (!ca.ok()) {
        ACCORD_LOG(ERROR) << ca.status().ToString();
        return 2;
      }
      ssl.pem_root_certs = *ca;
      ssl.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
    }
    creds = grpc::SslServerCredentials(ssl);
  } else if (absl::GetFlag(FLAGS_plaintext)) {
    ACCORD_LOG(WARNING) << "serving without TLS (no --tls_cert); use only on a trusted network";
    creds = grpc::InsecureServerCredentials();
  } else {
    ACCORD_LOG(ERROR) << "--plaintext=false but no --tls_cert/--tls_key given";
    return 2;
  }
  if (!absl::GetFlag(FLAGS_tokens_file).empty()) {
    ACCORD_LOG(WARNING) << "--tokens_file is not enforced yet (TODO(security))";
  }

  CoordinatorOptions options;
  options.deadline = absl::GetFlag(FLAGS_deadline);
  options.max_jobs = absl::GetFlag(FLAGS_max_jobs);
  options.max_groups_per_job = absl::GetFlag(FLAGS_max_groups_per_job);
  options.max_params_per_group = absl::GetFlag(FLAGS_max_params_per_group);
  options.max_pending_steps = absl::GetFlag(FLAGS_max_pending_steps);
  Coordinator coordinator(options, RealClock::Get());
  KvOptions kv_options;
  kv_options.max_jobs = options.max_jobs;
  KvStore kv(kv_options, RealClock::Get());
  CoordinatorGrpcService coordinator_service(&coordinator);
  KeyValueGrpcService kv_service(&kv);

  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  const std::string listen = absl::GetFlag(FLAGS_listen);
  int port = 0;
  builder.AddListeningPort(listen, creds, &port);
  builder.SetMaxReceiveMessageSize(absl::GetFlag(FLAGS_max_message_bytes));
  builder.SetMaxSendMessageSize(absl::GetFlag(FLAGS_max_message_bytes));
  builder.RegisterService(&coordinator_service);
  builder.RegisterService(&kv_service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    ACCORD_LOG(ERROR) << "cannot listen on " << listen
                      << " (--listen); is the port in use or the address not local?";
    return 1;
  }
  const std::string host = listen.substr(0, listen.rfind(':'));
  std::printf("accord-coordinator listening on %s:%d\n", host.c_str(), port);
  std::fflush(stdout);

  const int sig = WaitForTerminationSignal();
  ACCORD_LOG(INFO) << "signal " << sig << ": stopping (finishing in-flight replies)";
  if (auto* health = server->GetHealthCheckService(); health != nullptr) {
    health->SetServingStatus(false);
  }
  coordinator_service.FinishAll();
  kv.Stop();
  server->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  coordinator.Stop();
  ACCORD_LOG(INFO) << "stopped";
  return 0;
}

}  // namespace
}  // namespace accord::daemon

int main(int argc, char** argv) { return accord::daemon::Main(argc, argv); }
