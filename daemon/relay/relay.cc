#include "daemon/relay/relay.h"

#include <utility>

namespace accord::daemon {

Relay::Relay(RelayOptions options)
    : options_(std::move(options)),
      clock_(options_.clock != nullptr ? options_.clock : RealClock::Get()),
      job_(options_, *this),
      timer_(&mu_, clock_, [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return job_.CheckTimers(clock_->Now());
      }) {
  if (options_.start_timer_thread) timer_.Start();
}

Relay::~Relay() { Stop(); }

void Relay::Stop() { timer_.Stop(); }

void Relay::SetUpstream(UpstreamSink* upstream) {
  accord::MutexLock l(&mu_);
  job_.SetUpstream(upstream);
}

std::optional<std::string> Relay::CurrentRun(const std::string& job_id) {
  accord::MutexLock l(&mu_);
  return job_.CurrentRun(job_id);
}

RelayStats Relay::stats() {
  accord::MutexLock l(&mu_);
  return job_.stats();
}

Relay::SessionId Relay::OpenSession(NodeSink* sink) {
  accord::MutexLock l(&mu_);
  const SessionId id = job_.OpenSession();
  sinks_[id] = sink;
  return id;
}

void Relay::HandleMessage(SessionId session, const v1::NodeMessage& message) {
  accord::MutexLock l(&mu_);
  job_.HandleMessage(clock_->Now(), session, message);
}

void Relay::CloseSession(SessionId session) {
  accord::MutexLock l(&mu_);
  sinks_.erase(session);
  job_.CloseSession(clock_->Now(), session);
}

void Relay::OnUpstreamConnected() {
  accord::MutexLock l(&mu_);
  const absl::Time now = clock_->Now();
  // A new stream: unanswered until its Welcome.
  if (options_.upstream_health != nullptr) options_.upstream_health->NoteUnanswered(now);
  job_.OnUpstreamConnected(now);
}

void Relay::HandleCoordinatorMessage(v1::CoordinatorMessage* message) {
  // Any message is an answer (a refused hello gets an error, not a Welcome).
  if (options_.upstream_health != nullptr) options_.upstream_health->NoteAnswered();
  accord::MutexLock l(&mu_);
  job_.HandleCoordinatorMessage(message);
}

void Relay::CheckTimers() {
  accord::MutexLock l(&mu_);
  timer_.RunNow();
}

void Relay::SendToSession(SessionId session,
                          std::shared_ptr<const v1::CoordinatorMessage> message) {
  mu_.AssertHeld();
  if (auto it = sinks_.find(session); it != sinks_.end()) it->second->Send(std::move(message));
}

void Relay::ArmTimer(absl::Time at) {
  mu_.AssertHeld();
  timer_.Arm(at);
}

bool Relay::TimerArmed() const {
  mu_.AssertHeld();
  return timer_.armed();
}

}  // namespace accord::daemon
