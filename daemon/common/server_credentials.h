// What a daemon that serves TCP (the coordinator, the relay) sets on its
// server from its flags: credentials from --tls_cert/--tls_key/--tls_ca and
// --plaintext under the plaintext rule (tls.h), and keepalive matched with
// the nodes that dial it (docs/ARCHITECTURE.md, "Liveness"). Only main files
// read the flags; they fill ServerTlsFlags.
#ifndef ACCORD_DAEMON_COMMON_SERVER_CREDENTIALS_H_
#define ACCORD_DAEMON_COMMON_SERVER_CREDENTIALS_H_

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"

namespace accord::daemon {

struct ServerTlsFlags {
  std::string listen;      // --listen
  bool plaintext = false;  // --plaintext
  std::string cert_path;   // --tls_cert
  std::string key_path;    // --tls_key
  std::string ca_path;     // --tls_ca: require and verify client certificates
};

// TLS when any --tls_* is given, else insecure credentials. Logs a warning
// for --plaintext and for TLS without --tls_ca. FAILED_PRECONDITION under the
// plaintext rule, INVALID_ARGUMENT for half a key pair, NOT_FOUND for an
// unreadable file, each naming the flag.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentials(
    const ServerTlsFlags& flags);

// Keepalive on served connections: ping every `time`, close after `timeout`
// unanswered, and accept the clients' own pings as often as every `time` / 2.
// INVALID_ARGUMENT naming --keepalive_time/--keepalive_timeout out of range.
absl::Status AddServerKeepalive(grpc::ServerBuilder& builder, absl::Duration time,
                                absl::Duration timeout);

}  // namespace accord::daemon

#endif  // ACCORD_DAEMON_COMMON_SERVER_CREDENTIALS_H_
