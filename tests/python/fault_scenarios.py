"""A rank stopped (SIGSTOP) or killed (SIGKILL) in the middle of an FSDP2
step (test_faults.py). Six blocks, each its own FSDP unit; at step 2 the
victim stops itself in the forward of block 3, in the backward of block 5
(early) or 3, or after its backward (where the optimizer would step), so the
other ranks are left inside Gloo collectives."""

import os
import signal
import sys
import time

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from fsdp_scenarios import make_agreement

D = 16


class Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.blocks = nn.ModuleList(nn.Linear(D, D) for _ in range(6))

    def forward(self, x):
        y = self.inp(x)
        for b in self.blocks:
            y = torch.tanh(b(y))
        return y


def stop_mid_step(rank, world_size, cluster=None, victim=2, fault="stop", when="backward",
                  speculate=True, guard=True, steps=4, fault_step=2):
    torch.manual_seed(0)
    model = Blocks()
    mesh = init_device_mesh("cpu", (world_size,))
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    import accord.torch

    inst = accord.torch.install(model, make_agreement("accord", rank, world_size, cluster),
                                speculate=speculate, guard=guard)
    sig = signal.SIGSTOP if fault == "stop" else signal.SIGKILL
    state = {"armed": False}

    def die(*_):
        if state["armed"]:
            os.kill(os.getpid(), sig)

    if rank == victim:
        if when == "forward":
            model.blocks[3].register_forward_pre_hook(lambda m, a: die())
        elif when == "early-backward":  # the first block backward reaches
            model.blocks[5].register_full_backward_hook(lambda m, gi, go: die())
        elif when == "backward":
            model.blocks[3].register_full_backward_hook(lambda m, gi, go: die())
        elif when == "after-release":  # its step's batch went up, the end's turns not yet
            submit = inst.negotiation.submit_step

            def submit_then_die(*args):
                handles = submit(*args)
                die()
                return handles

            inst.negotiation.submit_step = submit_then_die
        elif when != "optimizer":
            raise ValueError(when)
    g = torch.Generator().manual_seed(rank)
    started = None
    try:
        for step in range(steps):
            if step == fault_step:
                state["armed"] = True
                started = time.monotonic()
                sys.stderr.write(f"fault step began at {time.time():.3f}\n")
                sys.stderr.flush()
            x = torch.randn(4, D, generator=g)
            model(x).pow(2).sum().backward()
            if when == "optimizer" and rank == victim:  # after the step's reduce-scatters
                die()
            model.zero_grad(set_to_none=True)
    except Exception as e:  # noqa: BLE001 - what the survivor was told
        return {"error": f"{type(e).__name__}: {e}",
                "seconds": time.monotonic() - started if started else None,
                "early": inst.watch.early if inst.watch else None}
    return {"error": None, "seconds": None}
