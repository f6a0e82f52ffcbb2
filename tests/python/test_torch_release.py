"""accord.torch's pure parts, without processes: the turn layouts, the
completion of a step, the release schedule, the guard's windows, and one
backward's release (accord.torch.release) over fake groups and a fake
agreement (sub-second)."""

import dataclasses
import random

import types

import pytest

import accord
import accord.torch
from accord.torch import windows
from accord.torch.negotiation import Negotiation, NegotiationTiming, join_dtypes
from accord.torch.release import Release
from accord.torch.plan import History, Layout, ReleaseSchedule, complete, turn_layout


def L(included, wire="float32"):
    return Layout(tuple(bool(x) for x in included), wire)


# ------------------------------------------------------------------ turn layouts

def test_a_turn_without_history_carries_every_trainable_parameter():
    assert turn_layout(History(), [True, False, True], "bfloat16", True) == L([1, 0, 1], "bfloat16")


def test_a_turn_carries_the_last_decision_unless_it_grew():
    h = History(L([1, 0, 0]), grew_last=False)
    assert turn_layout(h, [1, 1, 1], "float32", True) == L([1, 0, 0])
    h.grew_last = True
    assert turn_layout(h, [1, 1, 1], "float32", True) == L([1, 1, 1])
    h.grew_last = False
    assert turn_layout(h, [1, 1, 1], "float32", False) == L([1, 1, 1])  # speculation off


# ------------------------------------------------------------------ completion

def test_an_exact_turn_needs_nothing():
    c = complete(L([1, 0, 1]), L([1, 0, 1]), late_somewhere=False)
    assert c.exact


def test_parameters_carried_but_used_nowhere_are_trimmed():
    c = complete(L([1, 1, 1]), L([1, 0, 0]), late_somewhere=False)
    assert (c.trimmed, c.delta) == ([1, 2], [])


def test_a_parameter_left_out_but_used_somewhere_goes_in_the_delta():
    c = complete(L([1, 0]), L([1, 1]), late_somewhere=False)
    assert (c.trimmed, c.delta) == ([], [1])


def test_a_late_rank_sends_every_included_parameter_again():
    c = complete(L([1, 1, 0]), L([1, 0, 1]), late_somewhere=True)
    assert (c.trimmed, c.delta) == ([1], [0, 2])


def test_a_group_without_a_turn_sends_what_some_rank_used():
    assert complete(None, L([0, 1]), late_somewhere=False).delta == [1]


def test_layouts_of_other_lengths_are_refused():
    with pytest.raises(ValueError):
        complete(L([1]), L([1, 0]), late_somewhere=False)


def test_wire_dtypes_join_to_the_narrowest_that_holds_each():
    assert join_dtypes(["bfloat16"]) == "bfloat16"
    assert join_dtypes(["bfloat16", "float16"]) == "float32"
    assert join_dtypes(["float16", "float32"]) == "float32"
    assert join_dtypes(["float64", "bfloat16"]) == "float64"


# ------------------------------------------------------------------ the release schedule

def _run_schedule(n, all_gathers, rng, expected):
    """One rank's backward: the all-gathers every rank issues alike, with
    pre- and post-backwards of random groups at random places between them
    (where autograd ran them on this rank). Returns the released prefix
    before each all-gather and the order of releases."""
    s = ReleaseSchedule(n, expected)
    released, order = [], []

    def take(r):
        order.extend(r)

    for ag in all_gathers:
        for _ in range(rng.randrange(3)):
            kind, g = rng.choice(("pre", "post")), rng.randrange(n)
            take(s.at_pre_backward(g) if kind == "pre" else s.at_post_backward(g))
        take(s.before_all_gather(ag))
        released.append(s.released)
        s.after_all_gather(ag)
    for _ in range(rng.randrange(4)):
        take(s.at_post_backward(rng.randrange(n)))
    take(s.at_end())
    return released, order


