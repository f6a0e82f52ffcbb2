"""The Installation: accord hooked into one FSDP2 model (install() in
accord.torch.entry builds it).

Every group's reduce-scatter goes out during the backward, at a turn whose
position among the backward's all-gathers is the same on every rank
(accord.torch.release); the step's manifests go up as one batch at the
end-of-backward point (accord.torch.negotiation), and each group is
completed there once its decision is in (docs/PARTICIPATION.md, "One order
during the backward").
"""

from __future__ import annotations

import threading
import warnings
from typing import Optional, Sequence

import accord
from accord.torch import checks, configs, fsdp2, jobwatch, members
from accord.torch.all_gathers import Routes
from accord.torch.hooking import find_groups, hook_groups
from accord.torch.negotiation import Negotiation, NegotiationTiming
from accord.torch.optional import OptionalUnits
from accord.torch.release import Release
from accord.torch.steps import StageRoute, StepBounds
from accord.torch.windows import microbatch_record, other_stage_record


class Installation:
    """accord hooked into one FSDP2 model, built complete by the constructor
    (every hook installed; nothing sent yet: register() does that). Owned
    by the training thread; uninstall() may come from any thread."""

    def __init__(self, model, agreement, *, prefix: str, speculate: bool, optional: Sequence,
                 guard: bool, learn_optional: bool, watch: bool, timeout_s: float):
        self.model = model
        self.agreement = agreement
        self.rank = agreement.rank
        self.speculate = speculate
        self.asked_prefix = prefix
        self.prefix = prefix  # the one taken from members.PREFIXES once hooked
        self._taken: Optional[str] = None  # the prefix taken from members.PREFIXES
        # The ranks this installation's checks are agreed among: every rank
        # that reduces one of its groups (None: every rank of the job).
        self.members: members.Members = None
        self.timing = NegotiationTiming()
        self.steps = StepBounds()  # whether a step is open; a schedule's microbatch
        self.current: Optional[Release] = None  # this backward's release
        # All-gathers in the last backward that reduced (none yet: None). A
        # member set of one rank has none, ever: FSDP2 does not all-gather at
        # W = 1.
        self.backward_all_gathers: Optional[int] = None
        self.release_index = 0  # releases so far: the step of the batch's other items
        self.groups: dict = {}  # group id -> HookedGroup, install order
        self.units: Optional[OptionalUnits] = None  # optional units, given or learned
        self.guard = None  # accord.torch.guard.SequenceGuard (GuardSet: several member sets)
        self.watch = None  # accord.torch.watchdog.StepWatch
        self.job = None  # accord.torch.jobitem.JobItem: `~job`, with members
        self.negotiation: Optional[Negotiation] = None
        self._handles: list = []  # each has remove(): routes, setter checks, the stage route
        self._patched_states: list = []  # FSDP states whose final callback is wrapped
        self._lock = threading.Lock()
        self._fsdp_root = next((m for m in model.modules() if fsdp2.is_fsdp_module(m)), None)
        try:
            self._hook(optional, guard, learn_optional, watch, timeout_s)
        except BaseException:
            self.uninstall()
            raise

    def _hook(self, optional: Sequence, guard: bool, learn: bool, watch: bool,
              timeout_s: float) -> None:
        """The constructor's parts, in order: the groups and their member
        sets, the optional units, the checks (with an accord client: `~job`
        with members; the guard and the step watch with several members),
        the negotiation,
        then every hook. Whatever is built when one raises is what
        uninstall() removes."""
        found = find_groups(self.model, self.agreement)
        self.members = members.union([m for *_, m in found], self.agreement.world_size)
        self.prefix = self._taken = members.PREFIXES.take(self.asked_prefix, self.members)
        self.groups = hook_groups(self, found, self.prefix)
        if self.member_count == 1:
            self.backward_all_gathers = 0
        configs.refuse_post_accumulate_grad_hooks(self.groups.values(), "at install")
        self.units = OptionalUnits(self, optional)
        if getattr(self.agreement, "client", None) is not None:
            if guard and self.member_count > 1:
                self.guard = checks.sequence_guard(self, timeout_s, learn)
            if watch:
                self.job = checks.job_item(self, timeout_s)
                if self.member_count > 1:
                    self.watch = checks.step_watch(self, timeout_s)
        self.negotiation = Negotiation(self.agreement, self.prefix, self.groups, self.timing,
                                       self.units, self.guard, self.watch, self.members)
        self._handles.append(Routes(self))
        self._handles.extend(configs.watch(self))
        self._handles.append(StageRoute(self))
        self._hook_states()

    @property
    def member_count(self) -> int:
        return members.count(self.members, self.agreement.world_size)

    def item_id(self, name: str) -> str:
        """The id of one of this installation's own groups (`~late`, ...),
        tagged with its member set."""
        return f"{self.prefix}/{name}{members.tag(self.members)}"

    def _hook_states(self) -> None:
        for module in self.model.modules():
            if fsdp2.is_fsdp_module(module):
                state = fsdp2.state_of(module)
                if fsdp2.wrap_final_callback(state, self.final_callback):
                    self._patched_states.append(state)

    def register(self) -> None:
        """Registers every group and check with the agreement, in one batch."""
        self.negotiation.register()

    @property
    def overlap(self) -> bool:
        """Deprecated name of `speculate`."""
        warnings.warn("accord.torch: Installation.overlap is now Installation.speculate",
                      DeprecationWarning, stacklevel=2)
        return self.speculate

    @property
    def release_order(self) -> list:
        """The order of every release: install order reversed (so the root,
        installed first, goes last), which is the order autograd runs a
        sequential model's post-backwards in; any order that every rank
        computes alike would be correct."""
        return list(reversed(self.groups.values()))

    @property
    def stats(self) -> dict:
        """Group id -> GroupStats."""
        return {gid: h.stats for gid, h in self.groups.items()}

    @property
    def optional(self) -> list:
        """OptionalUnit, given or learned, in the order added (none once
        uninstalled)."""
        return self.units.units if self.units is not None else []

    @property
    def learned(self) -> list:
        """Names of the units the guard made optional."""
        return self.units.learned if self.units is not None else []

    @property
    def participation(self) -> dict:
        """Per optional unit (module path): this rank's forward calls per step."""
        return {u.name: u.participation for u in self.optional}

    # ------------------------------------------------------------ FSDP2's events

    def backward(self) -> Release:
        """This backward's release, begun at its first event."""
        if self.current is None:
            release = Release(self, self.release_order, self.backward_all_gathers)
            configs.refuse_post_accumulate_grad_hooks(release.order, "seen at a backward")
            self.current = release
        return self.current

    def released(self, all_gathers: int) -> int:
        """A backward that reduces is at its end-of-backward point after
        `all_gathers` all-gathers: counted, and its release index (the step
        of the batch's other items) returned."""
        self.timing.releases += 1
        self.backward_all_gathers = all_gathers
        index, self.release_index = self.release_index, self.release_index + 1
        return index

    def release_now(self) -> Optional[Release]:
        """This backward's release inside an autograd graph task; None
        outside one (a forward, FSDP2's lazy init): the release points
        before and after an all-gather and at a pre-backward."""
        if not fsdp2.in_backward():
            return None
        return self.current if self.current is not None else self.backward()

    def record_reduce(self, entry: str, group=None) -> None:
        """A reduce-scatter of FSDP2 parameter group `group` about to go out."""
        self.progress()
        if self.watch is not None:
            self.watch.progress(entry)
        if self.guard is not None:
            self.guard.record(entry, None, group)

    def progress(self) -> None:
        """The training thread is at an accord point: `~job`'s watch sees no
        stall (a member set of one rank has no step watch to tell)."""
        if self.job is not None:
            self.job.progress()

    def explain(self, failure: BaseException) -> None:
        """A collective failed: the guard's divergence or the watch's named
        peer failure replaces the collective's own error, when known."""
        if self.watch is not None:
            self.watch.explain(failure)
        if self.guard is not None:
            self.guard.explain(failure)

    def final_callback(self, original):
        """FSDP2's end-of-backward callback, with accord's release first."""

        def callback():
            self.progress()
            release = self.backward()
            last = fsdp2.is_last_backward(self._fsdp_root)
            try:
                release.finish()
                original()
            finally:
                release.end()
                self.current = None
                if last:  # the step's end (every backward, without a schedule)
                    self.steps.close()
                    if self.units is not None:
                        self.units.end_step()
                    if self.watch is not None:
                        self.watch.end_step()
                    if self.job is not None:
                        self.job.end_step()  # outside a schedule: `~job`'s step ends

        return callback

    def microbatch(self, chunk: int, stage: Optional[int] = None):
        """A context manager around a pipeline schedule's forward of
        microbatch `chunk` of the schedule's stage `stage` (its index: part
        of the release's sync_key)."""
        self.progress()
        self.negotiation.at_stage(stage)
        return self.steps.microbatch(chunk)

    def other_stage_forward(self, chunk: int, stage: Optional[int]) -> None:
        """Another stage module's forward of microbatch `chunk` on this rank
        (a schedule with several stages per rank): recorded by the guard,
        where a rank that skipped one of this module's units in its last
        forward meets the other ranks' all-gather of it (the unit is
        learned there; docs/PARTICIPATION.md, "Pipeline schedules")."""
        if self.guard is not None:
            self.guard.record(other_stage_record(chunk, stage))

    def schedule_step(self):
        """A context manager around a pipeline schedule's step() that drives
        this module (accord.torch.jobwatch.schedule_step)."""
        return jobwatch.schedule_step(self)

    def refuse_split_backward(self) -> None:
        """A schedule that splits this stage's backward into input and weight
        passes (at its step(), or at a weight-only backward): refused."""
        raise configs.split_backward_error()

    def begin_step(self) -> None:
        """The root's pre-forward outside the backward: a release left by a
        backward that never reached its end (it raised) is dropped, and the
        guard and the watch hear of the step's start."""
        if fsdp2.in_backward():
            return  # recomputation inside the backward (activation checkpointing)
        self.progress()
        if self.steps.continues():
            if self.guard is not None:
                self.guard.record(microbatch_record(self.steps.chunk))
            return
        self.steps.begin()
        if self.current is not None:
            self.current.end()
            self.current = None
        if self.watch is not None:
            self.watch.begin_step(self.release_index)
        if self.job is not None:
            self.job.begin_step()  # outside a schedule: `~job`'s step opens
        if self.guard is not None:
            self.guard.begin_step()

    # ------------------------------------------------------------ the end

    def uninstall(self) -> None:
        """Restores everything accord changed in FSDP2 and in the model."""
        with self._lock:
            if self.negotiation is not None:
                try:
                    self.negotiation.report(final=True)
                except accord.Error:
                    pass  # the client is closed: its sidecar keeps what it was sent
            for handle in self._handles:
                handle.remove()
            self._handles.clear()
            if self.job is not None:
                self.job.end_step()  # a step left open (a forward without a backward)
            if self.units is not None:
                self.units.remove()  # its learned units stay listed
            for part in ("guard", "watch"):
                if getattr(self, part) is not None:
                    getattr(self, part).close()
                    setattr(self, part, None)
            for state in self._patched_states:
                fsdp2.unwrap_final_callback(state)
            self._patched_states.clear()
            for h in self.groups.values():
                h.unhook()
            self.groups.clear()
            if self._taken is not None:
                members.PREFIXES.give_back(self.asked_prefix, self.members, self._taken)
                self._taken = None
            self.model.__dict__.pop("_accord_installation", None)
