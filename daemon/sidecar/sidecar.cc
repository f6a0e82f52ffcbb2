#include "daemon/sidecar/sidecar.h"

#include <utility>

namespace accord::daemon {

Sidecar::Sidecar(SidecarOptions options)
    : options_(std::move(options)),
      clock_(options_.clock != nullptr ? options_.clock : RealClock::Get()),
      job_(options_, *this),
      timer_(&mu_, clock_, [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return job_.CheckTimers(clock_->Now());
      }) {
  if (options_.start_timer_thread) timer_.Start();
}

Sidecar::~Sidecar() { Stop(); }

void Sidecar::Stop() { timer_.Stop(); }

void Sidecar::SetUpstream(UpstreamSink* upstream) {
  accord::MutexLock l(&mu_);
  job_.SetUpstream(upstream);
}

Sidecar::RunStamp Sidecar::CurrentRun() {
  accord::MutexLock l(&mu_);
  const UpstreamNode& node = job_.node();
  return RunStamp{node.job_id(), node.run_id(), options_.node_id, node.epoch()};
}

void Sidecar::ContinueIncarnation(std::string run_id, uint64_t node_epoch) {
  accord::MutexLock l(&mu_);
  job_.ContinueIncarnation(std::move(run_id), node_epoch);
}

SidecarStats Sidecar::stats() {
  accord::MutexLock l(&mu_);
  return job_.stats();
}

bool Sidecar::HadRank(int rank) {
  accord::MutexLock l(&mu_);
  return job_.HadRank(rank);
}

std::vector<int> Sidecar::ConnectedRanks() {
  accord::MutexLock l(&mu_);
  return job_.ConnectedRanks();
}

Sidecar::SessionId Sidecar::OpenRank(RankSink* sink) {
  accord::MutexLock l(&mu_);
  const SessionId id = job_.OpenSession();
  sinks_[id] = sink;
  return id;
}

void Sidecar::HandleRankMessage(SessionId session, const v1::RankMessage& message) {
  accord::MutexLock l(&mu_);
  job_.HandleRankMessage(clock_->Now(), session, message);
}

void Sidecar::CloseRank(SessionId session) {
  accord::MutexLock l(&mu_);
  job_.CloseSession(clock_->Now(), session);
  sinks_.erase(session);
}

void Sidecar::OnUpstreamConnected() {
  accord::MutexLock l(&mu_);
  const absl::Time now = clock_->Now();
  if (options_.upstream_health != nullptr) options_.upstream_health->NoteUnanswered(now);
  job_.OnUpstreamConnected(now);
}

void Sidecar::HandleCoordinatorMessage(v1::CoordinatorMessage* message) {
  // Any message is an answer (a refused hello gets an error, not a Welcome).
  if (options_.upstream_health != nullptr) options_.upstream_health->NoteAnswered();
  accord::MutexLock l(&mu_);
  job_.HandleCoordinatorMessage(clock_->Now(), message);
}

void Sidecar::HandleCoordinatorMessage(const v1::CoordinatorMessage& message) {
  accord::MutexLock l(&mu_);
  job_.HandleCoordinatorMessage(clock_->Now(), message);
}

void Sidecar::CheckPartialSteps() {
  accord::MutexLock l(&mu_);
  timer_.RunNow();
}

void Sidecar::SendToSession(SessionId session, std::shared_ptr<const v1::RankReply> reply) {
  mu_.AssertHeld();
  if (auto it = sinks_.find(session); it != sinks_.end()) it->second->Send(std::move(reply));
}

void Sidecar::CloseSession(SessionId session, const absl::Status& status) {
  mu_.AssertHeld();
  if (auto it = sinks_.find(session); it != sinks_.end()) it->second->Close(status);
}

void Sidecar::ArmTimer(absl::Time at) {
  mu_.AssertHeld();
  timer_.Arm(at);
}

bool Sidecar::TimerArmed() const {
  mu_.AssertHeld();
  return timer_.armed();
}

}  // namespace accord::daemon
