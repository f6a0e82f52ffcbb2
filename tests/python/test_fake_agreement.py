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


# ---------------------------------------------------------------- member sets (pure)


def test_member_tags_name_the_set_from_the_list_alone():
    from accord.torch import members as ms

    assert ms.tag(None) == ""
    assert ms.tag((2, 3)) == "@ranks2..3"
    assert ms.tag((5,)) == "@ranks5..5"
    assert ms.tag((1, 5)) == "@ranks1..5/4"
    assert ms.tag((0, 2, 4, 6)) == "@ranks0..6/2"
    odd = ms.tag((0, 1, 5))
    assert odd.startswith("@m") and len(odd) == 2 + 12 and int(odd[2:], 16) >= 0
    assert odd == ms.tag((0, 1, 5)) and odd != ms.tag((0, 1, 6))


def test_member_sets_are_canonical_and_every_rank_is_none():
    from accord.torch import members as ms

    assert ms.canonical([3, 2, 3], 4) == (2, 3)
    assert ms.canonical(range(4), 4) is None  # sent absent: the 1-D wire
    assert ms.union([(0, 2), (1, 3)], 4) is None
    assert ms.union([(2,), (3,)], 4) == (2, 3)
    assert ms.union([(2, 3), None], 4) is None
    assert ms.count(None, 8) == 8 and ms.count((1, 5), 8) == 2
    assert ms.ranks_of(None, 3) == (0, 1, 2) and ms.ranks_of((1, 5), 8) == (1, 5)
    for bad in ([], [4], [-1, 0]):
        with pytest.raises(ValueError):
            ms.canonical(bad, 4)
    reg = ("g", [("w", 1, 1)], None, False)
    assert ms.registration(reg, None) == reg  # 1-D: today's four elements
    assert ms.registration(reg, (2, 3)) == reg + ([2, 3],)


def test_sync_keys_are_equal_for_the_same_layout_and_stage_only():
    from accord.torch.members import sync_key

    key = sync_key("fsdp", ["fsdp/layers.0", "fsdp/root"], None)
    assert 0 < key < 2**64
    # blake2b, not Python's hash(): the same in every process and run.
    assert key == sync_key("fsdp", ("fsdp/layers.0", "fsdp/root"), None)
    others = [sync_key("fsdp", ["fsdp/root", "fsdp/layers.0"], None),
              sync_key("fsdp.1", ["fsdp/layers.0", "fsdp/root"], None),
              sync_key("fsdp", ["fsdp/layers.0"], None),
              sync_key("fsdp", ["fsdp/layers.0", "fsdp/root"], 0),
              sync_key("fsdp", ["fsdp/layers.0", "fsdp/root"], 1)]
    assert len({key, *others}) == 1 + len(others)


def test_prefixes_number_installations_per_member_set():
    from accord.torch.members import Prefixes

    p = Prefixes()
    assert p.take("fsdp", (0, 1)) == "fsdp"
    assert p.take("fsdp", (0, 1)) == "fsdp.1"  # the second chunk of an interleaved rank
    assert p.take("fsdp", (2, 3)) == "fsdp"
    assert p.take("fsdp", None) == "fsdp"
    p.give_back("fsdp", (0, 1), "fsdp")
    assert p.take("fsdp", (0, 1)) == "fsdp"  # the lowest free number
    assert p.take("fsdp", (0, 1)) == "fsdp.2"


class _Group:
    def __init__(self, gid, members):
        self.group_id, self.members = gid, members
        self.unit = gid.split("/", 1)[1].split("@")[0]

    def registration(self):
        from accord.torch import members as ms

        return ms.registration((self.group_id, [("w", 4, 16)], None, False), self.members)


@pytest.mark.parametrize("members", [None, (2, 3)])
def test_the_installation_items_are_agreed_among_its_member_set(members):
    """~late, ~wire and the guard's two groups carry the installation's
    member set and its tag; with none (1-D) every item is as before."""
    from accord.torch import members as ms
    from accord.torch.guard import SequenceGuard
    from accord.torch.negotiation import Negotiation, NegotiationTiming

    tag = ms.tag(members)
    groups = {f"p/<root>{tag}": _Group(f"p/<root>{tag}", members)}
    guard = SequenceGuard(None, 2, 4, "p/~collective-sequence", 5.0, members=members)
    neg = Negotiation(object(), "p", groups, NegotiationTiming(), guard=guard, members=members)
    regs = neg.registrations()
    ids = [r[0] for r in regs]
    assert ids == [f"p/<root>{tag}", f"p/~late{tag}", f"p/~wire{tag}",
                   f"p/~collective-sequence{tag}", f"p/~collective-sequence/step{tag}"]
    for r in regs:
        assert (len(r) == 4) if members is None else (r[4] == [2, 3]), r
    assert regs[1][1] == [("p/<root>", 1, 1)]  # one ~late slot per group, named without tag
    assert neg.late_item(7, [groups[ids[0]]], [True]) == (f"p/~late{tag}", 7, ["float32"])
    assert guard.comparison.ranks == ((0, 1, 2, 3) if members is None else (2, 3))


def test_window_comparisons_read_the_member_set_only():
    from accord.torch import windows
    from accord.torch.compare import WindowComparison

    class Store:
        asked = []

        def kv_get(self, keys, timeout_s, expected=None):
            self.asked.append((list(keys), expected))
            return [b'{"records": ["a"]}' for _ in keys]

    cmp = WindowComparison(Store(), "p/~collective-sequence@ranks2..3", 2, 4, 5.0,
                           members=(2, 3))
    got = cmp._all("k", 1.0)
    # The Get names only the member set's ranks when some did not write.
    assert Store.asked == [(["k/2", "k/3"], [2, 3])] and sorted(got) == [2, 3]

    def e(records, unit):
        return {"records": records, "waiting": True, "unit": unit, "forward_all_gather": True}

    entries = {2: e(["a", "ag b"], "b"), 3: e(["a", "ag c"], "c")}
    assert windows.repairable_units(entries, len(cmp.ranks)) == ["b", "c"]
    assert windows.repairable_units(entries, 4) is None  # a job-wide count would wait for 0, 1
