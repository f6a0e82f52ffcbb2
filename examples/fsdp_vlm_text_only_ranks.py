"""A vision-language model whose vision tower is its own FSDP unit, with a
text-only rank: the case that breaks FSDP2 in forward.

The model is LLaVA from `transformers` (a CLIP vision tower and a Llama
language model, built from a tiny config with random weights; nothing is
downloaded). Rank 0's batch has images, rank 1's is text only, so only rank 0
runs the vision tower's forward and its all-gather.

Without accord rank 1's next all-gather (a decoder layer) meets rank 0's
all-gather of the vision tower: Gloo aborts with a collective mismatch (NCCL
would hang). With `accord.torch.install(model, client, optional=[tower])`
every rank all-gathers the tower at the same point, the tower's
reduce-scatter is agreed like any other (rank 1 contributes zeros), and the
gradients equal a single-process reference on both ranks' data.

    pip install transformers==5.24.0      # scripts/deps installs it
    python examples/fsdp_vlm_text_only_ranks.py
"""

import copy
import sys

import torch

from _launch import launch, report

IMAGE_TOKEN = 63


def tiny_llava():
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
    )

    vision = CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                              num_attention_heads=2, image_size=16, patch_size=8,
                              projection_dim=16)
    text = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=2, vocab_size=64,
                       max_position_embeddings=64)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN,
                         vision_feature_select_strategy="default", vision_feature_layer=-1,
                         image_seq_length=4)
    torch.manual_seed(0)
    return LlavaForConditionalGeneration(config)


def batch(rank):
    g = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(0, 60, (2, 10), generator=g)
    inputs = {"input_ids": ids}
    if rank == 0:  # images on rank 0 only
        ids[:, 1:5] = IMAGE_TOKEN
        inputs["pixel_values"] = torch.randn(2, 3, 16, 16, generator=g)
    labels = ids.clone()
    labels[ids == IMAGE_TOKEN] = -100
    inputs["labels"] = labels
    return inputs


def train(rank, world, client):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import accord.torch

    ref_model = tiny_llava()
    model = copy.deepcopy(ref_model)
    mesh = init_device_mesh("cpu", (world,))
    tower = model.model.vision_tower
    fully_shard(tower, mesh=mesh)  # the tower is its own FSDP unit
    for layer in model.model.language_model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.set_force_sum_reduction_for_comms(True)
    # transformers finds a sharded tower's hidden states by class name; this
    # registers the FSDP subclass (install() does it too).
    accord.torch.fix_transformers_output_capture(model)
    if client is not None:
        accord.torch.install(model, client, optional=[tower])
    model(**batch(rank)).loss.backward()

    ref = {}
    for r in range(world):
        m = copy.deepcopy(ref_model)
        m(**batch(r)).loss.backward()
        for n, p in m.named_parameters():
            if p.grad is not None:
                ref[n] = ref.get(n, 0) + p.grad / world
    checked = 0
    for n, p in model.named_parameters():
        if n not in ref:
            if p.grad is not None:
                return f"{n} is used on no rank but has a gradient"
            continue
        if p.grad is None:
            return f"{n} has no gradient"
        got = p.grad.full_tensor()
        err = float((got - ref[n]).norm() / ref[n].norm().clamp_min(1e-12))
        if err > 1e-5:
            return f"{n} differs from the reference (relative error {err:.2e})"
        checked += 1
    return True if checked else "no gradient was checked"


if __name__ == "__main__":
    without = report("FSDP2 without accord", launch(train, 2, with_accord=False, timeout_s=30))
    with_ = report("FSDP2 with accord (optional=[vision tower])",
                   launch(train, 2, with_accord=True, timeout_s=180, job="vlm-text-only"))
    print(f"without accord: {'pass' if without else 'FAIL'}; "
          f"with accord: {'pass' if with_ else 'FAIL'}")
    sys.exit(0 if (with_ and not without) else 1)
