"""Nanotron's config schema (CLASSIC and HEAD keys) as plain dataclasses, plus `mesh3d:`.

Every key Nanotron reads has a field, so any Nanotron YAML parses; `checks/validate.py` decides
what mesh3d uses. Fields hold plain values (paths, dtypes and enums are strings). Field order
follows Nanotron's classes: it is the key order of `model_config.json`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class GeneralArgs:
    project: str
    run: str = "%date_%jobid"  # %date / %jobid are expanded by the trainer, not at load
    seed: int = 42
    step: int | None = None
    consumed_train_samples: int | None = None
    benchmark_csv_path: str | None = None
    ignore_sanity_checks: bool = True


@dataclass
class ParallelismArgs:
    dp: int
    pp: int
    tp: int
    pp_engine: str = "afab"  # afab | 1f1b
    tp_mode: str = "ALL_REDUCE"  # ALL_REDUCE | REDUCE_SCATTER
    tp_linear_async_communication: bool | None = False
    recompute_layer: bool = False
    tp_recompute_allgather: bool = True
    expert_parallel_size: int = 1
    context_parallel_size: int = 1
    moe_layer_recompute: bool = False  # in Nanotron's examples, not its schema: never written


@dataclass
class LlamaConfig:
    bos_token_id: int | None = 1  # null kept (an HF config's null; from-hf writes it)
    eos_token_id: int | None = 2
    hidden_act: str = "silu"
    hidden_size: int = 4096
    initializer_range: float = 0.02
    intermediate_size: int = 11008
    is_llama_config: bool = True
    max_position_embeddings: int = 2048
    num_attention_heads: int = 32
    num_hidden_layers: int = 32
    attention_bias: bool = False
    num_key_value_heads: int | None = None  # null -> num_attention_heads at load
    pad_token_id: int | None = None
    pretraining_tp: int = 1
    rms_norm_eps: float = 1e-6
    rope_scaling: dict | None = None
    rope_theta: float = 10000.0
    rope_interleaved: bool = False
    tie_word_embeddings: bool = False
    use_cache: bool = True
    vocab_size: int = 32000
    _attn_implementation: str | None = "flash_attention_2"
    z_loss_enabled: bool = False
    z_loss_coefficient: float = 1e-4


@dataclass
class RandomInit:
    std: float
    scaling_method: str = "NUM_LAYERS"  # NONE | NUM_LAYERS | LAYER_INDEX | MODEL_SCALE


@dataclass
class SpectralMupInit:
    use_mup: bool


@dataclass
class ExistingCheckpointInit:
    path: str


class ModelConfig:
    """The type of `model.model_config`: one family's config class, which `config/load.py` picks
    from the keys. Llama's is here; the others are loaded when a config names one
    (`config/other_families.py`, `config/llamoe.py`, `config/mamba.py`)."""


InitMethod = RandomInit | SpectralMupInit | ExistingCheckpointInit


@dataclass
class ModelArgs:
    model_config: ModelConfig
    init_method: InitMethod
    dtype: str = "bfloat16"
    make_vocab_size_divisible_by: int = 1
    ddp_bucket_cap_mb: int = 25


@dataclass
class TokenizerArgs:
    tokenizer_name_or_path: str | None = None
    tokenizer_revision: str | None = None
    tokenizer_max_length: int | None = None


@dataclass
class CheckpointsArgs:
    checkpoints_path: str
    checkpoint_interval: int
    save_initial_state: bool = False
    save_final_state: bool = False
    resume_checkpoint_path: str | None = None
    load_lr_scheduler: bool = True
    load_optimizer: bool = True
    checkpoints_path_is_shared_file_system: bool = False


@dataclass
class LoggingArgs:
    log_level: str = "info"  # debug | info | warning | error | critical | passive
    log_level_replica: str = "info"
    iteration_step_info_interval: int = 1


@dataclass
class MetricsLoggingArgs:
    log_level: int = 0  # 0 basic | 1 full per-layer stats
    log_detail_interval: int = 10


@dataclass
class TokensArgs:
    sequence_length: int
    train_steps: int  # the last step index, inclusive
    micro_batch_size: int
    batch_accumulation_per_replica: int  # microbatches per step per dp rank
    val_check_interval: int = -1
    limit_val_batches: int = 0
    limit_test_batches: int = 0


@dataclass
class AdamWOptimizerArgs:
    adam_eps: float
    adam_beta1: float
    adam_beta2: float
    torch_adam_is_fused: bool
    name: str = "adamW"


@dataclass
class SGDOptimizerArgs:
    name: str = "sgd"


@dataclass
class MuonOptimizerArgs:
    """mesh3d's `name: muon` (not a Nanotron optimizer): torch's Muon on the decoder layers'
    2-D weights, AdamW (these `adam_*` keys) on the rest (`train/muon.py`)."""

    adam_eps: float = 1e-8
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    torch_adam_is_fused: bool = False  # accepted; the AdamW part runs torch's single-tensor math
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    ns_coefficients: list[float] = field(default_factory=lambda: [3.4445, -4.775, 2.0315])
    ns_dtype: str = "bfloat16"  # bfloat16 (torch's Muon) | float32 (layout parity within 1e-5)
    eps: float = 1e-7
    adjust_lr_fn: str | None = None  # null / original: sqrt(max(1, A/B)) | match_rms_adamw
    muon_params: list[str] = field(default_factory=lambda: [r"layers\.\d+\..*weight$"])  # re.match
    name: str = "muon"


@dataclass
class LRSchedulerArgs:
    """Nanotron's LR schedule keys (docs/nanotron-layout.md#how-a-config-is-parsed)."""

    learning_rate: float
    lr_warmup_steps: int = 0
    lr_warmup_style: str = "linear"  # linear | constant (omitted: linear; Nanotron requires it)
    lr_decay_style: str = "linear"  # linear | cosine | 1-sqrt
    lr_decay_steps: int | None = None  # null -> train_steps - lr_warmup_steps at load
    lr_decay_starting_step: int | None = None  # null -> lr_warmup_steps (in the schedule)
    min_decay_lr: float | None = None  # null -> learning_rate at load


