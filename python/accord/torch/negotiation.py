"""The agreement calls of one installation: registration at install, the
wire dtypes (`~wire`), each step's one batch (the manifests, each optional
unit's participation, the guard's window, the step watch's item and
`~late`), the waits for decisions and the counts reported to the sidecar."""

from __future__ import annotations

import dataclasses
import inspect
import time
from typing import Dict, List, Optional

from accord.torch import members as member_sets
from accord.torch.errors import waited
from accord.torch.guards import parts as guard_parts
from accord.torch.watchdog import stop_at_exit


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


WIRE_DTYPES = ("float64", "float32", "bfloat16", "float16")
_IN_RELEASE = "accord.torch: learned in this rank's release (a group's decision)"
REPORT_EVERY_S = 1.0  # the longest a count waits at the rank before it is reported


def _takes_sync_key(submit_batch) -> bool:
    """Whether an agreement's submit_batch takes `sync_key` (ClientAgreement
    does; an agreement of an older protocol is called without it)."""
    try:
        params = inspect.signature(submit_batch).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        return False
    return "sync_key" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


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


class Negotiation:
    """One installation's agreement calls. `groups` maps group id to
    HookedGroup (install order); `units`, `guard` and `watch` may be None.
    Training thread only."""

    def __init__(self, agreement, prefix: str, groups: dict, timing: NegotiationTiming,
                 units=None, guard=None, watch=None, members: member_sets.Members = None):
        self.agreement = agreement
        self.prefix = prefix
        # The installation's member set: `~late` and `~wire` are agreed
        # among these ranks only (docs/MEMBERS.md 2.12).
        self.members = members
        tag = member_sets.tag(members)
        self.late_id, self.wire_id = f"{prefix}/~late{tag}", f"{prefix}/~wire{tag}"
        self.groups = groups
        self.timing = timing
        self.units = units
        self.guard = guard
        self.watch = watch
        self._late = None  # the ~late item's handle, from submit to wait
        # The installed module's pipeline stage index, told by the schedule
        # boundary (accord.torch.fsdp2.pipelining) before its first release;
        # None: no schedule drives it.
        self.stage: Optional[int] = None
        self._sync = (None, 0)  # (stage, sync_key) last computed
        batch = getattr(agreement, "submit_batch", None)
        self._takes_sync_key = callable(batch) and _takes_sync_key(batch)
        self._reported = (0, 0, 0)  # (speculated, repairs, redone) sent by report()
        self._reported_at = 0.0  # time.monotonic() of the last report sent
        stop_at_exit(self)  # what is left is reported at exit

    # ------------------------------------------------------------ install

    def registrations(self) -> List[tuple]:
        """Every group's and check's registration, each with its member set:
        an optional unit's ranks, one guard per member set
        (accord.torch.guards), the installation's for `~late`, `~wire` and
        the step watch."""
        units = self.units.registrations() if self.units is not None else []
        # Slots named by the group ids without their tags: every member of
        # the installation's set registers the same (expert groups of two EP
        # coordinates differ in their tags only).
        slots = [f"{self.prefix}/{h.unit}" for h in self.groups.values()]
        own = [(self.late_id, [(s, 1, 1) for s in slots], None, False),
               (self.wire_id, [(f"{s}:{dt}", 1, 1) for s in slots for dt in WIRE_DTYPES],
                None, False)]
        guard = self.guard.registrations() if self.guard is not None else []
        watch = [self.watch.registration()] if self.watch is not None else []
        return [h.registration() for h in self.groups.values()] + units + [
            member_sets.registration(r, self.members) for r in own] + guard + watch

    def register(self) -> None:
        """Every registration in one batched round trip where the agreement
        has one, before the first forward: no registration is ever lazy, so
        none waits at a data-dependent point. Then the wire dtypes."""
        regs = self.registrations()
        batch = getattr(self.agreement, "register_all", None)
        if callable(batch):
            batch(regs)
        else:
            for r in regs:
                self.agreement.register(*r)
        self._agree_wire_dtypes()
        if self.guard is not None:
            self.guard.registered()

    def _agree_wire_dtypes(self) -> None:
        """Each group's wire dtype, fixed for the run, so that no turn is
        ever sent in a dtype its decision widens: the `~wire` group's one
        step carries, per group, the dtype FSDP2 reduce-scatters it in on
        this rank (a slot per dtype); the ranks' dtypes are joined (fp16 on
        one rank and bf16 on another: float32)."""
        mine = []
        for h in self.groups.values():
            mine += ["float32" if dt == h.wire else None for dt in WIRE_DTYPES]
        decision = self.wait(self.submit([(self.wire_id, 0, mine)])[0])
        used = list(decision.included)
        k = len(WIRE_DTYPES)
        for i, h in enumerate(self.groups.values()):
            h.agreed_wire(join_dtypes([dt for dt, u in zip(WIRE_DTYPES, used[i * k:(i + 1) * k])
                                       if u] or [h.wire]))

    # ------------------------------------------------------------ each step

    def sync_key(self) -> int:
        """This installation's release batches' sync_key (members.sync_key)."""
        if self._sync[1] == 0 or self._sync[0] != self.stage:
            bases = [gid[:len(gid) - len(member_sets.tag(h.members))]
                     for gid, h in self.groups.items()]
            self._sync = (self.stage, member_sets.sync_key(self.prefix, bases, self.stage))
        return self._sync[1]

    def at_stage(self, stage: Optional[int]) -> None:
        """The pipeline stage index of the installed module (part of the
        release's sync_key); None: no schedule drives it."""
        self.stage = stage

    def submit(self, items: List[tuple], sync_key: int = 0) -> list:
        """Submits `items` as one batch where the agreement can; `sync_key`
        (release batches only) where its submit_batch takes one."""
        batch = getattr(self.agreement, "submit_batch", None)
        if callable(batch):
            if sync_key and self._takes_sync_key:
                return list(batch(items, sync_key=sync_key))
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
            decision = waited(self.agreement, handle, _IN_RELEASE)
        self.timing.exposed_s += time.perf_counter() - t0
        self.timing.waits += 1
        return decision

    def wait_all(self, handles: list) -> list:
        """wait() for each of `handles`, in order: their decisions."""
        if not handles or isinstance(handles[0], _Blocking):
            return [self.wait(h) for h in handles]
        t0 = time.perf_counter()
        ready = getattr(self.agreement, "ready", None)
        decisions = []
        for handle in handles:
            if ready is None or not ready(handle):
                self.timing.blocked += 1
            decisions.append(waited(self.agreement, handle, _IN_RELEASE))
        self.timing.exposed_s += time.perf_counter() - t0
        self.timing.waits += len(handles)
        return decisions

    def submit_step(self, index: int, manifests: List[tuple], late: tuple) -> list:
        """Submits the step's manifests as one batch, with each optional
        unit's participation, the guard's window, the step watch's item and
        the `~late` item: all at one step in the steady state, so that an
        unchanged step is one batch repeat upstream. Returns the manifests'
        handles."""
        extra = self.units.release_items() if self.units is not None else []
        guards = guard_parts(self.guard)
        windows = [g.release_item(index) for g in guards]
        extra += [(item, None) for item, _ in windows]
        live = self.watch.item(index) if self.watch is not None else None
        if live is not None:
            extra.insert(0, (live, None))
        handles = self.submit(list(manifests) + [item for item, _ in extra] + [late],
                              sync_key=self.sync_key())
        n = len(manifests)
        for (_, reporter), handle in zip(extra, handles[n:]):
            if reporter is not None:
                reporter.handed(handle)
        if live is not None:
            self.watch.handed(index, handles[n])
        if self.watch is not None:
            self.watch.released(index)
        for g, (_, window), handle in zip(guards, windows, handles[-1 - len(windows):-1]):
            g.release_handle(window, handle)
        self._late = handles[-1]
        return handles[:n]

    def late_item(self, index: int, order: list, late: List[bool]) -> tuple:
        """This rank's `~late` manifest: one slot per group (install order),
        present when the group's gradient came after its turn here."""
        mine = {h.group_id for h, l in zip(order, late) if l}
        return (self.late_id, index,
                ["float32" if gid in mine else None for gid in self.groups])

    def wait_late(self) -> Dict[str, bool]:
        """Which groups some rank was late for, from the `~late` decision."""
        decision = self.wait(self._late)
        self._late = None
        return {gid: bool(inc) for gid, inc in zip(self.groups, decision.included)}

    def report(self, final: bool = False) -> None:
        """Sends the counts added since the last report to the sidecar's
        metrics (an agreement that can): one small message, queued without
        waiting. After a release it goes when a repair was counted or
        REPORT_EVERY_S has passed since the last one (a steady step sends
        none: one message less per step; scrapes are seconds apart);
        `final` (uninstall) sends whatever is left."""
        report = getattr(self.agreement, "report", None)
        t, last = self.timing, self._reported
        more = (t.speculated - last[0], t.repairs - last[1], t.redone - last[2])
        if report is None or more == (0, 0, 0):
            return
        now = time.monotonic()
        if not final and more[1] == 0 and now - self._reported_at < REPORT_EVERY_S:
            return
        report(*more)
        self._reported = (t.speculated, t.repairs, t.redone)
        self._reported_at = now

    def stop_for_exit(self) -> None:
        try:
            self.report(final=True)
        except Exception:  # noqa: BLE001 - the client is closed: nothing more can go
            pass
