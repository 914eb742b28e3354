"""Nanotron's four DoReMi example configs train as written, at a reduced size, on Nanotron's
DoReMi data: a folder holding one saved dataset per domain (22 Pile domains, tiny). Only the
sizes (model, batch, steps, one process), the data folder, the checkpoint folders and the
reference checkpoint are changed: the 280M reference, the 280M proxy against it, the 2.8B
reference (with its validation every 2 steps) and the 2.8B run with the proxy's average weights
as its `domain_weights` (step 3 of the recipe). The data reading itself is checked in
`tests/unit/test_doremi_datasets.py`. One 1-rank launch: ~20 s on 2 cores.
"""

from __future__ import annotations

import math

from dist import run_ranks
from test_doremi_datasets import EXAMPLES, write_domain_datasets

STEPS = 4
SMALL = [
    "model.model_config.hidden_size=32", "model.model_config.intermediate_size=64",
    "model.model_config.num_attention_heads=4", "model.model_config.num_key_value_heads=2",
    "model.model_config.num_hidden_layers=2", "model.model_config.vocab_size=64",
    "model.model_config.max_position_embeddings=16", "tokens.sequence_length=16",
    "tokens.micro_batch_size=4", f"tokens.train_steps={STEPS}", "parallelism.dp=1",
    "parallelism.tp=1", "mesh3d.device=cpu",
]  # fmt: skip


def _train_examples(rank: int, world: int, root: str, tmp: str) -> dict:
    from mesh3d.checks.doremi_checks import domain_names
    from mesh3d.config import apply_overrides, load_config
    from mesh3d.train.doremi import average_weights
    from mesh3d.train.loop import train

    configs = {p.stem.removeprefix("nanotron_doremi_"): p for p in EXAMPLES}
    out = {}
    for name, extra in (
        ("280m_llama", []),
        ("280m_llama_proxy", [f"doremi.ref_model_resume_checkpoint_path={tmp}/280m_llama"]),
        ("2_8b_llama", []),
        ("2_8b_llama_with_tuned_weights", None),  # the proxy's average weights, below
    ):
        if extra is None:
            names, avg = average_weights(f"{tmp}/280m_llama_proxy")
            extra = [f"doremi.domain_weights=[{', '.join(repr(w) for w in avg)}]"]
            out["average"] = avg
        cfg = apply_overrides(load_config(str(configs[name])), [
            *SMALL, f"data_stages[0].data.dataset.hf_dataset_or_datasets={root}",
            f"checkpoints.checkpoints_path={tmp}/{name}", f"checkpoints.checkpoint_interval={STEPS}",
            "checkpoints.resume_checkpoint_path=null", *extra])  # fmt: skip
        names = domain_names(cfg.doremi)
        res = train(cfg)
        out[name] = dict(
            loss=[m["lm_loss"] for m in res.metrics],
            weights=[[m.get(f"doremi/weight/{n}") for n in names] for m in res.metrics],
            samples=[[m.get(f"doremi/samples/{n}", 0) for n in names] for m in res.metrics],
            val=[m["val_loss"] for m in res.metrics if "val_loss" in m],
        )  # fmt: skip
    return out


def test_nanotrons_example_configs_train_on_per_domain_datasets(tmp_path):
    import numpy as np

    from mesh3d.checks.doremi_checks import domain_names
    from mesh3d.config import load_config

    names = domain_names(load_config(str(EXAMPLES[0])).doremi)
    assert len(names) == 22
    rng = np.random.default_rng(0)
    rows = [[rng.integers(0, 64, 17).tolist() for _ in range(6)] for _ in names]
    root = write_domain_datasets(tmp_path / "the_pile", names, rows)
    (out,) = run_ranks(1, _train_examples, str(root), str(tmp_path), timeout=300)
    for name in ("280m_llama", "280m_llama_proxy", "2_8b_llama", "2_8b_llama_with_tuned_weights"):
        run = out[name]
        assert len(run["loss"]) == STEPS and all(math.isfinite(x) for x in run["loss"]), run
        assert all(sum(s) == 4 for s in run["samples"]), run["samples"]  # the global batch
    weights = out["280m_llama_proxy"]["weights"]
    assert all(len(w) == 22 and abs(sum(w) - 1) < 1e-9 for w in weights), weights
    assert out["280m_llama"]["weights"][0] == [None] * 22  # a reference logs none
    assert abs(sum(out["average"]) - 1) < 1e-9
    assert len(out["2_8b_llama"]["val"]) == 2  # val_check_interval 2, limit_val_batches 1
