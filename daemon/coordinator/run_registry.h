// The runs (incarnations) of the jobs a coordinator serves
// (docs/ARCHITECTURE.md, "Runs" and "Lifecycles").
#ifndef ACCORD_DAEMON_COORDINATOR_RUN_REGISTRY_H_
#define ACCORD_DAEMON_COORDINATOR_RUN_REGISTRY_H_

#include <algorithm>
#include <cstdint>
#include <deque>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "accord/v1/accord.pb.h"

namespace accord::daemon {

enum class RunState {
  kStarting,  // started by a key-value request; no node joined yet
  kRunning,   // its job exists (a node said NodeHello)
  kFailed,    // its job failed; its keys were dropped, late requests get the failure
};

// One run of a job. It starts at the job's first NodeHello or key-value
// request and ends when its last node disconnects, when a newer run
// supersedes it, or (never joined by a node) after run_start_timeout.
// SetRunning and SetFailed are its only transitions:
//   kStarting --SetRunning (its job was created by a NodeHello)--> kRunning
//   kRunning --SetFailed (its job failed)--> kFailed
// and from any state it ends (RunRegistry::End).
struct Run {
  std::string run_id;
  absl::Time started;
  // The nodes that joined it, each with the epoch its sidecar drew for its ranks.
  absl::flat_hash_map<std::string, uint64_t> node_epochs;
  RunState state = RunState::kStarting;
  v1::DecisionError failure;  // set in kFailed
  // Started by a RESUME that named it (taken over after a restart), not
  // drawn here.
  bool taken_over = false;
  // Ids of runs this coordinator never saw that nodes RESUMEd while this run
  // was current and had decided nothing: the same launch, whose first run
  // died with the previous coordinator before some of its nodes were
  // welcomed (docs/ARCHITECTURE.md, "Runs"). A RESUME or key-value request
  // naming one is placed in this run. At most kMaxAliases.
  std::vector<std::string> aliases;
  static constexpr size_t kMaxAliases = 8;
  bool Names(const std::string& id) const {
    return id == run_id || std::find(aliases.begin(), aliases.end(), id) != aliases.end();
  }
  void SetRunning() {
    if (state == RunState::kStarting) state = RunState::kRunning;
  }
  void SetFailed(const v1::DecisionError& error) {
    state = RunState::kFailed;
    failure = error;
  }
};

// A run's end (or its failure's drop of its keys) for
// CoordinatorOptions::on_run_ended.
struct EndedRun {
  std::string job_id;
  std::string run_id;  // the key scope (RunRegistry::KeyScopeOf)
  absl::Status why;
  std::string successor;  // a failed run's fresh key scope
};

// The current run of each job id, the ends not yet delivered, and the last
// kRemembered runs that failed or were superseded (so a late request of one
// is refused instead of reviving it). Not thread-safe: the coordinator's
// lock guards it.
class RunRegistry {
 public:
  static constexpr size_t kRemembered = 4096;

  // `seed` draws run ids.
  explicit RunRegistry(uint64_t seed) : nonce_(seed) {}

  size_t size() const { return runs_.size(); }
  // The job's current run (nullptr: none).
  Run* Find(const std::string& job_id);
  // Starts the job's run (the caller ended any previous one) at `now`, under
  // `run_id`, or a fresh id when empty.
  Run& Start(const std::string& job_id, std::string run_id, absl::Time now);
  // Ends the job's run if it is still `run_id`: it is erased and its end
  // queued with `why`. Returns whether it did.
  bool End(const std::string& job_id, const std::string& run_id, absl::Status why);
  // Replaces the reason of the last queued end when it is that of `scope`.
  void SetLastEndReason(const std::string& scope, absl::Status why);
  // The job's run failed (when it is still `run_id` and not failed yet):
  // kFailed, and the drop of its keys is queued; keys set afterwards go to a
  // fresh scope (KeyScopeOf), dropped when the run ends.
  void Fail(const std::string& job_id, const std::string& run_id, const v1::DecisionError& error);
  // Remembers that `run_id` of `job_id` ended here with `why`, the error its
  // ranks were sent (bounded, oldest first out).
  void Remember(const std::string& job_id, const std::string& run_id, v1::DecisionError why);
  // The same for `run` under each id it answers to (its own and its aliases).
  void Remember(const std::string& job_id, const Run& run, const v1::DecisionError& why);
  bool Remembered(const std::string& job_id, const std::string& run_id) const {
    return remembered_why_.contains(std::make_pair(job_id, run_id));
  }
  // The error a remembered run ended with (nullptr: not remembered), so a
  // node that comes back to it late gets the error its other nodes got.
  const v1::DecisionError* RememberedError(const std::string& job_id,
                                           const std::string& run_id) const {
    auto it = remembered_why_.find(std::make_pair(job_id, run_id));
    return it == remembered_why_.end() ? nullptr : &it->second;
  }
  // The jobs whose run is still kStarting `timeout` after it started; lowers
  // `next` to when the next one is due.
  std::vector<std::string> StartingPast(absl::Time now, absl::Duration timeout,
                                        absl::Time& next) const;
  // The queued ends, oldest first; the queue is left empty.
  std::vector<EndedRun> TakeEnded();

  // The job's run `run_id`, healthy, ended at `at` because its last node's
  // stream ended. Until `grace` later, a NEW that finds no current run takes
  // that id again (Revivable): the node may be one of the same launch that
  // never got its Welcome (docs/ARCHITECTURE.md, "Runs"). The last
  // kRemembered such ends are kept.
  void NoteLastNodeGone(const std::string& job_id, const std::string& run_id, absl::Time at,
                        absl::Duration grace);
  // The id a NEW of the job takes at `now`: a run whose last node went less
  // than its grace ago; "" when none.
  std::string Revivable(const std::string& job_id, absl::Time now) const;

  // The key-value scope of a run: its id, or after its failure a fresh one
  // (the failure dropped the run's keys).
  static std::string KeyScopeOf(const Run& run);

 private:
  absl::flat_hash_map<std::string, Run> runs_;  // by job id
  uint64_t nonce_;
  std::vector<EndedRun> ended_;
  std::deque<std::pair<std::string, std::string>> remembered_;
  absl::flat_hash_map<std::pair<std::string, std::string>, v1::DecisionError> remembered_why_;
  struct Gone {
    std::string run_id;
    absl::Time until;
    uint64_t note = 0;  // which NoteLastNodeGone made it
  };
  absl::flat_hash_map<std::string, Gone> gone_;              // by job id
  std::deque<std::pair<std::string, uint64_t>> gone_order_;  // (job id, note), oldest first
  uint64_t gone_notes_ = 0;
};

}  // namespace accord::daemon

#endif  // ACCORD_DAEMON_COORDINATOR_RUN_REGISTRY_H_
