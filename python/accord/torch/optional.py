"""Units whose forward runs on some ranks only (docs/PARTICIPATION.md).

An optional unit is all-gathered by every rank at one fixed point (right
after the root's pre-forward) and kept unsharded until the end of the
backward, so running it 0, 1 or 2 times issues the same collectives; it is
left out of FSDP2's record of the forward order, so the other units' backward
prefetch is the same on every rank. Its reduce-scatter is released with every
other group's (accord.torch.release). The guard's learner also lives
here: units that diverged at every rank's first forward all-gather become
optional units on every rank.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Dict, List, Optional, Sequence, Tuple

from accord.torch import fsdp2
from accord.torch import members as member_sets
from accord.torch.errors import waited


@dataclasses.dataclass
class UnitParticipation:
    """How often this rank ran one optional unit's forward, per step."""

    steps: int = 0
    skipped: int = 0  # steps with no forward call
    ran: int = 0  # steps with exactly one
    repeated: int = 0  # steps with two or more
    calls_this_step: int = 0


class ParticipationReporter:
    """Reports, per step, whether this rank ran one optional unit, through a
    group of its own (`<prefix>/~participation/<unit>`, "parameters" `ran`
    and `repeated`): the coordinator's skip matrix of that group is the
    unit x rank participation matrix. Submitted without waiting; the previous
    step's decision is collected at the next report."""

    PARAMS = [("ran", 1, 1), ("repeated", 1, 1)]

    def __init__(self, agreement, group_id: str, members: Optional[tuple] = None):
        self.agreement = agreement
        self.group_id = group_id
        self.members = members  # the unit's member set (None: every rank)
        self.previous = None

    def registration(self) -> tuple:
        reg = (self.group_id, self.PARAMS, None, False)
        return reg if self.members is None else reg + (list(self.members),)

    @staticmethod
    def manifest(calls: int) -> list:
        return ["float32" if calls >= 1 else None, "float32" if calls >= 2 else None]

    def item(self, step: int, calls: int):
        """The batch item of this step (submitted with the release's batch);
        the previous step's decision, long since there, is collected first."""
        if self.previous is not None:
            waited(self.agreement, self.previous,
                   "accord.torch: learned from the optional units' decision of the previous step")
            self.previous = None
        return (self.group_id, step, self.manifest(calls))

    def handed(self, handle) -> None:
        self.previous = handle


class OptionalUnit:
    """One optional FSDP unit. Pinned (unsharded by accord) from the root's
    pre-forward to the end of the backward; while pinned, FSDP2's own reshards
    after forward and after backward do nothing. Training thread only."""

    def __init__(self, name: str, module, groups: list, reporter=None,
                 step_open=lambda: False):
        self.name = name
        self.module = module
        self.groups = groups
        self.reporter = reporter
        self.pinned = False
        self.reported = False  # this step's participation went with the release
        self.participation = UnitParticipation()
        for g in groups:

            def reshard(original, g=g):
                if self.pinned:
                    # Kept unsharded until end_step: within FSDP2's forward
                    # and post-backward, and between a schedule's microbatches.
                    if fsdp2.in_step(g) or step_open():
                        return None
                    self.pinned = False  # an explicit reshard (state_dict, .to())
                return original()

            fsdp2.override_reshard(g, reshard)
        self._handle = module.register_forward_pre_hook(self._count)

    def _count(self, module, args):
        self.participation.calls_this_step += 1

    def release_item(self) -> Optional[tuple]:
        """This step's participation item, once per step (None: already
        given, or no reporter)."""
        if self.reporter is None or self.reported:
            return None
        self.reported = True
        p = self.participation
        return self.reporter.item(p.steps, p.calls_this_step)

    def begin_step(self) -> None:
        if self.pinned:  # a forward without backward left it pinned
            self.end_step(count=False)
        self.module.unshard()  # one all-gather, on every rank, at the same place
        self.pinned = True

    def end_step(self, count: bool = True) -> None:
        self.pinned = False
        for g in self.groups:
            fsdp2.reshard(g)
        p = self.participation
        self.reported = False
        if count:
            p.steps += 1
            if p.calls_this_step == 0:
                p.skipped += 1
            elif p.calls_this_step == 1:
                p.ran += 1
            else:
                p.repeated += 1
        p.calls_this_step = 0

    def remove(self) -> None:
        if self.pinned:
            self.end_step(count=False)
        self._handle.remove()
        for g in self.groups:
            fsdp2.restore_reshard(g)


