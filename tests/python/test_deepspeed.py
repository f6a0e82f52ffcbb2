"""accord.deepspeed against real DeepSpeed ZeRO on CPU/Gloo (2 and 3 ranks).

Without accord, the cases where a rank does not use the tower fail in Gloo
(pinned: a DeepSpeed release that changes this is noticed). With
accord.deepspeed.install (ZeRO-3: optional=["tower"]), ZeRO-1/2/3 train: the gradients DeepSpeed hands the
optimizer equal a single-process reference and are identical on every rank;
a parameter no rank used keeps its fp32 value, its model value and its Adam
moments bitwise through engine.step(). Each launch has a short process-group
timeout, so a pinned failure costs seconds.
"""


import pytest

pytest.importorskip("deepspeed")

import torch  # noqa: E402

import deepspeed_scenarios as sc  # noqa: E402
from cluster_fixture import cluster_info, start_cluster  # noqa: E402
from harness import RankDied, RankFailure  # noqa: E402

TOWER = ("tower.weight", "tower.bias")
MISMATCH = "doesn't match expected size"


@pytest.fixture(scope="module")
def cluster():
    with start_cluster(num_sidecars=2) as c:
        yield c


def _failures(results):
    return [r for r in results if isinstance(r, (RankFailure, RankDied))]


def _text(r):
    return r.stderr if isinstance(r, RankDied) else f"{r.error}\n{r.traceback}"


def _steps_done(r):
    import re

    found = re.findall(r"accord-test: steps done (\d+)", _text(r))
    return int(found[-1]) if found else 0


def _steps(results):
    """Per rank: the list of step records (without the trailing stats)."""
    out = []
    for r in results:
        assert not isinstance(r, (RankFailure, RankDied)), repr(r)
        out.append([s for s in r if "grads" in s])
    return out


def _check_against_reference(results, dtype="fp32"):
    per_rank = _steps(results)
    for step, records in enumerate(zip(*per_rank)):
        first = records[0]
        for other in records[1:]:  # identical on every rank
            for n, g in first["grads"].items():
                assert torch.equal(g, other["grads"][n]), (step, n)
        for n, g in first["grads"].items():
            ref = first["ref"][n]
            if ref is None:
                assert torch.count_nonzero(g) == 0, (step, n)
                continue
            if dtype == "fp32":
                torch.testing.assert_close(g, ref, rtol=1e-5, atol=1e-7, msg=f"step {step} {n}")
            else:  # the same bf16 math, reduced in another order
                err = (g - ref).norm() / ref.norm().clamp_min(1e-12)
                assert err < 2e-2, (step, n, float(err))


def _check_unused_unchanged(results, step):
    """The tower (used on no rank at `step`) is bitwise unchanged by that step."""
    for records in _steps(results):
        rec = records[step]
        for n in TOWER:
            assert rec["ref"][n] is None
            assert torch.equal(rec["after"][n], rec["start"][n]), n
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(rec["after_moments"][key][n], rec["moments"][key][n]), (key, n)
        # and the used parameters did move
        assert not torch.equal(rec["after"]["body.weight"], rec["start"]["body.weight"])
        prev = records[step - 1]
        for n in TOWER:  # the model's own parameter too
            assert torch.equal(rec["lp_after"][n], prev["lp_after"][n]), n


# ---------------------------------------------------------------- without accord (pinned)


@pytest.mark.parametrize("stage,leaf", [(1, ()), (2, ()), (3, ()), (3, ("tower",))])
def test_without_accord_a_rank_that_never_uses_the_tower_kills_the_job(stage, leaf):
    """`leaf`: the tower a ZeRO-3 leaf module; still a forward all-gather
    only rank 0 issues."""
    results = sc.run_ds_ranks(sc.train, 2, stage=stage, case="never_on_1", steps=2, leaf=leaf,
                              persistence=0 if leaf else None)
    failed = _failures(results)
    assert failed, "DeepSpeed trained without accord: the pinned failure changed"
    assert any(MISMATCH in _text(r) for r in failed), [_text(r)[-800:] for r in failed]
    assert all(_steps_done(r) == 0 for r in failed)  # in step 0


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_without_accord_skipping_the_tower_at_step_3_kills_the_job_at_step_3(stage):
    """ZeRO-1/2: a size mismatch in step 3's gradient all-reduce. ZeRO-3 (this
    model's parameters are under the persistence threshold): a mismatch, or
    the ranks block in different collectives until the process group's
    timeout (20 s here)."""
    results = sc.run_ds_ranks(sc.train, 2, stage=stage, case="skip_at_3", steps=4)
    failed = _failures(results)
    assert failed, "DeepSpeed trained without accord: the pinned failure changed"
    signs = (MISMATCH,) if stage < 3 else (MISMATCH, "Timed out waiting")
    assert any(any(s in _text(r) for s in signs) for r in failed), \
        [_text(r)[-800:] for r in failed]
    assert all(_steps_done(r) == 3 for r in failed)  # in step 3


# ---------------------------------------------------------------- with accord


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("case", ["never_on_1", "skip_at_3"])
def test_zero12_fp32_tower_skipped_trains_with_reference_gradients(stage, case):
    """Embedded default daemons (install(engine) with no client)."""
    results = sc.run_ds_ranks(sc.train, 2, stage=stage, case=case, steps=4, accord="embedded")
    _check_against_reference(results)
    for r in results:
        assert r[-1]["left_patched"] == []  # uninstall restored DeepSpeed's methods
        assert r[-1]["stats"]["releases"] == 4


@pytest.mark.parametrize("stage", [1, 2])
def test_zero12_fp32_tower_used_nowhere_is_bitwise_unchanged_with_its_moments(stage, cluster):
    info = cluster_info(cluster, 2, f"ds-nowhere-{stage}")
    results = sc.run_ds_ranks(sc.train, 2, stage=stage, case="nowhere_at_1", steps=3,
                              accord="cluster", cluster=info)
    _check_against_reference(results)
    _check_unused_unchanged(results, step=1)
    for r in results:
        assert r[-1]["stats"]["restored"] > 0


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("case", ["one_micro", "first_micro"])
def test_zero12_bf16_accumulation_tower_in_one_microbatch_of_one_rank(stage, case, cluster):
    info = cluster_info(cluster, 2, f"ds-bf16-{stage}-{case}")
    results = sc.run_ds_ranks(sc.train, 2, stage=stage, case=case, steps=2, gas=2,
                              dtype="bf16", accord="cluster", cluster=info)
    _check_against_reference(results, dtype="bf16")


