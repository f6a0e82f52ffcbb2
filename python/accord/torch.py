"""accord for PyTorch FSDP2: one call makes every reduce-scatter agree.

    import accord, accord.torch
    model = ...; fully_shard(...)            # FSDP2 as usual
    accord.torch.install(model, accord.connect())

How it hooks FSDP2
------------------
Each FSDP parameter group (one reduce-scatter) is registered once with accord
under the id ``"<prefix>/<module path>"`` with its parameters' names, dim-0
sizes and element counts, in the group's order. The group's ``post_backward``
is wrapped; when the group reduces (not on accumulation-only microbatches) the
wrapper, before FSDP2 builds its reduce-scatter buffer:

1. folds this microbatch's gradient into any accumulated one (what FSDP2 does
   first anyway), then states which parameters have a gradient and in which
   dtype (the manifest), submits it and waits for the decision, which is the
   same on every rank;
2. for each parameter the decision includes but this rank has no gradient for,
   puts a zero gradient in place (zero-fill); when this rank's gradients are of
   several dtypes, widens them all to the decided wire dtype; parameters the
   decision skips get no bytes in the buffer and their gradient stays None on
   every rank;
3. runs FSDP2's own post-backward with the group's reduce dtype set to the
   decided wire dtype, so FSDP2 builds the same buffer, in the same dtype, on
   every rank.

The wire dtype is the group's FSDP2 ``reduce_dtype`` when set (FSDP2's meaning:
the user chose it), otherwise the lossless join of every rank's gradient dtypes
(fp16 on one rank and bf16 on another go as fp32).

``set_reduce_scatter_unused_params``
------------------------------------
That FSDP2 switch zero-fills, in the parameter dtype, every locally unused
parameter, including those used on no rank. With accord installed, accord does
the zero-filling: the switch is turned off for the duration of each hooked
post-backward, so nothing is zero-filled twice, parameters used nowhere are
skipped (gradient None, no bytes reduced) instead of reduce-scattering zeros,
and the switch's value is restored afterwards. You may leave it set or not; the
result is the same.

Overlap (on by default)
-----------------------
Waiting for a decision inside every group's post-backward would put one
round trip per group on the backward critical path. With overlap, a group's
post-backward submits its manifest without waiting, holds its gradients
aside and returns; the wait, the zero-fill and FSDP2's reduce-scatter for it
run when later groups reach their post-backward (``overlap_depth`` groups
later, default 2, ``ACCORD_TORCH_OVERLAP_DEPTH``), so the round trip overlaps
their backward compute. Groups that FSDP2 reduces in its end-of-backward
callback (the root, units with gradient-free inputs, optional units) are
submitted together when the callback starts. Flushes happen only at points
every rank reaches in the same order, so every rank's reduce-scatters keep
the same place in its collective sequence, and the decisions, hence the
gradients, are the same as without overlap. The cost: up to
``overlap_depth`` groups keep their unsharded gradients (and parameters)
somewhat longer. ``install(..., overlap=False)`` or ``ACCORD_TORCH_OVERLAP=0``
turns it off; ``installation.timing`` says how long the training thread
waited.

Units whose forward runs on some ranks only (``optional=``)
------------------------------------------------------------
FSDP2 all-gathers a unit's parameters in that unit's pre-forward. When a rank
skips a unit (a vision tower on a text-only batch, a layer dropped by
LayerDrop) or enters it twice (images and video through one tower), its
all-gathers pair with other units' all-gathers on the other ranks: Gloo aborts
with a collective mismatch, NCCL hangs, before any gradient exists. Name such
units at install time::

    accord.torch.install(model, client, optional=[model.vision_tower])

For each optional unit accord then makes every collective rank-independent:

- forward: right after the root's pre-forward (a fixed point of every rank's
  sequence) every rank all-gathers every optional unit, in install order, and
  keeps it unsharded until the end of that backward; the unit's own
  pre-forward and pre-backward then find it unsharded and issue nothing, so
  running it 0, 1 or 2 times issues the same collectives;
- the unit is left out of FSDP2's record of the forward order, so the
  implicit backward prefetch of the other units follows the same order on
  every rank;
- backward: the unit's reduce-scatter is deferred to FSDP2's end-of-backward
  callback, where every rank reaches it at the same place; accord's agreement
  then decides it like any other group (a rank that did not run the unit
  contributes zeros, parameters used on no rank keep gradient None);
- after that callback (or after a forward under ``torch.no_grad``) the unit
  is resharded.

No extra round trip is added: the participation agreement is the group's
ordinary decision. The cost is one all-gather of each optional unit per
forward on every rank (also where it is not used) and its unsharded
parameters held for the whole step, so mark the units that can really be
skipped, not every unit. ``installation.participation`` counts, per optional
unit, the steps in which this rank ran it 0, 1 or more times.

Limits: install right after ``fully_shard`` and before the model's first
forward (each group's step count starts there on every rank); the model itself
must be an FSDP unit when ``optional`` is given. An optional unit must not be
resharded explicitly (``unit.reshard()``, ``state_dict()``) between a forward
and its backward. Ranks must reduce the other groups in the same order (as
FSDP2 itself requires). docs/PARTICIPATION.md has the collective sequences.
"""

