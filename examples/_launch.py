"""Shared by the examples: run a function on N local ranks (Gloo on CPU),
optionally with a local accord cluster, with a time limit (a hang is reported,
not waited out)."""

import multiprocessing as mp
import os
import tempfile
import traceback


def _entry(fn, rank, world, tmpdir, cluster, q):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        store = dist.FileStore(os.path.join(tmpdir, "store"), world)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
        client = None
        if cluster is not None:
            import accord

            sock, local_rank = cluster["sockets"][rank]
            client = accord.connect(sock, cluster["job"], rank, world, local_rank=local_rank)
        q.put((rank, "ok", fn(rank, world, client)))
    except BaseException as e:
        q.put((rank, "error", f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"))
        traceback.print_exc()
    # Flush the queue's feeder thread before the hard exit, or the answer is lost.
    q.close()
    q.join_thread()
    os._exit(0)


def launch(fn, world=2, with_accord=False, timeout_s=60.0, job="example"):
    """Returns {rank: ("ok", value) | ("error", message) | ("hang", None)}."""
    ctx = mp.get_context("spawn")
    cluster_obj, cluster = None, None
    if with_accord:
        import accord

        cluster_obj = accord.LocalCluster(num_sidecars=1)
        cluster = {"job": job, "sockets": [cluster_obj.socket_for(r, world) for r in range(world)]}
    try:
        q = ctx.Queue()
        with tempfile.TemporaryDirectory() as tmpdir:
            procs = [
                ctx.Process(target=_entry, args=(fn, r, world, tmpdir, cluster, q), daemon=True)
                for r in range(world)
            ]
            for p in procs:
                p.start()
            out = {}
            import queue
            import time

            deadline = time.monotonic() + timeout_s
            while len(out) < world:
                try:
                    rank, status, value = q.get(timeout=max(0.1, deadline - time.monotonic()))
                    out[rank] = (status, value)
                except queue.Empty:
                    break
            for r, p in enumerate(procs):
                if r not in out:
                    out[r] = ("hang", f"no answer after {timeout_s:.0f}s")
                if p.is_alive():
                    p.kill()
                p.join()
            return out
    finally:
        if cluster_obj is not None:
            cluster_obj.close()


def report(title, results):
    print(f"--- {title}")
    for r in sorted(results):
        status, value = results[r]
        print(f"  rank {r}: {status}: {value}")
    return all(s == "ok" and v is True for s, v in results.values())
