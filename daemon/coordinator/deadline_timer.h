// The coordinator's timer thread (docs/ARCHITECTURE.md, "Threading"): calls
// `check` whenever the wake time it was given has come by its clock. It
// holds its own mutex and condition variable and waits through
// Clock::WaitUntil, so a FakeClock drives it in tests. Thread-safe; the
// thread starts in Start() and stops in Stop() or the destructor.
//
// Not a DueTimer (daemon/common/due_timer.h), which runs its check under the
// owner's mutex: the coordinator's check takes the coordinator's lock itself
// and delivers what it produced after releasing it (Coordinator::Deliver),
// so it runs with no lock held and reports its next wake time by SetNext.
#ifndef ACCORD_DAEMON_COORDINATOR_DEADLINE_TIMER_H_
#define ACCORD_DAEMON_COORDINATOR_DEADLINE_TIMER_H_

#include <functional>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/time/time.h"
#include "daemon/common/clock.h"

namespace accord::daemon {

class DeadlineTimer {
 public:
  explicit DeadlineTimer(Clock* clock) : clock_(clock) {}
  ~DeadlineTimer() { Stop(); }
  DeadlineTimer(const DeadlineTimer&) = delete;
  DeadlineTimer& operator=(const DeadlineTimer&) = delete;

  // Starts the thread; `check` runs on it without the timer's lock held and
  // must set the next wake time (SetNext).
  void Start(std::function<void()> check);
  // Stops and joins the thread. Idempotent.
  void Stop() ABSL_LOCKS_EXCLUDED(mu_);
  // Wakes the thread at `at` if that is earlier than its next wake.
  void WakeAt(absl::Time at) ABSL_LOCKS_EXCLUDED(mu_);
  // The next wake time, whatever it was (after a check).
  void SetNext(absl::Time next) ABSL_LOCKS_EXCLUDED(mu_);
  absl::Time Now() { return clock_->Now(); }

 private:
  void Loop() ABSL_LOCKS_EXCLUDED(mu_);

  Clock* const clock_;
  std::function<void()> check_;
  accord::Mutex mu_;
  accord::CondVar cv_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  absl::Time next_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();
  std::thread thread_;
};

}  // namespace accord::daemon

#endif  // ACCORD_DAEMON_COORDINATOR_DEADLINE_TIMER_H_
