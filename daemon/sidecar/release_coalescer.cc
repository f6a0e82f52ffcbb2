#include "daemon/sidecar/release_coalescer.h"

#include <algorithm>
#include <limits>
#include <utility>

namespace accord::daemon {
namespace {

constexpr int64_t kEveryHold = std::numeric_limits<int64_t>::max();

// The class keys in ascending order: flushes of several classes go out in
// an order that does not depend on hashing.
template <typename Map>
std::vector<uint64_t> SortedKeys(const Map& classes) {
  std::vector<uint64_t> keys;
  keys.reserve(classes.size());
  for (const auto& [k, c] : classes) keys.push_back(k);
  std::sort(keys.begin(), keys.end());
  return keys;
}

}  // namespace

ReleaseCoalescer::Release ReleaseCoalescer::NoteRelease(int rank, uint64_t key) {
  if (key == 0) return Release{};
  SyncClass& c = classes_[key];
  return Release{key, ++c.counts[rank]};
}

bool ReleaseCoalescer::Ready(const SyncClass& c, int64_t n) {
  for (const auto& [rank, count] : c.counts) {
    if (count < n) return false;
  }
  return true;
}

absl::Time ReleaseCoalescer::Complete(absl::Time now, const Release& release, Batch& items,
                                      std::vector<Batch>* out) {
  const bool hold = release.key != 0 && hold_limit_ > absl::ZeroDuration();
  const Release at = hold ? release : Release{};
  const int64_t n = KeepGroupOrder(at, items, out);
  absl::Time due = absl::InfiniteFuture();
  if (!hold) {
    if (!items.empty()) out->push_back(std::move(items));
    items.clear();
    if (release.key != 0) FlushReady(release.key, out);
    return due;
  }
  SyncClass& c = classes_[release.key];
  if (!items.empty()) {
    auto [it, added] = c.holds.try_emplace(n);
    if (added) it->second.since = now;
    for (OutgoingManifest& o : items) {
      held_at_[o.group->index] = HeldAt{release.key, n};
      it->second.items.push_back(std::move(o));
    }
    items.clear();
  }
  FlushReady(release.key, out);
  auto it = c.holds.find(n);
  if (it != c.holds.end()) due = it->second.since + hold_limit_;
  return due;
}

int64_t ReleaseCoalescer::KeepGroupOrder(const Release& release, const Batch& items,
                                         std::vector<Batch>* out) {
  int64_t n = release.n;
  for (const OutgoingManifest& o : items) {
    auto it = held_at_.find(o.group->index);
    if (it == held_at_.end()) continue;
    const HeldAt at = it->second;
    if (release.key != 0 && at.key == release.key) {
      // Joins the group's latest hold in its class, or a later one.
      n = std::max(n, at.n);
      continue;
    }
    FlushUpTo(at.key, at.n, out);
  }
  return n;
}

void ReleaseCoalescer::FlushUpTo(uint64_t key, int64_t upto, std::vector<Batch>* out) {
  auto cit = classes_.find(key);
  if (cit == classes_.end()) return;
  std::map<int64_t, Hold>& holds = cit->second.holds;
  while (!holds.empty() && holds.begin()->first <= upto) {
    const int64_t n = holds.begin()->first;
    Batch items = std::move(holds.begin()->second.items);
    holds.erase(holds.begin());
    std::stable_sort(items.begin(), items.end(),
                     [](const OutgoingManifest& a, const OutgoingManifest& b) {
                       if (a.group->index != b.group->index) {
                         return a.group->index < b.group->index;
                       }
                       return a.step < b.step;
                     });
    for (const OutgoingManifest& o : items) {
      auto it = held_at_.find(o.group->index);
      if (it != held_at_.end() && it->second.key == key && it->second.n == n) held_at_.erase(it);
    }
    if (!items.empty()) out->push_back(std::move(items));
  }
}

void ReleaseCoalescer::FlushReady(uint64_t key, std::vector<Batch>* out) {
  auto cit = classes_.find(key);
  if (cit == classes_.end()) return;
  const SyncClass& c = cit->second;
  int64_t upto = -1;
  for (const auto& [n, hold] : c.holds) {
    if (!Ready(c, n)) break;
    upto = n;
  }
  if (upto >= 0) FlushUpTo(key, upto, out);
}

void ReleaseCoalescer::RemoveRank(int rank, std::vector<Batch>* out) {
  for (uint64_t key : SortedKeys(classes_)) {
    SyncClass& c = classes_[key];
    if (c.counts.erase(rank) == 0) continue;
    FlushUpTo(key, kEveryHold, out);
    if (c.counts.empty()) classes_.erase(key);
  }
}

void ReleaseCoalescer::FlushClassesOf(int rank, std::vector<Batch>* out) {
  for (uint64_t key : SortedKeys(classes_)) {
    if (classes_[key].counts.count(rank) != 0) FlushUpTo(key, kEveryHold, out);
  }
}

void ReleaseCoalescer::RestartRank(int rank, std::vector<Batch>* out) {
  for (uint64_t key : SortedKeys(classes_)) {
    SyncClass& c = classes_[key];
    if (c.counts.count(rank) == 0) continue;
    FlushUpTo(key, kEveryHold, out);
    // Its next release is numbered after the class's latest: a release it
    // sent before its stream ended, or one it resends unkeyed, then counts
    // as the class's.
    int64_t most = 0;
    for (const auto& [r, count] : c.counts) most = std::max(most, count);
    c.counts[rank] = most;
  }
}

absl::Time ReleaseCoalescer::CheckHolds(absl::Time now, std::vector<Batch>* out) {
  absl::Time next = absl::InfiniteFuture();
  if (hold_limit_ <= absl::ZeroDuration()) return next;
  for (uint64_t key : SortedKeys(classes_)) {
    SyncClass& c = classes_[key];
    int64_t upto = -1;
    for (const auto& [n, hold] : c.holds) {
      if (hold.since + hold_limit_ <= now) upto = n;
    }
    if (upto >= 0) {
      ++expired_;
      FlushUpTo(key, upto, out);
    }
    for (const auto& [n, hold] : c.holds) next = std::min(next, hold.since + hold_limit_);
  }
  return next;
}

void ReleaseCoalescer::DropHolds() {
  for (auto& [key, c] : classes_) c.holds.clear();
  held_at_.clear();
}

void ReleaseCoalescer::Clear() {
  classes_.clear();
  held_at_.clear();
}

size_t ReleaseCoalescer::held_manifests() const {
  size_t total = 0;
  for (const auto& [key, c] : classes_) {
    for (const auto& [n, hold] : c.holds) total += hold.items.size();
  }
  return total;
}

}  // namespace accord::daemon
