// ReleaseCoalescer: the sidecar's release coalescing by sync_key
// (docs/MEMBERS.md 2.11, "One record per node per step"). No lock, no
// thread, time passed in, batches to send returned: SidecarJob calls it with
// its caller's lock held and sends what it returns, in order.
//
// [Note: sync classes] A rank's ManifestBatch with sync_key k (a release
// batch) makes the rank a member of k's sync class and counts as its n-th
// release with key k. Node manifests completed by that batch are held as
// hold (k, n) until every connected rank of k's class has sent its n-th
// release with key k; then hold (k, n) goes upstream as ONE batch, sorted by
// LocalGroup::index (then step), so that the next equal step is the same
// batch and travels as a batch repeat. Holds of one class leave in n order.
// A hold is flushed early when a rank of its class leaves (RemoveRank) or
// resumes (RestartRank: the rank's count becomes the class's largest, so
// its next release is numbered with the others' next one), and when it is
// older than the hold limit (half the coordinator's deadline, the
// partial-report delay): a silent rank delays its class's manifests by at
// most that, and its own groups are reported partial as without holds.
// Manifests completed by a batch without a key go at once. A group's manifests never overtake each
// other: a batch naming a group held elsewhere flushes that hold first.
//
// Holding changes only when a manifest leaves the node, never its content
// or step. Memory: the held manifests (pointers to node manifests the
// sidecar keeps anyway for resends) and one count per (class, rank).
//
// Not thread-safe; owned by SidecarJob.
#ifndef ACCORD_DAEMON_SIDECAR_RELEASE_COALESCER_H_
#define ACCORD_DAEMON_SIDECAR_RELEASE_COALESCER_H_

#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/time/time.h"
#include "accord/v1/accord.pb.h"
#include "daemon/sidecar/local_group.h"

namespace accord::daemon {

// A node manifest ready to go upstream.
struct OutgoingManifest {
  const LocalGroup* group;
  int64_t step;
  bool repeat;
  uint64_t key;
  std::shared_ptr<const v1::Manifest> full;  // full form (step unset) when !repeat
};

class ReleaseCoalescer {
 public:
  using Batch = std::vector<OutgoingManifest>;
  // Which release of its class a keyed batch is (key 0: not a release).
  struct Release {
    uint64_t key = 0;
    int64_t n = 0;
  };

  // Holds older than `limit` are flushed; zero: nothing is held (no
  // deadline known yet). A shorter limit applies at the next CheckHolds.
  void SetHoldLimit(absl::Duration limit) { hold_limit_ = limit; }
  absl::Duration hold_limit() const { return hold_limit_; }

  // `rank` sent a batch with sync_key `key`: its release number in k's class
  // (the rank joins the class at its first). key 0: Release{} (none).
  Release NoteRelease(int rank, uint64_t key);

  // The node manifests `items` were completed by a batch that was `release`
  // (Release{}: a batch without key). Appends the batches to send now, in
  // order, to `out`; `items` is emptied. Returns when a hold made here is
  // due for its flush (InfiniteFuture: nothing new held).
  absl::Time Complete(absl::Time now, const Release& release, Batch& items,
                      std::vector<Batch>* out);

  // `rank` left: it leaves every class, whose holds are flushed into `out`.
  void RemoveRank(int rank, std::vector<Batch>* out);
  // `rank`'s stream ended and it may resume: the holds of its classes are
  // flushed into `out`; it stays in them with its count.
  void FlushClassesOf(int rank, std::vector<Batch>* out);
  // `rank` resumed: the holds of its classes are flushed into `out` and its
  // count in each becomes the class's largest.
  void RestartRank(int rank, std::vector<Batch>* out);

  // Flushes the holds older than the hold limit into `out`; returns when the
  // next one is due (InfiniteFuture: none held).
  absl::Time CheckHolds(absl::Time now, std::vector<Batch>* out);

  // Drops every hold, keeping the classes and counts: a new upstream stream
  // resends every undecided node manifest, held ones included.
  void DropHolds();
  // Forgets every class and hold (the job ended).
  void Clear();

  // Held node manifests now, and classes.
  size_t held_manifests() const;
  size_t classes() const { return classes_.size(); }
  // Holds flushed by the hold limit since construction.
  int64_t expired() const { return expired_; }

 private:
  struct Hold {
    absl::Time since;
    Batch items;
  };
  struct SyncClass {
    std::map<int, int64_t> counts;  // per connected rank of the class: releases sent
    std::map<int64_t, Hold> holds;  // by release number
  };
  struct HeldAt {
    uint64_t key = 0;
    int64_t n = 0;
  };

  // Whether every rank of `c` has sent its n-th release.
  static bool Ready(const SyncClass& c, int64_t n);
  // Moves the holds of class `key` up to release `upto` into `out`, in order.
  void FlushUpTo(uint64_t key, int64_t upto, std::vector<Batch>* out);
  // Moves the ready holds of class `key` into `out`, in order.
  void FlushReady(uint64_t key, std::vector<Batch>* out);
  // Flushes whatever holds an earlier manifest of a group of `items` and
  // would otherwise leave after them (held under another key, or not held
  // now); returns the release number `items` join in class `key`.
  int64_t KeepGroupOrder(const Release& release, const Batch& items, std::vector<Batch>* out);

  absl::Duration hold_limit_ = absl::ZeroDuration();
  absl::flat_hash_map<uint64_t, SyncClass> classes_;
  // Per held group (LocalGroup::index): the hold with its latest manifest.
  absl::flat_hash_map<int, HeldAt> held_at_;
  int64_t expired_ = 0;
};

}  // namespace accord::daemon

#endif  // ACCORD_DAEMON_SIDECAR_RELEASE_COALESCER_H_
