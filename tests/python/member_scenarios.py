"""An optional unit whose FSDP groups have different member sets
(test_participation.py): a mixture-of-experts layer sharded with one
fully_shard over every rank, its expert's parameters on the expert
data-parallel mesh (shard_placement_fn), marked optional."""

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard

D = 8


class Moe(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = nn.Linear(D, D)
        self.expert = nn.Linear(D, D)

    def forward(self, x):
        return self.expert(self.router(x))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.moe = Moe()

    def forward(self, x):
        return self.moe(self.inp(x))


def unit_spanning_two_member_sets(rank, world_size):
    from torch.distributed.fsdp._fully_shard._fsdp_common import (FSDPMeshInfo,
                                                                  ShardPlacementResult)

    import accord.torch
    from accord.torch import fsdp2
    from fake_agreement import FakeGlooAgreement

    torch.manual_seed(0)
    dp = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    edp = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("ep", "edp"))["edp"]
    experts = FSDPMeshInfo(mesh=edp, shard_mesh_dim=0)
    model = Model()
    expert_params = set(model.moe.expert.parameters())
    fully_shard(model.moe, mesh=dp, shard_placement_fn=lambda p: ShardPlacementResult(
        Shard(0), experts) if p in expert_params else None)
    fully_shard(model, mesh=dp)
    out = {"groups": len(fsdp2.param_groups(model.moe))}
    try:
        accord.torch.install(model, FakeGlooAgreement(), optional=[model.moe])
    except ValueError as e:
        out["error"] = str(e)
    return out


class TpBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(D, 2 * D)
        self.down = nn.Linear(2 * D, D)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class TpModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = TpBlock()
        self.head = nn.Linear(D, D)

    def forward(self, x):
        return self.head(self.block(x))


def tp_fsdp_steady(rank, world_size, cluster, steps):
    """TP x FSDP on a (dp, tp) 2 x 2 mesh (rank = 2 * dp rank + tp rank), the
    block's MLP tensor parallel, every module sharded over its TP
    coordinate's dp ranks, the same batch every step: each rank's groups
    have the member set of its TP coordinate, and the release batches of
    both carry one sync_key (docs/MEMBERS.md 2.11)."""
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    import accord.torch
    from fsdp_scenarios import make_agreement

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("dp", "tp"))
    model = TpModel()
    parallelize_module(model.block, mesh["tp"], {"up": ColwiseParallel(),
                                                 "down": RowwiseParallel()})
    fully_shard(model.block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    inst = accord.torch.install(model, make_agreement("accord", rank, world_size, cluster))
    x = torch.randn(4, D, generator=torch.Generator().manual_seed(rank // 2))
    for _ in range(steps):
        model(x).sum().backward()
        model.zero_grad(set_to_none=True)
    out = {"sync_key": inst.negotiation.sync_key(), "groups": sorted(inst.groups),
           "members": inst.members}
    inst.uninstall()
    return out
