// Fuzz target: merge and decide with arbitrary inputs. The bytes describe a
// group (sizes), a policy and per-rank gradients (including invalid dtype
// bits); the target merges the rank manifests in two different orders and
// through two different node groupings and checks the properties the
// protocol relies on: the same merged manifest and the same decision.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "core/decide.h"
#include "core/manifest.h"

namespace {

class Reader {
 public:
  Reader(const uint8_t* d, size_t n) : d_(d), n_(n) {}
  uint8_t Byte() { return i_ < n_ ? d_[i_++] : 0; }
  uint32_t U32() {
    return Byte() | (Byte() << 8) | (Byte() << 16) | (static_cast<uint32_t>(Byte()) << 24);
  }

 private:
  const uint8_t* d_;
  size_t n_;
  size_t i_ = 0;
};

void Check(bool ok) {
  if (!ok) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Reader in(data, size);
  const int world = 1 + in.Byte() % 17;
  const int num_params = 1 + in.Byte() % 24;
  accord::GroupSpec spec;
  spec.group_id = "g";
  for (int i = 0; i < num_params; ++i) {
    const int64_t dim0 = in.Byte() % 11;
    const int64_t inner = in.Byte() % 5;
    spec.params.push_back({"p" + std::to_string(i), dim0, dim0 * inner});
  }
  accord::Policy policy;
  const uint8_t pol = in.Byte();
  if (pol & 0x80) {
    policy.reduce_dtype = static_cast<accord::DType>(1 + pol % 6);
    policy.reduce_dtype_exact = (pol & 0x40) != 0;
  }
  policy.fp8_tie = (pol & 0x20) ? accord::Fp8TieBreak::kFloat16 : accord::Fp8TieBreak::kBFloat16;
  const int64_t step = in.Byte();
  std::vector<accord::Manifest> ranks;
  for (int r = 0; r < world; ++r) {
    accord::Manifest m;
    m.step = step;
    m.ranks = accord::RankSet(world);
    m.ranks.Add(r);
    for (int i = 0; i < num_params; ++i) m.dtypes.push_back(in.Byte());  // may hold invalid bits
    ranks.push_back(m);
  }
  // Order 1: ranks 0..W-1 into one manifest.
  accord::Manifest a = ranks[0];
  for (int r = 1; r < world; ++r) Check(accord::Merge(a, ranks[r]).ok());
  // Order 2: a permutation, grouped into nodes of a fuzzed size, then merged.
  std::vector<int> order(world);
  for (int r = 0; r < world; ++r) order[r] = r;
  for (int r = world - 1; r > 0; --r) std::swap(order[r], order[in.U32() % (r + 1)]);
  const int per_node = 1 + in.Byte() % world;
  std::vector<accord::Manifest> nodes;
  for (int k = 0; k < world; k += per_node) {
    accord::Manifest n = ranks[order[k]];
    for (int j = k + 1; j < std::min(world, k + per_node); ++j)
      Check(accord::Merge(n, ranks[order[j]]).ok());
    Check(accord::Merge(n, n).ok());  // idempotent
    nodes.push_back(n);
  }
  accord::Manifest b = nodes.back();
  for (int k = static_cast<int>(nodes.size()) - 2; k >= 0; --k)
    Check(accord::Merge(b, nodes[k]).ok());
  Check(a == b);
  // A mismatched merge is refused and leaves the target unchanged.
  accord::Manifest other = a;
  other.step = a.step + 1;
  accord::Manifest before = a;
  Check(!accord::Merge(a, other).ok() && a == before);

  absl::StatusOr<accord::Decision> d1 = accord::Decide(spec, world, a, policy);
  absl::StatusOr<accord::Decision> d2 = accord::Decide(spec, world, b, policy);
  Check(d1.ok() == d2.ok());
  if (!d1.ok()) return 0;
  Check(*d1 == *d2);
  for (int i = 0; i < num_params; ++i) {
    Check(d1->included[i] == (a.dtypes[i] != 0));
    if (a.dtypes[i] != 0 && !(policy.reduce_dtype && policy.reduce_dtype_exact)) {
      for (accord::DType t : accord::kAllDTypes) {
        if (accord::MaskHas(a.dtypes[i], t)) Check(accord::IsLossless(t, d1->wire_dtype));
      }
    }
  }
  absl::StatusOr<accord::Layout> layout =
      accord::ComputeLayout(spec, world, d1->included, d1->wire_dtype);
  Check(layout.ok() && layout->fingerprint == d1->layout_fingerprint);
  return 0;
}
