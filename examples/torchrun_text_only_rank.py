"""A text-only rank in FSDP2 training, under torchrun, with accord and
nothing to set up.

    torchrun --nproc-per-node=2 examples/torchrun_text_only_rank.py

    # two nodes (here: two torchrun agents on one host, c10d rendezvous)
    torchrun --nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d \
        --rdzv-endpoint=127.0.0.1:29400 --node-rank=0 examples/torchrun_text_only_rank.py &
    torchrun --nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d \
        --rdzv-endpoint=127.0.0.1:29400 --node-rank=1 examples/torchrun_text_only_rank.py

A tiny vision-language model: a vision tower, a token embedding, FSDP2 blocks
and a head. The tower lives in the root FSDP unit. The last rank trains on
text only, so its tower parameters get no gradient: without accord its
reduce-scatter of the root unit is smaller than the other ranks' (a Gloo
error or a hang). In the last step no rank sees an image.

`accord.torch.install(model)` is the only accord line. With no client it
calls `accord.connect()`, which under torchrun starts the job's own
coordinator and one sidecar per node (embedded mode, docs/EMBEDDED.md) unless
a deployed sidecar answers. The ranks then agree on every reduce-scatter: the
text-only rank contributes zeros for the tower, and in the step without
images the tower is left out on every rank (its gradient stays None).

Each step every rank compares its gradients with a single-process reference
computed from all ranks' batches; rank 0 prints one line per step and a final
PASSED or FAILED line (exit status 1 on failure). CPU and Gloo, any number of
ranks >= 2.
"""

import copy
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import accord.torch

VOCAB, DIM, IMAGE_FEATURES, LAYERS = 64, 32, 48, 2
STEPS, LR, TOLERANCE = 3, 0.1, 1e-5


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.mlp = nn.LayerNorm(DIM), nn.Sequential(
            nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class TinyVLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.vision = nn.Sequential(nn.Linear(IMAGE_FEATURES, DIM), nn.GELU(), nn.Linear(DIM, DIM))
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens, image=None):
        x = self.embed(tokens)
        if image is not None:  # text-only batches never run the tower
            x = x + self.vision(image)[:, None, :]
        for block in self.blocks:
            x = block(x)
        return self.head(x.flatten(0, 1))  # (batch * tokens, vocab)


def batch(step, rank, world):
    """Rank `rank`'s batch at `step`: text, plus an image except on the last
    rank, and on no rank in the last step."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(VOCAB, (2, 8), generator=g)
    text_only = rank == world - 1 or step == STEPS - 1
    return tokens, None if text_only else torch.randn(2, IMAGE_FEATURES, generator=g)


def loss_fn(model, tokens, image):
    logits = model(tokens, image).unflatten(0, tokens.shape)
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def reference_grads(ref_model, step, world):
    """The gradient FSDP2 should produce: the mean over ranks of each rank's
    loss gradient, on one unsharded copy (None: used on no rank)."""
    ref_model.zero_grad(set_to_none=True)
    for r in range(world):
        (loss_fn(ref_model, *batch(step, r, world)) / world).backward()
    return {n: p.grad for n, p in ref_model.named_parameters()}


def compare(model, ref):
    """(max relative error, list of problems) of this rank's full gradients."""
    worst, problems = 0.0, []
    for name, p in model.named_parameters():
        got = None if p.grad is None else p.grad.full_tensor()
        want = ref[name]
        if want is None or got is None:
            if (want is None) != (got is None):
                problems.append(f"{name}: gradient {'missing' if got is None else 'present'}, "
                                f"reference {'None' if want is None else 'present'}")
            continue
        err = ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
        worst = max(worst, err)
        if err > TOLERANCE:
            problems.append(f"{name}: rel. error {err:.3g}")
    return worst, problems


def gather(values, world):
    """Every rank's `values` (numbers), as a list of lists indexed by rank."""
    rows = [torch.zeros(len(values), dtype=torch.float64) for _ in range(world)]
    dist.all_gather(rows, torch.tensor(values, dtype=torch.float64))
    return [row.tolist() for row in rows]


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world < 2:
        sys.exit("run with at least 2 ranks: torchrun --nproc-per-node=2 " + sys.argv[0])

    torch.manual_seed(0)
    model = TinyVLM()
    ref_model = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.set_force_sum_reduction_for_comms(True)  # Gloo: average as sum + scale

    installation = accord.torch.install(model)  # no client: accord.connect() picks the sidecar

    optim = torch.optim.SGD(model.parameters(), lr=LR)
    ref_optim = torch.optim.SGD(ref_model.parameters(), lr=LR)
    failures = []
    for step in range(STEPS):
        tokens, image = batch(step, rank, world)
        loss = loss_fn(model, tokens, image)
        loss.backward()

        ref = reference_grads(ref_model, step, world)
        worst, problems = compare(model, ref)
        failures += [f"step {step} rank {rank}: {p}" for p in problems]
        # (max error, mismatches, text-only) of every rank, with tensors
        # only: all_gather_object would need numpy.
        per_rank = gather([worst, len(problems), image is None], world)
        if rank == 0:
            text_only = [r for r, row in enumerate(per_rank) if row[2]]
            print(f"step {step}: text-only ranks {text_only}; max rel. error vs reference "
                  f"{max(row[0] for row in per_rank):.2e} over {world} ranks", flush=True)
        optim.step()
        ref_optim.step()
        optim.zero_grad(set_to_none=True)

    for failure in failures:
        print(f"mismatch: {failure}", flush=True)
    root = installation.stats["fsdp/<root>"]  # the root FSDP unit holds the tower
    totals = gather([len(failures), root.zero_filled, root.skipped], world)
    failed = sum(int(row[0]) for row in totals)
    if rank == 0:
        if failed:
            print(f"FAILED: {failed} gradient mismatches (the lines starting with "
                  f"'mismatch:' name them)", flush=True)
        else:
            print(f"PASSED: {world} ranks, {STEPS} steps, rank {world - 1} text-only: every "
                  f"rank's gradients equal the single-process reference (rel. error <= "
                  f"{TOLERANCE:g}); root unit zero-filled per rank "
                  f"{[int(row[1]) for row in totals]}, skipped {int(totals[0][2])}", flush=True)
    dist.destroy_process_group()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
