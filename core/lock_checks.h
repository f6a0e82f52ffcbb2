// Abseil's lock-order (deadlock) detection for the daemons and the client.
#pragma once

#include <cstdlib>
#include <string_view>

#include "absl/synchronization/mutex.h"

namespace accord {

// Debian's Abseil is built without NDEBUG, so its lock-order detection is
// on, and it makes every nested lock about four times dearer (54-68 ns
// against 12-15 ns per nested pair on the development machine): gRPC and accord lock
// on every message. A process that serves or calls accord turns it off once
// at its start, unless ACCORD_LOCK_CHECKS=1 (scripts/test sets it, so the
// test suite keeps the check).
inline void ConfigureLockChecks() {
  const char* checks = std::getenv("ACCORD_LOCK_CHECKS");
  if (checks == nullptr || std::string_view(checks) != "1") {
    absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  }
}

}  // namespace accord
