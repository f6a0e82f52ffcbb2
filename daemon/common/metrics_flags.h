// The daemons' --metrics_port/--metrics_host: the Prometheus endpoint each
// daemon serves (observe/http_server.h). Only main files read the flags.
#ifndef ACCORD_DAEMON_COMMON_METRICS_FLAGS_H_
#define ACCORD_DAEMON_COMMON_METRICS_FLAGS_H_

#include <string>

#include "absl/status/status.h"
#include "observe/http_server.h"

namespace accord::daemon {

struct MetricsFlags {
  int port = -1;     // --metrics_port: 0 any free port, -1 off
  std::string host;  // --metrics_host
};

// Starts `server` on the flags' host and port and prints its URL under
// `daemon`'s name; OK without starting it when the port is -1 (off).
// UNAVAILABLE naming the flags when the port is taken.
absl::Status StartMetricsEndpoint(MetricsHttpServer& server, const std::string& daemon,
                                  const MetricsFlags& flags);

}  // namespace accord::daemon

#endif  // ACCORD_DAEMON_COMMON_METRICS_FLAGS_H_
