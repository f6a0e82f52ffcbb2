"""The FSDP2 hooking against the test-only FakeGlooAgreement (no daemons):
pins the adapter's behaviour independently of the client and daemons."""

import pytest

import fsdp_scenarios as sc
from harness import check_results, run_ranks


@pytest.mark.parametrize(
    "fn", [sc.grad_accumulation, sc.rank_branch, sc.unused_everywhere, sc.mixed_half_dtypes]
)
def test_scenario_with_fake_agreement(fn):
    results = check_results(run_ranks(fn, 2, 240.0, agreement="fake"))
    for r in results:
        for name, ref in r["ref"].items():
            got = r["grads"][name]
            assert (got is None) == (ref is None), name
            if ref is not None:
                assert (got - ref).abs().max().item() <= 1e-5, name
