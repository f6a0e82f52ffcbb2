// The only file that knows which collective backends were compiled in.
#include "absl/strings/str_cat.h"
#include "client/collective/collective.h"
#if ACCORD_WITH_GLOO
#include "client/collective/gloo_collective.h"
#endif
#if ACCORD_WITH_NCCL
#include "client/collective/nccl_collective.h"
#endif

namespace accord {

absl::StatusOr<std::unique_ptr<Collective>> CreateCollective(Backend backend, int rank,
                                                             int world_size, KeyValueStore& kv,
                                                             std::string key_prefix,
                                                             const CollectiveOptions& options) {
  switch (backend) {
    case Backend::kGloo:
#if ACCORD_WITH_GLOO
      // NCCL scopes its own key (and requires an incarnation); Gloo's store
      // keys go under "<key_prefix>/<incarnation>" when one is given.
      if (!options.incarnation.empty()) absl::StrAppend(&key_prefix, "/", options.incarnation);
      return GlooCollective::Create(rank, world_size, kv, std::move(key_prefix), options);
#else
      return absl::UnimplementedError(
          "collective: this build has no Gloo backend (libgloo-dev was not found at configure "
          "time); install it and rebuild");
#endif
    case Backend::kNccl:
#if ACCORD_WITH_NCCL
      return NcclCollective::Create(rank, world_size, kv, std::move(key_prefix), options);
#else
      return absl::UnimplementedError(
          "collective: this build has no NCCL backend (needs CUDA and NCCL at configure time; "
          "pip install nvidia-nccl-cu13 and reconfigure)");
#endif
  }
  return absl::InvalidArgumentError(
      absl::StrCat("collective: unknown backend ", static_cast<int>(backend)));
}

}  // namespace accord
