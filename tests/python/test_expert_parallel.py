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
