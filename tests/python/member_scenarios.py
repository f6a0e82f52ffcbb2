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
