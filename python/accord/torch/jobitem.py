"""`~job` of one client: its registration, and the job watch of a job whose
member sets have one rank (docs/MEMBERS.md 2.13 point 3).

Two modes, fixed by the registration's one slot, so every rank of the job
runs the same one (a job whose ranks disagree gets the coordinator's
registration error for `~job`, raised at the next step):

- `alive` (every member set has two ranks or more): `~job` is submitted only
  when a pipeline transfer fails because its peer's process ended
  (`ask`); a stopped rank is named by its member set's `~step@M`.
- `each-step` (the installation's member set is this rank alone: DP 1
  under a pipeline schedule, or TP or EP with DP 1): nobody of its set is
  left to name it, so `~job` names it. Every rank submits `~job` at step s
  once its step s ends (from the watch thread: the training thread only
  counts), and the watch thread submits it early when the training thread
  makes no progress for `stall_s` inside step s; still stalled `stall_s`
  after that item was decided ok (every rank was alive at s), it submits
  the next step's, and so on. Every live rank thus submits every step
  index, at its step's end or by stalling; a stopped rank stops at some
  index k, and the first submission of k + 1 starts the coordinator's
  clock: it is named at the deadline. A killed rank's peer, which Gloo
  tells (a reset connection) and whose process then ends with that error,
  submits its open step at exit, which the rank that left misses.

A step is the count of the process's schedule steps (the outermost step()
calls: enter()/leave()) under a pipeline schedule; outside one, of the
installed root modules' steps, from a root forward to the end of the
backward that ends FSDP2's step (begin_step()/end_step(), the step watch's
own brackets). Either is alike on every rank of a job whose ranks run the
same program, as TP, EP and pipeline peers do; once a schedule has driven a
step, only schedule steps count.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Optional

from accord.errors import is_local_timeout
from accord.torch.errors import AccordJobError, again, last_words, verdict
from accord.torch.watchdog import end_process, stop_at_exit

GROUP = "~job"
MANIFEST = ["float32"]
REGISTER_WAIT_S = 1.0
_WHERE = "accord.torch: a rank stopped or died while this rank was blocked in a step"
_TRANSFER = ("accord.torch: a pipeline transfer failed (a rank of another stage stopped or "
             "died)")
_EXIT = ("accord.torch: this process is ending with a collective's error (a peer's process "
         "ended) inside a step")
# Gloo's words when the other end of a transfer is gone (its process ended):
# Gloo raises a plain RuntimeError with no code, so its text is all there is
# to match. Other errors are the caller's own and pass unchanged.
_PEER_GONE = ("Connection reset", "Connection closed", "Broken pipe", "ECONNRESET")


def peer_gone(failure: Optional[BaseException]) -> bool:
    """A transfer failed because its peer's process ended (a schedule or
    DTensor may wrap Gloo's error in its own)."""
    seen = 0
    while failure is not None and seen < 8:
        if isinstance(failure, RuntimeError) and any(s in str(failure) for s in _PEER_GONE):
            return True
        failure, seen = failure.__cause__ or failure.__context__, seen + 1
    return False


class StepCount:
    """The process's schedule steps as the job watch counts them. Guarded by
    the JobItem's lock."""

    def __init__(self):
        self.depth = 0  # schedule_step() brackets open (interleaved chunks: one per stage)
        self.scheduled = False  # a schedule drove a step: the root modules' brackets count not
        self.open = -1  # the open step's index (-1: none)
        self.ended = 0  # steps ended: their items are due
        self.sent = 0  # the next step whose item this rank has not submitted
        self.last = time.monotonic()  # the training thread's last progress


class Verdict:
    """The job's verdict once the watch thread has it: the training thread
    raises it at its next accord point within `grace_s`, else the process
    ends with it (a rank blocked in a pipeline receive never returns)."""

    def __init__(self, grace_s: float, on_failure=None):
        self.failure: Optional[BaseException] = None
        self.raised = threading.Event()
        self.grace_s = grace_s
        self.on_failure = on_failure or end_process

    def check(self) -> None:
        if self.failure is not None:
            self.raised.set()
            raise again(self.failure)

    def fail(self, said: BaseException, where: str = _WHERE) -> None:
        self.failure = verdict(said, where)
        if not self.raised.wait(self.grace_s):
            self.on_failure(last_words(self.failure))


