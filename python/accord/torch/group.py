"""One FSDP2 parameter group under accord: its manifest, and how a decision
is applied to its gradients before FSDP2 builds the reduce-scatter buffer."""

from __future__ import annotations

import dataclasses
from typing import List, Optional

import torch

from accord.agreement import ParamTuple
from accord.torch import fsdp2
from accord.torch.plan import History, Layout


class AccordFSDPError(RuntimeError):
    """The adapter could not apply a decision (names the group and rank)."""


def dtype_name(dtype: torch.dtype) -> str:
    """accord's name of a torch dtype ('torch.bfloat16' -> 'bfloat16')."""
    return str(dtype).replace("torch.", "")


def torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


@dataclasses.dataclass
class GroupStats:
    """What the adapter did for one group (for tests, logs and dashboards);
    counted from each step's final decision."""

    reductions: int = 0
    zero_filled: int = 0  # parameter-steps zero-filled on this rank
    widened: int = 0  # parameter-steps converted to the wire dtype on this rank
    skipped: int = 0  # parameter-steps left out of the buffer
    last_decision: object = None
    speculated: int = 0  # steps reduce-scattered with the previous decision
    repaired: int = 0  # of those, steps that needed a repair


@dataclasses.dataclass
class Held:
    """A group's step between its manifest and the end of its repair."""

    step: int
    local: List[Optional[torch.Tensor]]
    dtypes: List[Optional[str]]
    handle: object = None
    applied: Optional[Layout] = None
    prior: Optional[list] = None  # sharded gradients before a speculative reduce-scatter


