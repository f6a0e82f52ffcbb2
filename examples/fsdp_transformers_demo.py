"""A PyTorch main job with accord: a `transformers` vision-language model with
an MoE language part, FSDP2 on 4 CPU ranks over Gloo, through a local accord
cluster (1 coordinator, 2 sidecars). Run by `scripts/demo --torch`, or:

    PYTHONPATH=<build>/python/pkg ACCORD_BIN_DIR=<build>/python/pkg/accord/bin \\
        OMP_NUM_THREADS=1 python examples/fsdp_transformers_demo.py

The model is LlavaForConditionalGeneration from a tiny config (random weights,
nothing downloaded): a CLIP vision tower and projector in the ROOT FSDP unit,
a Mixtral decoder (transformers 5.x fused experts, top-1 of 4) with one FSDP
unit per layer. Parameters are bf16, gradients are reduced in fp32, and each
step accumulates 2 microbatches. Each microbatch of each rank is an image+text
or a text-only sample, so in a step some ranks use the vision tower and some
do not; in one step no rank does.

1. Plain FSDP2 on the same data: the ranks reduce-scatter buffers of different
   sizes; the error (or the hang, after a time limit) is printed.
2. FSDP2 with accord.torch.install: per step the loss, and per FSDP group the
   agreed wire dtype and how many parameters were zero-filled (per rank),
   widened and skipped; then the coordinator's parameter x rank skip matrix
   (`accordctl skips`). The first step's gradients are compared with a
   single-process reference; the last line says PASSED and what was checked.
"""

import argparse
import copy
import multiprocessing as mp
import os
import queue
import subprocess
import sys
import tempfile
import time
import traceback

WORLD = 4
MICRO = 2
VOCAB = 64
IMAGE_TOKEN = VOCAB - 1
REL_BOUND = 1e-5


def build_model():
    import torch
    from transformers import (
        CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration, MixtralConfig,
    )

    vision = CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        image_size=16, patch_size=8, projection_dim=32,
    )
    text = MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
        num_local_experts=4, num_experts_per_tok=1,
    )
    cfg = LlavaConfig(
        vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN, image_seq_length=4
    )
    torch.manual_seed(0)
    return LlavaForConditionalGeneration(cfg)


def has_image(rank, step, k):
    """Step 0: ranks 0 and 2 see an image on the synced microbatch (its bf16
    gradient meets fp32 accumulations), ranks 1 and 3 are text-only. Step 1: an
    image on rank 1's first microbatch only. Step 2: no image anywhere (the
    tower is used on no rank). Step 3: like step 0."""
    step = step % 4
    if step == 0 or step == 3:
        return rank % 2 == 0 and k == MICRO - 1
    if step == 1:
        return rank == 1 and k == 0
    return False


def batch(rank, step, k):
    import torch

    g = torch.Generator().manual_seed(1_000 * rank + 10 * step + k)
    ids = torch.randint(0, VOCAB - 4, (1, 12), generator=g)
    out = {"input_ids": ids, "labels": ids.clone()}
    if has_image(rank, step, k):
        ids[0, 1:5] = IMAGE_TOKEN
        out["labels"][0, 1:5] = -100
        out["pixel_values"] = torch.randn(1, 3, 16, 16, generator=g)
    return out


def reference_grads(step):
    """Single process: every rank's microbatches of `step` on an unsharded copy
    with bf16 parameters (buffers stay fp32, as under FSDP2), microbatch
    gradients accumulated in fp32 (the reduce dtype), summed, divided by W."""
    import torch

    base = build_model()
    total = {}
    for r in range(WORLD):
        m = copy.deepcopy(base)
        for p in m.parameters():
            p.data = p.data.to(torch.bfloat16)
        for k in range(MICRO):
            b = {n: (v.to(torch.bfloat16) if v.is_floating_point() else v)
                 for n, v in batch(r, step, k).items()}
            m.zero_grad(set_to_none=True)
            m(**b).loss.backward()
            for n, p in m.named_parameters():
                if p.grad is not None:
                    total[n] = total.get(n, 0) + p.grad.float()
    return {n: total[n] / WORLD if n in total else None for n, _ in base.named_parameters()}


