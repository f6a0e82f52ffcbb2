"""FSDP2 configurations accord.torch refuses, each with an error naming it.

python/README.md ("Configurations") lists what is supported, with the test
of each. Three configurations are not, because accord would produce wrong
gradients or a hang in them; each is refused where it appears: at
`install` when the model is already so configured, otherwise at the call of
FSDP2's public setter that turns it on (which may come after `install`, for
example from a pipeline schedule), so the error comes before the step that
would go wrong, never as a failure at step N.

1. HSDP with the replica all-reduce off between microbatches
   (`set_requires_all_reduce(False)`). FSDP2 then adds each microbatch's
   reduce-scatter output into one flat buffer laid out by the parameters
   that reduce-scatter included, and all-reduces the sum on the last
   microbatch. accord's decision may include a parameter in one microbatch
   and not in another (a parameter first used on the last one), and a
   speculative decision repaired after the fact reduce-scatters again after
   FSDP2 has already folded that buffer in: the sum is misaligned or loses
   a microbatch (measured: relative error 0.78). Accumulating with
   `set_requires_gradient_sync(False)` under HSDP is supported.
2. Pipeline schedules that split each microbatch's backward into an input
   pass and a weight pass (ScheduleInterleavedZeroBubble,
   ScheduleZBVZeroBubble, ScheduleDualPipeV): refused at the schedule's
   step() when it drives an installed stage module, before any collective
   and on every rank alike (the schedule's actions are the same on every
   rank); a weight-only backward reached another way is refused too. FSDP2 alone does not produce the reference
   gradients under them (test_configs.py pins it), so accord cannot keep
   them correct. GPipe, 1F1B and interleaved 1F1B are supported, with
   optional and learned units (docs/PARTICIPATION.md, "Pipeline
   schedules").
3. Post-accumulate-grad hooks on sharded parameters (optimizer in the
   backward). FSDP2 runs them right after a reduce-scatter; accord's turn is
   completed only at the end of the backward (zeros trimmed, late gradients
   added), so a hook would act on an incomplete gradient. Checked at install
   and at the start of every backward that reduces.
"""

from __future__ import annotations

from typing import List

from accord.torch import fsdp2


class UnsupportedConfigurationError(ValueError):
    """An FSDP2 configuration accord.torch cannot keep correct (named in the message)."""


def _hsdp_units(model) -> List[str]:
    return [name or "<root>" for name, m in model.named_modules()
            if fsdp2.is_fsdp_module(m) and any(fsdp2.all_reduces(g)
                                               for g in fsdp2.param_groups(m))]


def _all_reduce_error(units: List[str], where: str) -> UnsupportedConfigurationError:
    return UnsupportedConfigurationError(
        f"accord.torch: HSDP with the replica all-reduce turned off between microbatches "
        f"({where}) is not supported (units {', '.join(units[:4])}"
        f"{', ...' if len(units) > 4 else ''}): FSDP2 sums each microbatch's reduce-scatter "
        f"output in one flat buffer laid out by the parameters it included, and accord's "
        f"decisions may include different parameters in different microbatches, which would "
        f"misalign that sum. Accumulate with set_requires_gradient_sync(False) instead (no "
        f"reduce-scatter until the last microbatch), or run without accord.torch")


def split_backward_error() -> UnsupportedConfigurationError:
    return UnsupportedConfigurationError(
        "accord.torch: pipeline schedules that split each microbatch's backward into input "
        "and weight passes (ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble, "
        "ScheduleDualPipeV) are not supported: FSDP2 alone does not produce the reference "
        "gradients under them, so accord cannot keep them correct; use ScheduleGPipe, "
        "Schedule1F1B or ScheduleInterleaved1F1B")


def refuse_post_accumulate_grad_hooks(groups, where: str) -> None:
    """Raises UnsupportedConfigurationError when a group's parameters carry
    post-accumulate-grad hooks (3. above)."""
    hooked = [h.group_id for h in groups if fsdp2.has_post_accumulate_grad_hooks(h.group)]
    if hooked:
        raise UnsupportedConfigurationError(
            f"accord.torch: post-accumulate-grad hooks on FSDP parameters ({where}; groups "
            f"{', '.join(hooked[:4])}{', ...' if len(hooked) > 4 else ''}) are not supported: "
            f"FSDP2 runs them right after each reduce-scatter, and accord completes a "
            f"reduce-scatter only at the end of the backward (zeros trimmed, late gradients "
            f"added), so the hook would see an incomplete gradient. Step the optimizer after "
            f"backward() instead of inside it, or run without accord.torch")


def refuse(model) -> None:
    """At install: raises UnsupportedConfigurationError when the model is
    already in a configuration listed in the module docstring."""
    for name, m in model.named_modules():
        if not fsdp2.is_fsdp_module(m):
            continue
        for g in fsdp2.param_groups(m):
            if fsdp2.all_reduces(g) and not fsdp2.all_reduce_enabled(g):
                raise _all_reduce_error([name or "<root>"], "requires_all_reduce is False at "
                                        "install")


def watch(installation) -> list:
    """Refuses the configurations turned on after install, at the setter.
    Returns the setter checks (each has remove())."""
    model = installation.model
    hsdp = _hsdp_units(model)
    handles = []
    for name, m in model.named_modules():
        if not fsdp2.is_fsdp_module(m):
            continue
        unit = name or "<root>"
        if hsdp:

            def check_all_reduce(requires_all_reduce, _unit=unit):
                if not requires_all_reduce:
                    raise _all_reduce_error(hsdp, f"set_requires_all_reduce(False) on '{_unit}'")

            handles.append(fsdp2.check_set_requires_all_reduce(m, check_all_reduce))
    return handles
