// A cuttable TCP proxy for fault tests: put between a sidecar (or a relay)
// and its upstream, it can cut every connection, drop what comes back, or
// go half-open. Shared by fault_test.cc and relay_fault_test.cc. The same
// over Unix sockets (UnixSockets): between a rank and its sidecar.
#ifndef ACCORD_TESTS_FAULT_CUTTABLE_PROXY_H_
#define ACCORD_TESTS_FAULT_CUTTABLE_PROXY_H_

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "core/sync.h"

namespace accord::testing {

// A TCP proxy between one sidecar and the coordinator that the test can cut
// (close every connection) or make drop what the coordinator sends. Owns
// one thread, stopped in the destructor.
class CuttableProxy {
 public:
  explicit CuttableProxy(std::string target_port) : target_port_(std::stoi(target_port)) {
    listen_fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    bind(listen_fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a));
    listen(listen_fd_, 16);
    socklen_t len = sizeof(a);
    getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&a), &len);
    port_ = ntohs(a.sin_port);
    (void)!pipe2(wake_, O_CLOEXEC);
    thread_ = std::thread([this] { Loop(); });
  }
  // Listens on the Unix socket `listen` and forwards to the one at `target`.
  struct UnixSockets {
    std::string listen;
    std::string target;
  };
  explicit CuttableProxy(UnixSockets paths) : target_port_(0), target_unix_(paths.target) {
    listen_fd_ = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un a = UnixAddress(paths.listen);
    unlink(paths.listen.c_str());
    bind(listen_fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a));
    listen(listen_fd_, 16);
    (void)!pipe2(wake_, O_CLOEXEC);
    thread_ = std::thread([this] { Loop(); });
  }
  ~CuttableProxy() {
    {
      accord::MutexLock l(&mu_);
      stop_ = true;
    }
    Wake();
    thread_.join();
    close(listen_fd_);
    close(wake_[0]);
    close(wake_[1]);
  }
  std::string address() const { return absl::StrCat("127.0.0.1:", port_); }
  // Drop (instead of forwarding) what the coordinator sends from now on.
  void DropDownstream(bool drop) {
    accord::MutexLock l(&mu_);
    drop_down_ = drop;
  }
  // Half-open: read nothing from either side (so nothing is forwarded, not
  // even a close or a keepalive ping) while every connection stays open.
  void Blackhole(bool on) {
    {
      accord::MutexLock l(&mu_);
      blackhole_ = on;
    }
    Wake();
  }
  // Half-open for the current connections only (read nothing from either
  // side, keep them open); connections accepted later are forwarded. Returns
  // once applied.
  void FreezeCurrent() {
    accord::MutexLock l(&mu_);
    const int64_t want = ++freeze_requested_;
    Wake();
    auto done = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return freeze_done_ >= want; };
    mu_.Await(absl::Condition(&done));
  }
  // Closes every current connection; returns once they are closed. New
  // connections are accepted and forwarded as before.
  int Cut() {
    accord::MutexLock l(&mu_);
    const int64_t want = ++cut_requested_;
    Wake();
    auto done = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return cut_done_ >= want; };
    mu_.Await(absl::Condition(&done));
    return last_cut_count_;
  }

 private:
  struct Conn {
    int down;  // the sidecar's side
    int up;    // the coordinator's side
    bool frozen = false;
  };
  void Wake() { (void)!write(wake_[1], "x", 1); }
  static sockaddr_un UnixAddress(const std::string& path) {
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    std::strncpy(a.sun_path, path.c_str(), sizeof(a.sun_path) - 1);
    return a;
  }
  // A connection to the target (-1 when it cannot be made).
  int ConnectUp() const {
    if (!target_unix_.empty()) {
      const int up = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
      sockaddr_un a = UnixAddress(target_unix_);
      if (connect(up, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0) return up;
      close(up);
      return -1;
    }
    const int up = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(static_cast<uint16_t>(target_port_));
    if (connect(up, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0) return up;
    close(up);
    return -1;
  }
  void CloseAll(std::vector<Conn>& conns) {
    for (Conn& c : conns) {
      close(c.down);
      close(c.up);
    }
    conns.clear();
  }
  void Loop() {
    std::vector<Conn> conns;
    char buf[16384];
    while (true) {
      {
        accord::MutexLock l(&mu_);
        if (stop_) break;
        if (cut_done_ < cut_requested_) {
          last_cut_count_ = static_cast<int>(conns.size());
          CloseAll(conns);
          cut_done_ = cut_requested_;
        }
        if (freeze_done_ < freeze_requested_) {
          for (Conn& c : conns) c.frozen = true;
          freeze_done_ = freeze_requested_;
        }
      }
      bool blackhole;
      {
        accord::MutexLock l(&mu_);
        blackhole = blackhole_;
      }
      std::vector<pollfd> fds = {{wake_[0], POLLIN, 0}, {listen_fd_, POLLIN, 0}};
      for (const Conn& c : conns) {
        // fd -1: poll ignores the entry (revents 0), so nothing is read.
        fds.push_back({blackhole || c.frozen ? -1 : c.down, POLLIN, 0});
        fds.push_back({blackhole || c.frozen ? -1 : c.up, POLLIN, 0});
      }
      if (poll(fds.data(), fds.size(), -1) < 0 && errno != EINTR) break;
      if (fds[0].revents) (void)!read(wake_[0], buf, sizeof(buf));
      // Only connections that were polled have an entry in fds; one accepted
      // below joins the next round.
      const size_t polled = conns.size();
      if (fds[1].revents & POLLIN) {
        const int down = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
        const int up = down >= 0 ? ConnectUp() : -1;
        if (up >= 0) {
          conns.push_back({down, up, false});
        } else if (down >= 0) {
          close(down);
        }
      }
      bool drop_down;
      {
        accord::MutexLock l(&mu_);
        drop_down = drop_down_;
      }
      std::vector<Conn> keep;
      for (size_t i = 0; i < conns.size(); ++i) {
        bool alive = true;
        for (int dir = 0; dir < 2 && alive && i < polled; ++dir) {
          const pollfd& p = fds[2 + 2 * i + dir];
          if (!(p.revents & (POLLIN | POLLHUP | POLLERR))) continue;
          const int from = dir == 0 ? conns[i].down : conns[i].up;
          const int to = dir == 0 ? conns[i].up : conns[i].down;
          const ssize_t n = read(from, buf, sizeof(buf));
          if (n <= 0) {
            alive = false;
            break;
          }
          if (dir == 1 && drop_down) continue;
          for (ssize_t off = 0; off < n;) {
            // send, not write: a peer that closed must not raise SIGPIPE in
            // the test process (MSG_NOSIGNAL makes it EPIPE).
            const ssize_t w = send(to, buf + off, n - off, MSG_NOSIGNAL);
            if (w <= 0) {
              alive = false;
              break;
            }
            off += w;
          }
        }
        if (alive) {
          keep.push_back(conns[i]);
        } else {
          close(conns[i].down);
          close(conns[i].up);
        }
      }
      conns = std::move(keep);
    }
    CloseAll(conns);
  }

  const int target_port_;
  const std::string target_unix_;  // empty: TCP to target_port_
  int listen_fd_ = -1;
  int port_ = 0;
  int wake_[2] = {-1, -1};
  std::thread thread_;
  accord::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool drop_down_ ABSL_GUARDED_BY(mu_) = false;
  bool blackhole_ ABSL_GUARDED_BY(mu_) = false;
  int64_t cut_requested_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t cut_done_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t freeze_requested_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t freeze_done_ ABSL_GUARDED_BY(mu_) = 0;
  int last_cut_count_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace accord::testing

#endif  // ACCORD_TESTS_FAULT_CUTTABLE_PROXY_H_
