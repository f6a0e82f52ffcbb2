// The small key-value rendezvous the collective libraries need (NCCL unique
// id, Gloo store). In production it is the coordinator's KeyValueService,
// scoped to the job; tests may use an in-memory one.
#ifndef ACCORD_CLIENT_KV_STORE_H_
#define ACCORD_CLIENT_KV_STORE_H_

#include <chrono>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace accord {

// Thread-safe: implementations may be called from any thread.
class KeyValueStore {
 public:
  virtual ~KeyValueStore() = default;
  // Sets (or overwrites) one key of this job.
  virtual absl::Status Set(const std::string& key, const std::string& value) = 0;
  // Returns the values of all keys in order, waiting up to `timeout` for the
  // missing ones (0: do not wait). DEADLINE_EXCEEDED names the missing keys;
  // the coordinator's store waits at most its --deadline and then also names
  // the ranks expected to set them (ask again to wait longer).
  virtual absl::StatusOr<std::vector<std::string>> Get(const std::vector<std::string>& keys,
                                                       std::chrono::milliseconds timeout) = 0;
  // Get, for keys that `expected` (ranks of the job, ascending: a member set)
  // set: a wait that ends without them names only those ranks. A store that
  // names no ranks answers as Get.
  virtual absl::StatusOr<std::vector<std::string>> GetAmong(const std::vector<std::string>& keys,
                                                            std::chrono::milliseconds timeout,
                                                            const std::vector<int>& expected) {
    return Get(keys, timeout);
  }
};

}  // namespace accord

#endif  // ACCORD_CLIENT_KV_STORE_H_
