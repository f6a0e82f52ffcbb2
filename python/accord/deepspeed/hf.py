"""accord.deepspeed for the Hugging Face Trainer with DeepSpeed
(`TrainingArguments(deepspeed=...)`).

    trainer = Trainer(model=model, args=TrainingArguments(..., deepspeed=ds_config),
                      callbacks=[AccordDeepSpeedCallback()])     # ZeRO-3: optional=[...]

At `on_train_begin` (after Accelerate has built the DeepSpeed engine, before
the first forward) the callback runs accord.deepspeed's install on the
Trainer's model and DeepSpeed's ZeRO optimizer (the Trainer's optimizer is
Accelerate's wrapper around it).
"""

from __future__ import annotations

from typing import Optional, Sequence

try:
    from transformers import TrainerCallback
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(f"accord.deepspeed.hf needs transformers (pip install transformers): "
                      f"{e}") from e

from accord.deepspeed import install
from accord.deepspeed.installation import Installation
from accord.deepspeed.zero import EngineParts


class AccordDeepSpeedCallback(TrainerCallback):
    """Turns accord on for the Trainer's DeepSpeed ZeRO engine at the start of
    training. `client`: an accord client or Agreement (default: accord.connect()
    with its defaults); `optional` (ZeRO-3): modules or their paths whose
    forward runs on some ranks only. `self.installation` is the
    accord.deepspeed.Installation once training started."""

    def __init__(self, client=None, *, optional: Sequence = (), prefix: str = "deepspeed",
                 timeout_s: float = 300.0):
        self.client = client
        self.optional = tuple(optional)
        self.prefix = prefix
        self.timeout_s = timeout_s
        self.installation: Optional[Installation] = None

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if model is None or optimizer is None:
            raise RuntimeError("accord.deepspeed.hf: the Trainer passed no model or optimizer "
                               "at train begin")
        zero_optimizer = getattr(optimizer, "optimizer", optimizer)  # Accelerate's wrapper
        self.installation = install(EngineParts(model, zero_optimizer), self.client,
                                    prefix=self.prefix, timeout_s=self.timeout_s,
                                    optional=self.optional)
        return control

    def on_train_end(self, args, state, control, **kwargs):
        if self.installation is not None:
            self.installation.uninstall()
        return control
