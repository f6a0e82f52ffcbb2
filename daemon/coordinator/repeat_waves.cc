#include "daemon/coordinator/repeat_waves.h"

#include <algorithm>
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

void RepeatWaves::Reset() {
  base_ = -1;
  members_ = 0;
  wave_ = Wave();
  sync_step_ = -1;
  sync_streams_ = 0;
  sync_groups_ = 0;
  sync_ok_ = false;
}

WaveDomains::WaveDomains(absl::Duration deadline, bool stalls)
    : deadline_(deadline), stalls_(stalls) {
  waves_.emplace_back(deadline_, stalls_);
  parent_.push_back(0);
}

int WaveDomains::ElementOf(const MemberSet* m) {
  if (m == nullptr) return 0;
  auto [it, added] = elements_.try_emplace(m, static_cast<int>(parent_.size()));
  if (added) {
    parent_.push_back(it->second);
    waves_.emplace_back(deadline_, stalls_);
    counted_ = false;
  }
  return it->second;
}

int WaveDomains::Find(int element) {
  while (parent_[element] != element) {
    parent_[element] = parent_[parent_[element]];  // path halving
    element = parent_[element];
  }
  return element;
}

bool WaveDomains::Link(int a, int b) {
  a = Find(a);
  b = Find(b);
  if (a == b) return true;
  if (at(a).holding() || at(b).holding()) return false;
  if (b < a) std::swap(a, b);
  parent_[b] = a;
  at(a).Reset();
  at(b).Reset();
  counted_ = false;
  return true;
}

bool WaveDomains::holding() const {
  for (const RepeatWaves& w : waves_) {
    if (w.holding()) return true;
  }
  return false;
}

bool WaveDomains::AllConnected(int root, const Membership& members) {
  if (!counted_) Count(members);
  return serving_[root] == connected_[root];
}

int WaveDomains::Connected(int root, const Membership& members) {
  if (!counted_) Count(members);
  return connected_[root];
}

void WaveDomains::Count(const Membership& members) {
  for (const auto& [id, node] : members.nodes()) {
    for (const auto& [m, ranks] : node.member_ranks) ElementOf(m);
  }
  serving_.assign(parent_.size(), 0);
  connected_.assign(parent_.size(), 0);
  std::vector<int> roots;
  for (const auto& [id, node] : members.nodes()) {
    roots.assign(1, Find(0));  // every node serves the world
    for (const auto& [m, ranks] : node.member_ranks) roots.push_back(Find(elements_.at(m)));
    std::sort(roots.begin(), roots.end());
    roots.erase(std::unique(roots.begin(), roots.end()), roots.end());
    for (int r : roots) {
      ++serving_[r];
      if (node.connected()) ++connected_[r];
    }
  }
  counted_ = true;
}

}  // namespace accord::daemon
