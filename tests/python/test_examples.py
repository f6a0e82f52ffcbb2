"""examples/torchrun_text_only_rank.py run unchanged under real torchrun, as
README.md and python/README.md tell a new user to: one agent with 2 ranks,
and two agents (one rank each) on loopback with c10d rendezvous. Then the
Hugging Face Trainer with `accord.hf.AccordCallback()` and no argument under
torchrun (hf_torchrun.py), and DeepSpeed ZeRO-2/3 with
`accord.deepspeed.install(engine)` and no client under torchrun
(ds_torchrun.py).

Nothing accord-specific is set: no ACCORD_* variable (the daemons come from
the package's accord/bin), so `accord.torch.install(model)` goes embedded.
Each job gets a private TMPDIR, which must hold no accord entry afterwards.
"""

import os
import pathlib
import shutil
import socket
import subprocess
import sys
import tempfile

import pytest

import accord

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "torchrun_text_only_rank.py"
HERE = os.path.dirname(os.path.abspath(__file__))
JOB_TIMEOUT_S = 180

pytestmark = pytest.mark.skipif(not accord.HAVE_CLIENT, reason="built without the client")


@pytest.fixture
def env():
    tmp = tempfile.mkdtemp(prefix="acc-ex-", dir="/tmp")  # short: sockets go there
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCORD_")}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
              "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        env.pop(k, None)
    pkg = os.path.dirname(os.path.dirname(os.path.abspath(accord.__file__)))
    env.update(PYTHONPATH=pkg, TMPDIR=tmp, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    yield env
    left = sorted(f for f in os.listdir(tmp) if f.startswith("accord"))
    shutil.rmtree(tmp, ignore_errors=True)
    assert not left, f"left in TMPDIR after the job: {left}"


def torchrun(env, *args, script=EXAMPLE, script_args=()):
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", *args, str(script), *script_args],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc, what):
    try:
        out, _ = proc.communicate(timeout=JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"{what} still running after {JOB_TIMEOUT_S} s; output:\n{out}")
    return proc.returncode, out


def check_passed(out):
    passed = [ln for ln in out.splitlines() if ln.startswith("PASSED: ")]
    assert len(passed) == 1 and "FAILED" not in out, out
    # Rank 1 is text-only: it zero-fills the tower's 4 parameters in the 2
    # steps with images; in the last step no rank has an image and the tower
    # is skipped on every rank.
    assert passed[0].startswith("PASSED: 2 ranks, 3 steps, rank 1 text-only: every rank's "
                                "gradients equal the single-process reference"), passed[0]
    assert passed[0].endswith("root unit zero-filled per rank [0, 8], skipped 4"), passed[0]
    steps = [ln for ln in out.splitlines() if ln.startswith("step ")]
    assert [ln.split(";")[0] for ln in steps] == [
        "step 0: text-only ranks [1]", "step 1: text-only ranks [1]",
        "step 2: text-only ranks [0, 1]"], out
    modes = [ln for ln in out.splitlines() if ln.startswith("accord: embedded mode")]
    assert len(modes) == 1, f"expected rank 0's one mode line:\n{out}"


def test_example_under_torchrun_one_agent_two_ranks(env):
    code, out = finish(torchrun(env, "--standalone", "--nproc-per-node=2"), "torchrun")
    assert code == 0, out
    check_passed(out)


def test_example_as_two_nodes_two_agents_on_loopback(env):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = ["--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}"]
    agents = [torchrun(env, *args) for _ in range(2)]
    outs = [finish(a, f"torchrun agent {n}") for n, a in enumerate(agents)]
    out = "\n".join(o for _, o in outs)
    assert [c for c, _ in outs] == [0, 0], out
    check_passed(out)


def test_hf_trainer_callback_with_no_arguments_under_torchrun(env, tmp_path):
    pytest.importorskip("transformers")
    import hf_scenarios as hs

    ckpt = tmp_path / "ckpt"
    hs.save_checkpoint(str(ckpt))
    env = dict(env, PYTHONPATH=os.pathsep.join([env["PYTHONPATH"], HERE]))
    code, out = finish(torchrun(env, "--standalone", "--nproc-per-node=2",
                                script=os.path.join(HERE, "hf_torchrun.py"),
                                script_args=(str(ckpt), str(tmp_path / "out"))), "torchrun")
    assert code == 0, out
    assert len([ln for ln in out.splitlines() if ln.startswith("accord: embedded mode")]) == 1, out
    ranks = {}
    for ln in out.splitlines():
        if ln.startswith("hf rank "):
            f = ln.split()
            ranks[int(f[2].rstrip(":"))] = {f[i]: f[i + 1] for i in range(3, len(f), 2)}
    assert sorted(ranks) == [0, 1], out
    # 2 optimizer steps, one reduction each; rank 1 (text-only) zero-fills the
    # tower and projector, rank 0 nothing; parameters used on no rank skipped.
    assert [ranks[r]["reductions"] for r in (0, 1)] == ["2", "2"], ranks
    assert ranks[0]["zero_filled"] == "0" and int(ranks[1]["zero_filled"]) > 0, ranks
    assert ranks[0]["skipped"] == ranks[1]["skipped"] != "0", ranks
    assert ranks[0]["loss"] == ranks[1]["loss"], ranks


@pytest.mark.parametrize("stage,tower", [(2, "given"), (3, "given"), (3, "learned")])
def test_deepspeed_install_with_no_client_under_torchrun(env, stage, tower):
    """ZeRO-3 "learned": install(engine) with nothing else, the tower not
    given as optional and fetched per forward; accord learns it at step 0."""
    pytest.importorskip("deepspeed")
    env = dict(env, PYTHONPATH=os.pathsep.join([env["PYTHONPATH"], HERE]), DS_ACCELERATOR="cpu")
    code, out = finish(torchrun(env, "--standalone", "--nproc-per-node=2",
                                script=os.path.join(HERE, "ds_torchrun.py"),
                                script_args=(str(stage), tower)), "torchrun")
    assert code == 0, out
    assert len([ln for ln in out.splitlines() if ln.startswith("accord: embedded mode")]) == 1, out
    ranks = {}
    for ln in out.splitlines():
        if ln.startswith("ds rank "):
            f = ln.split()
            ranks[int(f[2].rstrip(":"))] = {f[i]: f[i + 1] for i in range(3, len(f), 2)}
    assert sorted(ranks) == [0, 1], out
    for r in (0, 1):
        assert ranks[r]["stage"] == str(stage) and ranks[r]["steps"] == "3", ranks
        assert float(ranks[r]["worst_rel_err"]) < 1e-5, ranks
        assert ranks[r]["releases"] == "3", ranks
    # Rank 1 never uses the tower: it zero-fills the tower's 2 parameters each
    # step. Any other zeros are turns (ZeRO-2) that came before their gradient.
    filled = [int(ranks[r]["zero_filled"]) - int(ranks[r]["late"]) for r in (0, 1)]
    assert filled == [0, 6], ranks
    want = "tower" if tower == "learned" else "-"
    assert ranks[0]["learned"] == ranks[1]["learned"] == want, ranks


def test_deepspeed_zero3_persistent_tower_not_given_is_named_under_torchrun(env):
    """ZeRO-3 with DeepSpeed's default persistence threshold: the toy tower is
    persistent, first all-gathered after step 0 (DeepSpeed's trace is
    recorded by then, so it is not learned), and every rank ends with the
    same AccordDivergenceError naming it, not Gloo's size mismatch."""
    pytest.importorskip("deepspeed")
    env = dict(env, PYTHONPATH=os.pathsep.join([env["PYTHONPATH"], HERE]), DS_ACCELERATOR="cpu")
    code, out = finish(torchrun(env, "--standalone", "--nproc-per-node=2",
                                script=os.path.join(HERE, "ds_torchrun.py"),
                                script_args=("3", "persistent")), "torchrun")
    assert code != 0, out
    errors = {ln.split("]:", 1)[0]: ln.split("]:", 1)[1].strip() for ln in out.splitlines()
              if "AccordDivergenceError: " in ln and ln.startswith("[rank")}
    assert sorted(errors) == ["[rank0", "[rank1"], out
    assert len(set(errors.values())) == 1, errors
    text = next(iter(errors.values()))
    assert "all-gather of 'tower'" in text and "optional=[...]" in text, text
    assert "doesn't match expected size" not in out, out