@dataclass
class OptimizerArgs:
    optimizer_factory: AdamWOptimizerArgs | SGDOptimizerArgs | MuonOptimizerArgs
    zero_stage: int
    weight_decay: float
    accumulate_grad_in_fp32: bool
    learning_rate_scheduler: LRSchedulerArgs
    clip_grad: float | None = None
    weight_decay_exclude_named_params: list[str] = field(default_factory=list)  # re.match


@dataclass
class PretrainDatasetsArgs:
    hf_dataset_or_datasets: str | list[str] | dict[str, float]
    hf_dataset_splits: str | list[str] = "train"
    hf_dataset_config_name: str | None = None
    dataset_processing_num_proc_per_process: int | None = 1
    dataset_overwrite_cache: bool | None = False
    text_column_name: str = "text"


@dataclass
class NanosetDatasetsArgs:
    dataset_folder: list[str]  # a str or a {folder: weight} mapping is normalized at load
    dataset_weights: list[float] | None = None
    dataset_read_path: list[str] | None = None
    dataset_max_tokens: list[int] | None = None
    tokenizer_name: str | None = None
    vocab_size: int | None = None
    token_size_in_bytes: int | None = None
    return_positions: bool = True
    skip_in_stream: bool = False
    pad_samples_to_global_batch_size: bool = False
    shuffle_files: bool = False
    use_old_brrr_dataloader: bool = False


@dataclass
class SFTDatasetsArgs:
    hf_dataset_or_datasets: str | list[str] | dict[str, float]
    hf_dataset_splits: str | list[str] = "train"
    hf_dataset_config_name: str | None = None
    dataset_processing_num_proc_per_process: int | None = 1
    dataset_overwrite_cache: bool | None = False
    sft_dataloader: bool | None = True
    debug_max_samples: int | None = None


Dataset = PretrainDatasetsArgs | NanosetDatasetsArgs | SFTDatasetsArgs


@dataclass
class DataArgs:
    dataset: Dataset | None = None  # null -> dummy tokens
    seed: int = 42
    num_loading_workers: int = 1


