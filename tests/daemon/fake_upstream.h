// A fake of the node above (UpstreamSink) for the sidecar's and the relay's
// tests: records what was sent, the resend on a new stream, and reconnects.
#ifndef ACCORD_TESTS_DAEMON_FAKE_UPSTREAM_H_
#define ACCORD_TESTS_DAEMON_FAKE_UPSTREAM_H_

#include <utility>
#include <vector>

#include "accord/v1/accord.pb.h"
#include "daemon/common/upstream.h"

namespace accord::daemon::testing {

class FakeUpstream : public UpstreamSink {
 public:
  void Send(v1::NodeMessage m) override { sent.push_back(std::move(m)); }
  void Reset(std::vector<v1::NodeMessage> m) override { reset = std::move(m); }
  void Reconnect() override { ++reconnects; }
  // Every manifest sent, in order, across messages.
  std::vector<v1::Manifest> manifests() const {
    std::vector<v1::Manifest> out;
    for (const auto& m : sent) {
      for (const auto& x : m.manifests().manifests()) out.push_back(x);
    }
    return out;
  }
  std::vector<v1::NodeMessage> sent;
  std::vector<v1::NodeMessage> reset;
  int reconnects = 0;
};

}  // namespace accord::daemon::testing

#endif  // ACCORD_TESTS_DAEMON_FAKE_UPSTREAM_H_
