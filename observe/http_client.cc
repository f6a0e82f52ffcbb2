#include "observe/http_client.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace accord {

absl::StatusOr<HttpResponse> HttpGet(const std::string& host, int port, const std::string& path,
                                     absl::Duration timeout) {
  const std::string where = absl::StrCat("http://", host, ":", port, path);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (port <= 0 || port > 65535 || inet_pton(AF_INET, host.c_str(), &addr.sin_addr) != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("GET ", where, ": needs an IPv4 address and a port in 1..65535"));
  }
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0)
    return absl::InternalError(absl::StrCat("GET ", where, ": socket: ", strerror(errno)));
  const timeval tv = absl::ToTimeval(timeout);
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  if (::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof addr) != 0) {
    const int err = errno;
    ::close(fd);
    return absl::UnavailableError(absl::StrCat("GET ", where, ": connect: ", strerror(err)));
  }
  const std::string req =
      absl::StrCat("GET ", path, " HTTP/1.1\r\nHost: ", host, "\r\nConnection: close\r\n\r\n");
  for (size_t off = 0; off < req.size();) {
    const ssize_t w = ::write(fd, req.data() + off, req.size() - off);
    if (w <= 0) {
      const int err = errno;
      ::close(fd);
      return absl::UnavailableError(absl::StrCat("GET ", where, ": write: ", strerror(err)));
    }
    off += static_cast<size_t>(w);
  }
  std::string resp;
  char buf[8192];
  ssize_t n;
  while ((n = ::read(fd, buf, sizeof buf)) > 0) resp.append(buf, static_cast<size_t>(n));
  const int read_err = n < 0 ? errno : 0;
  ::close(fd);
  if (read_err != 0) {
    return absl::UnavailableError(absl::StrCat("GET ", where, ": read: ", strerror(read_err)));
  }
  const size_t end = resp.find("\r\n\r\n");
  int status = 0;
  // "HTTP/1.x NNN reason"
  if (end == std::string::npos || resp.compare(0, 5, "HTTP/") != 0 || resp.size() < 12 ||
      !absl::SimpleAtoi(resp.substr(9, 3), &status)) {
    return absl::DataLossError(
        absl::StrCat("GET ", where, ": not an HTTP response (", resp.size(), " bytes)"));
  }
  HttpResponse r;
  r.status = status;
  r.headers = resp.substr(0, end);
  r.body = resp.substr(end + 4);
  return r;
}

}  // namespace accord
