#include "core/manifest.h"

#include "absl/strings/str_cat.h"
#include "core/hash.h"

namespace accord {

Manifest RankManifest(int64_t step, int rank, int world_size,
                      const std::vector<std::optional<DType>>& grad_dtypes) {
  Manifest m;
  m.step = step;
  m.ranks = RankSet(world_size);
  if (rank >= 0 && rank < world_size) m.ranks.Add(rank);
  m.dtypes.reserve(grad_dtypes.size());
  for (const std::optional<DType>& d : grad_dtypes) m.dtypes.push_back(d ? MaskOf(*d) : 0);
  return m;
}

absl::Status ValidateManifest(const Manifest& m, absl::string_view group_id, size_t num_params,
                              int world_size) {
  auto where = [&] { return absl::StrCat("manifest for group \"", group_id, "\" step ", m.step); };
  if (m.step < 0) return absl::InvalidArgumentError(absl::StrCat(where(), ": negative step"));
  if (m.dtypes.size() != num_params) {
    return absl::InvalidArgumentError(absl::StrCat(where(), ": ", m.dtypes.size(),
                                                   " parameter entries but the group registered ",
                                                   num_params));
  }
  for (size_t i = 0; i < m.dtypes.size(); ++i) {
    if ((m.dtypes[i] & ~kValidDTypeMask) != 0) {
      return absl::InvalidArgumentError(absl::StrCat(where(), ": parameter ", i, " dtype set 0x",
                                                     absl::Hex(m.dtypes[i]),
                                                     " names a non-float or unknown dtype"));
    }
  }
  if (m.ranks.world_size() != world_size) {
    return absl::InvalidArgumentError(absl::StrCat(where(), ": rank set for world size ",
                                                   m.ranks.world_size(), ", job has ", world_size));
  }
  if (m.ranks.Empty()) {
    return absl::InvalidArgumentError(absl::StrCat(where(), ": speaks for no rank"));
  }
  return absl::OkStatus();
}

absl::Status Merge(Manifest& into, const Manifest& other) {
  if (into.step != other.step) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot merge manifests of steps ", into.step, " and ", other.step));
  }
  if (into.dtypes.size() != other.dtypes.size()) {
    return absl::InvalidArgumentError(absl::StrCat("cannot merge manifests with ",
                                                   into.dtypes.size(), " and ", other.dtypes.size(),
                                                   " parameters"));
  }
  if (into.ranks.world_size() != other.ranks.world_size()) {
    return absl::InvalidArgumentError(absl::StrCat("cannot merge manifests of world sizes ",
                                                   into.ranks.world_size(), " and ",
                                                   other.ranks.world_size()));
  }
  for (size_t i = 0; i < into.dtypes.size(); ++i) into.dtypes[i] |= other.dtypes[i];
  into.ranks.Union(other.ranks);
  return absl::OkStatus();
}

uint64_t ManifestKey(const Manifest& m) {
  StableHasher h;
  h.AddU64(m.dtypes.size());
  uint64_t word = 0;
  int n = 0;
  for (DTypeMask d : m.dtypes) {
    word |= static_cast<uint64_t>(d) << (8 * n);
    if (++n == 8) {
      h.AddU64(word);
      word = 0;
      n = 0;
    }
  }
  if (n > 0) h.AddU64(word);
  h.AddU64(static_cast<uint64_t>(m.ranks.world_size()));
  for (uint64_t w : m.ranks.words()) h.AddU64(w);
  return h.Finish();
}

}  // namespace accord
