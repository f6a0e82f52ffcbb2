"""DeepSpeed's own MoE layer (deepspeed.moe.layer.MoE, expert parallel) under
ZeRO-1/2, for tests/python/test_deepspeed_moe.py; launched with
deepspeed_scenarios.run_ds_ranks.

The model: `embed`, an MoE layer of E experts (Linear(HID, HID)) with
`ep_size` ranks per expert-parallel group, `head`. DeepSpeed's expert-parallel
groups are consecutive ranks ({0, 1}, {2, 3}), its expert-data-parallel
(EDP) groups strided ({0, 2}, {1, 3}); rank r holds global experts
[ep_rank x E / ep_size, ...) under the local names `...deepspeed_experts.<j>`.
Each token's expert is chosen by the batch: a large one-hot added to the
hidden state's first E features, which the gate (initialised to read them)
follows. `route(case, rank, step)` says which experts a rank's tokens go to,
or None where this rank skips the MoE layer (its whole expert-parallel group
does: the layer's all-to-all pairs the group's ranks). The reference is the
same model in plain torch, from every rank's full parameters.
"""

import os
import sys

import deepspeed_scenarios as sc

IN, HID, TOKENS, SIGNAL = 8, 16, 4, 8.0


def route(case, rank, step):
    """The experts of this rank's TOKENS tokens, or None: the layer is skipped."""
    if case == "mixed":
        # 0: expert 1 gets no token on any rank; 1: no rank runs the layer;
        # then rank 1 sends no token to expert 1, the other ranks do.
        if step == 0:
            return [0] * TOKENS
        if step == 1:
            return None
        return [0] * TOKENS if rank == 1 else [0, 1, 0, 1]
    if case == "ep_group_1_skips":
        # 1: ranks 2 and 3 (expert-parallel group 1) skip the layer; 2: every
        # rank does; otherwise every rank runs it, rank 3 sending expert 1 no token.
        if step == 2 or (step == 1 and rank >= 2):
            return None
        return [0] * TOKENS if rank == 3 else [rank % 2, 0, 1, rank % 2]
    raise ValueError(case)


def make_model(num_experts, ep_size):
    import torch
    from torch import nn
    from deepspeed.moe.layer import MoE

    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Linear(IN, HID)
            # Capacity = tokens: nothing dropped; no random token selection.
            self.moe = MoE(HID, nn.Linear(HID, HID), num_experts=num_experts, ep_size=ep_size,
                           k=1, capacity_factor=float(num_experts), min_capacity=0,
                           use_rts=False)
            self.head = nn.Linear(HID, 1)
            with torch.no_grad():
                wg = self.moe.deepspeed_moe.gate.wg.weight
                wg.zero_()
                wg[:, :num_experts] = torch.eye(num_experts)

        def forward(self, x, experts=None):
            h = self.embed(x)
            if experts is not None:
                h = h + SIGNAL * nn.functional.one_hot(torch.tensor(experts), HID).to(h.dtype)
                h, _, _ = self.moe(h)
            return self.head(torch.tanh(h)).pow(2).mean()

    return Net()


def _reference_loss(p, x, experts, num_experts):
    """The same model in plain torch from full parameters (`p`: global names)."""
    import torch

    h = torch.nn.functional.linear(x, p["embed.weight"], p["embed.bias"])
    if experts is not None:
        h = h + SIGNAL * torch.nn.functional.one_hot(torch.tensor(experts), HID).to(h.dtype)
        gates = torch.softmax(h @ p["gate"].t(), dim=1)
        chosen = gates.argmax(dim=1)
        rows = []
        for t in range(h.shape[0]):
            e = int(chosen[t])
            y = torch.nn.functional.linear(h[t], p[f"expert{e}.weight"], p[f"expert{e}.bias"])
            rows.append(gates[t, e] * y)
        h = torch.stack(rows)
    return torch.nn.functional.linear(torch.tanh(h), p["head.weight"], p["head.bias"]).pow(2).mean()