@pytest.mark.parametrize("stage", [1, 2])
def test_zero12_coalesce_grad_reduction_tower_in_one_backward_of_one_rank(stage):
    """engine.coalesce_grad_reduction(): two backwards, one reduction pass at
    the block's end; without accord it dies there (pinned), with accord the
    gradients equal the reference."""
    failed = _failures(sc.run_ds_ranks(sc.train, 2, stage=stage, case="one_micro", steps=1,
                                       coalesce=2))
    assert failed and any(MISMATCH in _text(r) for r in failed), failed
    results = sc.run_ds_ranks(sc.train, 2, stage=stage, case="one_micro", steps=2, coalesce=2,
                              accord="embedded")
    _check_against_reference(results)


# ---------------------------------------------------------------- ZeRO-1/2: turns in the backward


BUCKET = 1000  # reduce_bucket_size, elements: the sequential models' 3,000 span 3+ buckets
TURNS = {"reduce_bucket_size": BUCKET, "overlap_comm": True}  # ZeRO-1 reduces in hooks too


def _stats(results):
    return [r[-1]["stats"] for r in results]


@pytest.mark.parametrize("stage,world", [(1, 2), (2, 2), (2, 3)])
def test_zero12_sequential_model_holds_at_most_one_bucket_beyond_deepspeed(stage, world,
                                                                           cluster):
    """Every reduction is handed to DeepSpeed during the backward, before
    the decision; accord holds at most one bucket's gradient bytes beyond
    DeepSpeed (here: the weight whose bias, released first, is still being
    computed); 2 accumulated microbatches."""
    info = cluster_info(cluster, world, f"ds-seq-{stage}-{world}")
    results = sc.run_ds_ranks(sc.train, world, timeout_s=60 * world, stage=stage, steps=3, gas=2,
                              kind="seq", zero3=TURNS, accord="cluster", cluster=info)
    _check_against_reference(results)
    for s in _stats(results):
        assert 0 < s["speculated"] == s["reduced"], s
        assert s["late"] == s["repaired"] == s["zero_filled"] == 0, s
        assert s["held_bytes"] <= BUCKET * 4, s
        print(f"accord-test: ZeRO-{stage} sequential held_bytes {s['held_bytes']}")


@pytest.mark.parametrize("stage", [1, 2])
def test_zero12_late_gradient_is_repaired_by_a_delta_with_reference_gradients(stage, cluster):
    """The input layer is defined last: first in the model's order reversed
    (step 0's release order), its gradient comes last, after its turn
    (zeros), on every rank; the delta all-reduce adds it. From step 1 on the
    release order is the one learned in step 0: nothing late."""
    info = cluster_info(cluster, 2, f"ds-late-{stage}")
    results = sc.run_ds_ranks(sc.train, 2, stage=stage, steps=3, kind="late", zero3=TURNS,
                              accord="cluster", cluster=info)
    _check_against_reference(results)
    for s in _stats(results):
        assert s["late"] == 2 and s["repaired"] == 2, s  # its weight and bias, step 0
        print(f"accord-test: ZeRO-{stage} late held_bytes {s['held_bytes']}")


@pytest.mark.parametrize("stage,dtype,gas,world", [(2, "fp32", 1, 2), (1, "fp32", 1, 2),
                                                   (2, "bf16", 2, 2), (1, "bf16", 2, 2)])
def test_zero12_tower_on_one_rank_at_some_steps_is_speculated_and_repaired(stage, dtype, gas,
                                                                          world, cluster):
    """The tower runs on rank 0 at steps 0 and 2, nowhere at 1 and 3: step 1
    hands it over as zeros (speculated from step 0) and trims it, so it is
    bitwise unchanged; step 2's speculation (step 1's decision) leaves it
    out and the decision includes it: repaired by the delta."""
    info = cluster_info(cluster, world, f"ds-some-{stage}-{dtype}-{world}")
    results = sc.run_ds_ranks(sc.train, world, timeout_s=60 * world, stage=stage,
                              case="on_0_at_even", steps=4, gas=gas, dtype=dtype, zero3=TURNS,
                              accord="cluster", cluster=info)
    _check_against_reference(results, dtype=dtype)
    if dtype == "fp32":
        _check_unused_unchanged(results, step=1)
    for s in _stats(results):
        assert s["repaired"] >= 2 and s["speculated"] > 0 and s["restored"] > 0, s
        print(f"accord-test: ZeRO-{stage} {dtype} tower at some steps held_bytes "
              f"{s['held_bytes']} zero_filled_bytes {s['zero_filled_bytes']}")


@pytest.mark.parametrize("stage", [2, 3])
def test_three_ranks_tower_never_on_rank_1(stage, cluster):
    info = cluster_info(cluster, 3, f"ds-w3-{stage}")
    results = sc.run_ds_ranks(sc.train, 3, timeout_s=150, stage=stage, case="never_on_1",
                              steps=2, accord="cluster", cluster=info,
                              persistence=0 if stage == 3 else None,
                              optional=("tower",) if stage == 3 else ())
    _check_against_reference(results)


# ---------------------------------------------------------------- ZeRO-3


@pytest.mark.parametrize("case,persistence", [("never_on_1", None), ("never_on_1", 0),
                                              ("skip_at_3", 0)])
def test_zero3_optional_tower_trains_with_reference_gradients(case, persistence):
    """optional=["tower"]; persistence 0: every other module is fetched per
    forward and backward (DeepSpeed's module trace and prefetch at work);
    None: DeepSpeed's default threshold keeps this small model gathered."""
    results = sc.run_ds_ranks(sc.train, 2, stage=3, case=case, steps=4 if case == "skip_at_3" else 2,
                              accord="embedded", persistence=persistence, optional=("tower",))
    _check_against_reference(results)
    for r in results:
        assert r[-1]["left_patched"] == []  # uninstall restored DeepSpeed's functions


# ---------------------------------------------------------------- ZeRO-3: turns among all-gathers


