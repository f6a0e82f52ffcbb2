"""FSDP2 configurations as people deploy them, each with a divergence, run on
every rank (test_configs.py).

The model is a small Llama built from `transformers`' own LlamaDecoderLayer,
LlamaRMSNorm and LlamaRotaryEmbedding (3 decoder layers, each its own FSDP
unit; embedding, image projector, norm and head in the root unit). Its
forward takes the ids, optional image features and the layers to skip, so
the test controls each rank's usage, per divergence ("kinds"):

- "param": in step 0 even data-parallel ranks have an image (the root
  unit's `proj` is used there only: a parameter used on some ranks only);
  in step 1 no rank has one (`proj`'s gradient must stay None);
- "drop": in step 0 odd data-parallel ranks skip layer 1 (LayerDrop: a unit
  whose forward runs on some ranks only, marked `optional` for accord); in
  step 1 every rank skips it (its gradients must stay None).

A configuration (CONFIGS) says how the model is sharded (mesh, activation
checkpointing, reshard_after_forward, prefetch, CPU offload, compile, LoRA,
ignored_params, HSDP, tensor parallel, mixed precision and accumulation).
Each runs in three modes on the same data: "plain" (FSDP2 as is), "unused"
(FSDP2 with set_reduce_scatter_unused_params(True)) and "accord"
(accord.torch.install with the real client). run_pipeline does the same for
2 pipeline stages x 2 data-parallel ranks under a torch.distributed.pipelining
schedule.

What plain FSDP2 does on such a job is a Gloo abort (a size mismatch kills
the receiving process), a hang, or silently wrong gradients. So that one
pair of processes can show every outcome, WireCheck compares each collective
FSDP2 issues (all-gather, reduce-scatter, HSDP all-reduce: kind, element
counts, dtype) with the other members' before it is issued, over a side
group with a timeout; a difference raises WireMismatch on every member
instead of reaching Gloo, and every group has a timeout, so a hang is an
error. The same record shows that accord's ranks issue identical sequences.

Gradients are compared with a single-process reference (rank 0 computes it:
every data-parallel rank's batches on one unsharded model, summed, divided by
the data-parallel size; FSDP2 reduces with SUM and divides afterwards,
set_force_sum_reduction_for_comms, see fsdp_scenarios.py).
"""

import copy
import datetime
import math
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy,
                                    fully_shard)

from collective_names import fsdp2_collectives

D, HEADS, KV_HEADS, INTER, VOCAB = 16, 2, 1, 32, 64
BATCH, SEQ, IMG = 2, 8, 4
N_LAYERS = 3
DROP = 1  # the layer dropped on odd data-parallel ranks
STEPS = 2
PLAIN_TIMEOUT = datetime.timedelta(seconds=8)
ACCORD_TIMEOUT = datetime.timedelta(seconds=90)
RENDEZVOUS_TIMEOUT = datetime.timedelta(seconds=300)

# ---------------------------------------------------------------- the model


def llama_config():
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=D, intermediate_size=INTER,
                      num_hidden_layers=N_LAYERS, num_attention_heads=HEADS,
                      num_key_value_heads=KV_HEADS, max_position_embeddings=64)
    cfg._attn_implementation = "eager"
    return cfg


class LoraLinear(nn.Module):
    """A frozen base projection and a trained low-rank adapter beside it."""

    def __init__(self, base: nn.Linear, r=2):
        super().__init__()
        self.base = base
        base.weight.requires_grad_(False)
        self.a = nn.Parameter(torch.randn(base.in_features, r) * 0.1)
        self.b = nn.Parameter(torch.randn(r, base.out_features) * 0.1)

    def forward(self, x):
        return self.base(x) + x @ self.a @ self.b


class TinyLlama(nn.Module):
    def __init__(self):
        super().__init__()
        from transformers.models.llama.modeling_llama import (LlamaDecoderLayer, LlamaRMSNorm,
                                                              LlamaRotaryEmbedding)

        cfg = llama_config()
        self.embed = nn.Embedding(VOCAB, D)
        self.proj = nn.Linear(IMG, D)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i) for i in range(N_LAYERS))
        self.norm = LlamaRMSNorm(D)
        self.rotary = LlamaRotaryEmbedding(cfg)
        self.head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, ids, img=None, skip=()):
        h = self.embed(ids)
        if img is not None:
            h = h + self.proj(img)
        b, s = ids.shape
        pos = torch.arange(s).unsqueeze(0).expand(b, -1)
        pe = self.rotary(h, pos)
        mask = torch.full((s, s), float("-inf")).triu(1).to(h.dtype)[None, None]
        for i, layer in enumerate(self.layers):
            if i not in skip:
                h = layer(h, attention_mask=mask, position_ids=pos, position_embeddings=pe)
        return self.head(self.norm(h))


