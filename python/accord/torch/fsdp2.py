"""The one boundary between accord.torch and FSDP2's private names.

Every name of FSDP2 that is not public API (torch 2.9 through 2.13) is read or
written here and nowhere else in accord.torch, so a torch release that renames
one breaks this file, loudly: `probe()` runs at `install` and refuses a torch
whose FSDP2 lacks any of them, naming each. What each name means is described
in docs/PARTICIPATION.md ("The FSDP2 boundary").

Nothing here is patched process-wide except FSDP2's all-gather entry point
(for the collective-sequence guard), and that patch is reference-counted:
the last `uninstall()` restores FSDP2's own function.
"""

from __future__ import annotations

import contextlib
import re
import types
from typing import Callable, Iterator, List, Optional, Tuple

import torch

SUPPORTED_TORCH = ((2, 9), (2, 13))


class UnsupportedTorchError(RuntimeError):
    """The installed torch's FSDP2 is not one accord.torch knows how to hook."""


def torch_version(version: Optional[str] = None) -> Tuple[int, int]:
    """(major, minor) of a torch version string (default: the installed one)."""
    v = version if version is not None else torch.__version__
    m = re.match(r"^(\d+)\.(\d+)", str(v))
    if not m:
        raise UnsupportedTorchError(f"accord.torch: cannot parse torch version {v!r}")
    return int(m.group(1)), int(m.group(2))


def check_torch_version(version: Optional[str] = None) -> None:
    """Raises UnsupportedTorchError unless torch is within SUPPORTED_TORCH."""
    v = torch_version(version)
    lo, hi = SUPPORTED_TORCH
    if not (lo <= v <= hi):
        raise UnsupportedTorchError(
            f"accord.torch supports torch {lo[0]}.{lo[1]} through {hi[0]}.{hi[1]} (FSDP2's "
            f"internal reduce path differs elsewhere); found torch "
            f"{version if version is not None else torch.__version__}. Install a supported "
            f"torch or run without accord.torch."
        )


# The private names used, by owner. Methods and properties are looked up on the
# class; fields set in __init__ are found among the names the class's own code
# references (a renamed field disappears from there).
_NAMES = {
    "FSDPParamGroup": ("post_backward", "pre_backward", "reshard", "_record_post_forward",
                       "fsdp_params", "mp_policy",
                       "_training_state", "reduce_grads", "_reduce_dtype",
                       "reshard_after_backward", "mesh_info", "all_reduce_grads"),
    "FSDPParam": ("accumulate_unsharded_grad_if_needed", "unsharded_param", "_unsharded_param",
                  "unsharded_accumulated_grad", "_orig_size", "sharded_param", "param_dtype",
                  "orig_dtype"),
    "FSDPState": ("_root_post_backward_final_callback", "_is_root", "_state_ctx",
                  "is_last_backward"),
    "module _fsdp_param_group": ("foreach_all_gather", "foreach_all_gather_copy_out"),
    "TrainingState": ("FORWARD", "POST_BACKWARD", "PRE_BACKWARD", "IDLE"),
}

_NS: Optional[types.SimpleNamespace] = None


def _import() -> types.SimpleNamespace:
    global _NS
    if _NS is not None:
        return _NS
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp._fully_shard import _fsdp_param_group as pg_module
        from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
        from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
        from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
    except ImportError as e:
        raise UnsupportedTorchError(
            f"accord.torch: this torch ({torch.__version__}) has no FSDP2 (fully_shard) "
            f"internals accord.torch hooks: {e}"
        ) from e
    _NS = types.SimpleNamespace(FSDPModule=FSDPModule, FSDPParamGroup=FSDPParamGroup,
                                FSDPParam=FSDPParam, FSDPState=FSDPState,
                                TrainingState=TrainingState, pg_module=pg_module)
    return _NS


def _referenced(cls) -> set:
    names = set()
    for klass in cls.__mro__:
        for value in vars(klass).values():
            fn = getattr(value, "fget", value)
            fn = getattr(fn, "__wrapped__", fn)
            code = getattr(fn, "__code__", None)
            if code is not None:
                names.update(code.co_names)
    return names


def probe() -> None:
    """Checks the torch version and every private name accord.torch uses;
    raises UnsupportedTorchError naming each one missing."""
    check_torch_version()
    ns = _import()
    owners = {"FSDPParamGroup": ns.FSDPParamGroup, "FSDPParam": ns.FSDPParam,
              "FSDPState": ns.FSDPState, "module _fsdp_param_group": ns.pg_module,
              "TrainingState": ns.TrainingState}
    missing = []
    for owner, names in _NAMES.items():
        obj = owners[owner]
        known = _referenced(obj) if isinstance(obj, type) and owner != "TrainingState" else set()
        for name in names:
            if not hasattr(obj, name) and name not in known:
                missing.append(f"{owner}.{name}")
    if not {"_fsdp_param_groups", "_fsdp_param_group"} & _referenced(ns.FSDPState):
        missing.append("FSDPState._fsdp_param_groups")
    if missing:
        raise UnsupportedTorchError(
            f"accord.torch: FSDP2 in torch {torch.__version__} lacks {', '.join(missing)}, "
            f"which accord.torch relies on; supported: torch {SUPPORTED_TORCH[0]} to "
            f"{SUPPORTED_TORCH[1]}"
        )




def is_fsdp_module(module) -> bool:
    return isinstance(module, _import().FSDPModule)


# ------------------------------------------------------------------ states

def state_of(module):
    return module._get_fsdp_state()


