"""`mesh3d.plan` under context parallelism: the cp groups and the activation terms at cp 2 by hand;
real runs on 4 ranks (cp with tp, sequence parallelism, dp, FSDP, recompute, bf16 autocast, Qwen2
document masking): params, grads, optimizer state, the calls and bytes of the cp collectives, and
the bytes saved for backward equal the plan's, exactly (saved bytes plus what the plan leaves out
on purpose: CPU SDPA's causal masks, the autocast weight copies it counts as transient).

This file holds the tests of that subject that need a process group; the others are in
`tests/unit/test_plan_cp.py`."""

import copy

import torch
from dist import run_ranks
from parity import TINY
from plan_measure import (
    PP2,
    cp_measured,
    cp_overrides,
    cpu_causal_masks,
    plan_cfg,
    pp_schedule,
)

from mesh3d.config import apply_overrides, config_from_dict
from mesh3d.plan import (
    make_plan,
)


def _qwen_docs(overrides: list[str]):
    """TINY as Qwen2 with document masking (random tokens over 16 ids hold many EOS)."""
    d = copy.deepcopy(TINY)
    mc = d["model"]["model_config"]
    mc.pop("is_llama_config")
    mc.update(is_qwen2_config=True, _use_doc_masking=True, vocab_size=16, eos_token_id=3)
    d["mesh3d"]["dummy_data"] = "random"
    return apply_overrides(config_from_dict(d), overrides)


RUNS_CP = {  # on 4 ranks; label -> config
    "cp2 tp2 sequence parallel": plan_cfg(
        cp_overrides(2, "parallelism.tp=2", "parallelism.tp_mode=REDUCE_SCATTER")
    ),
    "cp2 dp2 zero1": plan_cfg(cp_overrides(2, "parallelism.dp=2", "optimizer.zero_stage=1")),
    "cp4 zero1 tied": plan_cfg(
        cp_overrides(4, "optimizer.zero_stage=1", "model.model_config.tie_word_embeddings=true")
    ),
    "cp2 tp2 recompute": plan_cfg(
        cp_overrides(2, "parallelism.tp=2", "parallelism.recompute_layer=true")
    ),
    "cp2 dp2 bf16 autocast": plan_cfg(cp_overrides(2, "parallelism.dp=2", "model.dtype=bfloat16")),
    "cp2 dp2 qwen2 documents": _qwen_docs(cp_overrides(2, "parallelism.dp=2")),
    "cp2 pp2 zero1 1f1b": plan_cfg(
        cp_overrides(2, *PP2[:2], "optimizer.zero_stage=1", *pp_schedule("1f1b"))
    ),
}


def test_plan_equals_real_cp_runs():
    """Params, grads, optimizer state and the cp collectives exactly; the bytes saved for
    backward exactly once the CPU-only causal masks are added, and the autocast weight copies,
    which autograd saves but the plan counts as transient (Llama without a pipeline: Qwen2's
    attention biases and document masks are not in the estimate, and a pipeline run keeps a few
    more bytes per microbatch than it counts, as without cp)."""
    measured = run_ranks(4, cp_measured, list(RUNS_CP.values()), timeout=240)
    for i, (label, cfg) in enumerate(RUNS_CP.items()):
        plan = make_plan(cfg, 4)
        for rank, rp in enumerate(plan.ranks):
            got = measured[rank][i]
            want = dict(elements=rp.param_elements, params=rp.param_bytes,
                        grads=rp.grad_bytes, optim=rp.optimizer_bytes)  # fmt: skip
            assert {k: got[k] for k in want} == want, f"{label}, rank {rank}"
            compute, want_cp = getattr(torch, plan.compute_dtype), {}
            for c in rp.comm:
                if c.axis == "cp":  # k, v in the compute dtype; document positions int64
                    dtype = torch.int64 if c.what.startswith("positions") else compute
                    want_cp[f"{c.collective} {dtype}"] = (c.count, c.count * c.bytes_each)
            assert got["cp"] == want_cp, f"{label}, rank {rank}"
            if "qwen2" not in label and plan.dims["pp"] == 1:
                extra = cpu_causal_masks(cfg, rp.coords["cp"], compute.itemsize)
                extra += rp.transient.get("autocast_weight_copies", 0)
                want = rp.saved_activation_bytes + extra
                assert got["saved"] == want, f"{label}, rank {rank}"
