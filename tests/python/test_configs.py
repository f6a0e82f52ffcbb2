"""FSDP2 as people deploy it, each configuration with a divergence, in three
modes on the same data: plain FSDP2, FSDP2 with
set_reduce_scatter_unused_params(True), and accord (real daemons, Gloo on
CPU). The model, data, wire check and references are in config_scenarios.py;
python/README.md ("Configurations") is the table these tests keep true.

Divergences (config_scenarios.usage): "param" = the root unit's image
projector used on some ranks only (and on none in step 1); "drop" = decoder
layer 1 skipped on some ranks (and on all in step 1); with accumulation
under mixed precision the image comes on the last microbatch, so its bf16
gradient meets fp32 accumulations. Plain FSDP2 and the unused-params flag
run each divergence alone; accord runs both at once.

accord must give, in every supported configuration: gradients equal to a
single-process reference (max |diff| / max |ref| <= 1e-5), identical on
every rank, None where no rank used the parameter, and the same collectives
on every rank. Unsupported configurations must be refused with an error
naming them (accord.torch.configs), before any step goes wrong.

Three spawns (2 ranks, 4 ranks, 4 ranks as 2 pipeline stages x 2) keep the
file within its time; each test checks one configuration's results.
"""

import pytest
import torch
from torch.distributed.fsdp import FSDPModule

import config_scenarios as cs
from cluster_fixture import cluster_info, start_cluster
from harness import check_results, run_ranks

TIMEOUT_S = 600.0
BOUND = 1e-5
PARAM, DROP, BOTH, NONE = ("param",), ("drop",), ("param", "drop"), ()

TWO = ["checkpoint", "reshard_false", "prefetch", "cpu_offload", "compile", "lora",
       "ignored_params"]
FOUR = ["reshard_int", "hsdp_no_sync", "tp"]
SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b"]
# FSDP2's set_reduce_scatter_unused_params (the "unused" cells) is not in every supported torch.
HAS_UNUSED = hasattr(FSDPModule, "set_reduce_scatter_unused_params")
NO_UNUSED = "this torch's FSDP2 has no set_reduce_scatter_unused_params"


def _plan(configs):
    runs = []
    for c in configs:
        runs += [(c, mode, kinds) for mode in ("plain", "unused") for kinds in (PARAM, DROP)]
        runs.append((c, "accord", BOTH))
    return runs


RUNS_TWO = _plan(TWO)
RUNS_FOUR = _plan(FOUR) + [
    ("hsdp", "plain", PARAM), ("hsdp", "unused", PARAM), ("hsdp", "accord", BOTH),
    ("hsdp_all_reduce_off_at_install", "accord", BOTH),
]


def _runnable(runs):
    return [r for r in runs if HAS_UNUSED or r[1] != "unused"]


def _skip_unsupported(mode):
    if mode == "unused" and not HAS_UNUSED:
        pytest.skip(NO_UNUSED)


PP_PLAIN = {"group_timeout_s": 6}  # stage 1 waits this long for a failed stage 0
RUNS_PP = (
    [(s, "accord_job", BOTH, {}) for s in SCHEDULES]
    + [(s, "accord", PARAM, {}) for s in SCHEDULES]
    + [(s, m, PARAM, PP_PLAIN) for s in SCHEDULES for m in ("plain", "unused")]
    # A layer used by some ranks' microbatches only, marked optional or learned.
    + [(s, "accord", BOTH, {}) for s in SCHEDULES]
    + [(s, m, BOTH, {}) for s in SCHEDULES
       for m in ("accord_learn", "accord_job_learn")]
    + [("interleaved_zb", "plain", NONE, PP_PLAIN), ("interleaved_zb", "accord", NONE, PP_PLAIN)]
)

