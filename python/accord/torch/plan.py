"""The pure parts of accord.torch's reduce path: which decision a group
applies, and how a speculative reduce-scatter is repaired. No torch, no I/O;
every rank computes the same answer from the same decisions, which is what
keeps their collectives identical (docs/PARTICIPATION.md, "One order" and
"Speculative decisions").
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence

NONE = "none"  # the speculative reduce-scatter was exact
TRIM = "trim"  # parameters reduced as zeros everywhere lose their gradient again
REDO = "redo"  # the group is reduce-scattered again with the real decision


@dataclasses.dataclass(frozen=True)
class Layout:
    """What a decision makes a reduce-scatter carry: which parameters, and
    the wire dtype."""

    included: tuple
    wire_dtype: str

    @staticmethod
    def of(decision) -> "Layout":
        return Layout(tuple(bool(x) for x in decision.included), str(decision.wire_dtype))


@dataclasses.dataclass
class Repair:
    kind: str
    trimmed: List[int] = dataclasses.field(default_factory=list)  # for TRIM


def plan_repair(applied: Layout, real: Layout) -> Repair:
    """How to turn the reduce-scatter of `applied` into that of `real`.

    TRIM when `real` only leaves out parameters `applied` carried, in the same
    dtype: `real` leaves a parameter out exactly when no rank had a gradient
    for it, so every rank sent zeros for it and the other parameters' sums are
    already right; only those parameters' gradients go back to what they were
    before (None). Anything else (a parameter `applied` left out that a rank
    had a gradient for, another wire dtype) is a REDO.
    """
    if len(applied.included) != len(real.included):
        return Repair(REDO)
    if applied == real:
        return Repair(NONE)
    if applied.wire_dtype != real.wire_dtype:
        return Repair(REDO)
    if any(r and not a for a, r in zip(applied.included, real.included)):
        return Repair(REDO)
    return Repair(TRIM, [i for i, (a, r) in enumerate(zip(applied.included, real.included))
                         if a and not r])


@dataclasses.dataclass
class History:
    """One group's past decisions, identical on every rank."""

    last: Optional[Layout] = None
    repaired_last: bool = False


def speculates(history: History, enabled: bool) -> bool:
    """Whether this group applies its previous decision without waiting.
    Only the group's history decides, so every rank answers the same: a group
    with a decision whose last step needed no repair. A group whose usage
    keeps changing alternates: one repaired step, one blocking step."""
    return enabled and history.last is not None and not history.repaired_last


def fits(layout: Layout, local_dtypes: Sequence[Optional[str]], join) -> bool:
    """Whether this rank's manifest fits `layout`: each parameter with a local
    gradient is included, and its dtype joined with the wire dtype is the
    wire dtype. For counting only; the real decision decides repairs."""
    for inc, dt in zip(layout.included, local_dtypes):
        if dt is None:
            continue
        if not inc or join(dt, layout.wire_dtype) != layout.wire_dtype:
            return False
    return True
