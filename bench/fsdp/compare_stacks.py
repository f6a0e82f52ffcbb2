"""The same FSDP2 jobs under four ways of making the ranks' reduce-scatters
match, 2 CPU ranks over Gloo; prints the table in python/README.md.

Jobs (tests/python/model_scenarios.py: real transformers model code, tiny
configs, 2 accumulated microbatches per step, vs a single-process reference):
  llava       LLaVA, vision tower in the root FSDP unit; rank 1 text-only
  custom_moe  per-expert nn.Modules; experts with no tokens on some ranks,
              one expert with tokens on none
  mixtral     transformers 5.x fused experts (nothing to fix: the control)
each with a mixed-precision variant: fp32 (reduce_dtype None) or bf16 params
with reduce_dtype fp32.

Approaches:
  plain        FSDP2 as is
  unused_flag  FSDP2 with set_reduce_scatter_unused_params(True)
  local        the rank-local patch people write today (re-implemented below):
               each rank, alone, zero-fills its missing gradients and widens
               all of them to the widest dtype it holds locally
  accord       accord.torch.install with a local cluster (coordinator + sidecar)

Outcome is measured, not assumed: "hang" (no answer within --timeout),
"assertion"/"collective error" (first error), "wrong gradients" (rel. error
> 1e-5 against the reference, a gradient missing, or ranks disagreeing),
"zero grads for N params used nowhere" (the reference has None there:
optimizers would decay them), or "trains, correct". Step time is the median
over steps 2..N of rank 0's wall time for forward+backward of the 2
microbatches (no optimizer); bytes are rank 0's reduce-scatter input bytes in
the last step. Run on a quiet machine; the script prints the load average.

    PYTHONPATH=<build>/python/pkg ACCORD_BIN_DIR=<build>/python/pkg/accord/bin \\
        OMP_NUM_THREADS=1 python bench/fsdp/compare_stacks.py [--steps 6]
"""

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests", "python"))

JOBS = [("llava", "fp32"), ("llava", "bf16-fp32"), ("custom_moe", "fp32"),
        ("custom_moe", "bf16-fp32"), ("mixtral", "bf16-fp32")]
APPROACHES = ["plain", "unused_flag", "local", "accord"]


def local_patch_install(model, rank, world_size):
    """The rank-local fix: before FSDP2 builds a group's buffer, each rank
    zero-fills every parameter it has no gradient for (it cannot know whether
    another rank has one) and widens every gradient to the widest dtype it
    holds itself. No communication, so ranks can still disagree on the dtype,
    and parameters used on no rank are reduced as zeros."""
    import torch
    from torch.distributed.fsdp import FSDPModule

    def widest(dtypes):
        return max(dtypes, key=lambda d: (torch.finfo(d).bits, torch.finfo(d).max))

    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        for group in module._get_fsdp_state()._fsdp_param_groups:
            if "post_backward" in group.__dict__:
                continue  # grouped unit seen before
            original = group.post_backward

            def post_backward(*args, _group=group, _original=original, **kwargs):
                if getattr(_group, "reduce_grads", True):
                    grads = []
                    for fp in _group.fsdp_params:
                        fp.accumulate_unsharded_grad_if_needed()
                        g = None
                        if hasattr(fp, "_unsharded_param"):
                            g = fp.unsharded_accumulated_grad
                            if g is None:
                                g = fp._unsharded_param.grad
                        grads.append(g)
                    present = [g.dtype for g in grads if g is not None]
                    if present:
                        dtype = widest(present)
                        for fp, g in zip(_group.fsdp_params, grads):
                            if g is None and hasattr(fp, "_unsharded_param"):
                                fp.unsharded_accumulated_grad = torch.zeros_like(
                                    fp._unsharded_param, dtype=dtype)
                            elif g is not None and g.dtype != dtype:
                                fp.unsharded_accumulated_grad = g.to(dtype)
                                fp._unsharded_param.grad = None
                return _original(*args, **kwargs)

            group.__dict__["post_backward"] = post_backward
    return None


