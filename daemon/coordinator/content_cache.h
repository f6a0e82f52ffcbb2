// What the coordinator keeps of one node's manifests for one group: the
// content its last full-form manifest named (a repeat-form manifest names it
// again by key), the older contents its pending steps still name, the steps
// it contributed to, and its skip counts (docs/ARCHITECTURE.md, "Classes").
#ifndef ACCORD_DAEMON_COORDINATOR_CONTENT_CACHE_H_
#define ACCORD_DAEMON_COORDINATOR_CONTENT_CACHE_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/inlined_vector.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "accord/v1/accord.pb.h"
#include "daemon/coordinator/content.h"

namespace accord::daemon {

// The ranks a node serves, as a full-form manifest needs them.
struct ServedRanks {
  absl::string_view node_id;
  int count = 0;
  const std::shared_ptr<const RankSet>& set;
  // set->words() is zero outside [word_lo, word_hi).
  int word_lo = 0;
  int word_hi = 0;
  // `set` is the node's ranks among the group's members.
  bool members = false;
};

// Parses a full-form manifest of a group of `num_params` parameters from the
// node serving `node`. A manifest without rank_bits speaks for all the node's
// ranks (their set is shared, not copied). INVALID_ARGUMENT (the kind in the
// payload: NON_FLOAT_DTYPE for an integer gradient) naming group, step and
// field for a manifest that does not parse or names ranks the node does not
// serve.
absl::StatusOr<std::shared_ptr<const Content>> ParseContent(const ServedRanks& node,
                                                            size_t num_params, int world,
                                                            const v1::Manifest& m);

// A full-form manifest's dtypes, decoded before the coordinator's lock is
// taken, without the group's registration (docs/ARCHITECTURE.md, "More than
// one core"). Only the common node form is decoded: no rank_bits (all the
// node's ranks), no rank_detail, a cache key; `content` is null otherwise,
// or when it does not decode. With dtype_masks the parameter count is
// theirs; with uniform_dtype it is 8 * used_bits' size.
struct PredecodedContent {
  std::shared_ptr<Content> content;
  bool masks = false;
};
PredecodedContent PredecodeContent(const v1::Manifest& m);

// What ParseContent(node, num_params, world, m) returns for a manifest that
// PredecodeContent decoded into `pre` (taking pre.content), or nullptr when
// the decoded form does not fit the registration's `num_params` (then
// ParseContent decides, and words any error). The same Content either way.
std::shared_ptr<const Content> ContentFromPredecoded(const ServedRanks& node, size_t num_params,
                                                     const v1::Manifest& m, PredecodedContent& pre);

// One node's contents for one group. Pending steps point at contents
// without owning them: the cache owns the current one and `retained_` the
// older ones still named by the node's pending steps, each kept until the
// last step that used it is older than every pending step of the node (so
// at most the node's pending steps of the group). Not thread-safe: the
// coordinator's lock guards it.
class ContentCache {
 public:
  // Forgets contributions to steps up to `last_decided_step` and the
  // retained contents only those named; returns how many contents went.
  int64_t Prune(int64_t last_decided_step);
  // The cached content when `key` names it (a repeat-form manifest);
  // nullptr when the cache is empty or holds another key.
  const Content* Repeat(uint64_t key) const {
    return current_ != nullptr && key_ == key ? current_.get() : nullptr;
  }
  // A full-form manifest's content becomes the cache; the previous one is
  // retained while a step this node contributed to may name it. Returns how
  // many contents were retained (0 or 1).
  int64_t Replace(std::shared_ptr<const Content> content);
  // Whether the node already contributed to `step`; AddStep records it.
  bool Contributed(int64_t step) const;
  void AddStep(int64_t step) { steps_.push_back(step); }
  // The owning pointer of a content a pending step names (nullptr: not held).
  std::shared_ptr<const Content> Owner(const Content* content) const;

  const std::shared_ptr<const Content>& current() const { return current_; }
  // current()->key and ->rank_count, kept here so a repeat does not touch
  // the Content (one cache miss fewer per node and group at scale).
  uint64_t key() const { return key_; }
  int rank_count() const { return rank_count_; }
  size_t retained() const { return retained_.size(); }

  // Skip accounting (Coordinator::SkipCounts): the current content was in
  // effect for one more contribution. Counts are folded in lazily (a run of
  // identical contributions costs one increment each).
  void CountSkips();
  // `n` more contributions of the current content at once: the repeat waves
  // a node went through (Coordinator, docs/ARCHITECTURE.md, "Repeat waves").
  void AddSkipSteps(int64_t n);
  // Folds the pending run into node_skips() and rank_extra_skips().
  void FlushSkips();
  // Per param: contributions at which the whole node lacked it.
  const std::vector<int64_t>& node_skips() const { return node_skips_; }
  // Per rank with rank_detail, per param: contributions at which the node
  // had the param but that rank did not use it.
  const absl::flat_hash_map<int, std::vector<int64_t>>& rank_extra_skips() const {
    return rank_extra_skips_;
  }

 private:
  struct Retained {
    std::shared_ptr<const Content> content;
    int64_t last_step = 0;
  };
  std::shared_ptr<const Content> current_;
  uint64_t key_ = 0;
  int rank_count_ = 0;
  absl::flat_hash_map<const Content*, Retained> retained_;
  // Pending steps this node spoke for (few: the pending window).
  absl::InlinedVector<int64_t, 4> steps_;
  std::shared_ptr<const Content> skip_content_;
  int64_t skip_steps_ = 0;
  std::vector<int64_t> node_skips_;
  absl::flat_hash_map<int, std::vector<int64_t>> rank_extra_skips_;
};

// What a node keeps per group: its registration variant and its contents.
struct NodeGroupState {
  int variant = -1;  // index of this node's registration variant, -1: none
  ContentCache contents;
  // The group's repeat-wave count (GroupState::waves) already folded into
  // `contents`' skip accounting.
  int64_t waves_counted = 0;
};

}  // namespace accord::daemon

#endif  // ACCORD_DAEMON_COORDINATOR_CONTENT_CACHE_H_
