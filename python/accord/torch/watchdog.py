"""The step watch: a rank that stops or dies mid-step is named on every other
rank within the coordinator's deadline (docs/RELIABILITY.md, "A rank stopped
mid-step").

The survivors of a stopped rank are blocked inside a collective (Gloo), or
at the next synchronisation with the device (NCCL), with nothing of theirs
pending at the coordinator: every decision they hold was already made. So
each release's batch carries one more item, the step's liveness manifest
(group `<prefix>/~step`, step = the release's, one constant slot: the same
manifest every step, so the batch still repeats). A rank whose training
thread has made no progress (no collective issued, no release) for
`stall_s` while inside a step submits that item early, if it has not yet:
from then on the coordinator's deadline runs for that step, and a rank that
never submits it is named to every rank that did, with its node and last
step. The watch then ends the process with the coordinator's message (exit
status 3), unless the training thread reaches accord within a grace and
raises it itself: a survivor blocked in a collective never returns from it.
Either way the rank reports the job's verdict as every rank does
(accord.torch.errors): an `AccordJobError` with the coordinator's words,
where the rank was blocked in a note.

A rank that is merely slow costs nothing: the early item is the same one its
release would have sent, and the step completes when the slow rank gets
there within the deadline.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
import weakref
from typing import Callable, Optional

from accord.torch import members as member_sets
from accord.torch.errors import again, last_words, verdict

STALL_S = 1.0  # no progress this long inside a step starts the coordinator's clock

# accord.torch's background threads (the step watch's, the guard's) spend
# their time inside accord's C++ waits with the GIL released. If the
# interpreter finalizes while one is there, the thread is ended as it takes
# the GIL back, which aborts the process ("terminate called without an active
# exception"). So at exit,
# before finalization, each is stopped and joined: its waits last at most
# its stall_s.
_threads_to_stop: "weakref.WeakSet" = weakref.WeakSet()


def stop_at_exit(owner) -> None:
    """`owner.stop_for_exit()` runs at interpreter exit if owner is alive."""
    _threads_to_stop.add(owner)


@atexit.register
def _stop_threads() -> None:
    for owner in list(_threads_to_stop):
        try:
            owner.stop_for_exit()
        except Exception:  # noqa: BLE001 - exiting anyway; the next one still stops
            pass
MANIFEST = ["float32"]


class StepWatch:
    """One rank's step watch. The training thread calls begin_step(),
    progress(), item()/handed() at each release and end_step(); a background
    thread (owned here, stopped by close()) watches for stalls."""

    def __init__(self, agreement, group_id: str, timeout_s: float, stall_s: float = STALL_S,
                 on_failure: Optional[Callable[[str], None]] = None, grace_s: float = 0.5,
                 members: Optional[tuple] = None):
        self.agreement = agreement
        self.group_id = group_id
        self.members = members  # the ranks its item is agreed among (None: every rank)
        self.timeout_s = timeout_s
        self.stall_s = stall_s
        self.grace_s = grace_s
        self.on_failure = on_failure or end_process
        self.early = 0  # steps whose item this watch submitted before the release
        self._failure: Optional[BaseException] = None  # the verdict, raised as this
        self.where = "a step"
        self._mu = threading.Lock()
        self._wake = threading.Condition(self._mu)
        self._in_step = False
        self._step = 0  # the step of the next release
        self._last = time.monotonic()
        self._handle = None  # the current step's item, once submitted
        self._handle_step = -1
        self._stop = False
        self._raised = threading.Event()
        self._thread = threading.Thread(target=self._run, name="accord-step-watch", daemon=True)
        self._thread.start()
        stop_at_exit(self)

    def registration(self) -> tuple:
        return member_sets.registration((self.group_id, [("alive", 1, 1)], None, False),
                                        self.members)

    # ------------------------------------------------------------ training thread

    def begin_step(self, step: int) -> None:
        self.check()
        with self._mu:
            self._in_step = True
            self._step = step
            self._last = time.monotonic()

    def open_step(self, step: int) -> None:
        """A pipeline schedule's step() began: the step is open from here,
        so a rank blocked in the schedule's first receive, before its stage
        module runs, is inside it (accord.torch.jobwatch)."""
        self.check()
        with self._mu:
            if not self._in_step:
                self._in_step, self._step, self._last = True, step, time.monotonic()

    def progress(self, where: str) -> None:
        # No lock: single assignments, read whole by the watch's thread.
        if self._failure is not None:
            self.check()
        self._last = time.monotonic()
        self.where = where

    def item(self, step: int):
        """The release's liveness item, or None when the watch already sent it."""
        self.check()
        with self._mu:
            self._last = time.monotonic()
            self._step = step
            if self._handle_step == step:
                return None
            return (self.group_id, step, MANIFEST)

    def handed(self, step: int, handle) -> None:
        with self._mu:
            self._handle, self._handle_step = handle, step

    def released(self, step: int) -> None:
        """The release of `step` went up with its item: what the training
        thread does next inside the step (the end's reduce-scatters, the
        completions' deltas) is watched as the next release's, so a peer that
        stops there is named by that item, which it never sends."""
        with self._mu:
            if self._step == step:
                self._step, self._last = step + 1, time.monotonic()

    def end_step(self) -> None:
        with self._mu:
            self._in_step = False

    @property
    def error(self) -> Optional[str]:
        """The verdict's text, once there is one."""
        return None if self._failure is None else str(self._failure)

    def check(self) -> None:
        if self._failure is not None:
            self._raised.set()
            raise again(self._failure)

    def explain(self, failure: BaseException) -> None:
        """A collective failed (Gloo saw a peer's connection reset): the step's
        item goes now, and if the coordinator names a rank that never sent it,
        that named error is raised instead of the collective's. When every
        rank had sent the step's item already (the peer died after its
        release, say with the job's verdict, while this rank's node could not
        hear it yet), the next step's item asks again: a
        peer that is gone never sends it, so the coordinator answers with the
        job's verdict or names that peer, within its deadline."""
        self.check()
        with self._mu:
            step = self._step
            handle = self._handle if self._handle_step == step else None
        if handle is None:
            handle = self.agreement.submit_async(self.group_id, step, MANIFEST)
            self.handed(step, handle)
            self.early += 1
        if self._ask(handle, failure):
            # The watch moves to that step (its thread then watches the same
            # item, and a later release does not send it again).
            handle = self.agreement.submit_async(self.group_id, step + 1, MANIFEST)
            with self._mu:
                self._step = step + 1
                self._handle, self._handle_step = handle, step + 1
            self.early += 1
            self._ask(handle, failure)

    def _ask(self, handle, failure: BaseException) -> bool:
        """Waits for an item: raises the coordinator's words when it has
        some; True when it was decided without error (it says nothing of the
        failure), False when no answer came in time."""
        try:
            self.agreement.wait(handle)
            return True
        except Exception:  # noqa: BLE001 - the coordinator's named error, or none in time
            said = self._said(handle)
            if said is not None:
                self._keep(said)
                self._raised.set()
                raise again(self._failure) from failure
            return False

    def _said(self, handle) -> Optional[BaseException]:
        """The item's own error once it has one, else None (not decided yet,
        or decided without error). A wait that timed out here may race the
        decision's arrival: what is reported is then the decision, never the
        local timeout."""
        if not handle.ready():
            return None
        try:
            self.agreement.wait(handle, timeout_s=0)
        except Exception as e:  # noqa: BLE001 - the coordinator's words
            return e
        return None

    # ------------------------------------------------------------ background

    def _run(self) -> None:
        while True:
            with self._mu:
                if self._stop:
                    return
                self._wake.wait(self.stall_s / 4)
                stalled = self._in_step and time.monotonic() - self._last > self.stall_s
                step, handle = self._step, self._handle if self._handle_step == self._step \
                    else None
            if not stalled:
                continue
            if handle is None:
                handle = self.agreement.submit_async(self.group_id, step, MANIFEST)
                self.handed(step, handle)
                self.early += 1
            self._watch(handle)
            if self.error is None:
                self._wait_verdict()
            if self.error is not None:
                return

    def _watch(self, handle) -> None:
        """Waits on the step's item while the rank stays stalled; a failed
        item is the coordinator naming whoever never sent it."""
        while not self._stop:
            try:
                self.agreement.wait(handle, timeout_s=self.stall_s)
                return  # every rank was alive at this step: a slow step, nothing more
            except Exception:  # noqa: BLE001 - a local timeout, or the coordinator's error
                if not handle.ready():
                    with self._mu:
                        if not self._in_step or self._handle is not handle:
                            return  # moved on
                    continue
                said = self._said(handle)
                if said is None:
                    return  # decided without error as the wait timed out: a slow step
                self._fail(said)
                return

    def _wait_verdict(self) -> None:
        """Still stalled after the step's item was decided: this rank's
        member sets are alive, so the cause is elsewhere (a rank of another
        pipeline stage); the job's verdict, pushed to every rank, ends it
        (docs/MEMBERS.md 2.13)."""
        wait = getattr(self.agreement, "wait_verdict", None)
        if wait is None:
            return
        try:
            wait(self.stall_s / 4)
        except Exception as said:  # noqa: BLE001 - the job's verdict
            self._fail(said)

    def _keep(self, said: BaseException) -> None:
        self._failure = verdict(said, f"accord.torch: a rank stopped or died while this rank "
                                      f"was blocked in {self.where}")

    def _fail(self, said: BaseException) -> None:
        self._keep(said)
        # The training thread raises it itself if it reaches accord within the
        # grace; one blocked inside a collective never will.
        if self._raised.wait(self.grace_s):
            return
        self.on_failure(last_words(self._failure))

    def close(self) -> None:
        with self._mu:
            self._stop = True
            self._wake.notify()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=self.timeout_s)

    def stop_for_exit(self) -> None:
        with self._mu:
            self._stop = True
            self._wake.notify()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.stall_s + 1)


def end_process(message: str, exit_code: int = 3) -> None:
    """Writes the message to stderr and ends the process at once: a blocked
    Gloo or NCCL call may never return otherwise. Nothing runs in between:
    aborting the process group first would let the training thread, woken
    by the abort with the collective's own error, run Python (and report that
    error instead) before the exit; a process that ends frees its peers and
    its device anyway."""
    sys.stderr.write(f"{message}\n")
    sys.stderr.flush()
    os._exit(exit_code)
