"""The collective-sequence guard's windows and their verdicts
(docs/PARTICIPATION.md, "The collective-sequence guard"). The guard
(accord.torch.guard) decides what each record is; this module carries the
windows: open while the training thread records into it, closed at a new
collective (submitted at once; the training thread waits for its verdict)
or at a release (handed with the step's batch), checked when the verdict is
in. An agreed verdict checks the window off; a diverged one gathers every
rank's window and either words the divergence or hands the units to learn
back to the training thread; the job's error becomes the guard's failure.
Stalls (no record for stall_s) are compared across ranks the same way."""

from __future__ import annotations

import threading
import time
from typing import Callable, Dict, List, Optional

from accord.torch.compare import WindowComparison
from accord.torch.errors import AccordDivergenceError, again, last_words, verdict
from accord.torch.watchdog import end_process, stop_at_exit
from accord.torch.windows import Window, diverged, slots


class Verdicts:
    """One guard's windows. The training thread appends to the open window,
    closes windows, hands release windows' handles and raises the failure
    (check()); the thread owned here (start(), stopped by close()) waits for
    the verdicts that need it (see _due_locked) and looks into stalls."""

    def __init__(self, client, comparison: WindowComparison, timeout_s: float, stall_s: float,
                 on_divergence: Callable[[str], None],
                 repairable: Callable[[Dict[int, dict]], Optional[List[str]]]):
        self.client = client
        self.comparison = comparison
        self.timeout_s, self.stall_s = timeout_s, stall_s
        # Called with the message when the training thread does not raise the
        # failure within abort_grace_s (it may be blocked in a collective).
        self.on_divergence = on_divergence or self._abort
        self.repairable = repairable  # every rank's window -> the units to learn, or None
        self.abort_grace_s = 2.0
        self.open = Window(0, 0, 0)  # replaced under _mu (the stall check reads it)
        self.reports = 0  # collectives recorded; the training thread counts, unlocked
        self.failure: Optional[BaseException] = None  # the finding, or the job's verdict
        self.waiting = False  # the training thread waits for a verdict
        self._seen = (0, time.monotonic())  # (reports, when this thread saw them)
        self._raised = threading.Event()  # the training thread has seen the failure
        self._mu = threading.Lock()
        self._wake = threading.Condition(self._mu)
        self._queue: List[Window] = []  # closed, not yet submitted
        self._inflight: List[Window] = []  # submitted, not yet checked
        self._stop = self._exiting = False
        self._thread: Optional[threading.Thread] = None

    error = property(lambda self: None if self.failure is None else str(self.failure))

    # ------------------------------------------------------------ training thread

    def begin(self, step: int) -> None:
        with self._mu:
            self.open.begin(step)

    def follow(self, entry: str) -> None:
        """Records `entry`, agreed in an earlier step, in the open window. No
        lock: only the training thread appends, and the stall check copies
        the list whole."""
        self.reports += 1
        self.open.entries.append(entry)

    def note(self, entry: str, closing: Optional[tuple], step: int, position: int):
        """Records `entry` in the open window; with `closing` = (group,
        group_step, unit, forward_all_gather) also closes it for a verdict
        and submits it. Returns the closed window, or None."""
        self.reports += 1
        with self._mu:
            w = self.open
            w.entries.append(entry)
            if closing is None:
                return None
            w.group, w.group_step, w.unit, w.forward_all_gather = closing
            w.waiting = True
            w.closed_at = time.monotonic()
            self._queue.append(w)
            self.open = Window(w.index + 1, step, position)
            # Submitted here rather than at this thread's next turn, so that a
            # closed window never waits for it.
            self._submit_locked()
            self._wake.notify()
        return w

    def close_release(self, group: str, group_step: int, step: int, position: int) -> Window:
        """Closes the open window for the release at `group_step` (its
        manifest goes in the step's batch: hand() its handle)."""
        with self._mu:
            w = self.open
            w.group, w.group_step = group, group_step
            w.closed_at = time.monotonic()
            self.open = Window(w.index + 1, step, position)
        return w

    def hand(self, window: Window, handle) -> None:
        """The handle of a release window's manifest; the earlier release
        verdicts that are in are checked off here."""
        with self._mu:
            window.handle = handle
            self._inflight.append(window)
            if self._settle_locked():
                self._wake.notify()

    def wait(self, window: Window) -> bool:
        """Waits (at most timeout_s) for the verdict of a window closed at a
        new collective; False when none came."""
        self.waiting = True
        try:
            return window.checked.wait(self.timeout_s)
        finally:
            self.waiting = False

    def check(self) -> None:
        """Raises the failure, once there is one."""
        if self.failure is not None:
            self._raised.set()
            raise again(self.failure)

    def pending(self) -> List[Window]:
        """The windows submitted and not checked yet, oldest first."""
        with self._mu:
            return list(self._inflight)

    def explain(self, failure: BaseException, wait_s: float) -> None:
        """A collective failed (a peer stopped or died): if a divergence is
        found in time, raise it instead; otherwise return (the caller
        re-raises the original failure)."""
        deadline = time.monotonic() + wait_s
        while self.failure is None and time.monotonic() < deadline:
            message = self._compare_stalled(timeout_s=min(2.0, self.timeout_s))
            if message is not None:
                self._fail(message, None, raise_here=True)
                break
            outstanding = self.pending()
            if not outstanding:
                break
            outstanding[0].checked.wait(min(1.0, max(0.0, deadline - time.monotonic())))
        if self.failure is not None:
            self._raised.set()
            raise again(self.failure) from failure

    # ------------------------------------------------------------ the thread

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="accord-guard", daemon=True)
            self._thread.start()
            stop_at_exit(self)

    @property
    def started(self) -> bool:
        return self._thread is not None

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

    def _submit_locked(self) -> None:
        for w in self._queue:
            w.handle = self.client.submit(w.group, w.group_step, slots(w.digest()))
            self._inflight.append(w)
        self._queue.clear()

    def _settle_locked(self) -> bool:
        """Checks off, oldest first, the release windows whose verdict is in
        and agrees; True when the next one's is in and needs this thread (a
        divergence, or the job's error)."""
        while self._inflight:
            w = self._inflight[0]
            ready = getattr(w.handle, "ready", None)
            if w.waiting or ready is None or not ready():
                return False
            try:
                decision = self.client.wait(w.handle, timeout_s=0)
            except Exception:  # noqa: BLE001 - the job's verdict: this thread words it
                return True
            if diverged(decision.included):
                return True
            self._inflight.pop(0)
            w.checked.set()
        return False

    def _due_locked(self) -> Optional[Window]:
        """The oldest submitted window when this thread should wait for its
        verdict now: the training thread waits for it (or one behind it), it
        is in, overdue (stall_s), or the guard stops; else the next release."""
        if not self._inflight:
            return None
        w = self._inflight[0]
        ready = getattr(w.handle, "ready", None)
        return w if (self._stop or self._inflight[-1].waiting or ready is None or ready()
                     or time.monotonic() - w.closed_at > self.stall_s) else None

    def _run(self) -> None:
        while not self._exiting:
            with self._mu:
                window = self._due_locked()
                if window is None:
                    if self._stop:
                        return
                    self._wake.wait(self.stall_s / 2)
                    # No record since the last look, stall_s ago or more:
                    # stalled (the training thread keeps no clock per record).
                    now = time.monotonic()
                    if self.reports != self._seen[0]:
                        self._seen = (self.reports, now)
                    stalled = bool(self.open.entries) and now - self._seen[1] > self.stall_s
            if window is None:
                if stalled and self.failure is None:
                    self._check_stall()  # outside the lock: it talks to the KV store
                continue
            decision = self._verdict_of(window)
            if decision is None:
                if self.failure is not None or self._exiting:
                    return
                continue
            if not self._judge(window, decision):
                return

    def _verdict_of(self, window: Window):
        """The window's decision; None when it is not there yet (a stall was
        looked into) or the guard failed waiting for it."""
        try:
            return self.client.wait(window.handle, timeout_s=self.stall_s)
        except Exception:  # noqa: BLE001 - a timeout, or the service's named error
            if self._exiting:
                return None
            if not window.handle.ready():
                # Not there yet: someone may be stuck; look, then wait again.
                if time.monotonic() - window.closed_at > self.timeout_s:
                    self._fail(f"accord: collective-sequence guard: no verdict for window "
                               f"{window.index} within {self.timeout_s:.0f}s", window)
                    return None
                self._check_stall()
                return None
        # Decided as the wait timed out (a race): the decision is what counts,
        # never the local timeout.
        try:
            return self.client.wait(window.handle, timeout_s=0)
        except Exception as said:  # noqa: BLE001 - the job's verdict
            where = window.records[-1] if window.records else f"window {window.index}"
            self._fail(verdict(said, f"accord.torch: learned by the collective-sequence "
                                     f"guard at {where}"), window)
            return None

    def _judge(self, window: Window, decision) -> bool:
        """Checks the window off with its verdict; False when it failed."""
        message = None
        if diverged(decision.included):
            entries = self.comparison.gather(window)
            window.repair = self.repairable(entries)
            if window.repair is None:
                message = self.comparison.describe(entries)
        with self._mu:
            if window in self._inflight:  # the training thread may have checked it off
                self._inflight.remove(window)
        if message is not None:
            self._fail(message, window)
            return False
        window.checked.set()
        return True

    def _fail(self, failure, window: Optional[Window], raise_here: bool = False) -> None:
        """`failure`: the guard's own finding (its text), or the job's verdict."""
        if isinstance(failure, str):
            failure = AccordDivergenceError(failure)
        self.failure = failure
        message = str(failure)
        with self._mu:
            pending = ([window] if window else []) + self._inflight + self._queue
        for w in pending:
            w.checked.set()
        if raise_here:
            return
        # The training thread raises the failure itself when it is waiting for
        # a verdict or reaches its next collective within the grace; a thread
        # blocked inside a collective never will.
        if self.waiting or self._raised.wait(self.abort_grace_s):
            return
        self.on_divergence(message)

    def _check_stall(self) -> None:
        if (message := self._compare_stalled(timeout_s=min(1.0, self.timeout_s))) is not None:
            self._fail(message, None)

    def _compare_stalled(self, timeout_s: float) -> Optional[str]:
        """The window this rank waits on, or the open one it is stuck in,
        against the other ranks' (accord.torch.compare)."""
        with self._mu:
            if self._settle_locked():  # verdicts in: not what this rank waits on
                self._wake.notify()
            w = self._inflight[0] if self._inflight else self.open
            records, index, final = w.records, w.index, w is not self.open
        return self.comparison.stalled(records, index, timeout_s, final)

    def _abort(self, message: str) -> None:
        """Default on divergence while the training thread may be blocked in a
        collective (accord.torch.watchdog.end_process)."""
        end_process(last_words(self.failure) if self.failure is not None
                    else f"AccordDivergenceError: {message}")
