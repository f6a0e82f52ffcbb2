"""install(): accord.torch's entry point. It checks the model and the
arguments, resolves the defaults (accord.torch.options), returns the
model's existing installation for the same client and units, and otherwise
builds an Installation (accord.torch.installation) and registers it."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from accord.agreement import as_agreement
from accord.torch import configs, fsdp2
from accord.torch.installation import Installation
from accord.torch.optional import resolve
from accord.torch.options import default_client, env_flag, speculate_flag
from accord.torch.transformers_capture import fix_transformers_output_capture


def _existing(model, client_or_agreement, units):
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
    accord.Agreement, or None for accord.connect() with its defaults (one
    per process: every stage module of a pipeline shares it). Each group is
    agreed among the ranks of its FSDP mesh (docs/MEMBERS.md). Call after
    fully_shard and before the model's first forward, on every rank.
    `optional`: FSDP units (modules or paths) whose forward may run a
    different number of times on different ranks. `speculate` (default on;
    ACCORD_TORCH_SPECULATE=0 turns it off; `overlap` is a deprecated name)
    applies each group's previous decision at once and repairs after the
    real one arrives. `guard` (default on with an accord client and more
    than one rank; ACCORD_TORCH_GUARD=0) checks that every rank issues the
    same FSDP collectives; with `learn_optional` (default on;
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
    existing = _existing(model, client_or_agreement, units)
    if existing is not None:
        return existing
    if any(fsdp2.is_fsdp_module(m) and fsdp2.has_run_forward(m) for m in model.modules()):
        raise ValueError(
            "accord.torch.install: the model has already run a forward under FSDP2; "
            "install accord right after fully_shard, before the first forward, on "
            "every rank (each group's step count must start at the same point)")
    configs.refuse(model)
    if client_or_agreement is None:
        client_or_agreement = default_client()
    agreement = as_agreement(client_or_agreement, timeout_s=timeout_s)
    inst = Installation(
        model, agreement, prefix=prefix, speculate=speculate_flag(speculate, overlap),
        optional=units, timeout_s=timeout_s,
        guard=env_flag("ACCORD_TORCH_GUARD") if guard is None else guard,
        learn_optional=(env_flag("ACCORD_TORCH_LEARN_OPTIONAL") if learn_optional is None
                        else learn_optional),
        watch=env_flag("ACCORD_TORCH_WATCH") if watch is None else watch)
    try:
        inst.register()
    except BaseException:
        inst.uninstall()
        raise
    fix_transformers_output_capture(model)
    model.__dict__["_accord_installation"] = inst
    return inst
