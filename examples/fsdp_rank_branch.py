"""Case 2: a parameter used on some ranks only (a rank-dependent branch
inside one FSDP unit).

Without accord the ranks reduce-scatter buffers of different sizes: Gloo
fails or hangs (the launcher gives up after a timeout). With accord the
ranks without a gradient contribute zeros and every rank gets the correct
averaged gradient.

    python examples/fsdp_rank_branch.py
"""

import copy
import sys

import torch
import torch.nn as nn

from _launch import launch, report


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.branch, self.b = nn.Linear(12, 10), nn.Linear(12, 10), nn.Linear(10, 10)

    def forward(self, x, use_branch):
        y = self.a(x)
        if use_branch:
            y = y + self.branch(x)
        return self.b(torch.relu(y))


def data(rank):
    return torch.randn(4, 12, generator=torch.Generator().manual_seed(7 + rank))


def train(rank, world, client):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    ref_model = Net()
    model = copy.deepcopy(ref_model)
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    model.set_force_sum_reduction_for_comms(True)
    if client is not None:
        import accord.torch

        accord.torch.install(model, client)
    (model(data(rank), use_branch=rank == 0) ** 2).sum().backward()
    ref = {n: torch.zeros_like(p) for n, p in ref_model.named_parameters()}
    for r in range(world):
        m = copy.deepcopy(ref_model)
        (m(data(r), use_branch=r == 0) ** 2).sum().backward()
        for n, p in m.named_parameters():
            if p.grad is not None:
                ref[n] += p.grad / world
    for n, p in model.named_parameters():
        if p.grad is None:
            return f"{n} has no gradient"
        got = p.grad.full_tensor()
        if not torch.allclose(got, ref[n], rtol=1e-5, atol=1e-6):
            return f"{n} differs from the reference by {(got - ref[n]).abs().max():.3g}"
    return True


if __name__ == "__main__":
    without = report("FSDP2 without accord", launch(train, 2, with_accord=False, timeout_s=120))
    with_ = report("FSDP2 with accord", launch(train, 2, with_accord=True, timeout_s=180, job="rank-branch"))
    print(f"without accord: {'pass' if without else 'FAIL'}; with accord: {'pass' if with_ else 'FAIL'}")
    sys.exit(0 if (with_ and not without) else 1)
