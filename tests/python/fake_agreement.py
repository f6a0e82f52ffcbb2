"""A test-only stand-in for the accord daemons: FakeGlooAgreement.

It gathers every rank's manifest over a separate Gloo group and runs accord's
own Decide (core/decide.h, through the bindings) on each rank. It exists to
unit-test the FSDP2 hooking without daemons; the shipped FSDP2 tests use the
real client and daemons (ClientAgreement).
"""

import torch.distributed as dist

from accord import _accord


class FakeGlooAgreement:
    def __init__(self, group=None):
        self.group = group if group is not None else dist.new_group(backend="gloo")
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.specs = {}

    def register(self, group_id, params, reduce_dtype, reduce_dtype_exact, members=None):
        if members is not None:
            raise _accord.Error(f"UNIMPLEMENTED: group {group_id}: FakeGlooAgreement agrees "
                                f"among every rank only, not members {list(members)}")
        mine = (group_id, list(params), reduce_dtype, reduce_dtype_exact)
        everyone = [None] * self.world_size
        dist.all_gather_object(everyone, mine, group=self.group)
        for r, theirs in enumerate(everyone):
            if theirs != mine:
                raise _accord.Error(
                    f"FAILED_PRECONDITION: group {group_id}: rank {r} registered {theirs}, "
                    f"rank {self.rank} registered {mine}"
                )
        self.specs[group_id] = mine

    def submit(self, group_id, step, dtypes):
        _, params, reduce_dtype, exact = self.specs[group_id]
        everyone = [None] * self.world_size
        dist.all_gather_object(everyone, (step, list(dtypes)), group=self.group)
        for r, (s, _) in enumerate(everyone):
            if s != step:
                raise _accord.Error(f"FAILED_PRECONDITION: group {group_id}: rank {r} at step {s}")
        return _accord.decide(
            group_id, params, step, [d for _, d in everyone], reduce_dtype, exact
        )
