"""Optional capabilities, loaded only when a run's config asks for them.

The core of a plain run never imports these modules by name (an import-linter contract in
pyproject.toml checks it); where the config turns one on, the core calls `load(name)`. A new
capability adds a line to `CAPABILITIES` and to that contract's `forbidden_modules`.
"""

from __future__ import annotations

import importlib
from types import ModuleType

# name -> module (what turns it on)
CAPABILITIES: dict[str, str] = {
    "async_checkpoint": "mesh3d.checkpoint.async_save",  # mesh3d.async_checkpoint
    "s3_upload": "mesh3d.checkpoint.upload",  # s3_upload
    "s3": "mesh3d.checkpoint.s3",  # checkpoints.resume_checkpoint_path: s3://...
    "hf_export": "mesh3d.checkpoint.hf_run",  # mesh3d.hf_export
    "hf_init": "mesh3d.checkpoint.hf_run",  # model.init_method.path: a Hugging Face folder
    "loss_spike": "mesh3d.train.spike",  # mesh3d.loss_spike
    "float8": "mesh3d.train.float8",  # mesh3d.float8
    "async_tp": "mesh3d.train.async_tp",  # mesh3d.async_tp
    "mup": "mesh3d.models.mup",  # init_method: {use_mup: true} (spectral µP: init and lr rules)
    "dropout": "mesh3d.models.dropout",  # a model_config with dropout > 0: keyed masks
    "moe_checks": "mesh3d.checks.moe_checks",  # a moe_config or expert_parallel_size > 1
    "speed_checks": "mesh3d.checks.speed",  # mesh3d.float8 / mesh3d.async_tp
    "moe": "mesh3d.train.experts",  # a model_config with a moe_config: aux loss, load metrics
    "expert_parallel": "mesh3d.parallel.experts",  # its experts split over ep, dispatch
    "context_parallel": "mesh3d.parallel.context",  # parallelism.context_parallel_size > 1
    "hf_datasets": "mesh3d.data.hf",  # a stage's hf_dataset_or_datasets (map-style)
    "streaming": "mesh3d.data.streaming",  # ... streamed (mesh3d.hf_streaming)
    "sft": "mesh3d.data.sft",  # a stage's sft_dataloader data
    "tokenize": "mesh3d.data.tokenize",  # preparing the built-in default data (first run only)
    "evaluation": "mesh3d.evaluation.scorer",  # mesh3d eval
    "evaluation_in_run": "mesh3d.evaluation.in_run",  # a lighteval: section
    "evaluation_jobs": "mesh3d.evaluation.slurm_job",  # ... with mesh3d.eval_mode: slurm_job
    "lora": "mesh3d.models.lora",  # mesh3d.lora: adapters, the base frozen
    "lora_files": "mesh3d.checkpoint.lora_files",  # a LoRA step folder: merge, PEFT export
    "ft_checks": "mesh3d.checks.ft_checks",  # mesh3d.fault_tolerance: its config checks
    "fault_tolerance": "mesh3d.train.fault_tolerance",  # mesh3d.fault_tolerance: torchft groups
    "doremi_checks": "mesh3d.checks.doremi_checks",  # a doremi: section
    "doremi": "mesh3d.train.doremi",  # a doremi: section: domains, the proxy's weights
    "doremi_datasets": "mesh3d.data.domain_datasets",  # ... with hf_dataset_or_datasets
    "hf_config": "mesh3d.config.hf_model",  # mesh3d.hf_model: the model from a transformers folder
    "hf_parts": "mesh3d.train.hf_parts",  # ... built and parallelized from its own code
    "expert_files": "mesh3d.checkpoint.expert_files",  # expert stacks split over ep ranks
    "pair_collectives": "mesh3d.parallel.pair_collectives",  # tp = 2 on CPU ranks
    "hf_models": "mesh3d.hf_models",  # mesh3d.parallelize_hf: a transformers model on the mesh
    "hf_stages": "mesh3d.hf_stages",  # mesh3d.build_hf_stage: its pipeline stages
}


def load(name: str) -> ModuleType:
    """The module of capability `name`, imported on first use."""
    return importlib.import_module(CAPABILITIES[name])
