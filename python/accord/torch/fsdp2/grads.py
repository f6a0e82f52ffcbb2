"""FSDP2's parameters and gradients: the reduce path accord drives."""

from __future__ import annotations

import contextlib
from typing import Iterator, List, Optional, Tuple

import torch

@contextlib.contextmanager
def without_reduce(group) -> Iterator[None]:
    """FSDP2's post-backward with its reduce-scatter left out: exactly what it
    does under set_requires_gradient_sync(False) (reshard, keep the gradient)."""
    saved = group.reduce_grads
    group.reduce_grads = False
    try:
        yield
    finally:
        group.reduce_grads = saved


def reduce_scatter_as_held(group, original, wire: torch.dtype) -> None:
    """FSDP2's own post-backward, reduce-scattering in `wire` exactly the
    gradients it holds, and no zero-filling of its own
    (set_reduce_scatter_unused_params: accord zero-fills, never twice). The
    steady turn calls it directly (its layout is the gradients FSDP2 holds,
    in one dtype: nothing is moved); reduce_scatter() after placing fills."""
    saved_dtype = getattr(group, "_reduce_dtype", None)
    saved_unused = getattr(group, "reduce_scatter_unused_params", None)
    group._reduce_dtype = wire
    if saved_unused is not None:
        group.reduce_scatter_unused_params = False
    try:
        original()
    finally:
        group._reduce_dtype = saved_dtype
        if saved_unused is not None:
            group.reduce_scatter_unused_params = saved_unused


# ------------------------------------------------------------------ parameters

def param_shape(fp) -> Tuple[int, int]:
    """(dim0, numel) of an FSDP parameter's unsharded shape."""
    size = tuple(int(s) for s in fp._orig_size)
    numel = 1
    for s in size:
        numel *= s
    return (size[0] if size else 1), numel


def sharded_param(fp):
    return fp.sharded_param


def sharded_grads_none(group) -> List[bool]:
    """Per parameter of the group: whether its sharded gradient is None."""
    return [fp.sharded_param.grad is None for fp in group.fsdp_params]


def all_gather_dtype(fp) -> Optional[torch.dtype]:
    """None before FSDP2's lazy init (the first forward) sets the dtypes:
    nothing was all-gathered yet (uninstall after a refused configuration)."""
    if not hasattr(fp, "orig_dtype"):
        return None
    return fp.param_dtype or fp.orig_dtype


def was_unsharded(fp) -> bool:
    """Whether the parameter was ever all-gathered (needed to zero-fill it)."""
    return hasattr(fp, "_unsharded_param")


def local_grads(group) -> List[Optional[torch.Tensor]]:
    """This rank's gradient per parameter of the group (None where it has
    none), after folding this microbatch's gradient into an accumulated one
    (idempotent; FSDP2 does it first too)."""
    out: List[Optional[torch.Tensor]] = []
    for fp in group.fsdp_params:
        if not hasattr(fp, "_unsharded_param"):
            out.append(None)
        elif fp.unsharded_accumulated_grad is None:  # nothing to fold in
            out.append(fp._unsharded_param.grad)
        else:
            fp.accumulate_unsharded_grad_if_needed()
            out.append(fp.unsharded_accumulated_grad)
    return out


def has_post_accumulate_grad_hooks(group) -> bool:
    """Whether any parameter of the group has a post-accumulate-grad hook
    (Tensor.register_post_accumulate_grad_hook), which FSDP2 runs on the
    sharded gradient right after each reduce-scatter."""
    return any([getattr(fp.sharded_param, "_post_accumulate_grad_hooks", None)
                for fp in group.fsdp_params])


def trainable(fp) -> bool:
    return bool(fp.sharded_param.requires_grad)


_WIDTH = {torch.float64: 3, torch.float32: 2, torch.bfloat16: 1, torch.float16: 1}


def widest_grad_dtype(group) -> torch.dtype:
    """The dtype FSDP2 reduce-scatters this group's gradients in: its
    reduce_dtype when set, else the gradients' own (param_dtype when set,
    else the parameters'); several (fp16 beside bf16) join to float32.
    Readable before the first forward."""
    mp = group.mp_policy
    if mp.reduce_dtype is not None:
        return mp.reduce_dtype
    if mp.param_dtype is not None:
        return mp.param_dtype
    dtypes = {fp.sharded_param.dtype for fp in group.fsdp_params
              if fp.sharded_param.requires_grad} or {torch.float32}
    if len(dtypes) == 1:
        return next(iter(dtypes))
    widest = max(dtypes, key=lambda d: _WIDTH.get(d, 2))
    return widest if _WIDTH.get(widest, 2) > 1 else torch.float32


