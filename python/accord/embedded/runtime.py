"""The embedded runtime (one per process) and the bootstrap through the
store: which rank starts which daemon, and what it publishes."""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import secrets
import socket
import threading
from typing import Dict, List, Mapping, Optional, Tuple

from accord.embedded.mode import EMBEDDED, EmbeddedError, ModeChoice
from accord.embedded.processes import Daemon, LifelineClient, LifelineServer, PrivateDir
from accord.embedded.store import (advertised_host, default_store, initialized_dist,
                                   is_loopback, join_host_port, peer_timeout_s,
                                   split_host_port, store_wait)

_KEY_ROOT = "accord/embedded"
_EXIT_GRACE_ENV = "ACCORD_EMBEDDED_EXIT_GRACE_S"


@dataclasses.dataclass
class Bootstrap:
    """What the ranks agreed on through the store for one connect() round."""

    mode: str
    job_id: str
    socket_path: Optional[str] = None  # embedded: this node's sidecar socket
    token: str = ""
    coordinator: Optional[str] = None
    metrics: Dict[str, str] = dataclasses.field(default_factory=dict)
    token_file: Optional[str] = None


class _Runtime:
    """The daemons this process started and the lifelines it holds; each is
    added by a method here, and close() ends them all."""

    def __init__(self):
        self.daemons: List[Daemon] = []
        self.dir: Optional[PrivateDir] = None
        self.server: Optional[LifelineServer] = None  # the lifelines of this process's dependents
        self.lifeline: Optional[LifelineClient] = None  # to the rank whose daemons this one uses
        self.bootstrap: Optional[Bootstrap] = None  # what connect() agreed on, once it did
        self._closed = False
        self._lock = threading.Lock()

    def private_dir(self) -> PrivateDir:
        if self.dir is None:
            self.dir = PrivateDir()
        return self.dir

    def start_daemon(self, label: str, argv: List[str], ready_prefix: str,
                     timeout_s: float) -> Tuple[Daemon, str]:
        """Starts a daemon (ended by close()); once it is ready, the daemon
        and what it printed after `ready_prefix` (its address)."""
        daemon = Daemon(label, argv, _daemon_env(), ready_prefix)
        self.daemons.append(daemon)
        return daemon, daemon.wait_ready(timeout_s)

    def serve_lifelines(self, host: str) -> str:
        """The address of this process's lifeline server, started at the
        first call (on `host`)."""
        if self.server is None:
            self.server = LifelineServer(host)
        return self.server.address

    def hold_lifeline(self, address: str, timeout_s: float, on_lost) -> None:
        """A lifeline to the rank at `address`, whose daemons this rank uses."""
        self.lifeline = LifelineClient(address, timeout_s, on_lost=on_lost)

    def booted(self, bootstrap: Bootstrap) -> None:
        self.bootstrap = bootstrap

    def stop_daemons(self, label: str):
        for d in self.daemons:
            if d.label.startswith(label):
                d.terminate()

    def close(self, wait_for_dependents: bool = True):
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self.lifeline is not None and self.server is None:
            self.lifeline.close()  # a dependent only: let its owner go
        if self.server is not None and wait_for_dependents:
            grace = float(os.environ.get(_EXIT_GRACE_ENV, "5") or 5)
            self.server.wait_closed(grace)
        # Sidecar before coordinator, as LocalCluster does (no reconnect storm).
        for d in sorted(self.daemons, key=lambda d: d.label != "sidecar"):
            d.terminate()
        if self.lifeline is not None:
            self.lifeline.close()
        if self.server is not None:
            self.server.close()
        if self.dir is not None:
            self.dir.close()


_runtime: Optional[_Runtime] = None
_runtime_lock = threading.Lock()


def _close_runtime():
    global _runtime
    with _runtime_lock:
        rt, _runtime = _runtime, None
    if rt is not None:
        rt.close()


atexit.register(_close_runtime)


def node_key(environ: Mapping[str, str]) -> str:
    """This rank's node: torchrun's GROUP_RANK (so two agents on one host are
    two nodes), else the hostname."""
    if environ.get("GROUP_RANK"):
        return f"group{environ['GROUP_RANK']}"
    return socket.gethostname()


def _daemon_env() -> Dict[str, str]:
    env = dict(os.environ)
    # Defaults a user may override through the daemons' ACCORD_<FLAG> variables.
    env.setdefault("ACCORD_METRICS_HOST", "127.0.0.1")
    env.setdefault("ACCORD_LOG_LEVEL", "error")  # lifecycle warnings are noise here
    return env


