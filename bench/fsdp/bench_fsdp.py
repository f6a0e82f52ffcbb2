"""Steps/s of a small FSDP2 model on 2 ranks (CPU, Gloo), with and without
accord, in the same run, where no fix is needed (every rank uses every
parameter, one dtype). Target: accord costs <= 5%.

Two identical models live in each rank; rounds alternate between them
(plain, accord, plain, accord, ...) so drift in machine load hits both alike.
The accord model talks to a real local cluster (coordinator + sidecar).

    PYTHONPATH=<build>/python/pkg python bench/fsdp/bench_fsdp.py [--rounds 6 --steps 10]
"""

import argparse
import copy
import multiprocessing as mp
import os
import sys
import tempfile
import time


def make_model(torch, nn, blocks, width):
    layers = []
    for _ in range(blocks):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers)


def rank_main(rank, world, tmpdir, sock, local_rank, job, args, q):
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import accord
    import accord.torch

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", store=dist.FileStore(os.path.join(tmpdir, "s"), world), rank=rank, world_size=world
    )
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    base = make_model(torch, nn, args.blocks, args.width)
    models = {}
    for name in ("plain", "accord"):
        m = copy.deepcopy(base)
        for layer in m:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(m, mesh=mesh)
        m.set_force_sum_reduction_for_comms(True)
        models[name] = m
    client = accord.connect(sock, job, rank, world, local_rank=local_rank)
    inst = accord.torch.install(models["accord"], client)
    opts = {n: torch.optim.SGD(m.parameters(), lr=1e-3) for n, m in models.items()}
    x = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(rank))

    def step(name):
        m = models[name]
        m(x).pow(2).mean().backward()
        opts[name].step()
        opts[name].zero_grad(set_to_none=True)

    for name in models:  # warm-up (first steps register groups, fill caches)
        for _ in range(args.warmup):
            step(name)
    totals = {n: 0.0 for n in models}
    for _ in range(args.rounds):
        for name in ("plain", "accord"):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step(name)
            dist.barrier()
            totals[name] += time.perf_counter() - t0
    groups = len(inst.groups)
    q.put((rank, totals, groups))
    dist.barrier()
    os._exit(0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()

    import accord

    ctx = mp.get_context("spawn")
    with accord.LocalCluster(num_sidecars=1) as cluster, tempfile.TemporaryDirectory() as tmpdir:
        q = ctx.Queue()
        procs = []
        for r in range(args.world):
            sock, lr = cluster.socket_for(r, args.world)
            p = ctx.Process(target=rank_main, args=(r, args.world, tmpdir, sock, lr, "bench", args, q))
            p.start()
            procs.append(p)
        results = [q.get(timeout=1800) for _ in procs]
        for p in procs:
            p.join(60)
    totals = max(results, key=lambda t: t[0])[1]  # all ranks finish each round together
    n = args.rounds * args.steps
    plain, acc = n / totals["plain"], n / totals["accord"]
    groups = results[0][2]
    print(
        f"FSDP2 {args.world} ranks CPU/Gloo, {args.blocks}x Linear({args.width}) + root "
        f"= {groups} FSDP groups, batch {args.batch}, {n} timed steps each"
    )
    print(f"  without accord: {plain:8.2f} steps/s")
    print(f"  with accord:    {acc:8.2f} steps/s")
    print(f"  slowdown:       {100.0 * (plain - acc) / plain:+.2f}%  (target <= 5%)")


if __name__ == "__main__":
    sys.exit(main())