@pytest.mark.parametrize("seed", range(40))
def test_the_prefix_released_before_each_all_gather_is_the_same_on_every_rank(seed):
    rng = random.Random(seed)
    n = rng.randrange(1, 12)
    all_gathers = [rng.randrange(n) for _ in range(rng.randrange(0, 2 * n))]
    expected = rng.choice([None, max(0, len(all_gathers) - rng.randrange(3)), len(all_gathers)])
    runs = [_run_schedule(n, all_gathers, random.Random(seed * 100 + r), expected)
            for r in range(4)]
    for released, order in runs:
        assert released == runs[0][0]
        assert order == list(range(n))  # every group once, in order


def test_a_sequential_backward_releases_each_group_right_after_its_post_backward():
    """Groups 0..4 in release order, FSDP2's one-ahead prefetch: the
    all-gather of group i+1 comes in the pre-backward of group i."""
    n = 5
    log = []
    s = ReleaseSchedule(n, expected=None)
    for i in range(n):
        if i == 0:
            s.before_all_gather(0)
            s.after_all_gather(0)
        log += [("turn", g) for g in s.at_pre_backward(i)]
        if i + 1 < n:
            log += [("turn", g) for g in s.before_all_gather(i + 1)]
            s.after_all_gather(i + 1)
        log.append(("post", i))
        log += [("turn", g) for g in s.at_post_backward(i)]
    log += [("turn", g) for g in s.at_end()]
    # Each group's turn comes with its post-backward (FSDP2 prefetched the
    # next unit first); the last one, with no all-gather after it, goes at
    # the end in the first step (its pre-backward's turns: nothing left).
    assert log == [("post", 0), ("turn", 0), ("post", 1), ("turn", 1), ("post", 2),
                   ("turn", 2), ("post", 3), ("turn", 3), ("post", 4), ("turn", 4)]


def test_in_the_tail_a_post_backward_releases_its_group_and_an_extra_all_gather_all():
    s = ReleaseSchedule(4, expected=1)
    assert list(s.at_post_backward(0)) == []  # not in the tail yet
    assert list(s.before_all_gather(0)) == []
    s.after_all_gather(0)
    assert list(s.at_post_backward(1)) == [0, 1]  # in the tail now
    assert list(s.before_all_gather(2)) == [2, 3]  # beyond what the last backward had


# ------------------------------------------------------------------ guard windows

def test_slots_encode_each_bit_in_one_of_two_slots():
    h = windows.hash64("x")
    s = windows.slots(h)
    assert len(s) == 2 * windows.GUARD_BITS
    for i in range(windows.GUARD_BITS):
        one, zero = s[2 * i], s[2 * i + 1]
        assert (one is not None) != (zero is not None)
        assert (one is not None) == bool((h >> i) & 1)


def test_windows_diverge_exactly_when_hashes_differ():
    def union(a, b):
        return [x is not None or y is not None for x, y in zip(windows.slots(a), windows.slots(b))]

    a, b = windows.hash64("a"), windows.hash64("b")
    assert not windows.diverged(union(a, a))
    assert windows.diverged(union(a, b))


def test_first_difference_and_the_shared_message():
    entries = {0: {"records": ["p0: x", "p1: y"]}, 1: {"records": ["p0: x", "p1: z"]},
               2: {"records": ["p0: x"]}}
    assert windows.first_difference(entries) == 1
    assert windows.first_difference(entries, prefix_only=True) is None
    msg = windows.describe(entries)
    assert "rank 0 issued p1: y" in msg and "rank 1 issued p1: z" in msg
    assert "rank 2 issued nothing more after p0: x" in msg


