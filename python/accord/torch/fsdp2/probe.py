"""FSDP2's version and private names: the probe run at `install`."""

from __future__ import annotations

import re
import types
from typing import Optional, Tuple

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
