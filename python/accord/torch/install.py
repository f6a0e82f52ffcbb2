"""accord.torch.install: hooks FSDP2's reduce path of one model."""

from __future__ import annotations

import os
from typing import Optional, Sequence

import torch

from accord.agreement import as_agreement
from accord.torch import configs, fsdp2, guarding
from accord.torch.group import HookedGroup
from accord.torch.installation import Installation
from accord.torch.optional import OptionalUnits, resolve


def _env_flag(name: str, default: bool = True) -> bool:
    raw = os.environ.get(name)
    if raw is None:
        return default
    return raw.strip().lower() not in ("0", "false", "off", "no")


def _check_existing(model, client_or_agreement, units):
    existing = model.__dict__.get("_accord_installation")
    if existing is None:
        return None
    same = existing.agreement is client_or_agreement or getattr(
        existing.agreement, "client", None) is client_or_agreement or client_or_agreement is None
    if not same:
        raise ValueError("accord.torch.install: this model is already hooked with another "
                         "client; call installation.uninstall() first")
    if [m for _, m in units] != [u.module for u in existing.optional
                                 if u.name not in existing.learned]:
        raise ValueError("accord.torch.install: this model is already hooked with other "
                         "optional units; call installation.uninstall() first")
    return existing


def _hook_groups(installation: Installation, model, prefix: str) -> None:
    param_names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    seen = set()
    for module_name, module in model.named_modules():
        if not fsdp2.is_fsdp_module(module):
            continue
        groups = fsdp2.param_groups(module)
        for gi, group in enumerate(groups):
            if id(group) in seen:
                continue  # fully_shard([a, b]): one state, listed under each member module
            seen.add(id(group))
            if group.__dict__.get("_accord_hook") is not None:
                raise ValueError(f"accord.torch.install: FSDP group of "
                                 f"'{module_name or '<root>'}' is already hooked by another "
                                 f"installation")
            base = f"{prefix}/{module_name or '<root>'}"
            group_id = base if len(groups) == 1 else f"{base}#{gi}"
            names = []
            for j, fp in enumerate(group.fsdp_params):
                n = param_names.get(id(fsdp2.sharded_param(fp)))
                names.append(n if n is not None else f"{module_name}.param{j}")
            hooked = HookedGroup(installation, group, group_id, names)
            fsdp2.set_method(group, "_accord_hook", hooked)
            fsdp2.set_method(group, "post_backward", hooked.post_backward)
            fsdp2.set_method(group, "pre_backward", hooked.pre_backward)
            installation.groups[group_id] = hooked
    if not installation.groups:
        raise ValueError("accord.torch.install: the model has no FSDP2 parameter groups; call "
                         "fully_shard(...) on it (and its submodules) first")


def _with_hint(e: BaseException, model, world_size: int) -> BaseException:
    """A registration that never completed, with why it may not (groups whose
    FSDP mesh is smaller than the job)."""
    waited = any(t in str(e) for t in ("DEADLINE_EXCEEDED", "not every rank registered"))
    hint = configs.registration_hint(model, world_size) if isinstance(
        e, Exception) and waited else ""
    if not hint:
        return e
    try:
        return type(e)(f"{e} [{hint}]")
    except Exception:  # noqa: BLE001 - an exception type that takes other arguments
        return e


def _checks(inst, agreement, prefix, timeout_s, guard, learn_optional, watch):
    """The collective-sequence guard and the step watch, each when asked for
    (or by default) with an accord client and more than one rank."""
    client = getattr(agreement, "client", None)
    many = client is not None and agreement.world_size > 1
    seq_guard = step_watch = None
    if guard is None:
        guard = _env_flag("ACCORD_TORCH_GUARD")
    if guard and many:
        from accord.torch.guard import SequenceGuard

        if learn_optional is None:
            learn_optional = _env_flag("ACCORD_TORCH_LEARN_OPTIONAL")
        seq_guard = SequenceGuard(client, agreement.rank, agreement.world_size,
                                  f"{prefix}/~collective-sequence", timeout_s,
                                  learner=inst.units if learn_optional else None,
                                  in_forward=fsdp2.in_forward)
    if watch is None:
        watch = _env_flag("ACCORD_TORCH_WATCH")
    if watch and many:
        from accord.torch.watchdog import StepWatch

        stall_s = float(os.environ.get("ACCORD_TORCH_STALL_S", "1.0"))
        step_watch = StepWatch(agreement, f"{prefix}/~step", timeout_s, stall_s=stall_s)
    return seq_guard, step_watch


