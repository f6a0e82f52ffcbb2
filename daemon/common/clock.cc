#include "daemon/common/clock.h"

#include <algorithm>

namespace accord::daemon {

void RealClock::WaitUntil(accord::CondVar* cv, accord::Mutex* mu, absl::Time deadline) {
  cv->WaitWithDeadline(mu, deadline);
}

RealClock* RealClock::Get() {
  static RealClock* clock = new RealClock();
  return clock;
}

absl::Time FakeClock::Now() {
  accord::MutexLock l(&mu_);
  return now_;
}

void FakeClock::WaitUntil(accord::CondVar* cv, accord::Mutex* mu, absl::Time deadline) {
  {
    accord::MutexLock l(&mu_);
    if (now_ >= deadline) return;
    waiters_.push_back({cv, mu});
  }
  // Advance() signals with `mu` held, so the signal cannot fall between the
  // registration above and this wait (which releases `mu` atomically).
  cv->Wait(mu);
  accord::MutexLock l(&mu_);
  auto it = std::find_if(waiters_.begin(), waiters_.end(),
                         [&](const Waiter& w) { return w.cv == cv && w.mu == mu; });
  if (it != waiters_.end()) waiters_.erase(it);
}

void FakeClock::Advance(absl::Duration d) {
  std::vector<Waiter> waiters;
  {
    accord::MutexLock l(&mu_);
    now_ += d;
    waiters = waiters_;
  }
  for (const Waiter& w : waiters) {
    accord::MutexLock l(w.mu);
    w.cv->SignalAll();
  }
}

int FakeClock::NumWaiters() {
  accord::MutexLock l(&mu_);
  return static_cast<int>(waiters_.size());
}

void FakeClock::AwaitWaiters(int n) {
  struct Arg {
    std::vector<Waiter>* waiters;
    int n;
  } arg{&waiters_, n};
  accord::MutexLock l(&mu_);
  mu_.Await(absl::Condition(
      +[](Arg* a) { return static_cast<int>(a->waiters->size()) >= a->n; }, &arg));
}

}  // namespace accord::daemon
