// Who a job's ranks are, for errors that name the ranks a wait is missing
// (docs/ARCHITECTURE.md, "Every wait names who is missing"). The key-value
// store asks it when a Get ends without its keys; the Coordinator answers
// from its membership.
#ifndef ACCORD_DAEMON_COORDINATOR_RANK_DIRECTORY_H_
#define ACCORD_DAEMON_COORDINATOR_RANK_DIRECTORY_H_

#include <string>
#include <vector>

namespace accord::daemon {

// Thread-safe implementations; callers hold none of their own locks.
class RankDirectory {
 public:
  virtual ~RankDirectory() = default;
  // The world size of the job's current run; 0 when no node of the job is
  // connected here (its ranks are not known).
  virtual int WorldSize(const std::string& job_id) = 0;
  // One description per rank of `ranks`, with its node and whether it is
  // connected (Membership::Describe); empty when the job is not known.
  virtual std::vector<std::string> DescribeRanks(const std::string& job_id,
                                                 const std::vector<int>& ranks) = 0;
};

}  // namespace accord::daemon

#endif  // ACCORD_DAEMON_COORDINATOR_RANK_DIRECTORY_H_
