"""Routes FSDP2's all-gathers of an installation's groups to its
SequenceGuard (recorded where FSDP2 issues them, through its one all-gather
entry point, patched while any installation is attached) and to its step
watch (progress); reduce-scatters are recorded where accord releases them
(accord.torch.group), each step's start at the root's pre-forward."""

from __future__ import annotations

from typing import Dict, Tuple

from accord.torch import fsdp2
from accord.torch.group import dtype_name

# FSDP parameter (id) -> (installation, unit path, group, HookedGroup), for every attached
# installation.
_GUARDED: Dict[int, tuple] = {}
_ENTRIES: Dict[Tuple[int, int, object], str] = {}  # (group, params, dtype) -> record text


def _guard_of(fsdp_params):
    for fp in fsdp_params:
        found = _GUARDED.get(id(fp))
        if found is not None:
            return found
    return None


def _route(original):
    def all_gather(fsdp_params, *args, **kwargs):
        found = _guard_of(fsdp_params)
        if found is None:
            return original(fsdp_params, *args, **kwargs)
        inst, unit, group, hooked = found
        # The release points before and after each all-gather (the backward's
        # reduce-scatters go between them, accord.torch.release).
        inst.before_all_gather(hooked)
        dtype = fsdp2.all_gather_dtype(fsdp_params[0])
        key = (id(group), len(fsdp_params), dtype)
        entry = _ENTRIES.get(key)
        if entry is None:
            numel = sum(fsdp2.param_shape(fp)[1] for fp in fsdp_params)
            entry = _ENTRIES[key] = f"all-gather of '{unit}' ({numel} x {dtype_name(dtype)})"
        guard, watch = inst.guard, inst.watch
        if watch is not None:
            watch.progress(entry)
        if guard is not None and guard.record(entry, unit, group):
            return None  # the unit was all-gathered and pinned instead (learned)
        try:
            result = original(fsdp_params, *args, **kwargs)
        except RuntimeError as e:  # a peer stopped: say why, if accord knows
            inst.explain(e)
            raise
        inst.after_all_gather(hooked)
        return result

    return all_gather


def _route_copy_out(original):
    # FSDP2 issues its all-gathers asynchronously and waits for them in the
    # copy-out: a peer that stopped or died shows there, not in the call above.
    def copy_out(all_gather_result, fsdp_params, *args, **kwargs):
        try:
            return original(all_gather_result, fsdp_params, *args, **kwargs)
        except RuntimeError as e:  # a peer stopped: say why, if accord knows
            found = _guard_of(fsdp_params)
            if found is not None:
                found[0].explain(e)
            raise

    return copy_out


def attach(installation) -> None:
    """Routes the installation's all-gathers; its guard and watch (either may
    be None) hear of each step's start first (a prepended root pre-forward)."""
    for h in installation.groups.values():
        for fp in h.group.fsdp_params:
            _GUARDED[id(fp)] = (installation, h.unit, h.group, h)
    fsdp2.patch_all_gather(_route, _route_copy_out)

    def begin_step(module, args):
        if not fsdp2.in_backward():
            installation.begin_forward()
            if installation.watch is not None:
                installation.watch.begin_step(installation.release_index)
            if installation.guard is not None:
                installation.guard.begin_step()
        return None

    # Prepended: before FSDP2's root pre-forward and its all-gather.
    installation._handles.append(
        installation.model.register_forward_pre_hook(begin_step, prepend=True))
    installation.attached = True


def detach(installation) -> None:
    if not getattr(installation, "attached", False):
        return
    for h in installation.groups.values():
        for fp in h.group.fsdp_params:
            _GUARDED.pop(id(fp), None)
            _ENTRIES.pop((id(h.group), len(h.group.fsdp_params), fsdp2.all_gather_dtype(fp)),
                         None)
    fsdp2.unpatch_all_gather()
    installation.attached = False
    for part in ("guard", "watch"):
        if getattr(installation, part) is not None:
            getattr(installation, part).close()
            setattr(installation, part, None)