@dataclass
class DatasetStageArgs:
    name: str
    start_training_step: int
    data: DataArgs
    sequence_length: int | None = None  # null -> tokens.sequence_length


@dataclass
class ProfilerArgs:
    profiler_export_path: str | None = None
    wait: int = 1
    warmup: int = 1
    active: int = 1
    repeat: int = 1
    skip_first: int = 3
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = True
    export_chrome_trace: bool = False


@dataclass
class S3UploadArgs:
    """Nanotron's `s3_upload`: s5cmd uploads each step folder to `<upload_s3_path>/<step>/`."""

    upload_s3_path: str
    remove_after_upload: bool
    s5cmd_numworkers: int | None = None
    s5cmd_concurrency: int | None = None
    s5cmd_path: str | None = None


@dataclass
class LossSpikeArgs:
    """`mesh3d.loss_spike`: skip a step whose loss or grad norm spikes (docs/faults.md)."""

    factor: float = 3.0  # a spike: loss (or grad norm) > factor x the running median
    window: int = 100  # healthy steps the running median is taken over
    warmup: int = 10  # healthy steps seen before any step can count as a spike
    max_skipped: int = 5  # spiking steps in a row skipped before the run stops


@dataclass
class LoraArgs:
    """`mesh3d.lora`: low-rank adapters, the base frozen (docs/lora.md); peft's keys and defaults."""

    r: int = 8  # the adapters' rank
    lora_alpha: float = 8  # scaling = lora_alpha / r
    lora_dropout: float = 0.0  # only 0 for now (layout-invariant masks are not built yet)
    # module names (last dotted parts, e.g. q_proj), a regex of the whole name, or "all-linear"
    target_modules: list[str] | str = field(default_factory=lambda: ["q_proj", "v_proj"])


@dataclass
class FaultToleranceArgs:
    """`mesh3d.fault_tolerance`: this job is one of `replica_groups` jobs that train one model
    through torchft (docs/fault-tolerance.md)."""

    replica_groups: int = 2  # jobs (torchrun launches) that train the model together
    replica_id: int | None = None  # 0 .. replica_groups-1 (null: $MESH3D_REPLICA_ID)
    lighthouse: str | None = None  # torchft lighthouse address (null: $TORCHFT_LIGHTHOUSE)
    min_replicas: int = 1  # groups a step needs to commit
    quorum_timeout_s: float = 60.0  # the wait for a quorum (a peer's heartbeat, a joiner)
    timeout_s: float = 60.0  # cross-group collectives and a healing transfer


@dataclass
class DoReMiArgs:
    """The `doremi:` section of Nanotron's examples/doremi (docs/doremi.md): one domain per
    Nanoset folder; comma strings (Nanotron's form) and lists both load."""

    domain_names: str | list[str]
    domain_weights: str | list[float] | None = None
    ref_model_resume_checkpoint_path: str | None = None  # set: a proxy run
    step_size: float = 1.0  # the weights' step in log space (Nanotron's and the paper's)
    smoothing_param: float = 1e-3  # mixed with uniform after each update


