// Reconnect backoff with jitter. The nominal delay starts at `initial` and
// doubles after each failed attempt up to `max`; the wait actually taken is
// drawn uniformly from [nominal / 2, nominal] ("equal jitter"). Thousands of
// sidecars (or relays) that lost the same coordinator at the same instant
// therefore spread their reconnects over half a backoff period instead of
// arriving in lockstep (docs/RELIABILITY.md, "Recovery at scale").
//
// Not thread-safe: owned by the thread that reconnects.
#ifndef ACCORD_DAEMON_COMMON_BACKOFF_H_
#define ACCORD_DAEMON_COMMON_BACKOFF_H_

#include <cstdint>
#include <random>

#include "absl/time/time.h"

namespace accord::daemon {

class ReconnectBackoff {
 public:
  // `seed` 0 draws one from std::random_device.
  ReconnectBackoff(absl::Duration initial, absl::Duration max, uint64_t seed = 0);

  // The wait before the next attempt; doubles the nominal delay for the one
  // after.
  absl::Duration Next();
  // Back to `initial` (after a stream that worked).
  void Reset() { nominal_ = initial_; }
  absl::Duration nominal() const { return nominal_; }

  // The jittered wait for nominal delay `nominal` and a draw `u` in [0, 1):
  // nominal / 2 + u * nominal / 2.
  static absl::Duration Jittered(absl::Duration nominal, double u);

 private:
  const absl::Duration initial_;
  const absl::Duration max_;
  absl::Duration nominal_;
  std::mt19937_64 rng_;
};

}  // namespace accord::daemon

#endif  // ACCORD_DAEMON_COMMON_BACKOFF_H_
