"""One reduce-scatter order on every rank, whatever order autograd runs
post-backwards in (docs/PARTICIPATION.md, "One order"), with real daemons,
real FSDP2 and Gloo, launched by the test harness and by torchrun.

The class: units whose parameters get gradients on some ranks only (a module
of the root unit, a unit whose output some ranks do not use, MoE experts with
no tokens, frozen parameters beside trained ones), usage redrawn every step,
W = 2, 3, 4, guard and speculation on and off. Every run must end in bounded
time with gradients equal to a single-process reference, identical on every
rank, None where used nowhere, and the same reduce-scatters on every rank.
"""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

import accord
import member_scenarios as ms
import order_scenarios as osc
from cluster_fixture import cluster_info, start_cluster
from harness import RankDied, RankFailure, RanksTimedOut, check_results, run_ranks

TIMEOUT_S = 240.0
RTOL, ATOL = 1e-5, 1e-6


@pytest.fixture(scope="module")
def cluster():
    with start_cluster(num_sidecars=2) as c:
        yield c


def run(cluster, fn, world_size, **kwargs):
    info = cluster_info(cluster, world_size, fn.__name__)
    return check_results(run_ranks(fn, world_size, TIMEOUT_S, cluster=info, **kwargs))


def check_zoo(results):
    first = results[0]
    for rank, r in enumerate(results):
        assert r["reduce_scatters"] == first["reduce_scatters"], (
            f"rank {rank} issued other collectives (or in another interleaving) than rank 0:\n"
            f"{r['reduce_scatters']}\n{first['reduce_scatters']}")
        for step, (grads, ref) in enumerate(zip(r["grads"], r["ref"])):
            for name, want in ref.items():
                got = grads[name]
                assert not isinstance(got, str), f"step {step} {name}: {got}"
                if want is None:
                    assert got is None, f"rank {rank} step {step} {name}: used nowhere, has a grad"
                    continue
                assert got is not None, f"rank {rank} step {step} {name}: gradient missing"
                torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL,
                                           msg=lambda m: f"rank {rank} step {step} {name}: {m}")
                assert torch.equal(got, first["grads"][step][name]), (rank, step, name)
    # Frozen parameters never get a gradient.
    assert all(g["lora.base.weight"] is None for g in first["grads"])


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scrape(port, job):
    """{(metric, kind): value} of the sidecar's repair series for `job`."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    out = {}
    for line in text.splitlines():
        if not line.startswith(("accord_speculated_reduces_total{", "accord_repairs_total{")):
            continue
        if f'job="{job}"' not in line:
            continue
        kind = line.split('kind="', 1)[1].split('"', 1)[0] if 'kind="' in line else None
        out[(line.split("{", 1)[0], kind)] = float(line.split()[-1])
    return out


@pytest.mark.parametrize("world_size,guard,speculate", [
    (2, True, True), (2, False, False), (3, True, False), (3, False, True), (4, True, True),
])
def test_divergent_usage_every_step_matches_reference(cluster, world_size, guard, speculate):
    results = run(cluster, osc.zoo, world_size, guard=guard, speculate=speculate, steps=3)
    check_zoo(results)
    t = results[0]["timing"]
    assert t["releases"] == 3, t
    # Every turn goes out before its decision: groups x steps.
    assert t["speculated"] == results[0]["groups"] * 3, t


def test_experts_that_do_not_run_on_some_ranks(cluster):
    results = run(cluster, osc.zoo, 3, experts="skip", steps=3, seed=5)
    check_zoo(results)


def test_steady_state_speculates_without_repairs_and_matches_blocking(cluster):
    on = run(cluster, osc.zoo, 2, speculate=True, steps=3, steady=True)
    off = run(cluster, osc.zoo, 2, speculate=False, steps=3, steady=True)
    check_zoo(on)
    groups = on[0]["groups"]
    for a, b in zip(on, off):
        assert a["timing"]["speculated"] == groups * 3, a["timing"]  # every turn
        # The first step carries every trainable parameter and trims what no
        # rank used; the steady steps carry the last decision: no repair.
        assert a["repairs"][2] == a["repairs"][0], a["repairs"]
        assert a["timing"]["late"] == 0, a["timing"]
        for ga, gb in zip(a["grads"], b["grads"]):
            for name in ga:
                if ga[name] is None:
                    assert gb[name] is None
                else:
                    assert torch.equal(ga[name], gb[name]), f"{name} differs with speculation"


def test_the_wire_dtype_is_agreed_at_install_and_never_repaired(cluster):
    """fp16 parameters on one rank, bf16 on the other: each group's wire
    dtype is their join (float32), agreed at install, so a turn never goes
    out in a dtype its decision widens later."""
    on = run(cluster, osc.widening, 2, speculate=True)
    off = run(cluster, osc.widening, 2, speculate=False)
    for r in on + off:
        for grads, ref in zip(r["grads"], r["ref"]):
            for name, want in ref.items():
                assert torch.equal(grads[name], want), (name, grads[name], want)
        assert r["timing"]["redone"] == 0, r["timing"]
        for step in r["wire"]:
            assert step and all(dtype == "float32" for dtype, _ in step), step


@pytest.mark.parametrize("scenario,world_size,kwargs", [
    ("zoo", 2, {"steps": 3, "seed": 3}),
    ("zoo", 3, {"steps": 4, "seed": 7}),  # usage redrawn every step: trims and deltas
])
def test_repairs_reach_the_sidecars_metrics(scenario, world_size, kwargs):
    """Each rank adds its speculation and repair counts to its sidecar's
    tally (AdapterCounts), which exports them per job: the sums over the
    node's ranks of what installation.timing counted."""
    port = _free_port()
    with accord.LocalCluster(num_sidecars=1, sidecar_flags=[f"--metrics_port={port}"]) as c:
        info = cluster_info(c, world_size, "repairs")
        on = check_results(run_ranks(getattr(osc, scenario), world_size, TIMEOUT_S, cluster=info,
                                     speculate=True, **kwargs))
        want = {
            ("accord_speculated_reduces_total", None): sum(r["timing"]["speculated"] for r in on),
            ("accord_repairs_total", "redo"): sum(r["timing"]["redone"] for r in on),
            ("accord_repairs_total", "trim"): sum(r["timing"]["repairs"] - r["timing"]["redone"]
                                                  for r in on),
        }
        assert sum(r["timing"]["repairs"] for r in on) > 0, [r["timing"] for r in on]
        deadline = time.monotonic() + 10
        got = _scrape(port, info["job_id"])
        while got != want and time.monotonic() < deadline:
            time.sleep(0.1)
            got = _scrape(port, info["job_id"])
        assert got == want


