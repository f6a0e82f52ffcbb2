"""ZeRO-3 turns in backwards whose all-gathers change (real DeepSpeed, Gloo,
real daemons): a module fetched twice in one backward, a frozen module whose
backward never runs, a module trace DeepSpeed invalidates mid-run. In every
backward accord holds at most one bucket's gradient bytes beyond DeepSpeed
(`installation.stats.held_by_release`, docs/DEEPSPEED.md, "Costs"), every
rank issues the same collectives, and the gradients equal the
single-process reference on every rank.
"""

import pytest

pytest.importorskip("deepspeed")

import torch  # noqa: E402

import deepspeed_scenarios as sc  # noqa: E402
from cluster_fixture import cluster_info, start_cluster  # noqa: E402
from harness import RankDied, RankFailure  # noqa: E402

BUCKET = 1000  # reduce_bucket_size, elements: the 5 x 600 parameters span 3+ buckets
FETCH = {"refetch": {"stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0},
         "prefetch": {"stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 1200},
         "kept": {}}


@pytest.fixture(scope="module")
def cluster():
    with start_cluster(num_sidecars=2) as c:
        yield c


def _check(results):
    """Reference gradients (a frozen parameter: none on every rank), the
    same on every rank; the same collectives on every rank."""
    per_rank = []
    for r in results:
        assert not isinstance(r, (RankFailure, RankDied)), repr(r)
        per_rank.append([s for s in r if "grads" in s])
    for step, records in enumerate(zip(*per_rank)):
        first = records[0]
        for n, g in first["grads"].items():
            for other in records[1:]:
                assert (g is None) == (other["grads"][n] is None), (step, n)
                assert g is None or torch.equal(g, other["grads"][n]), (step, n)
            ref = first["ref"][n]
            if ref is None:
                assert g is None or torch.count_nonzero(g) == 0, (step, n)
                continue
            torch.testing.assert_close(g, ref, rtol=1e-5, atol=1e-7, msg=f"step {step} {n}")
    seqs = [r[-1]["collectives"] for r in results]
    assert seqs[0] and all(s == seqs[0] for s in seqs[1:])


@pytest.mark.parametrize("kind,fetch,world", [
    ("seq-twice", "refetch", 2), ("seq-twice", "prefetch", 2), ("seq-twice", "kept", 2),
    ("seq-twice", "refetch", 3),
    ("seq-frozen", "refetch", 2), ("seq-frozen", "prefetch", 2),
    ("seq-freeze", "refetch", 2), ("seq-freeze", "prefetch", 2),
    ("seq-swap", "refetch", 2), ("seq-swap", "prefetch", 2), ("seq-swap", "kept", 2),
    ("seq-swap", "prefetch", 3)])
def test_zero3_changed_all_gathers_hold_at_most_one_bucket_beyond_deepspeed(kind, fetch, world,
                                                                          cluster):
    info = cluster_info(cluster, world, f"ds-z3-fetch-{kind}-{fetch}-{world}")
    results = sc.run_ds_ranks(sc.train, world, timeout_s=60 * world, stage=3, steps=4, gas=2,
                              kind=kind, persistence=0, accord="cluster", cluster=info,
                              record=True, zero3=dict(FETCH[fetch], reduce_bucket_size=BUCKET))
    _check(results)
    for rank, r in enumerate(results):
        s = r[-1]["stats"]
        held = s["held_by_release"]
        print(f"accord-test: ZeRO-3 {kind} {fetch} W={world} rank {rank} held per backward "
              f"{held} late {s['late']} zero_filled {s['zero_filled']}")
        assert len(held) == 8 and max(held) <= BUCKET * 4, s
