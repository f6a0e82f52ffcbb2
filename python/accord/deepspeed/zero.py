"""Every private DeepSpeed name accord.deepspeed reads or writes, and nowhere
else (ZeRO-3's: accord.deepspeed.zero3). `probe(engine)` checks them on the
installed DeepSpeed at install and names each one missing, so a DeepSpeed
release that moves them breaks here, loudly. One adapter per optimizer: `Zero12` (`DeepSpeedZeroOptimizer`) and
`zero3.Zero3` (`DeepSpeedZeroOptimizer_Stage3`), with the same methods.

Both optimizers (runtime/zero/stage_1_and_2.py, stage3.py):
- `reduce_ready_partitions_and_remove_grads(param[, i])`: called from each
  parameter's gradient hook (during autograd, in this rank's autograd order,
  only for parameters that got a gradient); puts the gradient in DeepSpeed's
  bucket and reduces the bucket when full.
- `independent_gradient_partition_epilogue()`: the end-of-backward point
  (the engine's post-backward callback -> `allreduce_gradients`), reached
  once per backward on every rank; reduces the last bucket.
- `_optimizer_step(group)`: the base optimizer's step on one flat fp32
  partition, before DeepSpeed copies it back into the model's parameters.
ZeRO-1/2: `bit16_groups`, `partition_gradients`, `overlap_comm`,
`use_grad_accum_attribute`, `get_gradient_for_reduction`,
`_gradient_reduction_buffer_dtype`, `is_gradient_accumulation_boundary`, a
parameter's `_hp_mapping` (utils/tensor_fragment.py); for the repair,
`reduce_ipg_grads`, `dp_process_group`, `get_param_id`,
`is_param_in_current_partition`, `get_param_gradient_attribute` and the
bf16 compact partition (`_use_compact_grad_partition_buffer`,
`grad_start_offset`, `partition_size`, `real_dp_process_group`,
`_get_compact_grad_partition_slice`, `grad_partition_insertion_offset`);
for the restore, `single_partition_of_fp32_groups` and the mapping's
`param_group_index` and `hp_fragment_address`. DeepSpeed's MoE layer:
`real_dp_process_group[i]` is an expert group's expert-data-parallel group.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

SUPPORTED_DEEPSPEED = ("0.19.8",)

_PATCHED = ("reduce_ready_partitions_and_remove_grads", "independent_gradient_partition_epilogue",
            "_optimizer_step")
_SUB_MODULE_FUNCTIONS = ("pre_sub_module_forward_function", "post_sub_module_forward_function",
                         "pre_sub_module_backward_function", "post_sub_module_backward_function")
_ALL_GATHER = "_PartitionedParameterCoordinator__all_gather_params"
_TRACE = "_PartitionedParameterCoordinator__submodule_order"
_STEP_ID = "_PartitionedParameterCoordinator__step_id"
_FETCHED_FOR = "_PartitionedParameterCoordinator__step_id_module_fetched_for"
_COORDINATOR = (_ALL_GATHER, "reset_step", "is_complete_trace", "is_record_trace")  # methods


class UnsupportedDeepSpeedError(RuntimeError):
    """The installed DeepSpeed, or this engine's configuration, lacks what
    accord.deepspeed hooks; the message names each missing piece."""


def deepspeed_version() -> str:
    import deepspeed

    return deepspeed.__version__


def stage(engine) -> int:
    return int(engine.zero_optimization_stage())


class _Adapter:
    METHODS: Tuple[str, ...] = ()
    FIELDS: Tuple[str, ...] = ()

    def __init__(self, opt):
        self.opt = opt

    @classmethod
    def missing(cls, opt) -> List[str]:
        out = [f"{type(opt).__name__}.{m}" for m in _PATCHED + cls.METHODS
               if not callable(getattr(opt, m, None))]
        return out + [f"{type(opt).__name__}.{f}" for f in cls.FIELDS if not hasattr(opt, f)]

    def patch(self, name: str, fn) -> None:
        """Replaces `opt.<name>` on this instance (restored by unpatch)."""
        self.opt.__dict__[name] = fn

    def original(self, name: str):
        """The class's own method, bound to the optimizer."""
        return getattr(type(self.opt), name).__get__(self.opt)

    def unpatch(self) -> None:
        for name in _PATCHED:
            self.opt.__dict__.pop(name, None)

    @staticmethod
    def leaf_parameters(params) -> List[torch.nn.Parameter]:
        """Those of `params` reduced from a ZeRO-3 leaf module's backward hook
        (none under ZeRO-1/2)."""
        return []


