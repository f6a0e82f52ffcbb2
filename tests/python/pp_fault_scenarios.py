"""A rank stopped (SIGSTOP) or killed (SIGKILL) in the middle of a pipeline
step, and in the middle of a TP x FSDP step, DP 2 or 1 (test_faults.py).

Pipeline: 2 stages x 2 DP ranks (rank = 2 * stage + dp rank), one accord
job of the 4 ranks, each stage module installed alone (its groups agreed
among the stage's DP ranks). At step 2 the victim stops itself where its
stage's backward reduces the gradients (the schedule's REDUCE_GRAD, after
the last microbatch's backward): its DP peer is left in a reduce-scatter,
the other stage's ranks in a pipeline send or receive of step 3 (the
stage-1 ranks of a stage-0 victim block receiving step 3's first
activation, before their stage module runs at all).

The victim writes `fault at <time.time()>` before it stops, so the test
measures from the fault to each survivor's end. A survivor ends as a script
whose exception nobody caught would: the traceback, then accord.torch's exit
functions (its step watch may end the process with the job's verdict)."""

import os
import signal
import sys
import time

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from fsdp_scenarios import make_agreement

D, MICROS = 16, 2


class Stage(nn.Module):
    def __init__(self, n=3):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(D, D) for _ in range(n))

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        return x


def _die(state, fault):
    if state["armed"]:
        state["armed"] = False
        sys.stderr.write(f"fault at {time.time():.3f}\n")
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGSTOP if fault == "stop" else signal.SIGKILL)


def _arm(module, state, fault):
    module.register_full_backward_hook(lambda *_: _die(state, fault))


def _arm_reduce(stage, state, fault):
    """At the stage's gradient reduction (the schedule's REDUCE_GRAD, where
    FSDP2 reduce-scatters once the last microbatch's backward is done)."""
    original = stage.perform_reduce_grad

    def perform_reduce_grad(*args, **kwargs):
        _die(state, fault)
        return original(*args, **kwargs)

    stage.perform_reduce_grad = perform_reduce_grad


def _steps(state, rank, step_fn, steps, fault_step, victim):
    """Runs the steps; what a survivor is told ends it (run as a script:
    harness.run_ranks(as_script=True))."""
    for step in range(steps):
        if step == fault_step and rank == victim:
            state["armed"] = True
        step_fn(step)
    return {"error": None, "ended_at": time.time()}


def _pipeline(rank, world_size, cluster, dp, schedule):
    """Two stages x `dp` DP ranks (rank = dp * stage + dp rank), each stage
    module installed alone: (its module, its stage, a step function)."""
    from torch.distributed import pipelining

    import accord.torch

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (2, dp), mesh_dim_names=("pp", "dp"))
    pp_rank = rank // dp
    mod = Stage()
    for b in mod.blocks:
        fully_shard(b, mesh=mesh["dp"])
    fully_shard(mod, mesh=mesh["dp"])
    accord.torch.install(mod, make_agreement("accord", rank, world_size, cluster))
    stage = pipelining.PipelineStage(mod, pp_rank, 2, torch.device("cpu"),
                                     group=mesh.get_group("pp"))
    sched = getattr(pipelining, schedule)(stage, n_microbatches=MICROS,
                                          loss_fn=lambda out, t: (out - t).pow(2).sum())
    g = torch.Generator().manual_seed(rank % dp)

    def step(_):
        x = torch.randn(2 * MICROS, D, generator=g)
        if pp_rank == 0:
            sched.step(x)
        else:
            sched.step(target=torch.zeros(2 * MICROS, D), losses=[])
        mod.zero_grad(set_to_none=True)

    return mod, stage, step


def pipeline_stopped(rank, world_size, cluster=None, victim=3, fault="stop",
                     schedule="ScheduleGPipe", steps=5, fault_step=2, dp=2, where="reduce"):
    """`where`: "reduce" (the stage's gradient reduction, after its last
    microbatch's backward) or "backward" (the first microbatch's backward,
    in its middle block)."""
    mod, stage, step = _pipeline(rank, world_size, cluster, dp, schedule)
    state = {"armed": False}
    if rank == victim:
        if where == "reduce":
            _arm_reduce(stage, state, fault)
        else:
            _arm(mod.blocks[1], state, fault)
    return _steps(state, rank, step, steps, fault_step, victim)


