"""A torchrun entry point for test_examples.py: deepspeed_scenarios.train under
real torchrun with `accord.deepspeed.install(engine)` and no client (embedded
mode), rank 1 never using the tower. Prints one line per rank comparing every
step's reduced gradients with the single-process reference.

    torchrun --nproc-per-node=2 ds_torchrun.py STAGE [given|learned|persistent]

ZeRO-3: the tower is given as optional, or not given: "learned" with every
parameter fetched per forward (persistence threshold 0, as a real tower's
weights are), so that accord learns it at step 0's divergence; "persistent"
with DeepSpeed's default threshold, under which the toy tower is persistent
and first all-gathered after step 0 (then every rank ends with the guard's
error).
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
    tower = (sys.argv[2:] or ["given"])[0]
    given = stage == 3 and tower == "given"
    deepspeed.init_distributed(dist_backend="gloo", verbose=False,
                               timeout=timedelta(seconds=60))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out = ds.train(rank, world, stage=stage, case="never_on_1", steps=3, accord="embedded",
                   optional=("tower",) if given else (),
                   **({"persistence": 0} if tower == "learned" else {}))
    worst = 0.0
    for step in out[:-1]:
        for name, g in step["grads"].items():
            ref = step["ref"][name]
            if g is None or ref is None:
                assert g is None and ref is None, (name, g, ref)
                continue
            worst = max(worst, float((g - ref).abs().max() / ref.abs().max().clamp_min(1e-12)))
    stats = out[-1]["stats"]
    line = (f"ds rank {rank}: stage {stage} steps {len(out) - 1} worst_rel_err {worst:.2e} "
            f"zero_filled {stats['zero_filled']} late {stats['late']} releases {stats['releases']} "
            f"learned {','.join(out[-1].get('learned') or []) or '-'}\n")
    os.write(1, line.encode())  # one write: the ranks share torchrun's pipe
