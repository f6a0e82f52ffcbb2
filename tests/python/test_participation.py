"""Rank-divergent FSDP unit participation, real transformers models, real daemons.

Ranks run an FSDP unit's forward 0, 1 or 2 times in a step (a LLaVA vision
tower on text-only / image / image+video batches; a Llama decoder layer
dropped on some ranks). With `accord.torch.install(..., optional=[unit])`
every rank must issue the same collectives in the same order, and the
gradients must equal a single-process reference on the same data and be
identical on every rank. Without accord the same jobs fail (bounded in time).
See participation_scenarios.py for the models and data.
"""

import json
import os
import subprocess

import pytest
import torch

import member_scenarios as ms
import participation_scenarios as ps
from cluster_fixture import cluster_info, start_cluster
from harness import RankDied, RankFailure, RanksTimedOut, check_results, run_ranks

TIMEOUT_S = 300.0
FP32_RTOL = 1e-5  # the bound for fp32
BF16_RTOL = 2e-2  # bf16 compute: the reference runs the same bf16 math in another order


@pytest.fixture(scope="module")
def cluster():
    with start_cluster(num_sidecars=2) as c:
        yield c


def rel_error(got, ref):
    return float((got.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12))


def check_case(results, case, rtol):
    """Gradients match the reference and are identical on every rank; every
    rank issued the same collectives; unused-everywhere parameters stay None."""
    world_size = len(results)
    sequences = {tuple(r["collectives"]) for r in results}
    assert len(sequences) == 1, "ranks issued different collective sequences:\n" + "\n".join(
        f"rank {i}: {r['collectives']}" for i, r in enumerate(results)
    )
    first = results[0]
    for name, ref in first["ref"].items():
        for rank, r in enumerate(results):
            got = r["grads"][name]
            assert not isinstance(got, str), f"{name}: {got}"
            if ref is None:
                assert got is None, f"rank {rank} {name}: used on no rank, got a gradient"
                continue
            assert got is not None, f"rank {rank} {name}: gradient missing"
            err = rel_error(got, ref)
            assert err <= rtol, f"rank {rank} {name}: relative error {err:.2e} > {rtol:.0e}"
            assert torch.equal(got, first["grads"][name]), f"{name}: rank {rank} differs"
    # What each rank did with the optional unit, step by step.
    plan = case["plan"]
    for rank, r in enumerate(results):
        if case["model_kind"] not in ("vlm", "paligemma", "qwen2vl"):
            continue
        calls = [{"text": 0, "image": 1, "both": 2}[m] for m in plan[rank]]
        want = (
            len(calls),
            sum(c == 0 for c in calls),
            sum(c == 1 for c in calls),
            sum(c >= 2 for c in calls),
        )
        ((_, got),) = r["participation"].items()
        assert got == want, (rank, r["participation"])
    return world_size


def run_accord(cluster, world_size, cases):
    """Each case in its own processes (a sidecar serves one job at a time, and
    a finished job's ranks leave when their processes exit)."""
    out = []
    for case in cases:
        job = cluster_info(cluster, world_size, f"part-{case['model_kind']}")
        results = check_results(
            run_ranks(ps.run_cases, world_size, TIMEOUT_S, cases=[case], cluster_jobs=[job])
        )
        for rank, per_rank in enumerate(results):
            assert not isinstance(per_rank[0], str), f"rank {rank} case {case}: {per_rank[0]}"
        out.append([per_rank[0] for per_rank in results])
    return out


VLM = "vlm"
DROP = "layerdrop"

# (world size, cases). Each case: the model, each rank's microbatches
# (modality, or dropped layers), parameter and reduce dtypes.
MATRIX = {
    2: [
        dict(model_kind=VLM, plan=[["image"], ["text"]]),
        dict(model_kind="paligemma", plan=[["text", "both"], ["image", "text"]],
             reduce_dtype="float32"),
        dict(model_kind=VLM, plan=[["both", "text"], ["text", "text"]], mp="bf16",
             reduce_dtype="float32"),
        dict(model_kind=DROP, plan=[[(), (1,)], [(1,), (1,)]], reduce_dtype="float32"),
    ],
    3: [
        dict(model_kind=VLM, plan=[["text", "image"], ["both", "text"], ["text", "text"]],
             reduce_dtype="float32"),
        # Qwen2-VL's own forward enters `visual` twice for images + videos.
        dict(model_kind="qwen2vl", plan=[["both"], ["text"], ["image"]]),
        dict(model_kind=DROP, plan=[[()], [(1,)], [()]], mp="bf16", reduce_dtype="float32"),
    ],
    4: [
        dict(model_kind=VLM, plan=[["text"], ["image"], ["text"], ["both"]]),
        dict(model_kind=DROP, plan=[[()], [(1,)], [(1,)], [()]]),
    ],
}


