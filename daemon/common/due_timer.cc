#include "daemon/common/due_timer.h"

#include <utility>

namespace accord::daemon {

void DueTimer::Start() {
  thread_ = std::thread([this] { Loop(); });
}

void DueTimer::Stop() {
  {
    accord::MutexLock l(mu_);
    stopping_ = true;
    cv_.SignalAll();
  }
  if (thread_.joinable()) thread_.join();
}

void DueTimer::Arm(absl::Time at) {
  if (at_ <= at) return;
  at_ = at;
  cv_.SignalAll();
}

void DueTimer::RunNow() {
  at_ = absl::InfiniteFuture();
  Arm(check_());  // the check may have armed it already: the earlier wins
}

void DueTimer::Loop() {
  accord::MutexLock l(mu_);
  while (!stopping_) {
    if (clock_->Now() >= at_) {
      RunNow();
      continue;
    }
    clock_->WaitUntil(&cv_, mu_, at_);
  }
}

}  // namespace accord::daemon
