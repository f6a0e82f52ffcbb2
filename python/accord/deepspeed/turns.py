"""ZeRO-1/2 reductions released during the backward (docs/DEEPSPEED.md, "The
mechanism").

[Note: turns in one release order]
Release order: in the first reducing backward, the reverse of the model's
parameter order (autograd's order in a sequential model); from then on, the
order in which the ranks' hooks ran in that backward, averaged over the
ranks (one all-reduce of a position per parameter at its epilogue), so a
model whose modules are defined out of execution order (HF Llama's layer
norms) is not late every step. In ZeRO-1/2 the only collectives of the backward are
DeepSpeed's gradient reductions, issued from its bucketing, which depends
only on the sequence of parameters it is handed. A gradient hook of the
parameter at release position p hands DeepSpeed every speculated parameter
up to p not handed yet (its gradient, or zeros where this rank has none);
the end of the backward hands the rest. So every rank hands the same
parameters in the same order, whatever its data: the same reductions, only
at other moments, and Gloo's blocking collectives pair. When a turn comes
is this rank's own choice, since no other collective interleaves: a hook
hands every parameter of the modules before its own (their backward is done
in a sequential model), then, greedily, each next one whose gradient is
there (a module's parameters come in either order).

The speculation is the last decision (every trainable parameter at first
and after a decision that grew). A gradient that comes after its
parameter's turn is *late*: a tensor hook keeps it and lets zeros through to
DeepSpeed's (already reduced) gradient. At the end of the backward, after
the decision, the parameters it includes that the speculation left out, or
that some rank was late for (`<prefix>/~late`), are reduced once more by
accord: one all-reduce of their flat deltas (what each rank has not sent,
zeros otherwise), the same on every rank, added into DeepSpeed's reduced
partition (zero.Zero12.add_reduced) before its epilogue reads it.
"""

from __future__ import annotations

import functools
from typing import Dict, List

import torch


def _bytes(t) -> int:
    return 0 if t is None else t.numel() * t.element_size()


