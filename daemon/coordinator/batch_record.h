// What a batch repeat on one node stream stands for: the stream's previous
// batch, its groups resolved once (docs/ARCHITECTURE.md, "Repeat waves").
#ifndef ACCORD_DAEMON_COORDINATOR_BATCH_RECORD_H_
#define ACCORD_DAEMON_COORDINATOR_BATCH_RECORD_H_

#include <cstdint>
#include <string>
#include <vector>

#include "daemon/coordinator/content_cache.h"

namespace accord::daemon {

class GroupState;

// One manifest of a stream's previous batch, resolved once.
struct BatchEntry {
  std::string group_id;
  uint64_t cache_key = 0;
  GroupState* group = nullptr;  // nullptr: unknown when recorded
  NodeGroupState* node_group = nullptr;
};

struct BatchRecord {
  std::vector<BatchEntry> entries;
  // wire::BatchKeyHasher over entries, taken when the batch is recorded
  // (0: no batch yet).
  uint64_t key = 0;
  // A hash of the entries' resolved groups, in order (0: not computed).
  uint64_t groups_key = 0;
  uint64_t GroupsKey();
};

}  // namespace accord::daemon

#endif  // ACCORD_DAEMON_COORDINATOR_BATCH_RECORD_H_
