"""Every private DeepSpeed name accord.deepspeed reads or writes, and nowhere
else. `probe(engine)` checks them on the installed DeepSpeed at install and
names each one missing, so a DeepSpeed release that moves them breaks here,
loudly. One adapter per optimizer: `Zero12` (`DeepSpeedZeroOptimizer`) and
`Zero3` (`DeepSpeedZeroOptimizer_Stage3`), with the same methods.

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
ZeRO-1/2: `bit16_groups`, `partition_gradients`, `use_grad_accum_attribute`,
`get_gradient_for_reduction`, `_gradient_reduction_buffer_dtype`,
`is_gradient_accumulation_boundary`, a parameter's `_hp_mapping`
(utils/tensor_fragment.py). ZeRO-3: `fp16_groups`, `grad_position`,
`fp32_partitioned_groups_flat`, `get_param_id`, `persistent_parameters`,
`__param_id_to_grad_partition`, `reduce_independent_p_g_buckets_and_remove_grads`,
a parameter's `ds_shape`, `ds_persist`, `all_gather`; the `parameter_offload`'s
four sub-module functions (`pre_sub_module_forward_function`, ...), through
which every module's forward and backward fetch and release go and its
coordinator records the module trace that `reset_step` requires to be the
same on every rank (`assert_ints_same_as_other_ranks`), and
`parameter_offload.FWD_MODULE_STACK`; the coordinator
(`parameter_offload.get_param_coordinator()`) and its
`__all_gather_params(params, forward)`, through which every fetch and
prefetch all-gathers, only the parameters whose `ds_status` is
`ZeroParamStatus.NOT_AVAILABLE` (partition_parameters.py), `ds_numel` each;
its `reset_step()` (at each forward's start), which while
`is_complete_trace()` is False compares the module trace `__submodule_order`
across ranks with collectives (`assert_ints_same_as_other_ranks`).
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


class Zero12(_Adapter):
    METHODS = ("get_gradient_for_reduction", "_gradient_reduction_buffer_dtype",
               "is_gradient_accumulation_boundary")
    FIELDS = ("bit16_groups", "partition_gradients", "use_grad_accum_attribute")

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
        linker = getattr(self.opt, "_lazy_init_hp_params_optimizer_state", None)
        if callable(linker) and self.opt.optimizer.state:
            linker()  # DeepSpeed links the state lazily, after the first step
        mapping = getattr(param, "_hp_mapping", None)
        if mapping is None:
            return []
        out = [mapping.hp_fragment]
        optim = getattr(mapping, "optim_fragment", None) or {}
        return out + [v for v in optim.values() if torch.is_tensor(v)]


class Zero3(_Adapter):
    METHODS = ("reduce_independent_p_g_buckets_and_remove_grads", "get_param_id",
               "is_gradient_accumulation_boundary")
    FIELDS = ("fp16_groups", "grad_position", "fp32_partitioned_groups_flat",
              "persistent_parameters", "parameter_offload",
              "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition")

    @classmethod
    def missing(cls, opt) -> List[str]:
        out = super().missing(opt)
        offload = getattr(opt, "parameter_offload", None)
        if offload is not None:
            out += [f"{type(offload).__name__}.{f}" for f in _SUB_MODULE_FUNCTIONS
                    if not callable(getattr(offload, f, None))]
            import deepspeed.runtime.zero.parameter_offload as po

            if not isinstance(getattr(po, "FWD_MODULE_STACK", None), list):
                out.append("deepspeed.runtime.zero.parameter_offload.FWD_MODULE_STACK")
            get = getattr(offload, "get_param_coordinator", None)
            coordinator = get() if callable(get) else None
            if coordinator is None:
                out.append(f"{type(offload).__name__}.get_param_coordinator")
            else:
                name = type(coordinator).__name__
                out += [f"{name}.{m.replace('_PartitionedParameterCoordinator', '')}"
                        for m in _COORDINATOR if not callable(getattr(type(coordinator), m, None))]
                out += [f"{name}.{f.replace('_PartitionedParameterCoordinator', '')}"
                        for f in (_TRACE, _STEP_ID, _FETCHED_FOR) if not hasattr(coordinator, f)]
            import deepspeed.runtime.zero.partition_parameters as pp

            if not hasattr(getattr(pp, "ZeroParamStatus", None), "NOT_AVAILABLE"):
                out.append("deepspeed.runtime.zero.partition_parameters.ZeroParamStatus")
        return out

    def __init__(self, opt):
        super().__init__(opt)
        self.pinned: List[torch.nn.Parameter] = []  # made persistent by accord
        self.bypassed: set = set()  # ids of the pinned modules and their descendants
        self.routed = None  # the coordinator whose all-gathers go through route()

    def pin(self, modules) -> None:
        """Makes the parameters of `modules` persistent (`ds_persist`: never
        released after a forward or backward, all-gathered again after each
        step by DeepSpeed's `_post_step`), then all-gathers every persistent
        parameter not yet gathered, now, on every rank alike: no forward or
        backward fetch of them ever follows one rank's data."""
        persistent = self.opt.persistent_parameters
        for m in modules:
            for p in m.parameters():
                if not p.ds_persist:
                    p.ds_persist = True
                    persistent.append(p)
                    self.pinned.append(p)
        if persistent:
            persistent[0].all_gather(persistent)
        self.bypassed |= {id(d) for m in modules for d in m.modules()}
        if self.bypassed:
            self._bypass_sub_module_functions()

    def _bypass_sub_module_functions(self) -> None:
        """A pinned module's forward and backward skip DeepSpeed's per-module
        fetch, release and trace: its parameters are all there on every rank,
        and the module trace (which every rank must record alike) leaves it
        out on every rank."""
        import deepspeed.runtime.zero.parameter_offload as po

        offload = self.opt.parameter_offload
        for name in _SUB_MODULE_FUNCTIONS:
            own = getattr(type(offload), name).__get__(offload)
            pushes = name == "pre_sub_module_forward_function"

            def bypass(sub_module, own=own, pushes=pushes):
                if id(sub_module) not in self.bypassed:
                    return own(sub_module)
                if pushes:  # the forward hook's post pops it
                    po.FWD_MODULE_STACK.append(sub_module)
                return None

            offload.__dict__[name] = bypass

    def unpin(self) -> None:
        persistent = self.opt.persistent_parameters
        for p in self.pinned:
            p.ds_persist = False
            if any(q is p for q in persistent):
                persistent.remove(p)
        self.pinned.clear()
        offload = getattr(self.opt, "parameter_offload", None)
        if offload is not None:
            for name in _SUB_MODULE_FUNCTIONS:
                offload.__dict__.pop(name, None)
        self.bypassed = set()

    def route_all_gathers(self, route, trace_check) -> None:
        """route(params, forward, issue) runs in place of each parameter
        all-gather of the forward's and backward's fetches and prefetches
        (issue(): DeepSpeed's own); trace_check(modules) just before
        `reset_step` compares the ranks' module traces (this rank's has
        `modules` modules), which it does while the trace is not complete."""
        coordinator = self.opt.parameter_offload.get_param_coordinator()
        own = getattr(type(coordinator), _ALL_GATHER).__get__(coordinator)
        reset = type(coordinator).reset_step.__get__(coordinator)

        def all_gather(params, forward):
            return route(params, forward, lambda: own(params, forward))

        def reset_step():
            if not coordinator.is_complete_trace():
                trace_check(len(getattr(coordinator, _TRACE)))
            return reset()

        coordinator.__dict__[_ALL_GATHER] = all_gather
        coordinator.__dict__["reset_step"] = reset_step
        self.routed = coordinator

    def recording_trace(self) -> bool:
        """Whether the coordinator records this step's module trace (step 0)."""
        return self.routed is not None and bool(self.routed.is_record_trace())

    def forget_fetch(self, module) -> None:
        """The fetch of `module` under way was pinned instead: its entry in
        the module trace being recorded, and the step id its end adds, are
        taken back, so the trace is what a rank that never ran it records."""
        c = self.routed
        order = getattr(c, _TRACE)
        if isinstance(order, list) and order and order[-1] is module:
            order.pop()
            getattr(c, _FETCHED_FOR)[module.ds_id].pop()
            setattr(c, _STEP_ID, getattr(c, _STEP_ID) - 1)

    def unpatch(self) -> None:
        super().unpatch()
        if self.routed is not None:
            for name in (_ALL_GATHER, "reset_step"):
                self.routed.__dict__.pop(name, None)
            self.routed = None

    @staticmethod
    def to_gather(params) -> List[Tuple[torch.nn.Parameter, int]]:
        """Those of `params` that an all-gather of them fetches (not there
        yet), each with its full element count."""
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        return [(p, p.ds_numel) for p in params if p.ds_status == ZeroParamStatus.NOT_AVAILABLE]

    def param_groups(self) -> List[List[torch.nn.Parameter]]:
        return [list(g) for g in self.opt.fp16_groups]

    def gradient(self, param) -> Optional[torch.Tensor]:
        return param.grad

    def zero_fill(self, param) -> None:
        """A full-size zero gradient on a partitioned parameter: torch checks a
        gradient's shape against the parameter's, so the parameter briefly
        holds a stride-0 view of the full shape (no memory)."""
        zeros = torch.zeros(param.ds_shape, dtype=param.dtype, device=param.device)
        data = param.data
        param.data = torch.zeros((), dtype=param.dtype, device=param.device).expand(param.ds_shape)
        try:
            param.grad = zeros
        finally:
            param.data = data

    def reduce(self, reduce_ready, param, group_index: int) -> None:
        reduce_ready(param)

    def reduces_now(self) -> bool:
        return True  # ZeRO-3 reduce-scatters every backward

    def clear_partition(self, param) -> None:
        """Zeroes `param`'s slice of the flat gradient partition, which keeps
        the last reduced value when a backward does not reduce it."""
        parts = self.opt._DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition
        part = parts.get(param.ds_id)
        if part is not None:
            part.zero_()

    def boundary(self) -> bool:
        return bool(self.opt.is_gradient_accumulation_boundary())

    def state_slices(self, param) -> List[torch.Tensor]:
        pos = self.opt.grad_position.get(self.opt.get_param_id(param))
        if pos is None or pos[2] == 0:
            return []
        group, offset, numel = pos
        flat = self.opt.fp32_partitioned_groups_flat[group]
        out = [flat.narrow(0, offset, numel)]
        state = self.opt.optimizer.state.get(flat, {})
        out += [v.narrow(0, offset, numel) for v in state.values()
                if torch.is_tensor(v) and v.shape == flat.shape]
        return out


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
    cls = Zero3 if s == 3 else Zero12
    opt = engine.optimizer
    missing = cls.missing(opt)
    if missing:
        raise UnsupportedDeepSpeedError(
            f"accord.deepspeed: DeepSpeed {version} with this configuration (ZeRO-{s}, "
            f"optimizer {type(opt).__name__}) lacks what accord hooks: {', '.join(missing)}; "
            f"supported: DeepSpeed {', '.join(SUPPORTED_DEEPSPEED)}, ZeRO-1/2/3 with "
            f"DeepSpeed's ZeRO optimizers")
    return cls(opt)
