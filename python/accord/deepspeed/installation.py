"""accord hooked into one DeepSpeed ZeRO engine (docs/DEEPSPEED.md).

[Note: one reduction order]
DeepSpeed reduces a parameter's gradient from its autograd hook, in this
rank's autograd order and only where the parameter got a gradient, packing
gradients into buckets by size: which parameters share a bucket, and so the
number and sizes of the all-reduces, follow the rank's data. Where DeepSpeed
reduces from its hooks (ZeRO-2, ZeRO-1 with overlap_comm, ZeRO-3), the hook
hands DeepSpeed parameters in one release order, speculated from the last
decision, and the epilogue repairs what the decision changes
(accord.deepspeed.turns; under ZeRO-3 only as far as a cap placed among its
parameter all-gathers allows, accord.deepspeed.turns3). Otherwise (ZeRO-1
without overlap_comm, or turns off) the hook does nothing (the gradient
stays where DeepSpeed keeps it), and no accord call is made inside autograd.
At DeepSpeed's end-of-backward epilogue, which every rank reaches once per
backward, the rank submits one manifest (which parameters have a gradient,
in which dtype) and waits for the decision, the same on every rank; then it
hands DeepSpeed, in parameter order, every parameter the decision includes,
with a zero gradient where this rank has none. DeepSpeed's own bucketing
then sees the same parameters with the same sizes in the same order on every
rank.

ZeRO-3 reduces every backward. Its forward and backward fetches follow each
rank's module trace, which DeepSpeed also requires to be the same on every
rank: modules given as optional are made persistent, all-gathered at install
on every rank, and kept out of DeepSpeed's per-module fetch, release and
trace (accord.deepspeed.zero3.Zero3.pin). Every other fetch's all-gather is
recorded by accord.torch's collective-sequence guard just before it is
issued (accord.deepspeed.all_gathers): a module that runs on some ranks only
and was not given ends with AccordDivergenceError on every rank, not in
Gloo.

A parameter no rank used in the accumulation window is not reduced;
DeepSpeed counts it as a zero gradient in its flat partition, which would
still move it (weight decay, moment decay). Its slice of this rank's fp32
partition and of each optimizer state tensor is copied before the base
optimizer's step and put back after it, so it and its moments are bitwise
unchanged (DeepSpeed copies the fp32 partition into the model's parameters
after the step). ZeRO-3 keeps the last reduced value in its flat gradient
partition for a parameter it does not reduce: that slice is zeroed in the
window's first backward.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import List

import torch

from accord.deepspeed.all_gathers import GuardedAllGathers
from accord.deepspeed.turns import Turns
from accord.deepspeed.turns3 import Zero3Turns
from accord.torch.errors import AccordDivergenceError, AccordJobError, waited


@dataclasses.dataclass
class Stats:
    """What accord did (for tests, logs and dashboards)."""

    releases: int = 0  # epilogues that reduced, each after one agreement
    reduced: int = 0  # parameter-reductions handed to DeepSpeed
    zero_filled: int = 0  # of those, with a zero gradient from this rank
    skipped: int = 0  # parameter-releases left out (no rank had a gradient)
    restored: int = 0  # parameter-steps whose fp32 slice and moments were put back
    restored_bytes: int = 0  # bytes copied for those (each way)
    # The most bytes accord held at once beyond what DeepSpeed holds: with
    # turns, gradients not yet handed (before their turn or the cap) or kept
    # for the repair (late, or left out of the speculation), a zero gradient
    # while DeepSpeed copies it, the repair's flat delta; without (ZeRO-1
    # without overlap_comm, turns=False), every gradient of the backward,
    # held to its epilogue.
    held_bytes: int = 0
    zero_filled_bytes: int = 0  # zeros this rank sent for parameters others used
    speculated: int = 0  # reductions handed to DeepSpeed before the decision
    late: int = 0  # gradients that came after their parameter's turn
    repaired: int = 0  # parameter-reductions repaired by accord's all-reduce
    repaired_bytes: int = 0  # bytes of those all-reduces
    agreed_caps: int = 0  # ZeRO-3 all-gathers before which the ranks agreed a cap
    # With turns: the most held during each reducing backward, in order.
    held_by_release: List[int] = dataclasses.field(default_factory=list)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


class Installation:
    """One ZeRO engine under accord. Training thread only."""

    def __init__(self, engine, adapter, agreement, prefix: str, watch=None, guard=None,
                 turns: bool = True):
        self.engine = engine
        self.zero = adapter
        self.agreement = agreement
        self.watch = watch  # accord.torch.watchdog.StepWatch, or None
        self.guard = guard  # accord.torch.guard.SequenceGuard (ZeRO-3), or None
        self.rank = agreement.rank
        self.group_id = f"{prefix}/zero"
        names = {id(p): n for n, p in engine.module.named_parameters()}
        self.all_gathers = None if guard is None else GuardedAllGathers(adapter, guard, names)
        # (group index, parameter), in DeepSpeed's group order: the release order.
        self.order = [(i, p) for i, g in enumerate(adapter.param_groups()) for p in g
                      if p.requires_grad]
        self.names = [names.get(id(p), f"group{i}.param{k}") for k, (i, p) in
                      enumerate(self.order)]
        self.step = 0  # agreement steps so far (one per reducing epilogue)
        self.used = [False] * len(self.order)  # in this accumulation window, on some rank
        self.window_closed = True  # the next release opens an accumulation window
        self.stats = Stats()
        self.decisions: List[object] = []  # the last decision, for tests
        self._reduce = adapter.original("reduce_ready_partitions_and_remove_grads")
        self._epilogue = adapter.original("independent_gradient_partition_epilogue")
        self._optimizer_step = adapter.original("_optimizer_step")
        in_hooks = getattr(adapter, "reduces_in_hooks", None)
        # ZeRO-3 leaf modules' parameters, and those of them autograd gave a
        # gradient since the last reduction: DeepSpeed's leaf hook zero-fills
        # the others.
        self.leaf = {id(p) for p in adapter.leaf_parameters([p for _, p in self.order])}
        self.came: set = set()
        self.turns = None
        if turns and in_hooks is not None and in_hooks():
            gathers = hasattr(adapter, "route_all_gathers")  # ZeRO-3
            self.turns = Zero3Turns(self) if gathers else Turns(self)
        self._handles: list = []  # hooks on the model, removed at uninstall
        self._wrapped: List[str] = []  # engine methods wrapped on the instance

    def registrations(self) -> List[tuple]:
        """Every group this installation submits to (the release's, the step
        watch's, the guard's), for one batched registration."""
        params = [(n, int(p.shape[0]) if p.dim() else 1, p.numel())
                  for n, (_, p) in zip(self.names, self.order)]
        regs = [(self.group_id, params, None, False)]
        if self.turns is not None:
            regs.append((f"{self.group_id}/~late", params, None, False))
        if self.watch is not None:
            regs.append(self.watch.registration())
        return regs + (self.guard.registrations() if self.guard is not None else [])

    def register(self) -> None:
        """registrations() in one round trip where the agreement has one."""
        batch = getattr(self.agreement, "register_all", None)
        if callable(batch):
            batch(self.registrations())
        else:
            for r in self.registrations():
                self.agreement.register(*r)
        if self.guard is not None:
            self.guard.registered()

    # ------------------------------------------------------------ DeepSpeed's hooks

    def held(self, param, i=None) -> None:
        """Replaces the hook-time reduction: the gradient stays with DeepSpeed
        until the epilogue (no collective, no accord call, inside autograd)."""
        if self.watch is not None:
            self.watch.progress("the backward")
        if id(param) in self.leaf and id(param) not in self.came and \
                not self.zero.in_bucket(param):
            param.grad = None  # DeepSpeed's zero-fill: no gradient on this rank
        if self.turns is not None and self.zero.reduces_now():
            self.turns.held(param)

    def epilogue(self) -> None:
        """DeepSpeed's end-of-backward epilogue, with accord's release first."""
        if self.zero.reduces_now():
            self.release()
            self.came.clear()
        with self.explaining():
            self._epilogue()
        if self.watch is not None and self.zero.reduces_now():
            self.watch.end_step()

    def begin_forward(self, module, args) -> None:
        """A forward of the model: the step watch's step begins (the index of
        the next release, the same on every rank), and the guard's."""
        if self.watch is not None:
            self.watch.begin_step(self.step)
            self.watch.progress("the forward")
        if self.guard is not None:
            self.guard.begin_step()

    def route(self, params, forward: bool, issue):
        """ZeRO-3's parameter all-gathers: the guard's record first, then
        the turns before it (turns3.Zero3Turns), then DeepSpeed's own."""
        turns = self.turns if isinstance(self.turns, Zero3Turns) else None
        gathered = self.zero.to_gather(params) if turns is not None else None

        def issue_after_turns():
            if gathered:
                turns.before_all_gather(gathered)
            return issue()

        if self.all_gathers is None:
            return issue_after_turns()
        return self.all_gathers.route(params, forward, issue_after_turns)

    @contextlib.contextmanager
    def explaining(self):
        """A collective that fails because a peer stopped or died raises the
        coordinator's named error (the step watch asks), when it has one."""
        try:
            yield
        except AccordDivergenceError:
            raise  # named already: the guard's finding, or the job's verdict
        except RuntimeError as e:
            if self.watch is not None:
                self.watch.explain(e)
            if self.guard is not None:
                self.guard.explain(e)
            raise

    def release(self) -> None:
        """One agreement, then every included parameter to DeepSpeed's
        bucketing in release order, zero-filled where this rank has none."""
        opening = self.window_closed
        if opening:
            self.used = [False] * len(self.order)
        if self.turns is not None:
            included = self.turns.end()
            self.step += 1
            self.stats.releases += 1
            self.used = [u or inc for u, inc in zip(self.used, included)]
            self.window_closed = self.zero.boundary()
            return
        grads = [self.zero.gradient(p) for _, p in self.order]
        manifest = [None if g is None else _dtype_name(g.dtype) for g in grads]
        held = sum(g.numel() * g.element_size() for g in grads if g is not None)
        self.stats.held_bytes = max(self.stats.held_bytes, held)
        decision = self.decide(manifest)[0]
        with self.explaining():
            self._reduce_included(decision, grads, opening)
        self.window_closed = self.zero.boundary()

    def _reduce_included(self, decision, grads, opening: bool) -> None:
        self.step += 1
        self.decisions = [decision]
        included = list(decision.included)
        s = self.stats
        s.releases += 1
        for k, ((i, p), g, inc) in enumerate(zip(self.order, grads, included)):
            if not inc:
                s.skipped += 1
                if opening:
                    self.zero.clear_partition(p)
                continue
            self.used[k] = True
            if g is None:
                self.zero.zero_fill(p)
                s.zero_filled += 1
                s.zero_filled_bytes += self.zero.gradient(p).numel() * \
                    self.zero.gradient(p).element_size()
            if self.watch is not None:
                self.watch.progress(f"the reduction of '{self.names[k]}'")
            self.zero.reduce(self._reduce, p, i)
            s.reduced += 1

    def decide(self, manifest, late=None) -> list:
        """This release's decision (and, with turns, the `~late` group's);
        the job's verdict (a rank lost, say) is raised as accord.torch's
        AccordJobError, the same text on every rank."""
        try:
            return self._decide(manifest, late)
        except AccordJobError as e:
            # A rank that diverged and stopped fails the job while this one
            # waits here: the divergence, once this rank's guard finds it too,
            # is what every rank reports.
            if self.guard is not None:
                self.guard.explain(e, wait_s=self.guard.stall_s)
            raise

    def _decide(self, manifest, late) -> list:
        """The step watch's item and the guard's window of the step go in the
        same batch (without a batch, the window is submitted without waiting)."""
        mine = [(self.group_id, self.step, manifest)]
        if late is not None:
            mine.append((f"{self.group_id}/~late", self.step, late))
        item = self.watch.item(self.step) if self.watch is not None else None
        seq, window = self.guard.release_item(self.step) if self.guard else (None, None)
        submit_batch = getattr(self.agreement, "submit_batch", None)
        if not callable(submit_batch):
            if seq is not None:
                self.guard.release_handle(window, self.guard.client.submit(*seq))
            return [self.agreement.submit(*m) for m in mine]
        handles = list(submit_batch(mine + ([item] if item else []) + ([seq] if seq else [])))
        if item:
            self.watch.handed(self.step, handles[len(mine)])
        if self.watch is not None:
            self.watch.released(self.step)  # the reductions after it: the next item's
        if seq is not None:
            self.guard.release_handle(window, handles[-1])
        where = "accord.deepspeed: learned at the end-of-backward release"
        return [waited(self.agreement, h, where) for h in handles[:len(mine)]]

    def optimizer_step(self, group_no: int) -> None:
        """The base optimizer's step on one flat partition, with the slices of
        parameters no rank used put back afterwards."""
        group = set(id(p) for p in self.zero.param_groups()[group_no])
        kept = []
        for k, (_, p) in enumerate(self.order):
            if id(p) in group and not self.used[k]:
                for t in self.zero.state_slices(p):
                    kept.append((t, t.detach().clone()))
                self.stats.restored += 1
        self._optimizer_step(group_no)
        for t, saved in kept:
            t.data.copy_(saved)
            self.stats.restored_bytes += saved.numel() * saved.element_size()

    # ------------------------------------------------------------ wiring

    def hook(self) -> None:
        self.zero.patch("reduce_ready_partitions_and_remove_grads", self.held)
        self.zero.patch("independent_gradient_partition_epilogue", self.epilogue)
        self.zero.patch("_optimizer_step", self.optimizer_step)
        if self.turns is not None:
            self.turns.hook()
        for _, p in self.order:
            if id(p) in self.leaf:
                self._handles.append(p.register_hook(
                    lambda grad, key=id(p): self.came.add(key)))
        if self.all_gathers is not None or isinstance(self.turns, Zero3Turns):
            check = self.all_gathers.trace_check if self.all_gathers is not None else None
            self.zero.route_all_gathers(self.route, check)
        if self.watch is not None or self.guard is not None:
            self._handles.append(
                self.engine.module.register_forward_pre_hook(self.begin_forward, prepend=True))
            # The engine's own calls (an engine, not EngineParts): a peer's
            # death inside them is named.
            for name in ("forward", "backward", "step"):
                own = getattr(type(self.engine), name, None)
                if own is None or not callable(own):
                    continue

                def wrapped(*args, __own=own.__get__(self.engine), **kwargs):
                    with self.explaining():
                        return __own(*args, **kwargs)

                self.engine.__dict__[name] = wrapped
                self._wrapped.append(name)
        self.engine.__dict__["_accord_installation"] = self

    def uninstall(self) -> None:
        """Restores DeepSpeed's own methods."""
        self.zero.unpatch()
        self.zero.unpin()
        if self.turns is not None:
            self.turns.unhook()
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for name in self._wrapped:
            self.engine.__dict__.pop(name, None)
        self._wrapped.clear()
        for part in ("guard", "watch"):
            if getattr(self, part) is not None:
                getattr(self, part).close()
                setattr(self, part, None)
        self.engine.__dict__.pop("_accord_installation", None)
