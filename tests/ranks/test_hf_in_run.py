"""Hugging Face inside the run: `init_method: {path: <HF folder>}` and `mesh3d.hf_export`.

One 8-rank launch at dp2 x tp2 x pp2: a run starting from a Hugging Face LlamaForCausalLM
folder directly, and one starting from what the offline converter (`from-hf`) wrote from the
same folder. Their losses and grad norms are bitwise equal (the same initial weights, read two
ways), and the first run's `hf/<step>/` export equals the offline `to-hf` of its step folder
tensor for tensor, and loads with transformers' AutoModelForCausalLM.
"""

import pytest
import torch
from dist import run_ranks
from safetensors.torch import load_file
from test_first_hour import hf_folder

from mesh3d.checkpoint import hf as convert
from mesh3d.config import load_config
from mesh3d.errors import UserError
from mesh3d.train.loop import train

transformers = pytest.importorskip("transformers", reason="the HF checks need transformers")

LAYOUT = ["parallelism.dp=2", "parallelism.tp=2", "parallelism.pp=2",
          "tokens.sequence_length=32", "tokens.micro_batch_size=1",
          "tokens.batch_accumulation_per_replica=2", "tokens.train_steps=3",
          "optimizer.learning_rate_scheduler.lr_warmup_steps=1", "logging.log_level=warning",
          "checkpoints.checkpoint_interval=2", "mesh3d.device=cpu"]  # fmt: skip


def _losses(rank, world, config, runs):
    out = []
    for overrides in runs:
        metrics = train(load_config(config, LAYOUT + overrides)).metrics
        out.append(([m["lm_loss"] for m in metrics], [m["grad_norm"] for m in metrics]))
    return out


def test_a_run_starts_from_an_hf_folder_and_exports_one_as_the_converter_does(tmp_path):
    hf = hf_folder(tmp_path / "hf")
    convert.from_hf(hf, tmp_path / "nt")
    runs = [
        [
            f"model.init_method={{path: {hf}}}",
            f"checkpoints.checkpoints_path={tmp_path / 'a'}",
            "mesh3d.hf_export=true",
        ],  # fmt: skip
        [f"checkpoints.checkpoints_path={tmp_path / 'b'}"],  # from the converter's folder
    ]
    direct, converted = run_ranks(8, _losses, tmp_path / "nt" / "config.yaml", runs, timeout=400)[0]
    assert direct == converted  # bitwise: losses and grad norms of 3 steps
    exported = tmp_path / "a" / "hf" / "2"
    assert sorted(p.name for p in (tmp_path / "a" / "hf").iterdir()) == ["2", "3"]
    convert.to_hf(tmp_path / "a" / "2", tmp_path / "offline")
    ours, theirs = (load_file(p / "model.safetensors") for p in (exported, tmp_path / "offline"))
    assert ours.keys() == theirs.keys() and len(ours) > 10
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    model = transformers.AutoModelForCausalLM.from_pretrained(exported)
    assert isinstance(model, transformers.LlamaForCausalLM)
    assert torch.equal(model.model.embed_tokens.weight, ours["model.embed_tokens.weight"])


def test_a_config_that_is_not_the_folders_model_is_refused(tmp_path):
    from mesh3d.checkpoint.hf_run import read_hf_for_run

    hf = hf_folder(tmp_path / "hf")
    convert.from_hf(hf, tmp_path / "nt")
    mc = load_config(tmp_path / "nt" / "config.yaml", ["model.model_config.hidden_size=32",
                                                       "model.model_config.num_key_value_heads=4"])  # fmt: skip
    with pytest.raises(UserError) as e:
        read_hf_for_run(hf, mc.model.model_config, 300)
    msg = str(e.value)
    assert "hidden_size: 32 vs 64" in msg and "num_key_value_heads: 4 vs 2" in msg, msg
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text(
        '{"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}'
    )
    with pytest.raises(UserError, match="model_type 'gpt2'.*GPT2LMHeadModel.*not a family"):
        read_hf_for_run(tmp_path / "other", mc.model.model_config, 300)
