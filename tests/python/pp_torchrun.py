"""One rank of a pipeline-parallel job under torchrun with accord's embedded
default (test_pipeline_one_job.py).

    python -m torch.distributed.run --standalone --nproc-per-node=4 \
        pp_torchrun.py OUT_DIR KINDS SCHEDULE...

2 stages x 2 data-parallel ranks (rank = 2 * stage + dp rank), each stage
module its own FSDP root on its stage's dp mesh: config_scenarios.run_pipeline
in mode "embedded", i.e. accord.torch.install(stage_module, optional=[...])
and nothing else (no accord.connect call, no job id, no per-stage job).
KINDS: "param+drop" and the like. Writes OUT_DIR/rank<R>.pt: per schedule the
run's result keyed (schedule, "embedded", kinds), and on rank 0 the
single-process reference under "ref".
"""

import os
import sys

import torch
import torch.distributed as dist

import config_scenarios as cs


def main():
    out_dir, kinds, schedules = sys.argv[1], tuple(sys.argv[2].split("+")), sys.argv[3:]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for schedule in schedules:
        out[(schedule, "embedded", kinds)] = cs.run_pipeline(rank, world, schedule, "embedded",
                                                             kinds, infos=None)
    if rank == 0:
        out["ref"] = cs.pp_reference(kinds)
    path = os.path.join(out_dir, f"rank{rank}.pt")
    torch.save(out, path + ".tmp")
    os.replace(path + ".tmp", path)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
