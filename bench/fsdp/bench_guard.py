"""Training-thread CPU of the collective-sequence guard's per-collective
bookkeeping (accord.torch.guard.SequenceGuard.note), in its steady state
(every transition already agreed, so no collective waits), against the
previous design's bookkeeping (two formatted strings and a BLAKE2 hash per
collective) measured in the same run, alternating rounds.

    PYTHONPATH=build/python/pkg python3 bench/fsdp/bench_guard.py --collectives 100

Prints microseconds per collective and milliseconds per step for each, and
what a step of `--collectives` collectives costs against `--step-ms` (a
plain FSDP2 step of the job the guard is measured on, bench/RESULTS.md).
"""
import argparse
import statistics
import threading
import time

from accord.torch.guard import SequenceGuard
from accord.torch.windows import Window, hash64


class PreviousBookkeeping:
    """The previous design's per-collective path, for the baseline."""

    def __init__(self):
        self.step, self.position, self.prefix = 1, 0, 0
        self.known = set()
        self.records, self.hashed = [], []
        self.mu = threading.Lock()

    def note(self, entry):
        transition = (self.prefix, entry)
        new = transition not in self.known
        with self.mu:
            self.records.append(f"step {self.step} position {self.position}: {entry}")
            self.hashed.append(f"position {self.position}: {entry}")
            self.position += 1
            self.prefix = hash64(f"{self.prefix}|{entry}")
            time.monotonic()
        return transition, new

    def begin_step(self):
        self.position, self.prefix = 0, 0
        self.records, self.hashed = [], []


def entries(n):
    return [f"{'all_gather' if i % 2 else 'reduce_scatter'} layers.{i // 2} float32 x{i}"
            for i in range(n)]


class Unsent:
    """Takes the first step's windows (submitted only then) and sends nothing."""

    def submit(self, group, step, manifest):
        return None


def run_current(es, steps):
    g = SequenceGuard(Unsent(), 0, 2, "guard", timeout_s=30)
    for e in es:  # the first step: every transition is new (no verdict waited for here)
        t, _ = g.note(e)
        g.known.add(t)
    t0 = time.thread_time()
    for _ in range(steps):
        g.step += 1
        g.position, g.prefix = 0, 0
        g._open = Window(0)
        for e in es:
            g.note(e)
        g._open.digest()  # once per step: the release's window manifest
    return (time.thread_time() - t0) / steps


def run_previous(es, steps):
    b = PreviousBookkeeping()
    for e in es:
        t, _ = b.note(e)
        b.known.add(t)
    t0 = time.thread_time()
    for _ in range(steps):
        b.begin_step()
        for e in es:
            b.note(e)
        hash64("\n".join(b.hashed))
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
    for name, xs in (("previous (text + BLAKE2 per collective)", prev),
                     ("now (tuple per collective, text per window)", cur)):
        per_step = statistics.median(xs)
        print(f"{name}: {per_step / a.collectives * 1e6:.2f} us/collective, "
              f"{per_step * 1e3:.3f} ms/step of {a.collectives} collectives = "
              f"{per_step * 1e3 / a.step_ms * 100:.3f}% of a {a.step_ms:g} ms step "
              f"(median of {a.rounds} rounds x {a.steps} steps)")


if __name__ == "__main__":
    main()
