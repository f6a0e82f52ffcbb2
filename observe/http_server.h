// Serves /metrics (Prometheus text exposition) and /healthz over HTTP with
// civetweb. Owns civetweb's worker threads: they start in Start() and stop in
// Stop() or the destructor.
#ifndef ACCORD_OBSERVE_HTTP_SERVER_H_
#define ACCORD_OBSERVE_HTTP_SERVER_H_

#include <functional>
#include <string>

#include "absl/status/statusor.h"
#include "observe/metrics.h"

struct mg_context;

namespace accord {

class MetricsHttpServer {
 public:
  // `render` produces the /metrics body on each scrape (usually
  // registry.Render(), possibly refreshing gauges first).
  explicit MetricsHttpServer(std::function<std::string()> render);
  ~MetricsHttpServer();
  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;

  // Listens on `address` ("0.0.0.0:9090", "127.0.0.1:0" for an ephemeral
  // port). Returns the bound port. UNAVAILABLE when the port is taken.
  absl::StatusOr<int> Start(const std::string& address);
  // For a daemon's --metrics_host/--metrics_port (port 0: ephemeral): starts
  // on host:port and prints "<daemon> metrics on http://HOST:PORT/metrics" on
  // stdout (127.0.0.1 for a wildcard host). UNAVAILABLE naming the flags when
  // the port is taken.
  absl::StatusOr<int> StartForDaemon(const std::string& daemon, const std::string& host, int port);
  void Stop();
  int port() const { return port_; }

  // Called by civetweb's threads; public for the C callback only.
  std::string RenderMetrics() const { return render_(); }

 private:
  std::function<std::string()> render_;
  mg_context* ctx_ = nullptr;
  int port_ = 0;
};

}  // namespace accord

#endif  // ACCORD_OBSERVE_HTTP_SERVER_H_