from __future__ import annotations

import dataclasses
import os
import re
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from accord.agreement import Agreement, ParamTuple, as_agreement
from accord.guard import AccordDivergenceError  # noqa: F401 - part of this module's API

SUPPORTED_TORCH = ((2, 9), (2, 13))


class UnsupportedTorchError(RuntimeError):
    """The installed torch's FSDP2 is not one accord.torch knows how to hook."""


class AccordFSDPError(RuntimeError):
    """The adapter could not apply a decision (names the group and rank)."""


def torch_version(version: Optional[str] = None) -> Tuple[int, int]:
    """(major, minor) of a torch version string (default: the installed one)."""
    v = version if version is not None else torch.__version__
    m = re.match(r"^(\d+)\.(\d+)", str(v))
    if not m:
        raise UnsupportedTorchError(f"accord.torch: cannot parse torch version {v!r}")
    return int(m.group(1)), int(m.group(2))


def check_torch_version(version: Optional[str] = None) -> None:
    """Raises UnsupportedTorchError unless torch is within SUPPORTED_TORCH."""
    v = torch_version(version)
    lo, hi = SUPPORTED_TORCH
    if not (lo <= v <= hi):
        raise UnsupportedTorchError(
            f"accord.torch supports torch {lo[0]}.{lo[1]} through {hi[0]}.{hi[1]} (FSDP2's "
            f"internal reduce path differs elsewhere); found torch "
            f"{version if version is not None else torch.__version__}. Install a supported "
            f"torch or run without accord.torch."
        )


def dtype_name(dtype: torch.dtype) -> str:
    """accord's name of a torch dtype ('torch.bfloat16' -> 'bfloat16')."""
    return str(dtype).replace("torch.", "")


def torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def _fsdp_internals():
    """The FSDP2 classes the adapter relies on, checked for the members used."""
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    except ImportError as e:  # pragma: no cover - depends on the torch build
        raise UnsupportedTorchError(
            f"accord.torch: this torch ({torch.__version__}) has no FSDP2 (fully_shard): {e}"
        ) from e
    missing = [
        f"FSDPParamGroup.{a}" for a in ("post_backward",) if not hasattr(FSDPParamGroup, a)
    ] + [
        f"FSDPParam.{a}"
        for a in ("accumulate_unsharded_grad_if_needed", "unsharded_param")
        if not hasattr(FSDPParam, a)
    ]
    if missing:
        raise UnsupportedTorchError(
            f"accord.torch: FSDP2 in torch {torch.__version__} lacks {', '.join(missing)}; "
            f"supported: torch {SUPPORTED_TORCH[0]} to {SUPPORTED_TORCH[1]}"
        )
    return FSDPModule, FSDPParamGroup


# FSDP parameter (id) -> (SequenceGuard, unit name) for the collective guard.
_GUARDED: Dict[int, tuple] = {}
_AG_ENTRIES: Dict[tuple, str] = {}  # (group id, params, dtype) -> the guard's text
_COLLECTIVES_PATCHED = False


def _guard_of(fsdp_params):
    for fp in fsdp_params:
        found = _GUARDED.get(id(fp))
        if found is not None:
            return found
    return None


def _in_forward(group) -> bool:
    return group is not None and group._training_state.name == "FORWARD"


def _patch_collectives() -> None:
    """Routes FSDP2's all-gathers and reduce-scatters through the guard of the
    installation that owns the parameters (a no-op for other models).
    FSDP2 calls both through `_fsdp_param_group`'s module globals."""
    global _COLLECTIVES_PATCHED
    if _COLLECTIVES_PATCHED:
        return
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as pg

    all_gather, reduce = pg.foreach_all_gather, pg.foreach_reduce

    def guarded_all_gather(fsdp_params, *args, **kwargs):
        found = _guard_of(fsdp_params)
        if found is not None:
            guard, unit, group = found
            dtype = fsdp_params[0].param_dtype or fsdp_params[0].orig_dtype
            key = (id(group), len(fsdp_params), dtype)
            entry = _AG_ENTRIES.get(key)
            if entry is None:
                numel = sum(int(fp._orig_size.numel()) for fp in fsdp_params)
                entry = _AG_ENTRIES[key] = f"all-gather of '{unit}' ({numel} x {dtype_name(dtype)})"
            if guard.record(entry, unit=unit, forward_all_gather=_in_forward(group)):
                return None  # the unit was all-gathered and pinned instead (learned)
            try:
                return all_gather(fsdp_params, *args, **kwargs)
            except RuntimeError as e:  # a peer stopped: say why, if the guard knows
                guard.explain(e)
                raise
        return all_gather(fsdp_params, *args, **kwargs)

    def guarded_reduce(fsdp_params, unsharded_grads, *args, **kwargs):
        found = _guard_of(fsdp_params)
        if found is not None:
            guard, unit, _ = found
            numel = sum(int(g.numel()) for g in unsharded_grads)
            reduce_dtype = args[5] if len(args) > 5 else kwargs.get("reduce_dtype")
            dtype = reduce_dtype or (unsharded_grads[0].dtype if unsharded_grads else None)
            guard.record(
                f"reduce-scatter of '{unit}' ({numel} x "
                f"{dtype_name(dtype) if dtype is not None else '?'})"
            )
            try:
                return reduce(fsdp_params, unsharded_grads, *args, **kwargs)
            except RuntimeError as e:  # a peer stopped: say why, if the guard knows
                guard.explain(e)
                raise
        return reduce(fsdp_params, unsharded_grads, *args, **kwargs)

    pg.foreach_all_gather = guarded_all_gather
    pg.foreach_reduce = guarded_reduce
    _COLLECTIVES_PATCHED = True


