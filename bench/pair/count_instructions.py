"""Before/after in instructions: the coordinator and relay benches of two build trees under callgrind.

    python3 bench/pair/count_instructions.py --old OLD_BUILD --new NEW_BUILD [--nodes 256]
        [--fanin 128] [--steps 4] [--runs 2] [--benches coordinator,relay] [--keep DIR]

OLD_BUILD and NEW_BUILD are build folders (the same build type) holding
bench/coordinator/accord_coordinator_bench. Instruction counts do not depend
on the machine's load, so a 2-core machine shared with other work gives the
same figure as a quiet one (timings: bench/pair/pair_trees.py).

Only the code under test is counted (`--collect-atstart=no` and
`--toggle-collect`), one callgrind dump per step (`--dump-after`):

- coordinator: `Coordinator::HandleMessage`, with `--modes=repeat,batch,full
  --repeat_waves=on`; a dump after each `RunStep` (the join and the warm-up
  step fall in the first dump, which is left out). Per mode: the mean over its
  steps (full form alternates two usage variants, so keep --steps even).
- relay: `Relay::HandleMessage` and `Relay::HandleCoordinatorMessage` in
  `--relays=1` (one relay of --fanin sidecars); a dump after each
  `HandleCoordinatorMessage`, which ends a step. The first dump (hellos and
  welcome) and the first full step (it also holds the registrations) are
  left out.

Protobuf parsing of the same bytes is outside the count (the bench's parse
baseline). Prints instructions per step and per node manifest, each tree's
runs, and new/old - 1.
"""

import argparse
import glob
import hashlib
import os
import re
import shutil
import subprocess
import tempfile

MODES = {"coordinator": ("none-repeat", "all-repeat", "batch-repeat"),
         "relay": ("full form", "repeat form", "batch repeat")}
BENCH = "bench/coordinator/accord_coordinator_bench"


def callgrind(exe: str, args: list, toggles: list, dump_after: str, out: str) -> list:
    """Runs exe under callgrind into `out` (kept: a later call with the same binary and
    arguments reads it again); returns the instruction total of each dump, in order."""
    with open(exe, "rb") as f:
        tag = hashlib.sha1(f.read() + repr((args, toggles, dump_after)).encode()).hexdigest()
    out = f"{out}-{tag[:12]}"
    if not os.path.exists(os.path.join(out, "done")):
        shutil.rmtree(out, ignore_errors=True)  # an unfinished run
        os.makedirs(out)
        cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}/cg.out",
               "--collect-atstart=no", f"--dump-after={dump_after}"]
        cmd += [f"--toggle-collect={t}" for t in toggles]
        p = subprocess.run(cmd + [exe] + args, capture_output=True, text=True)
        if p.returncode != 0:
            raise SystemExit(f"failed: {' '.join(cmd + [exe] + args)}\n{p.stdout[-2000:]}\n"
                             f"{p.stderr[-2000:]}")
        open(os.path.join(out, "done"), "w").write(" ".join(cmd + [exe] + args) + "\n")
    dumps = sorted(glob.glob(f"{out}/cg.out.*"), key=lambda f: int(f.rsplit(".", 1)[1]))
    totals = []
    for f in dumps:
        with open(f) as fh:
            m = re.search(r"^totals:\s+(\d+)", fh.read(), re.M)
        totals.append(int(m.group(1)))
    return totals


def coordinator(build: str, a, out: str) -> dict:
    args = [f"--nodes={a.nodes}", "--modes=full,repeat,batch", "--repeat_waves=on",
            f"--steps={a.steps}"]
    # Dump 1: join + warm-up; then --steps dumps per mode, in --modes order.
    d = callgrind(os.path.join(build, BENCH), args,
                  ["accord::daemon::Coordinator::HandleMessage(*"], "*RunStep(*", out)
    s = a.steps
    assert len(d) == 1 + 3 * s, f"expected {1 + 3 * s} dumps, got {len(d)}"
    return {"none-repeat": d[1:1 + s], "all-repeat": d[1 + s:1 + 2 * s],
            "batch-repeat": d[1 + 2 * s:1 + 3 * s]}


def relay(build: str, a, out: str) -> dict:
    args = [f"--nodes={a.fanin}", "--relays=1", "--modes=batch", "--repeat_waves=on",
            f"--steps={a.steps}"]
    toggles = ["accord::daemon::Relay::HandleMessage(*",
               "accord::daemon::Relay::HandleCoordinatorMessage(*"]
    # Dump 1: hellos + welcome; then --steps dumps per mode (full, repeat, batch).
    # A pattern that differs from the toggle's: callgrind keeps one setting per pattern.
    d = callgrind(os.path.join(build, BENCH), args, toggles,
                  "*Relay::HandleCoordinatorMessage(accord::v1::CoordinatorMessage*)", out)
    s = a.steps
    assert len(d) == 1 + 3 * s, f"expected {1 + 3 * s} dumps, got {len(d)}"
    return {"full form": d[2:1 + s], "repeat form": d[1 + s:1 + 2 * s],
            "batch repeat": d[1 + 2 * s:1 + 3 * s]}


def mean(xs):
    return sum(xs) / len(xs)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", required=True, help="the baseline's build folder")
    ap.add_argument("--new", required=True, help="the candidate's build folder")
    ap.add_argument("--nodes", type=int, default=256, help="coordinator bench: sidecars")
    ap.add_argument("--fanin", type=int, default=128, help="relay bench: sidecars per relay")
    ap.add_argument("--steps", type=int, default=4, help="measured steps per mode (even)")
    ap.add_argument("--runs", type=int, default=2, help="runs per tree (they should be equal)")
    ap.add_argument("--benches", default="coordinator,relay")
    ap.add_argument("--keep", default=None,
                    help="keep the callgrind files under this folder, and reuse the runs of an "
                    "unchanged binary with the same arguments from it")
    a = ap.parse_args()
    root = a.keep or tempfile.mkdtemp(prefix="count-instr-")
    groups = 200  # the bench's default --groups
    entries = {"coordinator": a.nodes * groups, "relay": a.fanin * groups}
    print(f"{'bench / mode':<28} {'old instr/step':>15} {'new instr/step':>15} "
          f"{'old /entry':>10} {'new /entry':>10} {'new/old-1':>9}  runs' spread")
    for bench in a.benches.split(","):
        fn = {"coordinator": coordinator, "relay": relay}[bench]
        per = {}
        for tree, build in (("old", a.old), ("new", a.new)):
            per[tree] = [fn(build, a, os.path.join(root, f"{bench}-run{r}"))
                         for r in range(a.runs)]
        for mode in MODES[bench]:
            o = [mean(run[mode]) for run in per["old"]]
            n = [mean(run[mode]) for run in per["new"]]
            spread = max((max(x) - min(x)) / min(x) for x in (o, n))
            print(f"{bench + ' / ' + mode:<28} {o[0]:>15.0f} {n[0]:>15.0f} "
                  f"{o[0] / entries[bench]:>10.1f} {n[0] / entries[bench]:>10.1f} "
                  f"{100 * (n[0] / o[0] - 1):>+8.2f}%  {100 * spread:.3f}%", flush=True)
    if a.keep is None:
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