# What plain FSDP2 and the unused-params flag do on each divergent job (the
# README table): "diverged" = the ranks were about to issue different
# collectives (Gloo aborts the process on a size mismatch, NCCL hangs);
# "hang" = a collective timed out; "dtype" = FSDP2's "uniform gradient
# dtype" assertion; "error" = another error; "zeros" = the reference's sums
# but zeros, not None, for parameters no rank used; "correct"; "wrong".
EXPECTED = {
    **{(c, m, DROP): "diverged" for c in TWO + ["tp"] for m in ("plain", "unused")},
    **{(c, "plain", PARAM): "diverged" for c in TWO + ["reshard_int", "tp", "hsdp"]},
    **{(c, "unused", PARAM): "zeros" for c in TWO + ["reshard_int", "tp", "hsdp"]},
    ("reshard_int", "plain", DROP): "hang",
    ("reshard_int", "unused", DROP): "hang",
    ("hsdp_no_sync", "plain", DROP): "hang",
    ("hsdp_no_sync", "unused", DROP): "hang",
    ("hsdp_no_sync", "plain", PARAM): "dtype",
    ("hsdp_no_sync", "unused", PARAM): "dtype",
    **{(s, "plain", PARAM): "diverged" for s in SCHEDULES},
    **{(s, "unused", PARAM): "zeros" for s in SCHEDULES},
}


@pytest.fixture(scope="module")
def cluster():
    # 8 sidecars: the pipeline spawn runs one accord job per stage on
    # sidecars 0-1 and 2-3 and a job of all 4 ranks on sidecars 4-7 (a
    # sidecar serves one job at a time).
    with start_cluster(num_sidecars=8) as c:
        yield c


def _spawn(fn, world_size, **kwargs):
    return check_results(run_ranks(fn, world_size, TIMEOUT_S, **kwargs))


@pytest.fixture(scope="module")
def two(cluster):
    return _spawn(cs.run_configs, 2, runs=_runnable(RUNS_TWO), cluster=cluster_info(cluster, 2, "cfg2"))


@pytest.fixture(scope="module")
def four(cluster):
    return _spawn(cs.run_configs, 4, runs=_runnable(RUNS_FOUR), cluster=cluster_info(cluster, 4, "cfg4"))


@pytest.fixture(scope="module")
def pipeline(cluster):
    def info(job, ranks):
        return {"job_id": job, "sockets": [cluster.socket_for(r, 8)[0] for r in ranks],
                "local_ranks": [0] * len(ranks)}

    infos = [info("pp-stage0", [0, 1]), info("pp-stage1", [2, 3])]
    return _spawn(cs.run_pipelines, 4, runs=_runnable(RUNS_PP), infos=infos,
                  job_wide=info("pp-job", [4, 5, 6, 7]))


# ---------------------------------------------------------------- checks


def rel_error(got, want):
    scale = want.abs().max().item()
    diff = (got.float() - want.float()).abs().max().item()
    return diff / scale if scale > 0 else diff


def outcomes(results, run):
    return [r[run]["outcome"] for r in results]


def classify(results, run, ref):
    """The outcome class (see EXPECTED) of one plain or unused-flag run
    (ignored_params' proj.weight is never reduced: not compared)."""
    outs = outcomes(results, run)
    if any(o.startswith("WireMismatch") for o in outs):
        return "diverged"
    if any("uniform gradient dtype" in o for o in outs):
        return "dtype"
    if any("Timed out" in o for o in outs):
        return "hang"
    if any(o != "ok" for o in outs):
        return "error"
    zeros = False
    for step, st in enumerate(ref):
        for name, want in st["grads"].items():
            if run[0] == "ignored_params" and name == "proj.weight":
                continue
            got = [r[run]["grads"][step].get(name, "absent") for r in results]
            got = [g for g in got if not (isinstance(g, str) and g == "absent")]
            if any(isinstance(g, str) for g in got):
                return "wrong"
            if want is None:
                if all(g is None for g in got):
                    continue
                if all(g is not None and not g.any() for g in got):
                    zeros = True
                    continue
                return "wrong"
            if any(g is None or rel_error(g, want) > BOUND for g in got):
                return "wrong"
    return "zeros" if zeros else "correct"


