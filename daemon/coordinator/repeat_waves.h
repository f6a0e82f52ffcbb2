// Repeat waves of one job (docs/ARCHITECTURE.md, "Repeat waves"): whether
// the job is in wave mode, the batch repeats held back for the next step,
// and the sync count that puts the job in wave mode. Data in, data out: time
// is passed in, and what to do is returned; the Job applies it. Not
// thread-safe: the coordinator's lock guards it.
#ifndef ACCORD_DAEMON_COORDINATOR_REPEAT_WAVES_H_
#define ACCORD_DAEMON_COORDINATOR_REPEAT_WAVES_H_

#include <cstdint>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/time/time.h"
#include "daemon/coordinator/batch_record.h"

namespace accord::daemon {

// A node stream's part of the waves.
struct WaveStream {
  // The last step this stream's whole batch was added to (-1: none).
  int64_t synced_step = -1;
  // The step of the wave it joined (-1: none).
  int64_t wave_step = -1;
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

}  // namespace accord::daemon

#endif  // ACCORD_DAEMON_COORDINATOR_REPEAT_WAVES_H_
