// The channel a sidecar or a relay dials upstream (the coordinator, or the
// relay above a sidecar), built from the flags both daemons share: TLS files
// under the plaintext rule (daemon/common/tls.h), message size, keepalive
// matched with the coordinator's (docs/ARCHITECTURE.md, "Liveness"; pings
// continue on an idle stream) and gRPC's own reconnect backoff kept within
// ours (its default grows to 120 s), so a restarted coordinator is found
// again quickly.
#ifndef ACCORD_DAEMON_COMMON_UPSTREAM_CHANNEL_H_
#define ACCORD_DAEMON_COMMON_UPSTREAM_CHANNEL_H_

#include <memory>
#include <string>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"

namespace accord::daemon {

struct UpstreamFlags {
  std::string target;      // --coordinator
  bool plaintext = false;  // --plaintext (sidecar) / --upstream_plaintext (relay)
  // The TLS files and the prefix of their flags, for messages: "tls_" for
  // the sidecar's --tls_ca/--tls_cert/--tls_key, "upstream_tls_" for the
  // relay's.
  std::string tls_flag_prefix = "tls_";
  std::string ca_path;
  std::string cert_path;
  std::string key_path;
  int max_message_bytes = 4 << 20;
  absl::Duration keepalive_time = absl::Seconds(10);
  absl::Duration keepalive_timeout = absl::Seconds(10);
  absl::Duration reconnect_max_backoff = absl::Seconds(5);
};

// INVALID_ARGUMENT or FAILED_PRECONDITION naming the flag at fault (a
// keepalive out of range, half a client key pair, plaintext to a remote
// target), NOT_FOUND for an unreadable file.
absl::StatusOr<std::shared_ptr<grpc::Channel>> UpstreamChannel(const UpstreamFlags& flags);

// Keepalive time and timeout in milliseconds; INVALID_ARGUMENT unless both
// are between 1 ms and INT32_MAX ms (AddServerKeepalive serves with them).
absl::StatusOr<std::pair<int, int>> KeepaliveMillis(absl::Duration time, absl::Duration timeout);

}  // namespace accord::daemon

#endif  // ACCORD_DAEMON_COMMON_UPSTREAM_CHANNEL_H_