def train(rank, world, client, steps, log):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    model = build_model()
    mesh = init_device_mesh("cpu", (world,))
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.language_model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)  # vision tower + projector: root unit
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)  # Gloo has ignored AVG (python/README.md)
    inst = None
    if client is not None:
        import accord.torch

        inst = accord.torch.install(model, client)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    checked = {}
    prev = {}
    for step in range(steps):
        t0 = time.perf_counter()
        losses = []
        for k in range(MICRO):
            model.set_requires_gradient_sync(k == MICRO - 1)
            loss = model(**batch(rank, step, k)).loss
            loss.backward()
            losses.append(float(loss.detach()))
        if step == 0:
            checked = first_step_check(model, rank)
        if inst is not None:
            report_step(rank, world, step, losses, inst, prev, time.perf_counter() - t0, log)
        optim.step()
        optim.zero_grad(set_to_none=True)
    return checked


def first_step_check(model, rank):
    """Gathers the first step's gradients and compares them with the reference."""
    import torch
    import torch.distributed as dist

    grads = {}
    for n, p in model.named_parameters():
        has = [None] * dist.get_world_size()
        dist.all_gather_object(has, p.grad is not None)
        if all(has):
            grads[n] = p.grad.full_tensor().float()
        elif not any(has):
            grads[n] = None
        else:
            grads[n] = f"grad None on ranks {[r for r, h in enumerate(has) if not h]} only"
    all_grads = [None] * dist.get_world_size()
    dist.all_gather_object(all_grads, grads)
    if rank != 0:
        return {}
    ref = reference_grads(0)
    worst, none_kept = 0.0, 0
    for n, want in ref.items():
        for r, g in enumerate(all_grads):
            got = g[n]
            if isinstance(got, str):
                raise AssertionError(f"first step, {n}: {got}")
            if want is None:
                if got is not None:
                    raise AssertionError(f"first step, rank {r}, {n}: used on no rank, has a grad")
                continue
            if got is None:
                raise AssertionError(f"first step, rank {r}, {n}: gradient missing")
            if not torch.equal(got, all_grads[0][n]):
                raise AssertionError(f"first step, {n}: rank {r}'s gradient differs from rank 0's")
            err = (got - want).abs().max().item() / max(want.abs().max().item(), 1e-30)
            worst = max(worst, err)
        none_kept += want is None
    if worst > REL_BOUND:
        raise AssertionError(f"first step: rel. error {worst:.3g} > {REL_BOUND} vs the reference")
    return {"rel_error": worst, "none_kept": none_kept, "params": len(ref)}


def report_step(rank, world, step, losses, inst, prev, seconds, log):
    """Rank 0 prints the mean loss and, per group, what accord decided and did."""
    import torch.distributed as dist

    now = {
        gid: (s.zero_filled, s.widened, s.skipped, s.last_decision.wire_dtype)
        for gid, s in inst.stats.items()
    }
    delta = {gid: tuple(v[i] - prev.get(gid, (0, 0, 0, None))[i] for i in range(3)) + (v[3],)
             for gid, v in now.items()}
    prev.clear()
    prev.update(now)
    everyone = [None] * world
    dist.all_gather_object(everyone, (sum(losses), delta))
    if rank != 0:
        return
    loss = sum(l for l, _ in everyone) / world
    log(f"step {step}: loss {loss:.4f} (sum of {MICRO} microbatches, mean over ranks), "
        f"{seconds * 1000:.0f} ms on rank 0")
    for gid in sorted(delta):
        zf = [d[gid][0] for _, d in everyone]
        wid = [d[gid][1] for _, d in everyone]
        skipped = everyone[0][1][gid][2]
        log(f"    {gid:34s} wire {delta[gid][3]:8s} zero-filled/rank {zf}  "
            f"widened/rank {wid}  skipped {skipped}")


# ---------------------------------------------------------------- launcher


