"""Runs one function on N ranks (spawned processes, Gloo on CPU), bounded in time.

run_ranks(fn, world_size, timeout_s, **kwargs) starts `world_size` processes,
each calling fn(rank, world_size, **kwargs) after init_process_group("gloo")
over a FileStore in a fresh temporary folder, and returns the per-rank results.
A rank that raises returns a RankFailure; when the deadline passes, the
survivors are killed and RanksTimedOut says which ranks had not finished.
"""

import multiprocessing as mp
import os
import pickle
import tempfile
import traceback


class RankFailure:
    def __init__(self, rank, error, tb):
        self.rank, self.error, self.traceback = rank, error, tb

    def __repr__(self):
        return f"RankFailure(rank={self.rank}, error={self.error!r})\n{self.traceback}"


class RanksTimedOut(Exception):
    pass


class RankDied:
    """A rank process that ended without a result (os._exit, a signal, an
    abort inside a library); `stderr` is the end of what it wrote there."""

    def __init__(self, rank, exitcode, stderr, ended_at=None):
        self.rank, self.exitcode, self.stderr = rank, exitcode, stderr
        self.ended_at = ended_at  # time.time() when the harness saw it gone (an upper bound)

    def __repr__(self):
        return f"RankDied(rank={self.rank}, exitcode={self.exitcode})\n{self.stderr}"


def _entry(fn, rank, world_size, tmpdir, kwargs, as_script=False):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    import boundary_audit

    boundary_audit.install_if_asked()
    # Keep this rank's stderr (also what a dying process writes) for the parent.
    err = os.open(os.path.join(tmpdir, f"stderr.{rank}"), os.O_WRONLY | os.O_CREAT, 0o644)
    os.dup2(err, 2)
    out = os.path.join(tmpdir, f"result.{rank}")
    try:
        store = dist.FileStore(os.path.join(tmpdir, "store"), world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        result = fn(rank, world_size, **kwargs)
    except BaseException as e:  # reported to the parent, which fails the test
        if as_script:
            _end_as_script()
        result = RankFailure(rank, repr(e), traceback.format_exc())
    with open(out + ".tmp", "wb") as f:
        pickle.dump(result, f)
    os.replace(out + ".tmp", out)
    # No destroy_process_group: a failed peer would make it wait.
    os._exit(0)


def _end_as_script():
    """Ends the process as Python ends a script whose exception nobody
    caught: the traceback on stderr, the exit functions (where accord.torch
    stops its threads, and its step watch may end the process with the job's
    verdict instead), exit status 1."""
    import atexit
    import sys

    traceback.print_exc()
    sys.stderr.flush()
    atexit._run_exitfuncs()
    sys.stderr.flush()
    os._exit(1)


def run_ranks(fn, world_size, timeout_s=120.0, victims=(), as_script=False, **kwargs):
    """victims: ranks expected to stop (SIGSTOP) or die mid-run: the others
    are waited for, then the victims are killed; their result is whatever
    they left (RankDied if none). as_script: a rank whose fn raises ends as
    a script with that exception uncaught would (RankDied, its stderr)."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="accord-ranks-") as tmpdir:
        procs = [
            ctx.Process(target=_entry, args=(fn, r, world_size, tmpdir, kwargs, as_script),
                        daemon=True)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        import time

        deadline = time.monotonic() + timeout_s
        ended = {}
        for r, p in enumerate(procs):
            if r not in victims:
                p.join(max(0.0, deadline - time.monotonic()))
                ended[r] = time.time()
        stuck = [r for r, p in enumerate(procs) if p.is_alive() and r not in victims]
        for r, p in enumerate(procs):
            if p.is_alive():
                p.kill()
                p.join()
        results = []
        for r in range(world_size):
            path = os.path.join(tmpdir, f"result.{r}")
            if os.path.exists(path):
                with open(path, "rb") as f:
                    results.append(pickle.load(f))
            else:
                with open(os.path.join(tmpdir, f"stderr.{r}"), errors="replace") as f:
                    results.append(RankDied(r, procs[r].exitcode, f.read()[-4000:],
                                            ended.get(r)))
        if stuck:
            raise RanksTimedOut(
                f"ranks {stuck} of {world_size} still running after {timeout_s}s "
                f"(a hang); results so far: {results}"
            )
        return results


def check_results(results):
    """Raises AssertionError with every failing rank's traceback."""
    failures = [r for r in results if isinstance(r, (RankFailure, RankDied)) or r is None]
    if failures:
        raise AssertionError("ranks failed:\n" + "\n".join(repr(f) for f in failures))
    return results
