"""A torchrun entry point for test_order.py: runs order_scenarios.zoo on this
rank with the cluster named in ACCORD_TEST_CLUSTER (or, without it, with
accord.torch.install(model) and nothing set) and saves what it returns to
ACCORD_TEST_OUT/rank<R>.pt."""

import json
import os

import torch
import torch.distributed as dist

import order_scenarios as osc

if __name__ == "__main__":
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    cluster = os.environ.get("ACCORD_TEST_CLUSTER")
    if cluster:
        result = osc.zoo(rank, world_size, cluster=json.loads(cluster), steps=3, seed=3)
    else:  # nothing set: accord.torch.install(model) alone
        result = osc.zoo(rank, world_size, agreement="auto", steps=3, seed=4)
    torch.save(result, os.path.join(os.environ["ACCORD_TEST_OUT"], f"rank{rank}.pt"))
    dist.barrier()
