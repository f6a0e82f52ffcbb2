"""Pipeline parallel as one accord job under real torchrun with the embedded
default: 2 stages x 2 DP, accord.torch.install(stage_module) per stage and
nothing else (docs/MEMBERS.md 3.2, 3.3). Each stage's groups and its own
checks are agreed among the stage's DP ranks, their member set."""

import os
import subprocess
import sys

import pytest
import torch

import accord
import config_scenarios as cs
from test_configs import BOTH, check_accord
from test_embedded import Job, finish

HERE = os.path.dirname(os.path.abspath(__file__))
SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b"]

pytestmark = pytest.mark.skipif(not accord.HAVE_CLIENT, reason="built without the client")


def pp_job(tmp_path_factory, name, nproc, kinds, runs, tp=False):
    """pp_torchrun.py under torchrun --nproc-per-node=NPROC with the
    embedded default, `runs` its SCHEDULE[:MODE] arguments: every rank's
    results and torchrun's output."""
    job = Job(tmp_path_factory.mktemp(name), name)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", os.path.join(HERE, "pp_torchrun.py"),
           *(["--tp"] if tp else []), str(job.out), "+".join(kinds), *runs]
    code, out = finish(subprocess.Popen(cmd, env=job.env, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True), "torchrun")
    assert code == 0, out
    results = [torch.load(job.out / f"rank{r}.pt", weights_only=False) for r in range(nproc)]
    job.assert_clean()
    return results, out


@pytest.fixture(scope="module")
def one_job(tmp_path_factory):
    return pp_job(tmp_path_factory, "pp", 4, BOTH, SCHEDULES)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pipeline_one_job(one_job, schedule):
    """The projection (used in one microbatch of even DP ranks at step 0,
    nowhere at step 1) and layer 1 (skipped by odd DP ranks at step 0,
    everywhere at step 1), both marked optional: gradients equal the
    single-process reference, identical across each stage's DP ranks, None
    where used nowhere; one release per step."""
    results, _ = one_job
    run = (schedule, "embedded", BOTH)
    ref = results[0]["ref"]
    for stage in (0, 1):
        check_accord(results[2 * stage:2 * stage + 2], run, ref)
    on_stage0 = results[0][run]["grads"]
    assert on_stage0[0]["proj.weight"] is not None and on_stage0[1]["proj.weight"] is None
    names = set()
    for r in results:
        names.update(r[run]["grads"][0])
        for t in r[run]["timing"]:
            assert t["releases"] == cs.STEPS, t
    assert names == set(ref[0]["grads"]), "some parameter lives on no stage"


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pipeline_one_job_registers_each_stage_with_its_dp_ranks(one_job, schedule):
    """Every registration of a stage's rank carries the stage's DP ranks and
    is tagged with them; the two chunks of an interleaved rank (same DP
    peers) get prefixes of their own."""
    results, out = one_job
    run = (schedule, "embedded", BOTH)
    for rank, r in enumerate(results):
        regs = r[run]["registered"]
        first = 2 * (rank // 2)
        assert regs and all(m == [first, first + 1] for _, m in regs), (rank, regs)
        assert all(gid.endswith(f"@ranks{first}..{first + 1}") for gid, _ in regs), regs
        prefixes = {gid.split("/", 1)[0] for gid, _ in regs}
        if schedule == "interleaved_1f1b":
            assert len(prefixes) == 2 and any(p.endswith(".1") for p in prefixes), prefixes
        else:
            assert len(prefixes) == 1, prefixes
    # The first run installed with no prefix at all: accord's default ids.
    if schedule == SCHEDULES[0]:
        assert any(gid.startswith("fsdp/<root>@") for gid, _ in results[0][run]["registered"])
    assert len([ln for ln in out.splitlines() if "accord: embedded mode" in ln]) == 1, out
