"""The private DeepSpeed names of ZeRO-3 (runtime/zero/stage3.py,
parameter_offload.py, partitioned_param_coordinator.py) that accord.deepspeed
reads or writes, checked by accord.deepspeed.zero.probe at install.

ZeRO-3: `fp16_groups`, `grad_position`,
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
For turns (accord.deepspeed.turns3): `backward_prologue` (the engine calls
it before autograd runs), `ipg_buckets` (each bucket's `params`),
`__reduce_and_partition_ipg_grads(dtype)` and `reduce_and_partition_stream`,
`_coalesce_grad_reduction`, `dtype`, `dp_process_group` (accord's own
all-reduces go there too: the agreed caps, learning, the repair),
`_get_param_partition_group`, a parameter's `ds_id`, `ds_numel`,
`partition_numel()`. With pinned modules: `step` (wrapped on the instance:
a step skipped for an overflow partitions every parameter and never reaches
`_post_step`, which gathers the persistent ones again).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from accord.deepspeed.zero import (_ALL_GATHER, _COORDINATOR, _FETCHED_FOR, _STEP_ID,
                                   _SUB_MODULE_FUNCTIONS, _TRACE, _Adapter)


_GRAD_PARTITION = "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition"
_REDUCE_BUCKET = "_DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads"


class Zero3(_Adapter):
    METHODS = ("reduce_independent_p_g_buckets_and_remove_grads", "get_param_id",
               "is_gradient_accumulation_boundary", "backward_prologue", _REDUCE_BUCKET,
               "_get_param_partition_group")
    FIELDS = ("fp16_groups", "grad_position", "fp32_partitioned_groups_flat",
              "persistent_parameters", "parameter_offload", _GRAD_PARTITION, "ipg_buckets",
              "dp_process_group", "dtype", "_coalesce_grad_reduction",
              "reduce_and_partition_stream")

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
        if self.pinned and "step" not in self.opt.__dict__:
            self._gather_after_skipped_steps()

    def _gather_after_skipped_steps(self) -> None:
        """DeepSpeed's ZeRO-3 `step` partitions every parameter first
        (`_partition_all_parameters`) and all-gathers the persistent ones
        again in `_post_step`, which a step skipped for an overflow (fp16's
        loss scaler; the overflow is all-reduced, so every rank skips) never
        reaches. DeepSpeed's own persistent parameters are fetched again at
        their next forward; the pinned ones, whose fetches are bypassed, are
        all-gathered here, after such a step, on every rank alike."""
        own = self.original("step")

        def step(*args, **kwargs):
            out = own(*args, **kwargs)
            gone = [p for p, _ in self.to_gather(self.pinned)]
            if gone:
                gone[0].all_gather(gone)
            return out

        self.opt.__dict__["step"] = step

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
        self.opt.__dict__.pop("step", None)
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
        `modules` modules), which it does while the trace is not complete
        (None: `reset_step` is left alone)."""
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
        if trace_check is not None:
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
        self.opt.__dict__.pop("backward_prologue", None)
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

    @staticmethod
    def leaf_parameters(params) -> List[torch.nn.Parameter]:
        """Those of `params` in ZeRO-3 leaf modules (set_z3_leaf_modules):
        DeepSpeed reduces them from the module's backward hook, each with a
        zero gradient where autograd gave it none."""
        from deepspeed.utils import z3_leaf_parameter

        return [p for p in params if z3_leaf_parameter(p)]

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
        """Every backward (ZeRO-3 reduce-scatters each), except those inside
        engine.coalesce_grad_reduction(), whose flush reduces them."""
        return not self.opt._coalesce_grad_reduction

    def reduces_in_hooks(self) -> bool:
        return True

    def grad_dtype(self) -> torch.dtype:
        return self.opt.dtype

    @staticmethod
    def numel(param) -> int:
        return int(param.ds_numel)

    def take(self, param) -> Optional[torch.Tensor]:
        g = param.grad
        param.grad = None
        return g

    @staticmethod
    def fetches_nothing(model) -> bool:
        """Whether every parameter of `model` is persistent (gathered for
        good): no forward or backward all-gathers anything."""
        return all(getattr(p, "ds_persist", False) for p in model.parameters())

    def in_bucket(self, param) -> bool:
        """Whether `param` is in one of DeepSpeed's reduce buckets (its
        gradient a view of the bucket, read when the bucket is reduced)."""
        return any(q is param for b in self.opt.ipg_buckets.values() for q in b.params)

    def flush(self) -> None:
        """DeepSpeed reduces its buckets now (its epilogue then finds them empty)."""
        from deepspeed.runtime.zero.stage3 import sort_dtypes

        for dtype in sort_dtypes(self.opt.ipg_buckets.keys()):
            getattr(self.opt, _REDUCE_BUCKET)(dtype)
        from deepspeed.accelerator import get_accelerator

        if not get_accelerator().resolves_data_dependency():
            self.opt.reduce_and_partition_stream.synchronize()

    @staticmethod
    def reduction_key(group_index: int) -> int:
        """One process group: DeepSpeed refuses its MoE layer under ZeRO-3."""
        return 0

    def all_reduce_mean(self, flat: torch.Tensor, group_index: Optional[int] = None) -> None:
        import torch.distributed as dist

        group = self.opt.dp_process_group
        flat.div_(dist.get_world_size(group=group))
        dist.all_reduce(flat, group=group)

    def all_reduce_max(self, t: torch.Tensor) -> None:
        import torch.distributed as dist

        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.opt.dp_process_group)

    def all_reduce_min(self, t: torch.Tensor) -> None:
        import torch.distributed as dist

        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.opt.dp_process_group)

    def add_reduced(self, param, group_index: int, reduced: torch.Tensor) -> int:
        """Adds this rank's partition of an already reduced full gradient of
        `param` into DeepSpeed's gradient partition of it. Returns the
        elements added."""
        import torch.distributed as dist

        part = getattr(self.opt, _GRAD_PARTITION).get(param.ds_id)
        if part is None:
            return 0
        rank = dist.get_rank(group=self.opt._get_param_partition_group(param))
        size = int(param.partition_numel())
        n = max(0, min(size, int(param.ds_numel) - rank * size))
        if n:
            part.narrow(0, 0, n).add_(reduced.reshape(-1).narrow(0, rank * size, n).to(part.dtype))
        return n

    def on_backward(self, fn) -> None:
        """fn() at the start of each backward (the optimizer's
        `backward_prologue`, called by the engine before autograd runs)."""
        own = self.original("backward_prologue")

        def prologue(*args, **kwargs):
            fn()
            return own(*args, **kwargs)

        self.opt.__dict__["backward_prologue"] = prologue

    @staticmethod
    def gather_key(gathered) -> tuple:
        """An all-gather's parameters by DeepSpeed's ids: the same on every rank."""
        return tuple(sorted(int(p.ds_id) for p, _ in gathered))

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
