"""A torchrun entry point for test_examples.py: deepspeed_scenarios.train under
real torchrun with `accord.deepspeed.install(engine)` and no client (embedded
mode), rank 1 never using the tower. Prints one line per rank comparing every
step's reduced gradients with the single-process reference.

    torchrun --nproc-per-node=2 ds_torchrun.py STAGE
"""

import os
import sys
from datetime import timedelta

if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch
    import deepspeed

    import deepspeed_scenarios as ds

    torch.set_num_threads(1)
    stage = int(sys.argv[1])
    deepspeed.init_distributed(dist_backend="gloo", verbose=False,
                               timeout=timedelta(seconds=60))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out = ds.train(rank, world, stage=stage, case="never_on_1", steps=3, accord="embedded",
                   optional=("tower",) if stage == 3 else ())
    worst = 0.0
    for step in out[:-1]:
        for name, g in step["grads"].items():
            ref = step["ref"][name]
            if g is None or ref is None:
                assert g is None and ref is None, (name, g, ref)
                continue
            worst = max(worst, float((g - ref).abs().max() / ref.abs().max().clamp_min(1e-12)))
    stats = out[-1]["stats"]
    print(f"ds rank {rank}: stage {stage} steps {len(out) - 1} worst_rel_err {worst:.2e} "
          f"zero_filled {stats['zero_filled']} releases {stats['releases']}", flush=True)
