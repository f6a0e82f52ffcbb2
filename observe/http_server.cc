#include "observe/http_server.h"

#include <civetweb.h>

#include <cstdio>
#include <cstring>
#include <mutex>

#include "absl/strings/str_cat.h"

namespace accord {
namespace {

int HandleMetrics(mg_connection* conn, void* cbdata) {
  const auto* server = static_cast<const MetricsHttpServer*>(cbdata);
  const std::string body = server->RenderMetrics();
  mg_printf(conn,
            "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n"
            "Content-Length: %zu\r\nConnection: close\r\n\r\n",
            body.size());
  mg_write(conn, body.data(), body.size());
  return 200;
}

int HandleHealth(mg_connection* conn, void*) {
  static constexpr char kBody[] = "ok\n";
  mg_printf(conn,
            "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %zu\r\n"
            "Connection: close\r\n\r\n%s",
            std::strlen(kBody), kBody);
  return 200;
}

int LogMessageQuietly(const mg_connection*, const char*) { return 1; }

}  // namespace

MetricsHttpServer::MetricsHttpServer(std::function<std::string()> render)
    : render_(std::move(render)) {}

MetricsHttpServer::~MetricsHttpServer() { Stop(); }

absl::StatusOr<int> MetricsHttpServer::Start(const std::string& address) {
  static std::once_flag init;
  std::call_once(init, [] { mg_init_library(0); });
  // civetweb takes "host:port"; an IPv4 wildcard is written as a bare port.
  std::string ports = address;
  if (ports.rfind("0.0.0.0:", 0) == 0) ports = ports.substr(8);
  const char* options[] = {"listening_ports",    ports.c_str(), "num_threads", "2",
                           "request_timeout_ms", "10000",       nullptr};
  mg_callbacks callbacks;
  std::memset(&callbacks, 0, sizeof callbacks);
  callbacks.log_message = LogMessageQuietly;
  ctx_ = mg_start(&callbacks, nullptr, options);
  if (ctx_ == nullptr) {
    return absl::UnavailableError(absl::StrCat("cannot serve metrics on ", address,
                                               ": the port is taken or the address is invalid"));
  }
  mg_set_request_handler(ctx_, "/metrics", HandleMetrics, this);
  mg_set_request_handler(ctx_, "/healthz", HandleHealth, nullptr);
  mg_server_port server_ports[4];
  const int n = mg_get_server_ports(ctx_, 4, server_ports);
  port_ = n > 0 ? server_ports[0].port : 0;
  return port_;
}

absl::StatusOr<int> MetricsHttpServer::StartForDaemon(const std::string& daemon,
                                                      const std::string& host, int port) {
  absl::StatusOr<int> bound = Start(absl::StrCat(host, ":", port));
  if (!bound.ok()) {
    return absl::UnavailableError(
        absl::StrCat(daemon, ": cannot serve metrics on ", host, ":", port,
                     " (--metrics_host/--metrics_port): ", bound.status().message(),
                     ". Pick a free port, 0 for any free port, or -1 to turn "
                     "metrics off"));
  }
  const std::string shown = (host == "0.0.0.0" || host.empty()) ? "127.0.0.1"
                            : host == "::" || host == "[::]"    ? "[::1]"
                                                                : host;
  std::printf("%s metrics on http://%s:%d/metrics\n", daemon.c_str(), shown.c_str(), *bound);
  std::fflush(stdout);
  return bound;
}

void MetricsHttpServer::Stop() {
  if (ctx_ != nullptr) {
    mg_stop(ctx_);
    ctx_ = nullptr;
  }
}

}  // namespace accord
