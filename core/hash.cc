#include "core/hash.h"

namespace accord {
namespace {

constexpr uint64_t Mix(uint64_t x) {
  // splitmix64 finalizer: a bijection with good avalanche.
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 31;
  return x;
}

}  // namespace

void StableHasher::AddU64(uint64_t v) {
  state_ = Mix(state_ ^ Mix(v + 0x9e3779b97f4a7c15ull * ++count_));
}

void StableHasher::AddBytes(absl::string_view bytes) {
  AddU64(bytes.size());
  uint64_t word = 0;
  int n = 0;
  for (unsigned char c : bytes) {
    word |= static_cast<uint64_t>(c) << (8 * n);
    if (++n == 8) {
      AddU64(word);
      word = 0;
      n = 0;
    }
  }
  if (n > 0) AddU64(word);
}

uint64_t StableHasher::Finish() const { return Mix(state_ ^ count_); }

}  // namespace accord
