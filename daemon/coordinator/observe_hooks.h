// What the coordinator's logic tells observers (metrics, the event log): a
// small interface so the logic class knows nothing of Prometheus, files or
// gRPC.
//
// Two kinds of calls:
//  - Hot path (GroupObserver::OnDecision, JobObserver::OnManifests): called with
//    the coordinator's lock held, once per decision / manifest. They must be
//    cheap and must not block: atomic updates of objects looked up once, when
//    the job or group appeared (ForJob / ForGroup).
//  - Rare events (CoordinatorObserver::OnEvent): decisions that changed,
//    errors, stalls, deadline failures, nodes connecting and leaving. Queued
//    under the lock and delivered after it is released, in order, one thread
//    at a time; OnEvent may block briefly (file I/O) but must not call back
//    into the Coordinator.
#ifndef ACCORD_DAEMON_COORDINATOR_OBSERVE_HOOKS_H_
#define ACCORD_DAEMON_COORDINATOR_OBSERVE_HOOKS_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "accord/v1/accord.pb.h"
#include "core/dtype.h"

namespace accord::daemon {

// One decision of one group, as the metrics count it.
struct DecisionSummary {
  int64_t step = 0;
  bool ok = true;                 // false: an error decision
  bool same_as_previous = false;  // answered from the previous decision
  DType wire = DType::kFloat32;   // when ok
  int included = 0;               // parameters in the buffer
  int skipped = 0;                // parameters used on no rank (left out)
  int64_t zero_fills = 0;         // (parameter, rank) pairs filled with zeros
  absl::Duration wait;            // first manifest in -> decision out
};

class GroupObserver {
 public:
  virtual ~GroupObserver() = default;
  // Under the coordinator's lock; must not block.
  virtual void OnDecision(const DecisionSummary& decision) = 0;
};

class JobObserver {
 public:
  virtual ~JobObserver() = default;
  // Under the coordinator's lock; must not block. `count` manifests arrived,
  // `cache_hit`: in repeat form. A repeat wave reports all of its manifests
  // at once.
  virtual void OnManifests(bool cache_hit, int64_t count) = 0;
  // Under the coordinator's lock, once per group of the job.
  virtual std::unique_ptr<GroupObserver> ForGroup(const std::string& group_id) = 0;
};

// A rare event, delivered outside the coordinator's lock.
struct ObserveEvent {
  enum class Type {
    kDecisionChanged,  // wire dtype or included set differs from the group's previous decision
    kError,            // an error sent to a node (kind, message, ranks)
    kStall,            // a group step waiting longer than half its deadline (once per step)
    kDeadlineFailure,  // a group step failed the job with MISSING_RANKS
    kNodeConnected,
    kNodeDisconnected,
  };
  Type type = Type::kError;
  std::string job_id;
  std::string group_id;
  std::string node_id;
  int64_t step = -1;
  // kDecisionChanged
  std::string wire;
  int included = 0;
  int skipped = 0;
  std::vector<std::string> skipped_names;  // at most kMaxSkippedNames
  // kError, kDeadlineFailure
  v1::ErrorKind kind = v1::ERROR_KIND_UNSPECIFIED;
  std::string message;
  // kError, kStall, kDeadlineFailure: ranks involved (missing ranks for stalls
  // and failures) and, for missing ranks, the last step each reached.
  std::vector<int> ranks;
  std::vector<int64_t> last_steps;
  // kStall: how long the step has waited and how long until its deadline.
  int64_t waiting_ms = 0;
  int64_t deadline_in_ms = 0;
  // kNodeConnected / kNodeDisconnected: the node's ranks and the job's
  // connected nodes afterwards.
  int connected_nodes = 0;

  static constexpr int kMaxSkippedNames = 32;
};

class CoordinatorObserver {
 public:
  virtual ~CoordinatorObserver() = default;
  // Under the coordinator's lock, when a job is created.
  virtual std::unique_ptr<JobObserver> ForJob(const std::string& job_id, int world_size) = 0;
  // Outside the lock, in order.
  virtual void OnEvent(const ObserveEvent& event) = 0;
};

}  // namespace accord::daemon

#endif  // ACCORD_DAEMON_COORDINATOR_OBSERVE_HOOKS_H_
