"""One collective-sequence guard per member set of an installation whose
groups have several (docs/MEMBERS.md 2.12): expert parallel with per-module
experts, where each EP coordinate's expert units are reduced by its
expert-data-parallel ranks and run on their own data, and the dense units by
every rank. Each group's collectives go to the guard of its member set,
agreed among those ranks only; the step's start and a schedule's
microbatch records go to every guard. An installation with one member set
keeps one accord.torch.guard.SequenceGuard."""

from __future__ import annotations

from typing import Callable, List, Optional

from accord.torch import members as member_sets


def member_sets_of(groups, world_size: int) -> list:
    """The distinct member sets of `groups` (HookedGroups), in install
    order, without those of one rank (FSDP2 issues no collective there)."""
    out = []
    for h in groups:
        if h.members not in out and member_sets.count(h.members, world_size) > 1:
            out.append(h.members)
    return out


def parts(guard) -> list:
    """The SequenceGuards of an installation's guard (None: none)."""
    if guard is None:
        return []
    return guard.parts if isinstance(guard, GuardSet) else [guard]


class GuardSet:
    """SequenceGuard's interface over one guard per member set; `make(members)`
    builds one."""

    def __init__(self, make: Callable[[member_sets.Members], object], groups, sets: list):
        self.parts = [make(m) for m in sets]
        by_set = dict(zip(sets, self.parts))
        self._by_group = {id(h.group): by_set[h.members] for h in groups if h.members in by_set}
        self.learner = self.parts[0].learner

    def record(self, entry: str, unit: Optional[str] = None, group=None) -> bool:
        """The collective of FSDP2 parameter group `group` to its set's guard
        (True: not to be issued, see SequenceGuard.record); without a group
        (a microbatch's start) to every guard."""
        if group is None:
            for part in self.parts:
                part.record(entry)
            return False
        part = self._by_group.get(id(group))
        return part is not None and part.record(entry, unit, group)

    def begin_step(self) -> None:
        for part in self.parts:
            part.begin_step()

    def registrations(self) -> List[tuple]:
        return [r for part in self.parts for r in part.registrations()]

    def registered(self) -> None:
        for part in self.parts:
            part.registered()

    def explain(self, failure: BaseException) -> None:
        for part in self.parts:
            part.explain(failure)

    def close(self) -> None:
        for part in self.parts:
            part.close()
