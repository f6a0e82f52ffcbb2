"""install(), and the Installation it builds: accord hooked into one FSDP2
model.

Every group's reduce-scatter goes out during the backward, at a turn whose
position among the backward's all-gathers is the same on every rank
(accord.torch.release); the step's manifests go up as one batch at the
end-of-backward point (accord.torch.negotiation), and each group is
completed there once its decision is in (docs/PARTICIPATION.md, "One order
during the backward").
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from typing import Iterator, Optional, Sequence

import torch

import accord
from accord.agreement import as_agreement
from accord.torch import configs, fsdp2, jobwatch, members
from accord.torch.all_gathers import Routes
from accord.torch.hooking import find_groups, hook_groups
from accord.torch.negotiation import Negotiation, NegotiationTiming
from accord.torch.optional import OptionalUnits, resolve
from accord.torch.options import default_client, env_flag, speculate_flag
from accord.torch.release import Release
from accord.torch.transformers_capture import fix_transformers_output_capture
from accord.torch.windows import microbatch_record


class Installation:
    """accord hooked into one FSDP2 model, built complete by the constructor
    (every hook installed; nothing sent yet: register() does that). Owned
    by the training thread; uninstall() may come from any thread."""

    def __init__(self, model, agreement, *, prefix: str, speculate: bool, optional: Sequence,
                 guard: bool, learn_optional: bool, watch: bool, timeout_s: float):
        self.model = model
        self.agreement = agreement
        self.asked_prefix = prefix
        self.prefix = prefix
        self._taken: Optional[str] = None  # the prefix taken from members.PREFIXES
        # The ranks this installation's checks are agreed among: every rank
        # that reduces one of its groups (None: every rank of the job).
        self.members: members.Members = None
        self.rank = agreement.rank
        self.speculate = speculate
        self.timing = NegotiationTiming()
        self.current: Optional[Release] = None  # this backward's release
        # All-gathers in the last backward that reduced (none yet: None). A
        # member set of one rank has none, ever: FSDP2 does not all-gather at
        # W = 1.
        self.backward_all_gathers: Optional[int] = None
        self.release_index = 0  # releases so far: the step of the batch's other items
        self.optional: list = []  # OptionalUnit, given or learned, in the order added
        self.learned: list = []  # names of the units the guard made optional
        self.groups: dict = {}  # group id -> HookedGroup, install order
        self.units: Optional[OptionalUnits] = None
        self.guard = None  # accord.torch.guard.SequenceGuard
        self.watch = None  # accord.torch.watchdog.StepWatch
        self.job = None  # accord.torch.jobwatch.JobItem: `~job`, with members and a watch
        self.negotiation: Optional[Negotiation] = None
        self._handles: list = []  # each has remove(): routes, setter checks
        self._patched_states: list = []  # FSDP states whose final callback is wrapped
        self._lock = threading.Lock()
        # Under a pipeline schedule a step spans every microbatch's forward
        # and backward: it begins at microbatch 0's forward and ends at the
        # end-of-backward point of the last backward (REDUCE_GRAD).
        self.step_open = False
        self.chunk: Optional[int] = None  # the schedule's microbatch now in its forward
        self._fsdp_root = next((m for m in model.modules() if fsdp2.is_fsdp_module(m)), None)
        try:
            found = find_groups(model, agreement)
            self.members = members.union([m for *_, m in found], agreement.world_size)
            self.prefix = self._taken = members.PREFIXES.take(prefix, self.members)
            self.groups = hook_groups(self, found, self.prefix)
            if self.member_count == 1:
                self.backward_all_gathers = 0
            configs.refuse_post_accumulate_grad_hooks(self.groups.values(), "at install")
            self.units = OptionalUnits(self, optional)
            many = getattr(agreement, "client", None) is not None and self.member_count > 1
            if guard and many:
                self.guard = self._sequence_guard(timeout_s, learn_optional)
            if watch and many:
                self.watch = self._step_watch(timeout_s)
            self.negotiation = Negotiation(agreement, self.prefix, self.groups, self.timing,
                                           self.units, self.guard, self.watch, self.members)
            self._handles.append(Routes(self))
            self._handles.extend(configs.watch(self))
            self._handles.append(_Schedules(self))
            self._hook_states()
        except BaseException:
            self.uninstall()
            raise

    def _sequence_guard(self, timeout_s: float, learn: bool):
        """The collective-sequence guard: one per member set of the groups
        when they have several (accord.torch.guards)."""
        from accord.torch.guard import SequenceGuard
        from accord.torch.guards import GuardSet, member_sets_of

        def make(mine):
            return SequenceGuard(self.agreement.client, self.rank, self.agreement.world_size,
                                 f"{self.prefix}/~collective-sequence", timeout_s,
                                 learner=self.units if learn else None,
                                 in_forward=fsdp2.in_forward, members=mine)

        sets = member_sets_of(self.groups.values(), self.agreement.world_size)
        if len(sets) > 1:
            return GuardSet(make, self.groups.values(), sets)
        return make(self.members)

    def _step_watch(self, timeout_s: float):
        from accord.torch.watchdog import StepWatch

        stall_s = float(os.environ.get("ACCORD_TORCH_STALL_S", "1.0"))
        if self.members is not None:  # `~job`: other member sets' ranks to hear from
            self.job = jobwatch.job_item(self.agreement)
        return StepWatch(self.agreement, self.item_id("~step"), timeout_s, stall_s=stall_s,
                         members=self.members)

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

    def release_now(self) -> Optional[Release]:
        """This backward's release inside an autograd graph task; None
        outside one (a forward, FSDP2's lazy init): the release points
        before and after an all-gather and at a pre-backward."""
        if not fsdp2.in_backward():
            return None
        return self.current if self.current is not None else self.backward()

    def record_reduce(self, entry: str, group=None) -> None:
        """A reduce-scatter of FSDP2 parameter group `group` about to go out."""
        if self.watch is not None:
            self.watch.progress(entry)
        if self.guard is not None:
            self.guard.record(entry, None, group)

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
            release = self.backward()
            last = fsdp2.is_last_backward(self._fsdp_root)
            try:
                release.finish()
                original()
            finally:
                release.end()
                self.current = None
                if last:  # the step's end (every backward, without a schedule)
                    self.step_open = False
                    if self.units is not None:
                        self.units.end_step()
                    if self.watch is not None:
                        self.watch.end_step()

        return callback

    def continues_step(self) -> bool:
        """A root forward that continues the open step: a later microbatch
        of a pipeline schedule's step."""
        return self.step_open and self.chunk is not None and self.chunk > 0

    @contextlib.contextmanager
    def microbatch(self, chunk: int, stage: Optional[int] = None) -> Iterator[None]:
        """Around a pipeline schedule's forward of microbatch `chunk` of the
        schedule's stage `stage` (its index: part of the release's sync_key)."""
        self.negotiation.stage = stage
        saved, self.chunk = self.chunk, chunk
        try:
            yield
        finally:
            self.chunk = saved

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
        if self.continues_step():
            if self.guard is not None:
                self.guard.record(microbatch_record(self.chunk))
            return
        self.step_open = True
        if self.current is not None:
            self.current.end()
            self.current = None
        if self.watch is not None:
            self.watch.begin_step(self.release_index)
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
            if self.units is not None:
                self.units.remove()
                self.units = None
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


class _Schedules:
    """The installed module as a pipeline stage's submod: the schedule tells
    the installation each microbatch's forward and its weight-only
    backwards (accord.torch.fsdp2.pipelining)."""

    def __init__(self, installation):
        self.model = installation.model
        fsdp2.route_stage(self.model, installation)
        fsdp2.patch_stages()

    def remove(self) -> None:
        fsdp2.unroute_stage(self.model)
        fsdp2.unpatch_stages()


def _existing(model, client_or_agreement, units):
    existing = model.__dict__.get("_accord_installation")
    if existing is None:
        return None
    same = existing.agreement is client_or_agreement or getattr(
        existing.agreement, "client", None) is client_or_agreement or client_or_agreement is None
    if not same:
        raise ValueError("accord.torch.install: this model is already hooked with another "
                         "client; call installation.uninstall() first")
    if [m for _, m in units] != [u.module for u in existing.optional
                                 if u.name not in existing.learned]:
        raise ValueError("accord.torch.install: this model is already hooked with other "
                         "optional units; call installation.uninstall() first")
    return existing


def install(
    model: torch.nn.Module,
    client_or_agreement=None,
    *,
    prefix: str = "fsdp",
    timeout_s: float = 300.0,
    optional: Sequence = (),
    speculate: Optional[bool] = None,
    overlap: Optional[bool] = None,
    guard: Optional[bool] = None,
    learn_optional: Optional[bool] = None,
    watch: Optional[bool] = None,
) -> Installation:
    """Hooks FSDP2's reduce path of every FSDP parameter group in `model`.

    `client_or_agreement`: an accord client (accord.connect()), any
    accord.Agreement, or None for accord.connect() with its defaults (one
    per process: every stage module of a pipeline shares it). Each group is
    agreed among the ranks of its FSDP mesh (docs/MEMBERS.md). Call after
    fully_shard and before the model's first forward, on every rank.
    `optional`: FSDP units (modules or paths) whose forward may run a
    different number of times on different ranks. `speculate` (default on;
    ACCORD_TORCH_SPECULATE=0 turns it off; `overlap` is a deprecated name)
    applies each group's previous decision at once and repairs after the
    real one arrives. `guard` (default on with an accord client and more
    than one rank; ACCORD_TORCH_GUARD=0) checks that every rank issues the
    same FSDP collectives; with `learn_optional` (default on;
    ACCORD_TORCH_LEARN_OPTIONAL=0) a unit whose forward runs on some ranks
    only from its first step becomes optional instead of an error. `watch`
    (default on with an accord client and more than one rank;
    ACCORD_TORCH_WATCH=0) names a rank that stops or dies mid-step on every
    other rank within the coordinator's deadline (accord.torch.watchdog).
    Idempotent for the same client and units; raises ValueError for another,
    UnsupportedTorchError for a torch whose FSDP2 accord.torch cannot hook,
    and accord.torch.configs.UnsupportedConfigurationError (a ValueError) for
    an FSDP2 configuration it cannot keep correct, then or when it is turned
    on later (python/README.md, "Configurations").
    """
    fsdp2.probe()
    units = resolve(model, optional)
    existing = _existing(model, client_or_agreement, units)
    if existing is not None:
        return existing
    if any(fsdp2.is_fsdp_module(m) and fsdp2.has_run_forward(m) for m in model.modules()):
        raise ValueError(
            "accord.torch.install: the model has already run a forward under FSDP2; "
            "install accord right after fully_shard, before the first forward, on "
            "every rank (each group's step count must start at the same point)")
    configs.refuse(model)
    if client_or_agreement is None:
        client_or_agreement = default_client()
    agreement = as_agreement(client_or_agreement, timeout_s=timeout_s)
    inst = Installation(
        model, agreement, prefix=prefix, speculate=speculate_flag(speculate, overlap),
        optional=units, timeout_s=timeout_s,
        guard=env_flag("ACCORD_TORCH_GUARD") if guard is None else guard,
        learn_optional=(env_flag("ACCORD_TORCH_LEARN_OPTIONAL") if learn_optional is None
                        else learn_optional),
        watch=env_flag("ACCORD_TORCH_WATCH") if watch is None else watch)
    try:
        inst.register()
    except BaseException:
        inst.uninstall()
        raise
    fix_transformers_output_capture(model)
    model.__dict__["_accord_installation"] = inst
    return inst
