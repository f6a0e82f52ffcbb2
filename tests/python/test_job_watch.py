"""`~job`'s watch (accord.torch.jobitem, docs/MEMBERS.md 2.13 point 3) with
a fake agreement: which indices a rank submits, when, and what it does with
the coordinator's answer. The real-daemon behaviour is in test_faults.py
(`test_pipeline_dp1_*`)."""

import threading

import pytest

import accord.torch
from accord.torch.jobitem import JobItem

WORDS = ('DEADLINE_EXCEEDED: job j group "~job" step 2: not every rank reported within 5s '
         'of the step\'s first submission (--deadline); missing ranks 1: rank 1')


class Handle:
    def __init__(self, step, error):
        self.step, self.error = step, error

    def ready(self):
        return True


class FakeAgreement:
    """Registers at once (or refuses), decides every submission at once: ok,
    or with `error` from step `fail_from` on; `seen` fires once `want`
    indices were submitted."""

    def __init__(self, error=None, fail_from=0, refuse=None, want=1):
        self.client = self
        self.error, self.fail_from, self.refuse = error, fail_from, refuse
        self.submitted = []
        self.want, self.seen = want, threading.Event()
        self._mu = threading.Lock()

    def register_group(self, group_id, params, **kwargs):
        if self.refuse is not None:
            raise RuntimeError(self.refuse)

    def submit_async(self, group_id, step, dtypes):
        with self._mu:
            assert group_id == "~job" and list(dtypes) == ["float32"]
            self.submitted.append(step)
            if len(self.submitted) >= self.want:
                self.seen.set()
        failed = self.error is not None and step >= self.fail_from
        return Handle(step, RuntimeError(self.error) if failed else None)

    def wait(self, handle, timeout_s=None):
        if handle.error is not None:
            raise handle.error
        return "ok"

    def ready(self, handle):
        return True

    def wait_verdict(self, timeout_s):
        return None


def _item(agreement, stall_s, said=None):
    done = threading.Event()

    def on_failure(message):
        (said if said is not None else []).append(message)
        done.set()

    return JobItem(agreement, each_step=True, stall_s=stall_s, grace_s=0.01,
                   on_failure=on_failure), done


def test_each_step_mode_submits_every_ended_step_in_order_without_a_stall():
    agreement = FakeAgreement(want=3)
    item, _ = _item(agreement, stall_s=60.0)
    try:
        for _ in range(3):
            item.enter()
            item.progress()
            item.leave()
        assert agreement.seen.wait(10.0), agreement.submitted
    finally:
        item.stop_for_exit()
    assert agreement.submitted == [0, 1, 2]
    assert item.early == 0


def test_a_stalled_rank_submits_its_open_step_then_chains_while_the_stall_lasts():
    """Each index decided ok while this rank stays stalled: the next one goes
    (every live rank submits every index); once the step ends, the indices
    already sent are not sent again."""
    agreement = FakeAgreement(want=3)
    item, _ = _item(agreement, stall_s=0.02)
    try:
        item.enter()  # step 0 opens; no progress from here
        assert agreement.seen.wait(10.0), agreement.submitted
        item.leave()
        n = len(agreement.submitted) + 3  # past the indices the stall sent (at most one more)
        with agreement._mu:
            agreement.want = n + 1  # then steps 0..n have ended
            agreement.seen.clear()
        for _ in range(n):
            item.enter()
            item.progress()
            item.leave()
        assert agreement.seen.wait(10.0), agreement.submitted
    finally:
        item.stop_for_exit()
    got = agreement.submitted
    assert got[:3] == [0, 1, 2] and got == list(range(len(got))) and len(got) >= n + 1, got
    assert item.early >= 3, item.early


def test_a_stalled_rank_whose_index_fails_ends_with_the_coordinators_words():
    said = []
    agreement = FakeAgreement(error=WORDS, fail_from=2)
    item, done = _item(agreement, stall_s=0.02, said=said)
    try:
        for _ in range(2):  # steps 0 and 1 end: their indices are decided ok
            item.enter()
            item.progress()
            item.leave()
        item.enter()  # stalled in step 2: its index names rank 1
        assert done.wait(10.0), agreement.submitted
        with pytest.raises(accord.torch.AccordJobError) as raised:
            item.progress()  # the training thread reaching accord raises the same verdict
    finally:
        item.stop_for_exit()
    (message,) = said
    assert message.splitlines()[-1] == f"AccordJobError: {WORDS}", message
    assert str(raised.value) == WORDS


def test_ranks_that_disagree_on_the_mode_get_the_registration_error_at_the_next_step():
    agreement = FakeAgreement(refuse='registration mismatch for group "~job"')
    item, _ = _item(agreement, stall_s=60.0)
    item._thread.join(10.0)  # the watch ends at the refused registration
    with pytest.raises(RuntimeError, match="registration mismatch"):
        item.enter()
    assert agreement.submitted == []


