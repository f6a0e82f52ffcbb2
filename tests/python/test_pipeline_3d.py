"""PP x TP x FSDP as one accord job under real torchrun with the embedded
default: 2 stages x 2 DP x 2 TP = 8 ranks (rank = 4 * stage + 2 * dp rank +
tp rank), each decoder layer's MLP tensor parallel, each stage module its own
FSDP root on the dp submesh of its TP coordinate, accord.torch.install(
stage_module, optional=[...]) and nothing else (docs/MEMBERS.md 3.1-3.3).
Each FSDP group is agreed among the ranks that reduce it: the stage's DP
ranks at the rank's TP coordinate (pp_torchrun.py --tp,
config_scenarios.run_pipeline)."""

import pytest

import accord
import config_scenarios as cs
from test_configs import BOTH, PARAM, check_accord, classify
from test_pipeline_one_job import pp_job

SCHEDULES = ["gpipe", "1f1b"]
PLAIN = ("1f1b", "plain", PARAM)

pytestmark = pytest.mark.skipif(not accord.HAVE_CLIENT, reason="built without the client")


@pytest.fixture(scope="module")
def job3d(tmp_path_factory):
    # FSDP2 alone last: its failure (a stage-1 rank waits PLAIN_TIMEOUT for
    # the failed stage 0) leaves nothing behind for the accord runs.
    return pp_job(tmp_path_factory, "pp3d", 8, BOTH, SCHEDULES + ["1f1b:plain:param"],
                  tp=True)


def members_of(rank):
    """The stage's DP ranks at the rank's TP coordinate."""
    first = 4 * (rank // 4) + rank % 2
    return [first, first + 2]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pipeline_tp_fsdp_3d(job3d, schedule):
    """The projection (its own unit, optional; used in microbatch 1 of even
    DP ranks at step 0, nowhere at step 1) and layer 1 (tensor parallel,
    optional; skipped by odd DP ranks at step 0, everywhere at step 1):
    gradients equal the single-process reference (the TP-sharded MLP
    weights compared whole, gathered over dp x tp), identical on the 4 ranks
    of each stage, None where used nowhere; the same collectives on each
    stage's ranks; one release per step."""
    results, _ = job3d
    run = (schedule, "embedded", BOTH)
    ref = results[0]["ref"]
    for stage in (0, 1):
        check_accord(results[4 * stage:4 * stage + 4], run, ref)
    names = set()
    for r in results:
        grads = r[run]["grads"]
        names.update(grads[0])
        for t in r[run]["timing"]:
            assert t["releases"] == cs.STEPS, t
        for name, got in grads[0].items():
            if ".mlp." in name and got is not None:
                assert got.shape == ref[0]["grads"][name].shape, name
    assert names == set(ref[0]["grads"]), "some parameter lives on no stage"
    on_stage0 = results[0][run]["grads"]
    assert on_stage0[0]["proj.weight"] is not None and on_stage0[1]["proj.weight"] is None
    assert on_stage0[0]["layers.1.mlp.down_proj.weight"] is not None
    assert on_stage0[1]["layers.1.mlp.down_proj.weight"] is None


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_3d_registers_each_group_with_its_stage_dp_ranks_at_its_tp_coordinate(job3d, schedule):
    """Every registration of a rank (FSDP groups, ~late, ~wire, the guard,
    the step watch, participation) carries the stage's DP ranks at the
    rank's TP coordinate, tagged with them; a stage's two TP coordinates
    register the same ids otherwise."""
    results, out = job3d
    run = (schedule, "embedded", BOTH)
    for rank, r in enumerate(results):
        regs = r[run]["registered"]
        m = members_of(rank)
        assert regs and all(got == m for _, got in regs), (rank, regs)
        assert all(gid.endswith(f"@ranks{m[0]}..{m[1]}/2") for gid, _ in regs), (rank, regs)
        assert any("/~late@" in gid for gid, _ in regs) and any(
            "/~collective-sequence/step@" in gid for gid, _ in regs), regs
    for stage in (0, 1):
        untagged = [sorted(gid.rsplit("@", 1)[0] for gid, _ in r[run]["registered"])
                    for r in results[4 * stage:4 * stage + 4]]
        assert all(u == untagged[0] for u in untagged), untagged
    assert len([ln for ln in out.splitlines() if "accord: embedded mode" in ln]) == 1, out


def test_3d_fsdp2_alone_diverges(job3d):
    """The same job with FSDP2 alone and the image divergence only (with
    layer 1 dropped too it hangs in the forward): the stage-0 ranks were
    about to issue different collectives (Gloo aborts the process on such a
    size mismatch)."""
    results, _ = job3d
    assert classify(results, PLAIN, results[0][("ref", PARAM)]) == "diverged", [
        r[PLAIN]["outcome"][:300] for r in results]
    assert all(r[PLAIN]["outcome"].startswith("WireMismatch") for r in results[:4]), [
        r[PLAIN]["outcome"][:300] for r in results[:4]]
