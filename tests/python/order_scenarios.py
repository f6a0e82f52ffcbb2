"""Jobs whose post-backwards run in a different order on different ranks
(test_order.py): the class behind "one reduce-scatter order on every rank".

`zoo` is one small FSDP2 model holding every shape of the class at once, with
each rank's usage drawn per step from a seed (so it changes every step):
- `proj`, a module of the root unit, used only on ranks with an "image";
- `side`, its own unit, whose forward runs everywhere but whose output only
  some ranks use (its post-backward runs inside autograd on those ranks and
  only in FSDP2's end-of-backward callback on the others);
- `experts`, each its own unit, routed tokens per rank: an expert with no
  tokens runs on an empty input ("empty") or not at all ("skip", marked
  optional);
- `lora`, one unit holding a frozen base weight beside trained adapters;
- two blocks, and a head in the root unit.
Gradients are compared with a single-process reference on the same data and
usage, every step; the reduce-scatters each rank issued are recorded.
"""

import random

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from fsdp_scenarios import WireSpy, _full_grads, make_agreement

D_IN, D = 6, 8
ROWS = 6


class Lora(nn.Module):
    def __init__(self):
        super().__init__()
        self.base = nn.Linear(D, D, bias=False)
        self.base.weight.requires_grad_(False)
        self.a = nn.Parameter(torch.randn(D, 2) * 0.1)
        self.b = nn.Parameter(torch.randn(2, D) * 0.1)

    def forward(self, h):
        return self.base(h) + h @ self.a @ self.b


class Zoo(nn.Module):
    def __init__(self, n_experts=3):
        super().__init__()
        self.embed = nn.Linear(D_IN, D)
        self.proj = nn.Linear(D_IN, D)
        self.blocks = nn.ModuleList(nn.Linear(D, D) for _ in range(2))
        self.side = nn.Linear(D, D)
        self.experts = nn.ModuleList(nn.Linear(D, D) for _ in range(n_experts))
        self.lora = Lora()
        self.head = nn.Linear(D, 1)

    def forward(self, x, img, use_side, routing, skip_empty):
        h = self.embed(x)
        if img is not None:
            h = h + self.proj(img)
        for b in self.blocks:
            h = torch.tanh(b(h))
        s = self.side(h)
        if use_side:
            h = h + s
        out = torch.zeros_like(h)
        for e, idx in zip(self.experts, routing):
            if skip_empty and idx.numel() == 0:
                continue
            out = out.index_add(0, idx, e(h[idx]))
        h = h + out
        h = h + self.lora(h)
        return self.head(h)


def usage(seed, rank, step, n_experts=3):
    """This rank's data and usage at this step, the same in every process."""
    rnd = random.Random(seed * 1_000_003 + rank * 1009 + step)
    g = torch.Generator().manual_seed(seed * 7919 + rank * 131 + step)
    x = torch.randn(ROWS, D_IN, generator=g)
    img = torch.randn(ROWS, D_IN, generator=g) if rnd.random() < 0.5 else None
    use_side = rnd.random() < 0.5
    owner = [rnd.randrange(n_experts + 1) for _ in range(ROWS)]  # n_experts: no expert
    routing = [torch.tensor([i for i, o in enumerate(owner) if o == e], dtype=torch.long)
               for e in range(n_experts)]
    return x, img, use_side, routing


def _reference(seed, world_size, step, skip_empty):
    torch.manual_seed(seed)
    model = Zoo()
    for r in range(world_size):
        x, img, use_side, routing = usage(seed, r, step)
        model(x, img, use_side, routing, skip_empty).pow(2).sum().backward()
    return {n: (p.grad / world_size if p.grad is not None else None)
            for n, p in model.named_parameters()}


