"""FSDP2 scenarios run on every rank (see test_fsdp.py and examples/).

Each scenario builds a small model, shards it with FSDP2 on a CPU mesh with
Gloo, runs backward, and returns what the test checks: the full gradients
(gathered from the shards), a single-process reference computed on the same
data, and what went over the wire (dtype and element count of every
reduce-scatter input, recorded by a spy on dist.reduce_scatter_single).

`agreement` selects how ranks agree: "none" (plain FSDP2), "fake" (the
test-only FakeGlooAgreement) or "accord" (the real client; `cluster` holds the
sidecar socket and job id of a running local cluster).

Gloo's reduce-scatter has ignored ReduceOp.AVG in some versions, so every
scenario calls set_force_sum_reduction_for_comms(True): FSDP2 then
reduce-scatters with SUM and divides by the world size afterwards, which is
what the references compute.
"""

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from collective_names import fsdp2_collectives

D_IN, D_HID = 12, 10  # 10 rows: padded on 4 ranks


class WireSpy:
    """Records (dtype, numel) of every reduce-scatter input on this rank in
    `calls`, and in `sequence` every FSDP2 collective in issue order, each
    as (kind, dtype, numel, process-group ranks): the sequence on each
    communicator and their interleaving."""

    def __init__(self):
        self.calls, self.sequence = [], []
        gather, scatter = fsdp2_collectives()
        self.names = {scatter: "reduce-scatter", gather: "all-gather", "all_reduce": "all-reduce"}
        self._orig = {n: getattr(dist, n) for n in self.names}
        for name, orig in self._orig.items():
            setattr(dist, name, self._spy(name, orig))

    def _spy(self, name, orig):
        def spy(*args, **kwargs):
            if name == "all_reduce":
                t = args[0] if args else kwargs["tensor"]
            else:
                t = args[1] if len(args) > 1 else kwargs.get("input", kwargs.get("input_tensor"))
            dtype = str(t.dtype).replace("torch.", "")
            if self.names[name] == "reduce-scatter":
                self.calls.append((dtype, t.numel()))
            group = kwargs.get("group")
            ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else ()
            self.sequence.append((self.names[name], dtype, t.numel(), ranks))
            return orig(*args, **kwargs)

        return spy

    def close(self):
        for name, orig in self._orig.items():
            setattr(dist, name, orig)


def make_agreement(kind, rank, world_size, cluster):
    if kind == "none":
        return None
    if kind == "fake":
        from fake_agreement import FakeGlooAgreement

        return FakeGlooAgreement()
    if kind == "accord":
        import accord

        client = accord.connect(
            socket_path=cluster["sockets"][rank],
            job_id=cluster["job_id"],
            rank=rank,
            world_size=world_size,
            local_rank=cluster["local_ranks"][rank],
        )
        return accord.ClientAgreement(client, timeout_s=60.0)
    raise ValueError(kind)


def _shard(model, units, mesh, mp_policy=None, unused_flag=None):
    kwargs = {"mesh": mesh}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    for u in units:
        fully_shard(u, **kwargs)
    fully_shard(model, **kwargs)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)
            if unused_flag is not None:
                m.set_reduce_scatter_unused_params(unused_flag, recurse=False)
    return model


def _install(model, agreement):
    if agreement is None:
        return None
    import accord.torch

    inst = accord.torch.install(model, agreement)
    assert accord.torch.install(model, agreement) is inst  # idempotent
    return inst


def _full_grads(model):
    """Gathers every parameter's sharded gradient (None stays None) on every rank."""
    out = {}
    for name, p in model.named_parameters():
        # Every rank takes part in each gather, so ranks must agree on which
        # are None; a rank-dependent answer is itself a failure worth seeing.
        has = torch.tensor([0 if p.grad is None else 1])
        everyone = [torch.zeros_like(has) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, has)
        flags = [int(t.item()) for t in everyone]
        if all(f == 0 for f in flags):
            out[name] = None
        elif all(f == 1 for f in flags):
            out[name] = p.grad.full_tensor().detach().clone()
        else:
            out[name] = f"grad None on ranks {[r for r, f in enumerate(flags) if f == 0]} only"
    return out


def _data(rank, k, n=4, gen_seed=1000):
    g = torch.Generator().manual_seed(gen_seed + 97 * rank + k)
    return torch.randn(n, D_IN, generator=g)


# ---------------------------------------------------------------- case 1


