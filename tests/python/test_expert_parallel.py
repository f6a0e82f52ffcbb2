"""Expert parallel with FSDP2 under accord (ep_scenarios.py): the experts'
groups are agreed among their expert-data-parallel ranks, the dense groups
among every rank; real daemons, 4 ranks on CPU/Gloo."""

import pytest
import torch

import ep_scenarios as ep
from cluster_fixture import cluster_info, start_cluster
from harness import check_results, run_ranks

import accord

pytestmark = pytest.mark.skipif(not accord.HAVE_CLIENT, reason="built without the client")
BOUND = 1e-5


@pytest.fixture(scope="module")
def results():
    with start_cluster(num_sidecars=2) as c:
        return check_results(run_ranks(ep.run_ep, 4, 240.0, cluster=cluster_info(c, 4, "ep")))


def test_stacked_experts_match_the_reference(results):
    """Gradients equal the single-process reference: dense layers on every
    rank, each EP rank's expert rows (an expert with no token anywhere: a
    zero slice, as FSDP2 alone gives it)."""
    ref = results[0]["ref"]
    for r in results:
        assert r["outcome"] == "ok", f"{r['outcome']}\n{r.get('traceback')}"
        e = r["rank"] % 2
        for step, grads in enumerate(r["grads"]):
            for name, got in grads.items():
                want = ref[step][name]
                if name == "experts.w":
                    want = want[2 * e:2 * e + 2]
                assert got is not None, (r["rank"], step, name)
                scale = max(want.abs().max().item(), 1e-12)
                err = (got - want).abs().max().item() / scale
                assert err <= BOUND, (r["rank"], step, name, err)
    assert ref[0]["experts.w"][3].abs().max().item() == 0  # expert 3 idle at step 0


def test_expert_groups_register_their_edp_member_set(results):
    """The experts' group carries the EDP ranks of the rank's EP coordinate;
    the root (dense) group and the installation's own groups (the union:
    every rank) carry none."""
    for r in results:
        e = r["rank"] % 2
        regs = dict(r["registered"])
        experts = [gid for gid in regs if gid.startswith("fsdp/experts@")]
        assert experts == [f"fsdp/experts@ranks{e}..{e + 2}/2"], regs
        assert regs[experts[0]] == [e, e + 2]
        assert regs["fsdp/<root>"] is None and regs["fsdp/~late"] is None, regs



def _per_module(optional):
    with start_cluster(num_sidecars=2) as c:
        name = "ep-pm" if optional else "ep-pm-learn"
        return check_results(run_ranks(ep.run_ep, 4, 240.0, cluster=cluster_info(c, 4, name),
                                       per_module=True, optional=optional))


@pytest.fixture(scope="module")
def per_module():
    return _per_module(optional=True)


@pytest.fixture(scope="module")
def per_module_learned():
    return _per_module(optional=False)