class HookedGroup:
    """One FSDP parameter group under accord. Owned by the training thread."""

    def __init__(self, installation, group, group_id: str, names: List[str]):
        self.installation = installation
        self.group = group
        self.group_id = group_id
        self.unit = group_id.split("/", 1)[1] if "/" in group_id else group_id
        self.params: List[ParamTuple] = []
        for name, fp in zip(names, group.fsdp_params):
            dim0, numel = fsdp2.param_shape(fp)
            self.params.append((name, dim0, numel))
        self.step = 0
        self.stats = GroupStats()
        self.history = History()
        self.original = group.post_backward  # FSDP2's, bound to the group
        self.optional = None  # the _OptionalUnit this group belongs to, if any

    def registration(self) -> tuple:
        rd = fsdp2.reduce_dtype(self.group)
        # FSDP2's reduce_dtype, when set, is the wire dtype (the user chose it).
        return (self.group_id, self.params, dtype_name(rd) if rd is not None else None,
                rd is not None)

    # ------------------------------------------------------------ FSDP2's hook

    def post_backward(self, *args, **kwargs):
        """Replaces the group's post_backward. Outside accord's release it
        never reduce-scatters: it does what FSDP2 does without gradient sync
        (reshard, keep the gradient), so no collective and no wait happens at
        a point whose order depends on this rank's data."""
        inst = self.installation
        if inst.releasing is self or not fsdp2.reduces(self.group):
            return self.original(*args, **kwargs)
        with fsdp2.without_reduce(self.group):
            result = self.original(*args, **kwargs)
        inst.held(self)
        return result

    # ------------------------------------------------------------ release

    def manifest(self) -> Held:
        local = fsdp2.local_grads(self.group)
        held = Held(self.step, local, [dtype_name(g.dtype) if g is not None else None
                                       for g in local])
        self.step += 1
        return held

    def reduce(self, decision, held: Held, speculative: bool) -> None:
        """Applies `decision` to this rank's gradients and runs FSDP2's own
        post-backward, which reduce-scatters what the decision includes in its
        wire dtype. Speculative: a local gradient the decision leaves out is
        kept out of this reduce-scatter (the repair brings it in)."""
        layout = Layout.of(decision)
        fsdp_params = self.group.fsdp_params
        if len(layout.included) != len(fsdp_params):
            raise AccordFSDPError(
                f"accord: group {self.group_id} step {held.step} rank "
                f"{self.installation.rank}: the decision covers {len(layout.included)} "
                f"parameters, the group has {len(fsdp_params)}")
        wire = torch_dtype(layout.wire_dtype)
        present = {g.dtype for g, inc in zip(held.local, layout.included) if g is not None and inc}
        # One local dtype: FSDP2's copy-in converts it to the wire dtype itself.
        # Several: each goes to the wire dtype, so FSDP2 sees uniform gradients.
        fill = next(iter(present)) if len(present) == 1 else wire
        for i, (fp, grad) in enumerate(zip(fsdp_params, held.local)):
            # FSDP2 reads the gradient from here only; what the decision
            # leaves out stays in held.local (for a repair) and nowhere else.
            fsdp2.take_grad(fp)
            if not layout.included[i]:
                if grad is not None and not speculative:
                    raise AccordFSDPError(
                        f"accord: group {self.group_id} step {held.step} rank "
                        f"{self.installation.rank}: the decision skips parameter "
                        f"{self.params[i][0]} but this rank has a gradient for it; the "
                        f"manifest and the decision disagree (check the agreement service)")
                continue
            if grad is None:
                if not fsdp2.was_unsharded(fp):
                    raise AccordFSDPError(
                        f"accord: group {self.group_id} step {held.step} rank "
                        f"{self.installation.rank}: parameter {self.params[i][0]} is used on "
                        f"another rank but this rank never ran this FSDP unit's forward, so "
                        f"there is nothing to zero-fill; run the unit's forward once on every "
                        f"rank (e.g. on an empty batch), or mark it optional")
                fsdp2.zero_fill(fp, fill)
            else:
                fp.unsharded_accumulated_grad = grad if grad.dtype == fill else grad.to(fill)
        held.applied = layout
        if speculative:
            held.prior = [_copy(fsdp2.sharded_param(fp).grad) for fp in fsdp_params]
        inst = self.installation
        if any(layout.included):
            numel = sum(p[2] for p, inc in zip(self.params, layout.included) if inc)
            inst.record_reduce(f"reduce-scatter of '{self.unit}' ({numel} x "
                               f"{layout.wire_dtype})")
            if fsdp2.all_reduces(self.group) and fsdp2.all_reduce_enabled(self.group):
                # HSDP: FSDP2 all-reduces the shard across replicas right
                # after the reduce-scatter, in the same call below.
                inst.record_reduce(f"all-reduce across replicas of '{self.unit}' (shard of "
                                   f"{numel} x {layout.wire_dtype})")
        inst.releasing = self
        try:
            with fsdp2.wire_dtype(self.group, wire):
                self.original()
        except RuntimeError as e:
            inst.explain(e)
            raise
        finally:
            inst.releasing = None

    def trim(self, held: Held, indices: List[int]) -> None:
        """Parameters the speculative reduce-scatter carried as zeros on every
        rank get back the gradient they had before it (None if none)."""
        for i in indices:
            sharded = fsdp2.sharded_param(self.group.fsdp_params[i])
            sharded.grad = held.prior[i]

    def restore_for_redo(self, held: Held) -> None:
        """The sharded gradients go back to what they were before the
        speculative reduce-scatter; reduce() then takes the unsharded ones
        from held.local again."""
        for fp, prior in zip(self.group.fsdp_params, held.prior):
            fsdp2.sharded_param(fp).grad = prior

    def count(self, decision, held: Held) -> None:
        """This step's stats, from its final decision."""
        s = self.stats
        s.reductions += 1
        s.last_decision = decision
        layout = Layout.of(decision)
        present = {dt for dt, inc in zip(held.dtypes, layout.included) if dt is not None and inc}
        for inc, dt in zip(layout.included, held.dtypes):
            if not inc:
                s.skipped += 1
            elif dt is None:
                s.zero_filled += 1
            elif len(present) > 1 and dt != layout.wire_dtype:
                s.widened += 1


def _copy(grad) -> Optional[torch.Tensor]:
    """A sharded gradient as it is now (FSDP2 may add into it in place)."""
    if grad is None:
        return None
    return grad.detach().clone()
