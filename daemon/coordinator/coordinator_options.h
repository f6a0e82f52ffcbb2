// The coordinator's options (flags of accord-coordinator) and counters.
#ifndef ACCORD_DAEMON_COORDINATOR_COORDINATOR_OPTIONS_H_
#define ACCORD_DAEMON_COORDINATOR_COORDINATOR_OPTIONS_H_

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "core/group.h"
#include "daemon/coordinator/observe_hooks.h"

namespace accord::daemon {

struct CoordinatorOptions {
  absl::Duration deadline = absl::Seconds(60);
  int max_jobs = 1024;
  int max_groups_per_job = 16384;
  int64_t max_params_per_group = kMaxParamsPerGroup;
  int max_pending_steps = 64;  // per group
  int max_world_size = 1 << 20;
  // Tests that drive CheckDeadlines() by hand may turn the thread off.
  bool start_timer_thread = true;
  // Metrics and event log (not owned; may be null). Must outlive the
  // Coordinator.
  CoordinatorObserver* observer = nullptr;
  // Observe API: decided steps of per-step usage kept per group for the skip
  // matrix (runs of identical steps cost one entry), and an approximate byte
  // bound of what they keep alive.
  int64_t usage_window_steps = 1000;
  int64_t usage_window_bytes = 16 << 20;
  // A cap on what every usage window together keeps (live jobs' groups and
  // retired jobs): past it, retired jobs' windows go first (oldest first),
  // then the deciding group's own window shrinks to its newest run.
  int64_t usage_total_bytes = 256 << 20;
  // Runs (docs/ARCHITECTURE.md, "Runs"). Called once per run that ended
  // (its last node left, a newer run superseded it, it never got a node
  // within run_start_timeout) or failed, without the coordinator's lock held,
  // with a RUN_ENDED (or the failure's) status saying why. The key-value
  // store drops the run's keys here. Must not call back into the Coordinator.
  // For a failed run `successor` names its fresh key scope (waiting Gets
  // move there); empty when the run ended.
  std::function<void(const std::string& job_id, const std::string& run_id, const absl::Status&,
                     const std::string& successor)>
      on_run_ended;
  // The ranks of a run's key scope whose last key-value request was a Get cut
  // at the deadline, each with the error it got (KvStore::WaitsCut; the
  // coordinator passes the run's id as the scope). A job such a rank leaves
  // fails with those words (docs/ARCHITECTURE.md, "Every wait names who is
  // missing"). Called with the coordinator's lock held: must not call back
  // into the Coordinator. Unset: no key-value store.
  std::function<std::vector<std::pair<int, absl::Status>>(const std::string& job_id,
                                                          const std::string& scope)>
      waits_cut;
  // A node whose stream ended (its sidecar died or restarted, or its host is
  // unreachable) while a pending step still needs its ranks fails the job,
  // on every node, once it has not come back for this long (a sidecar that
  // only lost its connection reconnects well within it). See
  // docs/RELIABILITY.md, "Sidecar restart".
  absl::Duration node_reconnect_grace = absl::Seconds(10);
  // A run started by a key-value request whose node never says NodeHello
  // ends after this long.
  absl::Duration run_start_timeout = absl::Minutes(5);
  // Jobs whose last node left stay visible to the observe API (status, skip
  // matrix) until this many newer jobs ended or the same job id returns.
  int retired_jobs = 8;
  // Repeat waves (docs/ARCHITECTURE.md, "Repeat waves"): once every node of
  // a job contributed its whole batch to a step that decided every group,
  // a step where every node sends a batch repeat is decided in O(groups)
  // after O(1) per node, with the same decisions, errors and counters as
  // without. Off: every batch repeat is handled entry by entry.
  bool repeat_waves = true;
  // More than one core (docs/ARCHITECTURE.md, "More than one core"): the
  // manifests of one batch (distinct groups) are handled, and the groups it
  // completes decided, side by side on this many threads, the handling
  // thread included (0: one per hardware thread, at most 8). Decisions,
  // messages and counters do not depend on it. 1 by default: on the 2-vCPU
  // machines measured (bench/RESULTS.md) more threads did not shorten a step.
  int decide_threads = 1;
  // A batch's manifests are handled side by side only when it has at least
  // this many (each costs about a microsecond).
  int64_t parallel_min_entries = 64;
  // A message's completed steps are decided in parallel only when their
  // merges add up to at least this many node contents (below it the
  // hand-off costs more than it saves).
  int64_t parallel_decide_min_contents = 4096;
};

// Counters for the metrics hook.
struct CoordinatorStats {
  int64_t manifests = 0;
  int64_t cache_hits = 0;    // repeat-form manifests resolved from the cache
  int64_t cache_misses = 0;  // full-form manifests
  int64_t repeat_key_mismatches = 0;
  int64_t decisions = 0;
  int64_t same_as_previous = 0;
  int64_t repeat_waves = 0;  // steps decided as one repeat wave
  // ManifestBatches received from nodes: with manifests, and batch repeats
  // (one record standing for the stream's previous batch).
  int64_t manifest_batches = 0;
  int64_t batch_repeats = 0;
  // Core Decides computed side by side on the worker pool (decide_threads).
  int64_t parallel_decides = 0;
  // Manifests whose HandleEntry part ran on the worker pool.
  int64_t parallel_entries = 0;
  int64_t errors = 0;  // error decisions and results sent (counted once per event)
  int64_t jobs = 0;    // live jobs
  int64_t runs = 0;    // live runs (a run may precede its job: see RunForKeyValue)
  int64_t sessions = 0;
  int64_t retained_contents = 0;  // ContentCache::retained() entries, all jobs
  int64_t usage_bytes = 0;        // usage windows, live and retired jobs (approximate)
};

}  // namespace accord::daemon

#endif  // ACCORD_DAEMON_COORDINATOR_COORDINATOR_OPTIONS_H_
