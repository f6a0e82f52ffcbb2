"""Before/after: the control-plane benchmarks of two build trees, paired per round.

    python3 bench/pair/pair_trees.py --old OLD_BUILD --new NEW_BUILD [--rounds 10]
        [--benches negotiation,coordinator,embedded] [--scale K] [--pin CORE]

OLD_BUILD and NEW_BUILD are build folders (RelWithDebInfo or Release, the
same for both, configured with -DACCORD_BUILD_PYTHON=ON) holding at least
accord_negotiation_bench, accord_coordinator_bench, the daemons and the
staged Python package (`ninja accord_python accord-coordinator accord-sidecar
accord-relay accord_negotiation_bench accord_coordinator_bench`). Each round
runs every benchmark once per tree, the order alternating between rounds, so
that a change of load hits both trees alike:

- negotiation: `accord_negotiation_bench --ranks=2` with the tree's own
  daemons: p50 of a cache hit and of a 200-group batch, local and
  coordinator path (the client, the sidecar and the coordinator);
- coordinator: `accord_coordinator_bench --nodes=2048`: the coordinator's
  CPU per step (none-repeat, per-manifest repeats, batch repeats), and with
  `--relays=16` one relay's fan-in CPU per step (128 sidecars of 8 ranks,
  full form, repeat form, batch repeat);
- embedded: one `torchrun --standalone` job of 2 ranks with the embedded
  default (bench/embedded/bench_embedded.py's rank: connect() starts the
  daemons, then 200 steady submit + wait), the tree's package on PYTHONPATH:
  connect() and the steady step's median (slowest rank).

Prints, per metric, each tree's median over the rounds and the paired
difference new/old - 1: mean and 95% t interval over rounds. Timings: run it
on a quiet machine and write the load down (printed before and after).
"""

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
EMBEDDED = os.path.join(HERE, "..", "embedded", "bench_embedded.py")
DAEMONS = {"accord-coordinator": "coordinator", "accord-sidecar": "sidecar",
           "accord-relay": "relay"}

# Two-sided 95% t quantiles by degrees of freedom (normal beyond 30).
_T95 = [12.71, 4.30, 3.18, 2.78, 2.57, 2.45, 2.36, 2.31, 2.26, 2.23, 2.20, 2.18, 2.16, 2.14,
        2.13, 2.12, 2.11, 2.10, 2.09, 2.09, 2.08, 2.07, 2.07, 2.06, 2.06, 2.06, 2.05, 2.05,
        2.05, 2.04]


def t95(df: int) -> float:
    return _T95[df - 1] if df <= len(_T95) else 1.96


SCALE = 1  # --scale: iterations and steps per run, times this
PIN = None  # --pin: the core the single-threaded coordinator bench runs on


def run(cmd, env=None, timeout=600, core=None) -> str:
    pin = None if core is None else (lambda: os.sched_setaffinity(0, {core}))
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout,
                       preexec_fn=pin)
    if p.returncode != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p.stdout


def bin_dir(build: str) -> str:
    """A folder with the tree's three daemons, as --bin_dir wants them."""
    d = tempfile.mkdtemp(prefix="pair-bin-")
    for name, sub in DAEMONS.items():
        os.symlink(os.path.join(os.path.abspath(build), "daemon", sub, name),
                   os.path.join(d, name))
    return d


def negotiation(build: str, bins: str) -> dict:
    out = run([os.path.join(build, "bench/negotiation/accord_negotiation_bench"), "--ranks=2",
               f"--iterations={300 * SCALE}", f"--bin_dir={bins}", "--gloo=false"])
    got = {}
    for path in ("local", "coordinator"):
        hit = re.search(rf"cache hit, {path}\s+([\d.]+)", out)
        batch = re.search(rf"batch of 200 groups x 10 params \(hit\), {path}\s+([\d.]+)", out)
        got[f"negotiation {path}: cache-hit p50 us"] = float(hit.group(1))
        got[f"negotiation {path}: 200-group batch p50 us"] = float(batch.group(1))
    return got


