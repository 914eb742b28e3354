"""Every config key Nanotron HEAD's strict parser accepts, as data, and a checker.

Nanotron parses a config with dacite `strict=True`: a key its dataclasses do not have, at any
level, raises (a model_config no class fits raises a TypeError instead). Values typed `str` or
`float` without Optional may not be null. Key lists from Nanotron `main` at 2411b022
(`src/nanotron/config/*.py`), written out here so a test does not depend on mesh3d's schema.
"""

from __future__ import annotations

TOP = {"general", "parallelism", "model", "tokenizer", "checkpoints", "logging",
       "metrics_logging", "tokens", "optimizer", "data_stages", "profiler", "lighteval",
       "s3_upload"}  # fmt: skip
SECTIONS = {
    "general": {"project", "run", "seed", "step", "consumed_train_samples",
                "benchmark_csv_path", "ignore_sanity_checks"},
    "parallelism": {"dp", "pp", "tp", "pp_engine", "tp_mode", "tp_linear_async_communication",
                    "recompute_layer", "tp_recompute_allgather", "expert_parallel_size",
                    "context_parallel_size"},
    "model": {"model_config", "init_method", "dtype", "make_vocab_size_divisible_by",
              "ddp_bucket_cap_mb"},
    "tokenizer": {"tokenizer_name_or_path", "tokenizer_revision", "tokenizer_max_length"},
    "checkpoints": {"checkpoints_path", "checkpoint_interval", "save_initial_state",
                    "save_final_state", "resume_checkpoint_path", "load_lr_scheduler",
                    "load_optimizer", "checkpoints_path_is_shared_file_system"},
    "logging": {"log_level", "log_level_replica", "iteration_step_info_interval"},
    "metrics_logging": {"log_level", "log_detail_interval"},
    "tokens": {"sequence_length", "train_steps", "micro_batch_size",
               "batch_accumulation_per_replica", "val_check_interval", "limit_val_batches",
               "limit_test_batches"},
    "optimizer": {"optimizer_factory", "zero_stage", "weight_decay", "clip_grad",
                  "accumulate_grad_in_fp32", "learning_rate_scheduler",
                  "weight_decay_exclude_named_params"},
    "profiler": {"profiler_export_path", "wait", "warmup", "active", "repeat", "skip_first",
                 "record_shapes", "profile_memory", "with_stack", "export_chrome_trace"},
    "s3_upload": {"upload_s3_path", "remove_after_upload", "s5cmd_numworkers",
                  "s5cmd_concurrency", "s5cmd_path"},
}  # fmt: skip
LLAMA = {"bos_token_id", "eos_token_id", "hidden_act", "hidden_size", "initializer_range",
         "intermediate_size", "is_llama_config", "max_position_embeddings",
         "num_attention_heads", "num_hidden_layers", "attention_bias", "num_key_value_heads",
         "pad_token_id", "pretraining_tp", "rms_norm_eps", "rope_scaling", "rope_theta",
         "rope_interleaved", "tie_word_embeddings", "use_cache", "vocab_size",
         "_attn_implementation", "z_loss_enabled", "z_loss_coefficient"}  # fmt: skip
QWEN2 = LLAMA - {"is_llama_config"} | {
    "is_qwen2_config", "rope_seq_len_interpolation_factor", "flex_attention_mask",
    "sliding_window_size", "no_rope_layer", "_fused_rotary_emb", "_fused_rms_norm",
    "_use_qkv_packed", "_use_doc_masking", "log_attn_probs", "ring_attn_heads_k_stride",
    "moe_config"}  # fmt: skip
