#include "daemon/coordinator/content_cache.h"

#include <algorithm>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "core/manifest.h"
#include "proto/wire.h"

namespace accord::daemon {

absl::StatusOr<std::shared_ptr<const Content>> ParseContent(const ServedRanks& node,
                                                            size_t num_params, int world,
                                                            const v1::Manifest& m) {
  const bool all_node_ranks = m.rank_bits().empty();
  if (node.set == nullptr || (all_node_ranks && node.count == 0)) {
    return absl::InvalidArgumentError(absl::StrCat("node \"", node.node_id, "\" serves no rank",
                                                   node.members ? " among the group's members" : "",
                                                   " but sent a manifest"));
  }
  auto content = std::make_shared<Content>();
  // The node's own rank set is shared when the manifest speaks for all its
  // ranks: only the dtypes are decoded (no rank set per manifest).
  absl::StatusOr<Manifest> parsed;
  if (all_node_ranks) {
    content->dtypes.resize(num_params);
    if (absl::Status s = wire::ManifestDTypesFromProto(m, num_params, content->dtypes.data());
        !s.ok()) {
      return s;
    }
    content->ranks = node.set;
    content->rank_count = node.count;
    if (m.cache_key() == 0) {  // only the key needs a Manifest
      parsed.emplace();
      parsed->dtypes.assign(content->dtypes.begin(), content->dtypes.end());
      parsed->ranks = *node.set;
    }
  } else {
    parsed = wire::ManifestFromProto(m, num_params, world, -1);
    if (!parsed.ok()) return parsed.status();
    const auto& words = parsed->ranks.words();
    const auto& node_words = node.set->words();
    for (size_t i = 0; i < words.size(); ++i) {
      if (words[i] & ~node_words[i]) {
        std::vector<int> foreign;
        for (int r : parsed->ranks.Members()) {
          if (!node.set->Contains(r)) foreign.push_back(r);
        }
        return absl::InvalidArgumentError(absl::StrCat(
            "manifest for group \"", m.group_id(), "\" step ", m.step(), ": rank_bits name ranks ",
            FormatRanks(foreign), " that node \"", node.node_id, "\" does not serve",
            node.members ? " among the group's members" : ""));
      }
    }
    // Every rank lies within the node's words (checked above).
    content->rank_count = parsed->ranks.CountInWords(node.word_lo, node.word_hi);
    content->ranks = std::make_shared<const RankSet>(parsed->ranks);
  }
  for (const v1::RankUsage& u : m.rank_detail()) {
    if (!content->ranks->Contains(u.rank())) {
      return absl::InvalidArgumentError(
          absl::StrCat("manifest for group \"", m.group_id(), "\" step ", m.step(),
                       ": rank_detail for rank ", u.rank(), " which the manifest does not cover"));
    }
    absl::StatusOr<std::vector<bool>> used = wire::UnpackBits(
        u.used_bits(), num_params,
        absl::StrCat("manifest for group \"", m.group_id(), "\" rank_detail of rank ", u.rank()));
    if (!used.ok()) return used.status();
    content->detail.push_back(RankDetail{u.rank(), *std::move(used)});
  }
  if (all_node_ranks) {
    content->word_lo = node.word_lo;
    content->word_hi = node.word_hi;
  } else {
    const std::vector<uint64_t>& words = content->ranks->words();
    int lo = 0;
    int hi = static_cast<int>(words.size());
    while (lo < hi && words[lo] == 0) ++lo;
    while (hi > lo && words[hi - 1] == 0) --hi;
    content->word_lo = lo;
    content->word_hi = hi;
  }
  content->key = m.cache_key() != 0 ? m.cache_key() : ManifestKey(*parsed);
  if (!all_node_ranks) content->dtypes.assign(parsed->dtypes.begin(), parsed->dtypes.end());
  return std::shared_ptr<const Content>(std::move(content));
}

PredecodedContent PredecodeContent(const v1::Manifest& m) {
  if (m.repeat() || !m.rank_bits().empty() || m.rank_detail_size() > 0 || m.cache_key() == 0) {
    return {};
  }
  const bool masks = !m.dtype_masks().empty();
  const size_t n = masks ? m.dtype_masks().size() : 8 * m.used_bits().size();
  if (n == 0 || (n + 7) / 8 != m.used_bits().size()) return {};
  auto content = std::make_shared<Content>();
  content->dtypes.resize(n);
  if (!wire::ManifestDTypesFromProto(m, n, content->dtypes.data()).ok()) return {};
  content->key = m.cache_key();
  return PredecodedContent{std::move(content), masks};
}

std::shared_ptr<const Content> ContentFromPredecoded(const ServedRanks& node, size_t num_params,
                                                     const v1::Manifest& m,
                                                     PredecodedContent& pre) {
  // ParseContent's checks for this form: the node serves ranks; used_bits
  // has (num_params + 7) / 8 bytes and no bit past num_params (a decoded
  // entry past it would be a used one); dtype_masks has num_params entries.
  if (pre.content == nullptr || node.count == 0 || num_params == 0 ||
      m.used_bits().size() != (num_params + 7) / 8 ||
      (pre.masks ? pre.content->dtypes.size() != num_params
                 : pre.content->dtypes.size() < num_params)) {
    return nullptr;
  }
  for (size_t i = num_params; i < pre.content->dtypes.size(); ++i) {
    if (pre.content->dtypes[i] != 0) return nullptr;
  }
  std::shared_ptr<Content> content = std::move(pre.content);
  content->dtypes.resize(num_params);
  content->ranks = node.set;
  content->rank_count = node.count;
  content->word_lo = node.word_lo;
  content->word_hi = node.word_hi;
  return content;
}

int64_t ContentCache::Prune(int64_t last_decided_step) {
  steps_.erase(std::remove_if(steps_.begin(), steps_.end(),
                              [&](int64_t x) { return x <= last_decided_step; }),
               steps_.end());
  if (retained_.empty()) return 0;
  const size_t before = retained_.size();
  if (steps_.empty()) {
    retained_.clear();
  } else {
    const int64_t oldest = *std::min_element(steps_.begin(), steps_.end());
    absl::erase_if(retained_, [&](const auto& r) { return r.second.last_step < oldest; });
  }
  return static_cast<int64_t>(before - retained_.size());
}

int64_t ContentCache::Replace(std::shared_ptr<const Content> content) {
  int64_t retained = 0;
  if (!steps_.empty() && current_ != nullptr) {
    // Steps contributed so far used the old content (or older ones).
    const int64_t last = *std::max_element(steps_.begin(), steps_.end());
    const Content* key = current_.get();
    if (retained_.try_emplace(key, Retained{std::move(current_), last}).second) retained = 1;
  }
  current_ = std::move(content);
  key_ = current_->key;
  rank_count_ = current_->rank_count;
  return retained;
}

bool ContentCache::Contributed(int64_t step) const {
  return std::find(steps_.begin(), steps_.end(), step) != steps_.end();
}

std::shared_ptr<const Content> ContentCache::Owner(const Content* content) const {
  if (current_.get() == content) return current_;
  if (auto it = retained_.find(content); it != retained_.end()) return it->second.content;
  return nullptr;
}

void ContentCache::CountSkips() {
  if (skip_content_ == current_) {
    ++skip_steps_;
    return;
  }
  FlushSkips();
  skip_content_ = current_;
  skip_steps_ = 1;
}

void ContentCache::AddSkipSteps(int64_t n) {
  if (n <= 0) return;
  if (skip_content_ != current_) {
    FlushSkips();
    skip_content_ = current_;
  }
  skip_steps_ += n;
}

void ContentCache::FlushSkips() {
  if (skip_content_ == nullptr || skip_steps_ == 0) return;
  const Content& c = *skip_content_;
  const size_t n = c.dtypes.size();
  if (node_skips_.size() != n) node_skips_.assign(n, 0);
  for (size_t i = 0; i < n; ++i) {
    if (c.dtypes[i] == 0) node_skips_[i] += skip_steps_;
  }
  for (const RankDetail& d : c.detail) {
    std::vector<int64_t>& extra = rank_extra_skips_[d.rank];
    if (extra.size() != n) extra.assign(n, 0);
    for (size_t i = 0; i < n; ++i) {
      if (c.dtypes[i] != 0 && !d.used[i]) extra[i] += skip_steps_;
    }
  }
  skip_steps_ = 0;
}

}  // namespace accord::daemon
