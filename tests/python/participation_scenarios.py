"""Rank-divergent FSDP unit participation on real `transformers` model code.

Run on every rank by test_participation.py and examples/vlm_text_only_ranks.py.
Each case builds a tiny model from a config (random weights, no download),
shards it with FSDP2 on a CPU mesh over Gloo, and trains a step in which ranks
run an FSDP unit's forward a different number of times:

- "vlm": a LLaVA model (CLIP vision tower + Llama) whose vision tower is its
  own FSDP unit. Per rank and microbatch the modality is "text" (the tower does
  not run), "image" (it runs once, through LLaVA's own forward) or "both" (it
  runs a second time on video frames, the way video-language trainers reuse
  one tower for images and video).
- "layerdrop": a Llama causal LM in which one decoder layer (its own FSDP
  unit) is dropped on some ranks, as LayerDrop / stochastic depth does.

A case returns the full gradients (gathered from the shards), a
single-process reference on the same data, every collective this rank issued
(kind, element count, dtype, in order) and accord's per-unit participation.
"""

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from collective_names import fsdp2_collectives
from fsdp_scenarios import _full_grads, make_agreement

IMAGE_TOKEN = 63
SEQ = 10


class CollectiveSpy:
    """Records (kind, numel, dtype) of every all-gather and reduce-scatter."""

    def __init__(self):
        self.calls = []
        self._orig = {}
        for kind, name in zip(("AG", "RS"), fsdp2_collectives()):
            orig = getattr(dist, name)
            self._orig[name] = orig

            def spy(output, input, *args, _kind=kind, _orig=orig, **kwargs):
                self.calls.append((_kind, input.numel(), str(input.dtype).replace("torch.", "")))
                return _orig(output, input, *args, **kwargs)

            setattr(dist, name, spy)

    def close(self):
        for name, orig in self._orig.items():
            setattr(dist, name, orig)


def tiny_llava():
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
    )

    vision = CLIPVisionConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=16,
        patch_size=8,
        projection_dim=16,
    )
    text = LlamaConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=64,
        max_position_embeddings=64,
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=IMAGE_TOKEN,
        vision_feature_select_strategy="default",  # 4 patch tokens per 16x16 image
        vision_feature_layer=-1,
        image_seq_length=4,
    )
    return LlavaForConditionalGeneration(config)


class VLMJob(nn.Module):
    """The VLM's own forward for text and images; video frames enter the same
    vision tower a second time (features of every frame, pooled into the loss)."""

    def __init__(self, vlm):
        super().__init__()
        self.vlm = vlm

    def forward(self, input_ids, labels, pixel_values=None, video=None, **extra):
        loss = self.vlm(input_ids=input_ids, pixel_values=pixel_values, labels=labels,
                        **extra).loss
        if video is not None:
            frames = self.vlm.model.get_image_features(pixel_values=video).pooler_output
            if isinstance(frames, (list, tuple)):
                frames = torch.stack(list(frames))
            loss = loss + 0.1 * frames.float().pow(2).mean()
        return loss


class Droppable(nn.Module):
    """A decoder layer that returns its input unchanged while `drop` is set."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer
        self.drop = False

    def forward(self, hidden_states, *args, **kwargs):
        if self.drop:
            return hidden_states
        return self.layer(hidden_states, *args, **kwargs)


class LayerDropJob(nn.Module):
    def __init__(self, lm):
        super().__init__()
        self.lm = lm
        layers = lm.model.layers
        for i in range(len(layers)):
            layers[i] = Droppable(layers[i])

    def forward(self, input_ids, labels, drop=()):
        for i, layer in enumerate(self.lm.model.layers):
            layer.drop = i in drop
        try:
            return self.lm(input_ids=input_ids, labels=labels).loss
        finally:
            for layer in self.lm.model.layers:
                layer.drop = False


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=64,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(config)


def tiny_paligemma():
    from transformers import (
        GemmaConfig,
        PaliGemmaConfig,
        PaliGemmaForConditionalGeneration,
        SiglipVisionConfig,
    )

    vision = SiglipVisionConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=16,
        patch_size=8,
    )
    text = GemmaConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        vocab_size=64,
    )
    config = PaliGemmaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=IMAGE_TOKEN,
        projection_dim=16,
        hidden_size=16,
    )
    return PaliGemmaForConditionalGeneration(config)


def tiny_qwen2vl():
    """Qwen2-VL: its `visual` tower runs once for images and once more for
    videos when a batch has both (what video-language RL trainers hit)."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    config = Qwen2VLConfig(
        text_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, vocab_size=80,
                         max_position_embeddings=128,
                         rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=2, embed_dim=16, hidden_size=32, num_heads=2, patch_size=4,
                           spatial_merge_size=2, temporal_patch_size=2, in_chans=3,
                           mlp_ratio=2),
        image_token_id=QWEN_IMAGE, video_token_id=QWEN_VIDEO,
        vision_start_token_id=QWEN_START, vision_end_token_id=QWEN_END,
    )
    return Qwen2VLForConditionalGeneration(config)


