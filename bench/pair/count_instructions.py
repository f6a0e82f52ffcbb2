"""Before/after in instructions: the coordinator, relay and sidecar hot paths of two build trees.

    python3 bench/pair/count_instructions.py --old OLD_BUILD --new NEW_BUILD [--nodes 256]
        [--fanin 128] [--steps 4] [--runs 2] [--iterations 50]
        [--benches coordinator,relay,negotiation,client] [--keep DIR]

OLD_BUILD and NEW_BUILD are build folders (the same build type) holding
bench/coordinator/accord_coordinator_bench (coordinator, relay) and, for
negotiation, bench/negotiation/accord_negotiation_bench and the coordinator
and sidecar daemons. Everything runs under valgrind's callgrind. Instruction
counts do not depend on the machine's load, so a 2-core machine shared with
other work gives the same figure as a quiet one (timings:
bench/pair/pair_trees.py). Only the code under test is counted
(`--collect-atstart=no` and `--toggle-collect`):

- coordinator: `Coordinator::HandleMessage`, `--modes=full,repeat,batch
  --repeat_waves=on`, one dump after each `RunStep` (`--dump-after`); the
  first (join and warm-up step) is left out. Per mode: the mean over its steps
  (full form alternates two usage variants, so keep --steps even).
- relay: `Relay::HandleMessage` and `Relay::HandleCoordinatorMessage` with
  `--relays=1` (one relay of --fanin sidecars), one dump after each
  `HandleCoordinatorMessage` (the end of a step); the first dump (hellos,
  welcome) and the first full step (it holds the registrations) are left out.
- negotiation: the sidecar's `HandleRankMessage` and
  `HandleCoordinatorMessage` in `accord_negotiation_bench --ranks=2`, per path
  (local decisions, coordinator); per iteration of its three cases (cache
  miss, cache hit, 200-group batch) as the difference of a run of
  2 x --iterations and one of --iterations. Not deterministic: the sidecar's
  threads interleave differently per run (lock slow paths, how upstream
  answers batch), a few percent between runs; use several --runs.

- client: the client's `Submit`, `SubmitBatch`, `Wait` and `HandleReply` in both
  rank processes of the same negotiation runs (the launcher and its ranks under
  callgrind with `--trace-children`, the daemons not), per iteration likewise:
  the native half of the embedded step (bench/embedded: a rank's submit and
  wait through the bindings). Waits block, and how often a lock spins before
  it does varies by run, as for the sidecar.

Coordinator and relay counts repeat to within 0.01%. Protobuf parsing of the
same bytes is outside the count (the bench's parse baseline). Prints
instructions per step (per iteration), per node x group (per group
submission), each tree's runs' mean, new/old - 1 and the largest spread
between one tree's runs.
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
         "relay": ("full form", "repeat form", "batch repeat"),
         "negotiation": ("local path", "coordinator path"),
         "client": ("local path", "coordinator path")}
# The sidecar's handlers of a rank's and of the upstream's messages (not nested).
SIDECAR_TOGGLES = ["accord::daemon::Sidecar::HandleRankMessage(*",
                   "accord::daemon::Sidecar::HandleCoordinatorMessage(accord::v1::"
                   "CoordinatorMessage*)"]
# The client's calls a rank makes per step (Submit, SubmitBatch, Wait) and its
# handling of the sidecar's replies, in both trees (GrpcClient was file-local in
# the older one: the leading wildcard takes its anonymous namespace).
CLIENT_TOGGLES = ["*GrpcClient::Submit(*", "*GrpcClient::SubmitBatch(*",
                  "*GrpcClient::Wait(*", "*GrpcClient::HandleReply(*"]
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


def negotiation_run(build: str, path: str, iters: int, out: str, who: str = "sidecar") -> int:
    """Instructions over one negotiation bench run (--ranks=2, one path): the sidecar's
    (`who` "sidecar"), or the client's in both rank processes together ("client")."""
    if os.path.exists(os.path.join(out, "done")):
        return int(open(os.path.join(out, "done")).read())
    shutil.rmtree(out, ignore_errors=True)
    bins = os.path.join(out, "bin")
    os.makedirs(bins)
    real = os.path.abspath(os.path.join(build, "daemon"))
    os.symlink(os.path.join(real, "coordinator", "accord-coordinator"),
               os.path.join(bins, "accord-coordinator"))
    exe = os.path.join(build, "bench/negotiation/accord_negotiation_bench")
    cmd = [exe]
    if who == "sidecar":
        wrapper = os.path.join(bins, "accord-sidecar")
        with open(wrapper, "w") as f:
            f.write("#!/bin/sh\nexec valgrind --tool=callgrind --collect-atstart=no "
                    f"--callgrind-out-file={out}/cg.%p " +
                    " ".join(f"'--toggle-collect={t}'" for t in SIDECAR_TOGGLES) +
                    f" {real}/sidecar/accord-sidecar \"$@\"\n")
        os.chmod(wrapper, 0o755)
    else:
        # The launcher and its rank processes (itself again) under callgrind, the daemons
        # not; only the client's calls are counted, and the launcher makes none.
        os.symlink(os.path.join(real, "sidecar", "accord-sidecar"),
                   os.path.join(bins, "accord-sidecar"))
        cmd = ["valgrind", "--tool=callgrind", "--collect-atstart=no", "--trace-children=yes",
               "--trace-children-skip=*accord-sidecar,*accord-coordinator,*/sh,*/rm",
               f"--callgrind-out-file={out}/cg.%p"]
        cmd += [f"--toggle-collect={t}" for t in CLIENT_TOGGLES] + [exe]
    p = subprocess.run(cmd + ["--ranks=2", f"--iterations={iters}", f"--bin_dir={bins}",
                              "--gloo=false", f"--paths={path}"], capture_output=True, text=True)
    files = glob.glob(f"{out}/cg.*")
    want = 1 if who == "sidecar" else 3  # the launcher and two ranks
    if p.returncode != 0 or len(files) != want:
        raise SystemExit(f"negotiation bench failed or {len(files)} callgrind files, not "
                         f"{want}: {p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    total = 0
    for name in files:
        with open(name) as fh:
            total += int(re.search(r"^totals:\s+(\d+)", fh.read(), re.M).group(1))
    open(os.path.join(out, "done"), "w").write(str(total))
    return total


def negotiation(build: str, a, out: str, who: str = "sidecar") -> dict:
    # Per iteration of the three cases (cache miss, cache hit, 200-group batch): the
    # difference of two runs' totals, so that start-up and registration cancel.
    binary = "bench/negotiation/accord_negotiation_bench" if who == "client" else \
        "daemon/sidecar/accord-sidecar"
    with open(os.path.join(build, binary), "rb") as f:
        out = f"{out}-{hashlib.sha1(f.read()).hexdigest()[:12]}"  # kept per binary
    got = {}
    for path in ("local", "coordinator"):
        lo = negotiation_run(build, path, a.iterations, f"{out}-{path}-{a.iterations}", who)
        hi = negotiation_run(build, path, 2 * a.iterations, f"{out}-{path}-{2 * a.iterations}",
                             who)
        got[f"{path} path"] = [(hi - lo) / a.iterations]
    return got


def client(build: str, a, out: str) -> dict:
    return negotiation(build, a, out, who="client")


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
    ap.add_argument("--iterations", type=int, default=50,
                    help="negotiation bench: iterations of the smaller run (the other: twice)")
    ap.add_argument("--benches", default="coordinator,relay")
    ap.add_argument("--keep", default=None,
                    help="keep the callgrind files under this folder, and reuse the runs of an "
                    "unchanged binary with the same arguments from it")
    a = ap.parse_args()
    root = a.keep or tempfile.mkdtemp(prefix="count-instr-")
    groups = 200  # the bench's default --groups
    entries = {"coordinator": a.nodes * groups, "relay": a.fanin * groups,
               "negotiation": 2 * (2 + groups),  # 2 ranks x (big twice + 200 groups)
               "client": 2 * (2 + groups)}
    print(f"{'bench / mode':<28} {'old instr/step':>15} {'new instr/step':>15} "
          f"{'old /entry':>10} {'new /entry':>10} {'new/old-1':>9}  runs' spread")
    for bench in a.benches.split(","):
        fn = {"coordinator": coordinator, "relay": relay, "negotiation": negotiation,
              "client": client}[bench]
        per = {}
        for tree, build in (("old", a.old), ("new", a.new)):
            per[tree] = [fn(build, a, os.path.join(root, f"{bench}-run{r}"))
                         for r in range(a.runs)]
        for mode in MODES[bench]:
            o = [mean(run[mode]) for run in per["old"]]
            n = [mean(run[mode]) for run in per["new"]]
            spread = max((max(x) - min(x)) / min(x) for x in (o, n))
            o, n = mean(o), mean(n)
            print(f"{bench + ' / ' + mode:<28} {o:>15.0f} {n:>15.0f} "
                  f"{o / entries[bench]:>10.1f} {n / entries[bench]:>10.1f} "
                  f"{100 * (n / o - 1):>+8.2f}%  {100 * spread:.3f}%", flush=True)
            print(f"    runs, old: {[round(mean(r[mode])) for r in per['old']]}, "
                  f"new: {[round(mean(r[mode])) for r in per['new']]}", flush=True)
    if a.keep is None:
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