def check_accord(results, run, ref, ignored=()):
    """Reference, identical on every rank, None where used nowhere, the same
    collectives on every rank."""
    outs = outcomes(results, run)
    assert all(o == "ok" for o in outs), f"{run}: {outs}\n{results[0][run].get('traceback')}"
    for rank, r in enumerate(results):
        res = r[run]
        assert "uninstall_error" not in res, res["uninstall_error"]
        assert not res["overrides_left"], res["overrides_left"]
        assert len(res["grads"]) == len(ref) == cs.STEPS
        for step, (grads, st) in enumerate(zip(res["grads"], ref)):
            for name, want in st["grads"].items():
                if name not in grads:
                    continue  # another pipeline stage's parameter
                got = grads[name]
                where = f"{run} rank {rank} step {step} {name}"
                assert not isinstance(got, str), f"{where}: {got}"
                if name in ignored:  # never reduced: this rank's own gradient
                    own = st["local"][rank][name]
                    assert (got is None) == (own is None), where
                    if own is not None:
                        assert rel_error(got, own) <= BOUND, where
                    continue
                if want is None:
                    assert got is None, f"{where}: used on no rank, has a gradient"
                    continue
                assert got is not None, f"{where}: gradient missing"
                err = rel_error(got, want)
                assert err <= BOUND, f"{where}: rel. error {err:.3g}"
                assert torch.equal(got, results[0][run]["grads"][step][name]), (
                    f"{where}: differs from the first rank's")
    # Every rank issued the same collectives (kind, sizes, dtype), step by step.
    stripped = [[[(k, i, o, d) for k, _, i, o, d in step] for step in r[run]["wire"]]
                for r in results]
    assert all(s == stripped[0] for s in stripped), f"{run}: ranks' collectives differ"


def check_cell(results, run, ref):
    got = classify(results, run, ref)
    want = EXPECTED[run]
    assert got == want, (f"{run}: {want} expected, got {got}: "
                         f"{[o[:300] for o in outcomes(results, run)]}")


# ---------------------------------------------------------------- 2 ranks, 1-D mesh


@pytest.mark.parametrize("config", TWO)
def test_accord_matches_reference(two, config):
    run = (config, "accord", BOTH)
    ignored = ("proj.weight",) if config == "ignored_params" else ()
    check_accord(two, run, two[0][("ref", config, BOTH)], ignored)
    timing = two[0][run]["timing"]
    assert timing["releases"] == cs.STEPS, timing
    # Every turn goes out before its decision (4 groups, 2 steps); step 1
    # carries step 0's decisions, and proj and layer 1, used in step 0 and
    # nowhere in step 1, are trimmed back to None. No gradient is late: each
    # group's turn comes after its post-backward wherever it has one.
    assert timing["speculated"] == 8 and timing["repairs"] >= 2, timing
    assert timing["late"] == 0 and timing["redone"] == 0, timing


def _ids(run):
    return "-".join([run[0], run[1], "+".join(run[2])])


@pytest.mark.parametrize("run", [r for r in RUNS_TWO if r[1] != "accord"], ids=_ids)
def test_fsdp2_alone(two, run):
    _skip_unsupported(run[1])
    check_cell(two, run, two[0][("ref", run[0], run[2])])


# ---------------------------------------------------------------- 4 ranks: 2-D meshes


@pytest.mark.parametrize("config", FOUR)
def test_accord_matches_reference_2d(four, config):
    run = (config, "accord", BOTH)
    check_accord(four, run, four[0][("ref", config, BOTH)])
    # One release per step: under accumulation only the synced microbatch reduces.
    assert four[0][run]["timing"]["releases"] == cs.STEPS


def test_2d_groups_register_their_mesh_member_sets(four):
    """TP x FSDP on a (dp, tp) 2 x 2 mesh: every registration of a rank (its
    FSDP groups and the installation's own: ~late, ~wire, the guard, the
    step watch, participation) carries the dp group of its TP coordinate,
    ids tagged with it, the same ids otherwise on both TP coordinates. HSDP:
    replicate x shard is every rank, so no members and no tag (the 1-D
    form)."""
    tp = [r[("tp", "accord", BOTH)]["registered"] for r in four]
    for rank, regs in enumerate(tp):
        t = rank % 2
        assert len(regs) > 4, regs
        assert all(m == [t, t + 2] for _, m in regs), (rank, regs)
        assert all(gid.endswith(f"@ranks{t}..{t + 2}/2") for gid, _ in regs), (rank, regs)
    untagged = [[gid.rsplit("@", 1)[0] for gid, _ in regs] for regs in tp]
    assert untagged[0] == untagged[1] == untagged[2] == untagged[3]
    assert any("/~late@" in gid for gid, _ in tp[0]) and any(
        "/~collective-sequence/step@" in gid for gid, _ in tp[0]), tp[0]
    for r in four:
        regs = r[("hsdp_no_sync", "accord", BOTH)]["registered"]
        assert regs and all(m is None and "@" not in gid for gid, m in regs), regs


