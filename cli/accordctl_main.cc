// accordctl: asks the coordinator's observe API who skipped what, who is
// connected, and which groups are waiting.
//
//   accordctl [--coordinator=HOST:PORT] [--json] status [--job=J]
//   accordctl skips --job=J [--group=G] [--window=N] [--full]
//   accordctl stalls [--job=J]
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "accord/v1/observe.grpc.pb.h"
#include "cli/format.h"
#include "grpcpp/grpcpp.h"

ABSL_FLAG(std::string, coordinator, "localhost:7070",
          "The coordinator's gRPC address (HOST:PORT). Env: ACCORD_COORDINATOR.");
ABSL_FLAG(std::string, job, "", "Job id (status/stalls: all jobs when empty; skips: required).");
ABSL_FLAG(std::string, group, "", "skips: one group (all groups of the job when empty).");
ABSL_FLAG(int64_t, window, 0,
          "skips: only the last N decided steps (0: all the coordinator kept).");
ABSL_FLAG(bool, json, false, "Print the response as JSON (for scripts) instead of tables.");
ABSL_FLAG(bool, full, false, "skips: print the whole matrix even when it is large.");
ABSL_FLAG(int, top, 10, "skips: how many parameters and ranks a summary lists.");
ABSL_FLAG(std::string, token, "",
          "The job's token, when the coordinator requires one. Env: ACCORD_TOKEN.");
ABSL_FLAG(std::string, tls_ca, "",
          "CA certificate (PEM) to verify the coordinator; empty: plaintext.");
ABSL_FLAG(std::string, tls_cert, "", "Client certificate (PEM) for mutual TLS.");
ABSL_FLAG(std::string, tls_key, "", "Client private key (PEM) for mutual TLS.");
ABSL_FLAG(int, timeout_ms, 10000, "RPC deadline in milliseconds.");

namespace {

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string EnvOr(const char* name, const std::string& flag_value, const std::string& dflt) {
  if (flag_value != dflt) return flag_value;
  const char* env = std::getenv(name);
  return env != nullptr ? std::string(env) : flag_value;
}

int Fail(const grpc::Status& s, const std::string& address) {
  std::fprintf(stderr, "accordctl: %s failed: %s (%d)%s\n", address.c_str(),
               s.error_message().c_str(), static_cast<int>(s.error_code()),
               s.error_code() == grpc::StatusCode::UNAVAILABLE
                   ? "; is the coordinator running there? check --coordinator"
                   : "");
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "accordctl: inspect an accord coordinator.\n"
      "  accordctl [flags] status            jobs, nodes, ranks and groups\n"
      "  accordctl [flags] skips --job=J     parameter x rank skip matrix\n"
      "  accordctl [flags] stalls            groups waiting and who they wait for\n");
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  if (args.size() != 2) {
    std::fprintf(stderr, "%s", absl::ProgramUsageMessage().data());
    std::fprintf(stderr, "accordctl: expected exactly one command (status, skips, stalls)\n");
    return 2;
  }
  const std::string command = args[1];
  const std::string address =
      EnvOr("ACCORD_COORDINATOR", absl::GetFlag(FLAGS_coordinator), "localhost:7070");
  const std::string token = EnvOr("ACCORD_TOKEN", absl::GetFlag(FLAGS_token), "");

  std::shared_ptr<grpc::ChannelCredentials> creds;
  if (!absl::GetFlag(FLAGS_tls_ca).empty()) {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = ReadFile(absl::GetFlag(FLAGS_tls_ca));
    if (!absl::GetFlag(FLAGS_tls_cert).empty()) {
      ssl.pem_cert_chain = ReadFile(absl::GetFlag(FLAGS_tls_cert));
      ssl.pem_private_key = ReadFile(absl::GetFlag(FLAGS_tls_key));
    }
    creds = grpc::SslCredentials(ssl);
  } else {
    creds = grpc::InsecureChannelCredentials();
  }
  auto stub = accord::v1::ObserveService::NewStub(grpc::CreateChannel(address, creds));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() +
                   std::chrono::milliseconds(absl::GetFlag(FLAGS_timeout_ms)));
  const bool json = absl::GetFlag(FLAGS_json);

  if (command == "status") {
    accord::v1::StatusRequest req;
    req.set_job_id(absl::GetFlag(FLAGS_job));
    req.set_token(token);
    accord::v1::StatusResponse resp;
    grpc::Status s = stub->Status(&ctx, req, &resp);
    if (!s.ok()) return Fail(s, address);
    std::cout << (json ? accord::cli::ToJson(resp) : accord::cli::FormatStatus(resp));
    return 0;
  }
  if (command == "skips") {
    if (absl::GetFlag(FLAGS_job).empty()) {
      std::fprintf(stderr, "accordctl: skips needs --job=JOB (see accordctl status)\n");
      return 2;
    }
    accord::v1::SkipMatrixRequest req;
    req.set_job_id(absl::GetFlag(FLAGS_job));
    req.set_group_id(absl::GetFlag(FLAGS_group));
    req.set_window_steps(absl::GetFlag(FLAGS_window));
    req.set_token(token);
    accord::v1::SkipMatrixResponse resp;
    grpc::Status s = stub->SkipMatrix(&ctx, req, &resp);
    if (!s.ok()) return Fail(s, address);
    accord::cli::SkipFormatOptions options;
    options.full = absl::GetFlag(FLAGS_full);
    options.top = absl::GetFlag(FLAGS_top);
    std::cout << (json ? accord::cli::ToJson(resp) : accord::cli::FormatSkips(resp, options));
    return 0;
  }
  if (command == "stalls") {
    accord::v1::StallsRequest req;
    req.set_job_id(absl::GetFlag(FLAGS_job));
    req.set_token(token);
    accord::v1::StallsResponse resp;
    grpc::Status s = stub->Stalls(&ctx, req, &resp);
    if (!s.ok()) return Fail(s, address);
    std::cout << (json ? accord::cli::ToJson(resp) : accord::cli::FormatStalls(resp));
    return 0;
  }
  std::fprintf(stderr, "accordctl: unknown command \"%s\" (expected status, skips or stalls)\n",
               command.c_str());
  return 2;
}
