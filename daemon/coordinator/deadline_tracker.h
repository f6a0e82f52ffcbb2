// The deadline of one pending (group, step) and the progress queries past it
// (protocol step 4 in coordinator.h; docs/ARCHITECTURE.md, "Silent ranks").
#ifndef ACCORD_DAEMON_COORDINATOR_DEADLINE_TRACKER_H_
#define ACCORD_DAEMON_COORDINATOR_DEADLINE_TRACKER_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/time/time.h"

namespace accord::daemon {

struct NodeState;

// A step's clock starts at its first submission (a node manifest, or a
// sidecar's partial report of when its first rank submitted). Its phases:
//
//   kRunning --(deadline; nodes to ask)--> kAsking --(every asked node
//       answered, or the grace ended)--> due to fail
//   kRunning --(deadline; nobody to ask)--> due to fail
//
// and at half the deadline (once) a stall is due for the observer. What the
// asked sidecars said of their own ranks (submitted, last steps) is kept for
// the failure's message. Not thread-safe: the coordinator's lock guards it.
class StepDeadline {
 public:
  enum class Phase { kRunning, kAsking };
  // What Check finds due at `now`.
  enum class Due {
    kNothing,  // `next` says when to check again
    kStall,    // half the deadline passed: report the stall (once)
    kAsk,      // the deadline passed: ask the nodes with missing ranks (Ask), or fail
    kFail,     // past the deadline and the answers (or the grace): fail the step
  };

  StepDeadline(absl::Time first_seen, absl::Duration deadline)
      : first_seen_(first_seen), deadline_(first_seen + deadline), half_(deadline / 2) {}
  // Whether the clock runs: one built with first_seen InfiniteFuture never
  // has anything due (a step only `decided` manifests speak for;
  // docs/ARCHITECTURE.md, "Decisions across a coordinator restart").
  bool started() const { return first_seen_ != absl::InfiniteFuture(); }

  // What is due at `now` (see Due); lowers `next` to when the step needs
  // the next check. `stalls`: whether stall reports are wanted.
  Due Check(absl::Time now, bool stalls, absl::Time& next);
  // The deadline passed and `asked` (not empty) were asked which of their
  // ranks submitted; the step fails at `grace_end` at the latest.
  void Ask(std::vector<const NodeState*> asked, absl::Time grace_end);
  enum class Answered {
    kIgnored,  // not asked, or answered already: its answer is not used
    kMore,     // taken; other asked nodes have not answered yet
    kAll,      // taken, the last one awaited: the step is due to fail now
  };
  // `node` answered at `now`.
  Answered Answer(const NodeState* node, absl::Time now);
  // What an asked (or partially submitted) node said of one of its ranks.
  void AddReported(int rank) { reported_.push_back(rank); }
  void AddLastStep(int rank, int64_t last_step) { last_steps_.emplace_back(rank, last_step); }
  // The node a relay says serves `rank` (its sidecar, docs/ARCHITECTURE.md, "Relays").
  void AddRankNode(int rank, std::string node) { rank_nodes_.emplace_back(rank, std::move(node)); }

  Phase phase() const { return phase_; }
  absl::Time first_seen() const { return first_seen_; }
  absl::Time deadline() const { return deadline_; }
  // The first time a stall is due (half the deadline).
  absl::Time stall_at() const { return first_seen_ + half_; }
  absl::Time grace_end() const { return grace_end_; }
  // Ranks their sidecars said submitted the step.
  const std::vector<int>& reported() const { return reported_; }
  // (rank, last step) as their sidecars said.
  const std::vector<std::pair<int, int64_t>>& last_steps() const { return last_steps_; }
  // (rank, node) as relays said.
  const std::vector<std::pair<int, std::string>>& rank_nodes() const { return rank_nodes_; }

 private:
  absl::Time first_seen_;
  absl::Time deadline_;
  absl::Duration half_;
  bool stall_reported_ = false;
  Phase phase_ = Phase::kRunning;
  std::vector<const NodeState*> unanswered_;       // asked, no answer yet
  absl::Time grace_end_ = absl::InfiniteFuture();  // moved to the last answer's time
  std::vector<int> reported_;
  std::vector<std::pair<int, int64_t>> last_steps_;
  std::vector<std::pair<int, std::string>> rank_nodes_;
};

}  // namespace accord::daemon

#endif  // ACCORD_DAEMON_COORDINATOR_DEADLINE_TRACKER_H_