def build(lora=False):
    torch.manual_seed(0)
    model = TinyLlama()
    if lora:
        for p in model.layers.parameters():
            p.requires_grad_(False)
        torch.manual_seed(1)
        for layer in model.layers:
            layer.self_attn.q_proj = LoraLinear(layer.self_attn.q_proj)
            layer.self_attn.v_proj = LoraLinear(layer.self_attn.v_proj)
    return model


def loss_of(logits, ids):
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB).float(), ids[:, 1:].reshape(-1))


def usage(dp_rank, step, micro=0, micros=1, kinds=("param", "drop")):
    """(ids, image features or None, layers to skip) of one microbatch, for
    the divergences in `kinds` ("param": the image; "drop": the dropped
    layer). With several microbatches the image comes on the last one only:
    its bf16 gradient then meets fp32 accumulations of the other root
    parameters."""
    g = torch.Generator().manual_seed(1000 + 97 * dp_rank + 13 * step + micro)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    img_features = torch.randn(BATCH, SEQ, IMG, generator=g)
    even = dp_rank % 2 == 0
    has_img = "param" in kinds and step == 0 and even and micro == micros - 1
    skip = (DROP,) if "drop" in kinds and (step == 1 or not even) else ()
    return ids, (img_features if has_img else None), skip


def canonical(name):
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


def reference(n_dp, micros=1, lora=False, dtype=None, reduce_dtype=None,
              kinds=("param", "drop")):
    """Per step: {name: full gradient or None} (the sum over data-parallel
    ranks divided by n_dp) and, per rank, this rank's own gradients (what an
    ignored parameter keeps). dtype: the parameters' compute dtype (FSDP2's
    param_dtype); microbatch gradients are accumulated in reduce_dtype."""
    base = build(lora)
    out = []
    for step in range(STEPS):
        total, local = {}, []
        for r in range(n_dp):
            m = copy.deepcopy(base)
            if dtype is not None:
                for p in m.parameters():
                    p.data = p.data.to(dtype)
            acc = {}
            for k in range(micros):
                m.zero_grad(set_to_none=True)
                ids, img, skip = usage(r, step, k, micros, kinds)
                if img is not None and dtype is not None:
                    img = img.to(dtype)
                loss_of(m(ids, img, skip), ids).backward()
                for n, p in m.named_parameters():
                    if p.grad is not None:
                        g = p.grad if reduce_dtype is None else p.grad.to(reduce_dtype)
                        acc[n] = g.clone() if n not in acc else acc[n] + g
            local.append({n: (g.float() if g is not None else None)
                          for n, g in ((n, acc.get(n)) for n, _ in m.named_parameters())})
            for n, g in acc.items():
                total[n] = g.float() if n not in total else total[n] + g.float()
        full = {n: (total[n] / n_dp if n in total else None) for n, _ in base.named_parameters()}
        out.append({"grads": full, "local": local})
    return out


# ---------------------------------------------------------------- the wire check


class WireMismatch(RuntimeError):
    """The members of a group were about to issue different collectives."""


_KINDS = {"all-gather": 1, "reduce-scatter": 2, "all-reduce": 3, "end": 4}
_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64]


