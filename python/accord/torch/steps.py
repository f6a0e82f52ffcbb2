"""Where an installation's step begins and ends.

Without a pipeline schedule a step is one forward and its backward: it opens
at the root's pre-forward and closes at the end-of-backward point. Under a
schedule it spans every microbatch's forward and backward: it opens at
microbatch 0's forward and closes at the end-of-backward point of the last
backward (REDUCE_GRAD); the schedule tells the installation each
microbatch's forward through accord.torch.fsdp2.pipelining (`StageRoute`).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

from accord.torch import fsdp2


class StepBounds:
    """Whether a step is open, and which microbatch of a pipeline schedule is
    in its forward. Training thread only."""

    def __init__(self):
        self.open = False
        self.chunk: Optional[int] = None  # the schedule's microbatch now in its forward

    def continues(self) -> bool:
        """A root forward that continues the open step: a later microbatch
        of a pipeline schedule's step."""
        return self.open and self.chunk is not None and self.chunk > 0

    def begin(self) -> None:
        self.open = True

    def close(self) -> None:
        self.open = False

    @contextlib.contextmanager
    def microbatch(self, chunk: int) -> Iterator[None]:
        """Around a pipeline schedule's forward of microbatch `chunk`."""
        saved, self.chunk = self.chunk, chunk
        try:
            yield
        finally:
            self.chunk = saved


class StageRoute:
    """The installed module as a pipeline stage's submod: the schedule calls
    the installation's schedule_step(), microbatch() and
    refuse_split_backward() (accord.torch.fsdp2.pipelining.route_stage);
    remove() undoes it."""

    def __init__(self, installation):
        self.model = installation.model
        fsdp2.route_stage(self.model, installation)
        fsdp2.patch_stages()

    def remove(self) -> None:
        fsdp2.unroute_stage(self.model)
        fsdp2.unpatch_stages()
