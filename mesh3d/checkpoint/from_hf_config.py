"""The training config `mesh3d.convert from-hf` writes next to the converted weights.

`<output>/config.yaml` runs as is (`torchrun --nproc_per_node=<tp*pp> recipes/train.py
--config-file <output>/config.yaml`): the model section starts from the converted weights
(`init_method: {path: <output>}`), and small defaults for a first fine-tuning run fill the rest;
change them with dotted overrides or in the file:

    tokens       sequence_length min(max_position_embeddings, 1024), 100 steps,
                 micro_batch_size 1, batch_accumulation_per_replica 1
    optimizer    AdamW (0.9, 0.95, eps 1e-8), lr 3e-5 after a 10-step linear warmup, then constant;
                 weight decay 0.01, clip 1.0, zero_stage 0, fp32 gradient accumulation
    data_stages  one stage on dummy tokens (`dataset: null`): set a Nanoset or HF dataset
    checkpoints  <output>/checkpoints, every 100 steps and at the end
    tokenizer    the HF folder, when it holds tokenizer.json / tokenizer_config.json
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from mesh3d.config import config_from_dict
from mesh3d.config.schema import Config

MAX_SEQUENCE_LENGTH = 1024
TRAIN_STEPS = 100
LEARNING_RATE = 3e-5
WARMUP_STEPS = 10


def training_config(mc, model_dir: Path, output: Path, tp: int, pp: int, dtype: str) -> Config:
    """The runnable config of a converted model `mc` (unpadded vocab) at dp 1, `tp`, `pp`."""
    model_dir, output = model_dir.resolve(), output.resolve()
    tokenizer = None
    if any((model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        tokenizer = {"tokenizer_name_or_path": str(model_dir)}
    schedule = {
        "learning_rate": LEARNING_RATE,
        "lr_warmup_steps": WARMUP_STEPS,
        "lr_warmup_style": "linear",
        "lr_decay_style": "linear",
        "min_decay_lr": LEARNING_RATE,  # decays to itself: constant after the warmup
    }
    stage = {"name": "Stable Training Stage", "start_training_step": 1,
             "data": {"dataset": None, "seed": 42}}  # fmt: skip
    adamw = {"name": "adamW", "adam_beta1": 0.9, "adam_beta2": 0.95, "adam_eps": 1e-8,
             "torch_adam_is_fused": True}  # fmt: skip
    return config_from_dict(
        {
            "general": {"project": "converted", "run": model_dir.name or "model", "seed": 42},
            "parallelism": {"dp": 1, "tp": tp, "pp": pp, "pp_engine": "1f1b"},
            "model": {
                "model_config": dataclasses.asdict(mc),  # unpadded: it pads to `padded` at tp
                "init_method": {"path": str(output)},
                "dtype": dtype,
                "make_vocab_size_divisible_by": 1,
            },
            "tokenizer": tokenizer,
            "tokens": {
                "sequence_length": min(mc.max_position_embeddings, MAX_SEQUENCE_LENGTH),
                "train_steps": TRAIN_STEPS,
                "micro_batch_size": 1,
                "batch_accumulation_per_replica": 1,
            },
            "optimizer": {
                "optimizer_factory": adamw,
                "zero_stage": 0,
                "weight_decay": 0.01,
                "clip_grad": 1.0,
                "accumulate_grad_in_fp32": True,
                "learning_rate_scheduler": schedule,
            },
            "data_stages": [stage],
            "checkpoints": {
                "checkpoints_path": str(output / "checkpoints"),
                "checkpoint_interval": TRAIN_STEPS,
                "save_final_state": True,
            },
        }
    )