def _param_groups(state) -> list:
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)  # older single-group layout
    return [group] if group is not None else []


@dataclasses.dataclass
class GroupStats:
    """What the adapter did for one group (for tests, logs and dashboards)."""

    reductions: int = 0
    zero_filled: int = 0  # parameter-steps zero-filled on this rank
    widened: int = 0  # parameter-steps converted to the wire dtype on this rank
    skipped: int = 0  # parameter-steps left out of the buffer
    last_decision: object = None


class _HookedGroup:
    """One FSDP parameter group under accord. Owned by the training thread."""

    def __init__(self, installation: "Installation", group, group_id: str, names: List[str]):
        self.installation = installation
        self.group = group
        self.group_id = group_id
        self.params: List[ParamTuple] = []
        for name, fp in zip(names, group.fsdp_params):
            size = tuple(fp._orig_size)
            dim0 = int(size[0]) if len(size) > 0 else 1
            numel = 1
            for s in size:
                numel *= int(s)
            self.params.append((name, dim0, numel))
        self.registered = False
        self.step = 0
        self.stats = GroupStats()
        self.original = group.post_backward  # bound method of the group
        self.optional: Optional["_OptionalUnit"] = None

    def _register(self) -> None:
        reduce_dtype = getattr(self.group, "_reduce_dtype", None)
        self.installation.agreement.register(
            self.group_id,
            self.params,
            dtype_name(reduce_dtype) if reduce_dtype is not None else None,
            reduce_dtype is not None,  # FSDP2's reduce_dtype is the wire dtype when set
        )
        self.registered = True

    def _local_grads(self) -> List[Optional[torch.Tensor]]:
        """This rank's gradient per parameter (None where it has none)."""
        fsdp_params = self.group.fsdp_params
        # FSDP2 folds this microbatch's gradient into an accumulated one first;
        # doing it here (it is idempotent) makes the manifest see the final dtype.
        for fp in fsdp_params:
            fp.accumulate_unsharded_grad_if_needed()
        local: List[Optional[torch.Tensor]] = []
        for fp in fsdp_params:
            grad = None
            if hasattr(fp, "_unsharded_param"):
                if fp.unsharded_accumulated_grad is not None:
                    grad = fp.unsharded_accumulated_grad
                elif fp._unsharded_param.grad is not None:
                    grad = fp._unsharded_param.grad
            local.append(grad)
        return local

    def _next_manifest(self) -> Tuple[int, List[Optional[torch.Tensor]], List[Optional[str]]]:
        if not self.registered:
            self._register()
        local = self._local_grads()
        step = self.step
        self.step += 1
        return step, local, [dtype_name(g.dtype) if g is not None else None for g in local]

    def post_backward(self, *args, **kwargs):
        inst = self.installation
        if self.optional is not None and not inst.in_final_callback:
            # Deferred to FSDP2's end-of-backward callback, which reaches this
            # group at the same place on every rank (see _OptionalUnit).
            return None
        # Earlier groups' reduce-scatters go first: all of them when this
        # group is already waiting (a unit entered twice), else all but the
        # newest overlap_depth - 1 (this group joins them).
        deferring = inst.overlap and not inst.in_final_callback
        again = any(p.hooked is self for p in inst.pending)
        inst.flush(keep=inst.overlap_depth - 1 if deferring and not again else 0)
        if not getattr(self.group, "reduce_grads", True):
            return self.original(*args, **kwargs)  # accumulation-only microbatch
        early = inst.presubmitted.pop(self.group_id, None)
        if early is not None:
            step, local, handle = early
        else:
            step, local, dtypes = self._next_manifest()
            handle = inst.submit(self.group_id, step, dtypes)
        if inst.overlap and not inst.in_final_callback and handle is not None:
            # Reduce later: the wait overlaps the next group's backward.
            inst.defer(self, step, local, handle, args, kwargs)
            return None
        decision = inst.wait(handle)
        return self._reduce(decision, step, local, args, kwargs)

    def _reduce(self, decision, step, local, args, kwargs):
        """Applies the decision, then runs FSDP2's own post-backward."""
        group = self.group
        self._apply(decision, step, group.fsdp_params, local)
        saved_reduce_dtype = getattr(group, "_reduce_dtype", None)
        saved_unused = getattr(group, "reduce_scatter_unused_params", None)
        group._reduce_dtype = torch_dtype(decision.wire_dtype)
        if saved_unused is not None:
            group.reduce_scatter_unused_params = False  # accord zero-fills, never twice
        try:
            return self.original(*args, **kwargs)
        finally:
            group._reduce_dtype = saved_reduce_dtype
            if saved_unused is not None:
                group.reduce_scatter_unused_params = saved_unused

    def _apply(self, decision, step: int, fsdp_params, local: List[Optional[torch.Tensor]]):
        rank = self.installation.agreement.rank
        if len(decision.included) != len(fsdp_params):
            raise AccordFSDPError(
                f"accord: group {self.group_id} step {step} rank {rank}: the decision covers "
                f"{len(decision.included)} parameters, the group has {len(fsdp_params)}"
            )
        wire = torch_dtype(decision.wire_dtype)
        present = {g.dtype for g in local if g is not None}
        # One local dtype: FSDP2's copy-in converts it to the wire dtype itself.
        # Several: widen each to the wire dtype so FSDP2 sees uniform gradients.
        fill_dtype = next(iter(present)) if len(present) == 1 else wire
        stats = self.stats
        stats.reductions += 1
        stats.last_decision = decision
        for i, (fp, grad) in enumerate(zip(fsdp_params, local)):
            name = self.params[i][0]
            if not decision.included[i]:
                stats.skipped += 1
                if grad is not None:
                    raise AccordFSDPError(
                        f"accord: group {self.group_id} step {step} rank {rank}: the decision "
                        f"skips parameter {name} but this rank has a gradient for it; the "
                        f"manifest and the decision disagree (check the agreement service)"
                    )
                continue
            if grad is None:
                if not hasattr(fp, "_unsharded_param"):
                    raise AccordFSDPError(
                        f"accord: group {self.group_id} step {step} rank {rank}: parameter "
                        f"{name} is used on another rank but this rank never ran this FSDP "
                        f"unit's forward, so there is nothing to zero-fill; run the unit's "
                        f"forward once on every rank (e.g. on an empty batch)"
                    )
                fp.unsharded_accumulated_grad = torch.zeros_like(
                    fp._unsharded_param, dtype=fill_dtype, requires_grad=False
                )
                stats.zero_filled += 1
            elif grad.dtype != fill_dtype:
                fp.unsharded_accumulated_grad = grad.to(fill_dtype)
                if fp._unsharded_param.grad is grad:
                    fp._unsharded_param.grad = None
                stats.widened += 1


