// Reading the TLS files named by the daemons' --tls_* flags.
#ifndef ACCORD_DAEMON_COMMON_TLS_H_
#define ACCORD_DAEMON_COMMON_TLS_H_

#include <string>

#include "absl/status/statusor.h"

namespace accord::daemon {

// The whole file; NOT_FOUND naming the flag and path when unreadable.
absl::StatusOr<std::string> ReadPemFile(const std::string& path, const std::string& flag);

}  // namespace accord::daemon

#endif  // ACCORD_DAEMON_COMMON_TLS_H_