def classify(results, timed_out, timeout_s):
    import model_scenarios as ms
    from harness import RankFailure

    if timed_out:
        return f"hang (no answer in {timeout_s:.0f}s)", None
    failures = [r for r in results if isinstance(r, RankFailure) or r is None]
    if failures:
        errors = " ".join(f.error for f in failures if f is not None)
        if "uniform gradient dtype" in errors:
            return "assertion: FSDP reduce-scatter expects uniform gradient dtype", None
        if "Connection" in errors or "size" in errors or any(f is None for f in failures):
            return "collective error (Gloo: reduce-scatter sizes differ, a rank aborted)", None
        return f"error: {errors[:80]}", None
    variant = next(iter(results[0]))
    ref = results[0][variant]["ref"]
    zero_unused, worst = 0, 0.0
    for name, want in ref.items():
        grads = [r[variant]["grads"][name] for r in results]
        if any(isinstance(g, str) for g in grads):
            return f"wrong gradients ({name}: {[g for g in grads if isinstance(g, str)][0]})", None
        if want is None:
            if grads[0] is not None:
                if all(float(g.abs().max()) == 0.0 for g in grads):
                    zero_unused += 1
                    continue
                return f"wrong gradients ({name} used nowhere has a non-zero gradient)", None
            continue
        if grads[0] is None:
            return f"wrong gradients ({name} missing)", None
        import torch

        if not all(torch.equal(g, grads[0]) for g in grads):
            return f"wrong gradients (ranks disagree on {name})", None
        worst = max(worst, ms.rel_error(grads[0], want))
    if worst > 1e-5:
        return f"wrong gradients (max rel. error {worst:.2g})", worst
    if zero_unused:
        return f"trains; zero grads for {zero_unused} params used nowhere", worst
    return "trains, correct", worst


def run_one(family, variant, approach, cluster, steps, timeout_s):
    import model_scenarios as ms
    from cluster_fixture import cluster_info
    from harness import RanksTimedOut, run_ranks

    mode = local_patch_install if approach == "local" else approach
    kwargs = dict(family=family, variants=[variant], mode=mode, steps=steps)
    if approach == "accord":
        kwargs["cluster"] = cluster_info(cluster, 2, f"cmp-{family}-{variant}")
    try:
        results = run_ranks(ms.run_family, 2, timeout_s, **kwargs)
        timed_out = False
    except RanksTimedOut:
        results, timed_out = None, True
    outcome, _ = classify(results, timed_out, timeout_s)
    step_ms = bytes_ = None
    if not timed_out and isinstance(results[0], dict):
        r0 = results[0][variant]
        if all(isinstance(r, dict) for r in results):
            step_ms = statistics.median(r0["step_s"][1:] or r0["step_s"]) * 1000
            bytes_ = ms.wire_bytes(r0["wire"][-1])
    return outcome, step_ms, bytes_


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--timeout", type=float, default=90.0)
    ap.add_argument("--jobs", default=",".join(f"{f}/{v}" for f, v in JOBS))
    ap.add_argument("--approaches", default=",".join(APPROACHES))
    ap.add_argument("--log", default="/tmp/accord-compare-stacks.log",
                    help="where the ranks' output (tracebacks of the failing runs) goes")
    args = ap.parse_args()
    import accord

    # The ranks inherit stdout and stderr (tracebacks, FSDP2's own prints):
    # send both to the log and print the report on a copy of the terminal.
    out = os.fdopen(os.dup(1), "w", buffering=1)
    sys.stdout.flush()
    log_fd = os.open(args.log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    sys.stdout = out
    print(f"ranks' output: {args.log}")

    print(f"load average before: {os.getloadavg()[0]:.2f} (1 min), {os.cpu_count()} CPUs")
    rows = []
    with accord.LocalCluster(num_sidecars=1) as cluster:
        for job in args.jobs.split(","):
            family, variant = job.split("/")
            for approach in args.approaches.split(","):
                t0 = time.monotonic()
                outcome, step_ms, bytes_ = run_one(family, variant, approach, cluster,
                                                   args.steps, args.timeout)
                rows.append((job, approach, outcome, step_ms, bytes_))
                print(f"  {job} {approach}: {outcome} ({time.monotonic() - t0:.0f}s)", flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f} (1 min)")
    print()
    print("| job (params / reduce) | approach | outcome | step time (ms) | bytes reduce-scattered / step (rank 0) |")
    print("|---|---|---|---|---|")
    for job, approach, outcome, step_ms, bytes_ in rows:
        st = f"{step_ms:.0f}" if step_ms is not None else "-"
        by = f"{bytes_:,}" if bytes_ is not None else "-"
        print(f"| {job} | {approach} | {outcome} | {st} | {by} |")


if __name__ == "__main__":
    main()