@dataclasses.dataclass
class NegotiationTiming:
    """Where this rank waited for decisions (for benchmarks and dashboards)."""

    exposed_s: float = 0.0  # training thread blocked waiting for decisions
    waits: int = 0
    blocked: int = 0  # waits whose decision had not arrived yet (a round trip exposed)
    deferred: int = 0  # reductions whose wait was moved behind the next group


@dataclasses.dataclass
class _Deferred:
    hooked: "_HookedGroup"
    step: int
    local: list
    handle: object
    args: tuple
    kwargs: dict
    stash: list


def _can_overlap(agreement) -> bool:
    return callable(getattr(agreement, "submit_async", None)) and callable(
        getattr(agreement, "wait", None)
    )


class _ParticipationReporter:
    """Reports, per step, whether this rank ran one optional unit, through a
    group of its own (`<prefix>/~participation/<unit>`, "parameters" `ran` and
    `repeated`). The coordinator's skip matrix of that group is then the
    unit x rank participation matrix, in its metrics, ObserveService, event
    log and `accordctl skips`. Submitted without waiting; the previous step's
    decision (long since there) is collected at the next report."""

    def __init__(self, agreement, group_id: str):
        self.agreement = agreement
        self.group_id = group_id
        self.registered = False
        self.previous = None

    def report(self, step: int, calls: int) -> None:
        if not self.registered:
            self.agreement.register(self.group_id, [("ran", 1, 1), ("repeated", 1, 1)], None,
                                    False)
            self.registered = True
        if self.previous is not None:
            self.agreement.wait(self.previous)
        self.previous = self.agreement.submit_async(
            self.group_id, step, ["float32" if calls >= 1 else None,
                                  "float32" if calls >= 2 else None]
        )


@dataclasses.dataclass
class UnitParticipation:
    """How often this rank ran one optional unit's forward, per step."""

    steps: int = 0
    skipped: int = 0  # steps with no forward call
    ran: int = 0  # steps with exactly one
    repeated: int = 0  # steps with two or more
    calls_this_step: int = 0