def install(
    model: torch.nn.Module,
    client_or_agreement=None,
    *,
    prefix: str = "fsdp",
    timeout_s: float = 300.0,
    optional: Sequence = (),
    speculate: Optional[bool] = None,
    overlap: Optional[bool] = None,
    guard: Optional[bool] = None,
    learn_optional: Optional[bool] = None,
    watch: Optional[bool] = None,
) -> Installation:
    """Hooks FSDP2's reduce path of every FSDP parameter group in `model`.

    `client_or_agreement`: an accord client (accord.connect()), any
    accord.Agreement, or None for accord.connect() with its defaults. Call
    after fully_shard and before the model's first forward, on every rank.
    `optional`: FSDP units (modules or paths) whose forward may run a
    different number of times on different ranks. `speculate` (default on;
    ACCORD_TORCH_SPECULATE=0 turns it off; `overlap`, the earlier name, is
    accepted too) applies each group's previous decision at once and repairs
    after the real one arrives. `guard` (default on with an accord client and
    more than one rank; ACCORD_TORCH_GUARD=0) checks that every rank issues
    the same FSDP collectives; with `learn_optional` (default on;
    ACCORD_TORCH_LEARN_OPTIONAL=0) a unit whose forward runs on some ranks
    only from its first step becomes optional instead of an error. `watch`
    (default on with an accord client and more than one rank;
    ACCORD_TORCH_WATCH=0) names a rank that stops or dies mid-step on every
    other rank within the coordinator's deadline (accord.torch.watchdog).
    Idempotent for the same client and units; raises ValueError for another,
    UnsupportedTorchError for a torch whose FSDP2 accord.torch cannot hook,
    and accord.torch.configs.UnsupportedConfigurationError (a ValueError) for
    an FSDP2 configuration it cannot keep correct, then or when it is turned
    on later (python/README.md, "Configurations").
    """
    fsdp2.probe()
    units = resolve(model, optional)
    existing = _check_existing(model, client_or_agreement, units)
    if existing is not None:
        return existing
    for module in model.modules():
        if fsdp2.is_fsdp_module(module) and fsdp2.has_run_forward(module):
            raise ValueError(
                "accord.torch.install: the model has already run a forward under FSDP2; "
                "install accord right after fully_shard, before the first forward, on "
                "every rank (each group's step count must start at the same point)")
    configs.refuse(model, [name for name, _ in units])
    if client_or_agreement is None:
        import accord

        client_or_agreement = accord.connect()
    agreement = as_agreement(client_or_agreement, timeout_s=timeout_s)
    if speculate is None:
        speculate = overlap if overlap is not None else (
            _env_flag("ACCORD_TORCH_SPECULATE") and _env_flag("ACCORD_TORCH_OVERLAP"))
    speculate = bool(speculate)
    inst = Installation(model, agreement, prefix, speculate)
    _hook_groups(inst, model, prefix)
    try:
        configs.refuse_post_accumulate_grad_hooks(inst.groups.values(), "at install")
    except configs.UnsupportedConfigurationError:
        inst.uninstall()
        raise
    inst.units = OptionalUnits(inst)
    for name, module in units:
        inst.units.add(name, module)
    extra = inst.units.registrations() + [inst.late_registration(),
                                             inst.wire_registration()]
    seq_guard, step_watch = _checks(inst, agreement, prefix, timeout_s, guard, learn_optional,
                                    watch)
    if seq_guard is not None:
        extra.extend(seq_guard.registrations())
    if step_watch is not None:
        extra.append(step_watch.registration())
    try:
        inst.register_all(extra)
        inst.agree_wire_dtypes()
    except BaseException as e:
        if step_watch is not None:
            step_watch.close()
        inst.uninstall()
        raise _with_hint(e, model, agreement.world_size)
    if seq_guard is not None:
        seq_guard.registered()
    inst.guard, inst.watch = seq_guard, step_watch
    guarding.attach(inst)
    inst.hook_states()
    configs.watch(inst)
    fix_transformers_output_capture(model)
    model.__dict__["_accord_installation"] = inst
    return inst


def fix_transformers_output_capture(model: torch.nn.Module) -> int:
    """Lets `transformers` record hidden states inside FSDP units.

    transformers 5.x looks up which outputs a model can record by the name of
    the model's class; fully_shard swaps a unit's class for a subclass
    (`FSDPCLIPVisionModel`), so a vision tower sharded as its own unit stops
    returning hidden states and LLaVA-style models fail with "'NoneType' object
    is not subscriptable". This registers each such unit's class under its own
    name. Called by install(); safe to call again. Returns how many units it
    registered (0 without transformers).
    """
    import sys

    capture = sys.modules.get("transformers.utils.output_capturing")
    registry = getattr(capture, "_CAN_RECORD_REGISTRY", None)
    if registry is None:
        return 0
    count = 0
    for module in model.modules():
        flags = getattr(module, "_can_record_outputs", None)
        if fsdp2.is_fsdp_module(module) and flags and not registry.get(module):
            registry[module] = flags
            count += 1
    return count