def test_a_final_window_that_others_go_past_is_where_they_diverged():
    """Stalled windows agree on every common position: a rank whose window is
    final (closed, waiting for its verdict) and shorter than another's went on
    without the other's collective; open windows may still grow (None)."""
    short, long = ["p0: x"], ["p0: x", "p1: y"]
    assert windows.past_final({0: {"records": short, "final": True},
                               1: {"records": long}}) == 1
    assert windows.past_final({0: {"records": short}, 1: {"records": long}}) is None
    assert windows.past_final({0: {"records": long, "final": True},
                               1: {"records": short}}) is None
    assert windows.past_final({0: {"records": long, "final": True},
                               1: {"records": long, "final": True}}) is None
    msg = windows.describe({0: {"records": short}, 1: {"records": long}},
                           windows.Wording("DeepSpeed ZeRO-3", "module", "install(...)"))
    assert msg.startswith("accord: the ranks' DeepSpeed ZeRO-3 collectives diverged: rank 0 "
                          "issued nothing more after p0: x; rank 1 issued p1: y. A module ran")
    assert msg.endswith("mark modules whose forward runs on some ranks only with install(...)")


def test_only_first_occurrence_forward_all_gathers_are_repairable():
    def e(records, unit, waiting=True, fag=True):
        return {"records": records, "unit": unit, "waiting": waiting, "forward_all_gather": fag}

    good = {0: e(["a", "ag b"], "b"), 1: e(["a", "ag c"], "c")}
    assert windows.repairable_units(good, 2) == ["b", "c"]
    assert windows.repairable_units({0: good[0]}, 2) is None  # a rank missing
    assert windows.repairable_units({0: good[0], 1: e(["a", "ag c"], "c", waiting=False)},
                                    2) is None
    assert windows.repairable_units({0: good[0], 1: e(["a", "ag c"], "c", fag=False)}, 2) is None
    assert windows.repairable_units({0: e(["x", "ag b"], "b"), 1: e(["y", "ag b"], "c")},
                                    2) is None  # differ before the last record
    # A pipeline schedule: one rank skipped unit b in microbatch 0 and is at
    # microbatch 1's start where the other all-gathers b.
    mb = "step 0 position 1: " + windows.microbatch_record(1)
    assert windows.repairable_units({0: e(["a", "ag b"], "b"), 1: e(["a", mb], None, fag=False)},
                                    2) == ["b"]
    assert windows.repairable_units({0: e(["a", mb], None, fag=False),
                                     1: e(["a", "step 0 position 1: end of step"], None,
                                           fag=False)}, 2) is None  # no rank at a unit
    assert windows.repairable_units({0: e(["a", "ag b"], "b"),
                                     1: e(["a", "step 0 position 1: end of step"], None,
                                           fag=False)}, 2) is None  # not a microbatch start
    # Several stages per rank: the other rank is at another stage's forward.
    other = "step 0 position 1: " + windows.other_stage_record(0, 3)
    assert windows.repairable_units({0: e(["a", "ag b"], "b"),
                                     1: e(["a", other], None, fag=False)}, 2) == ["b"]


# ------------------------------------------------------------------ release over fakes

@dataclasses.dataclass
class FakeDecision:
    included: list
    wire_dtype: str = "float32"


class FakeAgreement:
    """Answers each manifest with the decision `decide(group, step)`; records
    what was submitted and in which order handles were waited on."""

    rank, world_size = 0, 2

    def __init__(self, decide):
        self.decide = decide
        self.batches, self.waited, self.sync_keys = [], [], []

    def register(self, *a):
        pass

    def submit_async(self, group_id, step, dtypes):
        return (group_id, step, tuple(dtypes))

    def submit_batch(self, items, sync_key=0):
        self.batches.append([(g, s) for g, s, _ in items])
        self.sync_keys.append(sync_key)
        return [(g, s, tuple(d)) for g, s, d in items]

    def ready(self, handle):
        return True

    def wait(self, handle):
        self.waited.append(handle[:2])
        return self.decide(*handle)


class FakeTurn:
    def __init__(self, step, late):
        self.step, self.late, self.owed, self.applied = step, late, {}, L([1])