def test_alive_mode_submits_nothing_at_a_steps_end():
    agreement = FakeAgreement()
    item = JobItem(agreement, each_step=False, stall_s=0.02)
    for _ in range(3):
        item.enter()
        item.leave()
    item.stop_for_exit()  # joins its thread, which only registered
    assert agreement.submitted == []


# ------------------------------------------------- outside a pipeline schedule
# A one-rank member set outside a schedule (TP or EP with DP 1): the
# installation's root forward begins a step (begin_step) and the backward
# that ends FSDP2's step ends it (end_step).

def test_root_module_steps_outside_a_schedule_submit_every_ended_step_in_order():
    """Gradient accumulation: several forwards (and backwards that do not end
    FSDP2's step) before the one that does make one step; an end with no
    step open (the installation's end after a backward) counts nothing."""
    agreement = FakeAgreement(want=3)
    item, _ = _item(agreement, stall_s=60.0)
    try:
        for _ in range(3):
            for _micro in range(3):
                item.begin_step()
                item.progress()
            item.end_step()
            item.end_step()
        assert agreement.seen.wait(10.0), agreement.submitted
    finally:
        item.stop_for_exit()
    assert agreement.submitted == [0, 1, 2]
    assert item.steps.ended == 3 and item.early == 0


def test_a_rank_stalled_inside_a_root_module_step_submits_it_early():
    agreement = FakeAgreement(want=2)
    item, _ = _item(agreement, stall_s=0.02)
    try:
        item.begin_step()
        item.end_step()  # step 0 ends: its index is due
        item.begin_step()  # step 1 opens; no progress from here (a peer stopped)
        assert agreement.seen.wait(10.0), agreement.submitted
    finally:
        item.stop_for_exit()
    assert agreement.submitted[:2] == [0, 1], agreement.submitted
    assert item.early >= 1


def test_root_module_brackets_count_nothing_once_a_schedule_drove_a_step():
    """Under a schedule its step() brackets the step; the stage module's
    forwards and backward ends inside it (and outside it later) count
    nothing, so each schedule step is one index."""
    agreement = FakeAgreement(want=2)
    item, _ = _item(agreement, stall_s=60.0)
    try:
        for _ in range(2):
            item.enter()
            item.begin_step()
            item.end_step()
            item.begin_step()
            item.end_step()
            item.leave()
        item.begin_step()  # a stage module's forward outside the schedule
        item.end_step()
        assert agreement.seen.wait(10.0), agreement.submitted
    finally:
        item.stop_for_exit()
    assert agreement.submitted == [0, 1] and item.steps.ended == 2


def test_alive_mode_counts_no_root_module_steps():
    agreement = FakeAgreement()
    item = JobItem(agreement, each_step=False, stall_s=0.02)
    for _ in range(3):
        item.begin_step()
        item.end_step()
    item.stop_for_exit()
    assert agreement.submitted == [] and item.steps.ended == 0


def test_a_process_ending_with_a_peers_reset_connection_inside_a_step_asks_the_job():
    """Gloo raised a killed TP peer's reset connection on the training
    thread (a collective accord does not wrap): at exit the open step's
    index is submitted, which the rank that left misses; the process ends
    with the coordinator's words."""
    said = []
    agreement = FakeAgreement(error=WORDS, fail_from=1)
    item, _ = _item(agreement, stall_s=60.0, said=said)
    item.begin_step()
    item.end_step()
    item.begin_step()  # step 1
    try:
        raise RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:4242")
    except RuntimeError:
        item.stop_for_exit()  # the exit functions of a script whose exception nobody caught
    (message,) = said
    assert message.splitlines()[-1] == f"AccordJobError: {WORDS}", message
    assert agreement.submitted == [0, 1], agreement.submitted


@pytest.mark.parametrize("open_step,error", [(False, "Connection closed by peer"),
                                             (True, "shape mismatch"), (True, "verdict")])
def test_a_process_ending_otherwise_asks_nothing_at_exit(open_step, error):
    """No step open, another error, or the job's verdict already raised
    (its cause the reset connection)."""
    said = []
    agreement = FakeAgreement(error=WORDS)
    item, _ = _item(agreement, stall_s=60.0, said=said)
    if open_step:
        item.begin_step()
    try:
        if error == "verdict":
            try:
                raise RuntimeError("Connection reset by peer")
            except RuntimeError as gloo:
                raise accord.torch.AccordJobError(WORDS) from gloo
        raise RuntimeError(error)
    except RuntimeError:
        item.stop_for_exit()
    assert said == [] and agreement.submitted == []
