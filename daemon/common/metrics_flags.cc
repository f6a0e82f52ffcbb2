#include "daemon/common/metrics_flags.h"

namespace accord::daemon {

absl::Status StartMetricsEndpoint(MetricsHttpServer& server, const std::string& daemon,
                                  const MetricsFlags& flags) {
  if (flags.port < 0) return absl::OkStatus();
  return server.StartForDaemon(daemon, flags.host, flags.port).status();
}

}  // namespace accord::daemon
