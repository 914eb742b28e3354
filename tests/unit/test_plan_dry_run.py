"""`mesh3d plan --dry-run`: every distinct rank of 512-rank layouts built as training builds them.

- Llama-3-8B and -70B, Qwen2-72B, Qwen3-32B, Qwen1.5-MoE-A2.7B (expert parallelism 4) and
  StarCoder2-15B shapes at 512 ranks, dp x tp x pp = 8 x 8 x 8 or with cp 2, zero 0 / zero 1 / full shard
  / HSDP (`mesh3d.dp_shard`) / LoRA adapters (only they have gradients and optimizer state), five
  schedules: each representative rank's parts are built on meta with torch's fake process group
  (in this process, one group at a time), and their parameter, gradient and optimizer-state
  bytes equal make_plan's for every rank they stand for, exactly.
- Representatives: one per pp rank when every shard is even; under zero 1 uneven FSDP chunks
  add the ranks holding a short or empty one (the padded vocab's 16,032-row tp shard over dp 64;
  the MoE router's 60 rows and the shared-expert gate's one row over dp 16).
- A representative whose bytes differ from the plan's is flagged, with the ranks it stands for.
- The command line, one launch each, both at once: a report with the dry-run table and exit 0;
  a config validate passes but construction refuses (`mesh3d.attention: flash` without
  flash-attn) prints one `error: dry run: rank 0 ...` line naming the part and exits 2.

The tests of this subject that need a process group are in `tests/ranks/test_plan_dry_run_ranks.py`.
The tests of this subject that launch real processes are in
`tests/launch/test_plan_dry_run_launch.py`."""

import copy

from parity import TINY

from mesh3d.config import apply_overrides, config_from_dict
from mesh3d.plan import format_dry_run, make_plan
from mesh3d.plan.dry_run import differences, representatives
from mesh3d.plan.records import BuiltRank, DryRun

LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                 rope_theta=500000.0, max_position_embeddings=8192)  # fmt: skip
LLAMA3_70B = dict(LLAMA3_8B, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                  num_attention_heads=64)  # fmt: skip
QWEN2_72B = dict(hidden_size=8192, intermediate_size=29568, num_hidden_layers=80,
                 num_attention_heads=64, num_key_value_heads=8, vocab_size=152064,
                 rope_theta=1e6, max_position_embeddings=8192, is_qwen2_config=True)  # fmt: skip
QWEN3_32B = dict(QWEN2_72B, hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
                 vocab_size=151936)  # fmt: skip
QWEN15_MOE = dict(QWEN2_72B, hidden_size=2048, intermediate_size=5632, num_hidden_layers=24,
                  num_attention_heads=16, num_key_value_heads=16, vocab_size=151936,
                  moe_config=dict(num_experts=60, top_k=4, moe_intermediate_size=1408,
                                  shared_expert_intermediate_size=5632,
                                  enable_shared_expert=True, layers=[-1]))  # fmt: skip

STARCODER2_15B = dict(hidden_size=6144, intermediate_size=24576, num_hidden_layers=40,
                      num_attention_heads=48, grouped_query=True, num_kv_heads=4,
                      vocab_size=49152, rope_theta=100000.0, sliding_window_size=4096,
                      max_position_embeddings=16384, is_starcoder2_config=True)  # fmt: skip


def _config(model: dict, layout: list[str], family: dict | None = None):
    d = copy.deepcopy(TINY)
    mc = d["model"]["model_config"]
    if "is_starcoder2_config" in model:  # none of Llama's keys
        mc.clear()
    elif "is_qwen2_config" in model:
        del mc["is_llama_config"]
    mc.update(model)
    d["model"]["dtype"] = "bfloat16"  # fp32 master weights: accumulate_grad_in_fp32
    d["mesh3d"].update(family or {})
    steps = ["tokens.micro_batch_size=1", "tokens.sequence_length=8192"]
    return apply_overrides(config_from_dict(d), steps + layout)


def _layout(dp: int, tp: int, pp: int, schedule: str, microbatches: int, *more: str) -> list[str]:
    return [f"parallelism.dp={dp}", f"parallelism.tp={tp}", f"parallelism.pp={pp}",
            f"mesh3d.pp_schedule={schedule}",
            f"tokens.batch_accumulation_per_replica={microbatches}", *more]  # fmt: skip


