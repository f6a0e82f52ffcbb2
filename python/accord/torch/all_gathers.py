"""FSDP2's all-gathers of an installation's groups, routed to the backward's
release points (accord.torch.release), the collective-sequence guard and the
step watch, through FSDP2's one all-gather entry point (patched while any
installation is attached); each step's start at the root's pre-forward.
Reduce-scatters are recorded where accord releases them (accord.torch.group)."""

from __future__ import annotations

from accord.torch import fsdp2
from accord.torch.turn import dtype_name


def _entry(hooked, params) -> str:
    """The guard's record of one all-gather of the group (cached per shape)."""
    dtype = fsdp2.all_gather_dtype(params[0])
    key = (len(params), dtype)
    entry = hooked.all_gather_entries.get(key)
    if entry is None:
        numel = sum(fsdp2.param_shape(fp)[1] for fp in params)
        entry = hooked.all_gather_entries[key] = (
            f"all-gather of '{hooked.unit}' ({numel} x {dtype_name(dtype)})")
    return entry


def _route(original):
    def all_gather(params, *args, **kwargs):
        hooked = fsdp2.all_gather_owner(params)
        if hooked is None:
            return original(params, *args, **kwargs)
        inst = hooked.installation
        # The release points before and after each all-gather of the backward
        # (its reduce-scatters go between them, accord.torch.release).
        release = inst.release_now()
        if release is not None:
            release.before_all_gather(hooked)
        entry = _entry(hooked, params)
        if inst.watch is not None:
            inst.watch.progress(entry)
        if inst.guard is not None and inst.guard.record(entry, hooked.unit, hooked.group):
            return None  # the unit was all-gathered and pinned instead (learned)
        try:
            result = original(params, *args, **kwargs)
        except RuntimeError as e:  # a peer stopped: say why, if accord knows
            inst.explain(e)
            raise
        if release is not None:
            release.after_all_gather(hooked)
        return result

    return all_gather


def _route_copy_out(original):
    # FSDP2 issues its all-gathers asynchronously and waits for them in the
    # copy-out: a peer that stopped or died shows there, not in the call above.
    def copy_out(all_gather_result, params, *args, **kwargs):
        try:
            return original(all_gather_result, params, *args, **kwargs)
        except RuntimeError as e:  # a peer stopped: say why, if accord knows
            hooked = fsdp2.all_gather_owner(params)
            if hooked is not None:
                hooked.installation.explain(e)
            raise

    return copy_out


class Routes:
    """The installation's all-gathers routed, and its step start hooked
    (prepended to the root's pre-forward, before FSDP2's own and its
    all-gather); remove() undoes both."""

    def __init__(self, installation):
        self.groups = list(installation.groups.values())
        for h in self.groups:
            fsdp2.route_all_gathers(h.group, h)
        fsdp2.patch_all_gather(_route, _route_copy_out)
        self._hook = installation.model.register_forward_pre_hook(
            lambda module, args: installation.begin_step(), prepend=True)

    def remove(self) -> None:
        self._hook.remove()
        for h in self.groups:
            fsdp2.unroute_all_gathers(h.group)
        fsdp2.unpatch_all_gather()
