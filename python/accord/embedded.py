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

from __future__ import annotations

import atexit
import collections
import ctypes
import dataclasses
import ipaddress
import json
import os
import queue
import secrets
import selectors
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
from datetime import timedelta
from typing import Callable, Dict, List, Mapping, Optional, Tuple

DEFAULT_SOCKET = "/run/accord/sidecar.sock"
_KEY_ROOT = "accord/embedded"
_EXIT_GRACE_ENV = "ACCORD_EMBEDDED_EXIT_GRACE_S"
_PEER_TIMEOUT_ENV = "ACCORD_EMBEDDED_PEER_TIMEOUT_S"

# Modes, as `choose_mode` names them.
ARGUMENT = "argument"
ENV = "ACCORD_SOCKET"
DEPLOYED = "deployed sidecar"
EMBEDDED = "embedded"


class EmbeddedError(RuntimeError):
    """Embedded mode could not start (a daemon, the store, a peer rank)."""


# ---------------------------------------------------------------------------
# Which sidecar


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


# ---------------------------------------------------------------------------
# torch.distributed, looked at only when the program imported it


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


def _store_wait(store, keys: List[str], timeout_s: float, what: str):
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except Exception as e:  # noqa: BLE001 - torch raises DistStoreError/RuntimeError
        raise EmbeddedError(
            f"accord.connect: {what} did not appear in the torch.distributed store within "
            f"{timeout_s:g} s (key {keys[0]!r}; {_PEER_TIMEOUT_ENV}); check that rank's output "
            f"for its error ({type(e).__name__}: {e})"
        ) from None
    return [store.get(k) for k in keys]


# ---------------------------------------------------------------------------
# Child processes that die with this rank

_PR_SET_PDEATHSIG = 1
try:
    _prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None
except (OSError, AttributeError):
    _prctl = None


def _child_setup(parent: int) -> Callable[[], None]:
    def setup():
        # Runs in the child between fork and exec. The death signal follows
        # the thread that forked, hence `_run_on_lasting_thread`.
        if _prctl is not None:
            _prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
            if os.getppid() != parent:  # the rank died before prctl
                os._exit(126)

    return setup


class _LastingThread:
    """One thread that lives as long as the process. PR_SET_PDEATHSIG fires
    when the *thread* that forked the child ends, so daemons started from a
    short-lived thread are forked from here instead."""

    _lock = threading.Lock()
    _queue: Optional[queue.Queue] = None

    @classmethod
    def run(cls, fn):
        if threading.current_thread() is threading.main_thread():
            return fn()
        with cls._lock:
            if cls._queue is None:
                cls._queue = queue.Queue()
                threading.Thread(target=cls._loop, args=(cls._queue,), daemon=True,
                                 name="accord-embedded-spawner").start()
        done: queue.Queue = queue.Queue()
        cls._queue.put((fn, done))
        ok, value = done.get()
        if ok:
            return value
        raise value

    @staticmethod
    def _loop(q: queue.Queue):
        while True:
            fn, done = q.get()
            try:
                done.put((True, fn()))
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                done.put((False, e))


class _Daemon:
    """One accord daemon started by this rank. Its stdout and stderr (one
    pipe) are read by a thread: the readiness line, the metrics URL, and the
    rest forwarded to this rank's stderr with a prefix."""

    def __init__(self, label: str, argv: List[str], env: Dict[str, str], ready_prefix: str):
        self.label = label
        self.ready_prefix = ready_prefix
        self.ready_value: Optional[str] = None
        self.metrics_url: Optional[str] = None
        self._tail: collections.deque = collections.deque(maxlen=40)
        self._settled = threading.Event()
        self.proc = _LastingThread.run(lambda: subprocess.Popen(
            argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, close_fds=True, preexec_fn=_child_setup(os.getpid())))
        threading.Thread(target=self._drain, daemon=True, name=f"accord-{label}-output").start()

    def _drain(self):
        for raw in self.proc.stdout:
            line = raw.decode("utf-8", "replace").rstrip("\r\n")
            if self.ready_value is None and line.startswith(self.ready_prefix):
                self.ready_value = line[len(self.ready_prefix):].strip()
                self._settled.set()
                continue
            if self.metrics_url is None and " metrics on " in line:
                self.metrics_url = line.split(" metrics on ", 1)[1].strip()
                continue
            self._tail.append(line)
            if " stats: " not in line:  # the exit statistics line is not news
                try:
                    os.write(2, f"[accord {self.label}] {line}\n".encode())
                except OSError:
                    pass
        self.proc.stdout.close()
        self._settled.set()

    def wait_ready(self, timeout_s: float) -> str:
        if not self._settled.wait(timeout_s):
            self.terminate(grace_s=1.0)
            raise EmbeddedError(
                f"accord.connect (embedded mode): {self.label} (pid {self.proc.pid}) did not "
                f"print {self.ready_prefix.strip()!r} within {timeout_s:g} s; its output:\n"
                + "\n".join(self._tail)
            )
        if self.ready_value is None:
            code = self.proc.wait()
            raise EmbeddedError(
                f"accord.connect (embedded mode): {self.label} exited with code {code} before it "
                f"was ready (command: {' '.join(self.proc.args)}); its output:\n"
                + "\n".join(self._tail)
            )
        return self.ready_value

    def terminate(self, grace_s: float = 5.0):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class _PrivateDir:
    """A fresh 0700 temp dir, removed at close and, should this rank die
    without closing it, by a /bin/sh reaper that waits for its stdin pipe
    (held only by this process) to end."""

    # A Unix socket path has at most 107 bytes (sun_path); a long TMPDIR
    # falls back to /tmp.
    _MAX_BASE = 107 - len("/accord-embedded-XXXXXXXX/sidecar.sock")

    def __init__(self):
        base = tempfile.gettempdir()
        if len(base.encode()) > self._MAX_BASE and os.access("/tmp", os.W_OK):
            base = "/tmp"
        self.path = tempfile.mkdtemp(prefix="accord-embedded-", dir=base)  # mode 0700
        self._reaper = _LastingThread.run(lambda: subprocess.Popen(
            ["/bin/sh", "-c", 'read _ignored; rm -rf -- "$1"', "accord-reaper", self.path],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            close_fds=True, start_new_session=True))

    def write_secret(self, name: str, text: str) -> str:
        path = os.path.join(self.path, name)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        return path

    def close(self):
        shutil.rmtree(self.path, ignore_errors=True)
        try:
            self._reaper.stdin.close()
            self._reaper.wait(5.0)
        except (OSError, subprocess.TimeoutExpired):
            pass


