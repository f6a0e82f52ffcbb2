"""One rank of a pipeline-parallel job under torchrun with accord's embedded
default (test_pipeline_one_job.py).

    python -m torch.distributed.run --standalone --nproc-per-node=4 \
        pp_torchrun.py [--tp] OUT_DIR KINDS SCHEDULE[:MODE[:KINDS]]...

2 stages x 2 data-parallel ranks (rank = 2 * stage + dp rank), each stage
module its own FSDP root on its stage's dp mesh: config_scenarios.run_pipeline
in mode "embedded", i.e. accord.torch.install(stage_module, optional=[...])
and nothing else (no accord.connect call, no job id, no per-stage job).
With --tp (--nproc-per-node=8): 2 stages x 2 DP x 2 TP ranks, each layer's
MLP tensor parallel (test_pipeline_3d.py). A SCHEDULE may name another mode
of run_pipeline and kinds of its own ("1f1b:plain:param": FSDP2 alone with
the image divergence only). KINDS: "param+drop" and the like. Writes
OUT_DIR/rank<R>.pt: per schedule the run's result keyed (schedule, mode,
kinds), and on rank 0 the single-process reference under "ref".
"""

import os
import sys

import torch
import torch.distributed as dist

import config_scenarios as cs


def main():
    args = sys.argv[1:]
    tp = args[0] == "--tp"
    out_dir, kinds, schedules = args[tp], tuple(args[tp + 1].split("+")), args[tp + 2:]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for arg in schedules:
        schedule, mode, own = (arg.split(":") + ["", ""])[:3]
        mode, run_kinds = mode or "embedded", tuple(own.split("+")) if own else kinds
        out[(schedule, mode, run_kinds)] = cs.run_pipeline(rank, world, schedule, mode,
                                                           run_kinds, infos=None, tp=tp)
    if rank == 0:
        out["ref"] = cs.pp_reference(kinds)
        for other in {key[2] for key in out if key != "ref"} - {kinds}:
            out[("ref", other)] = cs.pp_reference(other)
    path = os.path.join(out_dir, f"rank{rank}.pt")
    torch.save(out, path + ".tmp")
    os.replace(path + ".tmp", path)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
