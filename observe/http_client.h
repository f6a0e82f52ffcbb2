// A minimal HTTP/1.1 GET over TCP, for what reads the daemons' /metrics and
// Prometheus' query API from inside this project (the demo's summary, tests).
// Not a general client: no TLS, no redirects, no chunked decoding (civetweb
// and Prometheus answer "Connection: close" requests with a plain body).
#ifndef ACCORD_OBSERVE_HTTP_CLIENT_H_
#define ACCORD_OBSERVE_HTTP_CLIENT_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace accord {

struct HttpResponse {
  int status = 0;       // e.g. 200
  std::string headers;  // the status line and header lines, as received
  std::string body;
};

// GET http://host:port/path, where host is an IPv4 address. Errors: the
// address does not parse, the connection or a read fails or passes
// `timeout`, or the answer is not HTTP.
absl::StatusOr<HttpResponse> HttpGet(const std::string& host, int port, const std::string& path,
                                     absl::Duration timeout = absl::Seconds(10));

}  // namespace accord

#endif  // ACCORD_OBSERVE_HTTP_CLIENT_H_
