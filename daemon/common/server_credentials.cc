#include "daemon/common/server_credentials.h"

#include <utility>

#include "core/log.h"
#include "daemon/common/tls.h"
#include "daemon/common/upstream_channel.h"

namespace accord::daemon {

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentials(
    const ServerTlsFlags& flags) {
  const bool tls = !flags.cert_path.empty() || !flags.key_path.empty() || !flags.ca_path.empty();
  if (absl::Status s = CheckServerPlaintext(flags.listen, flags.plaintext, tls); !s.ok()) {
    return s;
  }
  if (!tls) {
    if (flags.plaintext) {
      ACCORD_LOG(WARNING) << "serving without TLS (--plaintext): job tokens and manifests cross "
                             "the network in clear text; use only on a trusted network";
    }
    return grpc::InsecureServerCredentials();
  }
  if (flags.cert_path.empty() || flags.key_path.empty()) {
    return absl::InvalidArgumentError(
        "TLS needs both --tls_cert and --tls_key (--tls_ca alone only says which client "
        "certificates to accept)");
  }
  absl::StatusOr<std::string> cert = ReadPemFile(flags.cert_path, "tls_cert");
  if (!cert.ok()) return cert.status();
  absl::StatusOr<std::string> key = ReadPemFile(flags.key_path, "tls_key");
  if (!key.ok()) return key.status();
  grpc::SslServerCredentialsOptions ssl(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  ssl.pem_key_cert_pairs.push_back({*key, *cert});
  if (!flags.ca_path.empty()) {
    absl::StatusOr<std::string> ca = ReadPemFile(flags.ca_path, "tls_ca");
    if (!ca.ok()) return ca.status();
    ssl.pem_root_certs = *ca;
    ssl.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  } else {
    ACCORD_LOG(WARNING) << "TLS without --tls_ca: any client may connect (no client "
                           "certificates); rely on --tokens_file to tell jobs apart";
  }
  return grpc::SslServerCredentials(ssl);
}

absl::Status AddServerKeepalive(grpc::ServerBuilder& builder, absl::Duration time,
                                absl::Duration timeout) {
  absl::StatusOr<std::pair<int, int>> ms = KeepaliveMillis(time, timeout);
  if (!ms.ok()) return ms.status();
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, ms->first);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, ms->second);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  // Clients ping on their own --keepalive_time; gRPC's default would answer
  // pings more often than every 5 minutes with GOAWAY (too_many_pings).
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, ms->first / 2);
  return absl::OkStatus();
}

}  // namespace accord::daemon
