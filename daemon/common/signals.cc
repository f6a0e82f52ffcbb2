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

int WaitForTerminationSignal() { return Wait(TerminationSet()); }

int WaitForTerminationOrReloadSignal() {
  sigset_t set = TerminationSet();
  sigaddset(&set, SIGHUP);
  return Wait(set);
}

}  // namespace accord::daemon
