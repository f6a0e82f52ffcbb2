// SIGTERM/SIGINT handling for the daemons without signal handlers: block the
// signals in every thread (call before starting any), then wait for one.
#ifndef ACCORD_DAEMON_COMMON_SIGNALS_H_
#define ACCORD_DAEMON_COMMON_SIGNALS_H_

namespace accord::daemon {

// Blocks SIGTERM and SIGINT in the calling thread and the threads it starts.
void BlockTerminationSignals();
// Waits for SIGTERM or SIGINT; returns the signal number.
int WaitForTerminationSignal();

}  // namespace accord::daemon

#endif  // ACCORD_DAEMON_COMMON_SIGNALS_H_
