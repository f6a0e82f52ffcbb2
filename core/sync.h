// Mutex, lock guards and condition variable used throughout accord.
//
// They are absl::Mutex and friends with one addition: in ThreadSanitizer
// builds every lock, unlock and wait also tells TSan about the
// happens-before edge it creates. Debian's Abseil is not built with TSan, so
// without this TSan cannot see absl::Mutex synchronise anything and reports
// every guarded access as a race. In every other build the annotations are
// empty inline functions and these types cost exactly what absl's do.
#pragma once

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

#if defined(__SANITIZE_THREAD__)
#define ACCORD_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define ACCORD_TSAN 1
#endif
#endif

#ifdef ACCORD_TSAN
#include <sanitizer/tsan_interface.h>
#endif

namespace accord {

namespace sync_internal {
inline void Acquired(const void* addr) {
#ifdef ACCORD_TSAN
  __tsan_acquire(const_cast<void*>(addr));
#else
  (void)addr;
#endif
}
inline void Releasing(const void* addr) {
#ifdef ACCORD_TSAN
  __tsan_release(const_cast<void*>(addr));
#else
  (void)addr;
#endif
}
}  // namespace sync_internal

class CondVar;

class ABSL_LOCKABLE Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  void Lock() ABSL_EXCLUSIVE_LOCK_FUNCTION() {
    mu_.Lock();
    sync_internal::Acquired(this);
  }
  void Unlock() ABSL_UNLOCK_FUNCTION() {
    sync_internal::Releasing(this);
    mu_.Unlock();
  }
  void ReaderLock() ABSL_SHARED_LOCK_FUNCTION() {
    mu_.ReaderLock();
    sync_internal::Acquired(this);
  }
  void ReaderUnlock() ABSL_UNLOCK_FUNCTION() {
    sync_internal::Releasing(this);
    mu_.ReaderUnlock();
  }
  void AssertHeld() const ABSL_ASSERT_EXCLUSIVE_LOCK() { mu_.AssertHeld(); }

  // Releases the mutex until `cond` holds (evaluated with the mutex held).
  void Await(const absl::Condition& cond) ABSL_EXCLUSIVE_LOCKS_REQUIRED(this) {
    sync_internal::Releasing(this);
    mu_.Await(cond);
    sync_internal::Acquired(this);
  }
  // As Await; returns whether `cond` holds (false: the timeout passed first).
  bool AwaitWithTimeout(const absl::Condition& cond, absl::Duration timeout)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(this) {
    sync_internal::Releasing(this);
    const bool met = mu_.AwaitWithTimeout(cond, timeout);
    sync_internal::Acquired(this);
    return met;
  }
  // As Await; returns whether `cond` holds (false: the deadline passed first).
  bool AwaitWithDeadline(const absl::Condition& cond, absl::Time deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(this) {
    sync_internal::Releasing(this);
    const bool met = mu_.AwaitWithDeadline(cond, deadline);
    sync_internal::Acquired(this);
    return met;
  }

 private:
  friend class CondVar;
  absl::Mutex mu_;
};

class ABSL_SCOPED_LOCKABLE MutexLock {
 public:
  explicit MutexLock(Mutex* mu) ABSL_EXCLUSIVE_LOCK_FUNCTION(mu) : mu_(mu) { mu_->Lock(); }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;
  ~MutexLock() ABSL_UNLOCK_FUNCTION() { mu_->Unlock(); }

 private:
  Mutex* const mu_;
};

class ABSL_SCOPED_LOCKABLE ReaderMutexLock {
 public:
  explicit ReaderMutexLock(Mutex* mu) ABSL_SHARED_LOCK_FUNCTION(mu) : mu_(mu) { mu_->ReaderLock(); }
  ReaderMutexLock(const ReaderMutexLock&) = delete;
  ReaderMutexLock& operator=(const ReaderMutexLock&) = delete;
  ~ReaderMutexLock() ABSL_UNLOCK_FUNCTION() { mu_->ReaderUnlock(); }

 private:
  Mutex* const mu_;
};

class CondVar {
 public:
  void Wait(Mutex* mu) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    sync_internal::Releasing(mu);
    cv_.Wait(&mu->mu_);
    sync_internal::Acquired(mu);
  }
  // Returns true when the deadline passed (as absl::CondVar does).
  bool WaitWithDeadline(Mutex* mu, absl::Time deadline) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    sync_internal::Releasing(mu);
    const bool timed_out = cv_.WaitWithDeadline(&mu->mu_, deadline);
    sync_internal::Acquired(mu);
    return timed_out;
  }
  void Signal() { cv_.Signal(); }
  void SignalAll() { cv_.SignalAll(); }

 private:
  absl::CondVar cv_;
};

// One-shot event: Notify once, wait any number of times.
class Notification {
 public:
  void Notify() {
    sync_internal::Releasing(this);
    n_.Notify();
  }
  void WaitForNotification() const {
    n_.WaitForNotification();
    sync_internal::Acquired(this);
  }
  bool HasBeenNotified() const {
    const bool notified = n_.HasBeenNotified();
    if (notified) sync_internal::Acquired(this);
    return notified;
  }

 private:
  absl::Notification n_;
};

}  // namespace accord
