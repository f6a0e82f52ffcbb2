"""Real `transformers` model families under FSDP2 on CPU/Gloo, run on every rank.

Used by test_models.py and bench/fsdp/compare_stacks.py. Each family is real
model code built from a tiny config (random weights, nothing downloaded):

- "llava": LlavaForConditionalGeneration (CLIP vision tower + Llama decoder).
  The vision tower and projector live in the ROOT FSDP unit, each decoder
  layer is its own unit. Even ranks see an image in some microbatches, odd
  ranks are text-only. With the default vision_feature_layer=-2 the tower's
  last encoder layer and post_layernorm feed nothing: used on no rank.
- "mixtral": MixtralForCausalLM, transformers 5.x layout: the experts of a
  layer are two fused 3-D parameters (gate_up_proj, down_proj). An expert that
  gets no tokens on a rank still has a gradient there (a zero slice), so every
  rank states the same manifest and nothing needs zero-filling.
- "custom_moe": a small MoE language model written here with one nn.Module per
  expert (the older ModuleList layout and most custom MoE code). An expert with
  no tokens on a rank has no gradient there; expert 3 gets tokens on no rank.

run_family(rank, world_size, family, variants, mode, ...) trains `steps` steps
of `micro` microbatches (gradient accumulation: set_requires_gradient_sync on
the last microbatch only) for each mixed-precision variant (VARIANTS) and
returns, per variant, the full gradients of the last step on this rank, what
went over the wire (WireSpy), accord's per-group stats, and on rank 0 a
single-process reference computed on every rank's data.

mode: "plain" (FSDP2 as is), "unused_flag" (FSDP2 with
set_reduce_scatter_unused_params(True)), "accord" (accord.torch.install with
the real client), or a callable installer(model, rank, world_size) for other
approaches (bench/fsdp/compare_stacks.py).

Gloo's reduce-scatter has ignored ReduceOp.AVG in some versions, so every
unit sets set_force_sum_reduction_for_comms(True) (see fsdp_scenarios.py); the
reference is the sum over ranks divided by the world size.
"""

import copy
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

import fsdp_scenarios as sc

# name -> (param_dtype, reduce_dtype) of FSDP2's MixedPrecisionPolicy.
VARIANTS = {
    "fp32": (None, None),
    "bf16-fp32": (torch.bfloat16, torch.float32),
    "bf16-none": (torch.bfloat16, None),
}

VOCAB = 64
IMAGE_TOKEN = VOCAB - 1
SEQ = 8


# ---------------------------------------------------------------- families


def build_llava(text="llama"):
    """Tiny LLaVA: CLIP vision tower (2 layers, 16x16 images, 4 patches) and a
    2-layer Llama (or Mixtral, text="mixtral") decoder."""
    from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration

    vision = CLIPVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        image_size=16, patch_size=8, projection_dim=16,
    )
    cfg = LlavaConfig(
        vision_config=vision, text_config=text_config(text), image_token_index=IMAGE_TOKEN,
        image_seq_length=4,
    )
    torch.manual_seed(0)
    return LlavaForConditionalGeneration(cfg)


def text_config(kind):
    from transformers import LlamaConfig, MixtralConfig

    common = dict(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
    )
    if kind == "llama":
        return LlamaConfig(**common)
    if kind == "mixtral":
        # top-1 of 4 experts: with a few tokens per rank some experts get none.
        return MixtralConfig(num_local_experts=4, num_experts_per_tok=1, **common)
    raise ValueError(kind)


def build_mixtral():
    from transformers import MixtralForCausalLM

    torch.manual_seed(0)
    return MixtralForCausalLM(text_config("mixtral"))


