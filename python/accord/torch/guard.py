"""The collective-sequence guard of accord.torch (docs/PARTICIPATION.md, "The
collective-sequence guard"). Its parts: accord.torch.sequence (which records
are new), accord.torch.verdicts (the windows from open to checked, and the
thread that waits for their verdicts), accord.torch.windows (a window's
manifest and text, pure) and accord.torch.compare (windows compared through
the key-value store).

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

import time
from typing import Callable, Dict, List, Optional

from accord.torch import members as member_sets
from accord.torch.compare import WindowComparison
from accord.torch.errors import AccordDivergenceError
from accord.torch.sequence import StepSequence
from accord.torch.verdicts import Verdicts
from accord.torch.windows import Window, Wording, repairable_units, slot_params, slots

STALL_S = 2.0  # waiting this long starts the stall comparison
END = "end of step"


class SequenceGuard:
    """One rank's guard: what each record is (steady, or new and waited for),
    the release windows of the step's batch, the guard's registration. The
    training thread calls begin_step(), record(), and release_item() and
    release_handle() at each release; the windows and the thread that checks
    their verdicts are `verdicts` (accord.torch.verdicts)."""

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
        # learner.can_learn(units) -> units to pin or None (the verdicts'
        # thread, pure); learner.learn(units, current) -> whether the current
        # collective is done (training thread). See record(). in_forward(group):
        # whether `group`'s collective is a forward all-gather (asked of new ones).
        self.learner, self.in_forward = learner, in_forward
        self._new_windows = 0  # windows closed at a new collective (their group's step)
        self.stall_s, self.step = stall_s, 0
        self.sequence = StepSequence()  # which records are new
        self.blocking_waits, self.blocked_s = 0, 0.0
        self._release: tuple = (None, None)  # the last release window's shape, manifest
        self._registered = False
        self.comparison = WindowComparison(client, self.group_id, rank, world_size, timeout_s,
                                           wording, members=members)
        self.verdicts = Verdicts(client, self.comparison, timeout_s, stall_s, on_divergence,
                                 self._repairable)

    reports = property(lambda self: self.verdicts.reports)  # collectives recorded
    error = property(lambda self: self.verdicts.error)

    @property
    def abort_grace_s(self) -> float:
        """How long a failure waits for the training thread to raise it
        before on_divergence ends the process."""
        return self.verdicts.abort_grace_s

    @abort_grace_s.setter
    def abort_grace_s(self, value: float) -> None:
        self.verdicts.abort_grace_s = value

    # ------------------------------------------------------------ training thread

    def begin_step(self) -> None:
        """At the start of every root forward: the previous step's end is a
        position of its own (a rank with fewer collectives diverges there)."""
        if self.sequence.position > 0:
            self.record(END)
        self.sequence.end_step()
        self.step += 1
        self.verdicts.begin(self.step)

    def record(self, entry: str, unit: Optional[str] = None, group=None) -> bool:
        """Called just before this rank issues a collective described by
        `entry` (of `unit`, FSDP2 parameter group `group`). Returns True when
        the caller must not issue it: the ranks diverged at every rank's first
        occurrence, at forward all-gathers, and every rank has instead
        all-gathered and pinned a unit that covers it (learned optional
        units, see docs/PARTICIPATION.md)."""
        v = self.verdicts
        if v.failure is not None:
            v.check()
        if self.sequence.follows(entry):
            v.follow(entry)  # the steady state: agreed in an earlier step
            return False
        return self._record_new(entry, unit, group)

    def _record_new(self, entry: str, unit: Optional[str], group) -> bool:
        """record() off the path: the transition set decides whether the
        collective is new (then the training thread waits for the verdict)."""
        if not self.verdicts.started:
            self._register()
        transition, w = self.note(entry, unit, group)
        if w is None:
            return False
        t0 = time.perf_counter()
        if not self.verdicts.wait(w):
            raise AccordDivergenceError(
                f"accord: collective-sequence guard: no verdict for step {self.step} "
                f"({entry}) within {self.timeout_s:.0f}s; check the accord sidecar and "
                f"coordinator"
            )
        self.blocked_s += time.perf_counter() - t0
        self.blocking_waits += 1
        self.verdicts.check()
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
        transition, new = self.sequence.off_path_record(entry)
        closing = None
        if new:
            closing = (self.group_id, self._new_windows, unit,
                       unit is not None and self.in_forward(group))
            self._new_windows += 1
        return transition, self.verdicts.note(entry, closing, self.step, self.sequence.position)

    # The release (accord.torch.release) closes the open window and sends
    # it in the step's one batch, to a group of its own at the release's step:
    # in the steady state it is the same manifest every step, so the whole
    # batch repeats (docs/PARTICIPATION.md, "The collective-sequence guard").
    def release_item(self, step: int):
        """Closes the open window for the release at `step`; returns the batch
        item (group, step, manifest) and a token for release_handle()."""
        w = self.verdicts.close_release(self.step_group_id, step, self.step,
                                        self.sequence.position)
        # In the steady state the window is the last one again: its manifest
        # is too (the digest covers positions and entries, not steps).
        key = w.shape()
        if key != self._release[0]:
            self._release = (key, slots(w.digest()))
        return (w.group, step, self._release[1]), w

    def release_handle(self, window: Window, handle) -> None:
        """The handle of the window's manifest, submitted with the batch; the
        earlier release verdicts that are in are checked off here."""
        if not self.verdicts.started:
            self._register()
        self.verdicts.hand(window, handle)

    def explain(self, failure: BaseException, wait_s: float = 30.0) -> None:
        """A collective failed (a peer stopped or died): if the guard finds a
        divergence in time, raise it instead; otherwise return (the caller
        re-raises the original failure)."""
        self.verdicts.explain(failure, wait_s)

    # ------------------------------------------------------------ registration

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
        self.verdicts.start()

    def _repairable(self, entries: Dict[int, dict]) -> Optional[List[str]]:
        """The units to pin on every rank, or None when this divergence is an
        error (accord.torch.windows.repairable_units). The verdicts' thread."""
        if self.learner is None:
            return None
        units = repairable_units(entries, len(self.comparison.ranks))
        return None if units is None else self.learner.can_learn(units)

    def close(self) -> None:
        self.verdicts.close()

    def stop_for_exit(self) -> None:
        self.verdicts.stop_for_exit()