def _slow_once(module, state, slow_step, slow_s):
    """`module` computes `slow_s` more in its first forward of step `slow_step`."""
    def slow(*_):
        if state["step"] == slow_step and not state.get("done"):
            state["done"] = True
            time.sleep(slow_s)  # the slow computation itself, not a wait for anything
    module.register_forward_pre_hook(slow)


def pipeline_slow(rank, world_size, cluster=None, slow_rank=1, slow_s=3.0, steps=4,
                  slow_step=1, schedule="ScheduleGPipe"):
    """2 stages x DP 1, healthy: `slow_rank`'s stage module computes for
    `slow_s` more in its first forward of step `slow_step` (longer than the
    watches' stall time, shorter than the coordinator's deadline)."""
    mod, _, step = _pipeline(rank, world_size, cluster, 1, schedule)
    state = {"step": 0}
    if rank == slow_rank:
        _slow_once(mod, state, slow_step, slow_s)

    def counted(k):
        state["step"] = k
        step(k)

    result = _steps({"armed": False}, rank, counted, steps, -1, -1)
    result["early"] = mod.__dict__["_accord_installation"].job.early
    return result


def _tp_installed(rank, world_size, cluster, dp):
    """(dp, tp) = (`dp`, 2): the blocks' weights sharded column-wise then
    row-wise over tp, FSDP over dp; the model installed."""
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    import accord.torch

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (dp, 2), mesh_dim_names=("dp", "tp"))
    mod = Stage()
    for i, b in enumerate(mod.blocks):
        mod.blocks[i] = b = nn.Sequential(b, nn.Tanh(), nn.Linear(D, D))
        parallelize_module(b, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(b, mesh=mesh["dp"])
    fully_shard(mod, mesh=mesh["dp"])
    accord.torch.install(mod, make_agreement("accord", rank, world_size, cluster))
    return mod


def tp_fsdp_stopped(rank, world_size, cluster=None, victim=3, fault="stop", steps=5,
                    fault_step=2, dp=2):
    """(dp, tp) = (2, 2): each TP rank's dp group is a member set ({0, 2},
    {1, 3}). dp = 1: each rank's member set is itself alone (no guard, no
    step watch; `~job` each step, its steps the root's forward to the end
    of its backward)."""
    mod = _tp_installed(rank, world_size, cluster, dp)
    state = {"armed": False}
    if rank == victim:
        _arm(mod.blocks[1], state, fault)
    g = torch.Generator().manual_seed(rank // 2)  # the dp coordinate: TP peers alike

    def step(_):
        mod(torch.randn(4, D, generator=g)).pow(2).sum().backward()
        mod.zero_grad(set_to_none=True)

    return _steps(state, rank, step, steps, fault_step, victim)


def tp_dp1_slow(rank, world_size, cluster=None, slow_rank=1, slow_s=3.0, steps=4, slow_step=1,
                micros=2):
    """(dp, tp) = (1, 2), healthy, `micros` forwards and backwards per step
    (gradient accumulation: only the last backward ends FSDP2's step):
    `slow_rank` computes `slow_s` more in its first forward of step
    `slow_step` (longer than the stall time, shorter than the deadline)."""
    mod = _tp_installed(rank, world_size, cluster, 1)
    state = {"step": 0}
    if rank == slow_rank:
        _slow_once(mod, state, slow_step, slow_s)
    g = torch.Generator().manual_seed(0)

    def step(k):
        state["step"] = k
        for m in range(micros):
            mod.set_is_last_backward(m == micros - 1)
            mod(torch.randn(4, D, generator=g)).pow(2).sum().backward()
        mod.zero_grad(set_to_none=True)

    result = _steps({"armed": False}, rank, step, steps, -1, -1)
    job = mod.__dict__["_accord_installation"].job
    result.update(early=job.early, ended=job.steps.ended)
    return result