class LateNet(nn.Module):
    """`late` first gets a gradient on the last (synced) microbatch."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(D_IN, D_HID)
        self.b = nn.Linear(D_HID, D_HID)
        self.late = nn.Linear(D_IN, D_HID)

    def forward(self, x, use_late):
        y = self.b(torch.relu(self.a(x)))
        if use_late:
            y = y + self.late(x)
        return y


def _loss(y):
    return (y.float() ** 2).sum() * 0.5


def grad_accumulation(rank, world_size, agreement="fake", cluster=None, microbatches=3):
    """Case 1: gradient accumulation under MixedPrecisionPolicy(bf16, fp32)."""
    torch.manual_seed(0)
    ref_model = LateNet()
    model = copy.deepcopy(ref_model)
    mesh = init_device_mesh("cpu", (world_size,))
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    _shard(model, [model.a], mesh, mp_policy)
    inst = _install(model, make_agreement(agreement, rank, world_size, cluster))
    spy = WireSpy()
    try:
        for k in range(microbatches):
            last = k == microbatches - 1
            model.set_requires_gradient_sync(last)
            _loss(model(_data(rank, k), use_late=last)).backward()
    finally:
        spy.close()
    grads = _full_grads(model)

    # Reference: every rank's microbatches on one bf16 copy, gradients
    # accumulated in fp32 as FSDP2 does, summed over ranks, divided by W.
    ref = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in ref_model.named_parameters()}
    for r in range(world_size):
        acc = {}
        for k in range(microbatches):
            last = k == microbatches - 1
            m = copy.deepcopy(ref_model).to(torch.bfloat16)
            _loss(m(_data(r, k).to(torch.bfloat16), use_late=last)).backward()
            for n, p in m.named_parameters():
                if p.grad is not None:
                    acc[n] = acc[n] + p.grad if n in acc else p.grad.float()
        for n, g in acc.items():
            ref[n] += g
    ref = {n: g / world_size for n, g in ref.items()}
    return {"grads": grads, "ref": ref, "wire": spy.calls, "stats": _stats(inst)}


# ---------------------------------------------------------------- case 2


class BranchNet(nn.Module):
    """`branch` is used on even ranks only (one FSDP unit)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(D_IN, D_HID)
        self.branch = nn.Linear(D_IN, D_HID)
        self.b = nn.Linear(D_HID, D_HID)

    def forward(self, x, use_branch):
        y = self.a(x)
        if use_branch:
            y = y + self.branch(x)
        return self.b(torch.relu(y))


def _uses_branch(rank):
    return rank % 2 == 0


def rank_branch(rank, world_size, agreement="fake", cluster=None, steps=2):
    """Case 2: a parameter used on some ranks only, inside one FSDP unit."""
    torch.manual_seed(0)
    ref_model = BranchNet()
    model = copy.deepcopy(ref_model)
    mesh = init_device_mesh("cpu", (world_size,))
    _shard(model, [], mesh)
    inst = _install(model, make_agreement(agreement, rank, world_size, cluster))
    spy = WireSpy()
    try:
        for k in range(steps):
            model.zero_grad(set_to_none=True)
            _loss(model(_data(rank, k), use_branch=_uses_branch(rank))).backward()
    finally:
        spy.close()
    grads = _full_grads(model)
    ref = {n: torch.zeros_like(p) for n, p in ref_model.named_parameters()}
    for r in range(world_size):
        m = copy.deepcopy(ref_model)
        _loss(m(_data(r, steps - 1), use_branch=_uses_branch(r))).backward()
        for n, p in m.named_parameters():
            if p.grad is not None:
                ref[n] += p.grad
    ref = {n: g / world_size for n, g in ref.items()}
    return {"grads": grads, "ref": ref, "wire": spy.calls, "stats": _stats(inst)}


# ---------------------------------------------------------------- case 3


class UnusedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(D_IN, D_HID)
        self.unused = nn.Linear(D_IN, D_HID)
        self.b = nn.Linear(D_HID, D_HID)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def unused_everywhere(rank, world_size, agreement="fake", cluster=None, unused_flag=None):
    """Case 3: a parameter used on no rank (optionally with FSDP2's
    set_reduce_scatter_unused_params switched on as well)."""
    torch.manual_seed(0)
    ref_model = UnusedNet()
    model = copy.deepcopy(ref_model)
    mesh = init_device_mesh("cpu", (world_size,))
    _shard(model, [], mesh, unused_flag=unused_flag)
    inst = _install(model, make_agreement(agreement, rank, world_size, cluster))
    wires = []
    for _ in range(2):  # the first step carries every trainable parameter
        model.zero_grad(set_to_none=True)
        spy = WireSpy()
        try:
            _loss(model(_data(rank, 0))).backward()
        finally:
            spy.close()
        wires.append(spy.calls)
    grads = _full_grads(model)
    ref = {n: None for n, _ in ref_model.named_parameters()}
    for r in range(world_size):
        m = copy.deepcopy(ref_model)
        _loss(m(_data(r, 0))).backward()
        for n, p in m.named_parameters():
            if p.grad is not None:
                ref[n] = p.grad.clone() if ref[n] is None else ref[n] + p.grad
    ref = {n: (g / world_size if g is not None else None) for n, g in ref.items()}
    # Elements FSDP2 reduce-scatters for the used parameters only.
    used = 0
    for n, p in ref_model.named_parameters():
        if ref[n] is not None:
            rows = -(-p.shape[0] // world_size) * world_size
            used += rows * (p.numel() // p.shape[0])
    return {
        "grads": grads,
        "ref": ref,
        "wire": wires,
        "used_numel": used,
        "stats": _stats(inst),
    }


# ---------------------------------------------------------------- case 4


def mixed_half_dtypes(rank, world_size, agreement="fake", cluster=None, guard=False):
    """Case 4: reduce_dtype=None with fp16 gradients on even ranks and bf16 on
    odd ranks. Zero-initialised weights keep the (2-byte) all-gather exact
    across the two dtypes, and small integer data keep every gradient exact,
    so the comparison with the reference is exact. The all-gathers differ in
    dtype across ranks, which the collective-sequence guard reports (it is
    off here unless `guard`; with it, the scenario returns the error)."""
    lin = nn.Linear(8, 6)
    nn.init.zeros_(lin.weight)
    nn.init.zeros_(lin.bias)
    model = nn.Sequential(lin)
    dtype = torch.float16 if rank % 2 == 0 else torch.bfloat16
    mesh = init_device_mesh("cpu", (world_size,))
    _shard(model, [], mesh, MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=None))
    ag = make_agreement(agreement, rank, world_size, cluster)
    if guard:
        import accord.torch

        accord.torch.install(model, ag)
        try:
            model(torch.zeros(4, 8)).sum().backward()
        except accord.torch.AccordDivergenceError as e:
            return {"error": str(e)}
        return {"error": None}
    inst = None
    if ag is not None:
        import accord.torch

        inst = accord.torch.install(model, ag, guard=False)

    def data(r):
        g = torch.Generator().manual_seed(7 + r)
        x = torch.randint(-2, 3, (4, 8), generator=g).float()
        t = torch.randint(-2, 3, (4, 6), generator=g).float()
        return x, t

    spy = WireSpy()
    try:
        x, t = data(rank)
        y = model(x)
        ((y - t.to(y.dtype)) ** 2).sum().backward()
    finally:
        spy.close()
    grads = _full_grads(model)
    ref = {"0.weight": torch.zeros(6, 8), "0.bias": torch.zeros(6)}
    for r in range(world_size):
        x, t = data(r)
        dy = -2 * t  # y == 0
        ref["0.weight"] += dy.T @ x
        ref["0.bias"] += dy.sum(0)
    ref = {n: g / world_size for n, g in ref.items()}
    return {"grads": grads, "ref": ref, "wire": spy.calls, "stats": _stats(inst)}


def _stats(inst):
    if inst is None:
        return None
    return {
        gid: (s.reductions, s.zero_filled, s.widened, s.skipped)
        for gid, s in inst.stats.items()
    }


# ---------------------------------------------------------------- case 5


class DeepBlock(nn.Module):
    def __init__(self, index):
        super().__init__()
        self.index = index
        self.main = nn.Linear(D_HID, D_HID)
        self.side = nn.Linear(D_HID, D_HID)

    def forward(self, y, use_side):
        z = torch.relu(self.main(y))
        if self.index == 4 and use_side:
            z = z + self.side(y)
        return z


class DeepNet(nn.Module):
    """Six blocks, each its own FSDP unit: block 2 runs twice on every rank,
    block 4's `side` layer only on even ranks, `side` of the others nowhere.
    The blocks' inputs require grad, so their post-backwards run during
    autograd (accord holds their reduce-scatters for the release)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D_IN, D_HID)
        self.blocks = nn.ModuleList(DeepBlock(i) for i in range(6))

    def forward(self, x, use_side):
        y = self.inp(x)
        for i, b in enumerate(self.blocks):
            y = b(y, use_side)
            if i == 2:
                y = y + b(y, use_side)  # the unit entered twice
        return y


def deep_speculation(rank, world_size, agreement="accord", cluster=None, speculate=True,
                     steps=2):
    """Case 5: gradients with and without speculation (bit-identical expected)."""
    torch.manual_seed(0)
    ref_model = DeepNet()
    model = copy.deepcopy(ref_model)
    mesh = init_device_mesh("cpu", (world_size,))
    _shard(model, list(model.blocks), mesh)
    ag = make_agreement(agreement, rank, world_size, cluster)
    import accord.torch

    inst = accord.torch.install(model, ag, speculate=speculate)
    spy = WireSpy()
    try:
        for k in range(steps):
            model.zero_grad(set_to_none=True)
            _loss(model(_data(rank, k), use_side=rank % 2 == 0)).backward()
    finally:
        spy.close()
    grads = _full_grads(model)
    ref = {n: None for n, _ in ref_model.named_parameters()}
    for r in range(world_size):
        m = copy.deepcopy(ref_model)
        _loss(m(_data(r, steps - 1), use_side=r % 2 == 0)).backward()
        for n, p in m.named_parameters():
            if p.grad is not None:
                ref[n] = p.grad.clone() if ref[n] is None else ref[n] + p.grad
    ref = {n: (g / world_size if g is not None else None) for n, g in ref.items()}
    t = inst.timing
    return {
        "grads": grads,
        "ref": ref,
        "wire": spy.calls,
        "stats": _stats(inst),
        "timing": (t.exposed_s, t.waits, t.held, t.speculated),
        "speculate": inst.speculate,
    }


# ---------------------------------------------------------------- case 6


class Blocks(nn.Module):
    """Four blocks (own FSDP units) of one shape, except that block 2 has no
    bias (fewer elements), then a last unit."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D_IN, D_HID)
        self.blocks = nn.ModuleList(nn.Linear(D_HID, D_HID, bias=i != 2) for i in range(4))
        self.wide = nn.Linear(D_HID, D_HID)

    def forward(self, x, order, use_wide=True):
        y = self.inp(x)
        for i in order:
            y = torch.relu(self.blocks[i](y))
        return self.wide(y) if use_wide else y


def sequence_guard(rank, world_size, agreement="accord", cluster=None, diverge="none",
                   diverge_step=0, steps=3, learn=False):
    """Case 6: the collective-sequence guard. diverge: "none"; "order" (the
    last rank runs blocks 0 and 3, same-sized, in swapped order: Gloo would
    reduce mismatched data without noticing); "skip" (the last rank skips
    block 2, a unit that is not marked optional: other sizes)."""
    import time

    import accord.torch

    torch.manual_seed(0)
    model = Blocks()
    mesh = init_device_mesh("cpu", (world_size,))
    _shard(model, list(model.blocks) + [model.wide], mesh)
    ag = make_agreement(agreement, rank, world_size, cluster)
    inst = accord.torch.install(model, ag, learn_optional=learn)
    guard = inst.guard
    waits_after_warmup = None
    last = rank == world_size - 1
    t0 = None
    try:
        for k in range(steps):
            order = [0, 1, 2, 3]
            use_wide = True
            if last and k == diverge_step and diverge == "order":
                order = [3, 1, 2, 0]
            if last and k == diverge_step and diverge == "skip":
                order = [0, 1, 3]
            if k == diverge_step:
                t0 = time.monotonic()
            model.zero_grad(set_to_none=True)
            _loss(model(_data(rank, k), order=order, use_wide=use_wide)).backward()
            # Step 1's tail goes during autograd (step 0 could not know where
            # the tail begins): new collectives; step 2 begins by checking
            # step 1's end. From step 2 on every step repeats step 1.
            if k == 2:
                waits_after_warmup = guard.blocking_waits
    except accord.torch.AccordDivergenceError as e:
        return {"error": str(e), "seconds": time.monotonic() - t0}
    return {
        "error": None,
        "learned": list(inst.learned),
        "waits_after_warmup": waits_after_warmup,
        "waits": guard.blocking_waits,
        "reports": guard.reports,
        "blocked_s": guard.blocked_s,
    }