def global_name(name, rank, num_experts, ep_size):
    """The model's parameter name -> the reference's (experts by global index)."""
    if ".gate.wg." in name:
        return "gate"
    if ".deepspeed_experts." in name:
        local = int(name.split(".deepspeed_experts.")[1].split(".")[0])
        e = (rank % ep_size) * (num_experts // ep_size) + local
        return f"expert{e}.{name.rsplit('.', 1)[1]}"
    return name


def batch(rank, step, case):
    import torch

    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(TOKENS, IN, generator=g), route(case, rank, step)


def _reference(full, world_size, step, case, num_experts):
    """Gradients of the mean over ranks of each rank's loss, by global name."""
    import torch

    p = {n: t.clone().requires_grad_(True) for n, t in full.items()}
    total = sum(_reference_loss(p, *batch(r, step, case), num_experts)
                for r in range(world_size)) / world_size
    total.backward()
    return {n: (None if t.grad is None else t.grad.detach()) for n, t in p.items()}


def _gather_full(params, rank, num_experts, ep_size):
    """Every rank's full fp32 parameters by global name (all ranks call it)."""
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_fp32_param

    mine = {global_name(n, rank, num_experts, ep_size): safe_get_full_fp32_param(p).clone()
            for n, p in params.items()}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    out = {}
    for d in every:
        out.update(d)
    return out


def _trace_reduce(record):
    """Also records torch.distributed.reduce (ZeRO-1/2 reduce a bucket's
    slices to their owners), with the size of the group it runs on."""
    import torch.distributed as dist

    own = dist.reduce

    def traced(tensor, *args, **kwargs):
        group = kwargs.get("group")
        if record is not None:
            record.append(("reduce", (tensor.numel(),), dist.get_world_size(group=group)))
        return own(tensor, *args, **kwargs)

    dist.reduce = traced


def _local_state(engine, params):
    """Per parameter, this rank's slice of its fp32 partition and of each Adam
    moment (DeepSpeed 0.19.8 links the optimizer state of its first parameter
    group only, so safe_get_full_optimizer_state fails for the expert groups)."""
    opt = engine.optimizer
    out = {}
    for n, p in params.items():
        m = getattr(p, "_hp_mapping", None)
        if m is None:
            out[n] = []
            continue
        flat = opt.single_partition_of_fp32_groups[m.param_group_index]
        a = m.hp_fragment_address
        state = opt.optimizer.state.get(flat, {})
        out[n] = [m.hp_fragment.clone()] + [state[k].narrow(0, a.start, a.numel).clone()
                                            for k in ("exp_avg", "exp_avg_sq") if k in state]
    return out


def train(rank, world_size, stage=2, case="tokenless_on_1", steps=3, num_experts=2, ep_size=2,
          accord="none", record=False, wd=0.1, zero=None):
    """Trains `steps` steps; per step, by the model's local names: the reduced
    gradients (before engine.step()), the reference's for this rank's experts,
    the fp32 parameters and Adam moments before and after the step."""
    import torch
    import deepspeed
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

    collectives = [] if record else None
    if record or os.environ.get("ACCORD_TEST_TRACE"):
        sc._trace_collectives(collectives)
        _trace_reduce(collectives)
    model = make_model(num_experts, ep_size)
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "params"})
    opt = torch.optim.AdamW(groups, lr=1e-2, weight_decay=wd)
    cfg = sc.ds_config(stage, world_size)
    cfg["zero_optimization"].update(zero or {})
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    inst = None
    if accord != "none":
        from accord import deepspeed as accord_ds

        inst = accord_ds.install(engine, timeout_s=30.0)
    params = dict(engine.module.named_parameters())
    names = list(params)
    out = []
    for step in range(steps):
        full = _gather_full(params, rank, num_experts, ep_size)
        ref = _reference(full, world_size, step, case, num_experts)
        start = {n: safe_get_full_fp32_param(params[n]).clone() for n in names}
        x, experts = batch(rank, step, case)
        engine.backward(engine(x, experts))
        grads = {n: safe_get_full_grad(params[n]).detach().float().clone() for n in names}
        moments = _local_state(engine, params)
        engine.step()
        after = {n: safe_get_full_fp32_param(params[n]).clone() for n in names}
        after_moments = _local_state(engine, params)
        sc.DONE[0] = step + 1
        print(f"accord-test: steps done {sc.DONE[0]}", file=sys.stderr, flush=True)
        out.append({"grads": grads, "start": start, "after": after, "moments": moments,
                    "after_moments": after_moments,
                    "ref": {n: ref[global_name(n, rank, num_experts, ep_size)] for n in names}})
    tail = {"collectives": collectives, "experts": [global_name(n, rank, num_experts, ep_size)
                                                    for n in names]}
    if inst is not None:
        import dataclasses

        tail["stats"] = dataclasses.asdict(inst.stats)
        inst.uninstall()
    out.append(tail)
    return out