class OptionalUnits:
    """The installation's optional units, their step hooks on the root, and
    the guard's learner. Training thread, except can_learn (pure)."""

    def __init__(self, installation, units: Sequence[Tuple[str, object]] = ()):
        self.inst = installation
        self.units: List[OptionalUnit] = []  # given or learned, in the order added
        self.learned: List[str] = []  # names of the units the guard made optional
        self._order: Dict[str, int] = {}
        self._handles: list = []  # the root's step hooks, once a unit is added
        # Units that may become optional: every FSDP unit below the root with
        # one group, by module path, in module order.
        for i, (name, module) in enumerate(installation.model.named_modules()):
            if name and fsdp2.is_fsdp_module(module) and len(fsdp2.param_groups(module)) == 1:
                self._order.setdefault(name, i)
        for name, module in units:
            self.add(name, module)

    def add(self, name: str, module, register_now: bool = False) -> OptionalUnit:
        inst = self.inst
        groups = fsdp2.param_groups(module)
        hooked = [h for h in inst.groups.values() if any(h.group is g for g in groups)]
        _one_member_set(name, hooked, inst.agreement.world_size)
        reporter = None
        if callable(getattr(inst.agreement, "submit_async", None)):
            # Agreed among the ranks that reduce the unit: under expert
            # parallel the same path is another module on another EP
            # coordinate, and a learned unit registers on its members only.
            mine = member_sets.union([h.members for h in hooked], inst.agreement.world_size) \
                if hooked else inst.members
            reporter = ParticipationReporter(
                inst.agreement, f"{inst.prefix}/~participation/{name}{member_sets.tag(mine)}",
                mine)
            if register_now:
                inst.agreement.register(*reporter.registration())
        steps = inst.steps
        unit = OptionalUnit(name, module, groups, reporter, step_open=lambda: steps.open)
        self.units.append(unit)
        if not self._handles:
            # After FSDP2's root pre-forward (its hook is prepended; this one
            # is appended), before any other unit's all-gather.
            self._handles = [inst.model.register_forward_pre_hook(self._begin_step),
                             inst.model.register_forward_hook(self._after_forward)]
        return unit

    def registrations(self) -> List[tuple]:
        return [u.reporter.registration() for u in self.units if u.reporter]

    def release_items(self) -> list:
        """(item, reporter) per optional unit with a reporter: whether this
        rank ran it in this step (its step: the unit's count of steps, which
        is the release's step when every backward releases), for the
        release's batch."""
        return [(item, u.reporter) for u in self.units
                if (item := u.release_item()) is not None]

    def _report_rest(self) -> None:
        """Steps that ended without a release (accumulation microbatches, a
        forward under no_grad) report on their own."""
        for item, reporter in self.release_items():
            reporter.handed(self.inst.agreement.submit_async(*item))

    def _begin_step(self, module, args):
        if fsdp2.in_backward() or self.inst.steps.continues():
            return None  # recomputation inside backward; a schedule's later microbatch
        for unit in self.units:
            unit.begin_step()
        return None

    def _after_forward(self, module, args, output):
        import torch

        if not torch.is_grad_enabled():  # no backward will follow
            self.inst.steps.close()
            self.end_step()
        return None

    def end_step(self) -> None:
        self._report_rest()
        for unit in self.units:
            unit.end_step()

    def remove(self) -> None:
        for unit in self.units:
            unit.remove()
        self.units.clear()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # The guard's learner (accord.torch.guard.SequenceGuard.record).
    def can_learn(self, units: List[str]) -> Optional[List[str]]:
        """Background thread; pure. The unit to pin: the first of `units` in
        module order, or None when one of them cannot be made optional (the
        root, a grouped unit, one already optional)."""
        optional = {o.name for o in self.units}
        if any(u not in self._order or u in optional for u in units):
            return None
        return [min(units, key=self._order.__getitem__)]

    def learn(self, units: List[str], current: Optional[str]) -> bool:
        """Training thread: pins each unit (one all-gather each, in order, on
        every rank); returns whether the collective about to be issued (an
        all-gather of `current`) is now done."""
        for name in units:
            unit = self.add(name, self.inst.model.get_submodule(name), register_now=True)
            # A rank may hold it unsharded already (a schedule's UNSHARD,
            # never resharded where its forward did not run): resharded
            # first, so every rank issues the one all-gather.
            for g in unit.groups:
                fsdp2.reshard(g)
            unit.begin_step()
            self.learned.append(name)
            warnings.warn(
                f"accord: FSDP unit '{name}' ran its forward on some ranks only; accord made it "
                f"an optional unit (all-gathered on every rank at each step). Pass "
                f"optional=[...] to accord.torch.install to say so up front",
                stacklevel=2)
        return current in units


