"""FSDP2 with accord.torch at one rank, against plain FSDP2: peak memory.

Run by scripts/gpu-check on a machine with a GPU (docs/GPU.md); runs on CPU
too (--device cpu), where only the live unsharded-gradient bytes are
measured. One process, world size 1 (NCCL on CUDA, Gloo on CPU), no
daemons: the agreement is in-process (`LocalAgreement`, accord's own Decide
over this rank's manifest). At W = 1 FSDP2 copies instead of reduce-
scattering, so this checks memory and the turn path, not the collective.

The model's gradients dominate its memory (--blocks x Linear(--dim), fp32,
each block its own unit, a small batch). Per step it reports
torch.cuda.max_memory_allocated over the step's start (CUDA) and the peak
live unsharded-gradient bytes (tests/python/grad_meter.py), plain and
accord, and exits 1 when accord's steady step exceeds plain's by more than
the largest group's unsharded gradient:

    PYTHONPATH=<package> python3 bench/fsdp/gpu_memory.py --device cuda
"""

import argparse
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests", "python"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402


class LocalAgreement:
    """The agreement of a one-rank job: accord's Decide over this rank's
    manifest, in process (accord.Agreement's protocol)."""

    rank, world_size = 0, 1

    def __init__(self):
        self.specs = {}

    def register(self, group_id, params, reduce_dtype, reduce_dtype_exact):
        self.specs[group_id] = (list(params), reduce_dtype, reduce_dtype_exact)

    def submit(self, group_id, step, dtypes):
        import accord

        params, reduce_dtype, exact = self.specs[group_id]
        return accord.decide(group_id, params, step, [list(dtypes)], reduce_dtype, exact)


def build(blocks, dim, device):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(dim, dim) for _ in range(blocks)]).to(device)
    mesh = init_device_mesh(device, (1,))
    for b in model:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def step(model, x, device):
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
    model(x).square().sum().backward()
    peak = 0
    if device == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - start
    model.zero_grad(set_to_none=True)
    return peak


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--blocks", type=int, default=16)
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_memory: no CUDA device visible")
        return 2
    import accord.torch
    from grad_meter import GradMeter

    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo", store=store,
                                rank=0, world_size=1)
        meter = GradMeter()
        plain = build(args.blocks, args.dim, args.device)
        model = build(args.blocks, args.dim, args.device)
        meter.watch(plain)
        meter.watch(model)
        inst = accord.torch.install(model, LocalAgreement())
        x = torch.randn(4, args.dim, device=args.device)
        largest = (args.dim * args.dim + args.dim) * 4
        worst = 0
        print(f"largest group's unsharded gradient: {largest / 2**20:.1f} MiB")
        for k in range(args.steps):
            row = []
            for name, m in (("plain", plain), ("accord", model)):
                meter.reset()
                peak = step(m, x, args.device)
                row.append((peak, meter.peak))
            (pa, ga), (pb, gb) = row
            print(f"step {k}: live grads plain {ga / 2**20:.1f} MiB, accord {gb / 2**20:.1f} MiB; "
                  f"allocated over start plain {pa / 2**20:.1f} MiB, accord {pb / 2**20:.1f} MiB")
            if k == args.steps - 1:
                worst = max(gb - ga, pb - pa)
        meter.close()
        inst.uninstall()
        dist.destroy_process_group()
    ok = worst <= largest
    print(f"steady step: accord - plain = {worst / 2**20:+.1f} MiB "
          f"({'within' if ok else 'over'} one group)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