class WireCheck:
    """Records, and compares across the group's members before issuing, every
    all-gather, reduce-scatter and all-reduce FSDP2 issues (collective_names) on this rank. `side` maps a group's sorted global ranks to a
    side group with the same members (and a timeout)."""

    def __init__(self, side, rank):
        self.side, self.rank = side, rank
        self.calls = []  # (kind, group ranks, input numel, output numel, dtype)
        gather, scatter = fsdp2_collectives()
        self._orig = {n: getattr(dist, n) for n in (gather, scatter, "all_reduce")}

        def wrap(name, kind):
            orig = self._orig[name]

            def call(*args, **kwargs):
                if name == "all_reduce":
                    tensor = args[0] if args else kwargs["tensor"]
                    out, inp = tensor, tensor
                else:
                    out = args[0] if args else kwargs["output"]
                    inp = args[1] if len(args) > 1 else kwargs["input"]
                group = kwargs.get("group")
                ranks = (dist.get_process_group_ranks(group) if group is not None
                         else range(dist.get_world_size()))
                self.check(kind, ranks, inp.numel(), out.numel(), inp.dtype)
                return orig(*args, **kwargs)

            return call

        setattr(dist, gather, wrap(gather, "all-gather"))
        setattr(dist, scatter, wrap(scatter, "reduce-scatter"))
        dist.all_reduce = wrap("all_reduce", "all-reduce")

    def close(self):
        for n, f in self._orig.items():
            setattr(dist, n, f)

    def check(self, kind, ranks, n_in, n_out, dtype):
        ranks = tuple(sorted(ranks))
        entry = (kind, ranks, int(n_in), int(n_out), str(dtype).replace("torch.", ""))
        side = self.side.get(ranks)
        if side is None:
            raise WireMismatch(f"rank {self.rank}: {kind} on group {ranks}, which the wire "
                               f"check has no side group for")
        desc = torch.tensor([_KINDS[kind], n_in, n_out, _DTYPES.index(dtype)], dtype=torch.int64)
        everyone = [torch.zeros_like(desc) for _ in ranks]
        dist.all_gather(everyone, desc, group=side)
        if any(not torch.equal(e, everyone[0]) for e in everyone):
            inv = {v: k for k, v in _KINDS.items()}
            said = "; ".join(
                f"rank {r}: {inv[int(e[0])]} {int(e[1])}->{int(e[2])} x "
                f"{str(_DTYPES[int(e[3])]).replace('torch.', '')}" for r, e in zip(ranks, everyone))
            raise WireMismatch(f"collective #{len(self.calls)} on group {list(ranks)} differs: "
                               f"{said}")
        if kind != "end":
            self.calls.append(entry)

    def end(self, world_ranks):
        """Every rank says it is done: a rank with collectives left pairs one
        of them with this and both raise."""
        self.check("end", world_ranks, 0, 0, torch.int64)


# ---------------------------------------------------------------- meshes


class Meshes:
    """Fresh process groups for one run (FSDP2's and the wire check's, all with
    `timeout`): nothing of an earlier run that failed is reused."""

    def __init__(self, rank, world_size, timeout):
        self.rank, self.world_size, self.timeout = rank, world_size, timeout
        self.side = {}
        ranks = list(range(world_size))
        # A rendezvous first, with room for a peer still timing out of the
        # previous run's failure (new_group waits for every rank).
        dist.new_group(ranks, timeout=RENDEZVOUS_TIMEOUT)
        self.side[tuple(ranks)] = dist.new_group(ranks, timeout=timeout)
        self.world = dist.new_group(ranks, timeout=timeout)

    def _groups(self, rows):
        mine = None
        for ranks in rows:
            g = dist.new_group(ranks, timeout=self.timeout)
            if tuple(sorted(ranks)) not in self.side:
                self.side[tuple(sorted(ranks))] = dist.new_group(ranks, timeout=self.timeout)
            if self.rank in ranks:
                mine = g
        return mine

    def mesh(self, shape, names):
        grid = torch.arange(math.prod(shape)).reshape(shape)
        groups = [self._groups(grid.movedim(d, -1).reshape(-1, shape[d]).tolist())
                  for d in range(len(shape))]
        if len(shape) == 1:
            return DeviceMesh.from_group(groups[0], "cpu", mesh_dim_names=names)
        return DeviceMesh.from_group(groups, "cpu", mesh=grid, mesh_dim_names=names)

    def side_rows(self, rows):
        """Side groups for groups FSDP2 makes itself (reshard_after_forward=int)."""
        for ranks in rows:
            if tuple(sorted(ranks)) not in self.side:
                self.side[tuple(sorted(ranks))] = dist.new_group(ranks, timeout=self.timeout)


# ---------------------------------------------------------------- configurations

# name -> what the configuration does (see shard()).
CONFIGS = {
    # 2 ranks, 1-D mesh
    "checkpoint": dict(world=2, checkpoint=True),
    "reshard_false": dict(world=2, reshard=False),
    "prefetch": dict(world=2, prefetch=True),
    "cpu_offload": dict(world=2, offload=True),
    "compile": dict(world=2, compile=True),
    "lora": dict(world=2, lora=True),
    "ignored_params": dict(world=2, ignored=True),
    # 4 ranks
    "reshard_int": dict(world=4, reshard=2),
    "hsdp": dict(world=4, hsdp=True, micros=2, mp=True, accumulate="all_reduce"),
    "hsdp_no_sync": dict(world=4, hsdp=True, micros=2, mp=True, accumulate="sync"),
    "hsdp_all_reduce_off_at_install": dict(world=4, hsdp=True, micros=2, mp=True,
                                           accumulate="all_reduce",
                                           all_reduce_off_before_install=True),
    "tp": dict(world=4, tp=True),
}


