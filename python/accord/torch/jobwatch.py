"""`~job`: the job-wide part of the step watch (docs/MEMBERS.md 2.13).

Under a pipeline schedule a rank also waits for ranks of other stages, in
point-to-point transfers accord does not see: a stage's ranks block there
when a rank of another stage stopped or died. Two things reach them:

- The job's verdict, pushed to every rank (`CoordinatorMessage.error` with
  job_failed, `Agreement.wait_verdict`): the step watch opens its step at the
  schedule's step() (accord.torch.fsdp2.pipelining), so a rank blocked in a
  receive before its stage module runs is inside a step, stalls, and waits
  for the verdict once its own `~step@M` item is decided (watchdog.py).
- `~job`, one job-wide group (members absent, one slot) registered once per
  client by a background thread when the process's first installation with
  members and a watch is built (no `install` waits for it: its result needs
  every rank of the job, i.e. other stages' installs). It is submitted only
  when a pipeline transfer inside the schedule's step() failed (Gloo's
  connection reset: a peer of another stage died), never in a release batch,
  so it costs nothing in steady steps. A rank that left before that step
  misses it, which fails the step at once naming that rank; when the job
  already failed, the item is answered with the job's verdict. Either way
  the schedule's error is replaced by the job's verdict
  (accord.torch.errors), as accord does for the collectives it sees.

ACCORD_TORCH_JOB_WATCH=0 turns both off (the step watch then opens its step
at the stage module's first forward only, and a pipeline transfer's failure
reaches the caller as torch's error).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Iterator, Optional

from accord.errors import is_local_timeout
from accord.torch.errors import AccordJobError, verdict
from accord.torch.options import env_flag
from accord.torch.watchdog import stop_at_exit

GROUP = "~job"
MANIFEST = ["float32"]
REGISTER_WAIT_S = 1.0
# Gloo's words when the other end of a transfer is gone (its process ended):
# Gloo raises a plain RuntimeError with no code, so its text is all there is
# to match. A schedule's other errors are the caller's own and pass unchanged.
_PEER_GONE = ("Connection reset", "Connection closed", "Broken pipe", "ECONNRESET")


def enabled() -> bool:
    return env_flag("ACCORD_TORCH_JOB_WATCH")


def peer_gone(failure: Optional[BaseException]) -> bool:
    """A transfer failed because its peer's process ended (the schedule may
    wrap Gloo's error in its own, "failed to run forward")."""
    seen = 0
    while failure is not None and seen < 8:
        if isinstance(failure, RuntimeError) and any(s in str(failure) for s in _PEER_GONE):
            return True
        failure, seen = failure.__cause__ or failure.__context__, seen + 1
    return False


class JobItem:
    """`~job` of one client: registered in the background, submitted on a
    pipeline transfer's failure. Thread-safe."""

    def __init__(self, agreement):
        self.agreement = agreement
        self._mu = threading.Lock()
        self._registered = threading.Event()
        self._error: Optional[BaseException] = None  # the registration's
        self._next = 0  # the next step this rank may submit
        self._stop = False
        self._thread = threading.Thread(target=self._register, name="accord-job-register",
                                        daemon=True)
        self._thread.start()
        stop_at_exit(self)

    def _register(self) -> None:
        """Registers in 1 s waits (registering again waits for the same
        result), so that exit never finds this thread in a long C++ wait."""
        try:
            while not self._stop:
                try:
                    self.agreement.client.register_group(
                        GROUP, [("alive", 1, 1)], reduce_dtype=None, reduce_dtype_exact=False,
                        timeout_s=REGISTER_WAIT_S)
                    return
                except Exception as e:  # noqa: BLE001 - not yet, or refused
                    if not is_local_timeout(e):
                        self._error = e  # reported at the item's first use
                        return
        finally:
            self._registered.set()

    def stop_for_exit(self) -> None:  # watchdog.stop_at_exit
        self._stop = True
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * REGISTER_WAIT_S + 1)

    def ask(self, step: int, failure: BaseException, timeout_s: float) -> None:
        """A pipeline transfer failed at `step`: submits `~job` there and
        raises the job's verdict (from `failure`) once there is one within
        timeout_s; returns when there is none (the caller re-raises)."""
        if not self._registered.wait(timeout_s) or self._error is not None:
            return
        with self._mu:
            step = max(step, self._next)
            self._next = step + 1
        try:
            handle = self.agreement.submit_async(GROUP, step, MANIFEST)
        except Exception:  # noqa: BLE001 - refused here (a step this client sent): ask no more
            self._verdict(failure)
            return
        try:
            self.agreement.wait(handle, timeout_s=timeout_s)
        except Exception as said:  # noqa: BLE001 - the job's verdict, or none in time
            if handle.ready():
                raise verdict(said, "accord.torch: a pipeline transfer failed (a rank of "
                                    "another stage stopped or died)") from failure
            self._verdict(failure)

    def _verdict(self, failure: BaseException) -> None:
        wait = getattr(self.agreement, "wait_verdict", None)
        if wait is None:
            return
        try:
            wait(0)
        except Exception as said:  # noqa: BLE001 - the job's verdict
            raise verdict(said, "accord.torch: a pipeline transfer failed (a rank of another "
                                "stage stopped or died)") from failure


# Every JobItem while an installation holds it, weakly (registering again
# is the same registration); found by its client.
_ITEMS: "weakref.WeakSet[JobItem]" = weakref.WeakSet()
_ITEMS_MU = threading.Lock()


def job_item(agreement) -> Optional[JobItem]:
    """The client's `~job`, registered at the first call (None: no client,
    or turned off)."""
    client = getattr(agreement, "client", None)
    if client is None or not enabled():
        return None
    with _ITEMS_MU:
        item = next((i for i in _ITEMS if i.agreement.client is client), None)
        if item is None:
            item = JobItem(agreement)
            _ITEMS.add(item)
        return item


@contextlib.contextmanager
def schedule_step(installation) -> Iterator[None]:
    """Around a pipeline schedule's step() that drives `installation`'s
    module: the watch's step opens at its start, and a transfer whose peer
    died is reported as the job's verdict."""
    watch, job = installation.watch, installation.job
    if watch is None or job is None:
        yield
        return
    watch.open_step(installation.release_index)
    try:
        yield
    except RuntimeError as e:
        if peer_gone(e) and not isinstance(e, AccordJobError):
            watch.check()
            job.ask(installation.release_index, e, watch.timeout_s)
        raise
    else:
        watch.end_step()  # a step() without a backward: nothing closed it