def _one_member_set(name: str, hooked: list, world_size: int) -> None:
    """An optional unit's participation is agreed among one member set
    (docs/MEMBERS.md 2.12): a unit whose FSDP groups are reduced by
    different ranks (a per-parameter mesh, shard_placement_fn) is refused,
    naming the unit and its groups' member sets."""
    sets: Dict[object, str] = {}
    for h in hooked:
        sets.setdefault(h.members, h.group_id)
    if len(sets) < 2:
        return
    said = "; ".join(
        f"group '{gid}' by {'every rank' if m is None else 'ranks ' + str(list(m))}"
        for m, gid in sets.items())
    raise ValueError(
        f"accord.torch.install: optional unit '{name}' spans {len(sets)} member sets of the "
        f"job of {world_size} ranks ({said}); an optional unit's participation is agreed "
        f"among one member set: shard the parameters on each mesh in a unit of their own "
        f"(fully_shard on a submodule) and mark those units optional")


def resolve(model, optional) -> List[Tuple[str, object]]:
    """(path, module) of each optional unit, checked; raises ValueError."""
    import torch

    if isinstance(optional, (str, torch.nn.Module)):
        optional = [optional]
    names = {id(m): n for n, m in model.named_modules()}
    out: List[Tuple[str, object]] = []
    for item in optional:
        if isinstance(item, str):
            try:
                module = model.get_submodule(item)
            except AttributeError as e:
                raise ValueError(f"accord.torch.install: optional unit {item!r} is not a "
                                 f"submodule of the model ({e})") from None
            name = item
        elif isinstance(item, torch.nn.Module):
            if id(item) not in names:
                raise ValueError(f"accord.torch.install: optional unit {type(item).__name__} "
                                 f"is not a submodule of the model")
            module, name = item, names[id(item)]
        else:
            raise TypeError(f"accord.torch.install: optional takes modules or module paths, "
                            f"got {type(item).__name__}")
        if module is model:
            raise ValueError("accord.torch.install: the root module cannot be optional (every "
                             "rank runs the root's forward)")
        if not fsdp2.is_fsdp_module(module):
            raise ValueError(
                f"accord.torch.install: optional unit '{name}' ({type(module).__name__}) is "
                f"not an FSDP unit; call fully_shard on it (before fully_shard on the model) "
                f"so that it has its own all-gather and reduce-scatter")
        if any(m is module for _, m in out):
            continue
        out.append((name, module))
    if out and not fsdp2.is_fsdp_module(model):
        raise ValueError("accord.torch.install: optional units need the model itself to be an "
                         "FSDP unit (call fully_shard(model) after sharding its submodules)")
    return out
