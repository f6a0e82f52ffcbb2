"""accord for Hugging Face stacks: the Trainer and Accelerate, with FSDP2.

Two entry points (see python/README.md, "Hugging Face Trainer and Accelerate"):

- ``AccordCallback``: a ``transformers.TrainerCallback``. Pass it to the
  Trainer; at ``on_train_begin`` (after the Trainer and Accelerate have applied
  ``fully_shard``, before the first backward) it hooks every FSDP2 parameter
  group of the model with ``accord.torch.install``.
- ``install_after_prepare(model, client=None)``: the same for a hand-written
  Accelerate loop; call it after ``model = accelerator.prepare(model)``.

Given no client (``AccordCallback()``, ``install_after_prepare(model)``),
both call ``accord.torch.install(model)`` with no client, which calls
``accord.connect()`` with its defaults (docs/EMBEDDED.md): under torchrun, or
any launcher that sets RANK, WORLD_SIZE and LOCAL_RANK, nothing needs to be
set. The sidecar is ACCORD_SOCKET's, else the deployed one answering on
/run/accord/sidecar.sock, else embedded mode: the job starts its own
coordinator and one sidecar per node, which needs torch.distributed
initialized (the Trainer has done so by ``on_train_begin``; in an Accelerate
loop, ``Accelerator()`` does under a distributed launch). The job id is ACCORD_JOB_ID, else torchrun's TORCHELASTIC_RUN_ID, else one that
rank 0 draws; ACCORD_TOKEN for a deployment that requires a token. Pass an
accord client or an ``accord.Agreement`` to choose yourself.

FSDP2 under the Trainer comes from either (a) transformers' own loading,
``from_pretrained(..., distributed_config=DistributedConfig(fsdp_size=W))``,
which shards at load time and works on CPU/Gloo; or (b) Accelerate's FSDP
plugin (``fsdp_config={"fsdp_version": 2}``), which Accelerate 1.15 turns on for
GPU-like devices only: on CPU it is dropped and the model is not sharded.
``install_after_prepare`` therefore refuses a model with no FSDP2 unit, with a
message saying so, rather than leave accord silently unused.
"""

from __future__ import annotations

from typing import Optional

import torch

import accord.torch as accord_torch

try:
    from transformers import TrainerCallback
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(f"accord.hf needs transformers (pip install transformers): {e}") from e


class AccordHFError(RuntimeError):
    """accord could not be turned on for this Hugging Face model (says why)."""


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    # torch.compile wraps the module; FSDP2 state lives on the original.
    return getattr(model, "_orig_mod", model)


def _fsdp_units(model: torch.nn.Module):
    from torch.distributed.fsdp import FSDPModule

    return [n for n, m in model.named_modules() if isinstance(m, FSDPModule)]


def install_after_prepare(
    model: torch.nn.Module,
    client=None,
    *,
    prefix: str = "fsdp",
    timeout_s: float = 300.0,
):
    """Hooks accord into an FSDP2 model prepared by Accelerate or transformers.

    Returns the accord.torch.Installation. Raises AccordHFError when the model
    has no FSDP2 unit.
    """
    model = _unwrap(model)
    if not _fsdp_units(model):
        raise AccordHFError(
            "accord.hf: the model has no FSDP2 unit (fully_shard was not applied). With the "
            "Trainer, shard it with from_pretrained(..., distributed_config=DistributedConfig("
            "fsdp_size=WORLD_SIZE)) or Accelerate's FSDP plugin with fsdp_version 2; Accelerate "
            "1.15 enables that plugin on GPU-like devices only, not on CPU"
        )
    # client None: install() calls accord.connect() with its defaults.
    return accord_torch.install(model, client, prefix=prefix, timeout_s=timeout_s)


class AccordCallback(TrainerCallback):
    """Turns accord on for the Trainer's FSDP2 model at the start of training.

    ``client``: an accord client or Agreement; by default (``AccordCallback()``)
    ``accord.torch.install(model)`` connects at train begin with
    ``accord.connect()``'s defaults (module docstring). After training starts,
    ``self.installation`` is the accord.torch.Installation (its ``stats`` say
    what accord did per group).
    """

    def __init__(self, client=None, *, prefix: str = "fsdp", timeout_s: float = 300.0):
        self.client = client
        self.prefix = prefix
        self.timeout_s = timeout_s
        self.installation: Optional[accord_torch.Installation] = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is None:
            raise AccordHFError("accord.hf.AccordCallback: the Trainer passed no model")
        self.installation = install_after_prepare(
            model, self.client, prefix=self.prefix, timeout_s=self.timeout_s
        )
        return control
