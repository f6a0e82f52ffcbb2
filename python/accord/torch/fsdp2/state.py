"""FSDP2's units, states and parameter groups: reading them, and accord's
hooks on them (each installed and removed by one named function)."""

from __future__ import annotations

import inspect
from typing import Callable, List, Optional

import torch

from accord.torch.fsdp2.probe import _import

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


# ------------------------------------------------------------------ accord's hooks

_OWNER = "_accord_hook"


def hook_group(group, owner, post_backward: Callable, pre_backward: Callable):
    """Routes the group's post- and pre-backward through accord's functions;
    returns FSDP2's own (post_backward, pre_backward), bound to the group."""
    originals = group.post_backward, group.pre_backward
    group.__dict__.update({_OWNER: owner, "post_backward": post_backward,
                           "pre_backward": pre_backward})
    return originals


def hooked_by(group):
    """The owner given to hook_group, or None."""
    return group.__dict__.get(_OWNER)


def unhook_group(group) -> None:
    for name in (_OWNER, "post_backward", "pre_backward"):
        group.__dict__.pop(name, None)


def override_reshard(group, reshard: Callable[[Callable], object]) -> None:
    """group.reshard() becomes reshard(FSDP2's reshard), and the group leaves
    FSDP2's forward order (the order its implicit backward prefetch follows),
    so that other units' prefetch never depends on it (an optional unit)."""
    original = group.reshard
    group.__dict__["reshard"] = lambda: reshard(original)
    group.__dict__["_record_post_forward"] = lambda: None


def reshard(group) -> None:
    """The group's reshard (accord's override, when one is installed)."""
    group.reshard()


def restore_reshard(group) -> None:
    group.__dict__.pop("reshard", None)
    group.__dict__.pop("_record_post_forward", None)


class _SetterCheck:
    """A check run before one of a unit's public FSDP2 setters; remove()
    restores the setter."""

    def __init__(self, module, name: str, check: Callable[[bool], None]):
        original = getattr(module, name)  # bound to the module
        signature = inspect.signature(original)
        first = next(iter(signature.parameters))

        def setter(*args, **kwargs):
            check(signature.bind(*args, **kwargs).arguments[first])
            return original(*args, **kwargs)

        self.module, self.name = module, name
        module.__dict__[name] = setter

    def remove(self) -> None:
        self.module.__dict__.pop(self.name, None)


def check_set_requires_all_reduce(module, check: Callable[[bool], None]) -> _SetterCheck:
    """Runs check(value) before the unit's set_requires_all_reduce(value)."""
    return _SetterCheck(module, "set_requires_all_reduce", check)


_ROUTE = "_accord_route"


def route_all_gathers(group, owner) -> None:
    """Tags the group's parameters so that all_gather_owner() finds `owner`
    from the parameter list FSDP2's all-gather entry point receives."""
    for fp in group.fsdp_params:
        fp.__dict__[_ROUTE] = owner


def all_gather_owner(params):
    """The owner given to route_all_gathers for any of `params`, or None."""
    for fp in params:
        owner = fp.__dict__.get(_ROUTE)
        if owner is not None:
            return owner
    return None


def unroute_all_gathers(group) -> None:
    for fp in group.fsdp_params:
        fp.__dict__.pop(_ROUTE, None)