class _OptionalUnit:
    """One FSDP unit whose forward may run on some ranks only.

    Pinned (unsharded by accord) from the root's pre-forward to the end of the
    backward; while pinned, FSDP2's own reshards after forward and after
    backward do nothing. Owned by the training thread.
    """

    def __init__(self, name: str, module, groups: list, reporter=None):
        self.name = name
        self.module = module
        self.groups = groups
        self.reporter = reporter  # _ParticipationReporter or None
        self.pinned = False
        self.participation = UnitParticipation()
        self._originals = {}
        from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

        in_step = (TrainingState.FORWARD, TrainingState.POST_BACKWARD)
        for g in groups:
            original = g.reshard  # bound method

            def reshard(g=g, original=original):
                if self.pinned and g._training_state in in_step:
                    return None  # kept unsharded until end_step
                if g._training_state not in in_step:
                    self.pinned = False  # an explicit reshard (state_dict, .to())
                return original()

            g.__dict__["reshard"] = reshard
            # Not recorded in FSDP2's forward order: the implicit backward
            # prefetch of the other units must not depend on this unit.
            g.__dict__["_record_post_forward"] = lambda: None
        self._handle = module.register_forward_pre_hook(self._count)

    def _count(self, module, args):
        self.participation.calls_this_step += 1

    def begin_step(self) -> None:
        if self.pinned:  # a forward without backward left it pinned
            self.end_step(count=False)
        self.module.unshard()  # one all-gather, on every rank, at the same place
        self.pinned = True

    def end_step(self, count: bool = True) -> None:
        self.pinned = False
        for g in self.groups:
            g.reshard()
        if count:
            p = self.participation
            if self.reporter is not None:
                self.reporter.report(p.steps, p.calls_this_step)
            p.steps += 1
            if p.calls_this_step == 0:
                p.skipped += 1
            elif p.calls_this_step == 1:
                p.ran += 1
            else:
                p.repeated += 1
        self.participation.calls_this_step = 0

    def remove(self) -> None:
        self._handle.remove()
        for g in self.groups:
            g.__dict__.pop("reshard", None)
            g.__dict__.pop("_record_post_forward", None)