class FakeGroup:
    """Stands in for HookedGroup: records its turns and completion."""

    def __init__(self, gid, log):
        from accord.torch.turn import GroupStats

        self.group_id, self.log, self.step = gid, log, 0
        self.members = None
        self.group = type("G", (), {"reduce_grads": True, "fsdp_params": []})()
        self.stats, self.history = GroupStats(), History()
        self.turn, self.post_backwarded, self.unsent_grads = None, False, [None]
        self.passed_unready = False

    def take_turn(self, in_backward, queue=None):
        self.turn = FakeTurn(self.step, late=in_backward and not self.post_backwarded)
        self.step += 1
        self.log.append(("turn", self.group_id, in_backward, self.turn.late))
        if queue is None:
            self.issue(None, ())
        else:
            queue.append((self, None, ()))
        return self.turn

    def issue(self, send, args):
        self.log.append(("sent", self.group_id))

    def hold(self):
        self.post_backwarded = True

    def post_backward_ran(self):
        self.post_backwarded = True

    def turn_passed(self, in_backward):
        self.passed_unready = in_backward and not self.post_backwarded

    def closing(self):
        return self.unsent_grads, ["float32"], self.turn.late

    def layout_of(self, decision):
        return Layout.of(decision)

    def complete(self, completion, unsent):
        self.log.append(("complete", self.group_id, tuple(completion.trimmed),
                         tuple(completion.delta)))

    def settle(self, decision, layout, dtypes, late_somewhere):
        self.history.last = layout
        self.history.turn_at_end = late_somewhere

    def end_backward(self):
        self.turn, self.post_backwarded = None, False


class FakeInstallation:
    """What a Release reads of its installation and calls on it."""

    def __init__(self, agreement):
        self.groups = {}
        self.timing = NegotiationTiming()
        self.negotiation = Negotiation(agreement, "p", self.groups, self.timing)
        self.backward_all_gathers = None
        self.release_index = 0
        self.current = None

    def backward(self):
        if self.current is None:
            order = list(reversed(self.groups.values()))
            self.current = Release(self, order, self.backward_all_gathers)
        return self.current

    def released(self, all_gathers):
        self.timing.releases += 1
        self.backward_all_gathers = all_gathers
        index, self.release_index = self.release_index, self.release_index + 1
        return index


def make(decide, names=("a", "b", "c")):
    agreement = FakeAgreement(decide)
    inst = FakeInstallation(agreement)
    log = []
    for n in names:
        inst.groups[n] = FakeGroup(n, log)
    return inst, agreement, log


def _decide(late=()):
    def decide(group, step, dtypes):
        if group == "p/~late":
            return FakeDecision([g in late for g in ("a", "b", "c")])
        return FakeDecision([True])

    return decide


def test_turns_before_the_end_go_out_during_the_backward_the_rest_at_the_end():
    inst, agreement, log = make(_decide())
    g = inst.groups
    release = inst.backward()
    assert [h.group_id for h in release.order] == ["c", "b", "a"]  # install order reversed
    g["c"].post_backwarded = True
    release.before_all_gather(g["b"])
    release.after_all_gather(g["b"])  # pending: c
    release.pre_backward(g["b"])  # c's turn: its post-backward ran
    assert log == [("turn", "c", True, False), ("sent", "c")]
    release.finish()
    # One batch: every group's manifest, then the ~late item.
    assert agreement.batches == [[("c", 0), ("b", 0), ("a", 0), ("p/~late", 0)]]
    turns = [e[:3] for e in log if e[0] == "turn"]
    assert turns[1:] == [("turn", "b", False), ("turn", "a", False)]
    assert [e[1] for e in log if e[0] == "complete"] == ["c", "b", "a"]
    assert inst.timing.during == 1 and inst.timing.at_end == 2 and inst.timing.releases == 1


