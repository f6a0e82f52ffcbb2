#include "daemon/common/backoff.h"

#include "absl/time/time.h"
#include "gtest/gtest.h"

namespace accord::daemon {
namespace {

TEST(ReconnectBackoffTest, JitteredWaitSpansHalfToFullNominal) {
  const absl::Duration nominal = absl::Milliseconds(800);
  EXPECT_EQ(ReconnectBackoff::Jittered(nominal, 0.0), absl::Milliseconds(400));
  EXPECT_EQ(ReconnectBackoff::Jittered(nominal, 0.5), absl::Milliseconds(600));
  EXPECT_EQ(ReconnectBackoff::Jittered(nominal, 1.0), nominal);
  // Out-of-range draws are clamped, never outside the bounds.
  EXPECT_EQ(ReconnectBackoff::Jittered(nominal, -3.0), absl::Milliseconds(400));
  EXPECT_EQ(ReconnectBackoff::Jittered(nominal, 7.0), nominal);
}

TEST(ReconnectBackoffTest, EveryWaitStaysWithinBoundsAndNominalDoublesToTheCap) {
  ReconnectBackoff backoff(absl::Milliseconds(100), absl::Seconds(5), /*seed=*/42);
  absl::Duration nominal = absl::Milliseconds(100);
  for (int i = 0; i < 50; ++i) {
    ASSERT_EQ(backoff.nominal(), nominal) << "attempt " << i;
    const absl::Duration wait = backoff.Next();
    EXPECT_GE(wait, nominal / 2) << "attempt " << i;
    EXPECT_LE(wait, nominal) << "attempt " << i;
    nominal = std::min(nominal * 2, absl::Seconds(5));
  }
  backoff.Reset();
  EXPECT_EQ(backoff.nominal(), absl::Milliseconds(100));
}

TEST(ReconnectBackoffTest, DifferentSeedsSpreadTheSameAttempt) {
  // Many sidecars losing one coordinator: their first waits must not all be
  // equal (lockstep reconnects are what the jitter is for).
  absl::Duration lo = absl::InfiniteDuration(), hi = absl::ZeroDuration();
  for (uint64_t seed = 1; seed <= 64; ++seed) {
    ReconnectBackoff backoff(absl::Seconds(1), absl::Seconds(1), seed);
    const absl::Duration wait = backoff.Next();
    lo = std::min(lo, wait);
    hi = std::max(hi, wait);
  }
  EXPECT_GE(lo, absl::Milliseconds(500));
  EXPECT_LE(hi, absl::Seconds(1));
  EXPECT_GT(hi - lo, absl::Milliseconds(100));
}

}  // namespace
}  // namespace accord::daemon