class Turns:
    """One installation's turns. Training thread only."""

    def __init__(self, inst):
        self.inst = inst
        self.zero = inst.zero
        n = len(inst.order)
        model = {id(p): r for r, p in enumerate(inst.engine.module.parameters())}
        self.model_rank = [-model.get(id(p), -1) for _, p in inst.order]  # reversed
        self.index = {id(p): k for k, (_, p) in enumerate(inst.order)}
        self.order_by(self.model_rank)
        self.learned = False  # the release order from the first backward's hooks
        self.hooks_ran: Dict[int, None] = {}  # parameter indices, in the order gradients came
        self.speculated = [True] * n  # the layout of the turns, from the last decision
        self._handles: list = []
        self.reset()

    def order_by(self, key) -> None:
        """Release order by `key` (ties: the model's order reversed)."""
        n = len(self.inst.order)
        self.release = sorted(range(n), key=lambda k: (key[k], self.model_rank[k], -k))
        self.position = {k: r for r, k in enumerate(self.release)}
        # The first release position of each position's module (its run).
        module = [self.inst.names[k].rsplit(".", 1)[0] for k in self.release]
        self.module_start = [0] * n
        for r in range(1, n):
            same = module[r] == module[r - 1]
            self.module_start[r] = self.module_start[r - 1] if same else r

    def learn(self) -> None:
        """Each parameter's mean position over the ranks in the order their
        hooks ran (no hook: after every one), the same on every rank."""
        n = len(self.inst.order)
        device = self.inst.order[0][1].device  # NCCL reduces device tensors only
        where = torch.full((n,), float(n), dtype=torch.float64, device=device)
        for r, k in enumerate(self.hooks_ran):
            where[k] = float(r)
        self.zero.all_reduce_mean(where)
        self.order_by([float(x) for x in where])
        self.learned = True

    def relearn(self, late_anywhere: List[bool]) -> bool:
        """Whether this epilogue learns the release order (the same on every rank)."""
        return not self.learned

    def reset(self) -> None:
        n = len(self.inst.order)
        self.next = 0  # release positions below it have had their turn
        self.taken = [False] * n
        self.had = [False] * n  # this rank has a gradient (ZeRO-1: accumulated)
        self.arrived = [False] * n  # its hook ran in this backward
        self.late: Dict[int, torch.Tensor] = {}
        self.holding = 0  # gradient bytes accord holds now, beyond DeepSpeed
        self.peak = 0  # the most held in this backward

    def hook(self) -> None:
        for k, (_, p) in enumerate(self.inst.order):
            self._handles.append(p.register_hook(functools.partial(self.coming, k)))

    def unhook(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _peak(self, extra: int = 0) -> None:
        s = self.inst.stats
        self.peak = max(self.peak, self.holding + extra)
        s.held_bytes = max(s.held_bytes, self.peak)

    # ------------------------------------------------------------ the backward

    def coming(self, k: int, grad: torch.Tensor):
        """A gradient on its way to the parameter (before autograd accumulates
        it): after the turn it is kept as late, and zeros go on."""
        if not self.learned:
            self.hooks_ran.setdefault(k)
        if not self.taken[k]:
            return None
        self.had[k] = True
        kept = self.late.get(k)
        self.late[k] = grad.detach().clone() if kept is None else kept.add_(grad)
        if kept is None:
            self.holding += _bytes(grad)
            self.inst.stats.late += 1
        self._peak()
        return torch.zeros_like(grad)

    def held(self, param) -> None:
        """DeepSpeed's hook for `param`: the modules before its own, then
        each next parameter whose gradient is there."""
        k = self.index[id(param)]
        if not self.taken[k] and not self.arrived[k] and self.zero.gradient(param) is not None:
            self.arrived[k] = self.had[k] = True  # kept until its turn (the end: not speculated)
            self.holding += _bytes(self.zero.gradient(param))
        cap = self.cap()
        self.through(min(self.module_start[self.position[k]] - 1, cap))
        while self.next <= cap:
            k = self.release[self.next]
            if self.speculated[k] and not self.arrived[k]:
                break
            self.through(self.next)
        self._peak()  # what waits now: DeepSpeed alone would have taken it

    def cap(self) -> int:
        """The last release position a hook may hand now: every one (no other
        collective interleaves with DeepSpeed's reductions in ZeRO-1/2)."""
        return len(self.release) - 1

    def through(self, last: int) -> None:
        while self.next <= last:
            self.next += 1
            self.hand(self.next - 1)

    def hand(self, r: int) -> None:
        """The turn of release position `r` (none for a parameter out of the
        speculation or already handed)."""
        k = self.release[r]
        if not self.speculated[k] or self.taken[k]:
            return
        s = self.inst.stats
        i, p = self.inst.order[k]
        if self.zero.gradient(p) is None:
            self.zero.zero_fill(p)
            zeros = _bytes(self.zero.gradient(p))
            self._peak(zeros)
            s.zero_filled += 1
            s.zero_filled_bytes += zeros
        else:
            self.had[k] = True
            if self.arrived[k]:
                self.holding -= _bytes(self.zero.gradient(p))
        self.taken[k] = True
        if self.inst.watch is not None:
            self.inst.watch.progress(f"the reduction of '{self.inst.names[k]}'")
        self.zero.reduce(self.inst._reduce, p, i)
        s.reduced += 1
        s.speculated += 1

    # ------------------------------------------------------------ the end

    def end(self) -> List[bool]:
        """The rest of the turns, the decision, the repair; returns the
        decision's included parameters."""
        self.through(len(self.release) - 1)
        dtype = str(self.zero.grad_dtype()).replace("torch.", "")
        order = self.inst.order
        for k, (_, p) in enumerate(order):
            if not self.taken[k] and self.zero.gradient(p) is not None:
                self.had[k] = True
        manifest = [dtype if h else None for h in self.had]
        late = ["float32" if k in self.late else None for k in range(len(order))]
        decision, late_decision = self.inst.decide(manifest, late)
        included = [bool(x) for x in decision.included]
        late_anywhere = [bool(x) for x in late_decision.included]
        delta = [k for k in self.release
                 if included[k] and (not self.speculated[k] or late_anywhere[k])]
        with self.inst.explaining():
            if delta:
                self.repair(delta)
            if self.relearn(late_anywhere):
                self.learn()
        s = self.inst.stats
        s.held_by_release.append(self.peak)
        s.skipped += sum(1 for k in range(len(order)) if not included[k])
        grew = any(inc and not spec for inc, spec in zip(included, self.speculated))
        self.speculated = [True] * len(order) if grew else included
        self.reset()
        return included

    def repair(self, delta: List[int]) -> None:
        """What each rank has not sent for `delta`, added into DeepSpeed's
        reduced partition: one all-reduce per process group DeepSpeed reduces
        them over (the data-parallel group; each MoE expert group's
        expert-data-parallel group), in order of first release position."""
        self.zero.flush()
        by_group: Dict[int, List[int]] = {}
        for k in delta:
            by_group.setdefault(self.zero.reduction_key(self.inst.order[k][0]), []).append(k)
        for group_index, ks in by_group.items():
            self._repair_over(ks, group_index)

    def _repair_over(self, delta: List[int], group_index: int) -> None:
        """One float32 all-reduce of `delta`, all reduced over the process
        group of parameter group `group_index`."""
        params = [self.inst.order[k][1] for k in delta]
        sizes = [self.zero.numel(p) for p in params]
        flat = torch.zeros(sum(sizes), dtype=torch.float32,
                           device=params[0].device)
        offset = 0
        for k, p, size in zip(delta, params, sizes):
            mine = self.late.pop(k, None)
            if not self.speculated[k]:
                mine = self.zero.take(p)  # never handed to DeepSpeed
            if mine is not None:  # converted to float32 in place: no copy of its own
                flat.narrow(0, offset, size).copy_(mine.detach().reshape(-1))
            offset += size
        self._peak(_bytes(flat))
        self.zero.all_reduce_mean(flat, group_index)
        offset = 0
        s = self.inst.stats
        for k, size in zip(delta, sizes):
            i, p = self.inst.order[k]
            self.zero.add_reduced(p, i, flat.narrow(0, offset, size))
            offset += size
        s.repaired += len(delta)
        s.repaired_bytes += _bytes(flat)
