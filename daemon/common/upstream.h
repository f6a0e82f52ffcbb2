// The client side of the node protocol: the stream a sidecar (or a relay)
// keeps to the coordinator (or to a relay). The gRPC adapter (GrpcUpstream)
// implements UpstreamSink and drives an UpstreamHandler.
#ifndef ACCORD_DAEMON_COMMON_UPSTREAM_H_
#define ACCORD_DAEMON_COMMON_UPSTREAM_H_

#include <vector>

#include "accord/v1/accord.pb.h"

namespace accord::daemon {

// The stream upstream.
class UpstreamSink {
 public:
  virtual ~UpstreamSink() = default;
  // Queues a message; dropped while disconnected (resent on reconnect).
  virtual void Send(v1::NodeMessage message) = 0;
  // Replaces whatever is queued with `messages` (called on connect).
  virtual void Reset(std::vector<v1::NodeMessage> messages) = 0;
  // Ends the current stream once what is queued on it is written, and
  // connects again.
  virtual void Reconnect() = 0;
};

// What the stream feeds: told of each (re)connect, then of each message.
class UpstreamHandler {
 public:
  virtual ~UpstreamHandler() = default;
  // A new stream is up: queue (UpstreamSink::Reset) the hello and every
  // resend.
  virtual void OnUpstreamConnected() = 0;
  // One message from upstream; may move its contents out.
  virtual void HandleCoordinatorMessage(v1::CoordinatorMessage* message) = 0;
};

}  // namespace accord::daemon

#endif  // ACCORD_DAEMON_COMMON_UPSTREAM_H_