class Expert(nn.Module):
    def __init__(self, d, hidden):
        super().__init__()
        self.w1 = nn.Linear(d, hidden, bias=False)
        self.w3 = nn.Linear(d, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class HashMoE(nn.Module):
    """Top-1 MoE, one nn.Module per expert. The expert of a token is its id
    modulo the number of experts (hash routing, so tests control which experts
    get tokens); the learned router scales each expert's output. An expert with
    no tokens is not run and gets no gradient on that rank."""

    def __init__(self, d, hidden, n_experts):
        super().__init__()
        self.router = nn.Linear(d, n_experts, bias=False)
        self.experts = nn.ModuleList(Expert(d, hidden) for _ in range(n_experts))

    def forward(self, x, expert_ids):
        probs = torch.softmax(self.router(x).float(), dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            idx = (expert_ids == e).nonzero(as_tuple=True)[0]
            if idx.numel() == 0:
                continue
            w = probs[idx, e].unsqueeze(-1).to(x.dtype)
            out = out.index_add(0, idx, expert(x[idx]) * w)
        return out


class MoEBlock(nn.Module):
    def __init__(self, d, hidden, n_experts):
        super().__init__()
        self.norm = nn.RMSNorm(d)
        self.moe = HashMoE(d, hidden, n_experts)

    def forward(self, h, expert_ids):
        return h + self.moe(self.norm(h), expert_ids)


class CustomMoELM(nn.Module):
    N_EXPERTS = 4

    def __init__(self, d=16, hidden=32, layers=2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.layers = nn.ModuleList(MoEBlock(d, hidden, self.N_EXPERTS) for _ in range(layers))
        self.norm = nn.RMSNorm(d)
        self.head = nn.Linear(d, VOCAB, bias=False)

    def forward(self, input_ids, labels):
        ids = input_ids.reshape(-1)
        h = self.embed(ids)
        expert_ids = ids % self.N_EXPERTS
        for layer in self.layers:
            h = layer(h, expert_ids)
        logits = self.head(self.norm(h)).float()
        return F.cross_entropy(logits[:-1], labels.reshape(-1)[1:])


def build_custom_moe():
    torch.manual_seed(0)
    return CustomMoELM()


def _ids(rank, step, k, residues=None, n=SEQ):
    g = torch.Generator().manual_seed(10_000 + 1_000 * rank + 10 * step + k)
    ids = torch.randint(0, VOCAB - 4, (n,), generator=g)
    if residues is not None:  # custom MoE: only these experts (id % 4) get tokens
        res = torch.tensor(residues)
        ids = (ids // 4) * 4 + res[torch.randint(0, len(residues), (n,), generator=g)]
    return ids.unsqueeze(0)


def llava_has_image(rank, step, k):
    """Even ranks: the image arrives on the last (synced) microbatch of step 0
    and on the first (accumulated) one of step 1. Odd ranks: text only."""
    if rank % 2:
        return False
    return k == (1 if step == 0 else 0)


def llava_batch(rank, step, k):
    ids = _ids(rank, step, k)
    batch = {"input_ids": ids, "labels": ids.clone()}
    if llava_has_image(rank, step, k):
        ids[0, 1:5] = IMAGE_TOKEN
        g = torch.Generator().manual_seed(20_000 + 1_000 * rank + 10 * step + k)
        batch["pixel_values"] = torch.randn(1, 3, 16, 16, generator=g)
        batch["labels"][0, 1:5] = -100
    return batch


def custom_moe_residues(rank, k):
    """Which experts get tokens. Even ranks: expert 0, then 0 and 1 (expert 1
    first has a gradient on the synced microbatch); odd ranks: 0 and 2, then 0.
    Expert 3: no rank. So each of experts 1 and 2 is zero-token on half the
    ranks and expert 3 everywhere."""
    if rank % 2 == 0:
        return [0] if k == 0 else [0, 1]
    return [0, 2] if k == 0 else [0]


def custom_moe_batch(rank, step, k):
    ids = _ids(rank, step, k, residues=custom_moe_residues(rank, k))
    return {"input_ids": ids, "labels": ids.clone()}


def text_batch(rank, step, k):
    ids = _ids(rank, step, k)
    return {"input_ids": ids, "labels": ids.clone()}


def _hf_loss(model, batch):
    return model(**batch).loss


def _custom_loss(model, batch):
    return model(**batch)


FAMILIES = {
    # name -> (build, decoder-layer units, batch, loss)
    "llava": (build_llava, lambda m: list(m.model.language_model.layers), llava_batch, _hf_loss),
    "mixtral": (build_mixtral, lambda m: list(m.model.layers), text_batch, _hf_loss),
    "custom_moe": (build_custom_moe, lambda m: list(m.layers), custom_moe_batch, _custom_loss),
}


# ---------------------------------------------------------------- running


def _cast_batch(batch, dtype):
    if dtype is None:
        return batch
    return {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in batch.items()}


def shard(model, units, mesh, variant, unused_flag=False):
    param_dtype, reduce_dtype = VARIANTS[variant]
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for u in units:
        fully_shard(u, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)
            if unused_flag:
                m.set_reduce_scatter_unused_params(True, recurse=False)
    return model


class ExpertSpy:
    """Records, per forward of each Mixtral router on this rank, which experts
    got tokens: used[router name] is a list of sorted expert lists."""

    def __init__(self, model):
        self.used = {}
        self.handles = []
        for name, m in model.named_modules():
            if type(m).__name__.endswith("TopKRouter"):
                self.handles.append(m.register_forward_hook(self._hook(name)))

    def _hook(self, name):
        def hook(module, args, output):
            indices = output[2]
            self.used.setdefault(name, []).append(sorted({int(i) for i in indices.reshape(-1)}))

        return hook

    def close(self):
        for h in self.handles:
            h.remove()


def reference(family, variant, world_size, step, micro):
    """Single-process gradients of one step: every rank's microbatches on one
    unsharded copy whose parameters (not buffers, as FSDP2) are in the
    variant's param dtype; microbatch gradients accumulated as FSDP2 does (in
    the reduce dtype when one is set, else by autograd in the param dtype);
    summed over ranks in fp32 and divided by the world size. When the wire
    dtype is narrower than fp32 (bf16 params, reduce_dtype None) the sum is
    rounded to it before the division, as the reduce-scatter does: at 2 ranks
    that is one rounding of one addition, the same bits as Gloo's."""
    build, _, batch_fn, loss_fn = FAMILIES[family]
    param_dtype, reduce_dtype = VARIANTS[variant]
    base = build()
    total = {n: None for n, _ in base.named_parameters()}
    for r in range(world_size):
        m = copy.deepcopy(base)
        if param_dtype is not None:
            for p in m.parameters():
                p.data = p.data.to(param_dtype)
        acc = {}
        for k in range(micro):
            m.zero_grad(set_to_none=True)
            loss_fn(m, _cast_batch(batch_fn(r, step, k), param_dtype)).backward()
            for n, p in m.named_parameters():
                if p.grad is None:
                    continue
                g = p.grad if reduce_dtype is None else p.grad.to(reduce_dtype)
                acc[n] = g.clone() if n not in acc else acc[n] + g
        for n, g in acc.items():
            total[n] = g.float() if total[n] is None else total[n] + g.float()
    wire = reduce_dtype or param_dtype
    if wire is not None and wire != torch.float32:
        total = {n: (g.to(wire).float() if g is not None else None) for n, g in total.items()}
    return {n: (g / world_size if g is not None else None) for n, g in total.items()}


def make_installer(mode, rank, world_size, cluster, family, variant, agreement_cache):
    if mode in ("plain", "unused_flag"):
        return lambda model: None
    if mode == "accord":
        if "agreement" not in agreement_cache:
            agreement_cache["agreement"] = sc.make_agreement("accord", rank, world_size, cluster)

        def install(model):
            import accord.torch

            return accord.torch.install(
                model, agreement_cache["agreement"], prefix=f"{family}.{variant}"
            )

        return install
    if callable(mode):
        return lambda model: mode(model, rank, world_size)
    raise ValueError(mode)


def run_family(rank, world_size, family, variants, mode="accord", cluster=None, steps=2,
               micro=2, with_reference=True):
    """See the module docstring. Returns {variant: result dict}."""
    build, units, batch_fn, loss_fn = FAMILIES[family]
    mesh = init_device_mesh("cpu", (world_size,))
    cache = {}
    out = {}
    for variant in variants:
        model = build()
        shard(model, units(model), mesh, variant, unused_flag=(mode == "unused_flag"))
        inst = make_installer(mode, rank, world_size, cluster, family, variant, cache)(model)
        experts = ExpertSpy(model)
        spy = sc.WireSpy()
        losses, step_s, wire_per_step = [], [], []
        try:
            for s in range(steps):
                model.zero_grad(set_to_none=True)
                n_before = len(spy.calls)
                t0 = time.perf_counter()
                for k in range(micro):
                    model.set_requires_gradient_sync(k == micro - 1)
                    loss = loss_fn(model, batch_fn(rank, s, k))
                    loss.backward()
                    losses.append(float(loss.detach()))
                step_s.append(time.perf_counter() - t0)
                wire_per_step.append(spy.calls[n_before:])
        finally:
            spy.close()
            experts.close()
        result = {
            "grads": sc._full_grads(model),
            "wire": wire_per_step,
            "stats": sc._stats(inst),
            "losses": losses,
            "step_s": step_s,
            "experts_used": experts.used,
        }
        if rank == 0 and with_reference:
            result["ref"] = reference(family, variant, world_size, steps - 1, micro)
        out[variant] = result
    return out


def rel_error(got, ref):
    """max |got - ref| / max |ref| (0 when both are all zeros)."""
    scale = ref.abs().max().item()
    diff = (got.float() - ref.float()).abs().max().item()
    return diff / scale if scale > 0 else diff


def wire_bytes(calls):
    return sum(numel * torch.empty((), dtype=getattr(torch, dt)).element_size() for dt, numel in calls)
