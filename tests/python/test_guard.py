"""The collective-sequence guard (accord.torch.guard.SequenceGuard) with
several ranks in one process, over a fake coordinator that answers each
window's manifest with the union of the ranks' slots once every rank has
submitted it, as the real one does (docs/PARTICIPATION.md, "The
collective-sequence guard"). Each rank's training thread is a thread here;
the guard's own threads are real. Seconds, no sockets: the same guard over
real daemons and FSDP2 is in test_fsdp.py."""

import random
import threading
import time

import pytest

from accord.torch.errors import AccordDivergenceError
from accord.torch.guard import END, SequenceGuard
from accord.torch.sequence import StepSequence
from accord.torch.windows import Window


class FakeService:
    """The coordinator and key-value store the guards of one job share."""

    def __init__(self, world_size):
        self.world_size = world_size
        self.cv = threading.Condition()
        self.manifests = {}  # (group, step) -> {rank: manifest}
        self.kv = {}

    def decision(self, key):
        got = self.manifests.get(key, {})
        if len(got) < self.world_size:
            return None
        return Decision([any(m[i] is not None for m in got.values())
                         for i in range(len(next(iter(got.values()))))])


class Decision:
    def __init__(self, included):
        self.included = included


class Handle:
    def __init__(self, service, key):
        self.service, self.key = service, key

    def ready(self):
        with self.service.cv:
            return self.service.decision(self.key) is not None


class RankClient:
    """What the guard uses of accord.Client, for one rank."""

    def __init__(self, service, rank):
        self.service, self.rank = service, rank

    def register_group(self, *args, **kwargs):
        pass

    def submit(self, group, step, manifest):
        with self.service.cv:
            self.service.manifests.setdefault((group, step), {})[self.rank] = list(manifest)
            self.service.cv.notify_all()
        return Handle(self.service, (group, step))

    def wait(self, handle, timeout_s=300.0):
        with self.service.cv:
            if not self.service.cv.wait_for(lambda: self.service.decision(handle.key),
                                            timeout=timeout_s):
                raise TimeoutError(f"no decision for {handle.key}")
            return self.service.decision(handle.key)

    def kv_set(self, key, value):
        with self.service.cv:
            self.service.kv[key] = bytes(value)
            self.service.cv.notify_all()

    def kv_get(self, keys, timeout_s=10.0, expected=None):
        with self.service.cv:
            if not self.service.cv.wait_for(lambda: all(k in self.service.kv for k in keys),
                                            timeout=timeout_s):
                raise TimeoutError(f"keys missing: {keys}")
            return [self.service.kv[k] for k in keys]


class Rank:
    """One rank's training thread driving its guard: per step, begin_step,
    a record per collective, and the release (its window submitted, as the
    installation's batch does)."""

    def __init__(self, service, rank, **kwargs):
        self.client = RankClient(service, rank)
        self.aborted = []
        self.guard = SequenceGuard(self.client, rank, service.world_size, "job/guard",
                                   timeout_s=10.0, on_divergence=self.aborted.append,
                                   **kwargs)
        self.waits_per_step = []
        self.off_path_after_step = []  # records looked up in the transition set, so far
        self.error = None

    def step(self, index, sequence):
        before = self.guard.blocking_waits
        self.guard.begin_step()
        for entry in sequence:  # an entry, or (entry, unit) for a forward all-gather
            if isinstance(entry, str):
                self.guard.record(entry)
            else:
                self.guard.record(*entry)
        item, window = self.guard.release_item(index)
        self.guard.release_handle(window, self.client.submit(*item))
        self.waits_per_step.append(self.guard.blocking_waits - before)
        self.off_path_after_step.append(self.guard.sequence.off_path)

    def run(self, steps, pause_s=0.0):
        try:
            for i, sequence in enumerate(steps):
                self.step(i, sequence)
                time.sleep(pause_s)
        except AccordDivergenceError as e:
            self.error = str(e)


