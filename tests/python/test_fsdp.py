"""FSDP2 on CPU with Gloo, 2 and 4 ranks, with accord's real client and daemons.

Gloo's reduce-scatter has ignored ReduceOp.AVG in some versions; every
scenario sets set_force_sum_reduction_for_comms(True) (SUM on the wire, divide
by the world size afterwards), so the references below are exact sums / W.
"""

import pytest
import torch

import fsdp_scenarios as sc
from cluster_fixture import cluster_info, start_cluster
from harness import RankDied, RankFailure, check_results, run_ranks

TIMEOUT_S = 240.0


@pytest.fixture(scope="module")
def cluster():
    with start_cluster(num_sidecars=2) as c:
        yield c


def run(cluster, fn, world_size, **kwargs):
    info = cluster_info(cluster, world_size, fn.__name__)
    return check_results(
        run_ranks(fn, world_size, TIMEOUT_S, agreement="accord", cluster=info, **kwargs)
    )


def assert_grads_match(result, rtol, atol):
    for name, ref in result["ref"].items():
        got = result["grads"][name]
        assert not isinstance(got, str), f"{name}: {got}"
        if ref is None:
            assert got is None, f"{name}: expected no gradient, got one"
            continue
        assert got is not None, f"{name}: gradient missing"
        torch.testing.assert_close(got, ref, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("world_size", [2, 4])
def test_grad_accumulation_late_param_matches_reference(cluster, world_size):
    results = run(cluster, sc.grad_accumulation, world_size)
    for r in results:
        # bf16 compute is identical; fp32 sums may differ in order only.
        assert_grads_match(r, rtol=1e-5, atol=1e-6)
        assert all(dt == "float32" for dt, _ in r["wire"]), r["wire"]
        # `late` arrived in bf16 next to fp32 accumulations: widened.
        assert r["stats"]["fsdp/<root>"][2] == 2, r["stats"]


@pytest.mark.parametrize("world_size", [2, 4])
def test_param_used_on_some_ranks_gets_correct_grads(cluster, world_size):
    results = run(cluster, sc.rank_branch, world_size)
    sizes = {tuple(r["wire"]) for r in results}
    assert len(sizes) == 1, f"ranks reduce-scattered different buffers: {sizes}"
    for rank, r in enumerate(results):
        assert_grads_match(r, rtol=1e-5, atol=1e-6)
        zero_filled = r["stats"]["fsdp/<root>"][1]
        assert zero_filled == (0 if sc._uses_branch(rank) else 2 * 2), (rank, r["stats"])


@pytest.mark.parametrize("unused_flag", [None, True])
@pytest.mark.parametrize("world_size", [2, 4])
def test_param_used_nowhere_stays_none_and_costs_no_bytes(cluster, world_size, unused_flag):
    if unused_flag is not None:
        from torch.distributed.fsdp import FSDPModule

        if not hasattr(FSDPModule, "set_reduce_scatter_unused_params"):
            pytest.skip("this torch's FSDP2 has no set_reduce_scatter_unused_params")
    results = run(cluster, sc.unused_everywhere, world_size, unused_flag=unused_flag)
    for r in results:
        assert r["grads"]["unused.weight"] is None and r["grads"]["unused.bias"] is None
        assert_grads_match(r, rtol=1e-5, atol=1e-6)
        # The first step has no previous decision: it carries every trainable
        # parameter and trims; from the second on, the unused one costs no bytes.
        assert sum(n for _, n in r["wire"][0]) > r["used_numel"], r["wire"]
        assert [n for _, n in r["wire"][1]] == [r["used_numel"]], (r["wire"], r["used_numel"])


@pytest.mark.parametrize("world_size", [2, 4])
def test_fp16_and_bf16_grads_go_as_fp32(cluster, world_size):
    results = run(cluster, sc.mixed_half_dtypes, world_size)
    for r in results:
        assert [dt for dt, _ in r["wire"]] == ["float32"], r["wire"]
        assert_grads_match(r, rtol=0, atol=0)


@pytest.mark.parametrize("world_size", [2, 3])
def test_speculation_keeps_grads_bit_identical(cluster, world_size):
    on = run(cluster, sc.deep_speculation, world_size, speculate=True)
    off = run(cluster, sc.deep_speculation, world_size, speculate=False)
    for rank, (a, b) in enumerate(zip(on, off)):
        assert a["speculate"] and not b["speculate"]
        # Without speculation every turn carries every trainable parameter.
        assert len(a["wire"]) == len(b["wire"]), (rank, a["wire"], b["wire"])
        assert sum(n for _, n in a["wire"]) <= sum(n for _, n in b["wire"])
        for name, g in a["grads"].items():
            assert not isinstance(g, str), (name, g)
            if g is None:
                assert b["grads"][name] is None, name
                continue
            assert torch.equal(g, b["grads"][name]), f"rank {rank} {name} differs with speculation"
        assert_grads_match(a, rtol=1e-5, atol=1e-6)
        assert a["stats"] == b["stats"]
        # The six blocks' post-backwards run inside autograd (block 2's twice);
        # those whose turn comes later are held, the same ones either way;
        # every turn of the 7 groups in 2 steps goes out before its decision.
        _, waits_on, held_on, speculated_on = a["timing"]
        _, waits_off, held_off, speculated_off = b["timing"]
        assert held_on == held_off and held_on >= 2, (a["timing"], b["timing"])
        assert speculated_on == speculated_off == 2 * 7, (a["timing"], b["timing"])
        assert waits_on == waits_off, (a["timing"], b["timing"])


def test_guard_adds_no_blocking_wait_in_the_steady_state(cluster):
    results = run(cluster, sc.sequence_guard, 2, diverge="none", steps=5)
    for r in results:
        assert r["error"] is None, r
        # The first two steps check each new collective once (the second's
        # tail goes during autograd: sequence_guard); later steps repeat them
        # and never wait.
        assert r["waits_after_warmup"] > 0 and r["waits"] == r["waits_after_warmup"], r
        assert r["reports"] > 4 * 10, r  # every collective of every step reported


@pytest.mark.parametrize("diverge,diverge_step", [("order", 0), ("skip", 0), ("order", 2),
                                                  ("skip", 2)])
def test_guard_names_divergence_on_every_rank(cluster, diverge, diverge_step):
    """Both ranks end with one identical error naming the collective each issued,
    whether the divergence comes in the first step (every collective is still
    new: both ranks stop before it) or later (the diverging rank stops before
    its new collective; the other, blocked in Gloo, is ended by its guard)."""
    info = cluster_info(cluster, 2, f"guard-{diverge}-{diverge_step}")
    results = run_ranks(sc.sequence_guard, 2, 120.0, agreement="accord", cluster=info,
                        diverge=diverge, diverge_step=diverge_step)
    texts = []
    for r in results:
        if isinstance(r, RankDied):
            assert r.exitcode == 3, r
            line = [l for l in r.stderr.splitlines() if l.startswith("AccordDivergenceError: ")]
            assert line, r.stderr
            texts.append(line[-1].split(": ", 1)[1])
        else:
            assert not isinstance(r, RankFailure), r
            assert r["error"] is not None, f"no divergence reported: {r}"
            assert r["seconds"] < 60, r
            texts.append(r["error"])
    assert texts[0] == texts[1], texts
    text = texts[0]
    assert text.startswith("accord: the ranks' FSDP collectives diverged: "), text
    if diverge == "order":
        want = ("rank 0 issued step {s} position 1: all-gather of 'blocks.0' (110 x float32); "
                "rank 1 issued step {s} position 1: all-gather of 'blocks.3' (110 x float32)")
    else:
        want = ("rank 0 issued step {s} position 3: all-gather of 'blocks.2' (100 x float32); "
                "rank 1 issued step {s} position 3: all-gather of 'blocks.3' (110 x float32)")
    assert want.format(s=diverge_step + 1) in text, text
    assert "optional=[...]" in text


def test_guard_names_all_gathers_of_different_dtypes(cluster):
    """fp16 parameters on one rank, bf16 on the other: the all-gathers have the
    same size, so Gloo pairs them and reinterprets the bits; the guard names it."""
    results = run(cluster, sc.mixed_half_dtypes, 2, guard=True)
    assert results[0]["error"] == results[1]["error"], results
    assert ("rank 0 issued step 1 position 0: all-gather of '<root>' (54 x float16); "
            "rank 1 issued step 1 position 0: all-gather of '<root>' (54 x bfloat16)"
            in results[0]["error"]), results


@pytest.mark.parametrize("diverge", ["order", "skip"])
def test_guard_learns_units_that_diverge_from_the_first_step(cluster, diverge):
    """With learning on (install's default), the same first-step divergences
    train: each diverging forward all-gather pins a unit on every rank, one by
    one, until the ranks' sequences agree."""
    results = run(cluster, sc.sequence_guard, 2, diverge=diverge, diverge_step=0, learn=True)
    want = {"order": ["blocks.0", "blocks.1", "blocks.2"], "skip": ["blocks.2"]}[diverge]
    for r in results:
        assert r["error"] is None, r
        assert r["learned"] == want, r
