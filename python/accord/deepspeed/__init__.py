"""accord for DeepSpeed ZeRO: one call makes every rank issue the same
collectives, whatever parameters its data used.

    import accord.deepspeed
    engine, optimizer, _, _ = deepspeed.initialize(model=model, ...)
    accord.deepspeed.install(engine)                      # ZeRO-1/2
    accord.deepspeed.install(engine, optional=["tower"])  # ZeRO-3: modules run on some ranks only

ZeRO-1, -2 and -3 on the DeepSpeed versions in SUPPORTED_DEEPSPEED, with
DeepSpeed's ZeRO optimizers (tested: fp32, bf16, gradient accumulation,
engine.coalesce_grad_reduction()). How it works and what it costs: docs/DEEPSPEED.md. Every private DeepSpeed
name is in accord.deepspeed.zero, checked at install; `uninstall()` restores
DeepSpeed's own methods.
"""

from __future__ import annotations

import os

from accord.deepspeed.installation import Installation, Stats
from accord.deepspeed.zero import (  # noqa: F401
    SUPPORTED_DEEPSPEED,
    EngineParts,
    UnsupportedDeepSpeedError,
    deepspeed_version,
)


def install(engine, client_or_agreement=None, *, prefix: str = "deepspeed",
            timeout_s: float = 300.0, optional=(), watch=None) -> Installation:
    """Hooks the gradient reduction (and, ZeRO-3, the fetch of `optional`
    modules) of a ZeRO engine (or EngineParts(module, zero_optimizer)), after
    deepspeed.initialize and before the first forward, on every rank.

    `client_or_agreement`: an accord client (accord.connect()), any
    accord.Agreement, or None for accord.connect() with its defaults (the
    embedded daemons under torchrun or the deepspeed launcher). Raises
    UnsupportedDeepSpeedError naming what this DeepSpeed or configuration
    lacks; ValueError when the engine is already hooked. `optional` (ZeRO-3):
    modules (or their paths in engine.module) whose forward runs on some
    ranks only; their parameters become persistent and are all-gathered at
    install on every rank, with every other persistent parameter."""
    from accord.agreement import as_agreement
    from accord.deepspeed import zero

    adapter = zero.probe(engine)
    modules = [engine.module.get_submodule(m) if isinstance(m, str) else m for m in optional]
    if modules and zero.stage(engine) != 3:
        raise ValueError("accord.deepspeed.install: optional= is for ZeRO-3 (ZeRO-1/2 fetch no "
                         "parameters in the forward)")
    if engine.__dict__.get("_accord_installation") is not None:
        raise ValueError("accord.deepspeed.install: this engine is already hooked; call "
                         "installation.uninstall() first")
    if client_or_agreement is None:
        import accord

        client_or_agreement = accord.connect()
    agreement = as_agreement(client_or_agreement, timeout_s=timeout_s)
    step_watch = None
    if watch is None:
        watch = os.environ.get("ACCORD_DEEPSPEED_WATCH", "1").strip().lower() not in (
            "0", "false", "off", "no")
    if watch and getattr(agreement, "client", None) is not None and agreement.world_size > 1:
        from accord.torch.watchdog import StepWatch

        stall_s = float(os.environ.get("ACCORD_TORCH_STALL_S", "1.0"))
        step_watch = StepWatch(agreement, f"{prefix}/~step", timeout_s, stall_s=stall_s)
    inst = Installation(engine, adapter, agreement, prefix, step_watch)
    regs = [inst.registration()] + ([step_watch.registration()] if step_watch else [])
    try:
        batch = getattr(agreement, "register_all", None)
        if callable(batch):
            batch(regs)
        else:
            for r in regs:
                agreement.register(*r)
    except BaseException:
        if step_watch is not None:
            step_watch.close()
        raise
    adapter.pin(modules)
    inst.hook()
    return inst


__all__ = ["EngineParts", "Installation", "SUPPORTED_DEEPSPEED", "Stats", "UnsupportedDeepSpeedError",
           "deepspeed_version", "install"]