def run_ranks(ranks, steps_of, pause_s=0.0):
    threads = [threading.Thread(target=r.run, args=(steps_of(i), pause_s))
               for i, r in enumerate(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a rank hung"


def new_transitions_per_step(steps):
    """The guard's reference rule, on whole prefixes: a record waits exactly
    when no earlier step agreed on it after the same prefix. A step's chunk
    is the previous step's end, then its own collectives."""
    known, out = set(), []
    previous = None
    for sequence in steps:
        waits = 0
        if previous is not None:
            transition = (tuple(previous), END)
            waits += transition not in known
            known.add(transition)
        for p, entry in enumerate(sequence):
            transition = (tuple(sequence[:p]), entry)
            waits += transition not in known
            known.add(transition)
        out.append(waits)
        previous = sequence
    return out


POOL = ["all-gather of 'a' (8 x float32)", "all-gather of 'b' (8 x float32)",
        "all-gather of 'c' (4 x float32)", "reduce-scatter of 'a' (8 x float32)",
        "reduce-scatter of 'b' (8 x float32)"]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("world", [2, 3])
def test_ranks_that_agree_wait_exactly_at_new_transitions(seed, world):
    """Random steps drawn from a few patterns (repeats, a prefix of another,
    one longer, a return to an older one), the same on every rank: no error,
    and each rank waits for a verdict exactly where the reference rule says a
    transition is new; a repeated step never waits."""
    rng = random.Random(seed)
    patterns = [[rng.choice(POOL) for _ in range(rng.randint(1, 6))] for _ in range(3)]
    patterns.append(patterns[0][: max(1, len(patterns[0]) - 1)])
    patterns.append(patterns[1] + [rng.choice(POOL)])
    steps = [rng.choice(patterns) for _ in range(16)]
    service = FakeService(world)
    ranks = [Rank(service, r) for r in range(world)]
    run_ranks(ranks, lambda r: steps)
    expected = new_transitions_per_step(steps)
    for r in ranks:
        assert r.error is None and not r.aborted
        assert r.waits_per_step == expected
        r.guard.close()
        assert r.guard.error is None
    assert 0 in expected[1:] and max(expected) > 0  # both the steady path and new ones ran


@pytest.mark.parametrize("schedule", ["AB", "AAB", "ABC", "AABBC"])
def test_steps_of_a_few_patterns_stay_on_agreed_paths(schedule):
    """Microbatch patterns that repeat in a cycle (gradient accumulation: the
    last microbatch also reduce-scatters) look up no record in the
    transition set once each pattern, and each change between them, was
    agreed; the waits still follow the transition rule."""
    ag = [f"all-gather of 'l{i}' (8 x float32)" for i in range(3)]
    rs = [f"reduce-scatter of 'l{i}' (8 x float32)" for i in range(3)]
    patterns = {"A": ag + ag[::-1], "B": ag + [x for pair in zip(ag[::-1], rs[::-1])
                                                for x in pair],
                "C": ag[:2] + ag[:2][::-1]}
    steps = [patterns[k] for k in schedule * 8]
    service = FakeService(2)
    ranks = [Rank(service, r) for r in range(2)]
    run_ranks(ranks, lambda r: steps)
    for r in ranks:
        assert r.error is None and r.waits_per_step == new_transitions_per_step(steps)
        settled = r.off_path_after_step[-len(schedule) * 2:]
        assert settled[0] == settled[-1], r.off_path_after_step  # no lookups in the last cycles
        r.guard.close()


def test_one_entry_object_per_collective_is_not_required():
    """Entries equal in text but built afresh each step (the reduce-scatter
    entries are) stay on the agreed path."""
    service = FakeService(2)
    ranks = [Rank(service, r) for r in range(2)]
    base = ["all-gather of 'a' (8 x float32)", "reduce-scatter of 'a' (8 x float32)"]

    def fresh(_):
        return [[("".join(list(e))) for e in base] for _ in range(6)]

    run_ranks(ranks, fresh)
    for r in ranks:
        assert r.waits_per_step == [2, 1, 0, 0, 0, 0]  # the first step's end is new once
        r.guard.close()


@pytest.mark.parametrize("split", [0, 1, 2])
def test_ranks_that_take_different_known_paths_end_with_one_message(split):
    """Every transition each rank takes was agreed before, so no rank waits:
    the release window's verdict finds it, and every rank ends with the same
    AccordDivergenceError naming both collectives."""
    a, b, c = POOL[0], POOL[1], POOL[2]
    common = [[a, b, c], [a, c, b], [a, b, c]]  # both paths and both ends agreed
    mine = {0: [a, b, c], 1: [a, c, b]}
    service = FakeService(2)
    ranks = [Rank(service, r) for r in range(2)]
    steps = lambda r: common + [common[0]] * split + [mine[r]] + [common[0]] * 4  # noqa: E731
    # Steps take a while, as real ones do: the ranks raise at their next
    # record once the verdict is worded.
    run_ranks(ranks, steps, pause_s=0.2)
    errors = [r.error for r in ranks]
    assert errors[0] is not None and errors[0] == errors[1], errors
    assert f"position 1: {b}" in errors[0] and f"position 1: {c}" in errors[0]
    for r in ranks:
        assert r.waits_per_step[len(common) + split] == 0
        r.guard.close()


def test_a_rank_blocked_after_a_diverged_release_is_ended_by_its_guard():
    """After the diverged step no rank reaches another release or record (as
    when both are blocked inside mismatched collectives): the guards' threads
    find the verdict themselves and end each rank with the same message."""
    a, b, c = POOL[0], POOL[1], POOL[2]
    service = FakeService(2)
    ranks = [Rank(service, r, stall_s=0.4) for r in range(2)]
    for r in ranks:
        r.guard.abort_grace_s = 0.1
    common = [[a, b, c], [a, c, b], [a, b, c]]
    run_ranks(ranks, lambda r: common + [[a, b, c] if r == 0 else [a, c, b]])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not all(r.aborted for r in ranks):
        time.sleep(0.05)
    messages = [r.aborted[0] if r.aborted else None for r in ranks]
    assert messages[0] is not None and messages[0] == messages[1], messages
    assert "diverged" in messages[0]
    for r in ranks:
        assert r.error is None  # the training thread never got there
        r.guard.close()


def test_a_rank_that_went_on_to_its_release_without_the_others_collective_is_named():
    """After agreed steps, rank 1 is about to issue one collective more (new:
    it waits for the verdict) while rank 0 has closed its window at its
    release and waits for that verdict (as a DeepSpeed rank waits for its
    release's decision): neither window can be decided. The stalled windows
    agree at every common position, but rank 0's is final, so both guards
    name rank 1's collective instead of waiting for the timeout."""
    a, b, c = POOL[0], POOL[1], POOL[2]
    service = FakeService(2)
    ranks = [Rank(service, r, stall_s=0.4) for r in range(2)]
    for r in ranks:
        r.guard.abort_grace_s = 0.1
    run_ranks(ranks, lambda r: [[a, b]] * 3 + [[a, b] if r == 0 else [a, b, c]])
    assert ranks[1].error is not None, ranks[1].error  # raised while waiting at c
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not ranks[0].aborted:
        time.sleep(0.05)
    assert ranks[0].aborted == [ranks[1].error], ranks[0].aborted
    assert "rank 0 issued nothing more after step 4 position 1: " + b in ranks[1].error
    assert "rank 1 issued step 4 position 2: " + c in ranks[1].error
    for r in ranks:
        r.guard.close()


def test_a_steady_release_is_checked_off_by_the_training_thread():
    """In the steady state the guard's thread is not woken per step: the
    training thread checks off every earlier release whose verdict is in."""
    service = FakeService(1)
    rank = Rank(service, 0, stall_s=100.0)  # its thread looks only every 50 s
    seq = [POOL[0], POOL[3]]
    rank.run([seq] * 5)
    assert rank.error is None
    # Every release but the last had its verdict before the next release.
    pending = rank.guard.verdicts.pending()
    assert len(pending) <= 1
    rank.guard.close()
    assert rank.guard.error is None


class PinningLearner:
    """Learns every pair of units offered: each rank skips its all-gather."""

    def __init__(self):
        self.learned = []

    def can_learn(self, units):
        return units

    def learn(self, units, current):
        self.learned.append(tuple(units))
        return True


def test_a_repaired_transition_never_becomes_the_steady_path():
    """Ranks all-gather different units in every step and the learner
    repairs it each time: the repaired record was never agreed, so the next
    step looks it up again (and is repaired again) instead of taking it as
    steady and diverging unchecked."""
    service = FakeService(2)
    learners = [PinningLearner() for _ in range(2)]
    ranks = [Rank(service, r, learner=learners[r], in_forward=lambda group: True)
             for r in range(2)]
    unit = {0: "x", 1: "y"}
    run_ranks(ranks, lambda r: [[(f"all-gather of '{unit[r]}' (8 x float32)", unit[r])]] * 3)
    for r, learner in zip(ranks, learners):
        assert r.error is None and not r.aborted
        assert learner.learned == [("x", "y")] * 3
        r.guard.close()
        assert r.guard.error is None


def test_window_locates_records_across_a_step_boundary():
    w = Window(3, step=4, position=7)
    w.entries += ["x", END]
    w.begin(5)
    w.entries += ["y"]
    assert w.located() == [(4, 7, "x"), (4, 8, END), (5, 0, "y")]
    assert w.records[-1] == "step 5 position 0: y"
    v = Window(9, step=8, position=7)
    v.entries += ["x", END]
    v.begin(9)
    v.entries += ["y"]
    assert v.shape() == w.shape() and v.digest() == w.digest()  # steps do not count
    u = Window(9, step=8, position=6)
    u.entries += ["x", END]
    u.begin(9)
    u.entries += ["y"]
    assert u.shape() != w.shape() and u.digest() != w.digest()  # positions do
    empty = Window(0, step=1, position=2)
    empty.begin(2)
    empty.entries.append("z")
    assert empty.located() == [(2, 0, "z")]


@pytest.mark.parametrize("seed", range(20))
def test_step_sequence_answers_as_the_transition_rule(seed):
    """accord.torch.sequence alone, over random steps of a few patterns with
    random repairs: a record is on a path only when its whole-prefix
    transition was agreed, and off the paths it is new exactly when not."""
    rng = random.Random(seed)
    patterns = [[rng.choice(POOL) for _ in range(rng.randint(1, 7))] for _ in range(5)]
    seq, known = StepSequence(), set()
    on_path = 0
    for _ in range(60):
        steps = rng.choice(patterns) + [END]
        for p, entry in enumerate(steps):
            transition = (tuple(steps[:p]), entry)
            if seq.follows(entry):
                on_path += 1
                assert transition in known
                continue
            local, new = seq.off_path_record(entry)
            assert new == (transition not in known)
            if new and rng.random() < 0.1:
                seq.unagreed()  # repaired: never agreed
            else:
                seq.agree(local)
                known.add(transition)
        seq.end_step()
    assert on_path > 0
