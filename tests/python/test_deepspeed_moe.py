"""DeepSpeed's own MoE layer (deepspeed.moe.layer.MoE, expert parallel with
ep_size 2) under ZeRO-1/2 with accord.deepspeed, CPU/Gloo, 2 and 4 ranks
(scenarios in deepspeed_moe_scenarios.py).

DeepSpeed reduces expert gradients over expert-data-parallel (EDP) groups
({0}, {1} with 2 ranks; {0, 2}, {1, 3} with 4), the rest over the
data-parallel group, in the same buckets. Its layer dispatches a fixed
capacity to every expert, so an expert with no tokens, on some ranks or on
all, still runs and gets a zero gradient: DeepSpeed alone trains there, and
steps such an expert (weight decay) with or without accord. What breaks is a
layer that some expert-parallel group skips (pinned: Gloo's size mismatch),
and, under accord, a repair of expert gradients (the layer skipped by every
rank in one step, used again in the next), which must be reduced over the
EDP group, not the data-parallel group.
"""

import pytest

pytest.importorskip("deepspeed")

import torch  # noqa: E402

import deepspeed_moe_scenarios as ms  # noqa: E402
import deepspeed_scenarios as sc  # noqa: E402
from harness import RankDied, RankFailure  # noqa: E402

MISMATCH = "doesn't match expected size"
EP = 2  # ep_size: expert-parallel groups of consecutive ranks, EDP groups strided


def _is_moe(name):
    return ".deepspeed_moe." in name


def _is_expert(name):
    return ".deepspeed_experts." in name


def _failures(results):
    return [r for r in results if isinstance(r, (RankFailure, RankDied))]


def _text(r):
    return r.stderr if isinstance(r, RankDied) else f"{r.error}\n{r.traceback}"


def _steps(results):
    for r in results:
        assert not isinstance(r, (RankFailure, RankDied)), repr(r)
    return [r[:-1] for r in results]


def _check_reference(results):
    """Each rank's gradients (its experts by global index) equal the plain
    torch reference; where the reference has none, DeepSpeed's is zero."""
    for rank, records in enumerate(_steps(results)):
        for step, rec in enumerate(records):
            for n, g in rec["grads"].items():
                ref = rec["ref"][n]
                if ref is None:
                    assert torch.count_nonzero(g) == 0, (rank, step, n)
                else:
                    assert (g - ref).norm() <= 1e-5 * ref.norm() + 1e-8, (rank, step, n)


def _check_identical(results):
    """Dense gradients identical on every rank; an expert's on every rank of
    its EDP group."""
    per_rank = _steps(results)
    for rank, records in enumerate(per_rank):
        for other in range(len(per_rank)):
            for rec, theirs in zip(records, per_rank[other]):
                for n, g in rec["grads"].items():
                    if not _is_expert(n) or other % EP == rank % EP:
                        assert torch.equal(g, theirs["grads"][n]), (rank, other, n)


def _check_layer_unchanged(results, step):
    """No rank ran the MoE layer at `step`: its gate and experts, their fp32
    values and Adam moments on every rank's partition, bitwise unchanged."""
    checked = 0
    for records in _steps(results):
        rec = records[step]
        moe = [n for n in rec["grads"] if _is_moe(n)]
        assert moe and all(rec["ref"][n] is None for n in moe)
        for n in moe:
            assert torch.equal(rec["after"][n], rec["start"][n]), n
            before, after = rec["moments"][n], rec["after_moments"][n]
            # fp32 slice, exp_avg, exp_avg_sq; none where this rank's partition holds none of it
            assert len(before) == len(after) and len(after) in (0, 3), n
            for b, a in zip(before, after):
                assert torch.equal(a, b), n
            checked += len(after)
        assert not torch.equal(rec["after"]["embed.weight"], rec["start"]["embed.weight"])
    assert checked


def _check_same_collectives(results):
    """Every rank issues the same collectives (sizes included), but for the
    layer's all-to-alls, the same within each expert-parallel group."""
    seqs = [r[-1]["collectives"] for r in results]
    for rank, seq in enumerate(seqs):
        assert seq == seqs[rank - rank % EP], rank
    reductions = [[c for c in seq if c[0] != "all_to_all_single"] for seq in seqs]
    assert reductions[0] and all(s == reductions[0] for s in reductions[1:])


