// One job's engine at the coordinator (docs/ARCHITECTURE.md, "Classes"):
// its node streams, group registrations, manifests and decisions, rank
// events, progress reports and deadlines. It takes no lock and starts no
// thread: the Coordinator calls it with its lock held, passes the time in,
// and every effect outside the job (messages, counters, events, timer
// wake-ups, the run's failure) goes through JobEffects. Its parts:
// JobCore (the state they share), StepPipeline (manifests to decisions),
// RepeatWaves (steady-state batch repeats), DeadlineMonitor (deadlines and
// progress), GroupState (one group, the only writer of its last decision).
#ifndef ACCORD_DAEMON_COORDINATOR_JOB_H_
#define ACCORD_DAEMON_COORDINATOR_JOB_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/node_hash_map.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "accord/v1/accord.pb.h"
#include "daemon/common/worker_pool.h"
#include "daemon/coordinator/batch_record.h"
#include "daemon/coordinator/content_cache.h"
#include "daemon/coordinator/coordinator_options.h"
#include "daemon/coordinator/group_state.h"
#include "daemon/coordinator/job_core.h"
#include "daemon/coordinator/job_effects.h"
#include "daemon/coordinator/repeat_waves.h"
#include "daemon/coordinator/step_pipeline.h"

namespace accord::daemon {

// One node's stream (a coordinator session) in a job.
struct NodeStream {
  uint64_t id = 0;  // the coordinator's session id
  NodeSink* sink = nullptr;
  NodeState* node = nullptr;
  BatchRecord last_batch;  // what a batch repeat on this stream stands for
  WaveStream wave;
};

class Job {
 public:
  using StreamId = uint64_t;

  // `executor`: the step pipeline's worker pool (shared, not owned).
  Job(std::string job_id, std::string run_id, int world_size, const CoordinatorOptions& options,
      std::unique_ptr<JobObserver> observer, WorkerPool* executor);
  Job(const Job&) = delete;
  Job& operator=(const Job&) = delete;

  JobCore& core() { return core_; }
  const JobCore& core() const { return core_; }
  const std::string& job_id() const { return core_.job_id; }
  bool failed() const { return core_.failed(); }

  // NodeHello's job checks: the world size, and ranks held by another
  // connected node (DUPLICATE_RANK).
  absl::Status CheckJoin(const v1::NodeHello& hello, const std::vector<int>& ranks) const;
  // Places the node of `hello` on stream `id` (sorted, checked `ranks`) and
  // welcomes it (and resends the job's failure, if any). `*replaced`: the
  // stream the node was still connected on (0: none), now dropped.
  NodeStream& Connect(StreamId id, NodeSink* sink, const v1::NodeHello& hello,
                      const std::vector<int>& ranks, JobEffects& fx, StreamId* replaced);
  // Stream `s` ended at `now` (it is dropped). Returns whether no node of
  // the job is connected any more (the caller drops the job).
  bool Disconnect(NodeStream& s, absl::Time now, JobEffects& fx);

  // The messages of a connected stream.
  void HandleRegistration(NodeStream& s, const v1::NodeRegistration& nr, absl::Time now,
                          JobEffects& fx);
  // `predecoded`: the full forms' dtypes decoded before the lock (one per
  // manifest, or empty).
  void HandleManifests(NodeStream& s, const v1::ManifestBatch& batch,
                       std::vector<PredecodedContent>* predecoded, absl::Time now, JobEffects& fx);
  void HandleRankEvent(NodeStream& s, const v1::RankEvent& e, JobEffects& fx);
  // A rank whose last key-value request was a Get cut at the deadline
  // (CoordinatorOptions::waits_cut) and that is now gone (`leaving`, left,
  // on a node lost past its grace, or `all_gone`) ended the rendezvous for
  // every rank: fails the job with the words its wait ended with, so a rank
  // that reaches the run later gets them too (docs/ARCHITECTURE.md, "Every
  // wait names who is missing"). Returns whether it failed the job.
  bool FailForAWaitGivenUp(int leaving, bool all_gone, absl::Time now, JobEffects& fx);
  void HandleProgress(NodeStream& s, const v1::NodeProgress& progress, absl::Time now,
                      JobEffects& fx);

