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
order (turns.Turns), and how far the hand-over may go is a *cap*, a function
of the backward's all-gathers so far and of agreed history alone:

- before the backward's all-gather number c + 1, every turn through cap(c)
  (so a rank whose gradients were not there sends zeros: late, repaired);
- between all-gather c and c + 1, a gradient hook hands at most through
  cap(c) (nothing beyond it until the next all-gather).

So the parameters handed before each all-gather, and with them every
reduction, are the same on every rank: each bucket's reduction sits between
the same two all-gathers everywhere, whatever autograd's order on a rank.

cap(c), from the last learned backward (its all-gathers the same as this
one's so far): the release positions whose gradient had come on every rank
before that backward's all-gather c + 1 (`arrival`: the all-gather count when
it came, the ranks' maximum, learned by one all-reduce at the epilogue; the
release order sorted by it). After as many all-gathers as it had, every
position (the *tail*); an all-gather beyond that count first hands every
position, on every rank. Learned at the first epilogue, and again at an
epilogue whose backward's all-gathers differed from the learned one's or at
which some rank was late (both the same on every rank). With nothing learned
(the first backward, where DeepSpeed records its module trace and prefetches
nothing: each all-gather is the fetch of the module about to run its
backward), cap(c) is the position before the first parameter of the latest
module fetched, through the all-gather itself (recorded by the guard first);
where every parameter is persistent nothing is ever fetched, and every
backward is tail from the first.

Once something is learned, a backward is also tail from the moment nothing
more is to be fetched: at its prologue, the parameters some earlier backward
all-gathered that are not there now (`ds_status` NOT_AVAILABLE; the forward's
fetches and releases, hence this set, are the same on every rank) are what it
can still fetch; after the all-gather that fetches the last of them, and from
the prologue where there is none, every position. DeepSpeed's fetches change
once its module trace is complete (step 1: prefetch along the trace, and
parameters kept gathered from the forward to their backward under
`stage3_max_reuse_distance`), so the learned table, from a backward that
fetched more, would otherwise hold that backward's gradients to its epilogue.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch

from accord.deepspeed.turns import Turns


class Zero3Turns(Turns):
    """Turns placed among ZeRO-3's all-gathers. Training thread and
    autograd's (one at a time)."""

    def __init__(self, inst):
        self.expected: Optional[int] = None  # all-gathers of the learned backward
        self.learned_key: Optional[tuple] = None
        self.fetched: Dict[int, object] = {}  # id -> every parameter a backward all-gathered
        super().__init__(inst)

    def reset(self) -> None:
        super().reset()
        self.gathers = 0  # all-gathers of this backward so far
        self.pending = -1  # nothing learned: the cap the all-gathers so far allow
        self.key: tuple = ()  # this backward's all-gathers, by DeepSpeed's parameter ids
        self.in_backward = False  # from the backward's prologue to its epilogue
        self.arrival: Dict[int, int] = {}  # parameter index -> all-gathers before it came
        self.hooks_ran = {}
        self.unfetched: set = set()  # ids of what this backward can still all-gather
        self.tail = False  # every position, from now to the epilogue

    def hook(self) -> None:
        super().hook()
        self.zero.on_backward(self.reset_gathers)
        if self.zero.fetches_nothing(self.inst.engine.module):
            self.expected, self.caps = 0, []  # all tail, from the first backward

    def reset_gathers(self) -> None:
        """The backward begins (after the forward's all-gathers, on every rank)."""
        self.gathers, self.pending, self.key = 0, -1, ()
        self.in_backward = True
        self.unfetched = {id(p) for p, _ in self.zero.to_gather(self.fetched.values())}
        self.tail = self.expected is not None and not self.unfetched

    # ------------------------------------------------------------ the cap

    def cap(self) -> int:
        n = len(self.release)
        if self.tail:
            return n - 1
        if self.expected is None:
            return min(self.pending, n - 1)
        if self.gathers >= self.expected:
            return n - 1  # the tail
        return self.caps[self.gathers]

    def before_all_gather(self, gathered) -> None:
        """Just before DeepSpeed issues an all-gather of `gathered`
        ((parameter, numel) pairs) in a reducing backward: the turns
        through the cap, then the count."""
        if not self.in_backward or not self.zero.reduces_now():
            return
        self.key += (self.zero.gather_key(gathered),)
        if self.expected is None:  # the first backward: the module fetched is next
            ks = [self.index[id(p)] for p, _ in gathered if id(p) in self.index]
            if ks:
                self.pending = max(self.pending, min(self.position[k] for k in ks) - 1)
        self.through(self.cap())
        self.gathers += 1
        for p, _ in gathered:
            self.fetched[id(p)] = p
            self.unfetched.discard(id(p))
        self.tail = self.tail or (self.expected is not None and not self.unfetched)
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
        if self.inst.window_closed:  # DeepSpeed copies, not adds, what it reduces now
            for k, (_, p) in enumerate(self.inst.order):
                if not self.speculated[k]:  # not reduced now: a stale value from before
                    self.zero.clear_partition(p)
        return super().end()

    def relearn(self, late_anywhere: List[bool]) -> bool:
        return (not self.learned or self.key != self.learned_key or any(late_anywhere))

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
