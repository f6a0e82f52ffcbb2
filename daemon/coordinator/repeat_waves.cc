#include "daemon/coordinator/repeat_waves.h"

#include <utility>

#include "absl/hash/hash.h"
#include "daemon/coordinator/deadline_tracker.h"
#include "daemon/coordinator/group_state.h"

namespace accord::daemon {

uint64_t BatchRecord::GroupsKey() {
  if (groups_key == 0) {
    uint64_t h = entries.size();
    for (const BatchEntry& e : entries) h = absl::HashOf(h, e.group);
    groups_key = h | 1;
  }
  return groups_key;
}

void RepeatWaves::NoteSynced(WaveStream& s, BatchRecord& record, int64_t step, bool all_added,
                             bool whole, int connected) {
  if (sync_step_ != step) {
    sync_step_ = step;
    sync_streams_ = 0;
    sync_ok_ = true;
  }
  if (!all_added || record.entries.empty()) return;
  if (s.synced_step == step) {
    sync_ok_ = false;  // a second batch at the step: its record is not the step's
    return;
  }
  s.synced_step = step;
  const uint64_t groups = record.GroupsKey();
  if (sync_streams_ == 0) {
    sync_groups_ = groups;
  } else if (groups != sync_groups_) {
    sync_ok_ = false;
  }
  ++sync_streams_;
  if (!sync_ok_ || !whole || sync_streams_ != connected) return;
  // Every node added its whole record at `step`: each group decided it from
  // exactly these contents. Once per step, O(groups).
  for (const BatchEntry& e : record.entries) {
    const GroupState& g = *e.group;
    if (g.last_decided_step() != step || !g.pending.empty() || !g.last_ok() ||
        g.last_decision() == nullptr) {
      return;
    }
  }
  base_ = step;
  members_ = sync_streams_;
}

RepeatWaves::Join RepeatWaves::TryJoin(StreamId id, WaveStream& s, const BatchRecord& record,
                                       int64_t step, uint64_t batch_key, bool failed,
                                       absl::FunctionRef<absl::Time()> now, absl::Time* wake) {
  if (base_ < 0 || failed || s.synced_step != base_ || step <= base_ || s.wave_step == step ||
      (!wave_.streams.empty() && wave_.step != step) || record.key != batch_key) {
    return Join::kNo;
  }
  if (wave_.streams.empty()) {
    wave_.step = step;
    wave_.first_seen = now();
    // The check the entry-by-entry path's pending steps would wake for.
    const StepDeadline clock(wave_.first_seen, deadline_);
    wave_.wake = stalls_ ? clock.stall_at() : clock.deadline();
    *wake = wave_.wake;
  }
  wave_.streams.push_back(id);
  s.wave_step = step;
  return static_cast<int>(wave_.streams.size()) == members_ ? Join::kComplete : Join::kHeld;
}

RepeatWaves::Wave RepeatWaves::TakeComplete() {
  Wave wave = std::move(wave_);
  wave_ = Wave();
  base_ = wave.step;
  sync_step_ = wave.step;
  sync_streams_ = static_cast<int>(wave.streams.size());
  return wave;
}

RepeatWaves::Wave RepeatWaves::Break() {
  base_ = -1;
  if (wave_.streams.empty()) return Wave();
  Wave wave = std::move(wave_);
  wave_ = Wave();
  return wave;
}

}  // namespace accord::daemon
