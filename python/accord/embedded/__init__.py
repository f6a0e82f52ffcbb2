"""Zero setup for `accord.connect()`: which sidecar to use, and embedded mode.

`choose_mode` decides where a rank's sidecar is (docs/EMBEDDED.md):

1. a `socket_path` argument;
2. `ACCORD_SOCKET`;
3. the deployed sidecar's default socket, `/run/accord/sidecar.sock`, when it
   exists and accepts a connection;
4. otherwise *embedded mode*: the job starts its own daemons.

Embedded mode needs `torch.distributed` initialized. Its bootstrap goes
through the default store of the process group, under a key prefix of its
own per connect() round (`accord/embedded/<round>/`):

- rank 0 publishes `hello`: the mode it chose, the job id (agreed there when
  nothing names one) and, in embedded mode, the address and per-run token of
  the `accord-coordinator` it started on an ephemeral port;
- each node's local rank 0 (a node is torchrun's GROUP_RANK, else the
  hostname) starts one `accord-sidecar` on a socket in a fresh 0700 temp dir
  and publishes `node/<node>`: the socket and its lifeline address;
- the other local ranks read the socket from `node/<node>`.

A rank waits for another's key at most ACCORD_EMBEDDED_PEER_TIMEOUT_S (300 s;
ranks reach connect() at different times), for a daemon it started at most
connect_timeout_s; a rank that failed publishes its error under its key, so
the others fail with it at once.

Lifetime: every daemon gets PR_SET_PDEATHSIG(SIGKILL) from the rank that
started it (Linux), and is terminated at that rank's interpreter exit. A
`/bin/sh` reaper whose stdin is a pipe from that rank removes the temp dir
when the pipe ends, however the rank ends. Each rank that depends on another
rank's daemons holds a TCP *lifeline* to it: at exit a daemon owner first waits
(ACCORD_EMBEDDED_EXIT_GRACE_S, 5 s) for its dependents to close theirs, so a
decision in flight still reaches them; a node owner whose lifeline to rank 0
ends while it runs (rank 0 died, taking the coordinator with it) stops its
sidecar, so the ranks of that node fail now instead of at their deadline.
"""

from accord.embedded.mode import (  # noqa: F401
    ARGUMENT,
    DEFAULT_SOCKET,
    DEPLOYED,
    EMBEDDED,
    ENV,
    EmbeddedError,
    ModeChoice,
    choose_mode,
    probe_socket,
)
from accord.embedded.runtime import Bootstrap, bootstrap, current, node_key  # noqa: F401
from accord.embedded.store import (  # noqa: F401
    advertised_host,
    default_store,
    initialized_dist,
    peer_timeout_s,
)