class JobItem:
    """`~job` of one client. The training thread calls enter()/leave()
    around each schedule step and progress() at its accord points; a
    thread owned here registers the group, then (each-step mode) submits
    and watches. Thread-safe."""

    def __init__(self, agreement, each_step: bool = False, stall_s: float = 1.0,
                 timeout_s: float = 300.0, grace_s: float = 0.5, on_failure=None):
        self.agreement = agreement
        self.each_step = each_step
        self.stall_s = stall_s
        self.timeout_s = timeout_s  # the longest ask() waits for `~job`'s decision
        self.steps = StepCount()
        self.verdict = Verdict(grace_s, on_failure)
        self._mu = threading.Lock()
        self._wake = threading.Condition(self._mu)
        self._registered = threading.Event()
        self._error: Optional[BaseException] = None  # the registration's
        self._stop = False
        self.early = 0  # items this rank's watch submitted while stalled
        self._thread = threading.Thread(target=self._run, name="accord-job-watch", daemon=True)
        self._thread.start()
        stop_at_exit(self)

    @property
    def slot(self) -> str:
        return "each-step" if self.each_step else "alive"

    # ------------------------------------------------------------ training thread

    def enter(self) -> None:
        """A schedule step() begins (the outermost bracket opens the step)."""
        self.check()
        with self._mu:
            s = self.steps
            if s.depth == 0:
                s.open, s.last = s.ended, time.monotonic()
            s.depth += 1
            s.scheduled = True

    def leave(self) -> None:
        """A schedule step() returned or raised: the step's item is due."""
        with self._mu:
            s = self.steps
            s.depth -= 1
            if s.depth == 0:
                s.open, s.ended, s.last = -1, s.ended + 1, time.monotonic()
                if self.each_step:
                    self._wake.notify()

    def begin_step(self) -> None:
        """An installed root module's forward outside a schedule: it opens
        a step when none is open (a forward without a backward, or several
        before the backward that ends FSDP2's step, open one step)."""
        if not self.each_step:
            return
        self.check()
        with self._mu:
            s = self.steps
            if s.depth == 0 and not s.scheduled and s.open < 0:
                s.open, s.last = s.ended, time.monotonic()

    def end_step(self) -> None:
        """The backward that ends FSDP2's step (its last backward) outside a
        schedule, or the installation's end: the open step's item is due."""
        if not self.each_step:
            return
        with self._mu:
            s = self.steps
            if s.depth == 0 and not s.scheduled and s.open >= 0:
                s.open, s.ended, s.last = -1, s.ended + 1, time.monotonic()
                self._wake.notify()

    def progress(self) -> None:
        # No lock: one assignment, read whole by the watch thread.
        self.steps.last = time.monotonic()
        if self.verdict.failure is not None:
            self.verdict.check()

    def check(self) -> None:
        """Raises the job's verdict once the watch has it, or `~job`'s
        registration error (the ranks disagree on it) or a refused
        submission, in each-step mode."""
        self.verdict.check()
        if self.each_step and self._error is not None:
            raise again(self._error)

    @property
    def step(self) -> int:
        """The open step's index, else the next one's."""
        s = self.steps
        return s.open if s.open >= 0 else s.ended

    def ask(self, step: int, failure: BaseException, timeout_s: float,
            where: str = _TRANSFER) -> None:
        """A transfer failed at `step`: submits `~job` there (or at this
        rank's next unsent step) and raises the job's verdict (from
        `failure`, learned `where`) once there is one within timeout_s;
        returns when there is none (the caller re-raises)."""
        if not self._registered.wait(timeout_s) or self._error is not None:
            return
        try:
            handle = self._submit(step)
        except Exception:  # noqa: BLE001 - refused here (a step this client sent): ask no more
            self._job_verdict(failure, where)
            return
        try:
            self.agreement.wait(handle, timeout_s=timeout_s)
        except Exception as said:  # noqa: BLE001 - the job's verdict, or none in time
            if handle.ready():
                raise verdict(said, where) from failure
        self._job_verdict(failure, where)

    def _job_verdict(self, failure: BaseException, where: str) -> None:
        wait = getattr(self.agreement, "wait_verdict", None)
        if wait is None:
            return
        try:
            wait(0)
        except Exception as said:  # noqa: BLE001 - the job's verdict
            raise verdict(said, where) from failure

    def _submit(self, step: int):
        """`~job` at `step`, or at this rank's next unsent step when that is
        later (each index goes once: the client refuses a second); ended
        steps the watch thread has not sent yet go first."""
        with self._mu:  # submitted under the lock: indices leave in order
            s = self.steps
            for k in range(s.sent, min(s.ended, step)):
                self.agreement.submit_async(GROUP, k, MANIFEST)
            step = max(step, s.sent)
            s.sent = step + 1
            return self.agreement.submit_async(GROUP, step, MANIFEST)

    # ------------------------------------------------------------ the thread

    def _run(self) -> None:
        self._register()
        try:
            while self.each_step and self._error is None and self.verdict.failure is None:
                with self._mu:
                    if self._stop:
                        return
                    self._wake.wait(self.stall_s / 4)
                    s = self.steps
                    # Not awaited: an error decision fails the job, whose
                    # verdict reaches this rank (its next stall's wait).
                    for k in range(s.sent, s.ended):
                        self.agreement.submit_async(GROUP, k, MANIFEST)
                    s.sent = max(s.sent, s.ended)
                    stalled = s.open >= 0 and time.monotonic() - s.last > self.stall_s
                    step = s.open
                if stalled:
                    self._stalled(step)
        except Exception as e:  # noqa: BLE001 - a submission refused: the training thread raises it
            self._error = e

    def _register(self) -> None:
        """Registers in 1 s waits (registering again waits for the same
        result), so that exit never finds this thread in a long C++ wait."""
        try:
            while not self._stop:
                try:
                    self.agreement.client.register_group(
                        GROUP, [(self.slot, 1, 1)], reduce_dtype=None,
                        reduce_dtype_exact=False, timeout_s=REGISTER_WAIT_S)
                    return
                except Exception as e:  # noqa: BLE001 - not yet, or refused
                    if not is_local_timeout(e):
                        self._error = e  # reported at the item's first use
                        return
        finally:
            self._registered.set()

    def _stalled(self, step: int) -> None:
        """No progress for stall_s inside `step`: submits this rank's next
        unsent step (`step`, or the one after the last decided while this
        rank stayed stalled) and waits on it while the stall lasts; then,
        for stall_s, on the job's verdict."""
        handle = self._submit(step)
        self.early += 1
        while not self._stop:
            try:
                self.agreement.wait(handle, timeout_s=self.stall_s)
                break  # every rank was alive at that index
            except Exception:  # noqa: BLE001 - a local timeout, or the coordinator's words
                if handle.ready():
                    said = self._said(handle)
                    if said is None:
                        break  # decided ok as the wait timed out
                    self.verdict.fail(said)
                    return
                with self._mu:
                    if self.steps.open != step:
                        return  # the step ended: the decision comes without this wait
        wait = getattr(self.agreement, "wait_verdict", None)
        if wait is not None:
            try:
                wait(self.stall_s)
            except Exception as said:  # noqa: BLE001 - the job's verdict
                self.verdict.fail(said)

    def _ask_at_exit(self) -> None:
        """Each-step mode, the process ending inside a step with the error
        of a transfer whose peer's process ended (a TP or EP collective
        outside a schedule, which accord does not wrap, raised Gloo's reset
        connection on the training thread): asks `~job` at the open step
        and, when the job's verdict comes within timeout_s (a rank that left
        misses the step at once), ends the process with it."""
        failure = sys.exc_info()[1] or getattr(sys, "last_value", None)
        if (not self.each_step or self.steps.open < 0 or self.verdict.failure is not None
                or isinstance(failure, AccordJobError) or not peer_gone(failure)):
            return  # nothing to ask, or the verdict is known
        try:
            self.ask(self.step, failure, self.timeout_s, where=_EXIT)
        except AccordJobError as e:
            self.verdict.on_failure(last_words(e))

    def _said(self, handle) -> Optional[BaseException]:
        """A ready handle's error (the coordinator's words), None when it
        was decided ok: never the local timeout that raced the decision."""
        try:
            self.agreement.wait(handle, timeout_s=0)
        except Exception as e:  # noqa: BLE001 - the coordinator's words
            return e
        return None

    def stop_for_exit(self) -> None:  # watchdog.stop_at_exit
        self._ask_at_exit()
        with self._mu:
            self._stop = True
            self._wake.notify()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * max(REGISTER_WAIT_S, self.stall_s) + 1)