def coordinator(build: str) -> dict:
    exe = os.path.join(build, "bench/coordinator/accord_coordinator_bench")
    out = run([exe, "--nodes=2048", "--modes=full,repeat,batch", "--repeat_waves=on",
               f"--steps={5 * SCALE}"], core=PIN)
    got = {}
    for mode in ("none-repeat", "all-repeat", "batch-repeat"):
        m = re.search(rf"^{mode}\s+CPU/step\s+([\d.]+) ms", out, re.M)
        got[f"coordinator (2,048 nodes): {mode} CPU ms/step"] = float(m.group(1))
    out = run([exe, "--nodes=2048", "--relays=16", "--modes=batch", "--repeat_waves=on",
               f"--steps={5 * SCALE}"], core=PIN)
    for mode in ("full form", "repeat form", "batch repeat"):
        m = re.search(rf"relay fan-in \d+ x \d+ ranks, {mode}\s+CPU/step\s+([\d.]+) ms", out)
        got[f"relay fan-in (128 sidecars): {mode} CPU ms/step"] = float(m.group(1))
    return got


def embedded(build: str) -> dict:
    out = tempfile.mkdtemp(prefix="pair-emb-")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCORD_")}
    env.update(OMP_NUM_THREADS="1",
               PYTHONPATH=os.path.join(os.path.abspath(build), "python", "pkg"))
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         EMBEDDED, "--rank-main", out, "--steps", str(200 * SCALE)], env=env, timeout=300)
    ranks = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(2)]
    return {"embedded: connect() ms": 1e3 * max(r["connect_s"] for r in ranks),
            "embedded: steady step us": 1e6 * max(r["step_median_s"] for r in ranks)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", required=True, help="the baseline's build folder")
    ap.add_argument("--new", required=True, help="the candidate's build folder")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--benches", default="negotiation,coordinator,embedded")
    ap.add_argument("--scale", type=int, default=1,
                    help="iterations and steps per run, times this (less noise per round)")
    ap.add_argument("--pin", type=int, default=None,
                    help="run the (single-threaded) coordinator bench on this core")
    args = ap.parse_args()
    global SCALE, PIN
    SCALE, PIN = args.scale, args.pin
    benches = args.benches.split(",")
    bins = {"old": bin_dir(args.old), "new": bin_dir(args.new)}
    builds = {"old": args.old, "new": args.new}
    results = {"old": [], "new": []}
    print(f"load average before: {os.getloadavg()}", flush=True)
    for r in range(args.rounds):
        for tree in (("old", "new") if r % 2 == 0 else ("new", "old")):
            got = {}
            if "negotiation" in benches:
                got.update(negotiation(builds[tree], bins[tree]))
            if "coordinator" in benches:
                got.update(coordinator(builds[tree]))
            if "embedded" in benches:
                got.update(embedded(builds[tree]))
            results[tree].append(got)
        print(f"round {r + 1}/{args.rounds} done, load {os.getloadavg()[0]:.2f}", flush=True)
    print(f"load average after: {os.getloadavg()}")
    report(results)


def report(results: dict) -> None:
    print(f"{'metric':<58} {'old median':>11} {'new median':>11}  new/old - 1, mean [95% CI]")
    for key in results["old"][0]:
        old = [r[key] for r in results["old"]]
        new = [r[key] for r in results["new"]]
        d = [n / o - 1 for n, o in zip(new, old) if o > 0]
        mean = statistics.fmean(d)
        half = t95(len(d) - 1) * statistics.stdev(d) / math.sqrt(len(d)) if len(d) > 1 else 0
        print(f"{key:<58} {statistics.median(old):>11.2f} {statistics.median(new):>11.2f}  "
              f"{100 * mean:+6.2f}% [{100 * (mean - half):+.2f}, {100 * (mean + half):+.2f}]")


if __name__ == "__main__":
    main()
