"""The Hugging Face Trainer with FSDP2 on CPU/Gloo, run on every rank (see
test_hf.py).

The model is the tiny LLaVA of model_scenarios.py (vision tower in the ROOT
unit), saved to a local folder and loaded with
`from_pretrained(..., distributed_config=DistributedConfig(fsdp_size=W))`:
transformers' own FSDP2 sharding, which the Trainer trains without wrapping it
again (Accelerate's FSDP plugin is off on CPU, python/README.md). The dataset
is rank-aware so the test controls modality: even ranks get image+text
samples, odd ranks text only. accord is turned on with accord.hf.AccordCallback.

A second callback records, at the first optimizer step (after gradient
accumulation, before the update; max_grad_norm=0 so nothing is clipped), every
parameter's full gradient, and the batches each rank trained on, so the test
can compare with a single-process reference.
"""

import os

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

import fsdp_scenarios as sc
import model_scenarios as ms


def save_checkpoint(path):
    ms.build_llava().save_pretrained(path)


class RankDataset(Dataset):
    """Item i on rank r: an image+text sample on even ranks, text on odd ranks."""

    def __init__(self, rank, n=16):
        self.rank, self.n = rank, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        ids = ms._ids(self.rank, 100 + i, 0)[0]
        item = {"input_ids": ids, "labels": ids.clone()}
        if self.rank % 2 == 0:
            ids[1:5] = ms.IMAGE_TOKEN
            item["labels"][1:5] = -100
            g = torch.Generator().manual_seed(30_000 + 1_000 * self.rank + i)
            item["pixel_values"] = torch.randn(3, 16, 16, generator=g)
        return item


def _recorder_class():
    from transformers import TrainerCallback

    class FirstStepRecorder(TrainerCallback):
        def __init__(self):
            self.grads = None

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            if state.global_step == 0 and self.grads is None:
                self.grads = sc._full_grads(model)

    return FirstStepRecorder


def train(rank, world_size, ckpt, out_dir, mode, cluster=None, steps=2, accumulation=2,
          sharding="transformers"):
    """sharding: "transformers" (DistributedConfig at load time) or
    "accelerate" (the Trainer's fsdp_config with fsdp_version 2)."""
    from transformers import LlavaForConditionalGeneration, Trainer, TrainingArguments
    from transformers.distributed import DistributedConfig

    # Accelerate (inside the Trainer) reads the rank layout from the environment.
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
    )
    if sharding == "transformers":
        model = LlavaForConditionalGeneration.from_pretrained(
            ckpt, distributed_config=DistributedConfig(fsdp_size=world_size)
        )
        fsdp_args = {}
    else:
        model = LlavaForConditionalGeneration.from_pretrained(ckpt)
        fsdp_args = {"fsdp": True, "fsdp_config": {"fsdp_version": 2}}
    seen = []

    def collate(items):
        batch = {k: torch.stack([it[k] for it in items]) for k in items[0]}
        seen.append({k: v.clone() for k, v in batch.items()})
        return batch

    recorder = _recorder_class()()
    callbacks = [recorder]
    accord_cb = None
    if mode == "accord":
        from accord.hf import AccordCallback

        accord_cb = AccordCallback(sc.make_agreement("accord", rank, world_size, cluster))
        callbacks.insert(0, accord_cb)
    args = TrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=1, gradient_accumulation_steps=accumulation,
        max_steps=steps, use_cpu=True, report_to=[], save_strategy="no", logging_steps=1,
        max_grad_norm=0.0, learning_rate=1e-3, dataloader_num_workers=0, seed=0,
        disable_tqdm=True, **fsdp_args,
    )
    trainer = Trainer(
        model=model, args=args, train_dataset=RankDataset(rank), data_collator=collate,
        callbacks=callbacks,
    )
    out = trainer.train()
    inst = accord_cb.installation if accord_cb is not None else None
    return {
        "training_loss": out.training_loss,
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "grads": recorder.grads,
        "batches": seen[:accumulation],
        "stats": sc._stats(inst),
        "world_size": dist.get_world_size(),
    }


def reference(ckpt, batches_per_rank):
    """Full-batch gradient of the first step: the mean token loss over every
    rank's first microbatches, on one unsharded copy."""
    from transformers import LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(ckpt)
    total_tokens = 0
    for batches in batches_per_rank:
        for b in batches:
            total_tokens += int((b["labels"][:, 1:] != -100).sum())
    for batches in batches_per_rank:
        for b in batches:
            logits = model(**{k: v for k, v in b.items() if k != "labels"}).logits.float()
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), b["labels"][:, 1:].reshape(-1),
                ignore_index=-100, reduction="sum",
            )
            (loss / total_tokens).backward()
    return {n: (p.grad.clone() if p.grad is not None else None) for n, p in model.named_parameters()}


def grouped_tail(rank, world_size, cluster, micro=2):
    """The unit layout Accelerate's FSDP2 preparation (and torchtitan) build: the
    final norm and lm_head sharded together as one grouped unit,
    fully_shard([norm, lm_head]), next to per-layer units and the root (tower
    inside). accord is turned on with accord.hf.install_after_prepare; one step
    of `micro` accumulated microbatches, fp32."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    from accord.hf import install_after_prepare

    model = ms.build_llava()
    mesh = init_device_mesh("cpu", (world_size,))
    lm = model.model.language_model
    for layer in lm.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard([lm.norm, model.lm_head], mesh=mesh)
    fully_shard(model, mesh=mesh)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)
    inst = install_after_prepare(model, sc.make_agreement("accord", rank, world_size, cluster))
    for k in range(micro):
        model.set_requires_gradient_sync(k == micro - 1)
        model(**ms.llava_batch(rank, 0, k)).loss.backward()
    out = {"grads": sc._full_grads(model), "stats": sc._stats(inst)}
    if rank == 0:
        out["ref"] = ms.reference("llava", "fp32", world_size, 0, micro)
    return out
