"""ZeRO-3 reductions released during the backward, placed among the
backward's parameter all-gathers (docs/DEEPSPEED.md, "Turns under ZeRO-3").

[Note: turns among ZeRO-3's all-gathers]
A ZeRO-3 backward issues two kinds of collectives on DeepSpeed's
data-parallel group: the parameter all-gathers of its fetches and prefetches
(the same on every rank: DeepSpeed needs it, and optional modules and the
guard make it so), and the reductions of DeepSpeed's buckets, which follow
only the sequence of parameters handed to its bucketing
(`reduce_independent_p_g_buckets_and_remove_grads`: a bucket is reduced when
the next parameter would overflow it). Parameters are handed in one release
order (turns.Turns), and which turns come where is a function of the
backward's all-gathers so far and of agreed history alone: before each
all-gather, the turns the rule below gives (zeros where a rank's gradient
is not there: late, repaired); between two all-gathers, a gradient hook hands
at most what the rule gave before the first of them. So the parameters
handed before each all-gather, and with them every reduction, are the same
on every rank: each bucket's reduction sits between the same two all-gathers
everywhere, whatever autograd's order on a rank.

The turns follow one of two rules, chosen per all-gather from what every
rank sees alike:

- *following*: while the parameters not there at this backward's prologue
  and its all-gathers so far are the last learned backward's (DeepSpeed's
  parameter ids, all-gather by all-gather), its table: before all-gather
  c + 1, every turn through cap(c), the release positions whose gradient
  had come on every rank before
  that backward's all-gather c + 1 (`arrival`: the all-gather count when it
  came, the ranks' maximum, learned by one all-reduce at the epilogue; the
  release order sorted by it). After as many all-gathers as it had, every
  position (the *tail*);
- *agreed*: from the first all-gather that is not the one the table
  predicts (none learned: the first backward; the parameters not there at
  the prologue, or an all-gather, differ from the learned backward's:
  DeepSpeed's trace completed or invalidated, a module fetched once more or
  once less), to the epilogue: just before each all-gather, one all-reduce
  (MIN) on DeepSpeed's group of a flag per parameter (its gradient is here
  on this rank, or handed); every position flagged on every rank is handed,
  in release order; between all-gathers, nothing. No position is handed
  before its gradient came on every rank (nothing late), and what waits is
  what came since the last all-gather or is not there on some rank.

All-gathers are the same on every rank (DeepSpeed needs it; optional
modules and the guard make it so: docs/DEEPSPEED.md, "ZeRO-3: the
forward"), so every rank leaves the table at the same all-gather and issues
the same all-reduces at the same places.

The tail also comes, once something is learned, when nothing more is to be
fetched: at the prologue, the parameters the last backward that all-gathered
them fetched (as many times as it did) and that are not there now
(`ds_status` NOT_AVAILABLE; the forward's fetches and releases, hence this
set, are the same on every rank) are what it can still fetch; after the
all-gather that fetches the last of them, and from the prologue where there
is none, every position. An all-gather after the tail first hands every
position (zeros where a gradient has not come: late, kept to the repair).
Where every parameter is persistent nothing is ever fetched: every backward
is tail from the first.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from accord.deepspeed.turns import Turns


class Zero3Turns(Turns):
    """Turns placed among ZeRO-3's all-gathers. Training thread and
    autograd's (one at a time)."""

    def __init__(self, inst):
        self.expected: Optional[int] = None  # all-gathers of the learned backward
        self.learned_key: tuple = ()  # the learned backward's `key`
        # id -> (parameter, all-gathers of it in the last backward that fetched it)
        self.fetched: Dict[int, Tuple[object, int]] = {}
        super().__init__(inst)

    def reset(self) -> None:
        super().reset()
        self.gathers = 0  # all-gathers of this backward so far
        # what is to fetch at the prologue, then each all-gather, by DeepSpeed's parameter ids
        self.key: tuple = ()
        self.in_backward = False  # from the backward's prologue to its epilogue
        self.arrival: Dict[int, int] = {}  # parameter index -> all-gathers before it came
        self.hooks_ran = {}
        self.unfetched: Dict[int, int] = {}  # id -> all-gathers of it this backward can still issue
        self.counts: Dict[int, Tuple[object, int]] = {}  # id -> (parameter, all-gathers of it)
        self.following = False  # the prologue and all-gathers so far are the learned backward's
        self.tail = False  # every position, from now to the epilogue

    def hook(self) -> None:
        super().hook()
        self.zero.on_backward(self.reset_gathers)
        if self.zero.fetches_nothing(self.inst.engine.module):
            self.expected, self.caps = 0, []  # all tail, from the first backward
            self.learned_key = ((),)

    def reset_gathers(self) -> None:
        """The backward begins (after the forward's all-gathers, on every rank)."""
        gone = self.zero.to_gather([p for p, _ in self.fetched.values()])
        self.unfetched = {id(p): self.fetched[id(p)][1] for p, _ in gone}
        self.gathers, self.counts = 0, {}
        self.key = (self.zero.gather_key(gone),)
        self.in_backward, self.tail = True, False
        self.following = self.expected is not None and self.learned_key[:1] == self.key
        self._tail()

    def _tail(self) -> None:
        learned = self.expected is not None
        self.tail = self.tail or (self.following and self.gathers >= self.expected) or (
            learned and not self.unfetched)

    # ------------------------------------------------------------ the cap

    def cap(self) -> int:
        if self.tail:
            return len(self.release) - 1
        if self.following:
            return self.caps[self.gathers]
        return self.next - 1  # agreed: only at the next all-gather

    def _agree(self) -> None:
        """Hands, in release order, every position whose gradient is here on
        every rank: one all-reduce (MIN) of a flag per parameter, on every
        rank before the same all-gather."""
        n = len(self.release)
        device = self.inst.order[0][1].device  # NCCL reduces device tensors only
        here = torch.tensor([float(self.arrived[k] or self.taken[k]) for k in range(n)],
                            dtype=torch.float32, device=device)
        self.zero.all_reduce_min(here)
        everywhere = here.tolist()
        for r in range(self.next, n):
            if everywhere[self.release[r]]:
                self.hand(r)
        while self.next < n and (self.taken[self.release[self.next]]
                                 or not self.speculated[self.release[self.next]]):
            self.next += 1
        self.inst.stats.agreed_caps += 1

    def before_all_gather(self, gathered) -> None:
        """Just before DeepSpeed issues an all-gather of `gathered`
        ((parameter, numel) pairs) in a reducing backward: which rule, the
        turns it gives, then the count."""
        if not self.in_backward or not self.zero.reduces_now():
            return
        key = self.zero.gather_key(gathered)
        if self.following and (self.gathers + 1 >= len(self.learned_key)
                               or self.learned_key[self.gathers + 1] != key):
            self.following = False  # the same all-gather on every rank
        if not self.tail and not self.following:
            self._agree()
        self.key += (key,)
        self.through(self.cap())
        self.gathers += 1
        for p, _ in gathered:
            i = id(p)
            self.counts[i] = (p, self.counts.get(i, (p, 0))[1] + 1)
            left = self.unfetched.pop(i, 0) - 1
            if left > 0:
                self.unfetched[i] = left
        self._tail()
        self._peak()

    # ------------------------------------------------------------ gradients

    def coming(self, k: int, grad: torch.Tensor):
        if self.zero.reduces_now():
            self.arrival.setdefault(k, self.gathers)
            self.hooks_ran.setdefault(k)
        return super().coming(k, grad)

    def held(self, param) -> None:
        k = self.index[id(param)]
        if self.taken[k] and param.grad is not None and not self.zero.in_bucket(param):
            param.grad = None  # the zeros a late gradient let through (it is kept)
        super().held(param)

    # ------------------------------------------------------------ the end

    def end(self) -> List[bool]:
        self.fetched.update(self.counts)
        if self.inst.window_closed:  # DeepSpeed copies, not adds, what it reduces now
            for k, (_, p) in enumerate(self.inst.order):
                if not self.speculated[k]:  # not reduced now: a stale value from before
                    self.zero.clear_partition(p)
        return super().end()

    def relearn(self, late_anywhere: List[bool]) -> bool:
        return not self.learned or self.key != self.learned_key or any(late_anywhere)

    def learn(self) -> None:
        """Each parameter's arrival (the all-gathers before its gradient
        came; none: -1) and position in this rank's order of arrival, the
        ranks' maximum of each by one all-reduce; the release order sorted
        by arrival (none: last), then position; the caps from it."""
        n = len(self.inst.order)
        device = self.inst.order[0][1].device
        where = torch.full((2 * n,), -1.0, dtype=torch.float64, device=device)
        for k, c in self.arrival.items():
            where[k] = float(c)
        for r, k in enumerate(self.hooks_ran):
            where[n + k] = float(r)
        self.zero.all_reduce_max(where)
        arrival = [float("inf") if x < 0 else float(x) for x in where[:n].tolist()]
        self.order_by([(a, float(x)) for a, x in zip(arrival, where[n:].tolist())])
        self.expected = self.gathers
        self.caps = []
        last = -1
        for c in range(self.expected):
            while last + 1 < n and arrival[self.release[last + 1]] <= c:
                last += 1
            self.caps.append(last)
        self.learned_key = self.key
        self.learned = True
        self.hooks_ran = {}