# ---------------------------------------------------------------- without accord (pinned)


def test_without_accord_a_layer_skipped_by_one_expert_parallel_group_kills_the_job():
    """4 ranks: ranks 2 and 3 skip the layer at step 1, so their buckets hold
    no expert gradient: Gloo's size mismatch in step 1's reduction."""
    results = sc.run_ds_ranks(ms.train, 4, timeout_s=150, case="ep_group_1_skips", steps=2)
    failed = _failures(results)
    assert failed, "DeepSpeed trained without accord: the pinned failure changed"
    assert any(MISMATCH in _text(r) for r in failed), [_text(r)[-800:] for r in failed]


def test_without_accord_tokenless_experts_get_zero_gradients_and_a_skipped_layer_moves():
    """2 ranks: expert 1 gets no token on any rank at step 0 (a zero
    gradient, DeepSpeed's dense dispatch: reference gradients, no failure);
    no rank runs the layer at step 1: the same collectives on both ranks,
    and weight decay moves the layer's parameters."""
    results = sc.run_ds_ranks(ms.train, 2, timeout_s=150, case="mixed", steps=2)
    _check_reference(results)
    for records in _steps(results):
        rec = records[1]
        for n in rec["grads"]:
            if _is_moe(n):
                assert not torch.equal(rec["after"][n], rec["start"][n]), n


# ---------------------------------------------------------------- with accord


@pytest.mark.parametrize("stage,zero", [(2, None), (1, {"overlap_comm": True}), (1, None)])
def test_moe_layer_with_tokenless_experts_trains_with_reference_gradients(stage, zero):
    """2 ranks, EDP groups of one rank ("mixed": expert 1 tokenless
    everywhere at step 0, the layer run nowhere at step 1, rank 1's tokens all
    to expert 0 after). Gradients equal the reference; the layer is bitwise
    unchanged with its moments at step 1; with turns (ZeRO-2, ZeRO-1 with
    overlap_comm) step 2's expert gradients are repaired, over each expert's
    EDP group; the same collectives on both ranks. Expert 1 at step 0 is
    stepped with its zero gradient, as DeepSpeed alone does."""
    results = sc.run_ds_ranks(ms.train, 2, timeout_s=150, case="mixed", steps=4, stage=stage,
                              zero=zero, accord="embedded", record=True)
    _check_reference(results)
    _check_identical(results)
    _check_layer_unchanged(results, 1)
    _check_same_collectives(results)
    turns = stage == 2 or zero is not None
    for r in results:
        stats = r[-1]["stats"]
        assert stats["restored"] == 3  # the gate, expert weight and bias
        assert (stats["repaired"] > 0) == turns, stats


def test_moe_layer_skipped_by_one_expert_parallel_group_trains_on_four_ranks():
    """4 ranks, EDP groups {0, 2} and {1, 3} ("ep_group_1_skips": ranks 2 and
    3 skip the layer at step 1, every rank at step 2). Gradients equal the
    reference and are identical within each EDP group (dense ones on every
    rank); step 3 repairs the layer over the data-parallel group (the gate)
    and each EDP group (the experts); the layer is unchanged at step 2."""
    results = sc.run_ds_ranks(ms.train, 4, timeout_s=200, case="ep_group_1_skips", steps=4,
                              accord="embedded", record=True)
    _check_reference(results)
    _check_identical(results)
    _check_layer_unchanged(results, 2)
    _check_same_collectives(results)
    for r in results:
        assert r[-1]["stats"]["repaired"] >= 3, r[-1]["stats"]


def test_zero3_refuses_deepspeeds_moe_layer():
    """DeepSpeed 0.19.8 refuses its own MoE layer under ZeRO-3 at
    deepspeed.initialize (pinned: a release that supports it is noticed)."""
    results = sc.run_ds_ranks(ms.train, 2, timeout_s=150, case="mixed", steps=1, stage=3)
    failed = _failures(results)
    assert len(failed) == 2, results
    assert all("Native DeepSpeed MoE is not supported with ZeRO Stage 3" in _text(r)
               for r in failed), [_text(r)[-800:] for r in failed]
