// The usage window of one group: what the observe API's skip matrix is
// built from (docs/ARCHITECTURE.md, "Bounds").
#ifndef ACCORD_DAEMON_COORDINATOR_USAGE_WINDOW_H_
#define ACCORD_DAEMON_COORDINATOR_USAGE_WINDOW_H_

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "accord/v1/observe.pb.h"
#include "daemon/coordinator/content.h"

namespace accord::daemon {

// A run of consecutive decided steps of one group with the same node
// contents; the contents are shared and immutable.
struct UsageRun {
  int64_t first_step = 0;
  int64_t steps = 0;
  std::vector<std::shared_ptr<const Content>> contents;
  int64_t bytes = 0;  // approximate size of what `contents` keeps alive
};

// The decided steps of one group, oldest first, runs of identical steps
// stored once, bounded by steps and bytes. Not thread-safe: the
// coordinator's lock guards every window.
class UsageWindow {
 public:
  struct Limits {
    int64_t steps = 1000;             // decided steps kept
    int64_t bytes = 16 << 20;         // bytes this window keeps alive
    int64_t total_bytes = 256 << 20;  // bytes every window together keeps alive
  };

  // Records decided `step`. When `same` (its contents repeat the previous
  // step's) and the step follows the last run, that run grows by one step;
  // otherwise a run of `contents()` starts. Returns the bytes added.
  int64_t Record(int64_t step, bool same,
                 absl::FunctionRef<std::vector<std::shared_ptr<const Content>>()> contents);
  // Drops the oldest runs (or the oldest steps of the oldest run) past
  // `limits`. `total` is what every window together keeps alive, this one
  // included; it is lowered by what is dropped. Past limits.total_bytes the
  // window shrinks to its newest run.
  void Trim(const Limits& limits, int64_t& total);
  // The runs that cover the newest `window` steps (0: all), oldest first.
  std::deque<UsageRun> Newest(int64_t window) const;
  // Hands every run over (a job retiring), leaving this window empty.
  UsageWindow Take();

  int64_t steps() const { return steps_; }
  int64_t bytes() const { return bytes_; }
  const std::deque<UsageRun>& runs() const { return runs_; }

  // The approximate bytes `contents` keep alive.
  static int64_t ContentBytes(const std::vector<std::shared_ptr<const Content>>& contents);
  // The skip matrix of one group over the newest `window` steps of `runs`
  // (0: all): per parameter, per rank, the steps it had no gradient.
  static v1::GroupSkipMatrix MatrixOf(const std::string& group_id,
                                      const std::vector<std::string>& names, int world,
                                      const std::deque<UsageRun>& runs, int64_t window);

 private:
  std::deque<UsageRun> runs_;
  int64_t steps_ = 0;
  int64_t bytes_ = 0;
};

}  // namespace accord::daemon

#endif  // ACCORD_DAEMON_COORDINATOR_USAGE_WINDOW_H_
