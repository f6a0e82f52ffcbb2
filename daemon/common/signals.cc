#include "daemon/common/signals.h"

#include <pthread.h>
#include <signal.h>

namespace accord::daemon {
namespace {
sigset_t TerminationSet() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  return set;
}

int Wait(const sigset_t& set) {
  int sig = 0;
  while (sigwait(&set, &sig) != 0) {
  }
  return sig;
}
}  // namespace

void BlockTerminationSignals() {
  sigset_t set = TerminationSet();
  sigaddset(&set, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
}

namespace {
// Blocks them before main, as the program is loaded: a SIGTERM that comes
// while the daemon starts (flag parsing, gRPC's start) stays pending until
// the daemon waits for it, and it then stops cleanly instead of dying by the
// signal's default action with its socket or event log half made. Only a
// signal that comes while the loader runs, before anything exists, still
// ends the process by default.
__attribute__((constructor)) void BlockTerminationSignalsAtLoad() { BlockTerminationSignals(); }
}  // namespace

int WaitForTerminationSignal() { return Wait(TerminationSet()); }

int WaitForTerminationOrReloadSignal() {
  sigset_t set = TerminationSet();
  sigaddset(&set, SIGHUP);
  return Wait(set);
}

}  // namespace accord::daemon
