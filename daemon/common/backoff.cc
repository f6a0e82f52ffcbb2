#include "daemon/common/backoff.h"

#include <algorithm>

namespace accord::daemon {

ReconnectBackoff::ReconnectBackoff(absl::Duration initial, absl::Duration max, uint64_t seed)
    : initial_(initial),
      max_(std::max(initial, max)),
      nominal_(initial),
      rng_(seed != 0 ? seed : (uint64_t{std::random_device{}()} << 32) ^ std::random_device{}()) {}

absl::Duration ReconnectBackoff::Jittered(absl::Duration nominal, double u) {
  u = std::clamp(u, 0.0, 1.0);
  return nominal / 2 + (nominal / 2) * u;
}

absl::Duration ReconnectBackoff::Next() {
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  const absl::Duration wait = Jittered(nominal_, uniform(rng_));
  nominal_ = std::min(nominal_ * 2, max_);
  return wait;
}

}  // namespace accord::daemon
