// Transport security helpers for the daemons' --tls_* and --plaintext flags.
//
// The plaintext rule: TLS is used whenever TLS flags are given. Without them,
// plaintext is allowed implicitly only on loopback (a coordinator listening on
// 127.0.0.0/8, ::1 or localhost; a sidecar dialling such an address), so
// `accord-coordinator` and `accord-sidecar` start on a laptop with no flags.
// Anything reachable from the network without TLS needs --plaintext, and
// --plaintext together with TLS flags is refused as contradictory.
#ifndef ACCORD_DAEMON_COMMON_TLS_H_
#define ACCORD_DAEMON_COMMON_TLS_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace accord::daemon {

// The whole file; NOT_FOUND naming the flag and path when unreadable.
absl::StatusOr<std::string> ReadPemFile(const std::string& path, const std::string& flag);

// True for a gRPC target or listen address that only this machine can reach:
// unix: sockets, localhost, 127.0.0.0/8 and [::1] (with or without a port or
// an ipv4:/ipv6:/dns:/// scheme).
bool IsLoopbackAddress(absl::string_view address);

// Server side: OK to serve `listen` without TLS? FAILED_PRECONDITION naming
// the flags otherwise.
absl::Status CheckServerPlaintext(absl::string_view listen, bool plaintext_flag,
                                  bool tls_flags_given);
// Client side: OK to dial `target` without TLS? The messages name the
// daemon's flags: `tls_flag_prefix` "tls_" (the sidecar's --tls_ca and
// --plaintext) or "upstream_tls_" (the relay's --upstream_tls_ca and
// --upstream_plaintext).
absl::Status CheckClientPlaintext(absl::string_view target, bool plaintext_flag,
                                  bool tls_flags_given, absl::string_view tls_flag_prefix = "tls_");

}  // namespace accord::daemon

#endif  // ACCORD_DAEMON_COMMON_TLS_H_