def zoo(rank, world_size, agreement="accord", cluster=None, guard=True, speculate=True,
        steps=3, seed=1, experts="empty", learn=False, steady=False):
    """experts: "empty" (an expert without tokens runs on an empty input) or
    "skip" (it does not run; marked optional unless `learn`, which leaves it
    to the guard's learner)."""
    torch.manual_seed(seed)
    model = Zoo()
    mesh = init_device_mesh("cpu", (world_size,))
    units = [*model.blocks, model.side, *model.experts, model.lora]
    for u in units:
        fully_shard(u, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for m in model.modules():
        if hasattr(m, "set_force_sum_reduction_for_comms"):
            m.set_force_sum_reduction_for_comms(True)
    skip_empty = experts == "skip"
    inst = None
    # "auto": install(model) with no client, as a new user does under
    # torchrun (accord.connect() picks the deployment or embedded mode).
    ag = None if agreement == "auto" else make_agreement(agreement, rank, world_size, cluster)
    if ag is not None or agreement == "auto":
        import accord.torch

        optional = list(model.experts) if skip_empty and not learn else []
        inst = accord.torch.install(model, ag, guard=guard, speculate=speculate,
                                    optional=optional)
    per_step, refs, sequences, repairs = [], [], [], []
    for step in range(steps):
        x, img, use_side, routing = usage(seed, rank, 0 if steady else step)
        spy = WireSpy()
        try:
            model(x, img, use_side, routing, skip_empty).pow(2).sum().backward()
        finally:
            spy.close()
        sequences.append(spy.sequence)
        per_step.append(_full_grads(model))
        refs.append(_reference(seed, world_size, 0 if steady else step, skip_empty))
        model.zero_grad(set_to_none=True)
        repairs.append(inst.timing.repairs if inst is not None else 0)
    t = inst.timing if inst is not None else None
    learned = list(inst.learned) if inst is not None else []
    groups = len(inst.groups) if inst is not None else 0
    if inst is not None:
        inst.uninstall()  # reports the counts not yet reported (the process ends with os._exit)
    return {
        "grads": per_step, "ref": refs, "reduce_scatters": sequences, "repairs": repairs,
        "timing": None if t is None else {
            "speculated": t.speculated, "repairs": t.repairs, "redone": t.redone,
            "blocked": t.blocked, "waits": t.waits, "releases": t.releases,
            "during": t.during, "at_end": t.at_end, "late": t.late},
        "learned": learned,
        "groups": groups,
    }


class TwoUnits(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 6)
        self.b = nn.Linear(6, 6)
        for lin in (self.a, self.b):
            nn.init.zeros_(lin.weight)
            nn.init.zeros_(lin.bias)

    def forward(self, x, use_b):
        y = self.a(x)
        z = self.b(y + 1)
        return y + z if use_b else y


def widening(rank, world_size, agreement="accord", cluster=None, speculate=True):
    """reduce_dtype=None, fp16 parameters on even ranks and bf16 on odd ones.
    Unit `b`'s output is used only by rank 0 in step 0 (its wire dtype is
    fp16) and by every rank in step 1 (fp16 joined with bf16: fp32). Zero
    weights and small integer data keep every gradient exact."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    model = TwoUnits()
    dtype = torch.float16 if rank % 2 == 0 else torch.bfloat16
    mesh = init_device_mesh("cpu", (world_size,))
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=None)
    fully_shard(model.b, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    for m in model.modules():
        if hasattr(m, "set_force_sum_reduction_for_comms"):
            m.set_force_sum_reduction_for_comms(True)
    import accord.torch

    inst = accord.torch.install(model, make_agreement(agreement, rank, world_size, cluster),
                                guard=False, speculate=speculate)

    def data(r, step):
        g = torch.Generator().manual_seed(11 + r + 100 * step)
        return torch.randint(-2, 3, (4, 8), generator=g).float()

    grads, refs, wires = [], [], []
    for step in range(2):
        spy = WireSpy()
        try:
            model(data(rank, step), rank == 0 or step == 1).float().sum().backward()
        finally:
            spy.close()
        wires.append(spy.calls)
        grads.append(_full_grads(model))
        ref_model = TwoUnits()
        for r in range(world_size):
            ref_model(data(r, step), r == 0 or step == 1).sum().backward()
        refs.append({n: p.grad / world_size if p.grad is not None else None
                     for n, p in ref_model.named_parameters()})
        model.zero_grad(set_to_none=True)
    t = inst.timing
    return {"grads": grads, "ref": refs, "wire": wires,
            "timing": {"speculated": t.speculated, "repairs": t.repairs, "redone": t.redone}}
