"""The checks an installation builds besides its groups, for its member
sets: the collective-sequence guard (one per member set when its groups
have several, accord.torch.guards), the step watch (accord.torch.watchdog)
and the job-wide `~job` (accord.torch.jobwatch). Each is built by the
Installation's constructor or is absent (None)."""

from __future__ import annotations

import os
from typing import Optional

from accord.torch import fsdp2, jobwatch


def sequence_guard(installation, timeout_s: float, learn: bool):
    """The installation's collective-sequence guard: a SequenceGuard, or a
    GuardSet of one per member set of its groups when they have several."""
    from accord.torch.guard import SequenceGuard
    from accord.torch.guards import GuardSet, member_sets_of

    inst = installation
    agreement = inst.agreement

    def make(mine):
        return SequenceGuard(agreement.client, inst.rank, agreement.world_size,
                             f"{inst.prefix}/~collective-sequence", timeout_s,
                             learner=inst.units if learn else None,
                             in_forward=fsdp2.in_forward, members=mine)

    sets = member_sets_of(inst.groups.values(), agreement.world_size)
    if len(sets) > 1:
        return GuardSet(make, inst.groups.values(), sets)
    return make(inst.members)


def job_item(installation, timeout_s: float) -> Optional[jobwatch.JobItem]:
    """The client's `~job` for an installation with members (other member
    sets' ranks to hear from; None without, or when turned off): submitted
    each step when the member set is this rank alone (nobody of it would
    name this rank), else on a pipeline transfer's failure only."""
    if installation.members is None:
        return None
    return jobwatch.job_item(installation.agreement, installation.member_count == 1,
                             stall_s(), timeout_s)


def stall_s() -> float:
    """The watches' stall time: ACCORD_TORCH_STALL_S, else 1 s."""
    return float(os.environ.get("ACCORD_TORCH_STALL_S", "1.0"))


def step_watch(installation, timeout_s: float):
    """The installation's step watch, its item `~step` tagged with its
    member set; ACCORD_TORCH_STALL_S sets its stall time."""
    from accord.torch.watchdog import StepWatch

    return StepWatch(installation.agreement, installation.item_id("~step"), timeout_s,
                     stall_s=stall_s(), members=installation.members)
