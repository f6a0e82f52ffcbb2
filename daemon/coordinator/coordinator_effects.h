// Coordinator::Effects: the JobEffects of one event, used with the
// coordinator's lock held. Internal to the coordinator's .cc files.
#ifndef ACCORD_DAEMON_COORDINATOR_COORDINATOR_EFFECTS_H_
#define ACCORD_DAEMON_COORDINATOR_COORDINATOR_EFFECTS_H_

#include <utility>

#include "daemon/coordinator/coordinator.h"
#include "daemon/coordinator/job_effects.h"

namespace accord::daemon {

class Coordinator::Effects final : public JobEffects {
 public:
  Effects(Coordinator& c, Outbox& out, Job* job) : c_(c), out_(out), job_(job) {}

  void Send(NodeSink* sink, v1::CoordinatorMessage message) override {
    out_.direct.emplace_back(sink, std::move(message));
  }
  v1::DecisionBatch* ReplyBatch(NodeSink* sink) override { return out_.ReplyBatch(sink); }
  void Broadcast(v1::CoordinatorMessage message) override {
    out_.broadcast_other.emplace_back(job_, std::move(message));
  }
  v1::DecisionBatch& Decisions() override {
    return *out_.broadcast_decisions[job_].mutable_decisions();
  }
  v1::DecisionBatch& ScopedDecisions(std::vector<NodeSink*> sinks) override {
    auto& scoped = out_.GetLate().scoped_decisions;
    scoped.emplace_back(std::move(sinks), v1::CoordinatorMessage());
    return *scoped.back().second.mutable_decisions();
  }
  void BroadcastLast(v1::CoordinatorMessage message) override {
    out_.GetLate().broadcast_last.emplace_back(job_, std::move(message));
  }
  void NoteError(const v1::DecisionError& error) override {
    ++c_.stats_.errors;
    if (c_.options_.observer == nullptr) return;
    ObserveEvent e;
    e.type = ObserveEvent::Type::kError;
    e.job_id = error.job_id();
    e.group_id = error.group_id();
    e.step = error.step();
    e.kind = error.kind();
    e.message = error.message();
    e.ranks.assign(error.ranks().begin(), error.ranks().end());
    e.last_steps.assign(error.last_steps().begin(), error.last_steps().end());
    c_.events_.Push(std::move(e));
  }
  void Event(ObserveEvent event) override {
    if (c_.options_.observer != nullptr) c_.events_.Push(std::move(event));
  }
  void WakeAt(absl::Time at) override { c_.timer_.WakeAt(at); }
  void RunFailed(const v1::DecisionError& error) override {
    c_.runs_.Fail(job_->job_id(), job_->core().run_id, error);
  }
  void RecordUsage(UsageWindow& usage, int64_t step, bool same, StepContents contents) override {
    CoordinatorStats& stats = c_.stats_;
    stats.usage_bytes += usage.Record(step, same, contents);
    // The global cap (usage_total_bytes): retired jobs' windows go first.
    while (stats.usage_bytes > c_.options_.usage_total_bytes && !c_.retired_.empty()) {
      stats.usage_bytes -= c_.retired_.front().usage_bytes;
      c_.retired_.pop_front();
    }
    UsageWindow::Limits limits;
    limits.steps = c_.options_.usage_window_steps;
    limits.bytes = c_.options_.usage_window_bytes;
    limits.total_bytes = c_.options_.usage_total_bytes;
    usage.Trim(limits, stats.usage_bytes);
  }
  CoordinatorStats& stats() override { return c_.stats_; }

 private:
  Coordinator& c_;
  Outbox& out_;
  Job* const job_;
};

}  // namespace accord::daemon

#endif  // ACCORD_DAEMON_COORDINATOR_COORDINATOR_EFFECTS_H_