@pytest.mark.parametrize("run", [r for r in RUNS_FOUR if r[1] != "accord"], ids=_ids)
def test_fsdp2_alone_2d(four, run):
    _skip_unsupported(run[1])
    check_cell(four, run, four[0][("ref", run[0], run[2])])


def test_hsdp_accumulation_widens_the_late_bf16_gradient(four):
    """hsdp_no_sync's third divergence: on even ranks the image (proj) comes
    on the synced microbatch only, so its bf16 gradient meets the other root
    parameters' fp32 accumulations (plain FSDP2: the "uniform gradient dtype"
    assertion); accord widens it (2 parameters, step 0) and zero-fills it on
    the odd ranks."""
    for rank, r in enumerate(four):
        reductions, zero_filled, widened, skipped = \
            r[("hsdp_no_sync", "accord", BOTH)]["stats"]["hsdp_no_sync-param+drop/<root>"]
        assert reductions == cs.STEPS
        assert (widened, zero_filled) == ((2, 0) if rank % 2 == 0 else (0, 2)), (rank, widened)
        assert skipped == 2  # step 1: proj used on no rank


def test_hsdp_wire_has_replica_all_reduces(four):
    """HSDP: a reduce-scatter within each shard group, then an all-reduce
    across replicas, on every rank alike (checked in check_accord)."""
    kinds = [k for step in four[0][("hsdp_no_sync", "accord", BOTH)]["wire"] for k, *_ in step]
    assert "all-reduce" in kinds and "reduce-scatter" in kinds


def test_the_guard_records_every_hsdp_replica_all_reduce(four):
    """The guard's sequence holds the replica all-reduce FSDP2 issues after
    each HSDP reduce-scatter, right after it: as many as the wire saw, on
    every rank."""
    for rank, r in enumerate(four):
        res = r[("hsdp_no_sync", "accord", BOTH)]
        issued = sum(1 for step in res["wire"] for k, *_ in step if k == "all-reduce")
        recorded = res["recorded"]
        ars = [i for i, e in enumerate(recorded) if e.startswith("all-reduce across replicas")]
        assert issued > 0 and len(ars) == issued, (rank, issued, recorded)
        for i in ars:
            unit = recorded[i].split("'")[1]
            assert recorded[i - 1].startswith(f"reduce-scatter of '{unit}' "), recorded[i - 1:i + 1]
    assert len({tuple(r[("hsdp_no_sync", "accord", BOTH)]["recorded"]) for r in four}) == 1


def test_hsdp_all_reduce_off_between_microbatches_is_refused(four):
    """set_requires_all_reduce(False) under HSDP: refused at the call (after
    install) and at install (before)."""
    for run in [("hsdp", "accord", BOTH), ("hsdp_all_reduce_off_at_install", "accord", BOTH)]:
        for out in outcomes(four, run):
            assert out.startswith("UnsupportedConfigurationError: accord.torch: HSDP with the "
                                  "replica all-reduce turned off between microbatches"), out
            assert "set_requires_gradient_sync(False)" in out, out
        assert all(r[run]["grads"] == [] for r in four), "a step ran"
        for r in four:  # uninstall after the refusal restores everything
            assert "uninstall_error" not in r[run], r[run]["uninstall_error"]
            assert not r[run].get("overrides_left"), r[run]["overrides_left"]
    at_call = outcomes(four, ("hsdp", "accord", BOTH))[0]
    assert "set_requires_all_reduce(False) on '<root>'" in at_call, at_call
    at_install = outcomes(four, ("hsdp_all_reduce_off_at_install", "accord", BOTH))[0]
    assert "requires_all_reduce is False at install" in at_install, at_install


