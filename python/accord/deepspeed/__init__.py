"""accord for DeepSpeed ZeRO: one call makes every rank issue the same
collectives, whatever parameters its data used.

    import accord.deepspeed
    engine, optimizer, _, _ = deepspeed.initialize(model=model, ...)
    accord.deepspeed.install(engine)                      # ZeRO-1/2
    accord.deepspeed.install(engine, optional=["tower"])  # ZeRO-3: modules run on some ranks only

ZeRO-1, -2 and -3 on the DeepSpeed versions in SUPPORTED_DEEPSPEED, with
DeepSpeed's ZeRO optimizers (tested: fp32, bf16, gradient accumulation,
engine.coalesce_grad_reduction(); ZeRO-1/2 with DeepSpeed's MoE layer, expert
gradients repaired over their expert-data-parallel group). How it works and
what it costs: docs/DEEPSPEED.md. Every private DeepSpeed
name is in accord.deepspeed.zero, checked at install; `uninstall()` restores
DeepSpeed's own methods. Under ZeRO-3, a module that runs on some ranks only
and is not given as optional ends the job with the same
accord.torch.AccordDivergenceError on every rank (the collective-sequence
guard on the parameter all-gathers), not in Gloo.
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
            timeout_s: float = 300.0, optional=(), watch=None, guard=None,
            learn_optional: bool = True, turns=None) -> Installation:
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
    install on every rank, with every other persistent parameter. `watch`
    (the step watch) and `guard` (ZeRO-3: the collective-sequence guard on
    the parameter all-gathers) default to on with an accord client and more
    than one rank; ACCORD_DEEPSPEED_WATCH=0 / ACCORD_DEEPSPEED_GUARD=0 turn
    them off. `learn_optional` (ZeRO-3, with the guard; on by default, as in
    accord.torch): a module whose forward diverges in step 0 is made
    optional on every rank instead of ending the job; a divergence in a later
    step is AccordDivergenceError on every rank. `turns` (ZeRO-2, ZeRO-1 with
    overlap_comm, ZeRO-3; on by default, ACCORD_DEEPSPEED_TURNS=0 turns it
    off): reductions handed to DeepSpeed during the backward instead of all
    at its end."""
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
    many = getattr(agreement, "client", None) is not None and agreement.world_size > 1
    step_watch = sequence_guard = None
    try:
        if many and _flag(watch, "ACCORD_DEEPSPEED_WATCH"):
            from accord.torch.watchdog import StepWatch

            stall_s = float(os.environ.get("ACCORD_TORCH_STALL_S", "1.0"))
            step_watch = StepWatch(agreement, f"{prefix}/~step", timeout_s, stall_s=stall_s)
        if many and zero.stage(engine) == 3 and _flag(guard, "ACCORD_DEEPSPEED_GUARD"):
            from accord.deepspeed import all_gathers

            learner = all_gathers.Learner(adapter, engine.module) if learn_optional else None
            sequence_guard = all_gathers.sequence_guard(agreement, prefix, timeout_s, learner)
        inst = Installation(engine, adapter, agreement, prefix, step_watch, sequence_guard,
                            turns=_flag(turns, "ACCORD_DEEPSPEED_TURNS"))
        inst.register()
    except BaseException:
        for part in (step_watch, sequence_guard):
            if part is not None:
                part.close()
        raise
    adapter.pin(modules)
    inst.hook()
    return inst


def _flag(given, env: str) -> bool:
    if given is not None:
        return bool(given)
    return os.environ.get(env, "1").strip().lower() not in ("0", "false", "off", "no")


__all__ = ["EngineParts", "Installation", "SUPPORTED_DEEPSPEED", "Stats", "UnsupportedDeepSpeedError",
           "deepspeed_version", "install"]
