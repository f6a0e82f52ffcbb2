// The coordinator's key-value rendezvous (NCCL unique ids, the Gloo store),
// scoped per run of a job (job id + run id): two jobs, or two runs of one
// job, never see each other's keys. A key is write-once per run: a second Set
// with another value is ALREADY_EXISTS (the same value again is accepted, so
// a retried Set is harmless). DropRun deletes a run's keys when the
// coordinator ends the run (see docs/ARCHITECTURE.md, "Runs").
//
// Get with a timeout never blocks a thread: it registers a callback that runs
// when every key is present (from the Set that completes it), when the
// timeout passes (DEADLINE_EXCEEDED naming the missing keys, fired by this
// class's timer thread), or on Stop() (UNAVAILABLE). Callbacks run without
// the store's lock held, exactly once.
//
// Thread-safe. Owns one timer thread that stops in Stop() or the destructor.
#ifndef ACCORD_DAEMON_COORDINATOR_KV_STORE_H_
#define ACCORD_DAEMON_COORDINATOR_KV_STORE_H_

#include <cstdint>
#include <functional>
#include <list>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/sync.h"
#include "daemon/common/clock.h"

namespace accord::daemon {

struct KvOptions {
  // Runs holding keys at once (the coordinator's --max_jobs): runs are
  // dropped when they end, so this bounds live runs, not ids ever seen.
  int max_jobs = 1024;
  int max_keys_per_job = 1 << 16;
  int64_t max_value_bytes = 1 << 20;
  absl::Duration max_timeout = absl::Minutes(30);
};

class KvStore {
 public:
  using GetCallback = std::function<void(absl::StatusOr<std::vector<std::string>>)>;

  KvStore(KvOptions options, Clock* clock);
  ~KvStore();
  void Stop();

  // INVALID_ARGUMENT for an empty job or key, RESOURCE_EXHAUSTED past limits,
  // ALREADY_EXISTS when the run already holds `key` with another value.
  absl::Status Set(const std::string& job_id, const std::string& run_id, const std::string& key,
                   std::string value);
  // Calls `done` with the values of `keys` in order (see class comment).
  // timeout 0: answers at once, NOT_FOUND naming missing keys.
  void Get(const std::string& job_id, const std::string& run_id, std::vector<std::string> keys,
           absl::Duration timeout, GetCallback done);
  // Deletes the run's keys; its waiting Gets get `why` (a RUN_ENDED status),
  // or, with a `successor` scope (a failed run's fresh scope), wait there.
  void DropRun(const std::string& job_id, const std::string& run_id, const absl::Status& why,
               const std::string& successor = "");
  // Number of Get calls waiting (for tests).
  int NumWaiting();
  // Runs holding keys, and keys held in all (for the churn soak and metrics).
  int NumRuns();
  int64_t NumKeys();

 private:
  using Scope = std::pair<std::string, std::string>;  // job id, run id
  struct Waiter {
    Scope scope;
    std::vector<std::string> keys;
    absl::Time deadline;
    GetCallback done;
  };
  using Ready = std::vector<std::pair<GetCallback, absl::StatusOr<std::vector<std::string>>>>;
  // Values of all keys, or the missing ones in `missing`.
  bool Lookup(const Scope& scope, const std::vector<std::string>& keys,
              std::vector<std::string>* values, std::vector<std::string>* missing)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void TimerLoop();

  const KvOptions options_;
  Clock* const clock_;
  accord::Mutex mu_;
  accord::CondVar cv_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  absl::flat_hash_map<Scope, absl::flat_hash_map<std::string, std::string>> data_
      ABSL_GUARDED_BY(mu_);
  int64_t num_keys_ ABSL_GUARDED_BY(mu_) = 0;
  std::list<Waiter> waiters_ ABSL_GUARDED_BY(mu_);
  std::thread timer_;
};

}  // namespace accord::daemon

#endif  // ACCORD_DAEMON_COORDINATOR_KV_STORE_H_
