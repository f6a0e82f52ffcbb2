#include "core/rank_set.h"

#include <bit>

#include "absl/strings/str_cat.h"

namespace accord {

int RankSet::Count() const {
  int n = 0;
  for (uint64_t w : words_) n += std::popcount(w);
  return n;
}

bool RankSet::Full() const {
  const size_t whole = static_cast<size_t>(world_size_) / 64;
  for (size_t i = 0; i < whole; ++i) {
    if (words_[i] != ~uint64_t{0}) return false;
  }
  const int rest = world_size_ % 64;
  return rest == 0 || words_[whole] == (uint64_t{1} << rest) - 1;
}

bool RankSet::Empty() const {
  for (uint64_t w : words_) {
    if (w != 0) return false;
  }
  return true;
}

std::vector<int> RankSet::Missing() const {
  std::vector<int> out;
  for (int r = 0; r < world_size_; ++r) {
    if (!Contains(r)) out.push_back(r);
  }
  return out;
}

std::vector<int> RankSet::Members() const {
  std::vector<int> out;
  for (int r = 0; r < world_size_; ++r) {
    if (Contains(r)) out.push_back(r);
  }
  return out;
}

void RankSet::Union(const RankSet& other) {
  for (size_t i = 0; i < words_.size() && i < other.words_.size(); ++i)
    words_[i] |= other.words_[i];
}

bool RankSet::Intersects(const RankSet& other) const {
  for (size_t i = 0; i < words_.size() && i < other.words_.size(); ++i) {
    if (words_[i] & other.words_[i]) return true;
  }
  return false;
}

bool RankSet::FromWords(int world_size, std::vector<uint64_t> words, RankSet* out) {
  if (world_size < 0 || words.size() != static_cast<size_t>((world_size + 63) / 64)) return false;
  if (world_size % 64 != 0 && !words.empty()) {
    uint64_t valid = (uint64_t{1} << (world_size % 64)) - 1;
    if (words.back() & ~valid) return false;
  }
  out->world_size_ = world_size;
  out->words_ = std::move(words);
  return true;
}

std::string FormatRanks(const std::vector<int>& ranks) {
  std::string out;
  size_t i = 0;
  while (i < ranks.size()) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    if (!out.empty()) out += ",";
    if (j == i) {
      absl::StrAppend(&out, ranks[i]);
    } else {
      absl::StrAppend(&out, ranks[i], "-", ranks[j]);
    }
    i = j + 1;
  }
  return out.empty() ? "none" : out;
}

}  // namespace accord
