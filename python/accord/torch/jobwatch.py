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
  members is built (no `install` waits for it: its result needs every rank
  of the job, i.e. other stages' installs; accord.torch.jobitem). With
  member sets of two ranks or more it is submitted only when a pipeline
  transfer inside the schedule's step() failed (Gloo's connection reset: a
  peer of another stage died), never in a release batch, so it costs
  nothing in steady steps. A rank that left before that step misses it,
  which fails the step at once naming that rank; when the job already
  failed, the item is answered with the job's verdict. Either way the
  schedule's error is replaced by the job's verdict (accord.torch.errors),
  as accord does for the collectives it sees. Where the member set is this
  rank alone (a stage with DP 1, or TP or EP with DP 1 outside a schedule:
  no step watch), it is submitted each step and watched for stalls, which
  names a stopped rank of such a member set.

ACCORD_TORCH_JOB_WATCH=0 turns both off (the step watch then opens its step
at the stage module's first forward only, a pipeline transfer's failure
reaches the caller as torch's error, and a stopped DP-1 rank is named by
nobody).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Iterator, Optional

from accord.torch.errors import AccordJobError
from accord.torch.jobitem import JobItem, peer_gone
from accord.torch.options import env_flag

def enabled() -> bool:
    return env_flag("ACCORD_TORCH_JOB_WATCH")


# Every JobItem while an installation holds it, weakly (registering again
# is the same registration); found by its client.
_ITEMS: "weakref.WeakSet[JobItem]" = weakref.WeakSet()
_ITEMS_MU = threading.Lock()


def job_item(agreement, each_step: bool, stall_s: float, timeout_s: float
             ) -> Optional[JobItem]:
    """The client's `~job`, registered at the first call, in the mode of
    that call (None: no client, or turned off)."""
    client = getattr(agreement, "client", None)
    if client is None or not enabled():
        return None
    with _ITEMS_MU:
        item = next((i for i in _ITEMS if i.agreement.client is client), None)
        if item is None:
            item = JobItem(agreement, each_step=each_step, stall_s=stall_s, timeout_s=timeout_s)
            _ITEMS.add(item)
        return item


@contextlib.contextmanager
def schedule_step(installation) -> Iterator[None]:
    """Around a pipeline schedule's step() that drives `installation`'s
    module: the watches' step opens at its start (the step watch's, and
    `~job`'s step count), and a transfer whose peer died is reported as the
    job's verdict."""
    watch, job = installation.watch, installation.job
    if job is None:
        yield
        return
    job.enter()
    if watch is not None:
        watch.open_step(installation.release_index)
    try:
        yield
    except RuntimeError as e:
        if peer_gone(e) and not isinstance(e, AccordJobError):
            if watch is not None:
                watch.check()
            job.check()
            job.ask(job.step if job.each_step else installation.release_index, e, job.timeout_s)
        raise
    else:
        if watch is not None:
            watch.end_step()  # a step() without a backward: nothing closed it
    finally:
        job.leave()