def test_turns_at_the_end_are_recorded_before_the_batch_and_sent_after_it_in_order():
    """The end's reduce-scatters hide the batch's round trip; what they
    change (FSDP2's unsharded gradients) is not in the batch."""
    inst, agreement, log = make(_decide())
    submit = agreement.submit_batch
    agreement.submit_batch = lambda items, **kw: (log.append(("batch",)), submit(items, **kw))[1]
    g = inst.groups
    release = inst.backward()
    g["c"].post_backwarded = True
    release.before_all_gather(g["b"])
    release.after_all_gather(g["b"])
    release.pre_backward(g["b"])  # c's turn, during the backward: sent at once
    release.finish()
    assert [e for e in log if e[0] != "complete"] == [
        ("turn", "c", True, False), ("sent", "c"),
        ("turn", "b", False, False), ("turn", "a", False, False),
        ("batch",), ("sent", "b"), ("sent", "a")]
    # Completions only after every reduce-scatter went out.
    assert log.index(("sent", "a")) < [e[0] for e in log].index("complete")


def test_turns_recorded_at_the_end_are_sent_even_when_the_batch_fails():
    """Every rank issues what it recorded: a rank whose submit failed still
    joins the reduce-scatters its peers are in, then raises."""
    inst, agreement, log = make(_decide())

    def fail(items, **kw):
        raise RuntimeError("sidecar gone")

    agreement.submit_batch = fail
    with pytest.raises(RuntimeError, match="sidecar gone"):
        inst.backward().finish()
    assert [e for e in log if e[0] == "sent"] == [("sent", "c"), ("sent", "b"), ("sent", "a")]


def test_the_release_batch_carries_the_installations_sync_key():
    from accord.torch.members import sync_key

    inst, agreement, _ = make(_decide())
    inst.backward().finish()
    assert agreement.sync_keys == [sync_key("p", ["a", "b", "c"], None)]
    # Under a pipeline schedule the stage index is part of it.
    inst.current = None
    inst.negotiation.at_stage(1)
    inst.backward().finish()
    assert agreement.sync_keys[1] == sync_key("p", ["a", "b", "c"], 1) != agreement.sync_keys[0]
    # Other batches (the `~wire` agreement at install) carry none.
    inst.negotiation.submit([("p/~wire", 0, [None])])
    assert agreement.sync_keys[2] == 0


def test_an_agreement_without_sync_keys_gets_the_release_batch_without_one():
    class OlderAgreement(FakeAgreement):
        def submit_batch(self, items):
            return super().submit_batch(items)

    inst = FakeInstallation(OlderAgreement(_decide()))
    inst.groups["a"] = FakeGroup("a", [])
    inst.backward().finish()
    assert inst.negotiation.agreement.sync_keys == [0]


def test_a_group_late_somewhere_is_completed_with_a_delta_of_every_included_parameter():
    inst, agreement, log = make(_decide(late=("c",)))
    release = inst.backward()
    release.before_all_gather(inst.groups["b"])
    release.after_all_gather(inst.groups["b"])  # pending: c
    release.before_all_gather(inst.groups["a"])  # through c: its post-backward did not run
    assert log[0] == ("turn", "c", True, True)
    release.finish()
    assert ("complete", "c", (), (0,)) in log
    assert ("complete", "b", (), ()) in log
    assert inst.timing.repairs == 1 and inst.timing.redone == 1


def test_a_group_late_somewhere_takes_its_turn_at_the_end_from_the_next_step():
    inst, agreement, log = make(_decide(late=("c",)))
    release = inst.backward()
    release.before_all_gather(inst.groups["b"])
    release.after_all_gather(inst.groups["b"])
    release.before_all_gather(inst.groups["a"])  # c late
    release.finish()
    release.end()
    inst.current = None
    assert inst.groups["c"].history.turn_at_end
    log.clear()
    release = inst.backward()
    release.before_all_gather(inst.groups["b"])
    release.after_all_gather(inst.groups["b"])
    release.before_all_gather(inst.groups["a"])  # c's place: skipped
    assert log == []
    release.finish()
    # c after every other group, at the end; no delta for it.
    assert [e[1] for e in log if e[0] == "turn"] == ["b", "a", "c"]
    assert ("complete", "c", (), ()) in log


