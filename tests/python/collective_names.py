"""The torch.distributed functions FSDP2 issues its collectives through,
for the tests' spies: torch 2.13 calls all_gather_single and
reduce_scatter_single, torch 2.11 all_gather_into_tensor and
reduce_scatter_tensor (same tensors, output first)."""

import torch.distributed as dist


def fsdp2_collectives():
    """(all-gather function name, reduce-scatter function name) in this torch."""
    if hasattr(dist, "all_gather_single") and hasattr(dist, "reduce_scatter_single"):
        return "all_gather_single", "reduce_scatter_single"
    return "all_gather_into_tensor", "reduce_scatter_tensor"
