// Repeat waves of one job (docs/ARCHITECTURE.md, "Repeat waves"), one
// RepeatWaves per wave domain (docs/MEMBERS.md 2.11): whether the domain is
// in wave mode, the batch repeats held back for the next step, and the sync
// count that puts it in wave mode. Data in, data out: time is passed in, and
// what to do is returned; the Job applies it. Not thread-safe: the
// coordinator's lock guards it.
#ifndef ACCORD_DAEMON_COORDINATOR_REPEAT_WAVES_H_
#define ACCORD_DAEMON_COORDINATOR_REPEAT_WAVES_H_

#include <cstdint>
#include <deque>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/functional/function_ref.h"
#include "absl/time/time.h"
#include "daemon/coordinator/batch_record.h"
#include "daemon/coordinator/membership.h"

namespace accord::daemon {

// A node stream's part of the waves.
struct WaveStream {
  // The last step this stream's whole batch was added to (-1: none).
  int64_t synced_step = -1;
  // The step of the wave it joined (-1: none).
  int64_t wave_step = -1;
  // The wave domain its record was counted in at synced_step (-1: none; a
  // domain linked into another since is reset and joins nothing).
  int domain = -1;
};

class RepeatWaves {
 public:
  using StreamId = uint64_t;
  // Batch repeats of one step held back: nothing per group happens until
  // every node is in.
  struct Wave {
    int64_t step = -1;
    absl::Time first_seen;
    absl::Time wake;                // the stall or deadline check a pending step would have
    std::vector<StreamId> streams;  // arrival order
  };
  // `deadline`: the step deadline; `stalls`: whether pending steps also
  // wake at half of it (an observer is set).
  RepeatWaves(absl::Duration deadline, bool stalls) : deadline_(deadline), stalls_(stalls) {}

  // After a batch handled entry by entry on a stream: `all_added` when every
  // entry of `record` was added to `step`. Puts the job in wave mode when
  // every node did so at the step (`whole`: the job is running with every
  // node connected, `connected` of them) and each group of the record was
  // decided ok from them with nothing pending.
  void NoteSynced(WaveStream& s, BatchRecord& record, int64_t step, bool all_added, bool whole,
                  int connected);

  enum class Join {
    kNo,        // not a wave join: handle the repeat entry by entry (nothing changed)
    kHeld,      // held back; `*wake` set when the timer must look at the wave
    kComplete,  // held back, and the wave is complete: Take() it and decide
  };
  // A batch repeat (`batch_key`, at `step`) on stream `id`. `now` is read
  // only when the repeat starts a wave (once per wave, not per node).
  Join TryJoin(StreamId id, WaveStream& s, const BatchRecord& record, int64_t step,
               uint64_t batch_key, bool failed, absl::FunctionRef<absl::Time()> now,
               absl::Time* wake);
  // The complete wave, taken out; the job stays in wave mode at its step.
  Wave TakeComplete();
  // Any other event of the job: leaves wave mode, returning the held-back
  // repeats (their streams' wave_step must be reset by the caller).
  Wave Break();
  // After Break's repeats were handled entry by entry (which may have
  // synced again): wave mode stays off until the job syncs again.
  void Left() { base_ = -1; }
  // A stream counted at `step` sent another batch at it: the step is no
  // base.
  void Spoil(int64_t step) {
    if (sync_step_ == step) sync_ok_ = false;
  }
  // Back to the state of a new job (nothing held).
  void Reset();

  bool holding() const { return !wave_.streams.empty(); }
  absl::Time wake() const { return wave_.wake; }

 private:
  const absl::Duration deadline_;
  const bool stalls_;
  // base_ >= 0: at that step every connected node (all of the job's nodes,
  // members_ streams) contributed its whole batch record, the records name
  // the same groups, each of them was decided ok with nothing pending, and
  // nothing but wave joins happened since.
  int64_t base_ = -1;
  int members_ = 0;
  Wave wave_;
  // Streams whose whole batch was added at sync_step_; sync_groups_: their
  // records' GroupsKey, sync_ok_: all the same so far.
  int64_t sync_step_ = -1;
  int sync_streams_ = 0;
  uint64_t sync_groups_ = 0;
  bool sync_ok_ = false;
};

// The wave domains of one job (docs/MEMBERS.md 2.11): connected components
// of member sets, two sets linked when one synced record names groups of
// both, each with its RepeatWaves. Element 0 is the job's world (groups
// without members, which every node serves): a job without member sets has
// one domain, world(). A domain's nodes are the nodes serving any of its
// member sets; counted again after Changed().
class WaveDomains {
 public:
  WaveDomains(absl::Duration deadline, bool stalls);

  RepeatWaves& world() { return waves_.front(); }
  // The element of member set `m` (null: the world), assigned on first sight.
  int ElementOf(const MemberSet* m);
  int Find(int element);
  // Links the domains of two elements; false (nothing changes) when either
  // holds a wave. The linked domain starts over (no base).
  bool Link(int a, int b);
  // The waves of a domain: `element` a root, or a stale root, whose waves
  // were reset when it was linked and hold nothing.
  RepeatWaves& at(int element) { return waves_[static_cast<size_t>(element)]; }
  int elements() const { return static_cast<int>(parent_.size()); }
  bool IsRoot(int element) const { return parent_[static_cast<size_t>(element)] == element; }
  bool holding() const;

  // The nodes of the job changed (connected, disconnected, ranks or member
  // sets): the domains' node counts are taken again when next asked.
  void Changed() { counted_ = false; }
  // Whether every node of domain `root` is connected, and how many are.
  bool AllConnected(int root, const Membership& members);
  int Connected(int root, const Membership& members);

 private:
  void Count(const Membership& members);

  const absl::Duration deadline_;
  const bool stalls_;
  std::deque<RepeatWaves> waves_;  // per element; only roots' are used
  std::vector<int> parent_;
  absl::flat_hash_map<const MemberSet*, int> elements_;
  bool counted_ = false;
  std::vector<int> serving_;    // per root: nodes serving a member set of it
  std::vector<int> connected_;  // per root: those connected
};

}  // namespace accord::daemon

#endif  // ACCORD_DAEMON_COORDINATOR_REPEAT_WAVES_H_
