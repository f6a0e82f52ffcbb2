"""Local cluster launcher: a coordinator and sidecars on this machine.

The daemons ship inside the package (accord/bin); `daemon_path` finds them,
falling back to PATH and ACCORD_BIN_DIR.
"""

from __future__ import annotations

import os
import shutil

from accord import _accord

_PKG_BIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bin")


def daemon_path(name: str, use_path: bool = True) -> str:
    """Path of an accord program ('accord-coordinator', 'accord-sidecar',
    'accord-relay', 'accordctl', 'accord-local-cluster'): ACCORD_BIN_DIR, then
    the package, then PATH (unless use_path is False: the console scripts
    that exec these programs are on PATH under the same names)."""
    candidates = []
    if os.environ.get("ACCORD_BIN_DIR"):
        candidates.append(os.path.join(os.environ["ACCORD_BIN_DIR"], name))
    candidates.append(os.path.join(_PKG_BIN, name))
    for c in candidates:
        if os.access(c, os.X_OK):
            return c
    found = shutil.which(name) if use_path else None
    if found:
        return found
    raise FileNotFoundError(
        f"accord: cannot find {name} (looked in {', '.join(candidates)}"
        f"{' and PATH' if use_path else ''}); reinstall the package or set ACCORD_BIN_DIR"
    )


if getattr(_accord, "HAVE_CLUSTER", False):

    class LocalCluster(_accord.LocalCluster):
        """A coordinator and `num_sidecars` sidecars on this machine (temporary
        Unix sockets, loopback). Use as a context manager, or call close().

        bin_dir defaults to the daemons shipped in this package (or
        ACCORD_BIN_DIR). sidecars_per_relay=K > 0 places one accord-relay in
        front of every K sidecars (sidecar i reaches the coordinator through
        relay i // K; docs/ARCHITECTURE.md, "Relays")."""

        def __init__(self, num_sidecars=1, bin_dir=None, coordinator_flags=(),
                     sidecar_flags=(), ready_timeout_s=30.0, echo=False,
                     sidecars_per_relay=0, relay_flags=()):
            if bin_dir is None:
                bin_dir = os.path.dirname(daemon_path("accord-coordinator"))
            super().__init__(bin_dir, num_sidecars, list(coordinator_flags),
                             list(sidecar_flags), ready_timeout_s, echo,
                             sidecars_per_relay, list(relay_flags))

else:

    class LocalCluster:  # type: ignore[no-redef]
        """Placeholder: this build has no local cluster launcher."""

        def __init__(self, *args, **kwargs):
            raise RuntimeError(
                "accord was built without the local cluster launcher (client/testing); "
                "rebuild with the daemons enabled"
            )
