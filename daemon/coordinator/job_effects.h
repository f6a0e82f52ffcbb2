// What a Job's handlers do outside the job (docs/ARCHITECTURE.md,
// "Classes"): messages to its nodes, counters, observer events, timer
// wake-ups, the run's failure, the usage windows' global cap. A Job takes
// no lock and starts no thread; the coordinator implements this per event,
// with its lock held, and sends the messages when the event ends. Tests
// drive a Job with a fake that records.
#ifndef ACCORD_DAEMON_COORDINATOR_JOB_EFFECTS_H_
#define ACCORD_DAEMON_COORDINATOR_JOB_EFFECTS_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "accord/v1/accord.pb.h"
#include "daemon/coordinator/content.h"
#include "daemon/coordinator/coordinator_options.h"
#include "daemon/coordinator/observe_hooks.h"
#include "daemon/coordinator/usage_window.h"

namespace accord::daemon {

class NodeSink;

// A decided step's contents, asked for only when a usage window needs them.
using StepContents = absl::FunctionRef<std::vector<std::shared_ptr<const Content>>()>;

class JobEffects {
 public:
  virtual ~JobEffects() = default;
  // Queues `message` for one node. Messages go out when the event ends: the
  // direct ones first, in order, then Broadcast's, then Decisions(), then
  // BroadcastLast's.
  virtual void Send(NodeSink* sink, v1::CoordinatorMessage message) = 0;
  // The decision batch this event replies to one node (created on first use).
  virtual v1::DecisionBatch* ReplyBatch(NodeSink* sink) = 0;
  // Queues `message` for every node of the job.
  virtual void Broadcast(v1::CoordinatorMessage message) = 0;
  // The decisions this event broadcasts to every node of the job.
  virtual v1::DecisionBatch& Decisions() = 0;
  // Decisions this event sends to `sinks` only (one shared message, after
  // Decisions()): a wave domain's decisions go to the domain's nodes.
  virtual v1::DecisionBatch& ScopedDecisions(std::vector<NodeSink*> sinks) = 0;
  // Queues `message` for every node of the job after Decisions(): the job's
  // verdict follows the answers to its steps.
  virtual void BroadcastLast(v1::CoordinatorMessage message) = 0;
  // Counts an error sent to nodes (once per event) and queues its event.
  virtual void NoteError(const v1::DecisionError& error) = 0;
  // Queues an observer event (called only when an observer is set).
  virtual void Event(ObserveEvent event) = 0;
  // The timer must look at the job's deadlines at `at` (or earlier).
  virtual void WakeAt(absl::Time at) = 0;
  // The job failed with `error`: its run's keys are of no use any more.
  virtual void RunFailed(const v1::DecisionError& error) = 0;
  // Records a decided step in a group's usage window, within the global
  // byte cap (usage_total_bytes) that every window shares.
  virtual void RecordUsage(UsageWindow& usage, int64_t step, bool same, StepContents contents) = 0;
  virtual CoordinatorStats& stats() = 0;

  // The one reply path for errors sent to one node: each counts the error
  // (NoteError) and queues it in the shape the node expects (a session
  // error, a registration result, a decision). A failure already counted
  // (the job's or the group's) is resent with Send or ReplyBatch instead.
  void SendError(NodeSink* sink, v1::DecisionError error);
  void SendRegistrationError(NodeSink* sink, const std::string& group_id, v1::DecisionError error);
  void SendDecisionError(NodeSink* sink, absl::string_view group_id, int64_t step,
                         v1::DecisionError error);
};

}  // namespace accord::daemon

#endif  // ACCORD_DAEMON_COORDINATOR_JOB_EFFECTS_H_