STARCODER2 = {"activation_function", "attention_softmax_in_fp32", "attn_pdrop", "bos_token_id",
              "embd_pdrop", "eos_token_id", "global_attn_layers", "grouped_query", "hidden_size",
              "initializer_range", "intermediate_size", "is_starcoder2_config",
              "layer_norm_epsilon", "max_position_embeddings", "multi_query",
              "num_attention_heads", "num_hidden_layers", "num_kv_heads", "resid_pdrop",
              "rope_theta", "scale_attention_softmax_in_fp32", "scale_attn_weights",
              "sliding_window_size", "use_position_embeddings", "use_rotary_embeddings",
              "vocab_size", "_attn_implementation"}  # fmt: skip
MOE = {"num_experts", "top_k", "moe_intermediate_size", "shared_expert_intermediate_size",
       "router_aux_loss_coef", "layers", "enable_shared_expert", "token_dispatcher_type"}  # fmt: skip
INIT = [{"std", "scaling_method"}, {"use_mup"}, {"path"}]
FACTORY = [{"adam_eps", "adam_beta1", "adam_beta2", "torch_adam_is_fused", "name"}, {"name"}]
LR_SCHEDULER = {"learning_rate", "lr_warmup_steps", "lr_warmup_style", "lr_decay_style",
                "lr_decay_steps", "lr_decay_starting_step", "min_decay_lr"}  # fmt: skip
NOT_NULL = ("lr_warmup_style", "lr_decay_style", "min_decay_lr")  # str / float, no Optional
STAGE = {"name", "start_training_step", "data", "sequence_length"}
DATA = {"dataset", "seed", "num_loading_workers"}
DATASETS = [
    {"hf_dataset_or_datasets", "hf_dataset_splits", "hf_dataset_config_name",
     "dataset_processing_num_proc_per_process", "dataset_overwrite_cache", "text_column_name"},
    {"dataset_folder", "dataset_weights", "dataset_read_path", "dataset_max_tokens",
     "tokenizer_name", "vocab_size", "token_size_in_bytes", "return_positions",
     "skip_in_stream", "pad_samples_to_global_batch_size", "shuffle_files",
     "use_old_brrr_dataloader"},
    {"hf_dataset_or_datasets", "hf_dataset_splits", "hf_dataset_config_name",
     "dataset_processing_num_proc_per_process", "dataset_overwrite_cache", "sft_dataloader",
     "debug_max_samples"},
]  # fmt: skip


def config_key_problems(d: dict) -> list[str]:
    """What Nanotron HEAD's strict parser would refuse in config mapping `d` ([] if none)."""
    out: list[str] = []

    def keys(where: str, value, allowed: set[str]) -> None:
        if isinstance(value, dict):
            out.extend(f"unknown key {where}.{k}" for k in value if k not in allowed)

    def one_of(where: str, value, options: list[set[str]]) -> None:
        if isinstance(value, dict) and not any(set(value) <= o for o in options):
            out.append(f"{where} {sorted(value)} fits no Nanotron class")

    keys("", d, TOP)
    for name, allowed in SECTIONS.items():
        keys(name, d.get(name), allowed)
    model = d.get("model") or {}
    mc = model.get("model_config") or {}
    family = QWEN2 if "is_qwen2_config" in mc else LLAMA
    keys("model.model_config", mc, STARCODER2 if "is_starcoder2_config" in mc else family)
    keys("model.model_config.moe_config", mc.get("moe_config"), MOE)
    one_of("model.init_method", model.get("init_method"), INIT)
    opt = d.get("optimizer") or {}
    one_of("optimizer.optimizer_factory", opt.get("optimizer_factory"), FACTORY)
    lrs = opt.get("learning_rate_scheduler")
    keys("optimizer.learning_rate_scheduler", lrs, LR_SCHEDULER)
    out.extend(f"null {k}" for k in NOT_NULL if isinstance(lrs, dict) and lrs.get(k) is None)
    for i, stage in enumerate(d.get("data_stages") or []):
        keys(f"data_stages[{i}]", stage, STAGE)
        keys(f"data_stages[{i}].data", stage.get("data"), DATA)
        one_of(f"data_stages[{i}].data.dataset", (stage.get("data") or {}).get("dataset"), DATASETS)
    return out