class Installation:
    """accord hooked into one FSDP2 model. `stats` maps group id to GroupStats."""

    def __init__(self, model: torch.nn.Module, agreement: Agreement, prefix: str):
        self.model = model
        self.agreement = agreement
        self.prefix = prefix
        self.groups: Dict[str, _HookedGroup] = {}
        self.optional: List[_OptionalUnit] = []
        self.in_final_callback = False
        self.overlap = False
        self.timing = NegotiationTiming()
        self.overlap_depth = 1
        self.pending: List[_Deferred] = []
        self.presubmitted: Dict[str, tuple] = {}
        self._handles: list = []
        self._patched_states: list = []
        self.guard = None
        self.learned: List[str] = []  # optional units learned from divergence
        self._step_hooks = False
        self._unit_order: Dict[str, int] = {}
        self._lock = threading.Lock()

    @property
    def stats(self) -> Dict[str, GroupStats]:
        return {gid: h.stats for gid, h in self.groups.items()}

    @property
    def participation(self) -> Dict[str, UnitParticipation]:
        """Per optional unit (module path): this rank's forward calls per step."""
        return {u.name: u.participation for u in self.optional}

    def submit(self, group_id: str, step: int, dtypes):
        """A handle to wait on, or None after a blocking submit without one
        (an Agreement without submit_async); then wait() submits."""
        if not self.overlap:
            return ("blocking", group_id, step, dtypes)
        return self.agreement.submit_async(group_id, step, dtypes)

    def wait(self, handle) -> object:
        t0 = time.perf_counter()
        if isinstance(handle, tuple) and handle and handle[0] == "blocking":
            self.timing.blocked += 1
            decision = self.agreement.submit(*handle[1:])
        else:
            ready = getattr(self.agreement, "ready", None)
            if ready is None or not ready(handle):
                self.timing.blocked += 1
            decision = self.agreement.wait(handle)
        self.timing.exposed_s += time.perf_counter() - t0
        self.timing.waits += 1
        return decision

    def defer(self, hooked, step, local, handle, args, kwargs) -> None:
        """Holds this group's gradients aside until flush(), so that more
        gradients arriving for the group meanwhile (a unit entered twice) do
        not join this reduce-scatter."""
        stash = []
        for fp in hooked.group.fsdp_params:
            if hasattr(fp, "_unsharded_param"):
                stash.append((fp.unsharded_accumulated_grad, fp._unsharded_param.grad))
                fp.unsharded_accumulated_grad = None
                fp._unsharded_param.grad = None
            else:
                stash.append(None)
        self.pending.append(_Deferred(hooked, step, local, handle, args, kwargs, stash))
        self.timing.deferred += 1

    def flush(self, keep: int = 0) -> None:
        """Reduce-scatters deferred groups, oldest first, until `keep` remain.
        Called only at points every rank reaches in the same order (group
        post-backwards, the end-of-backward callback), never on timing, so the
        reduce-scatters keep the same place in every rank's sequence."""
        while len(self.pending) > keep:
            self._flush_one(self.pending.pop(0))

    def _flush_one(self, p: "_Deferred") -> None:
        decision = self.wait(p.handle)
        fsdp_params = p.hooked.group.fsdp_params
        arrived = []
        for fp, held in zip(fsdp_params, p.stash):
            if held is None:
                arrived.append(None)
                continue
            arrived.append((fp.unsharded_accumulated_grad, fp._unsharded_param.grad))
            fp.unsharded_accumulated_grad, fp._unsharded_param.grad = held
        try:
            p.hooked._reduce(decision, p.step, p.local, p.args, p.kwargs)
        finally:
            for fp, later in zip(fsdp_params, arrived):
                if later is not None:
                    acc, grad = later
                    if acc is not None:
                        fp.unsharded_accumulated_grad = acc
                    if grad is not None:
                        fp._unsharded_param.grad = grad

    def _presubmit_final(self) -> None:
        """Submits, together, the manifests of every group that FSDP2's
        end-of-backward callback will reduce (their gradients are final)."""
        from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

        for h in self.groups.values():
            g = h.group
            if g._training_state == TrainingState.POST_BACKWARD:
                continue
            if not getattr(g, "reduce_grads", True) or h.group_id in self.presubmitted:
                continue
            step, local, dtypes = h._next_manifest()
            self.presubmitted[h.group_id] = (step, local, self.submit(h.group_id, step, dtypes))

    def _add_optional(self, name: str, module) -> "_OptionalUnit":
        groups = _param_groups(module._get_fsdp_state())
        reporter = None
        if _can_overlap(self.agreement):
            reporter = _ParticipationReporter(
                self.agreement, f"{self.prefix}/~participation/{name}"
            )
        unit = _OptionalUnit(name, module, groups, reporter)
        for h in self.groups.values():
            if any(h.group is g for g in groups):
                h.optional = unit
        self.optional.append(unit)
        if not self._step_hooks:
            # After FSDP2's root pre-forward (its hook is prepended; this one
            # is appended), before any other unit's all-gather.
            self._handles.append(self.model.register_forward_pre_hook(self._begin_step))
            self._handles.append(self.model.register_forward_hook(self._after_forward))
            self._step_hooks = True
        return unit

    # The guard's learner (accord.guard.SequenceGuard.record): units whose
    # forward all-gathers diverged at every rank's first occurrence become
    # optional units on every rank, in module order.
    def can_learn(self, units: List[str]) -> Optional[List[str]]:
        """Background thread; pure. The unit to pin: the first of `units` in
        module order (the one the other ranks skipped when a unit is skipped
        or entered again; otherwise the next divergence pins the next), or
        None when one of them cannot be made optional (the root, a grouped
        unit, one already optional)."""
        order = self._unit_order
        if any(u not in order or u in {o.name for o in self.optional} for u in units):
            return None
        return [min(units, key=order.__getitem__)]

    def learn(self, units: List[str], current: Optional[str]) -> bool:
        """Training thread: pins each unit (one all-gather each, in order, on
        every rank); returns whether the collective about to be issued (an
        all-gather of `current`) is now done."""
        import warnings

        for name in units:
            unit = self._add_optional(name, self.model.get_submodule(name))
            unit.begin_step()
            self.learned.append(name)
            warnings.warn(
                f"accord: FSDP unit '{name}' ran its forward on some ranks only; accord made it "
                f"an optional unit (all-gathered on every rank at each step). Pass "
                f"optional=[...] to accord.torch.install to say so up front",
                stacklevel=2,
            )
        return current in units

    def _hook_step(self, units: List[Tuple[str, torch.nn.Module]]) -> None:
        for name, module in units:
            self._add_optional(name, module)
        # Units that may become optional: every FSDP unit below the root with
        # one group, by module path, in module order.
        FSDPModule, _ = _fsdp_internals()
        for i, (name, module) in enumerate(self.model.named_modules()):
            if name and isinstance(module, FSDPModule):
                if len(_param_groups(module._get_fsdp_state())) == 1:
                    self._unit_order.setdefault(name, i)
        for module in self.model.modules():
            if hasattr(module, "_get_fsdp_state"):
                state = module._get_fsdp_state()
                if "_root_post_backward_final_callback" in state.__dict__:
                    continue
                original = state._root_post_backward_final_callback
                state.__dict__["_root_post_backward_final_callback"] = self._final_callback(
                    original
                )
                self._patched_states.append(state)

    def _begin_step(self, module, args):
        if torch._C._current_graph_task_id() != -1:
            return None  # recomputation inside backward (activation checkpointing)
        for unit in self.optional:
            unit.begin_step()
        return None

    def _after_forward(self, module, args, output):
        if not torch.is_grad_enabled():  # no backward will follow
            for unit in self.optional:
                unit.end_step()
        return None

    def _final_callback(self, original):
        def callback():
            self.flush()
            self.in_final_callback = True
            try:
                if self.overlap:
                    self._presubmit_final()
                original()
            finally:
                self.in_final_callback = False
                self.presubmitted.clear()
                for unit in self.optional:
                    unit.end_step()

        return callback

    def _hook_guard(self, guard) -> None:
        _patch_collectives()
        self.guard = guard
        for h in self.groups.values():
            unit = h.group_id[len(self.prefix) + 1:]
            for fp in h.group.fsdp_params:
                _GUARDED[id(fp)] = (guard, unit, h.group)
        # Prepended: before FSDP2's root pre-forward and its all-gather.
        self._handles.append(
            self.model.register_forward_pre_hook(self._guard_begin_step, prepend=True)
        )

    def _guard_begin_step(self, module, args):
        if torch._C._current_graph_task_id() == -1:
            self.guard.begin_step()
        return None

    def uninstall(self) -> None:
        """Restores FSDP2's own post-backward on every hooked group."""
        with self._lock:
            self.flush()
            if self.guard is not None:
                for h in self.groups.values():
                    for fp in h.group.fsdp_params:
                        _GUARDED.pop(id(fp), None)
                self.guard.close()
                self.guard = None
            for unit in self.optional:
                if unit.pinned:
                    unit.end_step(count=False)
                unit.remove()
            self.optional.clear()
            for handle in self._handles:
                handle.remove()
            self._handles.clear()
            for state in self._patched_states:
                state.__dict__.pop("_root_post_backward_final_callback", None)
            self._patched_states.clear()
            for h in self.groups.values():
                if h.group.__dict__.get("post_backward") is not None:
                    del h.group.__dict__["post_backward"]
                h.group.__dict__.pop("_accord_hook", None)
            self.groups.clear()
            self.model.__dict__.pop("_accord_installation", None)