  // Repeat waves (docs/ARCHITECTURE.md, "Repeat waves"), one per wave
  // domain (docs/MEMBERS.md 2.11). TryJoinWave holds back a batch repeat
  // that may join its domain's wave (returns false, changing nothing, when
  // it may not); the last node of the domain in decides every group of its
  // records as same_as_previous. BreakWave: any other event of the job
  // first hands the held-back repeats of every domain to the entry-by-entry
  // path, as if they had been handled on arrival; BreakWavesFor only those
  // of the domains `message` on stream `s` (null: not attached) touches.
  // `now` is read only when the repeat starts or completes the wave.
  bool TryJoinWave(NodeStream& s, const v1::ManifestBatch& batch,
                   absl::FunctionRef<absl::Time()> now, JobEffects& fx);
  void BreakWave(absl::Time now, JobEffects& fx);
  void BreakWavesFor(const NodeStream* s, const v1::NodeMessage& message, absl::Time now,
                     JobEffects& fx);
  // After an event that failed the job: the held-back repeats of other
  // domains go the entry-by-entry path too.
  void BreakWavesIfFailed(absl::Time now, JobEffects& fx);

  // Everything due at `now` (a held wave's check, lost nodes, registrations,
  // pending steps); returns when the next thing is due.
  absl::Time CheckDeadlines(absl::Time now, JobEffects& fx);

 private:
  // HandleRegistration's steps: the registering ranks (served by the node,
  // at least one) and the size limit; the group (created on first sight, up
  // to --max_groups_per_job); the registration itself and its reply; the
  // completed registration sent to every node (its fingerprint, or the
  // mismatch, which also fails the group's pending steps).
  absl::StatusOr<std::vector<int>> CheckRegistration(const NodeState& node,
                                                     const v1::NodeRegistration& nr,
                                                     const GroupSpec& spec) const;
  absl::StatusOr<GroupState*> FindOrCreateGroup(const std::string& group_id);
  void Register(NodeStream& s, GroupState& g, const GroupSpec& spec, const Policy& policy,
                const std::vector<int>& ranks, absl::Time now, JobEffects& fx);
  void BroadcastRegistration(GroupState& g, JobEffects& fx);
  // A batch repeat: every entry of the stream's previous batch at a new step.
  void HandleBatchRepeat(NodeStream& s, const v1::ManifestBatch& batch, absl::Time now,
                         JobEffects& fx);
  // The entries of the stream's batch record at `step`, one by one.
  void RepeatBatch(NodeStream& s, int64_t step, StepPipeline::Times times, JobEffects& fx);
  // Resolves a batch entry's group pointers when it has none (the group was
  // unknown when recorded, or the entry is new).
  void ResolveEntry(NodeStream& s, BatchEntry& e);
  // After a batch handled entry by entry: `all_added` when every entry was
  // added to `step`.
  void NoteSynced(NodeStream& s, int64_t step, bool all_added);
  // NoteSynced in a job with member sets: the record's domain.
  void NoteSyncedInDomain(NodeStream& s, int64_t step, bool all_added);
  void CompleteWave(RepeatWaves::Wave wave, absl::Time now, JobEffects& fx);
  // Whether the deadline monitor may act at a check (a pending step, a
  // registration collecting, a node lost).
  bool MonitorMayAct() const;
  // Hands the held-back repeats of domain `element` (a root, or stale) to the
  // entry-by-entry path.
  void BreakDomain(int element, absl::Time now, JobEffects& fx);
  // The domain roots of the groups `batch` on stream `s` names, and of the
  // stream's record.
  std::vector<int> DomainsOf(const NodeStream& s, const v1::ManifestBatch& batch);

  JobCore core_;
  WaveDomains waves_;
  StepPipeline pipeline_;
  // node_hash_map: the coordinator's sessions point at the values.
  absl::node_hash_map<StreamId, NodeStream> streams_;
};

}  // namespace accord::daemon

#endif  // ACCORD_DAEMON_COORDINATOR_JOB_H_
