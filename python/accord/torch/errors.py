"""accord.torch's errors, and how a rank reports the job's verdict.

A decision that is an error is the verdict of the coordinator (or of a
single-node sidecar) for the whole job: every rank that waits for a step of
it gets the same words (docs/RELIABILITY.md, "A failed job's verdict reaches
every waiting rank"). A rank can learn the verdict in several places,
though: in its release, in the collective-sequence guard, or in the step
watch while its training thread is blocked inside Gloo. Which place is the
rank's own timing. So wherever accord.torch learns a verdict, it reports it
in the same way, built here: an `AccordJobError` whose text is the verdict's
words exactly. Where this rank learned it goes in a note (PEP 678; printed
with the traceback), and, when a background thread ends the process, on a
line of its own before the verdict's.
"""

from __future__ import annotations

from typing import List

import accord


class AccordDivergenceError(RuntimeError):
    """The ranks issued different FSDP collectives; same text on every rank."""


class AccordPeerError(RuntimeError):
    """A rank stopped or died mid-step; the message names it (the same on every rank)."""


class AccordJobError(accord.Error, AccordDivergenceError, AccordPeerError):
    """The job's verdict, as the coordinator worded it: the same text on every
    rank, wherever the rank learned it. Also an `accord.Error` (the service's
    error), and an `AccordDivergenceError` and `AccordPeerError` for code that
    catches what the guard or the step watch raise."""


def notes(e: BaseException) -> List[str]:
    return list(getattr(e, "__notes__", []))


def _with_notes(e: BaseException, lines: List[str]) -> BaseException:
    for line in lines:
        if hasattr(e, "add_note"):
            e.add_note(line)
        else:  # Python < 3.11: kept where 3.11's traceback would print it from
            e.__notes__ = notes(e) + [line]
    return e


def verdict(said: BaseException, where: str) -> AccordJobError:
    """The job's verdict `said` (the error of a decided handle), learned `where`."""
    return _with_notes(AccordJobError(str(said)), [where])


def again(e: BaseException) -> BaseException:
    """A fresh exception like `e`, for raising what was kept once more."""
    return _with_notes(type(e)(*e.args), notes(e))


def last_words(e: BaseException) -> str:
    """What a process ended from a background thread writes: the notes, then
    `Type: text` as the last line (as a traceback would end)."""
    return "\n".join(notes(e) + [f"{type(e).__name__}: {e}"])


def waited(agreement, handle, where: str, **kwargs):
    """agreement.wait(handle): an error that is the handle's decision is
    raised as the job's verdict; a local one (a timeout here, a sidecar out
    of reach) as it came."""
    try:
        return agreement.wait(handle, **kwargs)
    except accord.Error as e:
        ready = getattr(agreement, "ready", None)
        if ready is None or not ready(handle):
            raise
        raise verdict(e, where) from None