def test_the_next_backward_knows_how_many_all_gathers_the_last_one_had():
    inst, agreement, log = make(_decide())
    release = inst.backward()
    for h in (inst.groups["c"], inst.groups["b"]):
        release.before_all_gather(h)
        release.after_all_gather(h)
    release.finish()
    release.end()
    inst.current = None
    assert inst.backward_all_gathers == 2
    assert inst.backward().schedule.expected == 2


def test_groups_without_gradient_sync_are_not_released():
    inst, agreement, log = make(_decide())
    inst.groups["b"].group.reduce_grads = False
    inst.backward().finish()
    assert agreement.batches == [[("c", 0), ("a", 0), ("p/~late", 0)]]


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))


# ------------------------------------------------------------------ the step watch

class RaceHandle:
    def __init__(self):
        self.done = False

    def ready(self):
        return self.done


class RaceAgreement:
    """The step's item is decided (with the coordinator's error) just as the
    watch's local wait times out: the race CI once lost."""

    COORDINATOR = ('DEADLINE_EXCEEDED: job j group "fsdp/~step" step 0: not every rank reported '
                   'within 3s; missing ranks 1: rank 1 (last step -1, node "n1")')

    def __init__(self):
        self.handle = RaceHandle()

    def submit_async(self, group_id, step, dtypes):
        return self.handle

    def wait(self, handle, timeout_s=None):
        if timeout_s == 0 or handle.done:
            raise RuntimeError(self.COORDINATOR)
        handle.done = True  # arrives as the local wait gives up
        raise accord._accord.make_error(
            "DEADLINE_EXCEEDED", "no decision for group \"fsdp/~step\" step 0 before the "
            "caller's deadline", local_timeout=True)


def test_the_step_watch_reports_the_decision_not_a_local_timeout_that_raced_it():
    import threading

    from accord.torch.watchdog import StepWatch

    said, done = [], threading.Event()
    watch = StepWatch(RaceAgreement(), "fsdp/~step", timeout_s=5.0, stall_s=0.05, grace_s=0.01,
                      on_failure=lambda m: (said.append(m), done.set()))
    try:
        watch.begin_step(0)
        assert done.wait(5.0), "the watch never reported"
    finally:
        watch.close()
    (message,) = said
    assert message.endswith(RaceAgreement.COORDINATOR), message
    assert "caller's deadline" not in message


def test_the_step_watch_ends_with_the_verdicts_words_alone_on_the_last_line():
    """Where this rank was blocked is its own (a line before); the last line
    is `AccordJobError: <the coordinator's words>`, as the rank that raises
    the verdict prints it (accord.torch.errors)."""
    import threading

    from accord.torch.watchdog import StepWatch

    said, done = [], threading.Event()
    watch = StepWatch(RaceAgreement(), "fsdp/~step", timeout_s=5.0, stall_s=0.05, grace_s=0.01,
                      on_failure=lambda m: (said.append(m), done.set()))
    try:
        watch.begin_step(0)
        watch.progress("all-gather of 'blocks.2'")
        assert done.wait(5.0), "the watch never reported"
        # The training thread reaching accord afterwards raises the same verdict.
        with pytest.raises(accord.torch.AccordJobError) as raised:
            watch.check()
    finally:
        watch.close()
    (message,) = said
    lines = message.splitlines()
    assert lines[-1] == f"AccordJobError: {RaceAgreement.COORDINATOR}", lines
    assert lines[:-1] == ["accord.torch: a rank stopped or died while this rank was blocked in "
                          "all-gather of 'blocks.2'"], lines
    assert str(raised.value) == RaceAgreement.COORDINATOR
    assert isinstance(raised.value, accord.torch.AccordPeerError)  # what the watch raised before
    assert isinstance(raised.value, accord.Error)


