#include "daemon/coordinator/deadline_timer.h"

#include <utility>

namespace accord::daemon {

void DeadlineTimer::Start(std::function<void()> check) {
  check_ = std::move(check);
  thread_ = std::thread([this] { Loop(); });
}

void DeadlineTimer::Stop() {
  {
    accord::MutexLock l(&mu_);
    stopping_ = true;
    cv_.SignalAll();
  }
  if (thread_.joinable()) thread_.join();
}

void DeadlineTimer::WakeAt(absl::Time at) {
  accord::MutexLock l(&mu_);
  if (at < next_) {
    next_ = at;
    cv_.SignalAll();
  }
}

void DeadlineTimer::SetNext(absl::Time next) {
  accord::MutexLock l(&mu_);
  next_ = next;
  cv_.SignalAll();
}

void DeadlineTimer::Loop() {
  accord::MutexLock l(&mu_);
  while (!stopping_) {
    if (clock_->Now() >= next_) {
      mu_.Unlock();
      check_();
      mu_.Lock();
      continue;
    }
    clock_->WaitUntil(&cv_, &mu_, next_);
  }
}

}  // namespace accord::daemon
