"""One rank of an embedded-mode job (test_embedded.py, bench_embedded.py).

    python embedded_scenarios.py SCENARIO OUT_DIR

Run under torchrun, or by a launcher that sets RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR and MASTER_PORT. Initializes Gloo, calls `accord.connect()` with
no argument, and writes OUT_DIR/rank<R>.json.

Scenarios:
- decide: register one group, decide two steps where only rank 0 has
  gradients (the decision must be the same on every rank), then a barrier.
- kill_rank0: decide step 0; then rank 0 SIGKILLs itself and every other rank
  submits step 1 and records the error it gets (or none).
- world_mismatch: connect() with WORLD_SIZE in the environment made to
  disagree with the process group; records the ValueError.
"""

import json
import os
import signal
import sys
import time

PARAMS = [("w", 4, 16), ("b", 4, 4), ("unused", 2, 2)]


def write(out_dir, rank, result):
    path = os.path.join(out_dir, f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)


def decision_dict(d):
    return {"step": d.step, "wire": d.wire_dtype, "included": list(d.included),
            "skip": list(d.skip_indices()), "fingerprint": d.layout_fingerprint}


def accordctl_status(boot):
    """`accordctl status` against the embedded coordinator, with the token
    file rank 0's mode line names."""
    import subprocess

    from accord.cluster import daemon_path

    with open(boot.token_file) as f:
        token = f.read().strip()
    p = subprocess.run([daemon_path("accordctl"), "status", f"--coordinator={boot.coordinator}",
                        f"--token={token}"], capture_output=True, text=True, timeout=60)
    return {"rc": p.returncode, "out": p.stdout + p.stderr}


def main():
    scenario, out_dir = sys.argv[1], sys.argv[2]
    import torch.distributed as dist

    import accord
    import accord.embedded

    if scenario == "world_mismatch":
        # The group has one rank; the environment claims two.
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}",
                                rank=0, world_size=1)
        os.environ["WORLD_SIZE"] = "2"
        try:
            accord.connect(connect_timeout_s=10)
            write(out_dir, 0, {"error": None})
        except ValueError as e:
            write(out_dir, 0, {"error": str(e)})
        return

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    t0 = time.monotonic()
    client = accord.connect()
    connected_s = time.monotonic() - t0
    boot = accord.embedded.current()
    client.register_group("g", PARAMS, reduce_dtype=None, timeout_s=60)
    dtypes = ["float32", "bfloat16", None] if rank == 0 else [None, None, None]
    d0 = client.wait(client.submit("g", 0, dtypes), timeout_s=60)
    result = {
        "rank": rank,
        "pid": os.getpid(),
        "job_id": client.job_id,
        "mode": boot.mode if boot else None,
        "socket": boot.socket_path if boot else None,
        "coordinator": boot.coordinator if boot else None,
        "metrics": boot.metrics if boot else {},
        "connect_s": connected_s,
        "first_decision_s": time.monotonic() - t0,
        "decisions": [decision_dict(d0)],
    }
    if scenario == "decide":
        d1 = client.wait(client.submit("g", 1, dtypes), timeout_s=60)
        result["decisions"].append(decision_dict(d1))
        if rank == 0:
            result["accordctl_status"] = accordctl_status(boot)
        write(out_dir, rank, result)
        dist.barrier()
    elif scenario == "kill_rank0":
        # Every rank holds its first decision before rank 0 dies (on one node
        # its sidecar dies with it, possibly before rank 1 read that decision).
        dist.barrier()
        if rank == 0:
            write(out_dir, rank, result)
            os.kill(os.getpid(), signal.SIGKILL)
        t1 = time.monotonic()
        try:
            client.wait(client.submit("g", 1, dtypes), timeout_s=120)
            result["error"] = None
        except accord.Error as e:
            result["error"] = str(e)
        result["error_after_s"] = time.monotonic() - t1
        write(out_dir, rank, result)
        # No barrier: rank 0 is gone. Exiting runs accord's exit handler.
    else:
        raise SystemExit(f"unknown scenario {scenario}")


if __name__ == "__main__":
    main()
