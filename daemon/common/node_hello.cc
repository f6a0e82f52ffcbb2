#include "daemon/common/node_hello.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "proto/wire.h"

namespace accord::daemon {

absl::StatusOr<std::vector<int>> CheckNodeHello(const v1::NodeHello& hello, int max_world_size,
                                                absl::string_view receiver) {
  if (hello.job_id().empty() || hello.node_id().empty()) {
    return wire::KindError(v1::INVALID_REQUEST, "NodeHello needs a job_id and a node_id");
  }
  const int world = hello.world_size();
  if (world > max_world_size) {
    return wire::KindError(
        v1::LIMIT_EXCEEDED,
        absl::StrCat("job ", hello.job_id(), ": world size ", world, " from node \"",
                     hello.node_id(), "\" exceeds --max_ranks=", max_world_size, "; raise the ",
                     receiver, "'s --max_ranks"));
  }
  if (world < 1) {
    return wire::KindError(v1::INVALID_REQUEST,
                           absl::StrCat("job ", hello.job_id(), ": world size ", world,
                                        " from node \"", hello.node_id(), "\" must be at least 1"));
  }
  std::vector<int> ranks(hello.ranks().begin(), hello.ranks().end());
  std::sort(ranks.begin(), ranks.end());
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (ranks[i] < 0 || ranks[i] >= world || (i > 0 && ranks[i] == ranks[i - 1])) {
      return wire::KindError(
          v1::INVALID_REQUEST,
          absl::StrCat("job ", hello.job_id(), ": node \"", hello.node_id(), "\" announced rank ",
                       ranks[i], " twice or outside 0..", world - 1));
    }
  }
  return ranks;
}

absl::Status CheckNodeJoins(absl::string_view job_id, int job_world, const v1::NodeHello& hello,
                            absl::FunctionRef<RankHeldElsewhere()> held_elsewhere) {
  if (job_world != hello.world_size()) {
    return wire::KindError(
        v1::WORLD_SIZE_MISMATCH,
        absl::StrCat("job ", job_id, ": node \"", hello.node_id(), "\" says world size ",
                     hello.world_size(), " but the job has world size ", job_world,
                     "; check WORLD_SIZE of every launcher"));
  }
  if (const RankHeldElsewhere held = held_elsewhere(); held.rank >= 0) {
    return wire::KindError(
        v1::DUPLICATE_RANK,
        absl::StrCat("job ", job_id, ": rank ", held.rank, " is already served by node \"",
                     held.node_id, "\"; node \"", hello.node_id(),
                     "\" announced it too. Check RANK of the processes on both nodes"));
  }
  return absl::OkStatus();
}

}  // namespace accord::daemon