def fix_transformers_output_capture(model: torch.nn.Module) -> int:
    """Lets `transformers` record hidden states inside FSDP units.

    transformers 5.x looks up which outputs a model can record by the name of
    the model's class; fully_shard swaps a unit's class for a subclass
    (`FSDPCLIPVisionModel`), so a vision tower sharded as its own unit stops
    returning hidden states and LLaVA-style models fail with "'NoneType' object
    is not subscriptable". This registers each such unit's class under its own
    name. Called by install(); safe to call again. Returns how many units it
    registered (0 without transformers).
    """
    import sys

    capture = sys.modules.get("transformers.utils.output_capturing")
    registry = getattr(capture, "_CAN_RECORD_REGISTRY", None)
    if registry is None:
        return 0
    FSDPModule, _ = _fsdp_internals()
    count = 0
    for module in model.modules():
        flags = getattr(module, "_can_record_outputs", None)
        if isinstance(module, FSDPModule) and flags and not registry.get(module):
            registry[module] = flags
            count += 1
    return count


def _resolve_optional(model: torch.nn.Module, optional, FSDPModule) -> List[Tuple[str, torch.nn.Module]]:
    """(path, module) of each optional unit, checked; raises ValueError."""
    if isinstance(optional, (str, torch.nn.Module)):
        optional = [optional]
    names = {id(m): n for n, m in model.named_modules()}
    out: List[Tuple[str, torch.nn.Module]] = []
    for item in optional:
        if isinstance(item, str):
            try:
                module = model.get_submodule(item)
            except AttributeError as e:
                raise ValueError(
                    f"accord.torch.install: optional unit {item!r} is not a submodule of the "
                    f"model ({e})"
                ) from None
            name = item
        elif isinstance(item, torch.nn.Module):
            if id(item) not in names:
                raise ValueError(
                    f"accord.torch.install: optional unit {type(item).__name__} is not a "
                    f"submodule of the model"
                )
            module, name = item, names[id(item)]
        else:
            raise TypeError(
                f"accord.torch.install: optional takes modules or module paths, got "
                f"{type(item).__name__}"
            )
        if module is model:
            raise ValueError(
                "accord.torch.install: the root module cannot be optional (every rank runs "
                "the root's forward)"
            )
        if not isinstance(module, FSDPModule):
            raise ValueError(
                f"accord.torch.install: optional unit '{name}' ({type(module).__name__}) is "
                f"not an FSDP unit; call fully_shard on it (before fully_shard on the model) "
                f"so that it has its own all-gather and reduce-scatter"
            )
        if any(m is module for _, m in out):
            continue
        out.append((name, module))
    if out and not isinstance(model, FSDPModule):
        raise ValueError(
            "accord.torch.install: optional units need the model itself to be an FSDP unit "
            "(call fully_shard(model) after sharding its submodules)"
        )
    return out


