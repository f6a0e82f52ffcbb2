// Releasing the GIL around accord's blocking C++ calls, safely at exit.
//
// A thread that takes the GIL back once the interpreter finalizes is ended
// with pthread_exit, whose unwinding through C++ frames that may not throw
// aborts the whole process ("terminate called without an active exception").
// Checking for finalization before taking the GIL back is not enough: a
// thread can check, then wait for the GIL while the main thread starts
// finalizing. So the exit is a gate, closed by an atexit handler (registered
// when accord._accord loads, so it runs after every handler registered by
// what imports accord, accord.torch's thread stops included):
//   - closing marks the gate closed, then lets go of the GIL until every
//     thread already on its way back to the GIL has it;
//   - after that, any other thread that leaves accord's C++ parks there for
//     good (Python 3.14 parks such threads itself) and ends with the process.
// So no thread can reach the GIL after finalization begins by way of
// accord's calls. The thread that closed the gate (the one finalizing) goes
// on as before; an atexit handler registered before accord loaded runs after
// the gate closed, so it must not wait for a thread to come back from
// accord's C++ (that thread parks).
#ifndef ACCORD_PYTHON_SRC_GIL_H_
#define ACCORD_PYTHON_SRC_GIL_H_

#include <Python.h>
#include <pthread.h>
#include <unistd.h>

#include "core/sync.h"

namespace accord::python {

class ExitGate {
 public:
  static ExitGate& Get() {
    static ExitGate* gate = new ExitGate();  // never destroyed: threads may be parked on it
    return *gate;
  }

  // The thread that loads the module: the one taken to finalize until Close
  // says which does.
  void Loaded() {
    accord::MutexLock lock(&mu_);
    if (!closed_) closer_ = pthread_self();
  }

  // Called with the GIL held, once, by the thread that will finalize.
  void Close() {
    PyThreadState* state = PyEval_SaveThread();
    {
      accord::MutexLock lock(&mu_);
      closed_ = true;
      closer_ = pthread_self();
      auto none_returning = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return returning_ == 0; };
      mu_.Await(absl::Condition(&none_returning));
    }
    PyEval_RestoreThread(state);
  }

  // Takes the GIL back for `state`, unless the gate is closed to this thread.
  void Return(PyThreadState* state) {
    bool park;
    {
      accord::MutexLock lock(&mu_);
      park = (closed_ || Finalizing()) && !pthread_equal(closer_, pthread_self());
      if (!park) ++returning_;
    }
    if (park) {
      for (;;) pause();
    }
    PyEval_RestoreThread(state);
    accord::MutexLock lock(&mu_);
    --returning_;
  }

 private:
  ExitGate() = default;

  static bool Finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
    return Py_IsFinalizing() != 0;
#else
    return _Py_IsFinalizing() != 0;
#endif
  }

  accord::Mutex mu_;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  pthread_t closer_ ABSL_GUARDED_BY(mu_){};  // may take the GIL back while finalizing
  int returning_ ABSL_GUARDED_BY(mu_) = 0;   // threads between the check and the GIL
};

// Releases the GIL around a blocking C++ call (what nb::gil_scoped_release
// does), taking it back through the exit gate.
class GilReleased {
 public:
  GilReleased() : state_(PyEval_SaveThread()) {}
  GilReleased(const GilReleased&) = delete;
  GilReleased& operator=(const GilReleased&) = delete;
  ~GilReleased() { ExitGate::Get().Return(state_); }

 private:
  PyThreadState* state_;
};

}  // namespace accord::python

#endif  // ACCORD_PYTHON_SRC_GIL_H_
