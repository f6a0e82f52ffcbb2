// The key-value Sets a forwarder (a sidecar's, or a relay's) passed upstream
// and the coordinator accepted, kept so that they can be sent again to a
// coordinator that lost them: keys live in the coordinator's memory only, and
// a coordinator restarted under a job would otherwise leave a rendezvous in
// progress waiting for keys that were set before the restart
// (docs/RELIABILITY.md, "Keys across a coordinator restart").
//
// Kept per run scope (job id + run id, as stamped on the request), in the
// order scopes were first noted, at most `max_bytes` of keys and values in
// all: past it the oldest scope is forgotten whole (a restart then loses
// that run's keys, as before). Thread-safe.
#ifndef ACCORD_DAEMON_SIDECAR_KEY_LEDGER_H_
#define ACCORD_DAEMON_SIDECAR_KEY_LEDGER_H_

#include <cstdint>
#include <functional>
#include <list>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "accord/v1/accord.pb.h"
#include "core/sync.h"

namespace accord::daemon {

class KeyLedger {
 public:
  explicit KeyLedger(int64_t max_bytes = int64_t{16} << 20) : max_bytes_(max_bytes) {}

  // A Set the coordinator accepted. The same key again replaces it (a
  // write-once key only ever comes back with its value).
  void Note(const v1::KeyValueSetRequest& request);
  // Forgets the scopes `live` says are over (their run ended, or no rank of
  // the job is served here any more).
  void Prune(const std::function<bool(const std::string& job_id, const std::string& run_id)>& live);
  void Forget(const std::string& job_id, const std::string& run_id);
  // Every kept Set, scope by scope, each scope's keys in the order first set.
  std::vector<v1::KeyValueSetRequest> All() const;
  int64_t bytes() const;
  int scopes() const;

 private:
  struct Scope {
    std::string job_id;
    std::string run_id;
    std::vector<v1::KeyValueSetRequest> sets;         // first-set order
    absl::flat_hash_map<std::string, size_t> by_key;  // key -> its index in `sets`
    int64_t bytes = 0;
  };
  static int64_t SizeOf(const v1::KeyValueSetRequest& r);

  const int64_t max_bytes_;
  mutable accord::Mutex mu_;
  std::list<Scope> scopes_ ABSL_GUARDED_BY(mu_);  // oldest first
  int64_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace accord::daemon

#endif  // ACCORD_DAEMON_SIDECAR_KEY_LEDGER_H_
