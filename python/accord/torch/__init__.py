"""accord for PyTorch FSDP2: one call makes every reduce-scatter agree.

    import accord, accord.torch
    model = ...; fully_shard(...)            # FSDP2 as usual
    accord.torch.install(model)              # or install(model, accord.connect(...))

How it hooks FSDP2 (docs/PARTICIPATION.md has the collective sequences)
-----------------------------------------------------------------------
Each FSDP parameter group (one reduce-scatter) is registered with accord
under ``"<prefix>/<module path>"`` with its parameters' names, dim-0 sizes
and element counts, all groups in one batch at ``install``.

One order, computed locally. During autograd a group's post-backward never
reduce-scatters and never waits: it does what FSDP2 does without gradient
sync (reshard, keep the gradient). At the end of each backward, FSDP2's
end-of-backward callback first releases every group that reduces, in module order
reversed (root last), the same on every rank: the step's manifests (which parameters have a
gradient, in which dtype) go up as one batch; each group then applies its
decision, the same on every rank (zero-fill where another rank has a
gradient, parameters used on no rank left out with gradient None, one wire
dtype), and FSDP2's own post-backward reduce-scatters it. Whatever order
autograd ran the post-backwards in, every rank issues the same
reduce-scatters in the same order.

Speculation (on by default). A group whose previous step needed no repair
applies its previous decision without waiting; the real decisions are
checked after the step's reduce-scatters, before the callback returns, and a
difference is repaired on every rank alike: parameters carried as zeros
everywhere get their gradient back to None, anything else is reduce-scattered
again with the real decision. ``installation.timing`` counts speculated
group-steps and repairs.

The wire dtype is the group's FSDP2 ``reduce_dtype`` when set, otherwise the
lossless join of every rank's gradient dtypes. FSDP2's
``set_reduce_scatter_unused_params`` is turned off while accord
reduce-scatters (accord zero-fills, never twice) and restored afterwards.

Units whose forward runs on some ranks only (``optional=``) are all-gathered
by every rank at one fixed point and kept unsharded for the step
(accord.torch.optional); the collective-sequence guard (accord.torch.guard)
names any other divergence on every rank, and learns optional units that
diverge from their first step; the step watch (accord.torch.watchdog) names a
rank that stops or dies mid-step. However a rank learns the job's verdict,
it raises (or, blocked in a collective, ends with) an ``AccordJobError``
holding the coordinator's words, the same on every rank (accord.torch.errors).

Costs and limits: every group's unsharded gradient is kept until the end of
the backward (FSDP2 without accord frees each after its reduce-scatter), and
reduce-scatters do not overlap backward compute. Install right after
``fully_shard`` and before the first forward. Every private FSDP2 name is in
accord.torch.fsdp2, checked at install; ``uninstall()`` restores everything.
"""

from accord.torch.fsdp2 import (  # noqa: F401
    SUPPORTED_TORCH,
    UnsupportedTorchError,
    check_torch_version,
    torch_version,
)
from accord.torch.errors import AccordDivergenceError, AccordJobError, AccordPeerError  # noqa: F401
from accord.torch.group import AccordFSDPError, GroupStats, dtype_name, torch_dtype  # noqa: F401
from accord.torch.install import fix_transformers_output_capture, install  # noqa: F401
from accord.torch.installation import Installation, NegotiationTiming  # noqa: F401
from accord.torch.optional import UnitParticipation  # noqa: F401

__all__ = [
    "AccordDivergenceError", "AccordFSDPError", "AccordJobError", "AccordPeerError", "GroupStats",
    "Installation", "NegotiationTiming", "SUPPORTED_TORCH", "UnitParticipation",
    "UnsupportedTorchError", "check_torch_version", "dtype_name", "fix_transformers_output_capture", "install",
    "torch_dtype", "torch_version",
]
