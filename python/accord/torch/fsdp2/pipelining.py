"""torch.distributed.pipelining's methods that accord wraps: a schedule's
step() (its whole run, for the step watch: accord.torch.jobwatch), where a
schedule's step begins for a stage module (its microbatch 0 forward), and
schedules that split each microbatch's backward into input and weight
passes (refused at the schedule's step(), before anything runs, on every
rank alike: the schedule's action list is global; a weight-only backward
is refused too), and, under a schedule with several stages per rank, each
stage's microbatch forward to the rank's other stage modules (their guards
record it: a rank that skipped a unit in one chunk meets the other ranks'
all-gather of it at the next chunk's forward). Everything else a schedule
does reaches accord through FSDP2 (docs/PARTICIPATION.md, "Pipeline
schedules")."""

from __future__ import annotations

import contextlib
from typing import Callable, Optional

_STAGE = "_accord_stage"
_PATCH = {"users": 0, "forward": None, "weight": None, "step": None, "single_step": None}
_RUNNING: list = []  # per multi-stage schedule step() in progress: its stages' owners


def _classes():
    """(stage base class, multi-stage and single-stage schedule classes), or
    None on a torch without pipelining (no schedule can drive a module
    there)."""
    try:
        from torch.distributed.pipelining.schedules import (PipelineScheduleMulti,
                                                            PipelineScheduleSingle)
        from torch.distributed.pipelining.stage import _PipelineStageBase
    except ImportError:
        return None
    if not all(hasattr(_PipelineStageBase, m)
               for m in ("forward_one_chunk", "backward_weight_one_chunk")):
        return None
    return _PipelineStageBase, PipelineScheduleMulti, PipelineScheduleSingle


def route_stage(module, owner) -> None:
    """Schedules that drive `module` (a stage's submod) tell `owner`:
    owner.schedule_step() is a context manager around each step() of the
    schedule, owner.microbatch(chunk_id, stage_index) around each
    microbatch's forward (the stage's index in the pipeline);
    owner.other_stage_forward(chunk_id, stage_index) before each microbatch
    forward of another stage module of the same multi-stage schedule on
    this rank; owner.refuse_split_backward() raises, called at the step()
    of a schedule whose actions split a backward and before any weight-only
    backward."""
    module.__dict__[_STAGE] = owner


def unroute_stage(module) -> None:
    module.__dict__.pop(_STAGE, None)


def _owner(stage) -> Optional[object]:
    module = getattr(stage, "submod", None)
    return None if module is None else module.__dict__.get(_STAGE)


def patch_stages() -> None:
    """Wraps the methods (reference-counted with unpatch_stages)."""
    classes = _classes()
    if classes is None:
        return
    stage, multi, single = classes
    if _PATCH["users"] == 0:
        _PATCH.update(forward=stage.forward_one_chunk, weight=stage.backward_weight_one_chunk,
                      step=multi.step, single_step=single.step)
        stage.forward_one_chunk = _forward(_PATCH["forward"])
        stage.backward_weight_one_chunk = _weight(_PATCH["weight"])
        multi.step = _step(_PATCH["step"])
        single.step = _single_step(_PATCH["single_step"])
    _PATCH["users"] += 1


def unpatch_stages() -> None:
    classes = _classes()
    if classes is None or _PATCH["users"] == 0:
        return
    _PATCH["users"] -= 1
    if _PATCH["users"] == 0:
        stage, multi, single = classes
        stage.forward_one_chunk, stage.backward_weight_one_chunk = _PATCH["forward"], _PATCH["weight"]
        multi.step, single.step = _PATCH["step"], _PATCH["single_step"]
        _PATCH.update(forward=None, weight=None, step=None, single_step=None)


def _forward(original: Callable) -> Callable:
    def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):
        owner = _owner(self)
        if owner is None:
            return original(self, fwd_chunk_id, *args, **kwargs)
        stage = getattr(self, "stage_index", None)
        stage = None if stage is None else int(stage)
        for other in (_RUNNING[-1] if _RUNNING else ()):
            if other is not owner:
                other.other_stage_forward(int(fwd_chunk_id), stage)
        with owner.microbatch(int(fwd_chunk_id), stage):
            return original(self, fwd_chunk_id, *args, **kwargs)

    return forward_one_chunk


def _weight(original: Callable) -> Callable:
    def backward_weight_one_chunk(self, *args, **kwargs):
        owner = _owner(self)
        if owner is not None:
            owner.refuse_split_backward()
        return original(self, *args, **kwargs)

    return backward_weight_one_chunk


def _splits(action) -> bool:
    kind = getattr(getattr(action, "computation_type", None), "value", None)
    return kind in ("I", "W") or any(_splits(a) for a in (getattr(action, "sub_actions", None)
                                                          or ()))


def _step(original: Callable) -> Callable:
    def step(self, *args, **kwargs):
        owners = [o for o in map(_owner, getattr(self, "_stages", ())) if o is not None]
        if owners:
            order = getattr(self, "pipeline_order", None) or {}
            if any(_splits(a) for actions in order.values() for a in actions):
                owners[0].refuse_split_backward()
        _RUNNING.append(owners)
        try:
            return _bracketed(owners, original, self, *args, **kwargs)
        finally:
            _RUNNING.pop()

    return step


def _single_step(original: Callable) -> Callable:
    def step(self, *args, **kwargs):
        owner = _owner(getattr(self, "_stage", None))
        return _bracketed([owner] if owner is not None else [], original, self, *args, **kwargs)

    return step


def _bracketed(owners, original, schedule, *args, **kwargs):
    """original(schedule, ...) inside each owner's schedule_step()."""
    with contextlib.ExitStack() as stack:
        for owner in owners:
            stack.enter_context(owner.schedule_step())
        return original(schedule, *args, **kwargs)
