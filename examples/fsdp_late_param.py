"""Case 1: gradient accumulation with MixedPrecisionPolicy(bf16, fp32) where a
parameter first gets a gradient on the synced microbatch.

Without accord FSDP2 fails ("FSDP reduce-scatter expects uniform gradient
dtype": fp32 accumulations next to a fresh bf16 gradient). With accord the
fresh gradient is widened to fp32 and the sharded gradients match a
single-process reference.

    python examples/fsdp_late_param.py
"""

import copy
import sys

import torch
import torch.nn as nn

from _launch import launch, report


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.late = nn.Linear(12, 10), nn.Linear(10, 10), nn.Linear(12, 10)

    def forward(self, x, use_late):
        y = self.b(torch.relu(self.a(x)))
        return y + self.late(x) if use_late else y


def data(rank, k):
    return torch.randn(4, 12, generator=torch.Generator().manual_seed(100 * rank + k))


def train(rank, world, client):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    ref_model = Net()
    model = copy.deepcopy(ref_model)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)), mp_policy=mp)
    model.set_force_sum_reduction_for_comms(True)  # Gloo's reduce-scatter and AVG
    if client is not None:
        import accord.torch

        accord.torch.install(model, client)
    for k in range(3):
        model.set_requires_gradient_sync(k == 2)
        (model(data(rank, k), use_late=k == 2).float() ** 2).sum().backward()
    # Single-process reference: bf16 compute, fp32 accumulation, mean over ranks.
    ref = {n: torch.zeros_like(p) for n, p in ref_model.named_parameters()}
    for r in range(world):
        for k in range(3):
            m = copy.deepcopy(ref_model).to(torch.bfloat16)
            (m(data(r, k).bfloat16(), use_late=k == 2).float() ** 2).sum().backward()
            for n, p in m.named_parameters():
                if p.grad is not None:
                    ref[n] += p.grad.float() / world
    for n, p in model.named_parameters():
        got = p.grad.full_tensor()
        if not torch.allclose(got, ref[n], rtol=1e-5, atol=1e-6):
            return f"{n} differs from the reference by {(got - ref[n]).abs().max():.3g}"
    return True


if __name__ == "__main__":
    without = report("FSDP2 without accord", launch(train, 2, with_accord=False, timeout_s=180))
    with_ = report("FSDP2 with accord", launch(train, 2, with_accord=True, timeout_s=180, job="late-param"))
    print(f"without accord: {'pass' if without else 'FAIL'}; with accord: {'pass' if with_ else 'FAIL'}")
    sys.exit(0 if (with_ and not without) else 1)
