"""Expert parallel with FSDP2 (test_expert_parallel.py): 4 ranks, a (edp,
ep) = 2 x 2 mesh (rank = 2 * edp + ep). An MoE block of 4 stacked experts
(torchtitan's grouped form): EP rank e holds experts 2e and 2e + 1, tokens
go to their expert's EP rank and back by all-to-all within the EP group,
the experts are sharded over the expert-data-parallel group (the ranks with
the same e), the dense layers over all 4 ranks. Routing is drawn from a
seed per rank and step; some experts receive no token on some ranks, one
none anywhere.

Per-module experts (`per_module=True`): one `Expert` module per expert, each
its own `fully_shard` unit over the EDP group, at local paths `experts.0`,
`experts.1` on every rank (EP rank e's `experts.j` is global expert 2e + j:
equal paths, different modules across EP coordinates); an expert with no
token on a rank is not called there (no gradient). Routing per step and EP
group: PM_CHOICES for experts marked optional, LEARN_CHOICES for experts the
guard learns (their divergence must show at a forward all-gather of the
first step on every rank of the EDP pair)."""

import datetime
import traceback

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.nn.functional import all_to_all_single

D, E, T, STEPS = 8, 4, 6, 2
# Per step, the experts a token may be routed to: expert 3 gets none at
# step 0, expert 1 none at step 1.
CHOICES = [(0, 1, 2), (0, 2, 3)]


# Per-module experts: per step, per EP group (edp), the experts its tokens
# go to, in turn (each of them gets some). Marked optional: at step 0 expert 1 has tokens in EP group 0 only
# (the last expert of its EP rank: the peer that skips it goes on to the
# backward), expert 3 none; at step 1 expert 1 none, expert 2 in EP group 0
# only.
PM_CHOICES = [[(0, 1, 2), (0, 2)], [(0, 2, 3), (0, 3)]]
# Learned: at step 0 experts 0 and 2 (each EP rank's first) have tokens in EP
# group 0 only, so the peer that skips one all-gathers the next expert; at
# step 1 expert 0 none, expert 2 in EP group 1 only.
LEARN_CHOICES = [[(0, 1, 2, 3), (1, 3)], [(1, 3), (1, 2, 3)]]