def dp_layout(cfg, rank):
    """(data-parallel rank, data-parallel size) of this rank."""
    w = cfg["world"]
    if cfg.get("tp"):
        return rank // 2, w // 2
    return rank, w


def tensor_parallel(layers, tp_mesh):
    """Megatron-style TP of each decoder layer's MLP over `tp_mesh` (gate
    and up column-wise, down row-wise): its parameters become DTensors
    sharded over the TP ranks, its input and output stay replicated."""
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    for layer in layers:
        parallelize_module(layer.mlp, tp_mesh, {
            "gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(),
            "down_proj": RowwiseParallel()})


def shard(model, cfg, meshes, mode):
    """Applies the configuration to a fresh model; returns the optional units."""
    kwargs = {}
    if cfg.get("hsdp"):
        kwargs["mesh"] = meshes.mesh((2, 2), ("replicate", "shard"))
    elif cfg.get("tp"):
        mesh = meshes.mesh((2, 2), ("dp", "tp"))
        tensor_parallel(model.layers, mesh["tp"])
        kwargs["mesh"] = mesh["dp"]
    else:
        kwargs["mesh"] = meshes.mesh((cfg["world"],), ("dp",))
    if cfg.get("mp"):
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                   reduce_dtype=torch.float32)
    if cfg.get("offload"):
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    layer_kwargs = dict(kwargs)
    if "reshard" in cfg:
        layer_kwargs["reshard_after_forward"] = cfg["reshard"]
        if not isinstance(cfg["reshard"], bool):
            k = cfg["reshard"]
            meshes.side_rows(torch.arange(cfg["world"]).view(-1, k).tolist())
    if cfg.get("checkpoint"):
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import \
            checkpoint_wrapper

        for i, layer in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(layer)
    if cfg.get("compile"):
        for layer in model.layers:
            layer.compile(backend=cfg.get("backend", "inductor"))
    for layer in model.layers:
        fully_shard(layer, **layer_kwargs)
    root_kwargs = dict(kwargs)
    if cfg.get("ignored"):
        root_kwargs["ignored_params"] = {model.proj.weight}
    fully_shard(model, **root_kwargs)
    if cfg.get("prefetch"):
        layers = list(model.layers)
        for a, b in zip(layers, layers[1:]):
            a.set_modules_to_forward_prefetch([b])
            b.set_modules_to_backward_prefetch([a])
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)
            if mode == "unused":
                m.set_reduce_scatter_unused_params(True, recurse=False)
    return [model.layers[DROP]]


# ---------------------------------------------------------------- one run


def full_grads(model, world_group):
    """{canonical name: full gradient, None, or a string saying which ranks
    lack one}. Ignored (non-DTensor) parameters: this rank's own gradient."""
    out = {}
    for name, p in model.named_parameters():
        if not hasattr(p, "full_tensor"):  # ignored by FSDP2: never reduced
            out[canonical(name)] = None if p.grad is None else p.grad.detach().clone()
            continue
        has = torch.tensor([0 if p.grad is None else 1])
        everyone = [torch.zeros_like(has) for _ in range(dist.get_world_size(world_group))]
        dist.all_gather(everyone, has, group=world_group)
        flags = [int(t.item()) for t in everyone]
        key = canonical(name)
        if all(f == 0 for f in flags):
            out[key] = None
        elif all(f == 1 for f in flags):
            out[key] = p.grad.full_tensor().detach().clone()
        else:
            out[key] = f"grad None on ranks {[r for r, f in enumerate(flags) if f == 0]} only"
    return out


def _describe(e):
    text = f"{type(e).__name__}: {e}"
    return text.replace("\n", " ")[:1500]


