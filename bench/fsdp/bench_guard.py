"""Training-thread CPU of the collective-sequence guard's per-step work on
the training thread (accord.torch.guard.SequenceGuard: begin_step, record per
collective, release_item), in its steady state (the step repeats the last
agreed one, so no collective waits), against the previous design measured in
the same run, alternating rounds: a lock, a transition hash and a clock read
per collective, and the window's text and BLAKE2 digest at every release.

    PYTHONPATH=build/python/pkg python3 bench/fsdp/bench_guard.py --collectives 100

Prints microseconds per collective and milliseconds per step for each, and
what a step of `--collectives` collectives costs against `--step-ms` (a
plain FSDP2 step of the job the guard is measured on, bench/RESULTS.md).
"""
import argparse
import statistics
import threading
import time

from accord.torch.guard import END, SequenceGuard
from accord.torch.windows import hash64, slots


class PreviousBookkeeping:
    """The previous design's training-thread path, for the baseline."""

    def __init__(self):
        self.step, self.position, self.prefix = 1, 0, 0
        self.known = set()
        self.entries = []
        self.mu = threading.Lock()
        self.last = 0.0

    def note(self, entry):
        transition = (self.prefix, entry)
        new = transition not in self.known
        with self.mu:
            self.entries.append((self.step, self.position, entry))
            self.position += 1
            self.prefix = hash(transition)
            self.last = time.monotonic()
        return transition, new

    def begin_step(self):
        self.step += 1
        self.position, self.prefix = 0, 0

    def release(self):
        with self.mu:
            done, self.entries = self.entries, []
        return slots(hash64("\n".join(f"position {p}: {e}" for _, p, e in done)))


def entries(n):
    return [f"{'all_gather' if i % 2 else 'reduce_scatter'} layers.{i // 2} float32 x{i}"
            for i in range(n)]


def run_current(es, steps):
    g = SequenceGuard(None, 0, 2, "guard", timeout_s=30)
    # As after a first step whose transitions every rank agreed on.
    path = es + [END]
    prefix = [0]
    for e in path:
        prefix.append(hash((prefix[-1], e)))
    g.sequence._paths = [(path, prefix)]
    t0 = time.thread_time()
    for i in range(steps):
        g.begin_step()
        for e in es:
            g.record(e)
        g.release_item(i)
    assert g.blocking_waits == 0 and not g._inflight, "the steady state must not wait"
    return (time.thread_time() - t0) / steps


def run_previous(es, steps):
    b = PreviousBookkeeping()
    for e in es + [END]:
        t, _ = b.note(e)
        b.known.add(t)
    t0 = time.thread_time()
    for _ in range(steps):
        if b.position:
            b.note(END)
        b.begin_step()
        for e in es:
            b.note(e)
        b.release()
    return (time.thread_time() - t0) / steps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--collectives", type=int, default=100, help="per step")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--step-ms", type=float, default=224.0,
                    help="a plain FSDP2 step, for the share (bench/RESULTS.md)")
    a = ap.parse_args()
    es = entries(a.collectives)
    cur, prev = [], []
    for _ in range(a.rounds):
        cur.append(run_current(es, a.steps))
        prev.append(run_previous(es, a.steps))
    for name, xs in (("previous (lock, hash and clock per collective; digest per release)",
                      prev),
                     ("now (one comparison and one append per collective)", cur)):
        per_step = statistics.median(xs)
        print(f"{name}: {per_step / a.collectives * 1e6:.2f} us/collective, "
              f"{per_step * 1e3:.3f} ms/step of {a.collectives} collectives = "
              f"{per_step * 1e3 / a.step_ms * 100:.3f}% of a {a.step_ms:g} ms step "
              f"(median of {a.rounds} rounds x {a.steps} steps)")


if __name__ == "__main__":
    main()
