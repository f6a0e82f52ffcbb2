"""torch.distributed's store, looked at only when the program imported it,
and the addresses the embedded daemons advertise."""

from __future__ import annotations

import ipaddress
import os
import socket
import sys
from datetime import timedelta
from typing import List, Mapping, Optional, Tuple

from accord.embedded.mode import EmbeddedError

_PEER_TIMEOUT_ENV = "ACCORD_EMBEDDED_PEER_TIMEOUT_S"


def initialized_dist():
    """torch.distributed when this program imported it and initialized the
    default process group; None otherwise (torch is never imported here)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return None
    try:
        return dist if dist.is_available() and dist.is_initialized() else None
    except Exception:  # noqa: BLE001 - a half-imported torch is "not initialized"
        return None


def default_store(dist):
    """The default process group's store (a private torch name, checked here)."""
    getter = getattr(getattr(dist, "distributed_c10d", None), "_get_default_store", None)
    if getter is None:
        import torch

        raise EmbeddedError(
            f"accord.connect (embedded mode): torch {torch.__version__} has no "
            f"torch.distributed.distributed_c10d._get_default_store, which embedded mode uses to "
            f"share the daemons' addresses; set ACCORD_SOCKET to a running sidecar instead"
        )
    return getter()


def peer_timeout_s(connect_timeout_s: float,
                   environ: Optional[Mapping[str, str]] = None) -> float:
    """How long a rank waits in connect() for another rank's share of the
    bootstrap: ranks reach connect() at different times (one loads a
    checkpoint first), so at least ACCORD_EMBEDDED_PEER_TIMEOUT_S (300 s)."""
    environ = os.environ if environ is None else environ
    return max(connect_timeout_s, float(environ.get(_PEER_TIMEOUT_ENV, "300") or 300))


def store_wait(store, keys: List[str], timeout_s: float, what: str):
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except Exception as e:  # noqa: BLE001 - torch raises DistStoreError/RuntimeError
        raise EmbeddedError(
            f"accord.connect: {what} did not appear in the torch.distributed store within "
            f"{timeout_s:g} s (key {keys[0]!r}; {_PEER_TIMEOUT_ENV}); check that rank's output "
            f"for its error ({type(e).__name__}: {e})"
        ) from None
    return [store.get(k) for k in keys]


def join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def split_host_port(address: str) -> Tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def advertised_host(environ: Mapping[str, str], world_size: int) -> str:
    """The address other nodes reach rank 0's coordinator at: loopback when
    the whole job is on this node; else ACCORD_EMBEDDED_HOST, or this host's
    address on the route to MASTER_ADDR (loopback when MASTER_ADDR is), or
    the address of this host's name."""
    if environ.get("ACCORD_EMBEDDED_HOST"):
        return environ["ACCORD_EMBEDDED_HOST"]
    if int(environ.get("LOCAL_WORLD_SIZE", "0") or 0) == world_size:
        return "127.0.0.1"
    master = environ.get("MASTER_ADDR")
    if master:
        try:
            family, _, _, _, sockaddr = socket.getaddrinfo(master, None, type=socket.SOCK_DGRAM)[0]
            ip = sockaddr[0]
            if is_loopback(ip):
                return "127.0.0.1"
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect((ip, 9))  # UDP: no packet is sent, only a route chosen
                return s.getsockname()[0]
        except OSError:
            pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