CASES = {  # label -> (config, representatives expected)
    "llama3-8b 8x8x8 zero0 1f1b": (_config(LLAMA3_8B, _layout(8, 8, 8, "1f1b", 8)), 8),
    "llama3-70b dp4 cp2 tp8 pp8 zero1 interleaved recompute": (
        _config(
            LLAMA3_70B,
            _layout(
                4,
                8,
                8,
                "interleaved_1f1b",
                16,
                "mesh3d.pp_virtual_stages=2",
                "parallelism.context_parallel_size=2",
                "optimizer.zero_stage=1",
                "parallelism.tp_mode=REDUCE_SCATTER",
                "parallelism.recompute_layer=true",
            ),
        ),
        8,
    ),  # fmt: skip
    "qwen2-72b 8x8x8 full shard afab": (
        _config(
            QWEN2_72B,
            _layout(8, 8, 8, "afab", 8, "optimizer.zero_stage=1", "mesh3d.full_shard=true"),
        ),
        8,
    ),  # fmt: skip
    "qwen3-32b 8x8x8 zbv": (
        _config(
            QWEN3_32B,
            _layout(8, 8, 8, "zbv_zero_bubble", 16, "mesh3d.pp_virtual_stages=2"),
            dict(model_family="qwen3", head_dim=128),
        ),
        8,
    ),  # fmt: skip
    "qwen1.5-moe dp16 tp8 pp4 ep4 zero1": (
        _config(
            QWEN15_MOE,
            _layout(
                16, 8, 4, "1f1b", 8, "parallelism.expert_parallel_size=4", "optimizer.zero_stage=1"
            ),
        ),
        12,
    ),  # fmt: skip
    "starcoder2-15b dp16 tp4 pp8 zero1 recompute": (
        _config(
            STARCODER2_15B,
            _layout(
                16,
                4,
                8,
                "1f1b",
                8,
                "optimizer.zero_stage=1",
                "parallelism.tp_mode=REDUCE_SCATTER",
                "parallelism.recompute_layer=true",
            ),
        ),
        8,
    ),  # fmt: skip
    "llama3-8b HSDP dp8 (groups of 4) cp2 tp8 pp4 full": (
        _config(
            LLAMA3_8B,
            _layout(8, 8, 4, "1f1b", 8, "mesh3d.dp_shard=4", "parallelism.context_parallel_size=2"),
        ),
        4,
    ),  # fmt: skip
    "llama3-8b 8x8x8 LoRA r16 all-linear zero1": (
        _config(
            LLAMA3_8B,
            _layout(
                8,
                8,
                8,
                "1f1b",
                8,
                "optimizer.zero_stage=1",
                "mesh3d.lora={r: 16, target_modules: all-linear}",
            ),
        ),
        8,
    ),  # fmt: skip
    "llama3-8b dp64 tp8 zero1 (uneven vocab chunks)": (
        _config(LLAMA3_8B, _layout(64, 8, 1, "1f1b", 1, "optimizer.zero_stage=1")),
        2,
    ),
}


def test_representatives_add_the_ranks_holding_a_short_fsdp_chunk():
    # vocab 128256 / tp 8 = 16032 rows over dp 64: chunks of 251, the last one 219 (dp index 63)
    cfg, _ = CASES["llama3-8b dp64 tp8 zero1 (uneven vocab chunks)"]
    assert representatives(cfg, 512) == {0: list(range(504)), 504: list(range(504, 512))}
    # 60 router rows over dp 16: 4 each, none on dp rank 15; the shared-expert gate's one row
    # on dp rank 0 only: three kinds of rank per pp stage (ranks 0-7 are dp 0, tp 0..7)
    moe, _ = CASES["qwen1.5-moe dp16 tp8 pp4 ep4 zero1"]
    assert list(representatives(moe, 512).items())[:3] == [
        (0, list(range(8))), (8, list(range(8, 120))), (120, list(range(120, 128)))
    ]  # fmt: skip
    even, _ = CASES["llama3-8b 8x8x8 zero0 1f1b"]
    assert representatives(even, 512) == {
        64 * p: list(range(64 * p, 64 * p + 64)) for p in range(8)
    }


def test_a_difference_from_the_plan_is_flagged():
    cfg, _ = CASES["llama3-8b 8x8x8 zero0 1f1b"]
    plan = make_plan(cfg, 512)
    rp = plan.ranks[64]
    built = BuiltRank(64, list(range(64, 128)), rp.coords, rp.stages, rp.param_elements,
                      rp.param_bytes + 1024, rp.grad_bytes, rp.optimizer_bytes, "Schedule1F1B", 1.0)  # fmt: skip
    diffs = differences(plan, DryRun(512, [built], 1.0))
    want = f"param_bytes: built {rp.param_bytes + 1024:,}, plan {rp.param_bytes:,} for ranks 64-127"
    assert diffs == {64: [want]}
    text = format_dry_run(plan, DryRun(512, [built], 1.0), diffs)
    assert "DIFFERS" in text and f"rank 64 differs from the plan:\n    {want}" in text
