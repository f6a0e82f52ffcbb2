// The checks of a NodeHello that every receiver of node streams runs, the
// coordinator and the relay alike (docs/ARCHITECTURE.md, "Relays"), so that
// both refuse the same hellos with the same errors. Each returns a status
// with its ErrorKind attached (wire::WithKind), its code from the kind
// (wire::CodeOfKind). Needs accord_wire.
#ifndef ACCORD_DAEMON_COMMON_NODE_HELLO_H_
#define ACCORD_DAEMON_COMMON_NODE_HELLO_H_

#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "accord/v1/accord.pb.h"

namespace accord::daemon {

// What needs no state: a job and a node id, a world size in 1..max_world_size
// (`receiver`, e.g. "coordinator", owns the --max_ranks flag that sets it),
// each announced rank in range and announced once. Returns the ranks,
// ascending; INVALID_REQUEST or LIMIT_EXCEEDED otherwise.
absl::StatusOr<std::vector<int>> CheckNodeHello(const v1::NodeHello& hello, int max_world_size,
                                                absl::string_view receiver);

// A rank of the hello that another connected node serves now, and that
// node's id (rank -1: none).
struct RankHeldElsewhere {
  int rank = -1;
  std::string node_id;
};

// Whether the hello's node may join job `job_id` of world size `job_world`:
// WORLD_SIZE_MISMATCH when the world sizes differ, else DUPLICATE_RANK when
// `held_elsewhere()` (asked only once the hello's ranks are known to be in
// the job's range) names a rank.
absl::Status CheckNodeJoins(absl::string_view job_id, int job_world, const v1::NodeHello& hello,
                            absl::FunctionRef<RankHeldElsewhere()> held_elsewhere);

}  // namespace accord::daemon

#endif  // ACCORD_DAEMON_COMMON_NODE_HELLO_H_
