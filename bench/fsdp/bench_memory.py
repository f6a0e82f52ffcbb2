"""What accord.torch holds in memory beside plain FSDP2, per rank, in one run.

Each rank holds two identical models, sharded the same way: plain FSDP2 and
FSDP2 with accord.torch installed (defaults: guard, speculation, step watch;
real daemons started here). Each step runs the plain model, then the accord
model, on the same data, and reports for each:

- peak live unsharded-gradient bytes (tests/python/grad_meter.py: every
  tensor ever seen as an unsharded gradient or a reduce-scatter input,
  tracked through weak references, sampled at every post-backward and
  reduce-scatter);
- the step's peak RSS over its start (VmHWM after writing 5 to
  /proc/self/clear_refs; MALLOC_MMAP_THRESHOLD_=131072 so freed tensors
  leave RSS at once);
- for accord: where each group's reduce-scatter went (during autograd, or
  at the end-of-backward point), late group-steps and their bytes, and bytes
  held for parameters the turn left out ("owed").

Steps: the first, steady ones (usage fixed), and, with --usage changing,
steps whose usage is redrawn per rank (plain FSDP2 cannot run divergent
usage, so its baseline runs every module on every rank: the most it holds).

Models: --model linear (--blocks 16 x Linear(--dim 2048), each block its own
unit, an input and output Linear in the root; with --usage changing each
block also has a side projection, dim -> dim/4 -> dim, used per rank and
step with probability 1/W) and --model llama
(transformers' LlamaDecoderLayer x --layers, each its own unit; the root
holds embeddings, norm, head and an image projector used per --usage).
--dtype bf16 uses MixedPrecisionPolicy(bfloat16, reduce_dtype=float32).

    PYTHONPATH=build/python/pkg python3 bench/fsdp/bench_memory.py --model linear --world 2
    PYTHONPATH=build/python/pkg python3 bench/fsdp/bench_memory.py --model llama --layers 32 \\
        --world 4 --dtype bf16 --usage changing
"""

import argparse
import os
import random
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests", "python"))
os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402


def rss_reset():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def rss_now_and_peak():
    rss = hwm = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
            elif line.startswith("VmHWM:"):
                hwm = int(line.split()[1]) * 1024
    return rss, hwm


class LlamaVLM(nn.Module):
    """Llama decoder layers over embeddings plus an image projector (root)."""

    def __init__(self, layers, dim):
        super().__init__()
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import (LlamaDecoderLayer,
                                                              LlamaRotaryEmbedding)

        cfg = LlamaConfig(vocab_size=1024, hidden_size=dim, intermediate_size=dim * 8 // 3,
                          num_hidden_layers=layers, num_attention_heads=max(1, dim // 64),
                          num_key_value_heads=max(1, dim // 128), max_position_embeddings=64)
        cfg._attn_implementation = "eager"
        self.embed = nn.Embedding(cfg.vocab_size, dim)
        self.proj = nn.Linear(dim, dim)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i) for i in range(layers))
        self.rotary = LlamaRotaryEmbedding(cfg)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, cfg.vocab_size, bias=False)

    def forward(self, ids, img):
        h = self.embed(ids)
        if img is not None:
            h = h + self.proj(img)
        pos = torch.arange(ids.shape[1]).unsqueeze(0)
        emb = self.rotary(h, pos)
        for layer in self.layers:
            out = layer(h, position_embeddings=emb)
            h = out[0] if isinstance(out, tuple) else out
        return self.head(self.norm(h)).float().logsumexp(-1).sum()

    def blocks(self):
        return self.layers