def run_one(rank, name, mode, kinds, agreement):
    """One configuration in one mode on this rank. Returns its outcome
    ("ok" or what went wrong), gradients per step and the wire record."""
    cfg = CONFIGS[name]
    world = cfg["world"]
    micros = cfg.get("micros", 1)
    dp_rank, _ = dp_layout(cfg, rank)
    meshes = Meshes(rank, world, ACCORD_TIMEOUT if mode == "accord" else PLAIN_TIMEOUT)
    model = build(lora=cfg.get("lora", False))
    optional = shard(model, cfg, meshes, mode)
    wire = WireCheck(meshes.side, rank)
    inst = None
    result = {"outcome": "ok", "grads": [], "wire": [], "timing": None, "stats": None,
              "failed_at": None}
    t0 = time.perf_counter()
    try:
        if cfg.get("all_reduce_off_before_install"):
            model.set_requires_all_reduce(False)
        if mode == "accord":
            import accord.torch

            inst = accord.torch.install(model, agreement, prefix=f"{name}-{'+'.join(kinds)}",
                                        optional=optional if "drop" in kinds else ())
            # What install registered: (group id, members or None) per group.
            result["registered"] = [(r[0], list(r[4]) if len(r) > 4 else None)
                                    for r in inst.negotiation.registrations()]
            # What accord records for the guard at each release (a spy on the
            # real installation; the guard itself still gets every entry).
            recorded = result["recorded"] = []
            record = inst.record_reduce
            inst.record_reduce = lambda entry, group=None: (recorded.append(entry),
                                                            record(entry, group))[1]
        for step in range(STEPS):
            result["failed_at"] = step
            n_before = len(wire.calls)
            for k in range(micros):
                last = k == micros - 1
                if cfg.get("accumulate") == "all_reduce":
                    model.set_requires_all_reduce(last)
                elif cfg.get("accumulate") == "sync":
                    model.set_requires_gradient_sync(last)
                ids, img, skip = usage(dp_rank, step, k, micros, kinds)
                loss_of(model(ids, img, skip), ids).backward()
            result["wire"].append(wire.calls[n_before:])
            wire.end(list(range(world)))
            result["grads"].append(full_grads(model, meshes.world))
            model.zero_grad(set_to_none=True)
        result["failed_at"] = None
    except Exception as e:  # the outcome of this mode, checked by the test
        result["outcome"] = _describe(e)
        result["traceback"] = traceback.format_exc()[-3000:]
    finally:
        wire.close()
        if inst is not None:
            t = inst.timing
            result["timing"] = {"speculated": t.speculated, "repairs": t.repairs,
                                "redone": t.redone, "releases": t.releases, "held": t.held,
                                "late": t.late}
            result["stats"] = {gid: (s.reductions, s.zero_filled, s.widened, s.skipped)
                               for gid, s in inst.stats.items()}
            result["learned"] = list(inst.learned)
            _uninstall(inst, result)
            result["overrides_left"] = _overrides_left(model)
    result["seconds"] = time.perf_counter() - t0
    return result


def _overrides_left(model):
    """accord's instance overrides of FSDP2 methods, and its tags, still on
    the model; and the pipeline stage methods still wrapped."""
    from torch.distributed.pipelining.stage import _PipelineStageBase

    left = [f"{name or '<root>'}.{attr}" for name, m in model.named_modules()
            for attr in m.__dict__ if attr == "set_requires_all_reduce"
            or attr.startswith("_accord")]
    if _PipelineStageBase.forward_one_chunk.__name__ != "forward_one_chunk" or \
            _PipelineStageBase.forward_one_chunk.__module__ != _PipelineStageBase.__module__:
        left.append("_PipelineStageBase.forward_one_chunk")
    return left


def _uninstall(inst, result):
    try:
        inst.uninstall()
    except Exception as e:  # reported, and checked by the tests
        result["uninstall_error"] = _describe(e)


REFERENCES = {}


def reference_for(name, kinds):
    cfg = CONFIGS[name]
    _, n_dp = dp_layout(cfg, 0)
    key = (n_dp, cfg.get("micros", 1), cfg.get("lora", False), cfg.get("mp", False), kinds)
    if key not in REFERENCES:
        REFERENCES[key] = reference(
            n_dp, micros=key[1], lora=key[2],
            dtype=torch.bfloat16 if key[3] else None,
            reduce_dtype=torch.float32 if key[3] else None, kinds=kinds)
    return REFERENCES[key]


