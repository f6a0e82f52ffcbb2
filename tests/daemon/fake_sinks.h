// Fakes of a sidecar's or relay's neighbours for their tests: the node above
// (UpstreamSink: what was sent, the resend on a new stream, reconnects) and a
// rank's stream (RankSink: the replies and the close).
#ifndef ACCORD_TESTS_DAEMON_FAKE_SINKS_H_
#define ACCORD_TESTS_DAEMON_FAKE_SINKS_H_

#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "accord/v1/accord.pb.h"
#include "daemon/common/upstream.h"
#include "daemon/sidecar/sidecar.h"

namespace accord::daemon::testing {

class FakeUpstream : public UpstreamSink {
 public:
  void Send(v1::NodeMessage m) override { sent.push_back(std::move(m)); }
  void Reset(std::vector<v1::NodeMessage> m) override { reset = std::move(m); }
  void Reconnect() override {
    ++reconnects;
    sent_before_reconnect = sent.size();
  }
  // Every manifest sent, in order, across messages.
  std::vector<v1::Manifest> manifests() const {
    std::vector<v1::Manifest> out;
    for (const auto& m : sent) {
      for (const auto& x : m.manifests().manifests()) out.push_back(x);
    }
    return out;
  }
  // Every progress report sent, in order.
  std::vector<v1::NodeProgress> progress() const {
    std::vector<v1::NodeProgress> out;
    for (const auto& m : sent) {
      if (m.has_progress()) out.push_back(m.progress());
    }
    return out;
  }
  std::vector<v1::NodeMessage> sent;
  std::vector<v1::NodeMessage> reset;
  int reconnects = 0;
  size_t sent_before_reconnect = 0;  // at the last Reconnect
};

class FakeRankSink : public RankSink {
 public:
  void Send(std::shared_ptr<const v1::RankReply> reply) override { replies.push_back(*reply); }
  void Close(const absl::Status& status) override { closed = status; }
  // Every decision received, in order, across replies.
  std::vector<v1::Decision> decisions() const {
    std::vector<v1::Decision> out;
    for (const auto& r : replies) {
      for (const auto& d : r.decisions().decisions()) out.push_back(d);
    }
    return out;
  }
  std::vector<v1::RankReply> replies;
  std::optional<absl::Status> closed;
};

}  // namespace accord::daemon::testing

#endif  // ACCORD_TESTS_DAEMON_FAKE_SINKS_H_
