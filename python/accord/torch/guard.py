"""The collective-sequence guard of accord.torch (docs/PARTICIPATION.md, "The
collective-sequence guard"). Its parts: accord.torch.sequence (which records
are new), accord.torch.windows (a window's manifest and text, pure) and
accord.torch.compare (windows compared through the key-value store).

Every rank records each FSDP2 collective it issues and the end of each step,
in *windows* that close before a new collective (the training thread waits
for the verdict, so a rank about to diverge stops before pairing its
collective with another rank's) and at each release (in the release's batch).
A window is one manifest encoding a 64-bit hash of its records in two slots
per bit; the coordinator's decision includes a slot when any rank used it, so
every rank gets the same verdict. Stalls and divergences are worded from every
rank's window, the same on every rank: accord.torch.AccordDivergenceError.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Dict, List, Optional

from accord.torch import members as member_sets
from accord.torch.compare import WindowComparison
from accord.torch.errors import AccordDivergenceError, again, last_words, verdict
from accord.torch.sequence import StepSequence
from accord.torch.watchdog import end_process, stop_at_exit
from accord.torch.windows import Window, Wording, diverged, repairable_units, slot_params, slots

STALL_S = 2.0  # waiting this long starts the stall comparison
END = "end of step"


class SequenceGuard:
    """One rank's guard. The training thread calls begin_step(), record(),
    and release_item() and release_handle() at each release; a background
    thread (owned here, stopped by close()) checks the verdicts that need it
    (see _due_locked) and looks into stalls."""

    def __init__(self, client, rank: int, world_size: int, group_id: str, timeout_s: float,
                 on_divergence: Optional[Callable[[str], None]] = None, learner=None,
                 stall_s: float = STALL_S, wording: Wording = Wording(),
                 in_forward: Callable[[object], bool] = lambda group: False,
                 members: member_sets.Members = None):
        self.client = client
        self.rank = rank
        self.world_size = world_size
        self.members = members  # windows are agreed among these ranks (None: every rank)
        tag = member_sets.tag(members)
        self.group_id, self.step_group_id = group_id + tag, f"{group_id}/step{tag}"
        self.timeout_s = timeout_s
        self.on_divergence = on_divergence or self._abort
        # learner.can_learn(units) -> units to pin or None (background thread,
        # pure); learner.learn(units, current) -> whether the current
        # collective is done (training thread). See record(). in_forward(group):
        # whether `group`'s collective is a forward all-gather (asked of new ones).
        self.learner, self.in_forward = learner, in_forward
        self._new_windows = 0  # windows closed at a new collective (their group's step)
        self.stall_s, self.step = stall_s, 0
        self.sequence = StepSequence()  # which records are new
        self.blocking_waits, self.blocked_s = 0, 0.0
        self.reports = 0  # collectives recorded
        self.abort_grace_s = 2.0
        self._failure: Optional[BaseException] = None  # its finding, or the job's verdict
        self._open = Window(0, 0, 0)  # replaced under _mu (the stall check reads it)
        self._seen = (0, time.monotonic())  # (reports, when the guard's thread saw them)
        self._release: tuple = (None, None)  # the last release window's shape, manifest
        self._waiting = self._registered = False  # _waiting: the training thread waits
        self._raised = threading.Event()  # the training thread has seen the error
        self._mu = threading.Lock()
        self._wake = threading.Condition(self._mu)
        self._queue: List[Window] = []  # closed, not yet submitted
        self._inflight: List[Window] = []  # submitted, not yet checked
        self._stop = self._exiting = False
        self._thread: Optional[threading.Thread] = None
        self.comparison = WindowComparison(client, self.group_id, rank, world_size, timeout_s,
                                           wording, members=members)

    # ------------------------------------------------------------ training thread

    def begin_step(self) -> None:
        """At the start of every root forward: the previous step's end is a
        position of its own (a rank with fewer collectives diverges there)."""
        if self.sequence.position > 0:
            self.record(END)
        self.sequence.end_step()
        self.step += 1
        with self._mu:
            self._open.begin(self.step)

    def record(self, entry: str, unit: Optional[str] = None, group=None) -> bool:
        """Called just before this rank issues a collective described by
        `entry` (of `unit`, FSDP2 parameter group `group`). Returns True when
        the caller must not issue it: the ranks diverged at every rank's first
        occurrence, at forward all-gathers, and every rank has instead
        all-gathered and pinned a unit that covers it (learned optional
        units, see docs/PARTICIPATION.md)."""
        if self._failure is not None:
            self._check_error()
        if self.sequence.follows(entry):
            # The steady state: agreed in an earlier step. No lock: only this
            # thread appends, and the stall check copies the list whole.
            self.reports += 1
            self._open.entries.append(entry)
            return False
        return self._record_new(entry, unit, group)

    def _record_new(self, entry: str, unit: Optional[str], group) -> bool:
        """record() off the path: the transition set decides whether the
        collective is new (then the training thread waits for the verdict)."""
        if self._thread is None:
            self._register()
        transition, w = self.note(entry, unit, group)
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
            self.sequence.unagreed()
            if self.learner.learn(w.repair, unit):
                return True
            # Still to issue: record it again, in a window of its own.
            return self.record(entry, unit, group)
        self.sequence.agree(transition)
        return False

    def note(self, entry: str, unit: Optional[str] = None, group=None):
        """The bookkeeping of a record off the paths: appends the collective
        to the open window; returns (transition, window), the window closed
        for a verdict when the transition is new, else None."""
        self.reports += 1
        transition, new = self.sequence.off_path_record(entry)
        with self._mu:
            w = self._open
            w.entries.append(entry)
            if not new:
                return transition, None
            w.unit = unit
            w.forward_all_gather = unit is not None and self.in_forward(group)
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
        self._open = Window(w.index + 1, self.step, self.sequence.position)
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
            self._open = Window(w.index + 1, self.step, self.sequence.position)
        # In the steady state the window is the last one again: its manifest
        # is too (the digest covers positions and entries, not steps).
        key = w.shape()
        if key != self._release[0]:
            self._release = (key, slots(w.digest()))
        return (w.group, step, self._release[1]), w

    def release_handle(self, window: "Window", handle) -> None:
        """The handle of the window's manifest, submitted with the batch; the
        earlier release verdicts that are in are checked off here."""
        if self._thread is None:
            self._register()
        with self._mu:
            window.handle = handle
            self._inflight.append(window)
            if self._settle_locked():
                self._wake.notify()

    def _settle_locked(self) -> bool:
        """Checks off, oldest first, the release windows whose verdict is in
        and agrees; True when the next one's is in and needs the guard's
        thread (a divergence, or the job's error)."""
        while self._inflight:
            w = self._inflight[0]
            ready = getattr(w.handle, "ready", None)
            if w.waiting or ready is None or not ready():
                return False
            try:
                decision = self.client.wait(w.handle, timeout_s=0)
            except Exception:  # noqa: BLE001 - the job's verdict: the guard's thread words it
                return True
            if diverged(decision.included):
                return True
            self._inflight.pop(0)
            w.checked.set()
        return False

    error = property(lambda self: None if self._failure is None else str(self._failure))

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
        return [member_sets.registration((g, slot_params(), None, False), self.members)
                for g in (self.group_id, self.step_group_id)]

    def registered(self) -> None:
        self._registered = True

    def _register(self) -> None:
        if not self._registered:
            for group_id, params, *_ in self.registrations():
                self.client.register_group(group_id, params, reduce_dtype=None,
                                           reduce_dtype_exact=False, timeout_s=self.timeout_s,
                                           members=self.members and list(self.members))
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
                    stalled = bool(self._open.entries) and now - self._seen[1] > self.stall_s
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
                    where = window.records[-1] if window.records else f"window {window.index}"
                    self._fail(verdict(said, f"accord.torch: learned by the collective-sequence "
                                             f"guard at {where}"), window)
                    return
            message = None
            if diverged(decision.included):
                entries = self.comparison.gather(window)
                window.repair = self._repairable(entries)
                if window.repair is None:
                    message = self.comparison.describe(entries)
            with self._mu:
                if window in self._inflight:  # the training thread may have checked it off
                    self._inflight.remove(window)
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

    def _repairable(self, entries: Dict[int, dict]) -> Optional[List[str]]:
        """The units to pin on every rank, or None when this divergence is an
        error (accord.torch.windows.repairable_units)."""
        if self.learner is None:
            return None
        units = repairable_units(entries, len(self.comparison.ranks))
        return None if units is None else self.learner.can_learn(units)

    def _check_stall(self) -> None:
        if (message := self._compare_stalled(timeout_s=min(1.0, self.timeout_s))) is not None:
            self._fail(message, None)

    def _compare_stalled(self, timeout_s: float) -> Optional[str]:
        """The window this rank waits on, or the open one it is stuck in,
        against the other ranks' (accord.torch.compare)."""
        with self._mu:
            if self._settle_locked():  # verdicts in: not what this rank waits on
                self._wake.notify()
            w = self._inflight[0] if self._inflight else self._open
            records, index, final = w.records, w.index, w is not self._open
        return self.comparison.stalled(records, index, timeout_s, final)

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
