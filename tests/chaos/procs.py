"""Processes and links of one chaos run: daemons, ranks and cuttable proxies.

Every process is a real binary of this build started as its own process
group, with its output captured line by line and time-stamped (so the
oracle can measure when each rank got its error). A `Proxy` sits on each
TCP link between a sidecar (or relay) and the node above it, and can cut,
blackhole or delay that link.
"""

import os
import select
import signal
import socket
import subprocess
import threading
import time


class Proc:
    """One process of the run; restartable with the same arguments."""

    def __init__(self, name, args, log_dir, env=None, launch_env=False):
        self.name = name
        self.args = list(args)
        self.env = env
        # A rank: ACCORD_LAUNCH_ID says which launch each incarnation is
        # (RankHello.launch_id): the first is the job's launch, shared by
        # every rank; a restart is a launch of its own.
        self.launch_env = launch_env
        self.log_dir = log_dir
        self.popen = None
        self.lines = []  # (monotonic time, line) of every incarnation
        self.incarnation = 0
        self.killed_by_us = False  # the harness sent SIGKILL to the current incarnation
        self.exits = []  # (incarnation, returncode) of incarnations that ended
        self.ended_at = {}  # incarnation -> monotonic time its output ended
        self._cond = threading.Condition()

    def start(self):
        self.incarnation += 1
        self.killed_by_us = False
        log = open(os.path.join(self.log_dir, f"{self.name}.{self.incarnation}.log"), "w")
        env = self.env
        if self.launch_env:
            env = dict(os.environ if env is None else env)
            env["ACCORD_LAUNCH_ID"] = (
                "job" if self.incarnation == 1 else f"{self.name}.{self.incarnation}")
        self.popen = subprocess.Popen(
            self.args, stdout=subprocess.PIPE, stderr=log, env=env,
            start_new_session=True, text=True, bufsize=1)
        inc = self.incarnation
        threading.Thread(target=self._read, args=(self.popen, inc), daemon=True).start()
        return self

    def _read(self, popen, inc):
        with open(os.path.join(self.log_dir, f"{self.name}.{inc}.out"), "w") as out:
            for line in popen.stdout:
                t = time.monotonic()
                out.write(f"{t:.3f} {line}")
                out.flush()
                with self._cond:
                    self.lines.append((t, inc, line.rstrip("\n")))
                    self._cond.notify_all()
        popen.wait()
        with self._cond:
            self.ended_at[inc] = time.monotonic()
            self.exits.append((inc, popen.returncode))
            self._cond.notify_all()

    def wait_line(self, prefix, timeout):
        """The rest of the first line of the current incarnation starting with prefix."""
        end = time.monotonic() + timeout
        with self._cond:
            while True:
                for _, inc, line in self.lines:
                    if inc == self.incarnation and line.startswith(prefix):
                        return line[len(prefix):].strip()
                if any(i == self.incarnation for i, _ in self.exits):
                    raise RuntimeError(f"{self.name} exited before printing {prefix!r}: "
                                       f"{self.stderr_tail()}")
                left = end - time.monotonic()
                if left <= 0:
                    raise RuntimeError(f"{self.name} printed no {prefix!r} within {timeout}s")
                self._cond.wait(left)

    def printed(self):
        """Whether the current incarnation printed anything."""
        with self._cond:
            return any(inc == self.incarnation for _, inc, _ in self.lines)

    def alive(self):
        return self.popen is not None and self.popen.poll() is None

    def signal(self, sig):
        if self.alive():
            try:
                os.killpg(self.popen.pid, sig)
            except ProcessLookupError:
                pass
            if sig == signal.SIGKILL:
                self.killed_by_us = True

    def kill(self):
        self.signal(signal.SIGCONT)  # a stopped process must not stay stopped after its kill
        self.signal(signal.SIGKILL)
        if self.popen is not None:
            try:
                self.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass

    def wait_exit(self, timeout):
        """The return code of the current incarnation, or None while it runs."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if not self.alive():
                self.popen.wait()
                # its output is read to the end before the exit counts
                with self._cond:
                    self._cond.wait_for(
                        lambda: any(i == self.incarnation for i, _ in self.exits), timeout=5)
                return self.popen.returncode
            time.sleep(0.02)
        return None

    def stderr_tail(self, n=4000):
        path = os.path.join(self.log_dir, f"{self.name}.{self.incarnation}.log")
        try:
            with open(path, errors="replace") as f:
                return f.read()[-n:]
        except OSError:
            return ""

    def ready_time(self, incarnation, timeout):
        """When `incarnation` said it serves (a daemon's "serving"/"listening"
        line), waiting up to `timeout`. One that ended first: when it ended
        (it never served); None if it neither served nor ended in time."""
        end = time.monotonic() + timeout
        with self._cond:
            while True:
                for t, inc, line in self.lines:
                    if inc == incarnation and (" serving " in line or " listening " in line):
                        return t
                if incarnation in self.ended_at:
                    return self.ended_at[incarnation]
                left = end - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)

    def output(self, incarnation=None):
        with self._cond:
            return [(t, line) for t, inc, line in self.lines
                    if incarnation is None or inc == incarnation]


class Proxy:
    """A TCP proxy on one link, with faults: cut, blackhole and delay.

    cut: every open connection is closed, and new ones are closed at once,
      until healed (a network partition with resets).
    blackhole: bytes in both directions are read and thrown away, the
      connections stay open (a partition without resets, so only keepalive
      notices); when healed, those connections are closed (their streams lost
      bytes and cannot go on) and new ones work.
    delay: each chunk waits `delay_s` before it is forwarded, until healed.
    """

    def __init__(self, target_port):
        self.target_port = target_port
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.port = self.listener.getsockname()[1]
        self.mode = "pass"
        self.delay_s = 0.0
        self.lock = threading.Lock()
        self.conns = []
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while not self.closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            with self.lock:
                mode = self.mode
            if mode == "cut":
                _close(client)
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=2)
                upstream.settimeout(None)
            except OSError:
                _close(client)
                continue
            pair = [client, upstream]
            with self.lock:
                self.conns.append(pair)
            threading.Thread(target=self._pump, args=(pair,), daemon=True).start()

    def _pump(self, pair):
        a, b = pair
        peer = {a: b, b: a}
        try:
            while True:
                ready, _, _ = select.select([a, b], [], [], 0.2)
                with self.lock:
                    if pair not in self.conns:
                        return
                    mode, delay = self.mode, self.delay_s
                for s in ready:
                    data = s.recv(65536)
                    if not data:
                        return
                    if mode == "blackhole":
                        continue
                    if mode == "delay" and delay > 0:
                        time.sleep(delay)
                    peer[s].sendall(data)
        except OSError:
            return
        finally:
            with self.lock:
                if pair in self.conns:
                    self.conns.remove(pair)
            _close(a)
            _close(b)

    def _drop_all(self):
        with self.lock:
            pairs, self.conns = self.conns, []
        for a, b in pairs:
            _close(a)
            _close(b)

    def cut(self):
        with self.lock:
            self.mode = "cut"
        self._drop_all()

    def blackhole(self):
        with self.lock:
            self.mode = "blackhole"

    def delay(self, seconds):
        with self.lock:
            self.mode, self.delay_s = "delay", seconds

    def heal(self):
        with self.lock:
            was, self.mode, self.delay_s = self.mode, "pass", 0.0
        if was == "blackhole":
            self._drop_all()

    def close(self):
        self.closed = True
        _close(self.listener)
        self._drop_all()


def _close(s):
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        s.close()
    except OSError:
        pass


def free_port():
    """A TCP port on loopback that was free a moment ago."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def rss_kib(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0