def build(args, mesh):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import memory_scenarios as ms

    torch.manual_seed(0)
    if args.model == "linear":
        model = ms.Stack(args.blocks, args.dim, side=args.usage == "changing")
        units = list(model.blocks)
    else:
        model = LlamaVLM(args.layers, args.dim)
        units = list(model.layers)
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if args.dtype == "bf16" else MixedPrecisionPolicy())
    for u in units:
        fully_shard(u, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def run_step(model, args, rank, step, all_used):
    g = torch.Generator().manual_seed(1000 * step + rank)
    rng = random.Random(args.seed * 1000 + step * 31 + rank)
    if args.model == "linear":
        x = torch.randn(args.rows, args.dim, generator=g)
        if all_used or args.usage == "fixed":
            sides = [True] * args.blocks
        else:
            sides = [rng.random() < 1.0 / args.world for _ in range(args.blocks)]
        model(x, sides).backward()
    else:
        ids = torch.randint(0, 1024, (args.rows, args.seq), generator=g)
        used = all_used or args.usage == "fixed" or rng.random() < 1.0 / args.world
        img = torch.randn(args.rows, args.seq, args.dim, generator=g) if used else None
        model(ids, img).backward()


def _counts(inst):
    """Where the turns went (0 for a tree without turns: the previous design,
    run with --baseline-tree to compare)."""
    t = inst.timing
    out = {k: getattr(t, k, 0) for k in ("during", "at_end", "late", "late_bytes", "redone")}
    out["owed_bytes"] = sum(getattr(s, "owed_bytes", 0) for s in inst.stats.values())
    return out


def rank_main(rank, world_size, args=None, cluster=None):
    from torch.distributed.device_mesh import init_device_mesh

    import accord.torch
    from fsdp_scenarios import make_agreement
    from grad_meter import GradMeter
    from memory_scenarios import group_bytes

    mesh = init_device_mesh("cpu", (world_size,))
    meter = GradMeter()
    plain = build(args, mesh)
    model = build(args, mesh)
    meter.watch(plain)
    meter.watch(model)
    inst = accord.torch.install(model, make_agreement("accord", rank, world_size, cluster))
    rows = []
    try:
        for step in range(args.steps):
            row = {"step": step}
            for name, m in (("plain", plain), ("accord", model)):
                t0 = _counts(inst)
                meter.reset()
                rss_reset()
                rss0, _ = rss_now_and_peak()
                run_step(m, args, rank, step, all_used=name == "plain")
                _, hwm = rss_now_and_peak()
                row[name] = {"grad_peak": meter.peak, "rss_over_start": hwm - rss0}
                if name == "accord":
                    t1 = _counts(inst)
                    row[name].update({k: t1[k] - t0[k] for k in t1})
                m.zero_grad(set_to_none=True)
            rows.append(row)
    finally:
        meter.close()
        inst.uninstall()
    groups = group_bytes(model, 4)  # reduce dtype float32 in every configuration here
    return {"rows": rows, "largest": max(groups.values()), "groups": len(groups)}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=["linear", "llama"], default="linear")
    p.add_argument("--blocks", type=int, default=16)
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--usage", choices=["fixed", "changing"], default="fixed")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--timeout", type=float, default=1200.0)
    args = p.parse_args()
    if args.model == "llama" and args.dim == 2048:
        args.dim = 256

    import accord
    from cluster_fixture import cluster_info
    from harness import check_results, run_ranks

    with accord.LocalCluster(num_sidecars=1) as c:
        info = cluster_info(c, args.world, "bench-memory")
        results = check_results(run_ranks(rank_main, args.world, args.timeout, args=args,
                                          cluster=info))
    mib = 1 / 2**20
    print(f"# {args.model} ({results[0]['groups']} groups, largest group's unsharded gradient "
          f"in float32: {results[0]['largest'] * mib:.1f} MiB), W={args.world}, {args.dtype}, "
          f"usage {args.usage}")
    print("| rank | step | live unsharded grads plain / accord (MiB) | over plain | "
          "RSS over step start plain / accord (MiB) | over plain | during / at end | late (MiB) "
          "| owed (MiB) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for rank, r in enumerate(results):
        for row in r["rows"]:
            a, b = row["plain"], row["accord"]
            print(f"| {rank} | {row['step']} | {a['grad_peak'] * mib:.1f} / "
                  f"{b['grad_peak'] * mib:.1f} | {(b['grad_peak'] - a['grad_peak']) * mib:+.1f} | "
                  f"{a['rss_over_start'] * mib:.1f} / {b['rss_over_start'] * mib:.1f} | "
                  f"{(b['rss_over_start'] - a['rss_over_start']) * mib:+.1f} | "
                  f"{b['during']} / {b['at_end']} | {b['late']} ({b['late_bytes'] * mib:.1f}) | "
                  f"{b['owed_bytes'] * mib:.1f} |")


if __name__ == "__main__":
    main()