@pytest.mark.parametrize("world_size", sorted(MATRIX))
def test_divergent_units_train_like_the_reference(cluster, world_size):
    cases = MATRIX[world_size]
    for case, results in zip(cases, run_accord(cluster, world_size, cases)):
        check_case(results, case, BF16_RTOL if case.get("mp") == "bf16" else FP32_RTOL)


LEARN = [
    # (world size, case, the units every rank must have learned)
    (2, dict(model_kind=VLM, plan=[["image"], ["text"]], use_optional=False),
     ["vlm.model.vision_tower"]),
    (3, dict(model_kind="qwen2vl", plan=[["both"], ["text"], ["image"]], use_optional=False),
     ["vlm.model.visual"]),
    (2, dict(model_kind=DROP, plan=[[(), ()], [(1,), (1,)]], use_optional=False),
     ["lm.model.layers.1.layer"]),
]


@pytest.mark.parametrize("world_size,case,learned", LEARN, ids=["vlm", "qwen2vl", "layerdrop"])
def test_units_diverging_from_the_first_step_are_learned(cluster, world_size, case, learned):
    """Nothing marked optional: the guard sees the ranks' first forward
    all-gathers differ while every rank waits for its verdict, so every rank
    all-gathers and pins the units involved and training goes on, with the
    same gradients as when they are marked."""
    (results,) = run_accord(cluster, world_size, [case])
    check_case(results, dict(case, model_kind="learned"), FP32_RTOL)
    for r in results:
        assert r["learned"] == learned, r["learned"]


def test_divergence_first_seen_in_a_later_step_is_a_named_error(cluster):
    """The tower ran everywhere in step 1; in step 2 rank 1 is text-only. Its
    first all-gather there is new to it but not to rank 0, which already
    issued it: nothing can be repaired, every rank gets the named error."""
    case = dict(model_kind=VLM, plan=[["image", "image"], ["image", "text"]],
                use_optional=False)
    job = cluster_info(cluster, 2, "part-late")
    results = run_ranks(ps.run_cases, 2, TIMEOUT_S, cases=[case], cluster_jobs=[job])
    texts = []
    for r in results:
        if isinstance(r, RankDied):
            line = [l for l in r.stderr.splitlines() if l.startswith("AccordDivergenceError: ")]
            assert line, r.stderr
            texts.append(line[-1].split(": ", 1)[1])
        else:
            assert isinstance(r, list) and isinstance(r[0], str), r
            texts.append(r[0].split(": ", 1)[1].splitlines()[0])
    assert texts[0] == texts[1], texts
    assert "all-gather of 'vlm.model.vision_tower'" in texts[0], texts[0]
    assert "optional=[...]" in texts[0], texts[0]


def test_tower_unused_on_every_rank_keeps_grads_none(cluster):
    case = dict(model_kind=VLM, plan=[["text"], ["text"]])
    (results,) = run_accord(cluster, 2, [case])
    for r in results:
        tower = [n for n in r["grads"] if ".vision_tower." in n]
        assert tower and all(r["grads"][n] is None for n in tower), r["grads"]
        # 2 decoder layers + root + the tower: the first step has no previous
        # decision, so its turns carry every trainable parameter (the tower as
        # zeros on every rank), trimmed back to None.
        assert [k for k, _, _ in r["collectives"]].count("RS") == 4, r["collectives"]


@pytest.mark.parametrize(
    "case",
    [
        dict(model_kind=VLM, plan=[["image"], ["text"]]),
        dict(model_kind=DROP, plan=[[()], [(1,)]]),
    ],
    ids=["vlm-text-only-rank", "layerdrop"],
)
def test_plain_fsdp2_fails_on_the_same_jobs(case):
    """Without accord the same data breaks the collective sequence: the ranks
    fail (Gloo reports the mismatch or a peer's exit) or hang."""
    try:
        results = run_ranks(ps.run_cases, 2, 30.0, cases=[dict(case, agreement="none")])
        results = [r[0] if isinstance(r, list) else r for r in results]
    except RanksTimedOut:
        return  # a hang, bounded by the harness
    errors = []
    for r in results:
        if isinstance(r, RankDied):
            errors.append(f"the rank's process died (Gloo aborts it on a size mismatch):\n{r.stderr}")
        elif isinstance(r, RankFailure):
            errors.append(r.error)
        elif isinstance(r, str):
            errors.append(r)
    assert errors, f"plain FSDP2 trained on rank-divergent units: {results}"


