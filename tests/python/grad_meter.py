"""Live unsharded-gradient bytes of FSDP2 models, sampled where they peak.

GradMeter samples at every FSDP2 post-backward (its entry: the unit's new
gradient is there, nothing of it reduced yet) and every `foreach_reduce`
(its entry: the reduce-scatter's inputs, zeros included). A sample is the
bytes of every tensor still alive among all that were ever seen as an
unsharded gradient (FSDP2's `_unsharded_param.grad`, its
`unsharded_accumulated_grad`, or a reduce-scatter input), tracked through
weak references, so tensors held elsewhere (by accord, say) keep counting
as long as they live. One meter per process; it patches FSDP2's class and
module functions while it is open, so open it before accord.torch.install
(which captures the post-backward it hooks).
"""

from __future__ import annotations

import weakref


class GradMeter:
    def __init__(self):
        from torch.distributed.fsdp._fully_shard import _fsdp_param_group as pg

        self._pg = pg
        self._groups = []  # every FSDPParamGroup seen
        self._seen = {}  # id -> weakref of each tensor ever seen
        self.peak = 0
        self.samples = 0
        self._orig_post = pg.FSDPParamGroup.post_backward
        self._orig_reduce = pg.foreach_reduce
        meter = self

        def post_backward(group, *args, **kwargs):
            meter._note_group(group)
            meter.sample()
            return meter._orig_post(group, *args, **kwargs)

        def foreach_reduce(fsdp_params, unsharded_grads, *args, **kwargs):
            meter.sample(extra=unsharded_grads)
            return meter._orig_reduce(fsdp_params, unsharded_grads, *args, **kwargs)

        pg.FSDPParamGroup.post_backward = post_backward
        pg.foreach_reduce = foreach_reduce

    def close(self) -> None:
        self._pg.FSDPParamGroup.post_backward = self._orig_post
        self._pg.foreach_reduce = self._orig_reduce

    def _note_group(self, group) -> None:
        if all(g is not group for g in self._groups):
            self._groups.append(group)

    def watch(self, module) -> None:
        """Scans every FSDP2 group of `module` at each sample."""
        from torch.distributed.fsdp import FSDPModule

        from accord.torch.fsdp2.state import param_groups

        for m in module.modules():
            if isinstance(m, FSDPModule):
                for g in param_groups(m):  # torch 2.13's list, or one group before it
                    self._note_group(g)

    def _track(self, t) -> None:
        if t is None:
            return
        t = getattr(t, "_local_tensor", t)
        key = id(t)
        ref = self._seen.get(key)
        if ref is None or ref() is not t:
            self._seen[key] = weakref.ref(t)

    def sample(self, extra=()) -> int:
        for g in self._groups:
            for fp in g.fsdp_params:
                self._track(fp.unsharded_accumulated_grad)
                up = getattr(fp, "_unsharded_param", None)
                if up is not None:
                    self._track(up.grad)
        for t in extra:
            self._track(t)
        live, storages, dead = 0, set(), []
        for key, ref in self._seen.items():
            t = ref()
            if t is None:
                dead.append(key)
                continue
            ptr = t.untyped_storage().data_ptr()
            if ptr in storages or t.untyped_storage().nbytes() == 0:
                continue
            storages.add(ptr)
            live += t.untyped_storage().nbytes()
        for key in dead:
            del self._seen[key]
        self.samples += 1
        self.peak = max(self.peak, live)
        return live

    def reset(self) -> None:
        """Starts a new peak (between steps); forgets dead tensors."""
        self.peak = 0
        self.sample()
        self.peak = 0
