// Per-step manifests and their merge.
//
// A manifest says, for one group and step, which parameters have a local
// gradient and in which dtypes, and which ranks it speaks for. A rank's own
// manifest covers one rank; the sidecar merges its ranks into a node manifest;
// the coordinator merges node manifests into the cluster manifest. All three
// use the same Merge, which is a join in a semilattice (bitwise OR of the rank
// set and of each parameter's dtype set), hence commutative, associative and
// idempotent: the order in which ranks or nodes arrive never changes the answer.
#ifndef ACCORD_CORE_MANIFEST_H_
#define ACCORD_CORE_MANIFEST_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/dtype.h"
#include "core/rank_set.h"

namespace accord {

struct Manifest {
  int64_t step = 0;
  // One entry per parameter, in group order: the set of dtypes in which the
  // covered ranks hold a gradient for it. 0 means no covered rank has one.
  std::vector<DTypeMask> dtypes;
  // The ranks this manifest speaks for.
  RankSet ranks;

  friend bool operator==(const Manifest&, const Manifest&) = default;
};

// The manifest of a single rank. `grad_dtypes[i]` is the dtype of parameter
// i's gradient, or std::nullopt when the rank has none.
Manifest RankManifest(int64_t step, int rank, int world_size,
                      const std::vector<std::optional<DType>>& grad_dtypes);

// Checks a manifest against its group: parameter count, valid dtype bits, rank
// set within the world. INVALID_ARGUMENT naming the group, step and what is off.
absl::Status ValidateManifest(const Manifest& m, absl::string_view group_id, size_t num_params,
                              int world_size);

// Merges `other` into `into`. INVALID_ARGUMENT when the steps, the parameter
// counts or the world sizes differ; `into` is unchanged then.
absl::Status Merge(Manifest& into, const Manifest& other);

// A deterministic 64-bit key of the manifest's content except the step: two
// steps with the same usage and dtypes (and ranks) have the same key, which is
// what the response cache matches on.
uint64_t ManifestKey(const Manifest& m);

}  // namespace accord

#endif  // ACCORD_CORE_MANIFEST_H_
