// The server side of the node protocol (CoordinatorService.Session, see
// accord.proto): what the gRPC adapter (CoordinatorGrpcService) drives. Both
// the coordinator and the relay (docs/ARCHITECTURE.md, "Relays") implement
// it, so one adapter serves node streams for either.
#ifndef ACCORD_DAEMON_COMMON_NODE_SESSION_H_
#define ACCORD_DAEMON_COMMON_NODE_SESSION_H_

#include <cstdint>
#include <memory>

#include "accord/v1/accord.pb.h"

namespace accord::daemon {

// Where one node session's messages go. Send may be called with the
// handler's lock held: it must not block and must not call back into the
// handler. The same message object may go to many sinks.
class NodeSink {
 public:
  virtual ~NodeSink() = default;
  virtual void Send(std::shared_ptr<const v1::CoordinatorMessage> message) = 0;
};

// The logic behind node streams. Thread-safe in every implementation.
class NodeSessionHandler {
 public:
  using SessionId = uint64_t;
  virtual ~NodeSessionHandler() = default;
  // A node stream opened; messages for it go to `sink` until CloseSession.
  virtual SessionId OpenSession(NodeSink* sink) = 0;
  // Handles one message of a session; replies go to the sinks.
  virtual void HandleMessage(SessionId session, const v1::NodeMessage& message) = 0;
  // The stream ended; `sink` is not used afterwards.
  virtual void CloseSession(SessionId session) = 0;
};

}  // namespace accord::daemon

#endif  // ACCORD_DAEMON_COMMON_NODE_SESSION_H_