def test_bad_installs_get_precise_errors():
    (out,) = check_results(run_ranks(ps.bad_installs, 1, 120.0))
    expect = {
        "not_fsdp_unit": "ValueError: accord.torch.install: optional unit "
        "'vlm.model.vision_tower' (CLIPVisionModel) is not an FSDP unit; call fully_shard",
        "not_a_submodule": "ValueError: accord.torch.install: optional unit "
        "'vlm.model.no_such_tower' is not a submodule of the model",
        "foreign_module": "ValueError: accord.torch.install: optional unit Linear is not a "
        "submodule of the model",
        "root": "ValueError: accord.torch.install: the root module cannot be optional",
        "wrong_type": "TypeError: accord.torch.install: optional takes modules or module "
        "paths, got int",
        "root_not_fsdp": "ValueError: accord.torch.install: optional units need the model "
        "itself to be an FSDP unit",
        "not_fsdp_model": "ValueError: accord.torch.install: the model has no FSDP2 parameter "
        "groups",
        "after_first_forward": "ValueError: accord.torch.install: the model has already run a "
        "forward under FSDP2; install accord right after fully_shard",
    }
    for key, prefix in expect.items():
        assert out[key].startswith(prefix), f"{key}: {out[key]!r}"


def test_optional_unit_spanning_two_member_sets_is_refused_at_install():
    """A unit whose FSDP groups have different member sets (its expert's
    parameters on the expert data-parallel mesh by shard_placement_fn, the
    rest on every rank) marked optional: refused at install, naming the unit
    and both member sets (docs/MEMBERS.md 2.12)."""
    results = check_results(run_ranks(ms.unit_spanning_two_member_sets, 4, 120.0))
    for rank, out in enumerate(results):
        first = 2 * (rank // 2)
        assert out["groups"] == 2, out
        assert out.get("error") == (
            f"accord.torch.install: optional unit 'moe' spans 2 member sets of the job of 4 "
            f"ranks (group 'fsdp/moe#0' by every rank; group 'fsdp/moe#1@ranks{first}.."
            f"{first + 1}' by ranks [{first}, {first + 1}]); an optional unit's participation "
            f"is agreed among one member set: shard the parameters on each mesh in a unit of "
            f"their own (fully_shard on a submodule) and mark those units optional"), out


def test_coordinator_shows_the_participation_matrix(cluster):
    """accordctl (the coordinator's ObserveService) shows, per optional unit,
    the steps each rank did not run it (row "ran") and did not enter it twice
    (row "repeated")."""
    accordctl = os.environ.get("ACCORDCTL")
    assert accordctl and os.path.exists(accordctl), (
        "ACCORDCTL must name the accordctl binary (tests/python/CMakeLists.txt sets it)")
    plan = [["text", "image"], ["both", "text"], ["text", "text"]]
    job = cluster_info(cluster, 3, "part-observe")
    case = dict(model_kind=VLM, plan=plan)
    check_results(run_ranks(ps.run_cases, 3, TIMEOUT_S, cases=[case], cluster_jobs=[job]))
    group = "fsdp/~participation/vlm.model.vision_tower"
    out = subprocess.run(
        [accordctl, f"--coordinator={cluster.coordinator_address}", "--json", "skips",
         f"--job={job['job_id']}", f"--group={group}"],
        capture_output=True, text=True, timeout=60, check=True)
    (g,) = json.loads(out.stdout)["groups"]
    assert g["group_id"] == group and int(g["steps"]) == 2, g
    rows = {row["param_name"]: [int(c) for c in row["counts"]] for row in g["rows"]}
    calls = [[{"text": 0, "image": 1, "both": 2}[m] for m in steps] for steps in plan]
    assert rows["ran"] == [sum(c == 0 for c in cs) for cs in calls], rows
    assert rows["repeated"] == [sum(c < 2 for c in cs) for cs in calls], rows
