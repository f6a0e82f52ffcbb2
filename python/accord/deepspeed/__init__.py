"""accord for DeepSpeed ZeRO: one call makes every rank issue the same
gradient reductions, whatever parameters its data used.

    import accord.deepspeed
    engine, optimizer, _, _ = deepspeed.initialize(model=model, ...)
    accord.deepspeed.install(engine)     # or install(engine, accord.connect(...))

Supported: ZeRO-1 and ZeRO-2 (fp32, bf16, fp16), gradient accumulation, on
the DeepSpeed versions in SUPPORTED_DEEPSPEED. ZeRO-3 is refused at install.
How it works and what it costs: docs/DEEPSPEED.md. Every private DeepSpeed
name is in accord.deepspeed.zero, checked at install; `uninstall()` restores
DeepSpeed's own methods.
"""

from __future__ import annotations

from accord.deepspeed.installation import Installation, Stats
from accord.deepspeed.zero import (  # noqa: F401
    SUPPORTED_DEEPSPEED,
    UnsupportedDeepSpeedError,
    deepspeed_version,
)


def install(engine, client_or_agreement=None, *, prefix: str = "deepspeed",
            timeout_s: float = 300.0, optional=()) -> Installation:
    """Hooks the gradient reduction of a ZeRO-1/2 engine (after
    deepspeed.initialize, before the first backward, on every rank).

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
    if engine.__dict__.get("_accord_installation") is not None:
        raise ValueError("accord.deepspeed.install: this engine is already hooked; call "
                         "installation.uninstall() first")
    if client_or_agreement is None:
        import accord

        client_or_agreement = accord.connect()
    agreement = as_agreement(client_or_agreement, timeout_s=timeout_s)
    inst = Installation(engine, adapter, agreement, prefix)
    batch = getattr(agreement, "register_all", None)
    if callable(batch):
        batch([inst.registration()])
    else:
        agreement.register(*inst.registration())
    modules = [engine.module.get_submodule(m) if isinstance(m, str) else m for m in optional]
    adapter.pin(modules)
    inst.hook()
    return inst


__all__ = ["Installation", "SUPPORTED_DEEPSPEED", "Stats", "UnsupportedDeepSpeedError",
           "deepspeed_version", "install"]
