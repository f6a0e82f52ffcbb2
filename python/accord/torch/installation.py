"""accord hooked into one FSDP2 model: the release of reduce-scatters.

One order, computed locally (docs/PARTICIPATION.md, "One order"): during
autograd a group's post-backward never reduce-scatters and never waits; it
does what FSDP2 does without gradient sync (reshard, keep the gradient). At
the end of each backward, FSDP2's end-of-backward callback (which every rank
reaches once per backward) first *releases* every group that reduces, in
release order (module order reversed, the same on every rank): the step's manifests go
up as one batch, then each group applies its decision and FSDP2's own
post-backward reduce-scatters it. So every rank issues the same
reduce-scatters in the same order, whatever order autograd ran the
post-backwards in, and no accord wait sits at a point whose order depends on
a rank's data.

Speculation (on by default): a group whose previous step needed no repair
applies its previous decision at once, without waiting; the real decisions
are checked after the step's reduce-scatters, before the callback returns
(so before the optimizer sees a gradient), and any difference is repaired
the same way on every rank (accord.torch.plan).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Dict, List, Optional

import accord
from accord.torch import fsdp2
from accord.torch.errors import waited
from accord.torch.group import GroupStats, Held, HookedGroup
from accord.torch.plan import NONE, REDO, TRIM, Layout, plan_repair, speculates


@dataclasses.dataclass
class NegotiationTiming:
    """Where this rank waited for decisions (for benchmarks and dashboards)."""

    exposed_s: float = 0.0  # training thread blocked waiting for decisions
    waits: int = 0
    blocked: int = 0  # waits whose decision had not arrived yet (a round trip exposed)
    held: int = 0  # post-backwards run without their reduce-scatter (released later)
    releases: int = 0  # end-of-backward releases
    speculated: int = 0  # group-steps reduce-scattered with the previous decision
    repairs: int = 0  # of those, group-steps whose real decision differed
    redone: int = 0  # repairs that reduce-scattered the group again

    @property
    def deferred(self) -> int:  # the name before the release design
        return self.held


class _Blocking(tuple):
    """A manifest not yet submitted: an agreement without submit_async
    submits and waits in one call, at wait()."""


class Installation:
    """accord hooked into one FSDP2 model. `stats` maps group id to GroupStats."""

    def __init__(self, model, agreement, prefix: str, speculate: bool):
        self.model = model
        self.agreement = agreement
        self.prefix = prefix
        self.rank = agreement.rank
        self.groups: Dict[str, HookedGroup] = {}
        self.optional: list = []  # _OptionalUnit, see accord.torch.optional
        self.speculate = speculate
        self.timing = NegotiationTiming()
        self.releasing: Optional[HookedGroup] = None
        self.release_index = 0  # releases so far: the step of the batch's other items
        self.guard = None
        self.watch = None  # accord.torch.watchdog.StepWatch
        self.attached = False
        self.learned: List[str] = []
        self.units = None  # accord.torch.optional.OptionalUnits
        self._handles: list = []
        self._patched_states: list = []
        self._lock = threading.Lock()
        self._reported = (0, 0, 0)  # (speculated, repairs, redone) sent by _report

    # The name of the previous design's switch: overlapping the decision wait.
    @property
    def overlap(self) -> bool:
        return self.speculate

    @property
    def release_order(self) -> List[HookedGroup]:
        """The order of every release: install order reversed (so the root,
        installed first, goes last), which is the order autograd runs a
        sequential model's post-backwards in; any order that every rank
        computes alike would be correct."""
        return list(reversed(self.groups.values()))

    @property
    def stats(self) -> Dict[str, GroupStats]:
        return {gid: h.stats for gid, h in self.groups.items()}

    @property
    def participation(self):
        """Per optional unit (module path): this rank's forward calls per step."""
        return {u.name: u.participation for u in self.optional}

    # ------------------------------------------------------------ agreement

    def register_all(self, extra=()) -> None:
        """Every group (and `extra` registrations), in one batched round trip
        where the agreement has one, before the first forward: no
        registration is ever lazy, so none waits at a data-dependent point."""
        regs = [h.registration() for h in self.groups.values()] + list(extra)
        batch = getattr(self.agreement, "register_all", None)
        if callable(batch):
            batch(regs)
        else:
            for r in regs:
                self.agreement.register(*r)

    def _submit(self, items: List[tuple]) -> list:
        batch = getattr(self.agreement, "submit_batch", None)
        if callable(batch):
            return list(batch(items))
        if callable(getattr(self.agreement, "submit_async", None)):
            return [self.agreement.submit_async(*i) for i in items]
        return [_Blocking(i) for i in items]

    def wait(self, handle):
        t0 = time.perf_counter()
        if isinstance(handle, _Blocking):
            self.timing.blocked += 1
            decision = self.agreement.submit(*handle)
        else:
            ready = getattr(self.agreement, "ready", None)
            if ready is None or not ready(handle):
                self.timing.blocked += 1
            decision = waited(self.agreement, handle,
                              "accord.torch: learned in this rank's release (a group's decision)")
        self.timing.exposed_s += time.perf_counter() - t0
        self.timing.waits += 1
        return decision

    # ------------------------------------------------------------ hooks

    def held(self, hooked: HookedGroup) -> None:
        self.timing.held += 1

    def record_reduce(self, entry: str) -> None:
        if self.watch is not None:
            self.watch.progress(entry)
        if self.guard is not None:
            self.guard.record(entry)

    def explain(self, failure: BaseException) -> None:
        """A collective failed: the guard's divergence or the watch's named
        peer failure replaces the collective's own error, when known."""
        if self.watch is not None:
            self.watch.explain(failure)
        if self.guard is not None:
            self.guard.explain(failure)

    def final_callback(self, original):
        """FSDP2's end-of-backward callback, with accord's release first."""

        def callback():
            try:
                self.release()
                original()
            finally:
                if self.units is not None:
                    self.units.end_step()
                if self.watch is not None:
                    self.watch.end_step()

        return callback

    def release(self) -> None:
        """Reduce-scatters every group that reduces, in release order (see
        the module docstring). The same groups, steps and order on every rank."""
        todo = [h for h in self.release_order if fsdp2.reduces(h.group)]
        if not todo:
            return
        self.timing.releases += 1
        index = self.release_index
        self.release_index += 1
        held = [h.manifest() for h in todo]
        # One batch: the groups, each optional unit's participation and the
        # guard's window, all at one step in the steady state, so that an
        # unchanged step is one batch repeat upstream.
        extra = self.units.release_items() if self.units is not None else []
        window = None
        if self.guard is not None:
            item, window = self.guard.release_item(index)
            extra.append((item, None))
        live = self.watch.item(index) if self.watch is not None else None
        if live is not None:
            extra.insert(0, (live, None))
        handles = self._submit([(h.group_id, s.step, s.dtypes) for h, s in zip(todo, held)]
                               + [item for item, _ in extra])
        for (_, reporter), handle in zip(extra, handles[len(todo):]):
            if reporter is not None:
                reporter.handed(handle)
        if live is not None:
            self.watch.handed(index, handles[len(todo)])
        if window is not None:
            self.guard.release_handle(window, handles[-1])
        handles = handles[:len(todo)]
        speculated = []
        for h, s, handle in zip(todo, held, handles):
            s.handle = handle
            if speculates(h.history, self.speculate and not isinstance(handle, _Blocking)):
                self.timing.speculated += 1
                h.stats.speculated += 1
                h.reduce(h.stats.last_decision, s, speculative=True)
                speculated.append((h, s))
            else:
                decision = self.wait(handle)
                h.reduce(decision, s, speculative=False)
                self._settle(h, s, decision, repaired=False)
        # The real decisions, in the same order: usually already here, as the
        # reduce-scatters above took longer than the round trip.
        for h, s in speculated:
            decision = self.wait(s.handle)
            repair = plan_repair(s.applied, Layout.of(decision))
            if repair.kind == TRIM:
                h.trim(s, repair.trimmed)
            elif repair.kind == REDO:
                h.restore_for_redo(s)
                h.reduce(decision, s, speculative=False)
                self.timing.redone += 1
            if repair.kind != NONE:
                self.timing.repairs += 1
                h.stats.repaired += 1
            self._settle(h, s, decision, repaired=repair.kind != NONE)
        self._report()

    def _report(self) -> None:
        """Sends the counts added since the last report to the sidecar's
        metrics (an agreement that can), after each release that speculated
        and at uninstall: one small message, queued without waiting (a
        report held back for later is lost when the process exits first)."""
        report = getattr(self.agreement, "report", None)
        t, last = self.timing, self._reported
        more = (t.speculated - last[0], t.repairs - last[1], t.redone - last[2])
        if report is None or more == (0, 0, 0):
            return
        report(*more)
        self._reported = (t.speculated, t.repairs, t.redone)

    @staticmethod
    def _settle(h: HookedGroup, s: Held, decision, repaired: bool) -> None:
        h.count(decision, s)
        h.history.last = Layout.of(decision)
        h.history.repaired_last = repaired

    # ------------------------------------------------------------ wiring

    def hook_states(self) -> None:
        for module in self.model.modules():
            if fsdp2.is_fsdp_module(module):
                state = fsdp2.state_of(module)
                if fsdp2.wrap_final_callback(state, self.final_callback):
                    self._patched_states.append(state)

    def uninstall(self) -> None:
        """Restores everything accord changed in FSDP2 and in the model."""
        with self._lock:
            from accord.torch import guarding

            try:
                self._report()
            except accord.Error:
                pass  # the client is closed: its sidecar keeps what it was sent
            guarding.detach(self)
            if self.units is not None:
                self.units.remove()
                self.units = None
            for handle in self._handles:
                handle.remove()
            self._handles.clear()
            for state in self._patched_states:
                fsdp2.unwrap_final_callback(state)
            self._patched_states.clear()
            for h in self.groups.values():
                fsdp2.clear_method(h.group, "post_backward")
                fsdp2.clear_method(h.group, "_accord_hook")
            self.groups.clear()
            self.model.__dict__.pop("_accord_installation", None)