# DeepSpeed's backward all-gathers: `refetch` releases each module after its
# forward and fetches it again at its backward, one all-gather per module;
# `prefetch` also prefetches along the trace; `kept` (DeepSpeed's defaults)
# keeps this small model gathered once its trace is complete.
FETCH = {"refetch": {"stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0},
         "prefetch": {"stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 1200},
         "kept": {}}
SEQ_GRAD_BYTES = sc.LAYERS * sc.SEQ * (sc.SEQ + 1) * 4  # 12,000: one backward's fp32 gradient


def _same_collectives(results):
    """Every rank issued the same collectives (name, element counts) in the same order."""
    seqs = [r[-1]["collectives"] for r in results]
    assert seqs[0], seqs
    for other in seqs[1:]:
        assert other == seqs[0]


@pytest.mark.parametrize("fetch,world", [("refetch", 2), ("prefetch", 2), ("kept", 2),
                                         ("epilogue", 2), ("refetch", 3), ("prefetch", 3),
                                         ("kept", 3)])
def test_zero3_sequential_model_holds_at_most_one_bucket_beyond_deepspeed(fetch, world, cluster):
    """ZeRO-3 hands DeepSpeed every parameter during the backward, before
    the decision, at points placed among its all-gathers; every rank issues
    the same collectives. Held beyond DeepSpeed, in every backward: at most
    one bucket (here one module's gradient), also in the second backward,
    where DeepSpeed's fetches change (its trace complete: prefetch along it,
    or, with its defaults, every parameter kept gathered from the forward).
    `epilogue` (turns off): every gradient of every backward."""
    info = cluster_info(cluster, world, f"ds-z3-seq-{fetch}-{world}")
    config = dict(FETCH.get(fetch, FETCH["refetch"]), reduce_bucket_size=BUCKET)
    results = sc.run_ds_ranks(sc.train, world, timeout_s=60 * world, stage=3, steps=3, gas=2,
                              kind="seq", zero3=config,
                              persistence=0, accord="cluster", cluster=info, record=True,
                              turns=fetch != "epilogue")
    _check_against_reference(results)
    _same_collectives(results)
    for s in _stats(results):
        print(f"accord-test: ZeRO-3 sequential {fetch} held_bytes {s['held_bytes']} "
              f"per backward {s['held_by_release']}")
        if fetch == "epilogue":
            assert s["held_bytes"] == SEQ_GRAD_BYTES and s["speculated"] == 0, s
            continue
        assert 0 < s["speculated"] == s["reduced"], s
        assert s["late"] == s["repaired"] == s["zero_filled"] == 0, s
        held = s["held_by_release"]
        assert len(held) == 6 and 0 < max(held) <= BUCKET * 4, s


def test_zero3_input_layer_defined_last_is_handed_when_it_comes_on_every_rank(cluster):
    """The input layer, defined last, is first in the first backward's
    release order, its gradient last. The first backward agrees its turns
    before each all-gather (nothing is learned yet): every other layer is
    handed as its gradient comes on every rank, the input layer after it
    came, so nothing is late; from then on the learned order has it last."""
    info = cluster_info(cluster, 2, "ds-z3-late")
    results = sc.run_ds_ranks(sc.train, 2, stage=3, steps=3, kind="late", persistence=0,
                              zero3=dict(FETCH["refetch"], reduce_bucket_size=BUCKET),
                              accord="cluster", cluster=info, record=True)
    _check_against_reference(results)
    _same_collectives(results)
    for s in _stats(results):
        assert s["late"] == 0 and s["repaired"] == 0 and s["agreed_caps"] > 0, s
        assert max(s["held_by_release"]) <= BUCKET * 4, s
        print(f"accord-test: ZeRO-3 late held_bytes {s['held_bytes']} "
              f"per backward {s['held_by_release']}")


@pytest.mark.parametrize("fetch", ["refetch", "prefetch"])
def test_zero3_gradient_before_an_all_gather_on_one_rank_after_it_on_another(fetch, cluster):
    """The optional (persistent) tower's output joins before the body on
    rank 0 and after it on rank 1: its gradient comes after the body's
    backward all-gather on rank 0 and before it on rank 1, and with a
    100-element bucket nearly every hand-over reduces. Handed as gradients
    come, rank 1 would reduce before that all-gather what rank 0 reduces
    after it; the cap makes every rank's collectives the same, and the
    gradients equal the reference."""
    info = cluster_info(cluster, 2, f"ds-z3-placed-{fetch}")
    results = sc.run_ds_ranks(sc.train, 2, stage=3, steps=3, kind="toy-placed", persistence=0,
                              optional=("tower",), record=True,
                              zero3=dict(FETCH[fetch], reduce_bucket_size=100),
                              accord="cluster", cluster=info)
    _check_against_reference(results)
    _same_collectives(results)
    for s in _stats(results):
        print(f"accord-test: ZeRO-3 placed {fetch} held_bytes {s['held_bytes']} "
              f"per backward {s['held_by_release']} late {s['late']}")


@pytest.mark.parametrize("dtype,gas,fetch,world", [("fp32", 1, "refetch", 2),
                                                   ("bf16", 2, "refetch", 2),
                                                   ("fp32", 1, "prefetch", 2),
                                                   ("fp32", 1, "prefetch", 3)])
def test_zero3_tower_on_one_rank_at_some_steps_is_speculated_and_repaired(dtype, gas, fetch,
                                                                         world, cluster):
    """The optional tower runs on rank 0 at steps 0 and 2, nowhere at 1 and
    3: handed over as zeros at step 1 and left unchanged, left out of step
    2's speculation and repaired into the gradient partitions; the same
    collectives on both ranks."""
    info = cluster_info(cluster, world, f"ds-z3-some-{dtype}-{fetch}-{world}")
    results = sc.run_ds_ranks(sc.train, world, timeout_s=60 * world, stage=3,
                              case="on_0_at_even", steps=4, gas=gas,
                              dtype=dtype, persistence=0, optional=("tower",), record=True,
                              zero3=dict(FETCH[fetch], reduce_bucket_size=BUCKET),
                              accord="cluster", cluster=info)
    _check_against_reference(results, dtype=dtype)
    _same_collectives(results)
    if dtype == "fp32":
        _check_unused_unchanged(results, step=1)
    for s in _stats(results):
        assert s["repaired"] >= 2 and s["speculated"] > 0 and s["restored"] > 0, s
        print(f"accord-test: ZeRO-3 {dtype} {fetch} tower at some steps held_bytes "
              f"{s['held_bytes']} per backward {s['held_by_release']}")


def _check_fp16_skip(results, skipped_step):
    """fp16: the gradients (scaled by the loss scale) equal the reference
    and are identical on every rank, except at `skipped_step`, which every
    rank skips: the loss scale halves, and every parameter (fp32 and fp16)
    and Adam moment is bitwise unchanged by that step."""
    per_rank = _steps(results)
    for step, records in enumerate(zip(*per_rank)):
        first = records[0]
        for rank, rec in enumerate(records):
            assert rec["skipped"] == (step >= skipped_step) and rec["scale"] == first["scale"]
            if step == skipped_step:
                for n in rec["start"]:
                    assert torch.equal(rec["after"][n], rec["start"][n]), n
                    before = per_rank[rank][step - 1]["lp_after"][n]
                    assert torch.equal(rec["lp_after"][n], before), n
                    for key in ("exp_avg", "exp_avg_sq"):
                        assert torch.equal(rec["after_moments"][key][n], rec["moments"][key][n])
                continue
            for n, g in rec["grads"].items():
                assert torch.equal(g, first["grads"][n]), (step, n)
                ref = rec["ref"][n]
                if ref is None:
                    assert torch.count_nonzero(g) == 0, (step, n)
                    continue
                err = (g / rec["scale"] - ref).norm() / ref.norm().clamp_min(1e-12)
                assert err < 2e-2, (step, n, float(err))
        if step == skipped_step + 1:
            assert first["scale"] == per_rank[0][skipped_step]["scale"] / 2


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_fp16_loss_scaler_skips_an_overflow_on_one_rank_everywhere(stage, cluster):
    """fp16 with DeepSpeed's dynamic loss scaler (its CPU accelerator's fp16
    check overridden in the test's ranks: deepspeed_scenarios._allow_cpu_fp16),
    turns on, the tower on rank 0 at even steps (ZeRO-3: optional). Rank 0's
    loss is inf at step 1: every rank skips that step and leaves every
    parameter and moment bitwise unchanged; at step 2 rank 0 runs the tower
    (ZeRO-3: all-gathered again after the skipped step, which partitioned
    it) and it is repaired; the other steps match the reference (the tower
    bitwise unchanged at step 3, where no rank used it); ZeRO-3: the same
    collectives."""
    info = cluster_info(cluster, 2, f"ds-fp16-{stage}")
    zero = dict(FETCH["refetch"], reduce_bucket_size=BUCKET) if stage == 3 else TURNS
    results = sc.run_ds_ranks(sc.train, 2, stage=stage, case="on_0_at_even", steps=4,
                              dtype="fp16", overflow=(0, 1), zero3=zero, record=stage == 3,
                              persistence=0 if stage == 3 else None,
                              optional=("tower",) if stage == 3 else (),
                              accord="cluster", cluster=info)
    _check_fp16_skip(results, skipped_step=1)
    _check_unused_unchanged(results, step=3)
    if stage == 3:
        _same_collectives(results)
    for s in _stats(results):
        assert s["repaired"] >= 1 and s["speculated"] > 0, s
        print(f"accord-test: ZeRO-{stage} fp16 held_bytes {s['held_bytes']} "
              f"per backward {s['held_by_release']}")


@pytest.mark.parametrize("given", [True, False])
def test_zero3_leaf_module_tower_on_one_rank_trains_with_reference_gradients(given, cluster):
    """The tower a ZeRO-3 leaf module (its parameters reduced from its
    backward hook, which runs on rank 0 only). given: optional=["tower"],
    used on rank 0 at steps 0 and 2, nowhere at 1 and 3 (bitwise unchanged
    there, repaired at 2), the same collectives on both ranks; learned: not
    given, never used on rank 1, made optional in step 0."""
    info = cluster_info(cluster, 2, f"ds-z3-leaf-{given}")
    results = sc.run_ds_ranks(sc.train, 2, stage=3, case="on_0_at_even" if given else "never_on_1",
                              steps=4 if given else 2, persistence=0, leaf=("tower",),
                              optional=("tower",) if given else (), record=given,
                              zero3=dict(FETCH["refetch"], reduce_bucket_size=BUCKET),
                              accord="cluster", cluster=info)
    _check_against_reference(results)
    if given:
        _same_collectives(results)
        _check_unused_unchanged(results, step=1)
    else:
        assert all(r[-1]["learned"] == ["tower"] for r in results), [r[-1] for r in results]


TOY_BUCKET = 100  # elements: each of the toy model's modules but the head fills a bucket


@pytest.mark.parametrize("ckpt", ["torch", "deepspeed"])
def test_zero3_activation_checkpointing_refetches_are_counted_alike_on_every_rank(ckpt, cluster):
    """The body under activation checkpointing (torch's non-reentrant, with the
    optional tower too; DeepSpeed's reentrant): the body's recomputation
    fetches it again inside the backward (an all-gather the turns count with
    the backward's), the tower's (rank 0 at steps 0 and 2 only) fetches
    nothing. The same collectives on both ranks, reference
    gradients, the tower bitwise unchanged where no rank used it."""
    info = cluster_info(cluster, 2, f"ds-z3-ckpt-{ckpt}")
    results = sc.run_ds_ranks(sc.train, 2, stage=3, case="on_0_at_even", steps=4,
                              kind=f"toy-{ckpt}-ckpt", persistence=0, optional=("tower",),
                              zero3=dict(FETCH["refetch"], reduce_bucket_size=TOY_BUCKET),
                              record=True, accord="cluster", cluster=info)
    _check_against_reference(results)
    _same_collectives(results)
    _check_unused_unchanged(results, step=1)
    for s in _stats(results):
        assert s["speculated"] > 0 and s["repaired"] >= 2, s
        print(f"accord-test: ZeRO-3 {ckpt} checkpointing held_bytes {s['held_bytes']} "
              f"per backward {s['held_by_release']}")


class _FakeZero3:
    """What Zero3Turns calls on the adapter, recording each parameter
    handed to DeepSpeed's bucketing and each all-gather, in order."""

    def __init__(self):
        self.log = []

    def reduces_now(self):
        return True

    def gradient(self, p):
        return p.grad

    def zero_fill(self, p):
        p.grad = torch.zeros_like(p)

    def reduce(self, reduce_ready, p, i):
        self.log.append(("hand", p.tag))
        p.grad = None

    def in_bucket(self, p):
        return False

    def to_gather(self, params):
        return [(p, p.numel()) for p in params if not getattr(p, "there", False)]

    def gather_key(self, gathered):
        return tuple(sorted(p.tag for p, _ in gathered))

    def all_reduce_max(self, t):
        pass  # every simulated rank learns from the same backward

    def all_reduce_min(self, t):
        self.lockstep.all_reduce_min(self.rank, t)


class _Lockstep:
    """All-reduce (MIN) among simulated ranks, one thread each; a rank that
    all-reduces where the others do not breaks the barrier."""

    def __init__(self, ranks):
        import threading

        self.barrier = threading.Barrier(ranks, timeout=30)
        self.slots = [None] * ranks

    def all_reduce_min(self, rank, t):
        self.slots[rank] = t.clone()
        self.barrier.wait()
        least = torch.stack(self.slots).min(0).values
        self.barrier.wait()
        t.copy_(least)


def _fake_rank(modules):
    import types

    from accord.deepspeed.installation import Stats
    from accord.deepspeed.turns3 import Zero3Turns

    model = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(modules)])
    for k, p in enumerate(model.parameters()):
        p.tag = k
    inst = types.SimpleNamespace(zero=_FakeZero3(), engine=types.SimpleNamespace(module=model),
                                 stats=Stats(), watch=None, _reduce=None, window_closed=True)
    inst.order = [(0, p) for p in model.parameters()]
    inst.names = [n for n, _ in model.named_parameters()]
    return model, Zero3Turns(inst)


