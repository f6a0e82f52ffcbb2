// Time for the daemons' logic classes, injected so tests never sleep.
//
// A class that waits for a deadline holds its own mutex and condition
// variable and waits through Clock::WaitUntil; a FakeClock wakes such waiters
// whenever the test advances it, so deadline logic runs on the test's time.
#ifndef ACCORD_DAEMON_COMMON_CLOCK_H_
#define ACCORD_DAEMON_COMMON_CLOCK_H_

#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/time/time.h"
#include "core/sync.h"

namespace accord::daemon {

// Thread-safe.
class Clock {
 public:
  virtual ~Clock() = default;
  virtual absl::Time Now() = 0;
  // Waits on `cv` (with `mu` held, as for CondVar::Wait) until `deadline` by
  // this clock or a signal, whichever is first. Spurious returns are allowed;
  // callers re-check their condition.
  virtual void WaitUntil(accord::CondVar* cv, accord::Mutex* mu, absl::Time deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) = 0;
};

// The system clock. WaitUntil uses CondVar::WaitWithDeadline.
class RealClock : public Clock {
 public:
  absl::Time Now() override { return absl::Now(); }
  void WaitUntil(accord::CondVar* cv, accord::Mutex* mu, absl::Time deadline) override
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // A process-wide instance.
  static RealClock* Get();
};

// A clock that moves only when told. Advance() wakes every waiter so it can
// re-check its deadline against the new time.
class FakeClock : public Clock {
 public:
  explicit FakeClock(absl::Time start = absl::UnixEpoch() + absl::Hours(1)) : now_(start) {}
  absl::Time Now() override;
  void WaitUntil(accord::CondVar* cv, accord::Mutex* mu, absl::Time deadline) override
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  void Advance(absl::Duration d);
  // Number of threads currently blocked in WaitUntil (lets a test wait until a
  // timer thread is parked before advancing, without sleeping).
  int NumWaiters();
  // Blocks until at least `n` threads are parked in WaitUntil.
  void AwaitWaiters(int n);

 private:
  struct Waiter {
    accord::CondVar* cv;
    accord::Mutex* mu;
  };
  accord::Mutex mu_;
  absl::Time now_ ABSL_GUARDED_BY(mu_);
  std::vector<Waiter> waiters_ ABSL_GUARDED_BY(mu_);
};

}  // namespace accord::daemon

#endif  // ACCORD_DAEMON_COMMON_CLOCK_H_