# ---------------------------------------------------------------- pipeline parallel


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pipeline_stages_agree_within_their_dp_groups(pipeline, schedule):
    """One accord job per stage; the schedule's REDUCE_GRAD calls FSDP2's
    post-backward (held by accord) and then the root's end-of-backward
    callback, where accord releases the stage's reduce-scatters."""
    run = (schedule, "accord", PARAM)
    ref = pipeline[0][("ref", PARAM)]
    for stage in (0, 1):
        members = pipeline[2 * stage:2 * stage + 2]
        check_accord(members, run, ref)
    names = set()
    for r in pipeline:
        names.update(r[run]["grads"][0])
    assert names == set(ref[0]["grads"]), "some parameter lives on no stage"
    for r in pipeline:
        for t in r[run]["timing"]:  # one installation per stage module
            assert t["releases"] == cs.STEPS, t


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("mode", ["plain", "unused"])
def test_pipeline_fsdp2_alone(pipeline, schedule, mode):
    _skip_unsupported(mode)
    run = (schedule, mode, PARAM)
    check_cell(pipeline, run, pipeline[0][("ref", PARAM)])


@pytest.mark.parametrize("schedule,mode", [(s, "accord") for s in SCHEDULES]
                         + [(s, m) for s in SCHEDULES
                            for m in ("accord_learn", "accord_job_learn")])
def test_pipeline_optional_units(pipeline, schedule, mode):
    """Layer 1 runs in some DP ranks' microbatches only (step 0) and on no
    rank (step 1), beside the image projection used in one rank's second
    microbatch: marked optional ("accord") or learned by the guard at the
    stage's first step ("accord_learn"; "accord_job_learn" with one job of
    all stages: the guard's windows among the stage's DP ranks), it stays
    pinned across the schedule's microbatches and is released at
    REDUCE_GRAD. Under interleaved 1F1B the schedule's UNSHARD all-gathers
    layer 1 on every rank, so it is learned where a rank that skipped it
    reaches its other stage's forward. Gradients equal
    the single-process reference, identical across each stage's DP ranks,
    None where used nowhere; the same collectives on each stage's ranks."""
    run = (schedule, mode, BOTH)
    ref = pipeline[0][("ref", BOTH)]
    for stage in (0, 1):
        check_accord(pipeline[2 * stage:2 * stage + 2], run, ref)
    holders = [r for r in pipeline if any("layers.1." in n for n in r[run]["grads"][0])]
    assert holders, "layer 1 is on no stage"
    for r in holders:
        assert r[run]["learned"] == ([] if mode == "accord" else ["layers.1"]), r[run]["learned"]
        for t in r[run]["timing"]:
            assert t["releases"] == cs.STEPS, t


def test_pipeline_split_backward_schedules_are_refused(pipeline):
    """ScheduleInterleavedZeroBubble, every parameter used on every rank:
    FSDP2 alone gives wrong gradients (pinned here, so a torch that fixes it
    is noticed); under accord every rank refuses at the schedule's first
    step(), before any collective."""
    assert classify(pipeline, ("interleaved_zb", "plain", NONE),
                    pipeline[0][("ref", NONE)]) == "wrong"
    for r in pipeline:
        res = r[("interleaved_zb", "accord", NONE)]
        assert res["failed_at"] == 0, res
        assert "UnsupportedConfigurationError: accord.torch: pipeline schedules that split " \
               "each microbatch's backward" in res["outcome"], res["outcome"]
        assert "uninstall_error" not in res, res["uninstall_error"]
        assert not res["overrides_left"], res["overrides_left"]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pipeline_with_one_job_for_all_stages(pipeline, schedule):
    """One accord job of all 4 ranks (a client each, on 4 sidecars): each
    stage registers its groups with its DP ranks as members, so neither
    stage waits for the other; the projection (its own unit) and layer 1
    are marked optional. Gradients as with one job per stage."""
    run = (schedule, "accord_job", BOTH)
    ref = pipeline[0][("ref", BOTH)]
    for stage in (0, 1):
        check_accord(pipeline[2 * stage:2 * stage + 2], run, ref)
        for rank in (2 * stage, 2 * stage + 1):
            regs = pipeline[rank][run]["registered"]
            assert regs and all(m == [2 * stage, 2 * stage + 1] for _, m in regs), regs
            assert all(gid.endswith(f"@ranks{2 * stage}..{2 * stage + 1}") for gid, _ in regs)
