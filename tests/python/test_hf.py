"""accord.hf with the Hugging Face Trainer and FSDP2 on 2 CPU ranks (Gloo),
with accord's real client and daemons (hf_scenarios.py has the job).

The tiny LLaVA (vision tower in the root unit) is sharded by transformers at
load time (DistributedConfig(fsdp_size=2)); even ranks train on image+text
samples, odd ranks on text only; 2 steps of 2 accumulated microbatches.
"""

import pytest
import torch

import hf_scenarios as hs
import model_scenarios as ms
from cluster_fixture import cluster_info, start_cluster
from harness import RankDied, RankFailure, RanksTimedOut, check_results, run_ranks

W = 2
STEPS = 2


@pytest.fixture(scope="module")
def cluster():
    with start_cluster(num_sidecars=2) as c:
        yield c


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("llava") / "ckpt")
    hs.save_checkpoint(path)
    return path


def test_trainer_with_accord_callback_matches_reference(cluster, ckpt, tmp_path):
    results = check_results(
        run_ranks(
            hs.train, W, 240.0, ckpt=ckpt, out_dir=str(tmp_path), mode="accord",
            cluster=cluster_info(cluster, W, "hf-trainer"), steps=STEPS,
        )
    )
    # The first optimizer step's gradients: the full-batch gradient of every
    # rank's microbatches (mean token loss), identical on every rank.
    ref = hs.reference(ckpt, [r["batches"] for r in results])
    unused = [n for n, g in ref.items() if g is None]
    assert unused and all(n.startswith("model.vision_tower.") for n in unused), unused
    for rank, r in enumerate(results):
        for name, want in ref.items():
            got = r["grads"][name]
            assert not isinstance(got, str), f"rank {rank} {name}: {got}"
            if want is None:
                assert got is None, f"rank {rank} {name}: used on no rank, got a gradient"
                continue
            assert got is not None, f"rank {rank} {name}: gradient missing"
            err = ms.rel_error(got, want)
            assert err <= 1e-5, f"rank {rank} {name}: rel. error {err:.3g}"
            assert torch.equal(got, results[0]["grads"][name]), f"{name}: ranks differ"
        assert len(r["losses"]) == STEPS and all(l == l for l in r["losses"]), r["losses"]
        # The Trainer reduces only on the synced microbatch: one reduction per
        # step. Odd (text-only) ranks zero-fill the tower and projector.
        used_vision = sum(
            1 for n, g in ref.items()
            if g is not None and n.startswith(("model.vision_tower.", "model.multi_modal_projector."))
        )
        reductions, zero_filled, widened, skipped = r["stats"]["fsdp/<root>"]
        assert (reductions, skipped) == (STEPS, len(unused) * STEPS), r["stats"]
        assert zero_filled == (used_vision * STEPS if rank % 2 else 0), r["stats"]


def test_trainer_without_accord_fails(ckpt, tmp_path):
    try:
        results = run_ranks(hs.train, W, 90.0, ckpt=ckpt, out_dir=str(tmp_path), mode="plain",
                            steps=1)
    except RanksTimedOut as e:
        print(f"plain FSDP2 under the Trainer hung: {str(e)[:300]}")
        return
    failures = [r for r in results if isinstance(r, (RankFailure, RankDied)) or r is None]
    assert failures, "the Trainer trained text-only and image ranks without accord and no error"
    print(f"plain FSDP2 under the Trainer failed: {failures[0]!r}"[:600])


def test_accelerate_fsdp2_plugin_on_cpu_is_refused_by_name(cluster, ckpt, tmp_path):
    """Accelerate 1.15 turns its FSDP plugin on only for GPU-like devices: on
    CPU the Trainer trains an unsharded model. AccordCallback refuses that
    with a message instead of leaving accord unused."""
    results = run_ranks(
        hs.train, W, 120.0, ckpt=ckpt, out_dir=str(tmp_path), mode="accord",
        cluster=cluster_info(cluster, W, "hf-accelerate"), steps=1, sharding="accelerate",
    )
    for r in results:
        assert isinstance(r, RankFailure), r
        assert "AccordHFError" in r.error and "no FSDP2 unit" in r.error, r.error


def test_grouped_tail_unit_as_accelerate_and_torchtitan_shard_it(cluster):
    results = check_results(
        run_ranks(hs.grouped_tail, W, 120.0, cluster=cluster_info(cluster, W, "hf-grouped"))
    )
    ref = results[0]["ref"]
    for rank, r in enumerate(results):
        for name, want in ref.items():
            got = r["grads"][name]
            if want is None:
                assert got is None, f"rank {rank} {name}: used on no rank, got a gradient"
                continue
            assert got is not None and not isinstance(got, str), f"rank {rank} {name}: {got}"
            assert ms.rel_error(got, want) <= 1e-5, f"rank {rank} {name}"