class DecidedAgreement:
    """A handle decided with an error (`decided`), or a wait that gave up here."""

    def __init__(self, decided: bool):
        self.decided = decided

    def ready(self, handle):
        return self.decided

    def wait(self, handle, timeout_s=None):
        if self.decided:
            raise accord.Error(RaceAgreement.COORDINATOR)
        raise accord._accord.make_error("DEADLINE_EXCEEDED", "no decision before the caller's "
                                        "deadline", local_timeout=True)


def test_a_decided_error_is_the_jobs_verdict_and_a_local_one_stays_as_it_came():
    from accord.torch.errors import waited

    with pytest.raises(accord.torch.AccordJobError) as verdict:
        waited(DecidedAgreement(True), object(), "accord.torch: learned in a release")
    assert str(verdict.value) == RaceAgreement.COORDINATOR
    assert getattr(verdict.value, "__notes__", None) == ["accord.torch: learned in a release"]
    with pytest.raises(accord.Error) as local:
        waited(DecidedAgreement(False), object(), "accord.torch: learned in a release")
    assert not isinstance(local.value, accord.torch.AccordJobError)
    assert "caller's deadline" in str(local.value)


class RegisteringClient:
    """register_group ends in `waits` local timeouts, then raises `last`
    (None: registered)."""

    def __init__(self, waits, last=None):
        self.waits, self.last, self.calls = waits, last, 0

    def register_group(self, group_id, params, **kwargs):
        self.calls += 1
        if self.calls <= self.waits:
            raise accord._accord.make_error("DEADLINE_EXCEEDED", "no registration result yet",
                                            local_timeout=True)
        if self.last is not None:
            raise self.last


def test_the_job_item_registers_again_after_a_local_timeout_and_keeps_a_verdict():
    """`~job`'s registration is asked again while the client's own wait ends
    (err.local_timeout), whatever the message says; the coordinator's
    DEADLINE_EXCEEDED ends it."""
    from accord.torch.jobwatch import JobItem

    registered = JobItem(types.SimpleNamespace(client=RegisteringClient(waits=2)))
    assert registered._registered.wait(10)
    assert registered._error is None and registered.agreement.client.calls == 3
    said = accord._accord.make_error("DEADLINE_EXCEEDED", 'job j group "~job": not every rank '
                                     "registered the group within 3s; missing ranks 1")
    refused = JobItem(types.SimpleNamespace(client=RegisteringClient(waits=1, last=said)))
    assert refused._registered.wait(10)
    assert refused._error is said and refused.agreement.client.calls == 2


def test_the_all_gather_and_its_copy_out_are_patched_and_restored():
    from accord.torch import fsdp2

    pg = fsdp2._import().pg_module
    before = (pg.foreach_all_gather, pg.foreach_all_gather_copy_out)

    def wrap(f):
        return lambda *a, **k: f(*a, **k)

    fsdp2.patch_all_gather(wrap, wrap)
    try:
        assert pg.foreach_all_gather is not before[0]
        assert pg.foreach_all_gather_copy_out is not before[1]
    finally:
        fsdp2.unpatch_all_gather()
    assert (pg.foreach_all_gather, pg.foreach_all_gather_copy_out) == before


def test_an_all_gather_that_fails_in_its_copy_out_is_explained():
    """FSDP2 waits for its asynchronous all-gathers in the copy-out: a peer's
    death shows there, and the installation's explain() (the job's verdict,
    if accord has one) replaces Gloo's error."""
    from accord.torch import all_gathers, fsdp2

    class Explained(Exception):
        pass

    class Inst:
        def explain(self, failure):
            raise Explained(str(failure))

    class Hooked:
        installation = Inst()

    class Group:
        fsdp_params = [types.SimpleNamespace()]

    fsdp2.route_all_gathers(Group, Hooked())

    def gloo_copy_out(result, params, group):
        raise RuntimeError("Connection closed by peer")

    with pytest.raises(Explained, match="Connection closed by peer"):
        all_gathers._route_copy_out(gloo_copy_out)(None, Group.fsdp_params, None)
    # Not accord's unit: Gloo's error as it came.
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        all_gathers._route_copy_out(gloo_copy_out)(None, [types.SimpleNamespace()], None)