class _LifelineServer:
    """Accepts lifelines from the ranks that depend on this rank's daemons and
    tells when all of them have closed. One selector thread; nothing is read
    or written on a lifeline but its end."""

    def __init__(self, host: str):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.bind((host, 0))
        self._listener.listen(256)
        self._listener.setblocking(False)
        self.address = _join_host_port(host, self._listener.getsockname()[1])
        self._cv = threading.Condition()
        self._open = 0
        self._wake_r, self._wake_w = socket.socketpair()
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, "accept")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._thread = threading.Thread(target=self._loop, daemon=True,
                                        name="accord-embedded-lifelines")
        self._thread.start()

    def _loop(self):
        while True:
            for key, _ in self._sel.select():
                if key.data == "wake":
                    return
                if key.data == "accept":
                    try:
                        conn, _ = self._listener.accept()
                    except OSError:
                        continue
                    conn.setblocking(False)
                    self._sel.register(conn, selectors.EVENT_READ, "conn")
                    with self._cv:
                        self._open += 1
                    continue
                try:
                    data = key.fileobj.recv(64)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if not data:
                    self._sel.unregister(key.fileobj)
                    key.fileobj.close()
                    with self._cv:
                        self._open -= 1
                        self._cv.notify_all()

    def wait_closed(self, timeout_s: float) -> int:
        """Waits until no lifeline is open, at most timeout_s; returns how many
        are still open."""
        with self._cv:
            self._cv.wait_for(lambda: self._open == 0, timeout_s)
            return self._open

    def close(self):
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._thread.join(5.0)
        for key in list(self._sel.get_map().values()):
            key.fileobj.close()
        self._sel.close()
        self._wake_w.close()


class _LifelineClient:
    """This rank's lifeline to the rank whose daemons it uses. With
    `on_lost`, a thread waits for the line to end and calls it unless this
    side closed first."""

    def __init__(self, address: str, timeout_s: float, on_lost: Optional[Callable[[], None]]):
        host, port = _split_host_port(address)
        self._sock = socket.create_connection((host, port), timeout=timeout_s)
        self._sock.settimeout(None)
        self._closing = False
        if on_lost is not None:
            threading.Thread(target=self._watch, args=(on_lost,), daemon=True,
                             name="accord-embedded-lifeline").start()

    def _watch(self, on_lost):
        try:
            while self._sock.recv(64):
                pass
        except OSError:
            pass
        if not self._closing:
            on_lost()

    def close(self):
        self._closing = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()


# ---------------------------------------------------------------------------
# Addresses


def _join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _split_host_port(address: str) -> Tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _is_loopback(host: str) -> bool:
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
            if _is_loopback(ip):
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