def _entry(rank, world, tmpdir, cluster, steps, log_path, q):
    import warnings

    import torch
    import torch.distributed as dist

    # Each rank's stdout and stderr (tracebacks, library warnings, FSDP2's own
    # prints) go to its own log file; rank 0 prints the report on the terminal.
    terminal = os.fdopen(os.dup(1), "w")
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    try:
        store = dist.FileStore(os.path.join(tmpdir, "store"), world)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
        client = None
        if cluster is not None:
            import accord

            sock, local_rank = cluster["sockets"][rank]
            client = accord.connect(sock, cluster["job"], rank, world, local_rank=local_rank)
        log = (lambda s: print(s, file=terminal, flush=True)) if rank == 0 else (lambda s: None)
        q.put((rank, "ok", train(rank, world, client, steps, log)))
    except BaseException as e:  # reported to the parent
        q.put((rank, "error", f"{type(e).__name__}: {str(e).strip().splitlines()[0][:400]}"))
        traceback.print_exc()
    q.close()
    q.join_thread()
    os._exit(0)


def launch(world, steps, cluster, timeout_s, log_dir, phase):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    out = {}
    with tempfile.TemporaryDirectory(prefix="accord-demo-") as tmpdir:
        procs = [
            ctx.Process(
                target=_entry,
                args=(r, world, tmpdir, cluster, steps, os.path.join(log_dir, f"{phase}.rank{r}.log"), q),
                daemon=True,
            )
            for r in range(world)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        while len(out) < world:
            try:
                rank, status, value = q.get(timeout=max(0.1, deadline - time.monotonic()))
                out[rank] = (status, value)
            except queue.Empty:
                break
            if status == "error" and cluster is None:
                deadline = min(deadline, time.monotonic() + 10)  # peers get a few seconds
        for r, p in enumerate(procs):
            if r not in out:
                out[r] = ("hang", f"no answer after {timeout_s:.0f}s (killed)")
            if p.is_alive():
                p.kill()
            p.join()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--plain-timeout", type=float, default=60.0)
    ap.add_argument("--accordctl", default=os.environ.get("ACCORDCTL", "accordctl"),
                    help="the accordctl program (default: $ACCORDCTL, else PATH)")
    ap.add_argument("--log-dir", default=os.path.join(tempfile.gettempdir(), "accord-torch-demo"))
    args = ap.parse_args()
    start = time.monotonic()
    os.makedirs(args.log_dir, exist_ok=True)
    print(f"(each rank's output goes to {args.log_dir}/<phase>.rank<N>.log)")

    print(f"== 1. plain FSDP2, {WORLD} ranks, same data (time limit {args.plain_timeout:.0f}s)",
          flush=True)
    plain = launch(WORLD, 1, None, args.plain_timeout, args.log_dir, "plain")
    for r in sorted(plain):
        print(f"  rank {r}: {plain[r][0]}: {plain[r][1] if plain[r][0] != 'ok' else 'trained'}")
    plain_failed = any(s != "ok" for s, _ in plain.values())
    if not plain_failed:
        print("FAILED: plain FSDP2 trained this data without an error; the demo shows nothing")
        return 1

    import accord

    print(f"== 2. FSDP2 + accord, {WORLD} ranks, local cluster: 1 coordinator, 2 sidecars",
          flush=True)
    job = "fsdp-transformers-demo"
    with accord.LocalCluster(num_sidecars=2) as cluster:
        info = {"job": job, "sockets": [cluster.socket_for(r, WORLD) for r in range(WORLD)]}
        res = launch(WORLD, args.steps, info, 240.0, args.log_dir, "accord")
        bad = {r: v for r, v in res.items() if v[0] != "ok"}
        if bad:
            print(f"FAILED: with accord: {bad}")
            return 1
        print(f"== 3. the coordinator's skip matrix: accordctl skips --job={job}", flush=True)
        skips = subprocess.run(
            [args.accordctl, f"--coordinator={cluster.coordinator_address}", "skips", f"--job={job}"],
            capture_output=True, text=True, timeout=30,
        )
        print(skips.stdout.rstrip() or skips.stderr.rstrip())
        if skips.returncode != 0:
            print(f"FAILED: accordctl exited {skips.returncode}")
            return 1
    check = res[0][1]
    print(
        f"PASSED in {time.monotonic() - start:.0f}s: plain FSDP2 failed on this data; with accord "
        f"{args.steps} steps trained on {WORLD} ranks (bf16 params, fp32 reduce, {MICRO} "
        f"microbatches); first-step gradients identical on every rank and equal to the "
        f"single-process reference (max rel. error {check['rel_error']:.2e} <= {REL_BOUND:g}) for "
        f"{check['params']} parameters, {check['none_kept']} used on no rank kept grad None; "
        f"skip matrix read from the coordinator"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