def routes(rank, step, table=None):
    """(expert per token, tokens) of `rank` at `step`; `table`: PM_CHOICES
    or LEARN_CHOICES, the experts taken in turn (None: CHOICES, the stacked
    form's, drawn at random)."""
    g = torch.Generator().manual_seed(700 + 31 * rank + step)
    if table:
        choice = torch.tensor(table[step][rank // 2])
        turn = (torch.arange(T) + rank) % len(choice)
        return choice[turn], torch.randn(T, D, generator=g)
    choice = torch.tensor(CHOICES[step])
    return choice[torch.randint(0, len(choice), (T,), generator=g)], torch.randn(T, D, generator=g)


class Experts(nn.Module):
    """Stacked experts `first`, `first + 1`, ...: one weight per expert."""

    def __init__(self, w, first):
        super().__init__()
        self.w, self.first = nn.Parameter(w), first

    def forward(self, h, idx):
        return torch.einsum("nd,nde->ne", h, self.w[idx - self.first])


class Expert(nn.Module):
    """One expert of the per-module form."""

    def __init__(self, w):
        super().__init__()
        self.w = nn.Parameter(w)

    def forward(self, h):
        return h @ self.w


class PerModuleExperts(nn.ModuleList):
    """Experts `first`, `first + 1`, ..., one module each; an expert with no
    token is not called."""

    def __init__(self, ws, first):
        super().__init__(Expert(w) for w in ws)
        self.first = first

    def forward(self, h, idx):
        y = torch.zeros(len(idx), D)
        for j, expert in enumerate(self):
            rows = (idx == self.first + j).nonzero().flatten()
            if len(rows):
                y = y.index_copy(0, rows, expert(h[rows]))
        return y


class MoE(nn.Module):
    """Dense in and out projections around stacked (or per-module)
    experts; `experts`: which global experts this module holds (all 4 for
    the reference)."""

    def __init__(self, experts, per_module=False):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.out = nn.Linear(D, D), nn.Linear(D, D)
        full = torch.randn(E, D, D) * 0.3
        held = full[experts[0]:experts[-1] + 1].clone()
        self.experts = PerModuleExperts(held, experts[0]) if per_module else \
            Experts(held, experts[0])

    def forward(self, x, route, ep=None):
        h = self.inp(x)
        y = self.experts(h, route) if ep is None else self._dispatch(h, route, *ep)
        return self.out(torch.tanh(y))

    def _dispatch(self, h, route, group, e, peer_routes):
        """Tokens to their expert's EP rank and back; `peer_routes[j]`: the
        routes of the EP group's rank j (known from the seeds)."""
        dest = route // 2
        order = torch.argsort(dest, stable=True)
        send = [int((dest == j).sum()) for j in range(2)]
        recv = [int((r // 2 == e).sum()) for r in peer_routes]
        got = all_to_all_single(torch.empty(sum(recv), D), h[order], recv, send, group=group)
        idx = torch.cat([r[r // 2 == e] for r in peer_routes])
        back = all_to_all_single(torch.empty(len(route), D), self.experts(got, idx), send, recv,
                                 group=group)
        return torch.empty_like(back).index_copy(0, order, back)


def reference(table=None):
    """Per step: the gradients of the 4 ranks' summed losses on one model
    (per-module experts with a routing `table`), divided by each group's
    FSDP mesh size (None: used by no rank)."""
    model = MoE(list(range(E)), table is not None)
    out = []
    for step in range(STEPS):
        model.zero_grad(set_to_none=True)
        for r in range(4):
            route, x = routes(r, step, table)
            model(x, route).pow(2).sum().backward()
        # FSDP2 averages over each group's mesh: 4 ranks, 2 for the experts.
        out.append({n: None if p.grad is None else
                    p.grad / (2 if n.startswith("experts.") else 4)
                    for n, p in model.named_parameters()})
    return out


def run_ep(rank, world_size, cluster=None, use_accord=True, per_module=False, optional=True,
           group_timeout_s=None):
    """One rank. Per-module experts are each their own FSDP unit, marked
    optional unless `optional` is False (the guard learns them); every
    process group gets `group_timeout_s` when given (FSDP2 alone: a hang is an
    error)."""
    from fsdp_scenarios import make_agreement

    import accord.torch

    edp, e = rank // 2, rank % 2
    table = (PM_CHOICES if optional else LEARN_CHOICES) if per_module else None
    kw = {} if group_timeout_s is None else {
        "timeout": datetime.timedelta(seconds=group_timeout_s)}
    grid = torch.arange(4).view(2, 2)
    ep_groups = [dist.new_group(row.tolist(), **kw) for row in grid]
    edp_groups = [dist.new_group(col.tolist(), **kw) for col in grid.t()]
    ep_group, edp_group = ep_groups[edp], edp_groups[e]
    world = DeviceMesh.from_group(dist.new_group(list(range(4)), **kw), "cpu",
                                  mesh_dim_names=("dp",))
    edp_mesh = DeviceMesh.from_group(edp_group, "cpu", mesh_dim_names=("edp",))
    model = MoE([2 * e, 2 * e + 1], per_module)
    for unit in (model.experts if per_module else [model.experts]):
        fully_shard(unit, mesh=edp_mesh)
    fully_shard(model, mesh=world)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)
    result = {"outcome": "ok", "grads": [], "rank": rank}
    try:
        inst = None
        if use_accord:
            marked = list(model.experts) if per_module and optional else []
            inst = accord.torch.install(model, make_agreement("accord", rank, world_size, cluster),
                                        optional=marked)
            result["registered"] = [(r[0], list(r[4]) if len(r) > 4 else None)
                                    for r in inst.negotiation.registrations()]
        for step in range(STEPS):
            route, x = routes(rank, step, table)
            peers = [routes(2 * edp + j, step, table)[0] for j in range(2)]
            model(x, route, (ep_group, e, peers)).pow(2).sum().backward()
            grads = {}
            for n, p in model.named_parameters():
                grads[n] = None if p.grad is None else p.grad.full_tensor().detach().clone()
            result["grads"].append(grads)
            model.zero_grad(set_to_none=True)
        if inst is not None:
            result["learned"] = list(inst.learned)
            inst.uninstall()
    except Exception as ex:  # noqa: BLE001 - the outcome, checked by the test
        result["outcome"] = f"{type(ex).__name__}: {ex}"
        result["traceback"] = traceback.format_exc()[-3000:]
    if rank == 0:
        result["ref"] = reference(table)
    return result
