"""Every private DeepSpeed name accord.deepspeed reads or writes, and nowhere
else. `probe(engine)` checks them on the installed DeepSpeed at install and
names each one missing, so a DeepSpeed release that moves them breaks here,
loudly.

ZeRO-1/2 (`DeepSpeedZeroOptimizer`, runtime/zero/stage_1_and_2.py):
- `reduce_ready_partitions_and_remove_grads(param, i)`: called from each
  parameter's gradient hook (during autograd, in this rank's autograd order,
  only for parameters that got a gradient) and from `reduce_gradients`; it
  puts the gradient in DeepSpeed's bucket and reduces the bucket when full.
- `independent_gradient_partition_epilogue()`: the end-of-backward point
  (engine `_backward_epilogue` -> `allreduce_gradients`), reached once per
  backward on every rank; reduces the last bucket.
- `_optimizer_step(group_no)`: the base optimizer's step on one flat fp32
  partition, before DeepSpeed copies it back into the model's parameters.
- `bit16_groups`, `partition_gradients`, `use_grad_accum_attribute`,
  `get_gradient_for_reduction`, `_gradient_reduction_buffer_dtype`,
  `is_gradient_accumulation_boundary`; a parameter's `_hp_mapping`
  (utils/tensor_fragment.py: its slice of this rank's fp32 partition and of
  the optimizer state).
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch

SUPPORTED_DEEPSPEED = ("0.19.8",)

_ZERO12_METHODS = (
    "reduce_ready_partitions_and_remove_grads",
    "independent_gradient_partition_epilogue",
    "_optimizer_step",
    "get_gradient_for_reduction",
    "_gradient_reduction_buffer_dtype",
    "is_gradient_accumulation_boundary",
)
_ZERO12_FIELDS = ("bit16_groups", "partition_gradients", "use_grad_accum_attribute")
_PATCHED = ("reduce_ready_partitions_and_remove_grads", "independent_gradient_partition_epilogue",
            "_optimizer_step")


class UnsupportedDeepSpeedError(RuntimeError):
    """The installed DeepSpeed, or this engine's configuration, lacks what
    accord.deepspeed hooks; the message names each missing piece."""


def deepspeed_version() -> str:
    import deepspeed

    return deepspeed.__version__


def stage(engine) -> int:
    return int(engine.zero_optimization_stage())


def probe(engine) -> int:
    """The engine's ZeRO stage, once every name accord hooks is there;
    raises UnsupportedDeepSpeedError naming what is missing."""
    version = deepspeed_version()
    s = stage(engine)
    if s == 3:
        raise UnsupportedDeepSpeedError(
            f"accord.deepspeed: ZeRO-3 is not supported yet (DeepSpeed {version}); ZeRO-1 and "
            f"ZeRO-2 are")
    if s not in (1, 2):
        raise UnsupportedDeepSpeedError(
            f"accord.deepspeed: ZeRO stage {s} is not supported; use ZeRO-1 or ZeRO-2")
    opt = engine.optimizer
    missing = [f"{type(opt).__name__}.{m}" for m in _ZERO12_METHODS
               if not callable(getattr(opt, m, None))]
    missing += [f"{type(opt).__name__}.{f}" for f in _ZERO12_FIELDS if not hasattr(opt, f)]
    if not missing:
        for group in opt.bit16_groups:
            for p in group:
                if not hasattr(p, "_hp_mapping"):
                    missing.append("parameter._hp_mapping")
                    break
            if missing:
                break
    if missing:
        raise UnsupportedDeepSpeedError(
            f"accord.deepspeed: DeepSpeed {version} with this configuration (optimizer "
            f"{type(opt).__name__}) lacks what accord hooks: {', '.join(missing)}; supported: "
            f"DeepSpeed {', '.join(SUPPORTED_DEEPSPEED)} with ZeRO-1/2 (fp32, bf16, fp16)")
    return s


# ------------------------------------------------------------ ZeRO-1/2


def param_groups(opt) -> List[List[torch.nn.Parameter]]:
    """The optimizer's parameter groups, in DeepSpeed's order (the same on every rank)."""
    return [list(g) for g in opt.bit16_groups]


def gradient(opt, param) -> Optional[torch.Tensor]:
    """The gradient DeepSpeed would reduce for `param` (its accumulation
    attribute where DeepSpeed keeps one), or None."""
    return opt.get_gradient_for_reduction(param)


def zero_fill(opt, param) -> None:
    """Gives `param` a zero gradient where DeepSpeed reads it, in the dtype
    DeepSpeed keeps gradients in."""
    zeros = torch.zeros(param.shape, dtype=opt._gradient_reduction_buffer_dtype(),
                        device=param.device)
    if opt.use_grad_accum_attribute:
        param.grad_accum = zeros
    else:
        param.grad = zeros


def reduces_now(opt) -> bool:
    """Whether this backward's epilogue reduces: every backward with
    partitioned gradients (ZeRO-2), else at the accumulation boundary."""
    return bool(opt.partition_gradients or opt.is_gradient_accumulation_boundary())


def state_slices(param) -> List[torch.Tensor]:
    """Views of `param`'s slice of this rank's fp32 partition and of each
    optimizer state tensor shaped like it (Adam's moments); empty where this
    rank's partition holds none of `param`."""
    mapping = getattr(param, "_hp_mapping", None)
    if mapping is None:
        return []
    out = [mapping.hp_fragment]
    optim = getattr(mapping, "optim_fragment", None) or {}
    out.extend(v for v in optim.values() if torch.is_tensor(v))
    return out


def link_optimizer_state(opt) -> None:
    """Makes each parameter's `_hp_mapping` see the optimizer state (DeepSpeed
    links it lazily after the first step)."""
    linker = getattr(opt, "_lazy_init_hp_params_optimizer_state", None)
    if callable(linker) and opt.optimizer.state:
        linker()


def patch(opt, name: str, fn) -> None:
    """Replaces `opt.<name>` on this instance (restored by unpatch)."""
    opt.__dict__[name] = fn


def original(opt, name: str):
    """The class's own method, bound to `opt`."""
    return getattr(type(opt), name).__get__(opt)


def unpatch(opt) -> None:
    for name in _PATCHED:
        opt.__dict__.pop(name, None)
