"""`mesh3d plan` at zero_stage 0 shows the gradient buckets training uses (issue 42): their
count and sizes from `parallel/buckets.bucket_params` on the real (meta) model, which of them go
out during the backward (overlapped) and which after it (exposed).

A run's own bucket count against the plan: tests/ranks/test_grad_buckets.py."""

import torch
from test_plan import CPU_TINY

from mesh3d.config import load_config
from mesh3d.models.registry import spec_of
from mesh3d.parallel.buckets import bucket_params
from mesh3d.plan import make_plan
from mesh3d.plan.report import format_plan

MC = "model.model_config"
SMOLLM_135M = [f"{MC}.hidden_size=576", f"{MC}.intermediate_size=1536",
               f"{MC}.num_hidden_layers=30", f"{MC}.num_attention_heads=9",
               f"{MC}.num_key_value_heads=3", f"{MC}.vocab_size=49152",
               f"{MC}.tie_word_embeddings=true", "parallelism.dp=64"]  # fmt: skip


def _real_buckets(cfg, plan) -> list[int]:
    """Bytes of each bucket `GradBuckets` would cut from the whole model (pp 1)."""
    with torch.device("meta"):
        model = spec_of(cfg.model.model_config).build(
            cfg.model.model_config, vocab_size=plan.padded_vocab, attention="sdpa"
        )
    buckets = bucket_params(list(model.parameters()), cfg.model.ddp_bucket_cap_mb * 2**20)
    return [sum(p.numel() * p.element_size() for p in b) for b in buckets]


def test_zero0_comm_rows_are_the_real_buckets():
    for cap in (25, 1, 0):
        cfg = load_config(CPU_TINY, [*SMOLLM_135M, f"model.ddp_bucket_cap_mb={cap}"])
        plan = make_plan(cfg, 64)
        real = _real_buckets(cfg, plan)
        rows = [c for c in plan.ranks[0].comm if c.axis == "dp"]
        assert len(rows) == 2 and not any("flat" in c.what for c in rows)
        inside, last = rows
        assert inside.overlaps and not last.overlaps
        assert (inside.count, last.count) == (len(real) - 1, 1), cap
        assert last.bytes_each == real[-1]  # the embedding's bucket: final when backward ends
        assert abs(inside.bytes_each * inside.count - sum(real[:-1])) <= inside.count
        assert (
            f"of {len(real)} buckets" in inside.what and "during the last backward" in inside.what
        )
    text = format_plan(make_plan(load_config(CPU_TINY, SMOLLM_135M), 64))
    assert "buckets (ddp_bucket_cap_mb 25;" in text and "after the backward, exposed" in text


def test_zero_bubble_buckets_all_after_the_backward():
    cfg = load_config(CPU_TINY, ["parallelism.dp=2", "parallelism.pp=2",
                                 "mesh3d.pp_schedule=zbv_zero_bubble", "mesh3d.pp_virtual_stages=2",
                                 "tokens.batch_accumulation_per_replica=4"])  # fmt: skip
    rows = [c for c in make_plan(cfg, 4).ranks[0].comm if c.axis == "dp"]
    assert len(rows) == 1 and not rows[0].overlaps and "zero-bubble" in rows[0].what
