"""One rank of the chaos harness's accord.torch job (tests/chaos/chaos.py).

A small FSDP2 model (an input layer and four blocks, each its own unit, under
the root unit) trained for --steps steps on CPU/Gloo with accord.torch
installed with its defaults (speculation, guard, step watch). The data
diverges the way real jobs do: rank 1 leaves the root unit's `aux` layer
unused on even steps (a text-only batch), and block 3, installed as an
optional unit, is skipped on rank 0 at step 3 (no tokens for an expert).

Prints, like accord-rank-scenario, one line the oracle reads:
    rank R digest HEX               (sha256 of the trained full parameters)
    rank R step S: error KIND: MSG  (the first error this rank saw)
A step watch that names a stopped or dead peer ends the process itself
(exit 3, its message on stderr); the harness reads it there.
"""

import argparse
import faulthandler
import hashlib
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

D = 16


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.aux = nn.Linear(D, D)
        self.blocks = nn.ModuleList(nn.Linear(D, D) for _ in range(4))

    def forward(self, x, use_aux, skip_block):
        y = self.inp(x)
        if use_aux:
            y = y + self.aux(x)
        for i, b in enumerate(self.blocks):
            if i != skip_block:
                y = torch.tanh(b(y))
        return y.pow(2).mean()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--socket", required=True)
    ap.add_argument("--job", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--local_rank", type=int, required=True)
    ap.add_argument("--store", required=True, help="file for torch.distributed's FileStore")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--step_delay", type=float, default=0.1)
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--reconnect_grace", type=float, default=10.0,
                    help="seconds the client reconnects to a restarted sidecar")
    a = ap.parse_args()
    faulthandler.enable()  # a crash prints every thread's Python stack to stderr
    torch.set_num_threads(1)
    step = -1
    try:
        import datetime

        import accord
        import accord.torch

        dist.init_process_group("gloo", init_method=f"file://{a.store}", rank=a.rank,
                                world_size=a.world, timeout=datetime.timedelta(seconds=a.timeout))
        torch.manual_seed(0)
        model = Model()
        mesh = init_device_mesh("cpu", (a.world,))
        for b in model.blocks:
            fully_shard(b, mesh=mesh)
        fully_shard(model, mesh=mesh)
        client = accord.connect(a.socket, a.job, a.rank, a.world, local_rank=a.local_rank,
                                reconnect_grace_s=a.reconnect_grace)
        # block 3 is skipped on some ranks at some steps: declared optional
        accord.torch.install(model, client, timeout_s=a.timeout, optional=[model.blocks[3]])
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        print(f"rank {a.rank} ready", flush=True)  # the harness times faults from here
        g = torch.Generator().manual_seed(a.rank)
        for step in range(a.steps):
            if step:
                time.sleep(a.step_delay)
            x = torch.randn(4, D, generator=g)
            use_aux = not (a.rank == 1 and step % 2 == 0)
            skip = 3 if (a.rank == 0 and step == 3) else -1
            model(x, use_aux, skip).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        h = hashlib.sha256()
        for name, p in sorted(model.named_parameters()):
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            h.update(name.encode())
            h.update(full.detach().contiguous().numpy().tobytes())
        print(f"rank {a.rank} digest {h.hexdigest()[:16]}", flush=True)
        dist.destroy_process_group()
        return 0
    except BaseException as e:  # the first error, reported for the oracle
        traceback.print_exc()  # where it came from, in the rank's log
        msg = " ".join(str(e).split())
        print(f"rank {a.rank} step {step}: error {type(e).__name__}: {msg}", flush=True)
        os._exit(1)


if __name__ == "__main__":
    sys.exit(main())
