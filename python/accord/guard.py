"""The collective-sequence guard of accord.torch (see docs/PARTICIPATION.md).

Every rank reports each FSDP2 collective it issues (unit, kind, element count,
dtype) to the agreement service, as one manifest of a dedicated group per
collective. A report encodes a 64-bit hash of the collective and of its
position in two slots per bit: slot 2i is "used" when bit i is 1, slot 2i+1
when it is 0. The decision marks a slot included when any rank used it, so
the ranks issued the same collective at that position exactly when no bit has
both slots included. Every rank receives the same decision, so every rank
reaches the same verdict.

Off the critical path: the training thread only appends a report; a
background thread submits the reports in batches and checks the decisions.
The training thread waits for a verdict only before a collective that this
rank has never issued after the same prefix of its step (the first step, a
new microbatch pattern, a divergence): then a rank that is about to diverge
stops before its collective, instead of pairing it with another rank's
different collective, which Gloo answers by killing the process and NCCL by
hanging.

On divergence every rank builds the same message (each rank's collective at
that position, through the key-value store) and raises
accord.torch.AccordDivergenceError; a rank whose training thread is blocked
inside a collective gets the message from the background thread, which
aborts the process group and ends the process with it.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
import time
from typing import Callable, Dict, List, Optional, Tuple

GUARD_BITS = 64
END = "end of step"


class AccordDivergenceError(RuntimeError):
    """The ranks issued different FSDP collectives; same text on every rank."""


def _hash64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def _slots(h: int) -> List[Optional[str]]:
    out: List[Optional[str]] = []
    for i in range(GUARD_BITS):
        bit = (h >> i) & 1
        out.append("float32" if bit else None)
        out.append(None if bit else "float32")
    return out


def _diverged(included) -> bool:
    return any(included[2 * i] and included[2 * i + 1] for i in range(GUARD_BITS))


class _Report:
    __slots__ = ("index", "step", "position", "entry", "prefix", "handle", "checked", "waiting",
                 "unit", "forward_all_gather", "repair")

    def __init__(self, index, step, position, entry, prefix):
        self.index, self.step, self.position = index, step, position
        self.entry, self.prefix = entry, prefix
        self.handle = None
        self.checked = threading.Event()
        self.waiting = False  # this rank waits for the verdict before issuing
        self.unit: Optional[str] = None
        self.forward_all_gather = False
        self.repair: Optional[List[str]] = None  # units every rank pins, set by the verdict


class SequenceGuard:
    """One rank's guard. The training thread calls record(); a background
    thread (owned here, stopped by close()) submits and checks."""

    def __init__(
        self,
        client,
        rank: int,
        world_size: int,
        group_id: str,
        timeout_s: float,
        on_divergence: Optional[Callable[[str], None]] = None,
        flush_interval_s: float = 0.005,
        learner=None,
    ):
        self.client = client
        self.rank = rank
        self.world_size = world_size
        self.group_id = group_id
        self.timeout_s = timeout_s
        self.on_divergence = on_divergence or self._abort
        # learner.can_learn(units) -> ordered units or None (background thread,
        # pure); learner.learn(units, current) -> skip the current collective
        # (training thread). See SequenceGuard.record.
        self.learner = learner
        self.flush_interval_s = flush_interval_s
        self.step = 0
        self.position = 0
        self.prefix = 0  # running hash of this step's entries
        self.index = 0  # global report index = the guard group's step
        self.known: set = set()  # (prefix, entry) transitions every rank agreed on
        self.blocking_waits = 0
        self.blocked_s = 0.0
        self.reports = 0
        self.abort_grace_s = 2.0
        self.error: Optional[str] = None
        self._waiting = False  # the training thread waits for a verdict
        self._raised = threading.Event()  # the training thread has seen the error
        self._registered = False
        self._mu = threading.Lock()
        self._wake = threading.Condition(self._mu)
        self._queue: List[_Report] = []  # not yet submitted
        self._inflight: List[_Report] = []  # submitted, not yet checked
        self._stop = False
        self._thread: Optional[threading.Thread] = None
        self.process_group = None

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
        the first occurrence on every rank, at forward all-gathers, and every
        rank has instead all-gathered and pinned the units involved (learned
        optional units, see docs/PARTICIPATION.md)."""
        self._check_error()
        if not self._registered:
            self._register()
        self.reports += 1
        transition = (self.prefix, entry)
        report = _Report(self.index, self.step, self.position, entry, self.prefix)
        report.unit, report.forward_all_gather = unit, forward_all_gather
        report.waiting = transition not in self.known
        self.index += 1
        self.position += 1
        self.prefix = _hash64(f"{self.prefix}|{entry}")
        with self._mu:
            self._queue.append(report)
            if transition not in self.known:
                self._submit_locked()  # now, not at the next tick
            self._wake.notify()
        if transition in self.known:
            return False
        t0 = time.perf_counter()
        self._waiting = True
        try:
            got = report.checked.wait(self.timeout_s)
        finally:
            self._waiting = False
        if not got:
            raise AccordDivergenceError(
                f"accord: collective-sequence guard: no verdict for step {report.step} "
                f"position {report.position} ({entry}) within {self.timeout_s:.0f}s; check "
                f"the accord sidecar and coordinator"
            )
        self.blocked_s += time.perf_counter() - t0
        self.blocking_waits += 1
        self._check_error()
        if report.repair is not None:
            if self.learner.learn(report.repair, unit):
                return True
            # Still to issue: report it again at the next position.
            return self.record(entry, unit, forward_all_gather)
        self.known.add(transition)
        return False

    def explain(self, failure: BaseException, wait_s: float = 30.0) -> None:
        """A collective failed (a peer stopped or died): if the guard finds a
        divergence in time, raise it instead; otherwise return (the caller
        re-raises the original failure)."""
        deadline = time.monotonic() + wait_s
        with self._mu:
            if self._queue:
                self._submit_locked()
            outstanding = list(self._inflight)
        for r in outstanding:
            if self.error is not None:
                break
            r.checked.wait(max(0.0, deadline - time.monotonic()))
        if self.error is not None:
            self._raised.set()
            raise AccordDivergenceError(self.error) from failure

    def _check_error(self) -> None:
        if self.error is not None:
            self._raised.set()
            raise AccordDivergenceError(self.error)

    def _register(self) -> None:
        params = [(f"bit{i // 2}.{'one' if i % 2 == 0 else 'zero'}", 1, 1)
                  for i in range(2 * GUARD_BITS)]
        self.client.register_group(self.group_id, params, reduce_dtype=None,
                                   reduce_dtype_exact=False, timeout_s=self.timeout_s)
        self._registered = True
        self._thread = threading.Thread(target=self._run, name="accord-guard", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ background

    def _submit_locked(self) -> None:
        for r in self._queue:
            h = _hash64(f"{r.step}|{r.position}|{r.entry}")
            r.handle = self.client.submit(self.group_id, r.index, _slots(h))
            self._inflight.append(r)
        self._queue.clear()

    def _run(self) -> None:
        while True:
            with self._mu:
                if not self._inflight and not self._queue:
                    if self._stop:
                        return
                    self._wake.wait(self.flush_interval_s * 20)
                    continue
                if self._queue:
                    self._submit_locked()
                report = self._inflight[0]
            try:
                decision = self.client.wait(report.handle, timeout_s=self.timeout_s)
                message = None
                if _diverged(decision.included):
                    entries = self._gather(report)
                    report.repair = self._repairable(entries)
                    if report.repair is None:
                        message = self._describe(report, entries)
            except Exception as e:  # noqa: BLE001 - the service's own named error
                message = (f"accord: collective-sequence guard at step {report.step} position "
                           f"{report.position} ({report.entry}): {e}")
            with self._mu:
                self._inflight.pop(0)
            if message is not None:
                self._fail(message, report)
                return
            report.checked.set()

    def _fail(self, message: str, report: _Report) -> None:
        self.error = message
        with self._mu:
            pending = [report] + self._inflight + self._queue
        for r in pending:
            r.checked.set()
        # The training thread raises the error itself when it is waiting for a
        # verdict or reaches its next collective within the grace; a thread
        # blocked inside a collective never will.
        if self._waiting or self._raised.wait(self.abort_grace_s):
            return
        self.on_divergence(message)

    def _gather(self, report: _Report) -> Dict[int, dict]:
        """Every rank's report at this index, through the key-value store (each
        rank writes its own, then reads all): the same on every rank."""
        key = f"{self.group_id}/diverged/{report.index}"
        mine = {
            "what": f"step {report.step} position {report.position}: {report.entry}",
            "waiting": report.waiting,
            "unit": report.unit,
            "forward_all_gather": report.forward_all_gather,
        }
        try:
            self.client.kv_set(f"{key}/{self.rank}", json.dumps(mine).encode())
            values = self.client.kv_get([f"{key}/{r}" for r in range(self.world_size)],
                                        timeout_s=min(self.timeout_s, 10.0))
            return {r: json.loads(bytes(v).decode()) for r, v in enumerate(values)}
        except Exception as e:  # noqa: BLE001 - some rank did not answer in time
            mine["what"] += f" (the other ranks did not report theirs: {e})"
            return {self.rank: mine}

    def _repairable(self, entries: Dict[int, dict]) -> Optional[List[str]]:
        """The units to pin on every rank, or None when this divergence is an
        error: it must be every rank's first occurrence (all wait before
        issuing) and every rank's collective an all-gather in a forward."""
        if self.learner is None or len(entries) != self.world_size:
            return None
        if not all(e["waiting"] and e["forward_all_gather"] and e["unit"] for e in
                   entries.values()):
            return None
        return self.learner.can_learn(sorted({e["unit"] for e in entries.values()}))

    def _describe(self, report: _Report, entries: Dict[int, dict]) -> str:
        """The same text on every rank: what each rank issued at that position."""
        seen: Dict[str, List[int]] = {}
        for r in sorted(entries):
            seen.setdefault(entries[r]["what"], []).append(r)
        parts = [f"{'rank' if len(rs) == 1 else 'ranks'} {','.join(map(str, rs))} issued {what}"
                 for what, rs in sorted(seen.items(), key=lambda kv: kv[1][0])]
        return (f"accord: the ranks' FSDP collectives diverged at collective #{report.index}: "
                + "; ".join(parts)
                + ". A unit ran on some ranks only, or in another order, or with other "
                  "sizes; mark units whose forward runs on some ranks only with "
                  "accord.torch.install(..., optional=[...])")

    def _abort(self, message: str) -> None:
        """Default on divergence while the training thread may be blocked in a
        collective: abort the process group, then end the process with the
        message (a blocked Gloo/NCCL call may never return otherwise)."""
        sys.stderr.write(f"AccordDivergenceError: {message}\n")
        sys.stderr.flush()
        try:
            import torch.distributed as dist

            dist.distributed_c10d._abort_process_group(self.process_group)
        except Exception:  # noqa: BLE001 - best effort; the exit below is what counts
            pass
        os._exit(3)

    def close(self) -> None:
        with self._mu:
            self._stop = True
            self._wake.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.timeout_s)
