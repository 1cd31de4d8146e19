"""Supervised warm-up before RL: a few steps of fine-tuning on demonstrations of a task's answer format, as
verl's char_count recipe does (SFT, then GRPO), for a model too weak to follow the format from the prompt alone.

The loop is transformers' `Trainer` (AdamW, linear warm-up and decay, gradient clipping); this module only
builds the examples (loss on the response tokens alone) and saves a plain Hugging Face directory.
"""
from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForSeq2Seq,
    PrinterCallback,
    Trainer,
    TrainingArguments,
)


@dataclass
class WarmupConfig:
    lr: float = 1e-4
    """Peak learning rate (linear warm-up over the first 10% of steps, then linear decay to 0)."""
    batch_size: int = 4
    epochs: int = 1
    seed: int = 0
    threads: int = 2
    """torch CPU threads."""
    freeze_embeddings: bool = True
    """Keep the input embeddings (tied with the LM head in SmolLM2) fixed: faster on a CPU, and the format is
    learned by the transformer blocks."""


def supervised_warmup(model_dir: str, out: Path, examples: list[tuple], cfg: WarmupConfig | None = None) -> dict:
    """Fine-tune the causal LM in `model_dir` on `examples` and save model + tokenizer to `out`.

    examples: (prompt_ids, response_ids) pairs of token ids (the response ends with EOS), or (prompt_ids,
    response_ids, trainable) triples with a 0/1 flag per response token (a multi-turn episode: environment and
    template tokens 0); the loss is the mean cross-entropy over response tokens (flagged 1), every other position
    labelled -100. fp32 on the CPU or the default
    device. `out` is written to a temporary sibling first, then renamed (never half-written).
    Returns {"steps", "loss_first", "loss_last", "seconds"} from the trainer's log. Raises ValueError when
    `examples` is empty. cfg: None = the `WarmupConfig` defaults.
    """
    if cfg is None:
        cfg = WarmupConfig()
    if not examples:
        raise ValueError("supervised warm-up: no examples")
    torch.set_num_threads(cfg.threads)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if cfg.freeze_embeddings:
        model.get_input_embeddings().weight.requires_grad_(False)
    rows = [_row(*e) for e in examples]
    tmp = out.with_name(out.name + ".tmp")
    args = TrainingArguments(
        output_dir=str(tmp / "trainer"), per_device_train_batch_size=cfg.batch_size, num_train_epochs=cfg.epochs,
        learning_rate=cfg.lr, lr_scheduler_type="linear", warmup_steps=0.1, weight_decay=0.0,
        max_grad_norm=1.0, seed=cfg.seed, logging_steps=1, save_strategy="no", report_to=[],
        disable_tqdm=True, dataloader_num_workers=0, dataloader_pin_memory=False)
    collator = DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100)
    trainer = Trainer(model=model, args=args, train_dataset=rows, data_collator=collator)
    trainer.remove_callback(PrinterCallback)  # a dict per step on stdout; the summary is returned instead
    result = trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(tmp / "trainer", ignore_errors=True)
    tmp.rename(out)
    return {"steps": result.global_step, "loss_first": losses[0], "loss_last": losses[-1],
            "seconds": result.metrics["train_runtime"]}


def _row(prompt: list[int], response: list[int], trainable: list[int] | None = None) -> dict:
    """One Trainer example: labels -100 on the prompt and on response tokens flagged 0."""
    flags = [1] * len(response) if trainable is None else trainable
    return {"input_ids": prompt + response, "attention_mask": [1] * (len(prompt) + len(response)),
            "labels": [-100] * len(prompt) + [t if f else -100 for t, f in zip(response, flags)]}
