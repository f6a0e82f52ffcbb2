// The timer thread of a logic class whose state one mutex guards (the
// sidecar's partial-step reports; the relay's reports and sidecar grace): it
// runs the owner's check, with the owner's mutex held, whenever the armed due
// time passes by the owner's Clock (a FakeClock drives it in tests).
//
// Every method but Start and Stop is called with the owner's mutex held;
// the thread is started by Start and stopped and joined by Stop (or the
// destructor), which take that mutex.
#ifndef ACCORD_DAEMON_COMMON_DUE_TIMER_H_
#define ACCORD_DAEMON_COMMON_DUE_TIMER_H_

#include <functional>
#include <thread>
#include <utility>

#include "absl/time/time.h"
#include "core/sync.h"
#include "daemon/common/clock.h"

namespace accord::daemon {

// What an engine without threads (SidecarJob, RelayJob) asks of the
// DueTimer its owner runs: the owner's check, which calls the engine's, is
// due at `at`. Called with the owner's mutex held.
class DueTimerEffects {
 public:
  virtual ~DueTimerEffects() = default;
  // Due at `at`, unless due as early already.
  virtual void ArmTimer(absl::Time at) = 0;
  // Whether it is due at some time already.
  virtual bool TimerArmed() const = 0;
};

class DueTimer {
 public:
  // `mu`: the owner's mutex; neither is owned. `check` runs with the mutex
  // held once the due time passed, disarmed; it returns the next due time
  // (InfiniteFuture: none).
  DueTimer(accord::Mutex* mu, Clock* clock, std::function<absl::Time()> check)
      : mu_(mu), clock_(clock), check_(std::move(check)) {}
  ~DueTimer() { Stop(); }
  DueTimer(const DueTimer&) = delete;
  DueTimer& operator=(const DueTimer&) = delete;

  // Starts the thread.
  void Start();
  // Stops and joins the thread; no check runs afterwards. Idempotent.
  void Stop();
  // Wakes the thread at `at` unless it is due as early already.
  void Arm(absl::Time at);
  // Runs the check now, as the thread does when it is due (for tests that
  // drive time without the thread).
  void RunNow();
  bool armed() const { return at_ != absl::InfiniteFuture(); }

 private:
  void Loop();

  accord::Mutex* const mu_;
  Clock* const clock_;
  accord::CondVar cv_;
  // Guarded by *mu_.
  bool stopping_ = false;
  absl::Time at_ = absl::InfiniteFuture();
  const std::function<absl::Time()> check_;
  std::thread thread_;
};

}  // namespace accord::daemon

#endif  // ACCORD_DAEMON_COMMON_DUE_TIMER_H_