@dataclass
class Mesh3dArgs:
    """mesh3d's own settings, under `mesh3d:`; a config without the section loads in Nanotron."""

    pp_schedule: str | None = None  # overrides parallelism.pp_engine (parallel/pipeline_layout.py)
    pp_virtual_stages: int = 1  # stages per pp rank (2 for the V schedules)
    full_shard: bool = False  # FSDP full sharding over dp instead of zero_stage semantics
    dp_shard: int | None = None  # HSDP: FSDP inside groups of k dp ranks, dp / k replica groups
    device: str = "auto"  # auto | cpu | cuda
    attention: str = "auto"  # auto | sdpa | flash
    dummy_data: str = "random"  # random (Nanotron's uniform tokens) | learnable
    sft_packing: bool = True  # SFT data: several examples per sequence (mesh3d/data/sft.py)
    hf_streaming: bool = False  # stream hf_dataset_or_datasets stages (mesh3d/data/streaming.py)
    stream_shards: int | None = None  # a streamed stage's logical shards (null: its global batch)
    eval_failure: str = "continue"  # an in-run evaluation that fails: continue | stop (lighteval:)
    eval_engine: str = "lm-eval"  # the in-run evaluation's engine (lighteval:): lm-eval | lighteval
    eval_mode: str = "in_run"  # lighteval: in_run | slurm_job (an sbatch job per evaluated save)
    hf_model: str | None = None  # a transformers causal LM folder / hub id (docs/hf-models.md)
    sft_assistant_turns: str = "all"  # chat SFT data: the assistant turns that train: all | last
    compile: bool = False
    float8: bool = False  # decoder linears in float8 through torchao (tp 1, ep 1)
    async_tp: bool = False  # torch's async TP: compile + tp > 1 REDUCE_SCATTER on CUDA/NCCL
    wandb: bool | None = None  # null: on when wandb is installed and can log without a prompt
    tensorboard_dir: str | None = None  # TensorBoard scalars of every logged iteration
    console: str = "auto"  # nanotron | compact (a line per step) | auto (compact on a terminal)
    # failing safe on long runs (docs/faults.md)
    collective_timeout_s: float = 600.0  # every process group: a stopped rank ends the job
    checkpoint_timeout_s: float = 1800.0  # collectives and barriers while saving or loading
    skip_nonfinite_steps: int = 0  # non-finite loss/grad-norm steps skipped before stopping
    existing_checkpoints: str = "error"  # error | resume | overwrite: a fresh run, full folder
    load_without_manifest: bool = False  # resume from a mesh3d checkpoint whose manifest is gone
    loss_spike: LossSpikeArgs | None = None  # null: off; {} turns it on with the defaults
    lora: LoraArgs | None = None  # null: train every weight; {r: 16, ...}: adapters only
    fault_tolerance: FaultToleranceArgs | None = None  # null: off; torchft replica groups
    # activation recompute beside Nanotron's parallelism.recompute_layer (docs/parallelism.md)
    recompute: str | None = None  # null: recompute_layer decides (full); selective | full | none
    recompute_every: int = 1  # recompute only every k-th decoder layer (index a multiple of k)
    # checkpoints at scale (docs/checkpoints.md)
    async_checkpoint: bool = False  # copy the state at the save, write it while training goes on
    keep_last_checkpoints: int | None = None  # null: keep every step folder (Nanotron)
    keep_checkpoint_every: int | None = None  # with keep_last: also keep every multiple of this
    hf_export: bool | int = False  # also write <checkpoints_path>/hf/<step>/ (N: every N steps)
    upload_wait_on_stop_s: float = 20.0  # rank 0's wait for uploads at a stop signal or error
    # model families Nanotron lacks, on top of its Qwen2 model_config
    model_family: str | None = None  # null: from model_config; qwen3
    head_dim: int | None = None  # qwen3: the head size (null: hidden_size / num_attention_heads)
    norm_topk_prob: bool = False  # qwen3 with moe_config: top-k router weights renormalized


@dataclass
class Config:
    """A whole Nanotron config (CLASSIC + HEAD sections) plus mesh3d's own `mesh3d:` section.

    Example:

        cfg: mesh3d.Config = mesh3d.load_config("cfg.yaml")
        cfg.parallelism.tp, cfg.tokens.sequence_length
    """

    general: GeneralArgs
    parallelism: ParallelismArgs
    model: ModelArgs
    tokenizer: TokenizerArgs | None = None
    checkpoints: CheckpointsArgs | None = None
    logging: LoggingArgs = field(default_factory=LoggingArgs)
    metrics_logging: MetricsLoggingArgs | None = None
    tokens: TokensArgs | None = None
    optimizer: OptimizerArgs | None = None
    data_stages: list[DatasetStageArgs] | None = None
    profiler: ProfilerArgs | None = None
    lighteval: dict[str, Any] | None = None  # parsed as an opaque mapping
    s3_upload: S3UploadArgs | None = None
    doremi: DoReMiArgs | None = None  # Nanotron's examples/doremi (docs/doremi.md)
    mesh3d: Mesh3dArgs = field(default_factory=Mesh3dArgs)
