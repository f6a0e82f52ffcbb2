"""The collective-sequence guard of accord.torch (docs/PARTICIPATION.md, "The
collective-sequence guard"; its pure parts are in accord.torch.windows).

Every rank records each FSDP2 collective it issues and the end of each step,
in *windows* that close at points every rank agrees on while their sequences
agree: before a collective this rank never issued after the same prefix of
its step (a "new" one: the training thread waits for the verdict, so a rank
about to diverge stops before pairing its collective with another rank's),
and at each release (the window then goes in the release's batch, the same
manifest every steady step). A window is one manifest encoding a 64-bit hash
of its records in two slots per bit; the coordinator's decision includes a
slot when any rank used it, so every rank gets the same verdict.

A rank that makes no progress for STALL_S writes its open window to the
key-value store and compares it with the others': ranks stuck at different
collectives differ at a common position (a divergence); equal prefixes never
do. On divergence every rank builds the same message from every rank's
window and raises accord.torch.AccordDivergenceError; a rank blocked inside a
collective gets it from the background thread, which ends the process
with it.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Callable, Dict, List, Optional, Tuple

from accord.torch.errors import AccordDivergenceError, again, last_words, verdict
from accord.torch.watchdog import end_process, stop_at_exit
from accord.torch.windows import (Window, describe, diverged, first_difference,
                                  repairable_units, slot_params, slots)

STALL_S = 2.0  # waiting this long starts the stall comparison
END = "end of step"


class SequenceGuard:
    """One rank's guard. The training thread calls begin_step() and record();
    a background thread (owned here, stopped by close()) submits windows,
    checks verdicts and looks into stalls."""

    def __init__(
        self,
        client,
        rank: int,
        world_size: int,
        group_id: str,
        timeout_s: float,
        on_divergence: Optional[Callable[[str], None]] = None,
        learner=None,
        stall_s: float = STALL_S,
    ):
        self.client = client
        self.rank = rank
        self.world_size = world_size
        self.group_id = group_id
        self.timeout_s = timeout_s
        self.on_divergence = on_divergence or self._abort
        # learner.can_learn(units) -> units to pin or None (background thread,
        # pure); learner.learn(units, current) -> whether the current
        # collective is done (training thread). See record().
        self.learner = learner
        self.step_group_id = f"{group_id}/step"
        self._new_windows = 0  # windows closed at a new collective (their group's step)
        self.stall_s = stall_s
        self.step = 0
        self.position = 0
        self.prefix = 0  # running hash of this step's records
        self.known: set = set()  # (prefix, entry) transitions every rank agreed on
        self.blocking_waits = 0
        self.blocked_s = 0.0
        self.reports = 0  # collectives recorded
        self.abort_grace_s = 2.0
        self._failure: Optional[BaseException] = None  # its finding, or the job's verdict
        self._open = Window(0)  # guarded by _mu (the stall check reads it)
        self._last_record = time.monotonic()
        self._waiting = False  # the training thread waits for a verdict
        self._raised = threading.Event()  # the training thread has seen the error
        self._registered = False
        self._mu = threading.Lock()
        self._wake = threading.Condition(self._mu)
        self._queue: List[Window] = []  # closed, not yet submitted
        self._inflight: List[Window] = []  # submitted, not yet checked
        self._stop = False
        self._thread: Optional[threading.Thread] = None
        self._exiting = False
        self._stall_checked: Tuple[int, int] = (-1, -1)

    # ------------------------------------------------------------ training thread

    def begin_step(self) -> None:
        """At the start of every root forward: the previous step's end is a
        position of its own (a rank with fewer collectives diverges there)."""
        if self.position > 0:
            self.record(END)
        self.step += 1
        self.position = 0
        self.prefix = 0

    def record(self, entry: str, unit: Optional[str] = None,
               forward_all_gather: bool = False) -> bool:
        """Called just before this rank issues a collective described by
        `entry` (an all-gather of `unit` in a forward when forward_all_gather).
        Returns True when the caller must not issue it: the ranks diverged at
        every rank's first occurrence, at forward all-gathers, and every rank
        has instead all-gathered and pinned a unit that covers it (learned
        optional units, see docs/PARTICIPATION.md)."""
        self._check_error()
        if self._thread is None:
            self._register()
        transition, w = self.note(entry, unit, forward_all_gather)
        if w is None:
            return False
        t0 = time.perf_counter()
        self._waiting = True
        try:
            got = w.checked.wait(self.timeout_s)
        finally:
            self._waiting = False
        if not got:
            raise AccordDivergenceError(
                f"accord: collective-sequence guard: no verdict for step {self.step} "
                f"({entry}) within {self.timeout_s:.0f}s; check the accord sidecar and "
                f"coordinator"
            )
        self.blocked_s += time.perf_counter() - t0
        self.blocking_waits += 1
        self._check_error()
        if w.repair is not None:
            if self.learner.learn(w.repair, unit):
                return True
            # Still to issue: record it again, in a window of its own.
            return self.record(entry, unit, forward_all_gather)
        self.known.add(transition)
        return False

    def note(self, entry: str, unit: Optional[str] = None, forward_all_gather: bool = False):
        """The per-collective bookkeeping of record(): appends the collective to
        the open window; returns (transition, window), the window closed for a
        verdict when the transition is new, else None. Only a tuple append and
        a process-local hash per collective: the window's text and its digest
        are built once per window."""
        self.reports += 1
        transition = (self.prefix, entry)
        new = transition not in self.known
        with self._mu:
            w = self._open
            w.entries.append((self.step, self.position, entry))
            w.unit, w.forward_all_gather = unit, forward_all_gather
            self.position += 1
            # Which transitions this rank saw agreed is local state: Python's
            # hash (the same within the process) serves.
            self.prefix = hash(transition)
            self._last_record = time.monotonic()
            if not new:
                return transition, None
            w.waiting = True
            w.group, w.group_step = self.group_id, self._new_windows
            self._new_windows += 1
            self._close_locked()
            self._wake.notify()
        return transition, w

    def _close_locked(self) -> None:
        w = self._open
        w.closed_at = time.monotonic()
        self._queue.append(w)
        self._open = Window(w.index + 1)
        # Submitted here rather than at the background thread's next turn, so
        # that a closed window never waits for it.
        self._submit_locked()

    # The release (accord.torch.installation) closes the open window and sends
    # it in the step's one batch, to a group of its own at the release's step:
    # in the steady state it is the same manifest every step, so the whole
    # batch repeats (docs/PARTICIPATION.md, "The collective-sequence guard").
    def release_item(self, step: int):
        """Closes the open window for the release at `step`; returns the batch
        item (group, step, manifest) and a token for release_handle()."""
        with self._mu:
            w = self._open
            w.group, w.group_step = self.step_group_id, step
            w.closed_at = time.monotonic()
            self._open = Window(w.index + 1)
        return (w.group, step, slots(w.digest())), w

    def release_handle(self, window: "Window", handle) -> None:
        """The handle of the window's manifest, submitted with the batch."""
        if self._thread is None:
            self._register()
        with self._mu:
            window.handle = handle
            self._inflight.append(window)
            self._wake.notify()

    @property
    def error(self) -> Optional[str]:  # the failure's text, once there is one
        return None if self._failure is None else str(self._failure)

    def _check_error(self) -> None:
        if self._failure is not None:
            self._raised.set()
            raise again(self._failure)

    def explain(self, failure: BaseException, wait_s: float = 30.0) -> None:
        """A collective failed (a peer stopped or died): if the guard finds a
        divergence in time, raise it instead; otherwise return (the caller
        re-raises the original failure)."""
        deadline = time.monotonic() + wait_s
        while self.error is None and time.monotonic() < deadline:
            message = self._compare_stalled(timeout_s=min(2.0, self.timeout_s))
            if message is not None:
                self._fail(message, None, raise_here=True)
                break
            with self._mu:
                outstanding = list(self._inflight)
            if not outstanding:
                break
            outstanding[0].checked.wait(min(1.0, max(0.0, deadline - time.monotonic())))
        if self._failure is not None:
            self._raised.set()
            raise again(self._failure) from failure

    def registrations(self) -> List[tuple]:
        """The guard's groups (windows closed at new collectives; windows
        closed at releases), for the installation's one batched registration
        (then call registered())."""
        return [(self.group_id, slot_params(), None, False),
                (self.step_group_id, slot_params(), None, False)]

    def registered(self) -> None:
        self._registered = True

    def _register(self) -> None:
        if not self._registered:
            for group_id, params, _, _ in self.registrations():
                self.client.register_group(group_id, params, reduce_dtype=None,
                                           reduce_dtype_exact=False, timeout_s=self.timeout_s)
            self._registered = True
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="accord-guard", daemon=True)
            self._thread.start()
            stop_at_exit(self)

    # ------------------------------------------------------------ background

    def _submit_locked(self) -> None:
        for w in self._queue:
            w.handle = self.client.submit(w.group, w.group_step, slots(w.digest()))
            self._inflight.append(w)
        self._queue.clear()

    def _run(self) -> None:
        while not self._exiting:
            with self._mu:
                window = self._inflight[0] if self._inflight else None
                if window is None:
                    if self._stop:
                        return
                    self._wake.wait(self.stall_s / 2)
                    stalled = bool(self._open.entries) and (
                        time.monotonic() - self._last_record > self.stall_s)
            if window is None:
                if stalled and self.error is None:
                    self._check_stall()  # outside the lock: it talks to the KV store
                continue
            try:
                decision = self.client.wait(window.handle, timeout_s=self.stall_s)
            except Exception:  # noqa: BLE001 - a timeout, or the service's named error
                if self._exiting:
                    return
                if not window.handle.ready():
                    # Not there yet: someone may be stuck; look, then wait again.
                    if time.monotonic() - window.closed_at > self.timeout_s:
                        self._fail(f"accord: collective-sequence guard: no verdict for window "
                                   f"{window.index} within {self.timeout_s:.0f}s", window)
                        return
                    self._check_stall()
                    if self.error is not None:
                        return
                    continue
                # Decided as the wait timed out (a race): the decision is
                # what counts, never the local timeout.
                try:
                    decision = self.client.wait(window.handle, timeout_s=0)
                except Exception as said:  # noqa: BLE001 - the job's verdict
                    self._fail(verdict(said, f"accord.torch: learned by the collective-sequence "
                                             f"guard at {window.records[-1]}"), window)
                    return
            message = None
            if diverged(decision.included):
                entries = self._gather(window)
                window.repair = self._repairable(entries)
                if window.repair is None:
                    message = describe(entries)
            with self._mu:
                self._inflight.pop(0)
            if message is not None:
                self._fail(message, window)
                return
            window.checked.set()

    def _fail(self, failure, window: Optional[Window], raise_here: bool = False) -> None:
        """`failure`: the guard's own finding (its text), or the job's verdict."""
        if isinstance(failure, str):
            failure = AccordDivergenceError(failure)
        self._failure = failure
        message = str(failure)
        with self._mu:
            pending = ([window] if window else []) + self._inflight + self._queue
        for w in pending:
            w.checked.set()
        if raise_here:
            return
        # The training thread raises the error itself when it is waiting for a
        # verdict or reaches its next collective within the grace; a thread
        # blocked inside a collective never will.
        if self._waiting or self._raised.wait(self.abort_grace_s):
            return
        self.on_divergence(message)

    def _gather(self, window: Window) -> Dict[int, dict]:
        """Every rank's window at this index, through the key-value store (each
        rank writes its own, then reads all): the same on every rank."""
        key = f"{self.group_id}/diverged/{window.index}"
        mine = {"records": window.records, "waiting": window.waiting, "unit": window.unit,
                "forward_all_gather": window.forward_all_gather}
        try:
            self.client.kv_set(f"{key}/{self.rank}", json.dumps(mine).encode())
            values = self.client.kv_get([f"{key}/{r}" for r in range(self.world_size)],
                                        timeout_s=min(self.timeout_s, 10.0))
            return {r: json.loads(bytes(v).decode()) for r, v in enumerate(values)}
        except Exception as e:  # noqa: BLE001 - some rank did not answer in time
            mine["records"] = mine["records"] + [f"(the other ranks did not report: {e})"]
            return {self.rank: mine}

    def _repairable(self, entries: Dict[int, dict]) -> Optional[List[str]]:
        """The units to pin on every rank, or None when this divergence is an
        error (accord.torch.windows.repairable_units)."""
        if self.learner is None:
            return None
        units = repairable_units(entries, self.world_size)
        return None if units is None else self.learner.can_learn(units)

    # ------------------------------------------------------------ stalls

    def _check_stall(self) -> None:
        message = self._compare_stalled(timeout_s=min(1.0, self.timeout_s))
        if message is not None:
            self._fail(message, None)

    def _compare_stalled(self, timeout_s: float) -> Optional[str]:
        """Writes this rank's current window (the one it waits on, or the open
        one it is stuck in) and compares it with the other ranks' for the same
        window index; a message when they differ at a common position."""
        with self._mu:
            w = self._inflight[0] if self._inflight else self._open
            records = list(w.records)
            index = w.index
        if not records:
            return None
        key = f"{self.group_id}/stalled/{index}"
        try:
            # Keys are write-once per run: a window's first stall is written,
            # a later one in the same window compares that (a true prefix).
            if self._stall_checked[0] != index:
                self.client.kv_set(f"{key}/{self.rank}",
                                   json.dumps({"records": records}).encode())
                self._stall_checked = (index, len(records))
            values = self.client.kv_get([f"{key}/{r}" for r in range(self.world_size)],
                                        timeout_s=timeout_s)
        except Exception:  # noqa: BLE001 - a rank that is not stuck has not written
            return None
        entries = {r: json.loads(bytes(v).decode()) for r, v in enumerate(values)}
        p = first_difference(entries, prefix_only=True)
        if p is None:
            return None  # the common prefix agrees: slow, not diverged
        return describe({r: {"records": e["records"][: p + 1]} for r, e in entries.items()})

    def _abort(self, message: str) -> None:
        """Default on divergence while the training thread may be blocked in a
        collective (accord.torch.watchdog.end_process)."""
        end_process(last_words(self._failure) if self._failure is not None
                    else f"AccordDivergenceError: {message}")

    def close(self) -> None:
        with self._mu:
            self._stop = True
            self._wake.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.timeout_s)

    def stop_for_exit(self) -> None:  # watchdog.stop_at_exit: no verdict is waited for
        with self._mu:
            self._stop = self._exiting = True
            self._wake.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.stall_s + 1)
