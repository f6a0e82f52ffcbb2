"""The embedded daemons as child processes that die with the rank that
started them, their private folder, and the TCP lifelines between ranks."""

from __future__ import annotations

import collections
import ctypes
import os
import queue
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from typing import Callable, Dict, List, Optional

from accord.embedded.mode import EmbeddedError
from accord.embedded.store import join_host_port, split_host_port

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


class Daemon:
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


class PrivateDir:
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


class LifelineServer:
    """Accepts lifelines from the ranks that depend on this rank's daemons and
    tells when all of them have closed. One selector thread; nothing is read
    or written on a lifeline but its end."""

    def __init__(self, host: str):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.bind((host, 0))
        self._listener.listen(256)
        self._listener.setblocking(False)
        self.address = join_host_port(host, self._listener.getsockname()[1])
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


class LifelineClient:
    """This rank's lifeline to the rank whose daemons it uses. With
    `on_lost`, a thread waits for the line to end and calls it unless this
    side closed first."""

    def __init__(self, address: str, timeout_s: float, on_lost: Optional[Callable[[], None]]):
        host, port = split_host_port(address)
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
