// A JobEffects that records every effect a Job asks for, for tests that
// drive a Job alone (tests/daemon/job_test.cc, job_members_test.cc).
#ifndef ACCORD_TESTS_DAEMON_FAKE_JOB_EFFECTS_H_
#define ACCORD_TESTS_DAEMON_FAKE_JOB_EFFECTS_H_

#include <deque>
#include <map>
#include <utility>
#include <vector>

#include "daemon/coordinator/job_effects.h"

namespace accord::daemon::testing {

// Records every effect a Job asks for.
class FakeEffects : public JobEffects {
 public:
  void Send(NodeSink* sink, v1::CoordinatorMessage message) override {
    sent.emplace_back(sink, std::move(message));
  }
  v1::DecisionBatch* ReplyBatch(NodeSink* sink) override { return &replies[sink]; }
  void Broadcast(v1::CoordinatorMessage message) override {
    broadcasts.push_back(std::move(message));
  }
  v1::DecisionBatch& Decisions() override { return decisions; }
  v1::DecisionBatch& ScopedDecisions(std::vector<NodeSink*> sinks) override {
    scoped.emplace_back(std::move(sinks), v1::DecisionBatch());
    return scoped.back().second;
  }
  void BroadcastLast(v1::CoordinatorMessage message) override {
    last_broadcasts.push_back(std::move(message));
  }
  void NoteError(const v1::DecisionError& error) override { errors.push_back(error); }
  void Event(ObserveEvent event) override { events.push_back(std::move(event)); }
  void WakeAt(absl::Time at) override { wakes.push_back(at); }
  void RunFailed(const v1::DecisionError& error) override { run_failures.push_back(error); }
  void RecordUsage(UsageWindow& usage, int64_t step, bool same, StepContents contents) override {
    counters.usage_bytes += usage.Record(step, same, contents);
  }
  CoordinatorStats& stats() override { return counters; }

  std::vector<std::pair<NodeSink*, v1::CoordinatorMessage>> sent;
  std::map<NodeSink*, v1::DecisionBatch> replies;
  std::vector<v1::CoordinatorMessage> broadcasts;
  v1::DecisionBatch decisions;
  std::deque<std::pair<std::vector<NodeSink*>, v1::DecisionBatch>> scoped;
  std::vector<v1::CoordinatorMessage> last_broadcasts;
  std::vector<v1::DecisionError> errors;
  std::vector<ObserveEvent> events;
  std::vector<absl::Time> wakes;
  std::vector<v1::DecisionError> run_failures;
  CoordinatorStats counters;
};

}  // namespace accord::daemon::testing

#endif  // ACCORD_TESTS_DAEMON_FAKE_JOB_EFFECTS_H_
