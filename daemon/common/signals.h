// SIGTERM/SIGINT (and SIGHUP) handling for the daemons without signal handlers: block the
// signals in every thread (call before starting any), then wait for one.
#ifndef ACCORD_DAEMON_COMMON_SIGNALS_H_
#define ACCORD_DAEMON_COMMON_SIGNALS_H_

namespace accord::daemon {

// Blocks SIGTERM, SIGINT and SIGHUP in the calling thread and the threads it
// starts (a blocked SIGHUP is ignored unless waited for below).
void BlockTerminationSignals();
// Waits for SIGTERM or SIGINT; returns the signal number.
int WaitForTerminationSignal();
// Waits for SIGTERM, SIGINT or SIGHUP (a reload request); returns the signal.
int WaitForTerminationOrReloadSignal();

}  // namespace accord::daemon

#endif  // ACCORD_DAEMON_COMMON_SIGNALS_H_
