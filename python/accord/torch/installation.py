"""accord hooked into one FSDP2 model: the hooks that feed each backward's
release (accord.torch.release) and the agreement calls it makes.

Every group's reduce-scatter goes out during the backward, at a turn whose
position among the backward's all-gathers is the same on every rank; the
step's manifests go up as one batch at the end-of-backward point, and each
group is completed there once its decision is in (docs/PARTICIPATION.md,
"One order during the backward").
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Dict, List, Optional

import accord
from accord.torch import configs, fsdp2
from accord.torch.errors import waited
from accord.torch.group import GroupStats, HookedGroup
from accord.torch.release import Release


@dataclasses.dataclass
class NegotiationTiming:
    """Where this rank waited for decisions (for benchmarks and dashboards)."""

    exposed_s: float = 0.0  # training thread blocked waiting for decisions
    waits: int = 0
    blocked: int = 0  # waits whose decision had not arrived yet (a round trip exposed)
    held: int = 0  # post-backwards run without their reduce-scatter (sent at the turn)
    releases: int = 0  # end-of-backward points with groups to reduce
    speculated: int = 0  # turns that carried the previous decision's layout
    repairs: int = 0  # group-steps completed with a trim or a delta
    redone: int = 0  # of those, group-steps with a delta reduce-scatter
    during: int = 0  # turns during autograd that carried this rank's gradient
    at_end: int = 0  # turns at the end-of-backward point
    late: int = 0  # group-steps whose gradient came after the group's turn
    late_bytes: int = 0  # their unsharded gradients' bytes, held to the end

    @property
    def deferred(self) -> int:  # the name before the release design
        return self.held


def join_dtypes(names: List[str]) -> str:
    """The narrowest of WIRE_DTYPES that holds each of `names` exactly."""
    names = set(names)
    if "float64" in names:
        return "float64"
    if "float32" in names or len(names) > 1:
        return "float32"
    return next(iter(names))


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
        self.current: Optional[Release] = None  # this backward's release
        # All-gathers in the last backward that reduced (none yet: None). A
        # one-rank job has none, ever: FSDP2 does not all-gather at W = 1.
        self.backward_all_gathers: Optional[int] = 0 if self.agreement.world_size == 1 else None
        self._late = None  # the ~late item's handle, from submit to wait
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

    def backward(self) -> Release:
        """This backward's release, begun at its first event."""
        if self.current is None:
            order = [h for h in self.release_order if fsdp2.reduces(h.group)]
            configs.refuse_post_accumulate_grad_hooks(order, "seen at a backward")
            self.current = Release(self, order, self.backward_all_gathers)
        return self.current

    def post_backward(self, hooked: HookedGroup) -> bool:
        """Whether the group's turn came at its post-backward (then it is
        reduce-scattered there; otherwise the caller holds it)."""
        return self.backward().post_backward(hooked)

    def pre_backward(self, hooked: HookedGroup) -> None:
        if fsdp2.in_backward():
            self.backward().pre_backward(hooked)

    def before_all_gather(self, hooked: HookedGroup) -> None:
        if fsdp2.in_backward():
            self.backward().before_all_gather(hooked)

    def after_all_gather(self, hooked: HookedGroup) -> None:
        if fsdp2.in_backward():
            self.backward().after_all_gather(hooked)

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
            release = self.backward()
            try:
                release.finish()
                original()
            finally:
                release.end()
                self.current = None
                if self.units is not None:
                    self.units.end_step()
                if self.watch is not None:
                    self.watch.end_step()

        return callback

    def begin_forward(self) -> None:
        """A root forward outside the backward: a release left by a backward
        that never reached its end (it raised) is dropped."""
        if self.current is not None:
            self.current.end()
            self.current = None

    # ------------------------------------------------------------ the step's batch

    def submit_step(self, index: int, manifests: List[tuple], late: tuple) -> list:
        """Submits the step's manifests as one batch, with each optional
        unit's participation, the guard's window, the step watch's item and
        the `~late` item: all at one step in the steady state, so that an
        unchanged step is one batch repeat upstream. Returns the manifests'
        handles."""
        extra = self.units.release_items() if self.units is not None else []
        window = None
        if self.guard is not None:
            item, window = self.guard.release_item(index)
            extra.append((item, None))
        live = self.watch.item(index) if self.watch is not None else None
        if live is not None:
            extra.insert(0, (live, None))
        handles = self._submit(list(manifests) + [item for item, _ in extra] + [late])
        n = len(manifests)
        for (_, reporter), handle in zip(extra, handles[n:]):
            if reporter is not None:
                reporter.handed(handle)
        if live is not None:
            self.watch.handed(index, handles[n])
        if window is not None:
            self.guard.release_handle(window, handles[-2])
        self._late = handles[-1]
        return handles[:n]

    def late_registration(self) -> tuple:
        return (f"{self.prefix}/~late", [(gid, 1, 1) for gid in self.groups], None, False)

    def late_item(self, index: int, order: list, late: List[bool]) -> tuple:
        """This rank's `~late` manifest: one slot per group (install order),
        present when the group's gradient came after its turn here."""
        mine = {h.group_id for h, l in zip(order, late) if l}
        return (f"{self.prefix}/~late", index,
                ["float32" if gid in mine else None for gid in self.groups])

    def wait_late(self) -> Dict[str, bool]:
        """Which groups some rank was late for, from the `~late` decision."""
        decision = self.wait(self._late)
        self._late = None
        return {gid: bool(inc) for gid, inc in zip(self.groups, decision.included)}

    WIRE_DTYPES = ("float64", "float32", "bfloat16", "float16")

    def wire_registration(self) -> tuple:
        return (f"{self.prefix}/~wire",
                [(f"{gid}:{dt}", 1, 1) for gid in self.groups for dt in self.WIRE_DTYPES],
                None, False)

    def agree_wire_dtypes(self) -> None:
        """Each group's wire dtype, fixed for the run, so that no turn is
        ever sent in a dtype its decision widens: the `~wire` group's one
        step carries, per group, the dtype FSDP2 reduce-scatters it in on
        this rank (a slot per dtype); the ranks' dtypes are joined (fp16 on
        one rank and bf16 on another: float32)."""
        mine = []
        for h in self.groups.values():
            mine += ["float32" if dt == h.wire else None for dt in self.WIRE_DTYPES]
        decision = self.wait(self._submit([(f"{self.prefix}/~wire", 0, mine)])[0])
        used = list(decision.included)
        k = len(self.WIRE_DTYPES)
        for i, h in enumerate(self.groups.values()):
            h.wire = join_dtypes([dt for dt, u in zip(self.WIRE_DTYPES, used[i * k:(i + 1) * k])
                                  if u] or [h.wire])

    def report(self) -> None:
        """Sends the counts added since the last report to the sidecar's
        metrics (an agreement that can), after each release and at
        uninstall: one small message, queued without waiting (a report held
        back for later is lost when the process exits first)."""
        report = getattr(self.agreement, "report", None)
        t, last = self.timing, self._reported
        more = (t.speculated - last[0], t.repairs - last[1], t.redone - last[2])
        if report is None or more == (0, 0, 0):
            return
        report(*more)
        self._reported = (t.speculated, t.repairs, t.redone)

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
                self.report()
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
                fsdp2.clear_method(h.group, "pre_backward")
                fsdp2.clear_method(h.group, "_accord_hook")
            self.groups.clear()
            self.model.__dict__.pop("_accord_installation", None)