def run_configs(rank, world_size, runs, cluster=None):
    """runs: [(configuration, mode, kinds)], all of this world size; results
    keyed by the same tuples, and ("ref", configuration, kinds) on rank 0."""
    agreement = None
    if any(mode == "accord" for _, mode, _ in runs):
        from fsdp_scenarios import make_agreement

        agreement = make_agreement("accord", rank, world_size, cluster)
    out = {}
    for name, mode, kinds in runs:
        out[(name, mode, kinds)] = run_one(rank, name, mode, kinds, agreement)
        if rank == 0:
            out[("ref", name, kinds)] = reference_for(name, kinds)
    return out


# ---------------------------------------------------------------- pipeline parallel

PP_MICROS = 2


def pp_usage(dp_rank, step, micro, kinds):
    """Pipeline microbatch data: ids (1 row), image features (always passed:
    the schedule splits tensors only), whether the image is used, layers to
    skip. Step 0: microbatch 0 is text only everywhere; even DP ranks use the
    image in microbatch 1; odd DP ranks skip layer 1. Step 1: text only, layer
    1 skipped everywhere."""
    g = torch.Generator().manual_seed(5000 + 97 * dp_rank + 13 * step + micro)
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=g)
    img = torch.randn(1, SEQ, IMG, generator=g)
    even = dp_rank % 2 == 0
    has_img = "param" in kinds and step == 0 and even and micro == PP_MICROS - 1
    skip = (DROP,) if "drop" in kinds and (step == 1 or not even) else ()
    return ids, img, has_img, skip


class PipelinePiece(nn.Module):
    """Consecutive pieces of TinyLlama: `first` has embed and proj, `last`
    norm and head; layers keep their global index (parameter names match
    the reference model's)."""

    def __init__(self, full, layer_ids, first, last):
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.embed, self.proj = full.embed, full.proj
        self.layers = nn.ModuleDict({str(i): full.layers[i] for i in layer_ids})
        self.rotary = full.rotary
        if last:
            self.norm, self.head = full.norm, full.head
        self.plan = []  # per microbatch: (has_img, skip)
        self.calls = 0

    def forward(self, x, img=None):
        has_img, skip = self.plan[self.calls % len(self.plan)]
        self.calls += 1
        if self.first:
            h = self.embed(x)
            if has_img:
                h = h + self.proj(img)
        else:
            h = x
        b, s = h.shape[:2]
        pos = torch.arange(s).unsqueeze(0).expand(b, -1)
        pe = self.rotary(h, pos)
        mask = torch.full((s, s), float("-inf")).triu(1).to(h.dtype)[None, None]
        for i, layer in self.layers.items():
            if int(i) not in skip:
                h = layer(h, attention_mask=mask, position_ids=pos, position_embeddings=pe)
        return self.head(self.norm(h)) if self.last else h


PP_SCHEDULES = {
    # name -> (schedule class name, virtual stages per rank)
    "gpipe": ("ScheduleGPipe", 1),
    "1f1b": ("Schedule1F1B", 1),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", 2),
    "interleaved_zb": ("ScheduleInterleavedZeroBubble", 2),
}


def _pp_pieces(n_virtual):
    """Layer ids per virtual stage."""
    if n_virtual == 2:
        return [[0, 1], [2]]
    return [[0], [1], [2], []]


_PP_AGREEMENT = {}


