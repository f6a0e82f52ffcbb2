// Relay: the thread-safe, gRPC-facing side of a RelayJob (relay_job.h, the
// relay's protocol): it holds the lock, the timer thread, the clock and the
// sidecars' sinks, passes each call and the time to the RelayJob and
// delivers what it does (RelayEffects).
//
// Downstream it serves the node protocol exactly as the coordinator does
// (NodeSessionHandler: sidecars connect to it unchanged); upstream it is one
// node of the job (UpstreamHandler, driven by GrpcUpstream).
//
// Thread-safe: one mutex; sinks are called with it held and must not block or
// call back into the Relay. One timer thread (owned; stopped in Stop() or the
// destructor, which must run before the UpstreamSink goes away).
#ifndef ACCORD_DAEMON_RELAY_RELAY_H_
#define ACCORD_DAEMON_RELAY_RELAY_H_

#include <memory>
#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "accord/v1/accord.pb.h"
#include "core/sync.h"
#include "daemon/common/clock.h"
#include "daemon/common/due_timer.h"
#include "daemon/common/node_session.h"
#include "daemon/common/upstream.h"
#include "daemon/relay/relay_job.h"

namespace accord::daemon {

class Relay final : public NodeSessionHandler, public UpstreamHandler, private RelayEffects {
 public:
  using SessionId = NodeSessionHandler::SessionId;

  explicit Relay(RelayOptions options);
  ~Relay() override;
  Relay(const Relay&) = delete;
  Relay& operator=(const Relay&) = delete;

  // Stops the timer thread. Idempotent.
  void Stop();
  // Must be set before any other call; not owned.
  void SetUpstream(UpstreamSink* upstream);

  SessionId OpenSession(NodeSink* sink) override;
  void HandleMessage(SessionId session, const v1::NodeMessage& message) override;
  void CloseSession(SessionId session) override;

  void OnUpstreamConnected() override;
  void HandleCoordinatorMessage(v1::CoordinatorMessage* message) override;

  // Partial-step reports and sidecars past their reconnect grace, at
  // clock->Now(). The timer thread calls this; tests without it may.
  void CheckTimers();

  RelayStats stats();
  // The run of `job_id` this relay serves ("" while the coordinator has not
  // said it), or nullopt when it serves no such job: the key-value forwarder
  // keeps only that run's keys to set again, and names it on those it sets
  // again.
  std::optional<std::string> CurrentRun(const std::string& job_id);

 private:
  // RelayEffects, called by job_ with mu_ held.
  void SendToSession(SessionId session,
                     std::shared_ptr<const v1::CoordinatorMessage> message) override;
  void ArmTimer(absl::Time at) override;
  bool TimerArmed() const override;

  const RelayOptions options_;
  Clock* const clock_;
  accord::Mutex mu_;
  // Each open sidecar session's stream (not owned), from OpenSession to
  // CloseSession.
  absl::flat_hash_map<SessionId, NodeSink*> sinks_ ABSL_GUARDED_BY(mu_);
  RelayJob job_ ABSL_GUARDED_BY(mu_);
  DueTimer timer_;  // last: its thread starts once everything above is initialised
};

}  // namespace accord::daemon

#endif  // ACCORD_DAEMON_RELAY_RELAY_H_
