// The coordinator's key-value rendezvous (NCCL unique ids, the Gloo store),
// scoped per job: two jobs never see each other's keys.
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
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/sync.h"
#include "daemon/common/clock.h"

namespace accord::daemon {

struct KvOptions {
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

  // INVALID_ARGUMENT for an empty job or key, RESOURCE_EXHAUSTED past limits.
  absl::Status Set(const std::string& job_id, const std::string& key, std::string value);
  // Calls `done` with the values of `keys` in order (see class comment).
  // timeout 0: answers at once, NOT_FOUND naming missing keys.
  void Get(const std::string& job_id, std::vector<std::string> keys, absl::Duration timeout,
           GetCallback done);
  // Number of Get calls waiting (for tests).
  int NumWaiting();

 private:
  struct Waiter {
    std::string job_id;
    std::vector<std::string> keys;
    absl::Time deadline;
    GetCallback done;
  };
  using Ready = std::vector<std::pair<GetCallback, absl::StatusOr<std::vector<std::string>>>>;
  // Values of all keys, or the missing ones in `missing`.
  bool Lookup(const std::string& job_id, const std::vector<std::string>& keys,
              std::vector<std::string>* values, std::vector<std::string>* missing)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void TimerLoop();

  const KvOptions options_;
  Clock* const clock_;
  accord::Mutex mu_;
  accord::CondVar cv_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  absl::flat_hash_map<std::string, absl::flat_hash_map<std::string, std::string>> data_
      ABSL_GUARDED_BY(mu_);
  std::list<Waiter> waiters_ ABSL_GUARDED_BY(mu_);
  std::thread timer_;
};

}  // namespace accord::daemon

#endif  // ACCORD_DAEMON_COORDINATOR_KV_STORE_H_
