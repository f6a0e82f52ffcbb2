"""transformers' output-capture registry: the one place accord.torch touches
a private name of `transformers`."""

from __future__ import annotations

import sys

import torch

from accord.torch import fsdp2


def fix_transformers_output_capture(model: torch.nn.Module) -> int:
    """Lets `transformers` record hidden states inside FSDP units.

    transformers 5.x looks up which outputs a model can record by the name of
    the model's class; fully_shard swaps a unit's class for a subclass
    (`FSDPCLIPVisionModel`), so a vision tower sharded as its own unit stops
    returning hidden states and LLaVA-style models fail with "'NoneType' object
    is not subscriptable". This registers each such unit's class under its own
    name. Called by install(); safe to call again. Returns how many units it
    registered (0 without transformers).
    """
    capture = sys.modules.get("transformers.utils.output_capturing")
    registry = getattr(capture, "_CAN_RECORD_REGISTRY", None)
    if registry is None:
        return 0
    count = 0
    for module in model.modules():
        flags = getattr(module, "_can_record_outputs", None)
        if fsdp2.is_fsdp_module(module) and flags and not registry.get(module):
            registry[module] = flags
            count += 1
    return count