def install(
    model: torch.nn.Module,
    client_or_agreement,
    *,
    prefix: str = "fsdp",
    timeout_s: float = 300.0,
    optional: Sequence = (),
    overlap: Optional[bool] = None,
    guard: Optional[bool] = None,
    learn_optional: Optional[bool] = None,
) -> Installation:
    """Hooks FSDP2's reduce path of every FSDP parameter group in `model`.

    `client_or_agreement` is an accord client (accord.connect()) or any
    accord.Agreement. Call after fully_shard and before the model's first
    forward. `optional`: FSDP units (modules or module paths) whose forward
    may run a different number of times on different ranks (see the module
    docstring). `overlap` (default on; ACCORD_TORCH_OVERLAP=0 turns it off)
    moves each group's wait for its decision behind the next group's backward
    compute (see the module docstring). Idempotent: installing again with the same client and units
    returns the existing Installation; installing with a different one raises
    ValueError. `guard` (default on with an accord client and more than one
    rank; ACCORD_TORCH_GUARD=0 turns it off) checks that every rank issues
    the same FSDP collectives (see accord.guard); with `learn_optional`
    (default on; ACCORD_TORCH_LEARN_OPTIONAL=0 turns it off) a unit whose
    forward runs on some ranks only from the first time it diverges becomes
    an optional unit instead of an error. Raises
    UnsupportedTorchError for torch outside SUPPORTED_TORCH.
    """
    check_torch_version()
    FSDPModule, _ = _fsdp_internals()
    units = _resolve_optional(model, optional, FSDPModule)
    existing = model.__dict__.get("_accord_installation")
    if existing is not None:
        same = existing.agreement is client_or_agreement or getattr(
            existing.agreement, "client", None
        ) is client_or_agreement
        if not same:
            raise ValueError(
                "accord.torch.install: this model is already hooked with another client; "
                "call installation.uninstall() first"
            )
        if [m for _, m in units] != [u.module for u in existing.optional]:
            raise ValueError(
                "accord.torch.install: this model is already hooked with other optional "
                "units; call installation.uninstall() first"
            )
        return existing
    for module_name, module in model.named_modules():
        if isinstance(module, FSDPModule) and module._get_fsdp_state()._is_root is not None:
            raise ValueError(
                "accord.torch.install: the model has already run a forward under FSDP2; "
                "install accord right after fully_shard, before the first forward, on "
                "every rank (each group's step count must start at the same point)"
            )
    agreement = as_agreement(client_or_agreement, timeout_s=timeout_s)
    if overlap is None:
        overlap = os.environ.get("ACCORD_TORCH_OVERLAP", "1") not in ("0", "false", "off")
    installation = Installation(model, agreement, prefix)
    param_names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    seen_groups = set()
    for module_name, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        groups = _param_groups(module._get_fsdp_state())
        for gi, group in enumerate(groups):
            if id(group) in seen_groups:
                continue  # fully_shard([a, b]): one state, listed under each member module
            seen_groups.add(id(group))
            if group.__dict__.get("_accord_hook") is not None:
                raise ValueError(
                    f"accord.torch.install: FSDP group of '{module_name or '<root>'}' is "
                    f"already hooked by another installation"
                )
            base = f"{prefix}/{module_name or '<root>'}"
            group_id = base if len(groups) == 1 else f"{base}#{gi}"
            names = []
            for j, fp in enumerate(group.fsdp_params):
                n = param_names.get(id(fp.sharded_param))
                names.append(n if n is not None else f"{module_name}.param{j}")
            hooked = _HookedGroup(installation, group, group_id, names)
            group.__dict__["_accord_hook"] = hooked
            group.__dict__["post_backward"] = hooked.post_backward
            installation.groups[group_id] = hooked
    if not installation.groups:
        raise ValueError(
            "accord.torch.install: the model has no FSDP2 parameter groups; call "
            "fully_shard(...) on it (and its submodules) first"
        )
    installation.overlap = overlap and _can_overlap(agreement)
    installation.overlap_depth = max(1, int(os.environ.get("ACCORD_TORCH_OVERLAP_DEPTH", "2")))
    installation._hook_step(units)
    if guard is None:
        guard = os.environ.get("ACCORD_TORCH_GUARD", "1") not in ("0", "false", "off")
    client = getattr(agreement, "client", None)
    if guard and client is not None and agreement.world_size > 1:
        from accord.guard import SequenceGuard

        if learn_optional is None:
            learn_optional = os.environ.get("ACCORD_TORCH_LEARN_OPTIONAL", "1") not in (
                "0", "false", "off")
        installation._hook_guard(
            SequenceGuard(client, agreement.rank, agreement.world_size,
                          f"{prefix}/~collective-sequence", timeout_s,
                          learner=installation if learn_optional else None)
        )
    fix_transformers_output_capture(model)
    model.__dict__["_accord_installation"] = installation
    return installation