class DecidedThenVerdictAgreement:
    """Step 0's item was decided before the failure (every rank had sent it);
    the next step's item gets the job's verdict: the peer is gone."""

    VERDICT = ('DEADLINE_EXCEEDED: job j group "fsdp/<root>": not every rank registered the '
               'group within 2s of its first registration (--deadline); missing ranks 0')

    def __init__(self):
        self.submitted = []

    def submit_async(self, group_id, step, dtypes):
        self.submitted.append((group_id, step))
        handle = RaceHandle()
        handle.done = True
        handle.step = step
        return handle

    def wait(self, handle, timeout_s=None):
        if handle.step >= 1:
            raise RuntimeError(self.VERDICT)
        return None


def test_a_failed_collective_after_the_steps_item_was_decided_asks_with_the_next_step():
    from accord.torch.watchdog import StepWatch

    agreement = DecidedThenVerdictAgreement()
    watch = StepWatch(agreement, "fsdp/~step", timeout_s=5.0, stall_s=60.0, grace_s=0.01,
                      on_failure=lambda m: None)
    try:
        watch.begin_step(0)
        watch.handed(0, agreement.submit_async("fsdp/~step", 0, ["float32"]))  # the release's
        gloo = RuntimeError("Connection closed by peer")
        with pytest.raises(accord.torch.AccordJobError) as raised:
            watch.explain(gloo)
        assert str(raised.value) == DecidedThenVerdictAgreement.VERDICT
        assert raised.value.__cause__ is gloo
        assert agreement.submitted == [("fsdp/~step", 0), ("fsdp/~step", 1)]
        # The training thread reaching accord again raises the same verdict.
        with pytest.raises(accord.torch.AccordJobError) as again:
            watch.check()
        assert str(again.value) == DecidedThenVerdictAgreement.VERDICT
    finally:
        watch.close()


def test_a_stall_after_the_release_is_named_by_the_next_releases_item():
    """The end's reduce-scatters go out after the release's batch: a peer
    that stops between its batch and them leaves this rank blocked with the
    step's item decided. The watch submits the next release's item, which
    the stopped peer never sends, and reports the coordinator's words."""
    import threading

    from accord.torch.watchdog import StepWatch

    agreement = DecidedThenVerdictAgreement()
    said, done = [], threading.Event()
    watch = StepWatch(agreement, "fsdp/~step", timeout_s=5.0, stall_s=0.05, grace_s=0.01,
                      on_failure=lambda m: (said.append(m), done.set()))
    try:
        watch.begin_step(0)
        watch.handed(0, agreement.submit_async("fsdp/~step", 0, ["float32"]))  # the release's
        watch.released(0)
        watch.progress("reduce-scatter of '<root>' (64 x float32)")  # then blocked in it
        assert done.wait(5.0), "the watch never reported"
    finally:
        watch.close()
    assert agreement.submitted == [("fsdp/~step", 0), ("fsdp/~step", 1)]
    (message,) = said
    assert message.endswith(DecidedThenVerdictAgreement.VERDICT), message
    assert "reduce-scatter of '<root>'" in message


def test_the_deprecated_overlap_names_still_choose_speculation_and_warn(monkeypatch):
    from accord.torch.options import speculate_flag as _speculate

    monkeypatch.delenv("ACCORD_TORCH_OVERLAP", raising=False)
    monkeypatch.delenv("ACCORD_TORCH_SPECULATE", raising=False)
    assert _speculate(None, None) is True
    assert _speculate(False, None) is False
    with pytest.warns(DeprecationWarning, match="overlap"):
        assert _speculate(None, False) is False
    monkeypatch.setenv("ACCORD_TORCH_OVERLAP", "0")
    with pytest.warns(DeprecationWarning, match="ACCORD_TORCH_OVERLAP"):
        assert _speculate(None, None) is False