# ---------------------------------------------------------------------------
# Embedded runtime (one per process)


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
    """The daemons this process started and the lifelines it holds."""

    def __init__(self):
        self.daemons: List[_Daemon] = []
        self.dir: Optional[_PrivateDir] = None
        self.server: Optional[_LifelineServer] = None
        self.lifeline: Optional[_LifelineClient] = None
        self.bootstrap: Optional[Bootstrap] = None
        self._closed = False
        self._lock = threading.Lock()

    def private_dir(self) -> _PrivateDir:
        if self.dir is None:
            self.dir = _PrivateDir()
        return self.dir

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
    argv = [daemon_path("accord-coordinator"), f"--listen={_join_host_port(host, 0)}",
            "--metrics_port=0", f"--tokens_file={tokens}"]
    if not _is_loopback(host):
        argv.append("--plaintext")  # the per-run token still guards the job
    daemon = _Daemon("coordinator", argv, _daemon_env(), "accord-coordinator listening on ")
    rt.daemons.append(daemon)
    address = daemon.wait_ready(timeout_s)
    rt.server = _LifelineServer(host)
    return {"address": address, "token": token, "lifeline": rt.server.address,
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
    if not _is_loopback(_split_host_port(coordinator["address"])[0]):
        argv.append("--plaintext")
    daemon = _Daemon("sidecar", argv, _daemon_env(), "accord-sidecar serving unix:")
    rt.daemons.append(daemon)
    path = daemon.wait_ready(timeout_s)
    if rt.server is None:
        rt.server = _LifelineServer("127.0.0.1")
    return {"socket": path, "lifeline": rt.server.address, "metrics": daemon.metrics_url or "",
            "node_id": node_id}


def _round_prefix(store, world_size: int) -> str:
    # Every rank adds 1 per connect(): ranks of round g read g*W+1..(g+1)*W,
    # so a second connect() after a new init_process_group on the same store
    # gets fresh keys.
    count = store.add(f"{_KEY_ROOT}/connects", 1)
    return f"{_KEY_ROOT}/{(count - 1) // world_size}/"


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
    hello_key = prefix + "hello"
    host_name = socket.gethostname()

    rt = _Runtime() if choice.mode == EMBEDDED else None
    try:
        if rank == 0:
            hello = {"mode": choice.mode, "reason": choice.reason,
                     "job_id": job_id or f"accord-{secrets.token_hex(8)}",
                     "job_id_source": job_id_source if job_id else "drawn by rank 0",
                     "host": host_name}
            if rt is not None:
                try:
                    hello["coordinator"] = _start_coordinator(
                        rt, hello["job_id"], advertised_host(environ, world_size), timeout_s)
                except Exception as e:  # noqa: BLE001 - published so every rank fails with it
                    store.set(hello_key, json.dumps({**hello, "error": str(e)}))
                    raise
            store.set(hello_key, json.dumps(hello))
        else:
            (raw,) = _store_wait(store, [hello_key], peer_s, "rank 0's accord hello")
            hello = json.loads(raw)
            if hello.get("error"):
                raise EmbeddedError(
                    f"accord.connect (embedded mode): rank 0 (host {hello['host']}) could not "
                    f"start the job's coordinator: {hello['error']}")
            if hello["mode"] != choice.mode:
                raise EmbeddedError(
                    f"accord.connect: ranks disagree on where their sidecars are: rank 0 (host "
                    f"{hello['host']}) chose {hello['mode']} ({hello['reason']}) but rank {rank} "
                    f"(host {host_name}) chose {choice.mode} ({choice.reason}); give every node "
                    f"a deployed sidecar or none, or set ACCORD_SOCKET on every rank")
            if job_id is not None and job_id != hello["job_id"]:
                raise EmbeddedError(
                    f"accord.connect: ranks disagree on the job id: rank 0 has "
                    f"{hello['job_id']!r} ({hello['job_id_source']}) but rank {rank} has "
                    f"{job_id!r} ({job_id_source}); give every rank the same ACCORD_JOB_ID")
        out = Bootstrap(mode=choice.mode, job_id=hello["job_id"], socket_path=choice.socket_path)
        if rt is None:
            return out

        coord = hello["coordinator"]
        out.coordinator, out.token = coord["address"], coord["token"]
        out.metrics["coordinator"] = coord["metrics"]
        out.token_file = coord.get("token_file")
        node = node_key(environ)
        node_key_name = f"{prefix}node/{node}"
        if local_rank == 0:
            try:
                info = _start_sidecar(rt, out.job_id, coord, node,
                                      int(environ.get("LOCAL_WORLD_SIZE", "1") or 1), timeout_s)
            except Exception as e:  # noqa: BLE001 - published so the node's ranks fail with it
                store.set(node_key_name, json.dumps({"error": str(e), "host": host_name}))
                raise
            store.set(node_key_name, json.dumps(info))
            if rank != 0:
                rt.lifeline = _LifelineClient(
                    coord["lifeline"], timeout_s,
                    on_lost=lambda: _coordinator_lost(rt, coord, node))
        else:
            (raw,) = _store_wait(store, [node_key_name], peer_s,
                                 f"the sidecar of node {node} (started by its local rank 0)")
            info = json.loads(raw)
            if info.get("error"):
                raise EmbeddedError(
                    f"accord.connect (embedded mode): local rank 0 of node {node} could not "
                    f"start its sidecar: {info['error']}")
            rt.lifeline = _LifelineClient(info["lifeline"], timeout_s, on_lost=None)
        out.socket_path = info["socket"]
        out.metrics[f"sidecar {info.get('node_id', node)}"] = info["metrics"]
        rt.bootstrap = out
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