def _pp_agreement(rank, world_size, infos, job_wide, timeout_s):
    """One client per process (a sidecar serves one job at a time): the
    stage's own job (its DP ranks), or one job of every rank (`job_wide`)."""
    import accord

    key = "job" if job_wide is not None else "stage"
    if key not in _PP_AGREEMENT:
        if job_wide is not None:
            from fsdp_scenarios import make_agreement

            ag = make_agreement("accord", rank, world_size, job_wide)
            ag.timeout_s = timeout_s
        else:
            info = infos[rank // 2]
            dp_rank = rank % 2
            ag = accord.ClientAgreement(accord.connect(
                socket_path=info["sockets"][dp_rank], job_id=info["job_id"], rank=dp_rank,
                world_size=2, local_rank=info["local_ranks"][dp_rank]), timeout_s=timeout_s)
        _PP_AGREEMENT[key] = ag
    return _PP_AGREEMENT[key]


ONE_JOB = ("accord_job", "embedded")
_EMBEDDED_RUNS: list = []  # schedules run in this process with accord


def _pp_install(rank, world_size, infos, job_wide, timeout_s, sid, mod, prefix, mode, kinds):
    """accord.torch.install of one stage module in `mode`. "embedded" passes
    nothing but the optional units (and a prefix when `prefix` is not None:
    runs after the first in one job need ids of their own)."""
    import accord.torch

    optional = []
    if mode in ("accord", *ONE_JOB) and "drop" in kinds and str(DROP) in mod.layers:
        optional.append(mod.layers[str(DROP)])
    if mode in ONE_JOB and sid == 0:
        optional.append(mod.proj)
    if mode == "embedded":
        return accord.torch.install(mod, optional=optional,
                                    **({} if prefix is None else {"prefix": prefix}))
    ag = _pp_agreement(rank, world_size, infos,
                       job_wide if mode.startswith("accord_job") else None, timeout_s)
    prefix = f"{prefix}-s{sid}" if mode == "accord" else prefix
    return accord.torch.install(mod, ag, prefix=prefix, optional=optional, timeout_s=timeout_s)


def pp_layout(rank, tp=False):
    """(stage, dp rank) of a pipeline rank: rank = 2 * stage + dp rank, or
    with tensor parallel rank = 4 * stage + 2 * dp rank + tp rank."""
    return (rank // 4, rank // 2 % 2) if tp else (rank // 2, rank % 2)


def run_pipeline(rank, world_size, schedule, mode, kinds, infos, job_wide=None, timeout_s=60.0,
                 group_timeout=None, tp=False):
    """2 pipeline stages x 2 data-parallel ranks (rank = 2 * stage + dp
    rank), or with `tp` 2 stages x 2 DP x 2 TP ranks on a (pp, dp, tp) mesh
    (rank = 4 * stage + 2 * dp rank + tp rank; each layer's MLP tensor
    parallel over the tp dimension, tensor_parallel). Every stage module is
    its own FSDP root on the dp (sub)mesh of its TP coordinate. Mode
    "accord": one accord job per stage (its DP ranks), `infos[stage]`;
    "accord_job": one job of all 4 ranks (`job_wide`), each stage's groups
    agreed among its DP ranks (their member set); "embedded": the same with
    accord.torch.install(stage_module) and nothing else (accord's embedded
    default under torchrun). In these two the image projection is a unit of
    its own, marked optional with layer 1 ("drop"). "accord_learn" and
    "accord_job_learn": nothing marked, the guard learns."""
    from torch.distributed import pipelining

    cls_name, per_rank = PP_SCHEDULES[schedule]
    pp_rank, dp_rank = pp_layout(rank, tp)
    n_virtual = 2 * per_rank
    if group_timeout is None:
        group_timeout = ACCORD_TIMEOUT if mode.startswith("accord") or mode == "embedded" \
            else PLAIN_TIMEOUT
    meshes = Meshes(rank, world_size, group_timeout)
    mesh = meshes.mesh((2, 2, 2), ("pp", "dp", "tp")) if tp else \
        meshes.mesh((2, 2), ("pp", "dp"))
    dp_mesh, pp_group = mesh["dp"], mesh.get_group("pp")
    full = build()
    pieces = _pp_pieces(n_virtual)
    stage_ids = [pp_rank + 2 * v for v in range(per_rank)]
    mods, stages = [], []
    for sid in stage_ids:
        mod = PipelinePiece(full, pieces[sid], first=sid == 0, last=sid == n_virtual - 1)
        if tp:
            tensor_parallel(mod.layers.values(), mesh["tp"])
        for layer in mod.layers.values():
            fully_shard(layer, mesh=dp_mesh)
        if sid == 0 and mode in ONE_JOB:
            fully_shard(mod.proj, mesh=dp_mesh)
        fully_shard(mod, mesh=dp_mesh)
        for m in mod.modules():
            if isinstance(m, FSDPModule):
                m.set_force_sum_reduction_for_comms(True)
                if mode == "unused":
                    m.set_reduce_scatter_unused_params(True, recurse=False)
        h = torch.zeros(1, SEQ, D, requires_grad=True)
        inputs = (torch.zeros(1, SEQ, dtype=torch.long), torch.zeros(1, SEQ, IMG)) \
            if sid == 0 else (h,)
        output = torch.zeros(1, SEQ, VOCAB, requires_grad=True) if sid == n_virtual - 1 else h
        stages.append(pipelining.PipelineStage(mod, sid, n_virtual, torch.device("cpu"),
                                               input_args=inputs, output_args=output,
                                               group=pp_group))
        mods.append(mod)

    def loss_fn(out, target):
        return loss_of(out, target)

    cls = getattr(pipelining, cls_name)
    sched = cls(stages if per_rank > 1 else stages[0], n_microbatches=PP_MICROS,
                loss_fn=loss_fn)
    wire = WireCheck(meshes.side, rank)
    insts = []
    result = {"outcome": "ok", "grads": [], "wire": [], "timing": None, "failed_at": None,
              "stats": None}
    t0 = time.perf_counter()
    try:
        if mode.startswith("accord") or mode == "embedded":
            prefix = f"pp-{schedule}-{mode}-{'+'.join(kinds)}"
            if mode == "embedded" and not _EMBEDDED_RUNS:
                prefix = None  # the process's first: install(stage_module, optional=...) only
            _EMBEDDED_RUNS.append(schedule)
            for sid, mod in zip(stage_ids, mods):
                insts.append(_pp_install(rank, world_size, infos, job_wide, timeout_s, sid, mod,
                                         prefix, mode, kinds))
            result["registered"] = [(r[0], list(r[4]) if len(r) > 4 else None)
                                    for i in insts for r in i.negotiation.registrations()]
        for step in range(STEPS):
            result["failed_at"] = step
            data = [pp_usage(dp_rank, step, m, kinds) for m in range(PP_MICROS)]
            for mod in mods:
                mod.plan = [(d[2], d[3]) for d in data]
                mod.calls = 0
            ids = torch.cat([d[0] for d in data])
            img = torch.cat([d[1] for d in data])
            n_before = len(wire.calls)
            kwargs = {}
            if pp_rank == 1 or per_rank > 1:
                kwargs = {"target": ids, "losses": []}
            if pp_rank == 0:
                sched.step(ids, img, **kwargs)
            else:
                sched.step(**kwargs)
            result["wire"].append(wire.calls[n_before:])
            wire.end(list(range(world_size)))
            grads = {}
            for mod in mods:  # the stages differ: gather within the stage's DP group
                grads.update(full_grads(mod, dp_mesh.get_group()))
            result["grads"].append(grads)
            for mod in mods:
                mod.zero_grad(set_to_none=True)
        result["failed_at"] = None
    except Exception as e:
        result["outcome"] = _describe(e)
        result["traceback"] = traceback.format_exc()[-3000:]
    finally:
        wire.close()
        if insts:
            result["timing"] = [{"speculated": i.timing.speculated, "repairs": i.timing.repairs,
                                 "releases": i.timing.releases, "held": i.timing.held}
                                for i in insts]
            result["stats"] = {gid: (s.reductions, s.zero_filled, s.widened, s.skipped)
                               for i in insts for gid, s in i.stats.items()}
            result["learned"] = [u for i in insts for u in i.learned]
            for i in insts:
                _uninstall(i, result)
            result["overrides_left"] = [o for mod in mods for o in _overrides_left(mod)]
    result["seconds"] = time.perf_counter() - t0
    return result


def pp_reference(kinds, n_dp=2):
    """Per step: {name: gradient or None}: every DP rank's microbatches on
    one model, each microbatch's loss divided by the number of microbatches
    (the schedule's scale_grads), summed over ranks, divided by n_dp."""
    base = build()
    out = []
    for step in range(STEPS):
        base.zero_grad(set_to_none=True)
        for r in range(n_dp):
            for m in range(PP_MICROS):
                ids, img, has_img, skip = pp_usage(r, step, m, kinds)
                loss = loss_of(base(ids, img if has_img else None, skip), ids)
                (loss / PP_MICROS).backward()
        out.append({"grads": {n: (p.grad / n_dp if p.grad is not None else None)
                              for n, p in base.named_parameters()}})
    return out


def run_pipelines(rank, world_size, runs, infos=None, job_wide=None):
    """runs: [(schedule, mode, kinds, options)], options a dict with
    "group_timeout_s" (the process groups') and "accord_timeout_s"; mode
    "accord_job" is accord with one job of all 4 ranks (`job_wide`) instead
    of one per stage. Results keyed by the first three."""
    out = {}
    for schedule, mode, kinds, opts in runs:
        group_timeout = opts.get("group_timeout_s")
        if group_timeout is not None:
            group_timeout = datetime.timedelta(seconds=group_timeout)
        out[(schedule, mode, kinds)] = run_pipeline(
            rank, world_size, schedule, mode, kinds, infos, job_wide,
            opts.get("accord_timeout_s", 60.0), group_timeout)
        if rank == 0 and ("ref", kinds) not in out:
            out[("ref", kinds)] = pp_reference(kinds)
    return out
