"""The pure parts of accord.torch's reduce path: where each group's
reduce-scatter goes in the backward, which layout it carries, and how the
step is completed once the real decisions are in. No torch, no I/O; every
rank computes the same answer from the same inputs, which is what keeps
their collectives identical (docs/PARTICIPATION.md, "One order during the
backward").
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import List, Optional, Sequence


@dataclasses.dataclass(frozen=True)
class Layout:
    """What a reduce-scatter carries: which parameters, and the wire dtype."""

    included: tuple
    wire_dtype: str

    @staticmethod
    def of(decision) -> "Layout":
        return Layout(tuple(map(bool, decision.included)), str(decision.wire_dtype))

    def numel(self, sizes: Sequence[int]) -> int:
        return sum(itertools.compress(sizes, self.included))


@dataclasses.dataclass
class History:
    """One group's past decisions, identical on every rank."""

    last: Optional[Layout] = None
    # The last step's decision included a parameter its turn's layout left
    # out (some rank had a gradient the turn did not carry).
    grew_last: bool = False
    # Some rank was late for the group in its last step (or, its turn at the
    # end, would have been): its turn goes to the end-of-backward point.
    turn_at_end: bool = False


def turn_layout(history: History, trainable: Sequence[bool], wire: str,
                speculate: bool) -> Layout:
    """The layout a group's reduce-scatter carries at its turn in the
    backward, before this step's decision exists. From history alone, so
    every rank computes the same: the last decision when speculating and it
    did not grow; otherwise every trainable parameter (zeros cost bandwidth,
    not memory; the parameters used nowhere are trimmed afterwards). The wire
    dtype is the group's, fixed at install."""
    if speculate and history.last is not None and not history.grew_last:
        return Layout(history.last.included, wire)
    return Layout(tuple(bool(t) for t in trainable), wire)


@dataclasses.dataclass
class Completion:
    """What a group needs after its turn, once the real decision is in.

    `trimmed`: parameters the turn carried that no rank had a gradient for;
    their sharded gradient goes back to None where it was None before.
    `delta`: parameters reduce-scattered once more at the end of the
    backward, every rank contributing what it has not sent yet (zeros
    otherwise): all included parameters when some rank was late for the
    group, plus those the turn's layout left out and some rank used."""

    trimmed: List[int]
    delta: List[int]

    @property
    def exact(self) -> bool:
        return not self.trimmed and not self.delta


def complete(applied: Optional[Layout], real: Layout, late_somewhere: bool) -> Completion:
    """The completion of a group's step. `applied` is the turn's layout
    (None: the group had no turn, so nothing was sent)."""
    n = len(real.included)
    carried = applied.included if applied is not None else (False,) * n
    if len(carried) != n:
        raise ValueError(f"a layout of {len(carried)} parameters against a decision of {n}")
    trimmed = [i for i in range(n) if carried[i] and not real.included[i]]
    if late_somewhere:
        delta = [i for i in range(n) if real.included[i]]
    else:
        delta = [i for i in range(n) if real.included[i] and not carried[i]]
    return Completion(trimmed, delta)


class ReleaseSchedule:
    """Where each group's reduce-scatter goes in one backward.

    Groups are released in one order (index 0 first), each exactly once. The
    all-gathers are the only other FSDP2 collectives of the backward, and
    every rank issues the same ones in the same order (FSDP2 needs that; the
    guard checks it), so the rule below makes the prefix released before
    each all-gather a function of the all-gathers so far, never of where
    autograd ran a hook:

    - before any all-gather: release through `pending`, what earlier
      all-gathers allow; after the all-gather of group i: pending =
      max(pending, i - 1) (group i is about to run its backward; the group
      before it in release order is done once group i's pre-backward runs,
      in a sequential model);
    - at the pre-backward of group j: through min(pending, j - 1), and at
      its post-backward through min(pending, j) (FSDP2 prefetched the next
      unit before group j's compute, so in a sequential model group j's turn
      comes with its own post-backward); the next all-gather releases as
      much anyway on ranks where those hooks do not run. So on every rank the
      released prefix before an all-gather is `pending`, a function of the
      all-gathers alone;
    - the *tail*: after as many all-gathers as the previous backward had
      (`expected`, the same on every rank), each post-backward releases
      through its own group, whatever `pending`. No rule ties these to an all-gather, so an
      all-gather beyond `expected` first releases every group left, on
      every rank alike;
    - at the end of the backward: the rest.

    A group whose gradient is not there at its release is *late*: it sends
    zeros then and its gradient once more at the end (Completion.delta)."""

    def __init__(self, count: int, expected: Optional[int] = None):
        self.count = count
        self.expected = expected  # all-gathers of the previous backward
        self.all_gathers = 0
        self.released = 0  # groups [0, released) are released
        self.pending = -1

    @property
    def in_tail(self) -> bool:
        return self.expected is not None and self.all_gathers >= self.expected

    def before_all_gather(self, index: int) -> range:
        self.all_gathers += 1
        if self.expected is not None and self.all_gathers > self.expected:
            return self._through(self.count - 1)
        return self._through(self.pending)

    def after_all_gather(self, index: int) -> None:
        self.pending = max(self.pending, index - 1)

    def at_pre_backward(self, index: int) -> range:
        return self._through(min(self.pending, index - 1))

    def at_post_backward(self, index: int) -> range:
        return self._through(index if self.in_tail else min(self.pending, index))

    def at_end(self) -> range:
        return self._through(self.count - 1)

    def _through(self, last: int) -> range:
        last = min(last, self.count - 1)
        if last < self.released:
            return range(0)
        out = range(self.released, last + 1)
        self.released = last + 1
        return out
