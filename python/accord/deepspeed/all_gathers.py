"""ZeRO-3's parameter all-gathers under accord.torch's collective-sequence
guard (docs/DEEPSPEED.md, "The collective-sequence guard").

Every fetch and prefetch of ZeRO-3's forward and backward all-gathers through
one function of the parameter coordinator
(accord.deepspeed.zero3.Zero3.route_all_gathers). Each all-gather that fetches
something is recorded there just before DeepSpeed issues it, as is the
module-trace check of the coordinator's `reset_step`; a collective new to the
agreed sequence waits for the guard's verdict, so a rank about to fetch what
the other ranks do not stops before its collective is paired with theirs,
and every rank raises the same AccordDivergenceError. Agreed ones are
recorded without waiting; the step's window goes with the release
(accord.deepspeed.installation.Installation._decide). With a Learner, a
module whose forward all-gather diverges in step 0 is made optional on every
rank instead (docs/DEEPSPEED.md, "Learning").
"""

from __future__ import annotations

import warnings
from typing import Dict, List, Optional, Tuple

from accord.torch.windows import Wording

WORDING = Wording(collectives="DeepSpeed ZeRO-3", units="module",
                  install="accord.deepspeed.install(engine, optional=[...])")


def sequence_guard(agreement, prefix: str, timeout_s: float, learner=None):
    """accord.torch's guard, worded for DeepSpeed; its windows' group is
    `<prefix>/~collective-sequence`. A record's `group` is whether the
    all-gather is the forward's."""
    from accord.torch.guard import SequenceGuard

    return SequenceGuard(agreement.client, agreement.rank, agreement.world_size,
                         f"{prefix}/~collective-sequence", timeout_s, wording=WORDING,
                         in_forward=bool, learner=learner)


class Learner:
    """Learned optional modules (accord.torch.guard's learner): at a
    divergence of forward all-gathers in the step whose module trace
    DeepSpeed records (step 0), every rank pins the first diverging module
    (accord.deepspeed.zero3.Zero3.pin: one all-gather, on every rank at the
    verdict), and the rank that was fetching it skips its fetch."""

    def __init__(self, adapter, model):
        self.zero = adapter
        self.model = model
        self._order = {n: i for i, (n, _) in enumerate(model.named_modules()) if n}
        self.learned: List[str] = []

    def can_learn(self, units: List[str]) -> Optional[List[str]]:
        """Guard's thread; reads only. None when a unit is not one module
        (a prefetch of several), or the trace is no longer recorded."""
        if not self.zero.recording_trace() or any(u not in self._order for u in units):
            return None
        return [min(units, key=self._order.__getitem__)]

    def learn(self, units: List[str], current: Optional[str]) -> bool:
        """Training thread: pins `units`; True when the fetch under way (of
        `current`) is now done."""
        self.zero.pin([self.model.get_submodule(u) for u in units])
        for name in units:
            self.learned.append(name)
            warnings.warn(
                f"accord: module '{name}' ran its forward on some ranks only under ZeRO-3; "
                f"accord made it optional (persistent, gathered on every rank). Pass "
                f"optional=[...] to accord.deepspeed.install to say so up front", stacklevel=2)
        if current not in units:
            return False
        self.zero.forget_fetch(self.model.get_submodule(current))
        return True


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


class GuardedAllGathers:
    """The adapter's all-gathers, each recorded by `guard` before it is
    issued. `names`: id(parameter) -> its path in the model. Called on the
    threads DeepSpeed fetches on (the training thread, autograd's)."""

    def __init__(self, adapter, guard, names: Dict[int, str]):
        self.zero = adapter
        self.guard = guard
        self.names = names
        self._entries: Dict[frozenset, Tuple[str, str]] = {}  # parameter ids -> (entry, unit)
        self.recorded = 0  # all-gathers recorded
        self.trace_checks = 0  # DeepSpeed's module-trace checks recorded

    def route(self, params, forward: bool, issue):
        gathered = self.zero.to_gather(params)
        if gathered:
            entry, unit = self.entry(gathered)
            self.recorded += 1
            if self.guard.record(entry, unit, forward):
                return None  # its module was pinned instead (learned), on every rank
        return issue()

    def trace_check(self, modules: int) -> None:
        """Before DeepSpeed compares the ranks' module traces (collectives
        of a size each rank's trace gives) at a forward's start, until the
        trace is complete and again on a rank whose trace was invalidated."""
        self.trace_checks += 1
        self.guard.record(f"DeepSpeed's module-trace check ({modules} modules)")

    def entry(self, gathered) -> Tuple[str, str]:
        """The record of an all-gather of `gathered` ((parameter, numel)
        pairs), named by the modules that own them, the same on every rank
        whatever order DeepSpeed's set gives; and those modules."""
        key = frozenset(id(p) for p, _ in gathered)
        found = self._entries.get(key)
        if found is None:
            paths = [self.names.get(id(p), "?") for p, _ in gathered]
            unit = ", ".join(sorted({n.rpartition(".")[0] or "(root)" for n in paths}))
            numel = sum(n for _, n in gathered)
            dtypes = "+".join(sorted({_dtype_name(p.dtype) for p, _ in gathered}))
            found = self._entries[key] = (
                f"all-gather of '{unit}' ({len(paths)} parameters, {numel} x {dtypes})", unit)
        return found