def test_plain_fsdp2_fails_on_the_same_job():
    """The job is a real instance of the class: without accord it fails or
    hangs (bounded here)."""
    try:
        results = run_ranks(osc.zoo, 2, 30.0, agreement="none", steps=3)
    except RanksTimedOut:
        return
    bad = [r for r in results if isinstance(r, (RankFailure, RankDied))]
    wrong = False
    if not bad:
        try:
            check_zoo(results)
        except AssertionError:
            wrong = True
    assert bad or wrong, "plain FSDP2 ran the divergent job correctly; the test shows nothing"


@pytest.mark.parametrize("deployment", ["cluster", "embedded"])
def test_torchrun_launch(cluster, tmp_path, deployment):
    """torchrun, 3 ranks: through a running cluster, and with
    accord.torch.install(model) alone (no accord variable set: the job starts
    its own daemons, docs/EMBEDDED.md)."""
    world_size = 3
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCORD_")
           or k == "ACCORD_BIN_DIR"}
    env.update(ACCORD_TEST_OUT=str(tmp_path), OMP_NUM_THREADS="1")
    if deployment == "cluster":
        env["ACCORD_TEST_CLUSTER"] = json.dumps(cluster_info(cluster, world_size, "torchrun"))
    here = os.path.dirname(os.path.abspath(__file__))
    env["PYTHONPATH"] = here + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={world_size}", os.path.join(here, "order_torchrun.py")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    results = []
    for r in range(world_size):
        with open(tmp_path / f"rank{r}.pt", "rb") as f:
            results.append(torch.load(f, weights_only=False))
    check_zoo(results)


def test_steady_steps_reach_the_coordinator_as_repeat_waves():
    """What accord.torch sends in its steady state is one batch per rank per
    step, the same as the step before (groups, the guard's window, the step
    watch's item, all at one step), so the coordinator decides those steps as
    repeat waves (docs/ARCHITECTURE.md, "Repeat waves")."""
    port = _free_port()
    with accord.LocalCluster(num_sidecars=2, coordinator_flags=[f"--metrics_port={port}"]) as c:
        steps = 6
        check_results(run_ranks(osc.zoo, 2, TIMEOUT_S, cluster=cluster_info(c, 2, "waves"),
                                steps=steps, steady=True))
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read()
    waves = [float(line.split()[-1]) for line in text.decode().splitlines()
             if line.startswith("accord_repeat_waves_total")]
    # The first steps differ (registration, the guard's first windows, the
    # wave base, and step 1, whose tail releases during autograd where step
    # 0's could not: a new collective sequence); every later one is a wave.
    assert waves and waves[0] >= steps - 4, waves


def test_tp_fsdp_steady_steps_reach_the_coordinator_as_one_batch_repeat_per_node():
    """TP x FSDP 2 x 2 with both TP ranks of a dp coordinate on one sidecar:
    each node holds ranks of two member sets, whose groups complete at
    different messages; with the release batches' one sync_key the sidecar
    sends them as one batch per step, so the steady steps arrive as one batch
    repeat per node (docs/MEMBERS.md 2.11)."""
    port = _free_port()
    steps = 8
    with accord.LocalCluster(num_sidecars=2, coordinator_flags=[f"--metrics_port={port}"]) as c:
        results = check_results(run_ranks(ms.tp_fsdp_steady, 4, TIMEOUT_S,
                                          cluster=cluster_info(c, 4, "tpsync"), steps=steps))
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read()
    assert len({r["sync_key"] for r in results}) == 1, results
    # Ranks 0 and 1 (one node) are in two member sets, with the same key.
    assert [r["members"] for r in results] == [(0, 2), (1, 3), (0, 2), (1, 3)], results
    assert results[0]["groups"] != results[1]["groups"]
    counts = {line.split()[0]: float(line.split()[-1]) for line in text.decode().splitlines()
              if line.startswith(("accord_node_batches_total", "accord_node_batch_repeats_total"))}
    # The first steps differ (registration, the guard's first windows, the
    # class forming at step 0); every later one is one batch repeat per node.
    assert counts.get("accord_node_batch_repeats_total", 0) >= 2 * (steps - 4), counts
