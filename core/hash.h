// A deterministic 64-bit hash for fingerprints and cache keys: the same
// value on every machine, process and build (unlike absl::Hash, which is
// seeded per process).
#ifndef ACCORD_CORE_HASH_H_
#define ACCORD_CORE_HASH_H_

#include <cstdint>
#include "absl/strings/string_view.h"

namespace accord {

class StableHasher {
 public:
  void AddU64(uint64_t v);
  void AddBytes(absl::string_view bytes);
  uint64_t Finish() const;

 private:
  uint64_t state_ = 0x6a09e667f3bcc909ull;
  uint64_t count_ = 0;
};

}  // namespace accord

#endif  // ACCORD_CORE_HASH_H_