def param_groups(module_or_state) -> list:
    """The FSDPParamGroups of a unit (one, unless a per-parameter mesh)."""
    state = module_or_state
    if hasattr(state, "_get_fsdp_state"):
        state = state._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)  # torch 2.9 layout
    return [group] if group is not None else []


def has_run_forward(module) -> bool:
    """Whether FSDP2 lazily initialized this unit (a forward ran)."""
    return state_of(module)._is_root is not None


def in_backward() -> bool:
    """Inside an autograd graph task (a hook, or recomputation)."""
    return torch._C._current_graph_task_id() != -1


def is_last_backward(module) -> bool:
    """FSDP2's flag for "the next backward ends the step" (False while a
    pipeline schedule runs its microbatches' backwards)."""
    return bool(state_of(module)._state_ctx.is_last_backward)


def wrap_final_callback(state, make: Callable[[Callable], Callable]) -> bool:
    """Replaces this state's end-of-backward callback with make(original);
    False when it is already replaced."""
    if "_root_post_backward_final_callback" in state.__dict__:
        return False
    state.__dict__["_root_post_backward_final_callback"] = make(
        state._root_post_backward_final_callback)
    return True


def unwrap_final_callback(state) -> None:
    state.__dict__.pop("_root_post_backward_final_callback", None)


# ------------------------------------------------------------------ groups

def training_state(group) -> str:
    return group._training_state.name


def in_forward(group) -> bool:
    return group is not None and training_state(group) == "FORWARD"


def in_step(group) -> bool:
    """FORWARD or POST_BACKWARD: where FSDP2 reshards on its own."""
    return training_state(group) in ("FORWARD", "POST_BACKWARD")


def reduces(group) -> bool:
    """Whether this group reduce-scatters at its next post-backward (False
    under set_requires_gradient_sync(False))."""
    return bool(getattr(group, "reduce_grads", True))


def all_reduces(group) -> bool:
    """Whether the group all-reduces across replicas after its reduce-scatter
    (HSDP, or a replicate-only mesh)."""
    return getattr(getattr(group, "mesh_info", None), "replicate_mesh_dim", None) is not None


def data_parallel_ranks(group) -> List[int]:
    """The global ranks of the group's FSDP mesh (shard and replicate dims):
    every rank that takes part in its reduce-scatter or all-reduce."""
    return sorted(int(r) for r in group.mesh_info.mesh.mesh.flatten().tolist())


def all_reduce_enabled(group) -> bool:
    """False under set_requires_all_reduce(False)."""
    return bool(getattr(group, "all_reduce_grads", True))


def reduce_dtype(group) -> Optional[torch.dtype]:
    return getattr(group, "_reduce_dtype", None)


def set_method(group, name: str, fn) -> None:
    group.__dict__[name] = fn


def clear_method(group, name: str) -> None:
    group.__dict__.pop(name, None)


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


@contextlib.contextmanager
def wire_dtype(group, dtype: torch.dtype) -> Iterator[None]:
    """FSDP2's reduce-scatter in `dtype`, and no zero-filling of its own
    (set_reduce_scatter_unused_params: accord zero-fills, never twice)."""
    saved_dtype = getattr(group, "_reduce_dtype", None)
    saved_unused = getattr(group, "reduce_scatter_unused_params", None)
    group._reduce_dtype = dtype
    if saved_unused is not None:
        group.reduce_scatter_unused_params = False
    try:
        yield
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
        grad = None
        if hasattr(fp, "_unsharded_param"):
            fp.accumulate_unsharded_grad_if_needed()
            if fp.unsharded_accumulated_grad is not None:
                grad = fp.unsharded_accumulated_grad
            elif fp._unsharded_param.grad is not None:
                grad = fp._unsharded_param.grad
        out.append(grad)
    return out


def has_post_accumulate_grad_hooks(group) -> bool:
    """Whether any parameter of the group has a post-accumulate-grad hook
    (Tensor.register_post_accumulate_grad_hook), which FSDP2 runs on the
    sharded gradient right after each reduce-scatter."""
    return any(getattr(fp.sharded_param, "_post_accumulate_grad_hooks", None)
               for fp in group.fsdp_params)


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
        with wire_dtype(group, wire):
            original()
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


# ------------------------------------------------------------------ all-gathers

_ALL_GATHER = {"original": None, "copy_out": None, "users": 0}


def patch_all_gather(make: Callable[[Callable], Callable],
                     make_copy_out: Callable[[Callable], Callable]) -> None:
    """Routes FSDP2's all-gathers through make(original), and the waits for
    their results (the copy-out, where an asynchronous all-gather's failure
    surfaces) through make_copy_out(original); reference-counted with
    unpatch_all_gather()."""
    pg = _import().pg_module
    if _ALL_GATHER["users"] == 0:
        _ALL_GATHER["original"] = pg.foreach_all_gather
        _ALL_GATHER["copy_out"] = pg.foreach_all_gather_copy_out
        pg.foreach_all_gather = make(pg.foreach_all_gather)
        pg.foreach_all_gather_copy_out = make_copy_out(pg.foreach_all_gather_copy_out)
    _ALL_GATHER["users"] += 1


def unpatch_all_gather() -> None:
    if _ALL_GATHER["users"] == 0:
        return
    _ALL_GATHER["users"] -= 1
    if _ALL_GATHER["users"] == 0:
        pg = _import().pg_module
        pg.foreach_all_gather = _ALL_GATHER["original"]
        pg.foreach_all_gather_copy_out = _ALL_GATHER["copy_out"]
        _ALL_GATHER["original"] = _ALL_GATHER["copy_out"] = None