class Zero12(_Adapter):
    METHODS = ("get_gradient_for_reduction", "_gradient_reduction_buffer_dtype",
               "is_gradient_accumulation_boundary", "reduce_ipg_grads", "get_param_id",
               "get_param_gradient_attribute", "_use_compact_grad_partition_buffer",
               "_get_compact_grad_partition_slice")
    FIELDS = ("bit16_groups", "partition_gradients", "use_grad_accum_attribute", "overlap_comm",
              "dp_process_group", "is_param_in_current_partition", "grad_start_offset",
              "partition_size", "real_dp_process_group",
              "grad_partition_insertion_offset", "single_partition_of_fp32_groups")

    @classmethod
    def missing(cls, opt) -> List[str]:
        out = super().missing(opt)
        if not out and any(not hasattr(p, "_hp_mapping") for g in opt.bit16_groups for p in g):
            out.append("parameter._hp_mapping")
        return out

    def param_groups(self) -> List[List[torch.nn.Parameter]]:
        """The optimizer's parameter groups, in DeepSpeed's order (the same on every rank)."""
        return [list(g) for g in self.opt.bit16_groups]

    def gradient(self, param) -> Optional[torch.Tensor]:
        """The gradient DeepSpeed would reduce for `param` (its accumulation
        attribute where DeepSpeed keeps one), or None."""
        return self.opt.get_gradient_for_reduction(param)

    def zero_fill(self, param) -> None:
        """A zero gradient where DeepSpeed reads it, in DeepSpeed's gradient dtype."""
        zeros = torch.zeros(param.shape, dtype=self.opt._gradient_reduction_buffer_dtype(),
                            device=param.device)
        if self.opt.use_grad_accum_attribute:
            param.grad_accum = zeros
        else:
            param.grad = zeros

    def reduce(self, reduce_ready, param, group_index: int) -> None:
        reduce_ready(param, group_index)

    def reduces_now(self) -> bool:
        """Whether this backward's epilogue reduces: every backward with
        partitioned gradients (ZeRO-2), else at the accumulation boundary."""
        return bool(self.opt.partition_gradients or self.opt.is_gradient_accumulation_boundary())

    def reduces_in_hooks(self) -> bool:
        """Whether DeepSpeed reduces from the gradient hooks (ZeRO-2, or
        ZeRO-1 with overlap_comm at the boundary); ZeRO-1 without it reduces
        only from the boundary's epilogue."""
        return bool(self.opt.partition_gradients or self.opt.overlap_comm)

    def grad_dtype(self) -> torch.dtype:
        return self.opt._gradient_reduction_buffer_dtype()

    @staticmethod
    def numel(param) -> int:
        return param.numel()

    def take(self, param) -> Optional[torch.Tensor]:
        """This rank's gradient of a parameter DeepSpeed never reduced, removed
        from where DeepSpeed would read it."""
        g = self.gradient(param)
        param.grad = None
        if self.opt.use_grad_accum_attribute:
            param.grad_accum = None
        return g

    def flush(self) -> None:
        """DeepSpeed reduces its last bucket now (its epilogue then finds it empty)."""
        self.opt.reduce_ipg_grads()

    def reduction_key(self, group_index: int) -> int:
        """The first parameter group DeepSpeed reduces over the same process
        group as `group_index`: the data-parallel group, or, for a group of
        DeepSpeed's MoE experts, its expert-data-parallel group (one per
        expert group name). The same on every rank."""
        groups = self.opt.real_dp_process_group
        return next(j for j, g in enumerate(groups) if g is groups[group_index])

    def all_reduce_mean(self, flat: torch.Tensor, group_index: Optional[int] = None) -> None:
        """Sum over the ranks that reduce parameter group `group_index`
        (None: DeepSpeed's data-parallel group), divided by the
        data-parallel size, as DeepSpeed averages a bucket, expert
        gradients included (stage_1_and_2.py `average_tensor`)."""
        import torch.distributed as dist

        dp = self.opt.dp_process_group
        group = dp if group_index is None else self.opt.real_dp_process_group[group_index]
        flat.div_(dist.get_world_size(group=dp))
        if dist.get_world_size(group=group) > 1:
            dist.all_reduce(flat, group=group)

    def add_reduced(self, param, group_index: int, reduced: torch.Tensor) -> int:
        """Adds an already reduced gradient of `param` into what DeepSpeed
        reduced for it this backward, for this rank's partition only: its
        bf16 compact partition slice, or the parameter's gradient attribute
        (set where DeepSpeed holds none). Returns the elements added."""
        opt, i = self.opt, group_index
        pid = opt.get_param_id(param)
        if opt._use_compact_grad_partition_buffer(i):
            part = opt.real_dp_process_group[i]
            import torch.distributed as dist

            rank = dist.get_rank(group=part)
            start = opt.grad_start_offset[i][rank].get(pid)
            if start is None:
                return 0
            n = int(min(param.numel() - int(start), int(opt.partition_size[i]) -
                        int(opt.grad_partition_insertion_offset[i][rank][pid])))
            out = opt._get_compact_grad_partition_slice(i, rank, pid, n)
            out.add_(reduced.reshape(-1).narrow(0, int(start), n).to(out.dtype))
            return n
        if not opt.is_param_in_current_partition[pid]:
            return 0
        have = opt.get_param_gradient_attribute(param)
        if have is None:
            value = reduced.reshape(param.shape).to(self.grad_dtype())
            if opt.use_grad_accum_attribute:
                param.grad_accum = value
            else:
                param.grad = value
        else:
            have.add_(reduced.reshape(have.shape).to(have.dtype))
        return param.numel()

    def boundary(self) -> bool:
        return bool(self.opt.is_gradient_accumulation_boundary())

    def clear_partition(self, param) -> None:
        """Nothing: DeepSpeed rebuilds the flat gradient partition at each
        boundary, with zeros for parameters it did not reduce."""

    def pin(self, modules) -> None:
        """Nothing: ZeRO-1/2 fetch no parameters in the forward."""

    def unpin(self) -> None:
        pass

    def state_slices(self, param) -> List[torch.Tensor]:
        """Views of `param`'s slice of this rank's fp32 partition and of each
        optimizer state tensor shaped like it (Adam's moments); empty where
        this rank's partition holds none of `param`."""
        mapping = getattr(param, "_hp_mapping", None)
        if mapping is None:
            return []
        # Read from the optimizer's state, not the mapping's optim_fragment:
        # DeepSpeed links that after the first group's first step, so every
        # later group (weight-decay groups, MoE expert groups) links empty.
        flat = self.opt.single_partition_of_fp32_groups[mapping.param_group_index]
        where = mapping.hp_fragment_address
        state = self.opt.optimizer.state.get(flat, {})
        return [mapping.hp_fragment] + [v.narrow(0, where.start, where.numel)
                                        for v in state.values()
                                        if torch.is_tensor(v) and v.shape == flat.shape]


