"""Which sidecar a rank uses: a socket_path argument, ACCORD_SOCKET, the
deployed sidecar, or embedded mode (docs/EMBEDDED.md)."""

from __future__ import annotations

import dataclasses
import os
import socket
import stat
from typing import Mapping, Optional, Tuple

DEFAULT_SOCKET = "/run/accord/sidecar.sock"

# Modes, as `choose_mode` names them.
ARGUMENT = "argument"
ENV = "ACCORD_SOCKET"
DEPLOYED = "deployed sidecar"
EMBEDDED = "embedded"


class EmbeddedError(RuntimeError):
    """Embedded mode could not start (a daemon, the store, a peer rank)."""


def probe_socket(path: str, timeout_s: float = 1.0) -> Tuple[bool, str]:
    """Whether something accepts connections on the Unix socket `path`, and
    why not. Connecting is all it does: nothing is sent."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False, f"{path} does not exist"
    except OSError as e:
        return False, f"cannot stat {path}: {e.strerror}"
    if not stat.S_ISSOCK(st.st_mode):
        return False, f"{path} exists but is not a socket"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout_s)
    try:
        s.connect(path)
        return True, f"a sidecar answers on {path}"
    except ConnectionRefusedError:
        return False, (
            f"{path} exists but nothing listens on it (connection refused): a stale socket "
            f"left by a sidecar that is gone"
        )
    except PermissionError:
        return False, (
            f"{path} exists but this user may not connect to it (permission denied): the "
            f"sidecar's socket is mode 0660; run the ranks in its --socket_group"
        )
    except socket.timeout:
        return False, f"{path} did not accept a connection within {timeout_s:g} s"
    except OSError as e:
        return False, f"cannot connect to {path}: {e.strerror}"
    finally:
        s.close()


@dataclasses.dataclass(frozen=True)
class ModeChoice:
    mode: str  # ARGUMENT, ENV, DEPLOYED or EMBEDDED
    socket_path: Optional[str]  # None in embedded mode
    reason: str


def choose_mode(
    socket_path: Optional[str] = None,
    environ: Optional[Mapping[str, str]] = None,
    default_socket: str = DEFAULT_SOCKET,
) -> ModeChoice:
    """Where this rank's sidecar is, without starting anything."""
    environ = os.environ if environ is None else environ
    if socket_path is not None:
        return ModeChoice(ARGUMENT, socket_path, "socket_path was passed to accord.connect")
    if environ.get("ACCORD_SOCKET"):
        path = environ["ACCORD_SOCKET"]
        return ModeChoice(ENV, path, f"ACCORD_SOCKET={path}")
    answers, why = probe_socket(default_socket)
    if answers:
        return ModeChoice(DEPLOYED, default_socket, why)
    return ModeChoice(
        EMBEDDED, None,
        f"ACCORD_SOCKET is not set and no deployed sidecar answers ({why}), so the job starts "
        f"its own daemons",
    )
