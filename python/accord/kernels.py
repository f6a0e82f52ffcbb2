"""The CPU pack/unpack kernels on torch tensors (or anything with data_ptr()).

Gradients are packed into FSDP2's reduce-scatter layout exactly as a decision
says: widened to the wire dtype, zeros for included parameters without a local
gradient, nothing for skipped ones.
"""

from __future__ import annotations

from typing import Optional, Sequence

from accord import _accord
from accord.agreement import ParamTuple


def _name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def _check_source(t, numel: int, what: str):
    if not t.is_contiguous():
        raise ValueError(f"{what}: tensor must be contiguous")
    if t.device.type != "cpu":
        raise ValueError(f"{what}: pack_cpu needs CPU tensors, got {t.device}")
    if t.numel() != numel:
        raise ValueError(f"{what}: expected {numel} elements, got {t.numel()}")


def pack_cpu(
    group_id: str,
    params: Sequence[ParamTuple],
    world_size: int,
    decision,
    grads: Sequence[Optional["object"]],
    out,
    num_threads: int = 1,
    allow_narrowing: bool = False,
) -> None:
    """Packs `grads` (a tensor or None per parameter) into `out` (a flat CPU
    tensor of the decision's wire dtype and the layout's total size)."""
    if len(grads) != len(params):
        raise ValueError(f"pack_cpu: group {group_id}: {len(grads)} grads for {len(params)} params")
    sources = []
    for (name, _, numel), g in zip(params, grads):
        if g is None:
            sources.append(None)
            continue
        _check_source(g, numel, f"pack_cpu: group {group_id} param {name}")
        sources.append((g.data_ptr(), _name(g.dtype)))
    if _name(out.dtype) != decision.wire_dtype:
        raise ValueError(
            f"pack_cpu: group {group_id}: out is {out.dtype}, the decision's wire dtype is "
            f"{decision.wire_dtype}"
        )
    _check_source(out, out.numel(), f"pack_cpu: group {group_id} out")
    _accord.pack_cpu(
        group_id,
        list(params),
        world_size,
        list(decision.included),
        decision.wire_dtype,
        sources,
        out.data_ptr(),
        out.numel() * out.element_size(),
        num_threads,
        allow_narrowing,
    )


def unpack_cpu(
    group_id: str,
    params: Sequence[ParamTuple],
    world_size: int,
    decision,
    rank: int,
    shard,
    targets: Sequence[Optional["object"]],
    drop_padding: bool = False,
) -> None:
    """Converts this rank's reduced `shard` into `targets` (a tensor or None
    per parameter; None for every skipped parameter)."""
    if len(targets) != len(params):
        raise ValueError(
            f"unpack_cpu: group {group_id}: {len(targets)} targets for {len(params)} params"
        )
    row = _accord.layout_row_numel(
        group_id, list(params), world_size, list(decision.included), decision.wire_dtype
    )
    _check_source(shard, row, f"unpack_cpu: group {group_id} shard")
    dst = []
    for i, ((name, _, _), t) in enumerate(zip(params, targets)):
        if t is None:
            dst.append(None)
            continue
        n = _accord.unpacked_numel(
            group_id, list(params), world_size, list(decision.included), decision.wire_dtype,
            i, rank, drop_padding,
        )
        _check_source(t, n, f"unpack_cpu: group {group_id} param {name}")
        dst.append((t.data_ptr(), _name(t.dtype)))
    _accord.unpack_cpu(
        group_id, list(params), world_size, list(decision.included), decision.wire_dtype,
        rank, shard.data_ptr(), dst, drop_padding,
    )
