// The step pipeline of one job (docs/ARCHITECTURE.md, "More than one
// core"): a batch's manifests go through entry handling (answered without
// content, or handled), content resolution (the node's cached content for a
// repeat, else the parsed full form), contribution to the pending step, and
// the decision of each step they complete. The executor is the worker pool
// shared by every job: with one thread every step is decided as it
// completes (serial); with more, a large batch naming distinct groups
// handles its entries side by side, and the steps it completes are decided
// together at its end, their core Decides side by side. Decisions, messages
// and counters do not depend on the executor. Not thread-safe: called with
// the coordinator's lock held; it starts no thread.
#ifndef ACCORD_DAEMON_COORDINATOR_STEP_PIPELINE_H_
#define ACCORD_DAEMON_COORDINATOR_STEP_PIPELINE_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "accord/v1/accord.pb.h"
#include "core/decide.h"
#include "daemon/common/worker_pool.h"
#include "daemon/coordinator/content_cache.h"
#include "daemon/coordinator/group_state.h"
#include "daemon/coordinator/job_core.h"
#include "daemon/coordinator/job_effects.h"

namespace accord::daemon {

// A manifest's fields as the hot path needs them: a proto manifest or one
// entry of a batch repeat. `full` is set for full-form manifests only.
struct ManifestRef {
  absl::string_view group_id;
  int64_t step = 0;
  bool repeat = false;
  uint64_t cache_key = 0;
  const v1::Manifest* full = nullptr;
  PredecodedContent* predecoded = nullptr;  // full form: what was decoded before the lock
  // The node holds this step's decision already (Manifest.decided).
  bool decided = false;
};

// A manifest of a batch with its resolved group states (nullptr: unknown).
struct EntryRef {
  ManifestRef m;
  GroupState* g;
  NodeGroupState* ng;
};

class StepPipeline {
 public:
  StepPipeline(const CoordinatorOptions& options, WorkerPool* executor)
      : options_(options), executor_(executor) {}

  // When a batch is handled: `now`, and `start`, the time a pending step it
  // creates starts at (now, or a broken wave's first arrival).
  struct Times {
    absl::Time now;
    absl::Time start;
  };
  // Handles the manifests `node` sent (on `sink`) in order, as one by one,
  // and decides the steps they complete; returns whether every one was
  // added to its step.
  bool HandleBatch(JobCore& job, NodeState& node, NodeSink* sink, std::vector<EntryRef>& refs,
                   Times times, JobEffects& fx);
  // A scratch list for the caller to fill for HandleBatch (saves allocations).
  std::vector<EntryRef>& refs() { return refs_; }

 private:
  enum class Added { kAdded, kResent, kRefused };
  // What handling one manifest changes outside its own group's state, to be
  // applied in the batch's order (ApplyEntry): entries of distinct groups
  // may be handled side by side.
  struct EntryResult {
    bool answer = false;  // answered without content; nothing else was done
    int64_t cache_hits = 0;
    int64_t cache_misses = 0;
    int64_t key_mismatches = 0;
    int64_t retained = 0;  // change of the retained contents' count
    absl::Time wake = absl::InfiniteFuture();
    Added added = Added::kRefused;
    v1::DecisionError error;  // kRefused
    bool complete = false;    // its step now has every rank
  };
  // Complete steps waiting for their decisions (one group at most once),
  // when the batch decides them together at its end; nullptr: decide each
  // one as it completes.
  struct ReadyStep {
    GroupState* group;
    int64_t step;
  };
  using Ready = std::vector<ReadyStep>;
  struct Sender {
    JobCore& job;
    NodeState& node;
    NodeSink* sink;
  };

  // Whether the batch may handle its entries side by side: large enough,
  // every group known and named once, none with a step waiting to be decided.
  bool CanRunSideBySide(const std::vector<EntryRef>& refs);
  bool HandleManifest(const Sender& s, const EntryRef& r, Times times, Ready* ready,
                      JobEffects& fx);
  // A manifest that needs no content: a failed job, an unknown or failed
  // group, a negative or decided step.
  static bool AnswersWithoutContent(const JobCore& job, const GroupState* g,
                                    const NodeGroupState* ng, int64_t step);
  static void AnswerWithoutContent(const Sender& s, const ManifestRef& m, const GroupState* g,
                                   const NodeGroupState* ng, JobEffects& fx);
  // Changes only its group's state (GroupState, the node's NodeGroupState,
  // their pending step); reads `job` and `node`. A new pending step starts
  // at `start`.
  void HandleEntry(const JobCore& job, NodeState& node, GroupState& g, NodeGroupState& ng,
                   const ManifestRef& m, absl::Time start, EntryResult& r) const;
  // Applies what HandleEntry wrote: counters, timer, error reply, the node's
  // last step, the decision. Returns whether the manifest was added.
  bool ApplyEntry(const Sender& s, const EntryRef& e, EntryResult& r, absl::Time now, Ready* ready,
                  JobEffects& fx);
  // The manifest's content: the node's cached one for a repeat, else the
  // parsed full form, which becomes the cache. nullptr with r.error set when
  // it cannot be resolved (resend_full_form for an unknown repeat).
  static const Content* ResolveContent(const JobCore& job, const NodeState& node, GroupState& g,
                                       NodeGroupState& ng, const ManifestRef& m, EntryResult& r);
  // The pending step, started at `start` when new (r.wake: when the timer
  // must look at it); nullptr (LIMIT_EXCEEDED in r.error) past
  // --max_pending_steps.
  PendingStep* PendingStepFor(const JobCore& job, GroupState& g, const ManifestRef& m,
                              absl::Time start, EntryResult& r) const;
  // Adds the node's content to the step: kResent for an identical resend
  // (no-op), kRefused (`error` set) for a different one about the same ranks.
  static Added AddContribution(const JobCore& job, NodeState& node, NodeGroupState& ng,
                               const ManifestRef& m, const Content* content, PendingStep& p,
                               v1::DecisionError& error);
  // The core Decide on the OR-merge of the step's contributions. Reads only
  // the step's contents and the group's agreed registration, which nothing
  // changes while it runs, so steps of different groups may run at once.
  static absl::StatusOr<Decision> ComputeDecision(const RegVariant& agreed, int world_size,
                                                  int64_t step, const PendingStep& p);
  // Decides the ready steps in the order they completed, their core
  // Decides side by side first when they are worth it.
  void DecideReady(JobCore& job, Ready& ready, absl::Time now, JobEffects& fx);
  // Decides a complete step and forgets it. `computed`: its core decision
  // when it was computed already, else nullptr.
  void DecideStep(JobCore& job, GroupState& g, int64_t step, absl::StatusOr<Decision>* computed,
                  absl::Time now, JobEffects& fx);

  const CoordinatorOptions& options_;
  WorkerPool* const executor_;
  // The batch that last named each group is stamped in GroupState::marks.
  uint64_t batch_stamp_ = 0;
  // HandleBatch's scratch, kept to save allocations.
  std::vector<EntryRef> refs_;
  std::vector<EntryResult> results_;
};

}  // namespace accord::daemon

#endif  // ACCORD_DAEMON_COORDINATOR_STEP_PIPELINE_H_
