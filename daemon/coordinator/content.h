// One node manifest's content as the coordinator keeps it: shared between a
// node's content cache, the pending steps it contributed to and the usage
// windows of the observe API. Immutable once built.
#ifndef ACCORD_DAEMON_COORDINATOR_CONTENT_H_
#define ACCORD_DAEMON_COORDINATOR_CONTENT_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "core/dtype.h"
#include "core/rank_set.h"

namespace accord::daemon {

// One rank's own usage bits, when it differs from its node's (rank_detail).
struct RankDetail {
  int rank;
  std::vector<bool> used;
};

struct Content {
  uint64_t key = 0;
  // Inline for typical groups: one allocation per Content (make_shared).
  absl::InlinedVector<DTypeMask, 32> dtypes;
  std::shared_ptr<const RankSet> ranks;
  int rank_count = 0;
  // ranks->words() is zero outside [word_lo, word_hi): merges OR only those.
  int word_lo = 0;
  int word_hi = 0;
  std::vector<RankDetail> detail;
};

}  // namespace accord::daemon

#endif  // ACCORD_DAEMON_COORDINATOR_CONTENT_H_