def ran_expert(rank, step, expert, table=ep.PM_CHOICES):
    """Whether the EP rank holding `expert` got a token for it from `rank`'s
    EP group."""
    return any(bool((ep.routes(2 * (rank // 2) + j, step, table)[0] == expert).any())
               for j in range(2))


def check_per_module(results):
    """Gradients equal the reference (each rank's experts.j is global
    expert 2e + j), identical on the 4 ranks (dense) or the 2 EDP ranks
    (experts), None for an expert no rank routed a token to."""
    ref = results[0]["ref"]
    for r in results:
        assert r["outcome"] == "ok", f"{r['rank']}: {r['outcome']}\n{r.get('traceback')}"
        e = r["rank"] % 2
        for step, grads in enumerate(r["grads"]):
            assert len(grads) == 4 + 2, grads.keys()
            for name, got in grads.items():
                glob = name
                if name.startswith("experts."):
                    glob = f"experts.{2 * e + int(name.split('.')[1])}.w"
                want, where = ref[step][glob], (r["rank"], step, name)
                if want is None:
                    assert got is None, where
                    continue
                assert got is not None, where
                scale = max(want.abs().max().item(), 1e-12)
                assert (got - want).abs().max().item() / scale <= BOUND, where
                peer = results[r["rank"] ^ 2 if name.startswith("experts.") else 0]
                assert torch.equal(got, peer["grads"][step][name]), where


def test_per_module_experts_match_the_reference(per_module):
    """Per-module experts, each its own FSDP unit on its EDP group, marked
    optional; equal paths on both EP coordinates hold different experts.
    Step 0: expert 1 has tokens on rank 0 only (rank 2, its EDP peer, does
    not run it), expert 3 on no rank; step 1: expert 1 on none, expert 2 on
    rank 1 only."""
    assert ran_expert(0, 0, 1) and not ran_expert(2, 0, 1)
    assert not any(ran_expert(r, 0, 3) or ran_expert(r, 1, 1) for r in range(4))
    assert ran_expert(1, 1, 2) and not ran_expert(3, 1, 2)
    ref = per_module[0]["ref"]
    assert ref[0]["experts.3.w"] is None and ref[1]["experts.1.w"] is None
    check_per_module(per_module)
    assert per_module[1]["grads"][0]["experts.1.w"] is None  # expert 3 on rank 1
    assert all(not r["learned"] for r in per_module)


def test_per_module_experts_get_a_guard_per_member_set(per_module):
    """One collective-sequence guard per member set: every rank for the
    dense groups, the EDP ranks of the rank's EP coordinate for its
    experts; an expert's participation among its EDP ranks."""
    for r in per_module:
        e = r["rank"] % 2
        tag = f"@ranks{e}..{e + 2}/2"
        regs = dict(r["registered"])
        assert regs["fsdp/~collective-sequence"] is None, regs
        assert regs[f"fsdp/~collective-sequence{tag}"] == [e, e + 2], regs
        assert regs[f"fsdp/~collective-sequence/step{tag}"] == [e, e + 2], regs
        for j in range(2):
            assert regs[f"fsdp/experts.{j}{tag}"] == [e, e + 2], regs
            assert regs[f"fsdp/~participation/experts.{j}{tag}"] == [e, e + 2], regs
        assert regs["fsdp/<root>"] is None and regs["fsdp/~late"] is None, regs


def test_per_module_experts_learned(per_module_learned):
    """Nothing marked: at step 0 each EDP pair's guard learns its first
    expert (run on one of its ranks only, the other went on to the second
    expert's forward all-gather) among its own ranks; the same gradients,
    None for expert 0 at step 1 (no token anywhere)."""
    t = ep.LEARN_CHOICES
    assert ran_expert(0, 0, 0, t) and not ran_expert(2, 0, 0, t)
    assert ran_expert(1, 0, 2, t) and not ran_expert(3, 0, 2, t)
    assert all(ran_expert(r, s, x, t) for r in range(4) for s in range(2) for x in (1, 3))
    assert not any(ran_expert(r, 1, 0, t) for r in range(4))
    check_per_module(per_module_learned)
    assert per_module_learned[0]["grads"][1]["experts.0.w"] is None
    for r in per_module_learned:
        assert r["learned"] == ["experts.0"], (r["rank"], r["learned"])


def test_per_module_experts_fsdp2_alone_hang():
    """The marked job's data with FSDP2 alone (5 s process-group timeouts):
    rank 0 all-gathers expert 1, which its EDP peer rank 2 never runs, so the
    pair's collectives no longer match and no rank trains through: the pair
    times out (NCCL: a hang), and a rank whose peer ended first may see the
    connection closed instead."""
    results = run_ranks(ep.run_ep, 4, 120.0, per_module=True, use_accord=False,
                        group_timeout_s=5)
    outcomes = [r["outcome"] if isinstance(r, dict) else repr(r) for r in results]
    gloo_failures = ("Timed out", "Connection closed by peer", "Connection reset by peer")
    assert all(any(f in o for f in gloo_failures) for o in outcomes), outcomes
    assert any("Timed out" in o for o in outcomes), outcomes
