// A set of ranks 0..world_size-1 as a bitset.
#ifndef ACCORD_CORE_RANK_SET_H_
#define ACCORD_CORE_RANK_SET_H_

#include <cstdint>
#include <string>
#include <vector>

namespace accord {

class RankSet {
 public:
  RankSet() = default;
  explicit RankSet(int world_size) : world_size_(world_size), words_((world_size + 63) / 64, 0) {}

  int world_size() const { return world_size_; }
  // Ranks outside 0..world_size-1 are ignored (callers validate first).
  void Add(int rank) {
    if (rank >= 0 && rank < world_size_) words_[rank >> 6] |= (uint64_t{1} << (rank & 63));
  }
  bool Contains(int rank) const {
    return rank >= 0 && rank < world_size_ && (words_[rank >> 6] >> (rank & 63)) & 1;
  }
  int Count() const;
  // Every rank of the world / no rank: word compares that stop at the first
  // word deciding it (no bit count; bits beyond world_size are never set).
  bool Full() const;
  bool Empty() const;
  // Ranks of the world not in the set, ascending.
  std::vector<int> Missing() const;
  std::vector<int> Members() const;
  // OR with another set of the same world size.
  void Union(const RankSet& other);
  bool Intersects(const RankSet& other) const;
  const std::vector<uint64_t>& words() const { return words_; }
  // Builds a set from raw words; false when words has the wrong length or
  // bits beyond world_size are set.
  static bool FromWords(int world_size, std::vector<uint64_t> words, RankSet* out);

  friend bool operator==(const RankSet&, const RankSet&) = default;

 private:
  int world_size_ = 0;
  std::vector<uint64_t> words_;
};

// "0-3,5,7-9": compact, readable rank lists for error messages.
std::string FormatRanks(const std::vector<int>& ranks);

}  // namespace accord

#endif  // ACCORD_CORE_RANK_SET_H_
