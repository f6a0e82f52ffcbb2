"""Peak live unsharded-gradient bytes, plain FSDP2 beside accord.torch in
one process (test_memory.py, bench/fsdp/bench_memory.py).

The model is a stack of Linear blocks, each its own FSDP unit, with an input
and an output Linear in the root unit; each block has a `side` Linear whose
output some ranks use (usage "changing": drawn per rank and step from a
seed, so parameters get gradients on some ranks only and the decisions
change between steps). Plain FSDP2 cannot run divergent usage, so its
baseline runs every module on every rank: the most it can hold.
"""

import random

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from fsdp_scenarios import make_agreement
from grad_meter import GradMeter


class Block(nn.Module):
    def __init__(self, dim, side=True):
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        if side:
            self.side = nn.Linear(dim, dim // 4, bias=False)
            self.back = nn.Linear(dim // 4, dim, bias=False)

    def forward(self, h, use_side):
        out = torch.tanh(self.lin(h))
        if use_side and hasattr(self, "side"):
            out = out + self.back(torch.tanh(self.side(h)))
        return out


class Stack(nn.Module):
    def __init__(self, blocks, dim, side=True):
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(Block(dim, side) for _ in range(blocks))
        self.out = nn.Linear(dim, 1)

    def forward(self, x, sides):
        h = self.inp(x)
        for b, s in zip(self.blocks, sides):
            h = b(h, s)
        return self.out(h).sum()


def _build(blocks, dim, mesh, dtype):
    torch.manual_seed(0)
    model = Stack(blocks, dim)
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if dtype == "bf16" else MixedPrecisionPolicy())
    for b in model.blocks:
        fully_shard(b, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def group_bytes(model, wire_bytes=4):
    """Each FSDP group's unsharded gradient in the reduce dtype (fp32 here)."""
    from accord.torch.fsdp2.state import param_groups

    out = {}
    for name, m in model.named_modules():
        if hasattr(m, "_get_fsdp_state"):
            for g in param_groups(m):
                n = 0
                for fp in g.fsdp_params:
                    size = 1
                    for s in fp._orig_size:
                        size *= int(s)
                    n += size
                out[name or "<root>"] = n * wire_bytes
    return out


def sides_for(usage, rank, step, blocks, seed, world_size=2):
    """Which blocks use their side projection: all ("fixed"), or each with
    probability 1/W per rank and step ("changing": often no rank does)."""
    if usage == "fixed":
        return [True] * blocks
    rng = random.Random(seed * 1000 + step * 31 + rank)
    return [rng.random() < 1.0 / world_size for _ in range(blocks)]


def memory(rank, world_size, agreement="accord", cluster=None, dtype="fp32", blocks=8,
           dim=256, steps=4, usage="fixed", seed=1, rows=8):
    import accord.torch

    mesh = init_device_mesh("cpu", (world_size,))
    meter = GradMeter()
    plain = _build(blocks, dim, mesh, dtype)
    model = _build(blocks, dim, mesh, dtype)
    meter.watch(plain)
    meter.watch(model)
    inst = accord.torch.install(model, make_agreement(agreement, rank, world_size, cluster))
    out = {"plain": [], "accord": [], "late_bytes": [], "owed_bytes": [], "turns": [],
           "groups": group_bytes(model), "equal": []}
    try:
        for step in range(steps):
            g = torch.Generator().manual_seed(100 * step + rank)
            x = torch.randn(rows, dim, generator=g)
            meter.reset()
            plain(x, [True] * blocks).backward()
            out["plain"].append(meter.peak)
            t0 = _counts(inst)
            meter.reset()
            model(x, sides_for(usage, rank, step, blocks, seed, world_size)).backward()
            out["accord"].append(meter.peak)
            t1 = _counts(inst)
            out["late_bytes"].append(t1["late_bytes"] - t0["late_bytes"])
            out["owed_bytes"].append(t1["owed_bytes"] - t0["owed_bytes"])
            out["turns"].append({k: t1[k] - t0[k] for k in ("during", "at_end", "late")})
            if usage == "fixed":
                out["equal"].append(all(
                    torch.equal(a.grad.to_local(), b.grad.to_local())
                    for a, b in zip(plain.parameters(), model.parameters())))
            plain.zero_grad(set_to_none=True)
            model.zero_grad(set_to_none=True)
    finally:
        meter.close()
        inst.uninstall()
    return out


def _counts(inst):
    t = inst.timing
    owed = sum(s.owed_bytes for s in inst.stats.values())
    return {"late_bytes": t.late_bytes, "owed_bytes": owed, "during": t.during,
            "at_end": t.at_end, "late": t.late}


class WithAux(Stack):
    """Stack with a unit `aux` (first in release order) whose output joins
    the last block's. On ranks that feed it the raw input (which needs no
    gradient) its post-backward runs only in FSDP2's end-of-backward
    callback, after its turn, although its parameters have gradients: a
    late group. Elsewhere it runs during autograd. The all-gathers are the
    same on every rank."""

    def __init__(self, blocks, dim):
        super().__init__(blocks, dim)
        self.aux = nn.Linear(dim, dim)

    def forward(self, x, raw):
        h0 = self.inp(x)
        a = self.aux(x if raw else h0)
        h = h0
        for b in self.blocks:
            h = b(h, True)
        return self.out(h + a).sum()


def late(rank, world_size, agreement="accord", cluster=None, blocks=4, dim=32, steps=3,
         speculate=True):
    """`aux` gets the raw input on odd ranks every step: its gradient is
    late there. Returns every step's gradients beside a single-process
    reference."""
    import accord.torch
    from fsdp_scenarios import _full_grads

    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    model = WithAux(blocks, dim)
    torch.manual_seed(0)
    ref = WithAux(blocks, dim)
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model.aux, mesh=mesh)
    fully_shard(model, mesh=mesh)
    inst = accord.torch.install(model, make_agreement(agreement, rank, world_size, cluster),
                                speculate=speculate)
    out = {"grads": [], "ref": [], "late": [], "late_bytes": [], "deltas": []}

    def data(r, step):
        return torch.randn(4, dim, generator=torch.Generator().manual_seed(7 * step + r))

    for step in range(steps):
        t = inst.timing
        late0, bytes0, deltas0 = t.late, t.late_bytes, t.redone
        model(data(rank, step), rank % 2 == 1).backward()
        out["late"].append(t.late - late0)
        out["late_bytes"].append(t.late_bytes - bytes0)
        out["deltas"].append(t.redone - deltas0)
        out["grads"].append(_full_grads(model))
        ref.zero_grad(set_to_none=True)
        for r in range(world_size):
            ref(data(r, step), r % 2 == 1).backward()
        out["ref"].append({n: p.grad / world_size for n, p in ref.named_parameters()})
        model.zero_grad(set_to_none=True)
    inst.uninstall()
    return out


def post_accumulate_hooks(rank, world_size, agreement="accord", cluster=None):
    """An optimizer-in-backward hook is refused at install, and when it is
    registered after install, at the next backward (before any turn)."""
    import accord.torch
    from accord.torch.configs import UnsupportedConfigurationError

    mesh = init_device_mesh("cpu", (world_size,))
    model = _build(2, 16, mesh, "fp32")
    p = next(model.blocks[0].parameters())
    handle = p.register_post_accumulate_grad_hook(lambda t: None)
    said = []
    ag = make_agreement(agreement, rank, world_size, cluster)
    try:
        accord.torch.install(model, ag)
    except UnsupportedConfigurationError as e:
        said.append(str(e))
    handle.remove()
    inst = accord.torch.install(model, ag)
    x = torch.randn(2, 16)
    model(x, [True, True]).backward()
    p.register_post_accumulate_grad_hook(lambda t: None)
    try:
        model(x, [True, True]).backward()
    except UnsupportedConfigurationError as e:
        said.append(str(e))
    inst.uninstall()
    return said
