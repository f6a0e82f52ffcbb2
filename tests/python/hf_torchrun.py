"""A torchrun entry point for test_examples.py: the Hugging Face Trainer with
`AccordCallback()` and no argument (embedded mode), on the tiny LLaVA of
hf_scenarios.py (vision tower in the root unit, odd ranks text-only), 2 steps
of 2 accumulated microbatches. Prints one line per rank with the root unit's
accord statistics.

    torchrun --nproc-per-node=2 hf_torchrun.py CHECKPOINT_DIR OUTPUT_DIR
"""

import os
import sys

import torch

import hf_scenarios as hs

if __name__ == "__main__":
    from transformers import LlavaForConditionalGeneration, Trainer, TrainingArguments
    from transformers.distributed import DistributedConfig

    from accord.hf import AccordCallback

    torch.set_num_threads(1)
    ckpt, out_dir = sys.argv[1], sys.argv[2]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    model = LlavaForConditionalGeneration.from_pretrained(
        ckpt, distributed_config=DistributedConfig(fsdp_size=world))
    callback = AccordCallback()
    args = TrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=1, gradient_accumulation_steps=2,
        max_steps=2, use_cpu=True, report_to=[], save_strategy="no", logging_steps=1,
        max_grad_norm=0.0, learning_rate=1e-3, dataloader_num_workers=0, seed=0,
        disable_tqdm=True)
    trainer = Trainer(
        model=model, args=args, train_dataset=hs.RankDataset(rank), callbacks=[callback],
        data_collator=lambda items: {k: torch.stack([it[k] for it in items]) for k in items[0]})
    out = trainer.train()
    s = callback.installation.stats["fsdp/<root>"]
    line = (f"hf rank {rank}: loss {out.training_loss:.6f} reductions {s.reductions} "
            f"zero_filled {s.zero_filled} skipped {s.skipped}\n")
    # One write of the whole line: both ranks share torchrun's stdout, and
    # print() writes the text and its newline apart when unbuffered.
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), line.encode())