class EngineParts:
    """What accord.deepspeed reads of an engine (its module, its ZeRO optimizer,
    its stage), for callers that hold those but not the engine (the HF
    Trainer's callbacks)."""

    def __init__(self, module, optimizer):
        self.module = module
        self.optimizer = optimizer
        name = type(optimizer).__name__
        if name == "DeepSpeedZeroOptimizer_Stage3":
            self.stage = 3
        elif name == "DeepSpeedZeroOptimizer":
            self.stage = 2 if getattr(optimizer, "partition_gradients", False) else 1
        else:
            raise UnsupportedDeepSpeedError(
                f"accord.deepspeed: {name} is not a DeepSpeed ZeRO optimizer (ZeRO-1/2/3 "
                f"with DeepSpeed's ZeRO optimizers are supported)")

    def zero_optimization_stage(self) -> int:
        return self.stage


def probe(engine) -> _Adapter:
    """The adapter for the engine's optimizer, once every name accord hooks is
    there; raises UnsupportedDeepSpeedError naming what is missing."""
    version = deepspeed_version()
    s = stage(engine)
    if s not in (1, 2, 3):
        raise UnsupportedDeepSpeedError(
            f"accord.deepspeed: ZeRO stage {s} is not supported; use ZeRO-1, -2 or -3")
    if s == 3:
        from accord.deepspeed.zero3 import Zero3 as cls
    else:
        cls = Zero12
    opt = engine.optimizer
    missing = cls.missing(opt)
    if missing:
        raise UnsupportedDeepSpeedError(
            f"accord.deepspeed: DeepSpeed {version} with this configuration (ZeRO-{s}, "
            f"optimizer {type(opt).__name__}) lacks what accord hooks: {', '.join(missing)}; "
            f"supported: DeepSpeed {', '.join(SUPPORTED_DEEPSPEED)}, ZeRO-1/2/3 with "
            f"DeepSpeed's ZeRO optimizers")
    return cls(opt)
