// Argument checks shared by the CPU and CUDA pack/unpack launchers, so both
// refuse the same inputs with the same messages. Internal to kernels/.
#ifndef ACCORD_KERNELS_PACK_VALIDATE_H_
#define ACCORD_KERNELS_PACK_VALIDATE_H_

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kernels/pack.h"

namespace accord::kernels {

absl::Status ValidatePack(const GroupSpec& spec, const Layout& layout,
                          absl::Span<const GradSource> sources, const void* out,
                          const PackOptions& options);

absl::Status ValidateUnpack(const GroupSpec& spec, const Layout& layout, int rank,
                            const void* shard, absl::Span<const UnpackTarget> targets);

}  // namespace accord::kernels

#endif  // ACCORD_KERNELS_PACK_VALIDATE_H_
