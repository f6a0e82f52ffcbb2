"""Embedded mode's cost: time from `accord.connect()` to the first decision,
and the steady step, against a deployment (a sidecar already running) in the
same run. docs/EMBEDDED.md.

    PYTHONPATH=build/python/pkg OMP_NUM_THREADS=1 \\
        python bench/embedded/bench_embedded.py [--runs 5] [--steps 200] [--nproc 2]

Each run is one `torchrun --standalone --nproc-per-node=N` job. Every rank
initializes Gloo, waits at a barrier (so that Python and torch start-up are
not counted), then times: connect() (embedded: starting the coordinator and
the sidecar included; deployed: ACCORD_SOCKET to a LocalCluster sidecar started
before the job), register + submit + wait of step 0 (only rank 0 has
gradients), then `--steps` more steps (submit + wait, same manifests). A
run's figure is its slowest rank's.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

PARAMS = [("w", 4, 16), ("b", 4, 4), ("unused", 2, 2)]


def rank_main(out_dir, steps):
    import torch.distributed as dist

    import accord

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dist.barrier()
    t0 = time.perf_counter()
    client = accord.connect()
    t_connect = time.perf_counter() - t0
    client.register_group("g", PARAMS, reduce_dtype=None, timeout_s=60)
    dtypes = ["float32", "bfloat16", None] if rank == 0 else [None, None, None]
    client.wait(client.submit("g", 0, dtypes), timeout_s=60)
    t_first = time.perf_counter() - t0
    step_s = []
    for step in range(1, steps + 1):
        t = time.perf_counter()
        client.wait(client.submit("g", step, dtypes), timeout_s=60)
        step_s.append(time.perf_counter() - t)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"connect_s": t_connect, "first_decision_s": t_first,
                   "step_median_s": statistics.median(step_s)}, f)
    dist.barrier()


def one_run(mode, nproc, steps, cluster_socket):
    out = tempfile.mkdtemp(prefix="bench-emb-")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCORD_")}
    env["OMP_NUM_THREADS"] = "1"
    if mode == "deployed":
        env.update(ACCORD_SOCKET=cluster_socket, ACCORD_JOB_ID=f"bench-{uuid.uuid4().hex[:8]}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", os.path.abspath(__file__), "--rank-main", out,
           "--steps", str(steps)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    if p.returncode != 0:
        raise SystemExit(f"{mode} run failed:\n{p.stdout}\n{p.stderr}")
    ranks = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(nproc)]
    return {k: max(r[k] for r in ranks) for k in ranks[0]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--rank-main", metavar="OUT_DIR")
    args = ap.parse_args()
    if args.rank_main:
        rank_main(args.rank_main, args.steps)
        return

    import accord

    print(f"load average before: {os.getloadavg()}")
    results = {"embedded": [], "deployed": []}
    with accord.LocalCluster(num_sidecars=1) as cluster:
        sock, _ = cluster.socket_for(0, 1)
        # Interleaved, so that a change of load hits both modes alike.
        for _ in range(args.runs):
            for mode in results:
                results[mode].append(one_run(mode, args.nproc, args.steps, sock))
    print(f"load average after: {os.getloadavg()}")
    print(f"{args.nproc} ranks, torchrun --standalone, {args.runs} runs per mode, "
          f"{args.steps} steady steps per run; slowest rank per run")
    print(f"{'mode':<10} {'connect() ms':>24} {'connect -> 1st decision ms':>30} "
          f"{'steady step us (median)':>26}")
    for mode, runs in results.items():
        def col(key, scale):
            v = sorted(r[key] * scale for r in runs)
            return f"{statistics.median(v):7.1f} ({v[0]:.1f}-{v[-1]:.1f})"
        print(f"{mode:<10} {col('connect_s', 1e3):>24} {col('first_decision_s', 1e3):>30} "
              f"{col('step_median_s', 1e6):>26}")


if __name__ == "__main__":
    main()
