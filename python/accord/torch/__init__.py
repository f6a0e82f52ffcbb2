"""accord for PyTorch FSDP2: one call makes every reduce-scatter agree.

    import accord, accord.torch
    model = ...; fully_shard(...)            # FSDP2 as usual
    accord.torch.install(model)              # or install(model, accord.connect(...))

How it hooks FSDP2 (docs/PARTICIPATION.md has the collective sequences)
-----------------------------------------------------------------------
Each FSDP parameter group (one reduce-scatter) is registered with accord
under ``"<prefix>/<module path>"`` with its parameters' names, dim-0 sizes
and element counts, all groups in one batch at ``install``.

One order during the backward. A group's post-backward never waits: each
group takes one *turn* per backward, in release order (module order
reversed, root last), at points placed among the backward's all-gathers by a
rule of the all-gathers alone, so every rank issues the same reduce-scatters
in the same order whatever order autograd ran the post-backwards in. At its
turn FSDP2's own post-backward reduce-scatters the group with the layout
its previous decision gives (zeros where this rank has no gradient) and
frees the unsharded gradient, as it does alone. The step's manifests go up
as one batch at the end-of-backward point; once the decisions are in, each
group is completed alike on every rank: parameters no rank used get their
gradient back to None, and a gradient that came after its turn goes in one
delta reduce-scatter. The wire dtype of each group is agreed once at
install. ``installation.timing`` counts turns, repairs and deltas.

Units whose forward runs on some ranks only (``optional=``) are all-gathered
by every rank at one fixed point and kept unsharded for the step
(accord.torch.optional); the collective-sequence guard (accord.torch.guard)
names any other divergence on every rank, and learns optional units that
diverge from their first step; the step watch (accord.torch.watchdog) names a
rank that stops or dies mid-step. However a rank learns the job's verdict,
it raises (or, blocked in a collective, ends with) an ``AccordJobError``
holding the coordinator's words, the same on every rank (accord.torch.errors).

Costs: at most one group's unsharded gradient beyond plain FSDP2 (none in
the steady state); one batch per step. Install right after ``fully_shard``
and before the first forward. Every private FSDP2 name is in
accord.torch.fsdp2, checked at install; ``uninstall()`` restores everything.
"""

from accord.torch.fsdp2 import (  # noqa: F401
    SUPPORTED_TORCH,
    UnsupportedTorchError,
    check_torch_version,
    torch_version,
)
from accord.torch.errors import AccordDivergenceError, AccordJobError, AccordPeerError  # noqa: F401
from accord.torch.group import AccordFSDPError  # noqa: F401
from accord.torch.turn import GroupStats, dtype_name, torch_dtype  # noqa: F401
from accord.torch.transformers_capture import fix_transformers_output_capture  # noqa: F401
from accord.torch.installation import Installation  # noqa: F401
from accord.torch.entry import install  # noqa: F401
from accord.torch.negotiation import NegotiationTiming  # noqa: F401
from accord.torch.optional import UnitParticipation  # noqa: F401

__all__ = [
    "AccordDivergenceError", "AccordFSDPError", "AccordJobError", "AccordPeerError", "GroupStats",
    "Installation", "NegotiationTiming", "SUPPORTED_TORCH", "UnitParticipation",
    "UnsupportedTorchError", "check_torch_version", "dtype_name", "fix_transformers_output_capture", "install",
    "torch_dtype", "torch_version",
]