def _start_coordinator(rt: _Runtime, job_id: str, host: str, timeout_s: float) -> dict:
    from accord.cluster import daemon_path

    token = secrets.token_hex(16)
    d = rt.private_dir()
    tokens = d.write_secret("tokens", f"{job_id} {token}\n* {token}\n")
    token_file = d.write_secret("token", token + "\n")
    argv = [daemon_path("accord-coordinator"), f"--listen={join_host_port(host, 0)}",
            "--metrics_port=0", f"--tokens_file={tokens}"]
    if not is_loopback(host):
        argv.append("--plaintext")  # the per-run token still guards the job
    daemon, address = rt.start_daemon("coordinator", argv, "accord-coordinator listening on ",
                                      timeout_s)
    return {"address": address, "token": token, "lifeline": rt.serve_lifelines(host),
            "metrics": daemon.metrics_url or "", "token_file": token_file,
            "host": socket.gethostname(), "pid": os.getpid()}


def _start_sidecar(rt: _Runtime, job_id: str, coordinator: dict, node: str,
                   local_world: int, timeout_s: float) -> dict:
    from accord.cluster import daemon_path

    d = rt.private_dir()
    token_file = d.write_secret("sidecar-token", coordinator["token"] + "\n")
    sock = os.path.join(d.path, "sidecar.sock")
    node_id = socket.gethostname() if node == socket.gethostname() else \
        f"{socket.gethostname()}-{node}"
    argv = [daemon_path("accord-sidecar"), f"--coordinator={coordinator['address']}",
            f"--socket={sock}", f"--token_file={token_file}", f"--job={job_id}",
            "--require_rank_token", f"--node_id={node_id}", "--metrics_port=0",
            f"--max_ranks={max(64, local_world)}"]
    if not is_loopback(split_host_port(coordinator["address"])[0]):
        argv.append("--plaintext")
    daemon, path = rt.start_daemon("sidecar", argv, "accord-sidecar serving unix:", timeout_s)
    return {"socket": path, "lifeline": rt.serve_lifelines("127.0.0.1"),
            "metrics": daemon.metrics_url or "",
            "node_id": node_id}


def _round_prefix(store, world_size: int) -> str:
    # Every rank adds 1 per connect(): ranks of round g read g*W+1..(g+1)*W,
    # so a second connect() after a new init_process_group on the same store
    # gets fresh keys.
    count = store.add(f"{_KEY_ROOT}/connects", 1)
    return f"{_KEY_ROOT}/{(count - 1) // world_size}/"


def _rank0_hello(store, key: str, choice: ModeChoice, job_id: Optional[str],
                 job_id_source: str, rt: Optional[_Runtime], environ, world_size: int,
                 timeout_s: float) -> dict:
    """Rank 0 draws the job id when nothing names one, starts the coordinator
    (embedded mode) and publishes its hello; a failure is published too, so
    every rank fails with it."""
    hello = {"mode": choice.mode, "reason": choice.reason,
             "job_id": job_id or f"accord-{secrets.token_hex(8)}",
             "job_id_source": job_id_source if job_id else "drawn by rank 0",
             "host": socket.gethostname()}
    if rt is not None:
        try:
            hello["coordinator"] = _start_coordinator(
                rt, hello["job_id"], advertised_host(environ, world_size), timeout_s)
        except Exception as e:  # noqa: BLE001 - published so every rank fails with it
            store.set(key, json.dumps({**hello, "error": str(e)}))
            raise
    store.set(key, json.dumps(hello))
    return hello


def _read_hello(store, key: str, choice: ModeChoice, job_id: Optional[str],
                job_id_source: str, rank: int, peer_s: float) -> dict:
    """Rank 0's hello, checked against this rank's own choice and job id."""
    (raw,) = store_wait(store, [key], peer_s, "rank 0's accord hello")
    hello = json.loads(raw)
    host = socket.gethostname()
    if hello.get("error"):
        raise EmbeddedError(
            f"accord.connect (embedded mode): rank 0 (host {hello['host']}) could not "
            f"start the job's coordinator: {hello['error']}")
    if hello["mode"] != choice.mode:
        raise EmbeddedError(
            f"accord.connect: ranks disagree on where their sidecars are: rank 0 (host "
            f"{hello['host']}) chose {hello['mode']} ({hello['reason']}) but rank {rank} "
            f"(host {host}) chose {choice.mode} ({choice.reason}); give every node "
            f"a deployed sidecar or none, or set ACCORD_SOCKET on every rank")
    if job_id is not None and job_id != hello["job_id"]:
        raise EmbeddedError(
            f"accord.connect: ranks disagree on the job id: rank 0 has "
            f"{hello['job_id']!r} ({hello['job_id_source']}) but rank {rank} has "
            f"{job_id!r} ({job_id_source}); give every rank the same ACCORD_JOB_ID")
    return hello