def was_unsharded_group(group) -> bool:
    """Whether the group was ever all-gathered on this rank."""
    return all(hasattr(fp, "_unsharded_param") for fp in group.fsdp_params)


def hold(group, original) -> None:
    """FSDP2's post-backward without its reduce-scatter: reshard and keep
    the gradient, as under set_requires_gradient_sync(False). A group never
    all-gathered on this rank has no gradient; FSDP2's no-sync path cannot
    handle it, so its reduce path runs with nothing to reduce instead."""
    if was_unsharded_group(group):
        with without_reduce(group), _grads_in_param_dtype(group):
            original()
        return
    with _no_unused_params(group):
        original()


@contextlib.contextmanager
def _grads_in_param_dtype(group) -> Iterator[None]:
    """FSDP2's no-sync path converts each gradient to reduce_dtype to keep it
    across backwards; held only to the group's turn in this backward, it
    stays in the parameter dtype (half the bytes for bf16), and FSDP2's
    copy-in converts it as it does without accord."""
    saved = [fp.__dict__.get("reduce_dtype") for fp in group.fsdp_params]
    for fp in group.fsdp_params:
        if "reduce_dtype" in fp.__dict__:
            fp.reduce_dtype = None
    try:
        yield
    finally:
        for fp, rd in zip(group.fsdp_params, saved):
            if "reduce_dtype" in fp.__dict__:
                fp.reduce_dtype = rd


@contextlib.contextmanager
def _no_unused_params(group) -> Iterator[None]:
    saved = getattr(group, "reduce_scatter_unused_params", None)
    if saved is not None:
        group.reduce_scatter_unused_params = False
    try:
        yield
    finally:
        if saved is not None:
            group.reduce_scatter_unused_params = saved


def drop_local_grads(group) -> None:
    """Clears the group's unsharded gradients (the caller keeps what it needs)."""
    for fp in group.fsdp_params:
        take_grad(fp)


def reduce_scatter(group, original, fills: list, wire: torch.dtype, midway: bool) -> None:
    """Runs FSDP2's own post-backward so that it reduce-scatters exactly the
    parameters with a fill, in `wire`: a fill is this rank's gradient, or a
    dtype for zeros. `midway`: the group's own post-backward has not run
    yet (a late turn), so its unit is not resharded, its training state is
    kept and the gradients accumulated so far are put back afterwards."""
    stash = [take_grad(fp) for fp in group.fsdp_params]
    tensors = {f.dtype for f in fills if isinstance(f, torch.Tensor)}
    # One dtype: FSDP2's copy-in converts it to the wire dtype. Several: each
    # is converted here, so FSDP2 sees uniform gradients.
    common = next(iter(tensors)) if len(tensors) == 1 else wire
    for fp, fill in zip(group.fsdp_params, fills):
        if fill is None:
            continue
        if isinstance(fill, torch.Tensor):
            fp.unsharded_accumulated_grad = fill if fill.dtype == common else fill.to(common)
        else:
            fp.unsharded_accumulated_grad = torch.zeros_like(
                fp._unsharded_param, dtype=common, requires_grad=False)
    state, after_backward = group._training_state, group.reshard_after_backward
    if midway:
        group.reshard_after_backward = False
    try:
        reduce_scatter_as_held(group, original, wire)
    finally:
        if midway:
            group._training_state = state
            group.reshard_after_backward = after_backward
            for fp, held in zip(group.fsdp_params, stash):
                if held is not None:
                    fp.unsharded_accumulated_grad, fp._unsharded_param.grad = held


def take_grad(fp) -> Optional[tuple]:
    """Removes and returns the parameter's unsharded gradient state."""
    if not hasattr(fp, "_unsharded_param"):
        return None
    held = (fp.unsharded_accumulated_grad, fp._unsharded_param.grad)
    fp.unsharded_accumulated_grad = None
    fp._unsharded_param.grad = None
    return held


def group_params(group) -> list:
    """The group's FSDP parameters (opaque: read them with the functions here)."""
    return group.fsdp_params