QWEN_IMAGE, QWEN_VIDEO, QWEN_START, QWEN_END = 70, 71, 72, 73
QWEN_PATCH = 3 * 2 * 4 * 4  # channels x temporal patch x patch x patch


def qwen_batch(what, g, n):
    ids = torch.randint(0, 60, (n, SEQ), generator=g)
    out = {}
    if what in ("image", "both"):  # one 8x8 image per sample: 4 patches, 1 token
        ids[:, 2], ids[:, 3], ids[:, 4] = QWEN_START, QWEN_IMAGE, QWEN_END
        out["pixel_values"] = torch.randn(4 * n, QWEN_PATCH, generator=g)
        out["image_grid_thw"] = torch.tensor([[1, 2, 2]] * n)
    if what == "both":  # one 2-frame 8x8 video per sample: 8 patches, 2 tokens
        ids[:, 6], ids[:, 7], ids[:, 8], ids[:, 9] = QWEN_START, QWEN_VIDEO, QWEN_VIDEO, QWEN_END
        out["pixel_values_videos"] = torch.randn(8 * n, QWEN_PATCH, generator=g)
        out["video_grid_thw"] = torch.tensor([[2, 2, 2]] * n)
    if what != "text":
        out["mm_token_type_ids"] = (ids == QWEN_IMAGE).int() + 2 * (ids == QWEN_VIDEO).int()
    labels = ids.clone()
    labels[(ids == QWEN_IMAGE) | (ids == QWEN_VIDEO)] = -100
    out.update(input_ids=ids, labels=labels)
    return out


def build(model_kind):
    """The job model, from a fixed seed."""
    torch.manual_seed(0)
    if model_kind == "vlm":
        return VLMJob(tiny_llava())
    if model_kind == "paligemma":
        return VLMJob(tiny_paligemma())
    if model_kind == "qwen2vl":
        return VLMJob(tiny_qwen2vl())
    if model_kind == "layerdrop":
        return LayerDropJob(tiny_llama())
    raise ValueError(model_kind)


def units_of(job, model_kind):
    """(path, module) of every FSDP unit below the root, and the optional paths."""
    if model_kind in ("vlm", "paligemma"):
        inner = job.vlm.model
        units = [("vlm.model.vision_tower", inner.vision_tower)]
        units += [
            (f"vlm.model.language_model.layers.{i}", layer)
            for i, layer in enumerate(inner.language_model.layers)
        ]
        return units, ["vlm.model.vision_tower"]
    if model_kind == "qwen2vl":
        inner = job.vlm.model
        units = [("vlm.model.visual", inner.visual)]
        units += [
            (f"vlm.model.language_model.layers.{i}", layer)
            for i, layer in enumerate(inner.language_model.layers)
        ]
        return units, ["vlm.model.visual"]
    layers = job.lm.model.layers
    return [(f"lm.model.layers.{i}.layer", l.layer) for i, l in enumerate(layers)], [
        "lm.model.layers.1.layer"
    ]


def batch(model_kind, what, rank, k, n=2):
    """The inputs of rank `rank`, microbatch `k`; `what` is the modality
    ("text", "image", "both") or, for layerdrop, the tuple of dropped layers."""
    g = torch.Generator().manual_seed(1000 + 97 * rank + k)
    if model_kind == "qwen2vl":
        return qwen_batch(what, g, n)
    ids = torch.randint(0, 60, (n, SEQ), generator=g)
    if model_kind == "layerdrop":
        return {"input_ids": ids, "labels": ids.clone(), "drop": tuple(what)}
    out = {"input_ids": ids, "labels": None}
    if what in ("image", "both"):
        ids[:, 1:5] = IMAGE_TOKEN
        out["pixel_values"] = torch.randn(n, 3, 16, 16, generator=g)
    if what == "both":
        out["video"] = torch.randn(3, 3, 16, 16, generator=g)
    labels = ids.clone()
    labels[ids == IMAGE_TOKEN] = -100
    out["labels"] = labels
    return out