def _node_sidecar(store, prefix: str, rt: _Runtime, job_id: str, coord: dict, rank: int,
                  local_rank: int, environ, timeout_s: float, peer_s: float) -> dict:
    """This node's sidecar: started and published by its local rank 0, read by
    the others; each rank that depends on another's daemons holds a lifeline."""
    node = node_key(environ)
    key = f"{prefix}node/{node}"
    if local_rank != 0:
        (raw,) = store_wait(store, [key], peer_s,
                            f"the sidecar of node {node} (started by its local rank 0)")
        info = json.loads(raw)
        if info.get("error"):
            raise EmbeddedError(
                f"accord.connect (embedded mode): local rank 0 of node {node} could not "
                f"start its sidecar: {info['error']}")
        rt.hold_lifeline(info["lifeline"], timeout_s, on_lost=None)
        return {**info, "node": node}
    try:
        info = _start_sidecar(rt, job_id, coord, node,
                              int(environ.get("LOCAL_WORLD_SIZE", "1") or 1), timeout_s)
    except Exception as e:  # noqa: BLE001 - published so the node's ranks fail with it
        store.set(key, json.dumps({"error": str(e), "host": socket.gethostname()}))
        raise
    store.set(key, json.dumps(info))
    if rank != 0:
        rt.hold_lifeline(coord["lifeline"], timeout_s,
                         on_lost=lambda: _coordinator_lost(rt, coord, node))
    return {**info, "node": node}


def bootstrap(
    choice: ModeChoice,
    job_id: Optional[str],
    job_id_source: str,
    rank: int,
    world_size: int,
    local_rank: int,
    timeout_s: float,
    environ: Optional[Mapping[str, str]] = None,
) -> Bootstrap:
    """Agrees with the other ranks, through the default store, on the mode and
    the job id, and in embedded mode starts this rank's share of the daemons.
    Needs torch.distributed initialized."""
    global _runtime
    environ = os.environ if environ is None else environ
    dist = initialized_dist()
    assert dist is not None
    peer_s = peer_timeout_s(timeout_s, environ)
    with _runtime_lock:
        # One embedded runtime per process: a second connect() reuses it.
        if _runtime is not None and _runtime.bootstrap is not None and choice.mode == EMBEDDED:
            return _runtime.bootstrap
    store = default_store(dist)
    prefix = _round_prefix(store, world_size)
    rt = _Runtime() if choice.mode == EMBEDDED else None
    try:
        if rank == 0:
            hello = _rank0_hello(store, prefix + "hello", choice, job_id, job_id_source, rt,
                                 environ, world_size, timeout_s)
        else:
            hello = _read_hello(store, prefix + "hello", choice, job_id, job_id_source, rank,
                                peer_s)
        if rt is None:
            return Bootstrap(mode=choice.mode, job_id=hello["job_id"],
                             socket_path=choice.socket_path)
        coord = hello["coordinator"]
        info = _node_sidecar(store, prefix, rt, hello["job_id"], coord, rank, local_rank,
                             environ, timeout_s, peer_s)
        out = Bootstrap(
            mode=choice.mode, job_id=hello["job_id"], socket_path=info["socket"],
            token=coord["token"], coordinator=coord["address"], token_file=coord.get("token_file"),
            metrics={"coordinator": coord["metrics"],
                     f"sidecar {info.get('node_id', info['node'])}": info["metrics"]})
        rt.booted(out)
        with _runtime_lock:
            _runtime = rt
        return out
    except BaseException:
        if rt is not None:
            rt.close(wait_for_dependents=False)
        raise


def _coordinator_lost(rt: _Runtime, coord: dict, node: str):
    try:
        os.write(2, (
            f"accord: rank 0 (pid {coord['pid']} on host {coord['host']}), which ran this job's "
            f"accord-coordinator at {coord['address']}, is gone (its lifeline ended); stopping "
            f"the sidecar of node {node} so that this node's ranks fail now rather than at "
            f"their deadline\n").encode())
    except OSError:
        pass
    rt.stop_daemons("sidecar")



def current() -> Optional[Bootstrap]:
    """This process's embedded-mode bootstrap (job id, socket, coordinator,
    metrics URLs), or None when it started or joined no embedded daemons."""
    with _runtime_lock:
        return _runtime.bootstrap if _runtime is not None else None
