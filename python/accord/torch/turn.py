"""One group's step as accord.torch records it: the turn (what a group's
reduce-scatter carried before its decision), the group's counts, and the
names of torch dtypes on the wire."""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional

import torch

from accord.torch.plan import Layout

DTYPE_NAMES = {d: str(d).replace("torch.", "") for d in (
    torch.float64, torch.float32, torch.bfloat16, torch.float16)}


def dtype_name(dtype: torch.dtype) -> str:
    """accord's name of a torch dtype ('torch.bfloat16' -> 'bfloat16')."""
    name = DTYPE_NAMES.get(dtype)
    return name if name is not None else str(dtype).replace("torch.", "")


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
    speculated: int = 0  # turns that carried the previous decision's layout
    repaired: int = 0  # steps that needed a trim or a delta
    late: int = 0  # steps whose gradient came after the group's turn on this rank
    late_bytes: int = 0  # bytes of those gradients, held to the end of the backward
    owed_bytes: int = 0  # bytes of gradients the turn's layout left out, held likewise


@dataclasses.dataclass
class Turn:
    """A group's step from its turn to its completion. Holds no sharded
    gradient: `was_none` answers a trim, `owed` keeps only gradients the
    turn's layout left out."""

    step: int
    applied: Optional[Layout]  # None: nothing was reduce-scattered at the turn
    # Per parameter, whether its sharded gradient was None before the turn;
    # None when the turn carried exactly this rank's gradients (then no
    # parameter it carried can be trimmed: this rank used each of them).
    was_none: Optional[List[bool]]
    dtypes: List[Optional[str]]  # this rank's gradients sent at the turn
    owed: Dict[int, torch.Tensor]
    late: bool = False  # the gradient was not there at the turn
    steady: bool = False  # the layout was exactly this rank's gradients, in one dtype
    in_backward: bool = False  # the turn came before the end-of-backward point
    sent_bytes: int = 0  # this rank's gradient bytes the turn carried