def _cast(inputs, dtype):
    return {
        k: (v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
        for k, v in inputs.items()
    }


def run_case(
    rank,
    world_size,
    model_kind,
    plan,
    agreement="accord",
    cluster=None,
    mp="fp32",
    reduce_dtype=None,
    use_optional=True,
):
    """One training step of `model_kind`; plan[r][k] is rank r's microbatch k
    (a modality, or the layers dropped). mp: "fp32" or "bf16" parameters;
    reduce_dtype: None or "float32"."""
    ref_job = build(model_kind)
    job = copy.deepcopy(ref_job)
    mesh = init_device_mesh("cpu", (world_size,))
    param_dtype = torch.bfloat16 if mp == "bf16" else None
    reduce = getattr(torch, reduce_dtype) if reduce_dtype else None
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce)
    units, optional = units_of(job, model_kind)
    for _, unit in units:
        fully_shard(unit, mesh=mesh, mp_policy=policy)
    fully_shard(job, mesh=mesh, mp_policy=policy)
    for m in job.modules():
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)
    import accord.torch

    # Without this, transformers drops the vision tower's hidden states once
    # it is an FSDP unit (install() calls it too).
    accord.torch.fix_transformers_output_capture(job)
    inst = None
    ag = make_agreement(agreement, rank, world_size, cluster)
    if ag is not None:
        inst = accord.torch.install(job, ag, optional=optional if use_optional else ())
    microbatches = len(plan[rank])
    spy = CollectiveSpy()
    losses = []
    try:
        for k in range(microbatches):
            job.set_requires_gradient_sync(k == microbatches - 1)
            loss = job(**batch(model_kind, plan[rank][k], rank, k))
            loss.backward()
            losses.append(float(loss.detach()))
    finally:
        spy.close()
    grads = _full_grads(job)

    # Reference: every rank's microbatches on one unsharded copy (in the
    # parameter dtype), gradients accumulated in fp32, summed over ranks, / W.
    ref = {n: None for n, _ in ref_job.named_parameters()}
    for r in range(world_size):
        for k in range(len(plan[r])):
            m = copy.deepcopy(ref_job)
            inputs = batch(model_kind, plan[r][k], r, k)
            if param_dtype is not None:
                m = m.to(param_dtype)
                inputs = _cast(inputs, param_dtype)
            m(**inputs).backward()
            for n, p in m.named_parameters():
                if p.grad is not None:
                    g = p.grad.float()
                    ref[n] = g if ref[n] is None else ref[n] + g
    ref = {n: (g / world_size if g is not None else None) for n, g in ref.items()}
    participation = None
    learned = list(inst.learned) if inst is not None else None
    if inst is not None:
        participation = {
            name: (p.steps, p.skipped, p.ran, p.repeated)
            for name, p in inst.participation.items()
        }
        inst.uninstall()
    return {
        "grads": grads,
        "ref": ref,
        "collectives": spy.calls,
        "participation": participation,
        "learned": learned,
        "losses": losses,
    }


def run_cases(rank, world_size, cases, cluster_jobs=None):
    """Runs several cases in one process group; cluster_jobs[i] is case i's
    job on the accord cluster (None for plain FSDP2). A failing case is
    returned as its error text, and ends the run (the process group may be out
of step after it)."""
    import traceback

    jobs = cluster_jobs or [None] * len(cases)
    out = []
    for case, job in zip(cases, jobs):
        try:
            out.append(run_case(rank, world_size, cluster=job, **case))
        except Exception as e:  # noqa: BLE001 - reported to the test
            # The process group may be out of step now: stop here.
            out.append(f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
            break
    return out


class _NoAgreement:
    """Never consulted: the install calls below fail before any agreement."""

    rank, world_size = 0, 1

    def register(self, *a):
        raise AssertionError("not reached")

    def submit(self, *a):
        raise AssertionError("not reached")


def bad_installs(rank, world_size):
    """Each misuse of install(..., optional=...) and the error it raised."""
    import accord.torch

    mesh = init_device_mesh("cpu", (world_size,))
    out = {}

    def attempt(key, fn):
        try:
            fn()
            out[key] = "no error"
        except (ValueError, TypeError) as e:
            out[key] = f"{type(e).__name__}: {e}"

    def sharded(shard_tower=True, shard_root=True):
        job = build("vlm")
        units, _ = units_of(job, "vlm")
        for path, unit in units:
            if shard_tower or "vision_tower" not in path:
                fully_shard(unit, mesh=mesh)
        if shard_root:
            fully_shard(job, mesh=mesh)
        return job

    job = sharded(shard_tower=False)
    attempt("not_fsdp_unit", lambda: accord.torch.install(
        job, _NoAgreement(), optional=["vlm.model.vision_tower"]))
    job = sharded()
    attempt("not_a_submodule", lambda: accord.torch.install(
        job, _NoAgreement(), optional=["vlm.model.no_such_tower"]))
    attempt("foreign_module", lambda: accord.torch.install(
        job, _NoAgreement(), optional=[nn.Linear(2, 2)]))
    attempt("root", lambda: accord.torch.install(job, _NoAgreement(), optional=[job]))
    attempt("wrong_type", lambda: accord.torch.install(job, _NoAgreement(), optional=[3]))
    job = sharded(shard_root=False)
    attempt("root_not_fsdp", lambda: accord.torch.install(
        job, _NoAgreement(), optional=["vlm.model.vision_tower"]))
    attempt("not_fsdp_model", lambda: accord.torch.install(build("vlm"), _NoAgreement()))
    job = sharded()
    accord.torch.fix_transformers_output_capture(job)
    job(**batch("vlm", "image", rank, 0))
    attempt("after_first_forward", lambda: accord.torch.install(
        job, _NoAgreement(), optional=["vlm.model.vision_tower"]))
    return out