def _fake_backward(model, turns, gathers, arrivals):
    """`gathers`: the backward's all-gathers (module indices each);
    `arrivals`: per all-gather count, the parameters whose gradient comes
    then. Returns the log: hands and all-gathers in order."""
    params = list(model.parameters())
    turns.zero.log = []
    turns.reset_gathers()
    for c in range(len(gathers) + 1):
        for k in arrivals.get(c, []):
            if turns.taken[k]:
                turns.late[k] = torch.ones_like(params[k])
                continue
            params[k].grad = torch.ones_like(params[k])
            turns.held(params[k])
        if c < len(gathers):
            gathered = [(p, p.numel()) for m in gathers[c] for p in model[m].parameters()]
            turns.before_all_gather(gathered)
            turns.zero.log.append(("all-gather", c))
    turns.through(len(turns.release) - 1)
    return turns.zero.log


@pytest.mark.parametrize("case", ["first", "learned", "changed", "twice"])
def test_zero3_turns_hand_the_same_parameters_between_the_same_all_gathers_whatever_the_order(
        case):
    """The rule alone (no DeepSpeed): ranks whose gradients come in
    different orders, at different all-gathers or not at all hand DeepSpeed
    the same parameters in the same order between the same two all-gathers,
    so its bucketing issues the same reductions between them. First
    backward (agreed before each all-gather), with a learned table
    (prefetches: all-gathers of several modules), `changed`: learned from a
    backward that fetched every module, then one where two modules are still
    there and the rest come in two prefetches (agreed from the prologue, tail
    after the last), and `twice`: learned from that backward, then one that
    fetches module 2 once more after module 1 (agreed from there)."""
    import random
    import threading

    modules, ranks = 6, 8
    fetch = [[m] for m in reversed(range(modules))]
    prefetch = [[5, 4], [3, 2], [1, 0]]
    gathers = {"first": fetch, "learned": prefetch, "changed": [[3, 2], [1, 0]],
               "twice": fetch[:5] + [[2]] + fetch[5:]}[case]
    lockstep = _Lockstep(ranks)
    logs = [None] * ranks

    def rank_backwards(rank):
        model, turns = _fake_rank(modules)
        turns.zero.lockstep, turns.zero.rank = lockstep, rank
        if case != "first":  # the same backward on every rank first, then learned
            seen = prefetch if case == "learned" else fetch
            template = {c + 1: [k for m in ms for k in (2 * m + 1, 2 * m)]
                        for c, ms in enumerate(seen)}
            _fake_backward(model, turns, seen, template)
            turns.fetched.update(turns.counts)
            turns.learn()
            turns.reset()
        for m in (5, 4):  # kept gathered from the forward
            for p in model[m].parameters():
                p.there = case == "changed"
        rng = random.Random(rank)
        arrivals = {}
        for k in range(2 * modules):
            if rng.random() < 0.8:  # some ranks never get some gradients
                arrivals.setdefault(rng.randrange(len(gathers) + 1), []).append(k)
        for v in arrivals.values():
            rng.shuffle(v)
        logs[rank] = _fake_backward(model, turns, gathers, arrivals)

    threads = [threading.Thread(target=rank_backwards, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert logs[0] is not None
    for log in logs[1:]:
        assert log == logs[0]
    assert sum(1 for e in logs[0] if e[0] == "hand") == 2 * modules


def test_zero3_tower_used_nowhere_is_bitwise_unchanged_with_its_moments(cluster):
    info = cluster_info(cluster, 2, "ds-z3-nowhere")
    results = sc.run_ds_ranks(sc.train, 2, stage=3, case="nowhere_at_1", steps=3,
                              accord="cluster", cluster=info, persistence=0,
                              optional=("tower",))
    # The gradient DeepSpeed hands the optimizer for the tower at step 1 is
    # zero (not step 0's, which its partition would otherwise still hold).
    _check_against_reference(results)
    _check_unused_unchanged(results, step=1)


@pytest.mark.parametrize("case", ["one_micro", "first_micro"])
def test_zero3_bf16_accumulation_tower_in_one_microbatch_of_one_rank(case, cluster):
    info = cluster_info(cluster, 2, f"ds-z3-bf16-{case}")
    results = sc.run_ds_ranks(sc.train, 2, stage=3, case=case, steps=2, gas=2, dtype="bf16",
                              accord="cluster", cluster=info, persistence=0,
                              optional=("tower",))
    _check_against_reference(results, dtype="bf16")


def test_zero3_coalesce_grad_reduction_with_an_optional_tower():
    results = sc.run_ds_ranks(sc.train, 2, stage=3, case="one_micro", steps=2, coalesce=2,
                              accord="embedded", persistence=0, optional=("tower",))
    _check_against_reference(results)


def test_zero3_tower_not_marked_optional_ends_with_the_same_divergence_error_on_every_rank():
    """The tower runs on rank 0 only and is not marked optional. Without
    accord, DeepSpeed's parameter fetch pairs rank 0's all-gather of the tower
    with rank 1's of the next module: Gloo's size mismatch (pinned). With
    accord, the collective-sequence guard stops both ranks before that
    all-gather (every collective of step 0 is new), and both raise
    AccordDivergenceError with one text naming what each was about to fetch
    (learning off: by default the tower would be learned, below)."""
    failed = _failures(sc.run_ds_ranks(sc.train, 2, stage=3, case="never_on_1", steps=2,
                                       persistence=0))
    assert failed and any(MISMATCH in _text(r) for r in failed), \
        [_text(r)[-800:] for r in failed]
    results = sc.run_ds_ranks(sc.train, 2, stage=3, case="never_on_1", steps=2,
                              accord="embedded", persistence=0, learn=False)
    assert all(isinstance(r, RankFailure) for r in results), results
    texts = [r.error for r in results]
    assert texts[0] == texts[1], texts
    assert texts[0].startswith("AccordDivergenceError(\"accord: the ranks' DeepSpeed ZeRO-3 "
                               "collectives diverged: "), texts[0]
    # Position 0: DeepSpeed's module-trace check at the forward's start.
    assert "rank 0 issued step 1 position 2: all-gather of 'tower' (2 parameters, 80 x " \
           "float32)" in texts[0], texts[0]
    assert "rank 1 issued step 1 position 2: all-gather of 'body' (2 parameters, 272 x " \
           "float32)" in texts[0], texts[0]
    assert "accord.deepspeed.install(engine, optional=[...])" in texts[0]
    assert all(_steps_done(r) == 0 for r in results)


NO_PREFETCH = {"stage3_prefetch_bucket_size": 0, "stage3_max_reuse_distance": 0}


def _divergence_text(r):
    """The AccordDivergenceError text a rank ended with: raised, or written to
    stderr by its guard before it ended the process (exit status 3: the rank
    was blocked inside a collective)."""
    if isinstance(r, RankDied):
        assert r.exitcode == 3, r
        lines = [l for l in r.stderr.splitlines() if l.startswith("AccordDivergenceError: ")]
    else:
        assert isinstance(r, RankFailure) and r.error.startswith("AccordDivergenceError("), r
        lines = [l for l in r.traceback.splitlines()
                 if l.startswith("accord.torch.errors.AccordDivergenceError: ")]
    assert lines, _text(r)[-2000:]
    return lines[-1].split(": ", 1)[1]


@pytest.mark.parametrize("fetch,rank0,rank1", [
    ("persistent", "nothing", "position 0: all-gather of 'head' (2 parameters, 17 x float32)"),
    ("prefetch", "nothing more after step 4 position 0: all-gather of 'body, embed, head, "
                 "tower' (8 parameters, 513 x float32)",
     "position 1: all-gather of 'body' (2 parameters, 272 x float32)"),
    ("each", "step 4 position 1: all-gather of 'tower' (2 parameters, 80 x float32)",
     "position 1: all-gather of 'body' (2 parameters, 272 x float32)")])
def test_zero3_tower_not_marked_optional_skipped_at_step_3_is_named_on_every_rank(
        fetch, rank0, rank1):
    """Rank 1 skips the tower at step 3 only (not marked optional). Steps 0-2
    agreed, so nothing waits until rank 1 is about to all-gather what rank 0
    does not (DeepSpeed invalidates rank 1's module trace and fetches again).
    Every parameter persistent (DeepSpeed's default threshold), or fetched
    by prefetch at the step's start: rank 0 all-gathers nothing more and
    waits for its release's decision. Each module fetched on its own (no
    prefetch, no reuse): rank 0 is blocked in its all-gather of the tower.
    The guards compare the windows they are stuck in; every rank ends with
    the same AccordDivergenceError, none with Gloo's error or timeout."""
    results = sc.run_ds_ranks(sc.train, 2, stage=3, case="skip_at_3", steps=5,
                              accord="embedded", persistence=None if fetch == "persistent" else 0,
                              zero3=NO_PREFETCH if fetch == "each" else None)
    texts = [_divergence_text(r) for r in results]
    assert texts[0] == texts[1], texts
    assert texts[0].startswith("accord: the ranks' DeepSpeed ZeRO-3 collectives diverged: "
                               f"rank 0 issued {rank0}; rank 1 issued step 4 {rank1}. "), texts[0]
    assert all(_steps_done(r) == 3 for r in results)


@pytest.mark.parametrize("prefetch", [True, False])
def test_zero3_learns_a_module_that_diverges_in_step_0(prefetch):
    """install(engine) (learn_optional is on by default), the tower never used
    on rank 1 and not marked: at step 0's divergence (rank 0 about to all-gather the tower,
    rank 1 the body) every rank makes the tower optional (persistent,
    all-gathered on every rank), rank 0 skips its fetch, and training goes on
    with gradients equal to the reference, identical on both ranks; DeepSpeed's
    module trace (checked across ranks at step 1) is the same on both."""
    results = sc.run_ds_ranks(sc.train, 2, stage=3, case="never_on_1", steps=3,
                              accord="embedded", persistence=0,
                              zero3=None if prefetch else NO_PREFETCH)
    _check_against_reference(results)
    for r in results:
        assert r[-1]["learned"] == ["tower"], r[-1]
        assert r[-1]["left_patched"] == []


def test_zero3_learning_is_for_step_0_a_later_divergence_is_an_error():
    """With learning on (the default), the tower skipped at step 3 (DeepSpeed's
    module trace already complete) still ends with the guard's error."""
    results = sc.run_ds_ranks(sc.train, 2, stage=3, case="skip_at_3", steps=5,
                              accord="embedded", persistence=0)
    texts = [_divergence_text(r) for r in results]
    assert texts[0] == texts[1] and "rank 1 issued step 4 position 1: all-gather of 'body'" \
        in texts[0], texts


@pytest.mark.parametrize("prefetch", [True, False])
def test_zero3_guard_adds_no_blocking_wait_in_the_steady_state(prefetch):
    """Every rank uses every module, every parameter fetched (persistence 0;
    without prefetch, also no reuse: each module's forward and backward
    fetches). The guard records every all-gather and DeepSpeed's module-trace
    checks; it waits for a verdict only for collectives new to the agreed
    sequence (in steps 0-3: DeepSpeed checks the module trace at the start of
    steps 0 and 1 and, with prefetch, follows the trace from step 1 on, so
    steps 0, 1 and 2 differ, and each begins with the previous one's end),
    never once the steps repeat."""
    results = sc.run_ds_ranks(sc.train, 2, stage=3, case="all", steps=6, accord="embedded",
                              persistence=0, zero3=None if prefetch else NO_PREFETCH)
    _check_against_reference(results)
    for r in results:
        steps = [s for s in r if "grads" in s]
        waits = [s["guard_waits"] for s in steps]
        assert waits[0] > 0 and waits[3] == waits[-1], waits
        reports = [0] + [s["guard_reports"] for s in steps]
        per_step = [b - a for a, b in zip(reports, reports[1:])]
        # Each later step: its all-gathers (4 modules' forward and backward
        # without prefetch), and the previous step's end.
        assert min(per_step[1:]) >= (2 if prefetch else 9), per_step
        all_gathers, trace_checks = r[-1]["all_gathers_recorded"]
        assert trace_checks == 2  # steps 0 and 1, until DeepSpeed's trace is complete
        assert all_gathers + trace_checks + 5 == reports[-1], r[-1]  # 5 step ends
        assert r[-1]["left_patched"] == []


def test_zero3_llava_text_only_rank_trains_with_reference_gradients(cluster):
    """transformers' LLaVA (CLIP tower, Llama decoder) from a tiny config under
    ZeRO-3 with every module fetched (persistence 0): rank 1 text-only, rank 0
    an image in one of 2 accumulated microbatches. Without accord the job
    dies in step 0 (pinned); with optional=[vision tower, projector] the
    gradients equal the reference (relative error <= 1e-5 per parameter, or
    1e-8 absolute for a gradient that is zero in exact arithmetic, such as a
    key bias's), identical on both ranks, and the tower's last layer (fed to
    nothing: vision_feature_layer=-2) is bitwise unchanged."""
    failed = _failures(sc.run_ds_ranks(sc.family, 2, timeout_s=150, steps=1, accord="none"))
    assert failed and all(_steps_done(r) == 0 for r in failed), failed
    info = cluster_info(cluster, 2, "ds-llava")
    results = sc.run_ds_ranks(sc.family, 2, timeout_s=200, steps=2, accord="cluster",
                              cluster=info)
    unused = _check_family(results)
    assert unused and all(".layers.1." in n or "post_layernorm" in n for n in unused), unused


@pytest.mark.parametrize("stage,leaf", [(2, False), (3, False), (3, True)])
def test_moe_with_tokenless_experts_trains_with_reference_gradients(stage, leaf):
    """An MoE language model with one module per expert (model_scenarios'
    custom_moe): experts 1 and 2 get no tokens on one rank, expert 3 on no
    rank. Without accord the job dies in step 0 (pinned); ZeRO-3 marks every
    expert optional (persistent). `leaf`: each MoE layer a ZeRO-3 leaf module
    (set_z3_leaf_modules), no optional=: without accord it trains, but
    DeepSpeed zero-fills the gradients of experts without tokens, so expert
    3 (no rank) moves by weight decay (pinned); accord takes a leaf
    module's zero-filled gradient as no gradient, so expert 3 is bitwise
    unchanged, as without leaf modules."""
    plain = sc.run_ds_ranks(sc.family, 2, timeout_s=150, name="custom_moe", stage=stage,
                            steps=1, accord="none", leaf=leaf)
    if leaf:
        _check_moves_unused_experts(plain)
    else:
        failed = _failures(plain)
        assert failed and all(_steps_done(r) == 0 for r in failed), failed
    results = sc.run_ds_ranks(sc.family, 2, timeout_s=200, name="custom_moe", stage=stage,
                              steps=2, accord="embedded", leaf=leaf)
    unused = _check_family(results)
    assert unused and all(".experts.3." in n for n in unused), unused


@pytest.mark.parametrize("mode", ["coalesce", "epilogue"])
def test_zero3_moe_leaf_modules_keep_unused_experts_unchanged(mode):
    """Each MoE layer a leaf module. coalesce: a step's 2 backwards in one
    engine.coalesce_grad_reduction() block (experts 1 and 2 have tokens in
    one backward of the block only); epilogue: turns=False. A zero-filled
    gradient is no gradient there too: expert 3 bitwise unchanged."""
    results = sc.run_ds_ranks(sc.family, 2, timeout_s=200, name="custom_moe", stage=3,
                              steps=2, accord="embedded", leaf=True,
                              coalesce=mode == "coalesce", turns=mode != "epilogue")
    unused = _check_family(results)
    assert unused and all(".experts.3." in n for n in unused), unused


def _check_moves_unused_experts(results):
    """DeepSpeed alone with leaf modules: reference gradients, but expert 3
    (used on no rank) is changed by the step."""
    for records in _steps(results):
        rec = records[0]
        unused = [n for n, g in rec["ref"].items() if g is None]
        assert unused and all(".experts.3." in n for n in unused), unused
        for n, g in rec["grads"].items():
            ref = rec["ref"][n]
            if ref is None:
                assert torch.count_nonzero(g) == 0, n
                assert not torch.equal(rec["after"][n], rec["start"][n]), n
            else:
                assert (g - ref).norm() <= 1e-5 * ref.norm() + 1e-8, n


def _check_family(results):
    """Gradients = reference, identical on both ranks; parameters used on no
    rank have zero gradient and are bitwise unchanged. Returns those."""
    per_rank = _steps(results)
    unused = []
    for step, (mine, other) in enumerate(zip(*per_rank)):
        unused = [n for n, g in mine["ref"].items() if g is None]
        for n, g in mine["grads"].items():
            assert torch.equal(g, other["grads"][n]), (step, n)
            ref = mine["ref"][n]
            if ref is None:
                assert torch.count_nonzero(g) == 0, (step, n)
                assert torch.equal(mine["after"][n], mine["start"][n]), (step, n)
            else:
                assert (g - ref).norm() <= 1e-5 * ref.norm() + 1e-8, (step, n)
    return unused


# ---------------------------------------------------------------- a rank lost


@pytest.fixture(scope="module")
def deadline_cluster():
    import accord

    with accord.LocalCluster(num_sidecars=2, coordinator_flags=["--deadline=5s"]) as c:
        yield c


@pytest.mark.parametrize("stage,where", [(2, "backward"), (3, "forward")])
def test_a_rank_that_dies_mid_step_is_named_on_the_survivor(stage, where, deadline_cluster):
    """Rank 1 exits at step 1 (ZeRO-2: after its forward; ZeRO-3: before it,
    so rank 0 is inside a parameter all-gather). Rank 0 raises the
    coordinator's named error (accord.torch's AccordJobError: rank 1 missing),
    not Gloo's, through the step watch (coordinator deadline 5 s)."""
    info = cluster_info(deadline_cluster, 2, f"ds-die-{stage}")
    results = sc.run_ds_ranks(sc.train, 2, stage=stage, case="never_on_1", steps=3,
                              accord="cluster", cluster=info, die=(1, 1, where),
                              persistence=0 if stage == 3 else None,
                              optional=("tower",) if stage == 3 else ())
    survivor, victim = results
    assert isinstance(victim, RankDied) and _steps_done(victim) == 1, victim
    assert isinstance(survivor, RankFailure), survivor
    assert survivor.error.startswith("AccordJobError("), survivor.error
    assert "missing ranks 1: rank 1" in survivor.error, survivor.error
    assert _steps_done(survivor) == 1


# ---------------------------------------------------------------- the HF Trainer


@pytest.mark.parametrize("stage", [2, 3])
def test_hf_trainer_with_deepspeed_and_the_accord_callback_matches_reference(stage, tmp_path):
    """Trainer(args=TrainingArguments(deepspeed=config)) on the tiny LLaVA,
    rank 0 image+text, rank 1 text-only, 2 accumulated microbatches: without
    accord it dies in step 0 (pinned, ZeRO-2); with AccordDeepSpeedCallback
    (ZeRO-3: optional=[vision tower, projector]) the first step's gradients
    equal the full-batch reference of test_hf.py (max error <= 1e-5 of the
    largest element, or 1e-8 absolute for a gradient zero in exact
    arithmetic), identical on both ranks."""
    import hf_scenarios as hs

    if stage == 2:
        failed = _failures(sc.run_ds_ranks(sc.hf_trainer, 2, timeout_s=200,
                                           out_dir=str(tmp_path / "plain"), stage=stage))
        assert failed and any(MISMATCH in _text(r) for r in failed), failed
    results = sc.run_ds_ranks(sc.hf_trainer, 2, timeout_s=200, out_dir=str(tmp_path / "run"),
                              stage=stage, accord="embedded")
    assert not _failures(results), results
    hs.save_checkpoint(str(tmp_path / "ckpt"))  # the same weights (seed 0)
    ref = hs.reference(str(tmp_path / "ckpt"), [r["batches"] for r in results])
    for n, want in ref.items():
        got = [r["grads"][n] for r in results]
        assert torch.equal(got[0], got[1]), n
        if want is None:
            assert torch.count_nonzero(got[0]) == 0, n
            continue
        diff = (got[0] - want).abs().max()
        assert diff <= 1e-5 * want.abs().max() + 1e-8, (n, float(diff))
    assert results[0]["stats"]["releases"] > 0
    for rank, r in enumerate(results):
        s = r["stats"]
        print(f"accord-test: HF ZeRO-{stage} rank {rank}: " +
              ", ".join(f"{k} {s.get(k)}" for k in ("held_bytes", "zero_filled_bytes", "late",
                                                     "repaired", "repaired_bytes",
                                                     "held_by_release")))


@pytest.mark.parametrize("stage", [2, 3])
def test_accelerate_with_a_deepspeed_plugin_and_accord_matches_reference(stage):
    """accelerate's Accelerator(deepspeed_plugin=...) without the Trainer:
    accord.deepspeed.install on the engine accelerator.prepare returns. The
    tower on rank 0 at steps 0 and 2, nowhere at 1 and 3: reference
    gradients, identical on both ranks; the tower bitwise unchanged at step
    1. Without accord (ZeRO-2) it dies in step 0 (pinned)."""
    if stage == 2:
        failed = _failures(sc.run_ds_ranks(sc.accelerate_train, 2, stage=2, steps=1,
                                           accord="none"))
        assert failed and any(MISMATCH in _text(r) for r in failed), failed
    results = sc.run_ds_ranks(sc.accelerate_train, 2, stage=stage)
    _check_against_reference(results)
    for records in _steps(results):
        for n in TOWER:
            assert torch.equal(records[1]["after"][n], records[1]["start"][n]), n
        assert not torch.equal(records[1]["after"]["body.weight"], records[1]["start"]["body.weight"])


# ---------------------------------------------------------------- the boundary


def test_probe_names_every_missing_deepspeed_name():
    """An optimizer without what accord hooks (a DeepSpeed that moved them) is
    refused at install, each missing name listed."""
    from accord.deepspeed import UnsupportedDeepSpeedError, zero

    class Optimizer:
        bit16_groups = []

    class Engine:
        optimizer = Optimizer()

        def zero_optimization_stage(self):
            return 2

    with pytest.raises(UnsupportedDeepSpeedError) as e:
        zero.probe(Engine())
    for name in ("Optimizer.reduce_ready_partitions_and_remove_grads",
                 "Optimizer.independent_gradient_partition_epilogue",
                 "Optimizer._optimizer_step", "Optimizer.partition_gradients"):
        assert name in str(e.value)
    Engine.zero_optimization_stage = lambda self: 3
    with pytest.raises(UnsupportedDeepSpeedError) as e:
        zero.probe(Engine())
    assert "Optimizer.persistent_parameters" in str(e.value)
    assert "Optimizer.fp16_groups" in str(e.value)

    class Coordinator:  # a parameter coordinator without what the guard hooks
        pass

    class Offload:
        def get_param_coordinator(self):
            return Coordinator()

    Optimizer.parameter_offload = Offload()
    with pytest.raises(UnsupportedDeepSpeedError) as e:
        zero.probe(Engine())
    for name in ("Coordinator.__all_gather_params", "Coordinator.reset_step",
                 "Coordinator.is_complete_trace", "Coordinator.is_record_trace",
                 "Coordinator.__submodule_order", "Coordinator.__step_id",
                 "Offload.pre_sub_module_forward_function"):
        assert name in str(e.value)
