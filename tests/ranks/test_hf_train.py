"""`mesh3d train` of a transformers folder (`mesh3d.hf_model`): mesh3d's own run (data, loss,
step, metrics, checkpoints) around the model's own modeling code.

A tiny GPT-NeoX folder (fused query_key_value, LayerNorms with biases, partial rotary), 4 steps
of the CPU config's learnable data:
- at dp2 x tp2 x pp2 (ZeRO-1, 1F1B) the losses and gradient norms equal one process's within
  1e-5, at the same global batch;
- at cp2 x tp2 (its attention modules calling mesh3d's context-parallel attention) likewise;
- its step-2 checkpoint resumed at 1x1x1 and at dp1 x tp2 continues as the 2x2x2 run did;
- `mesh3d convert to-hf` of its last step (the model found in the checkpoint's metadata) is a
  folder `from_pretrained` loads, with logits equal to one process's last step's export.
"""

from __future__ import annotations

import pytest
import torch
from dist import run_ranks

from mesh3d.config import load_config
from mesh3d.convert import main as convert
from mesh3d.generate import main as generate
from mesh3d.hf_experts import stacked_experts
from mesh3d.train.hooks import KeepModel
from mesh3d.train.loop import train

transformers = pytest.importorskip("transformers", reason="mesh3d.hf_model needs transformers")

CONFIG = "recipes/configs/cpu_tiny.yaml"
COMMON = ["tokens.train_steps=4", "tokens.sequence_length=32", "model.dtype=float32",
          "mesh3d.device=cpu", "optimizer.learning_rate_scheduler.lr_warmup_steps=1",
          "tokens.val_check_interval=-1", "logging.log_level=warning",
          "parallelism.tp_mode=ALL_REDUCE", "checkpoints.checkpoint_interval=2",
          "tokens.micro_batch_size=4"]  # fmt: skip
ONE = ["tokens.batch_accumulation_per_replica=4"]  # global batch 16 at every layout
THREE = ["parallelism.dp=2", "parallelism.tp=2", "parallelism.pp=2", "optimizer.zero_stage=1",
         "tokens.batch_accumulation_per_replica=2"]  # fmt: skip

CP = ["parallelism.context_parallel_size=2", "parallelism.tp=2", *ONE]  # 4 ranks, cp2 x tp2


def _folder(path):
    config = transformers.GPTNeoXConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                                        num_attention_heads=4, num_hidden_layers=4,
                                        max_position_embeddings=64, rotary_pct=0.5,
                                        tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    transformers.GPTNeoXForCausalLM(config).save_pretrained(path)
    return path


def _run(rank, world, overrides):
    metrics = train(load_config(CONFIG, COMMON + overrides)).metrics
    return [(m["iteration"], m["lm_loss"], m["grad_norm"]) for m in metrics]


def _experts_held(rank, world, overrides):
    """(the steps, as `_run`), and the experts of each layer this rank holds."""
    result = train(load_config(CONFIG, COMMON + overrides), hooks=[KeepModel()])
    held = [m.gate_up_proj.shape[0] for m in stacked_experts(result.model)]
    return [(m["iteration"], m["lm_loss"], m["grad_norm"]) for m in result.metrics], held


def _close(a: list, b: list) -> bool:
    return [x[0] for x in a] == [x[0] for x in b] and all(
        abs(x[1] - y[1]) <= 1e-5 and abs(x[2] - y[2]) <= 1e-5 for x, y in zip(a, b)
    )


def _one_and_2x2x2(model: list, tmp_path) -> tuple[list, list]:
    """4 steps at one process and at dp2 x tp2 x pp2 (checkpoints in `one/`, `three/`), equal."""
    one = run_ranks(1, _run, model + ONE + [f"checkpoints.checkpoints_path={tmp_path / 'one'}"],
                    timeout=120)[0]  # fmt: skip
    three = run_ranks(8, _run, model + THREE + [f"checkpoints.checkpoints_path={tmp_path / 'three'}"],
                      timeout=300)[0]  # fmt: skip
    assert len(one) == 4 and _close(three, one), (three, one)
    return one, three


def test_a_transformers_folder_trains_at_any_layout_resumes_and_exports(tmp_path):
    hf = _folder(tmp_path / "neox")
    model = [f"mesh3d.hf_model={hf}"]
    one, three = _one_and_2x2x2(model, tmp_path)
    cp = run_ranks(4, _run, model + CP + [f"checkpoints.checkpoints_path={tmp_path / 'cp'}"],
                   timeout=300)[0]  # fmt: skip
    assert _close(cp, one), (cp, one)  # its attention is mesh3d's, over the cp ranks

    for layout, world in ((ONE, 1), (["parallelism.tp=2", *ONE], 2)):
        resumed = run_ranks(world, _run, model + layout + [
            f"checkpoints.checkpoints_path={tmp_path / f'resumed{world}'}",
            f"checkpoints.resume_checkpoint_path={tmp_path / 'three' / '2'}"], timeout=180)[0]  # fmt: skip
        assert _close(resumed, three[2:]), (world, resumed, three[2:])

    for run in ("one", "three"):  # no --model: the checkpoint names its model
        convert(["to-hf", "--checkpoint", str(tmp_path / run / "4"),
                 "--output", str(tmp_path / f"{run}-hf")])  # fmt: skip
    a, b = (transformers.AutoModelForCausalLM.from_pretrained(tmp_path / f"{r}-hf")
            for r in ("one", "three"))  # fmt: skip
    assert isinstance(a, transformers.GPTNeoXForCausalLM)
    tokens = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (a(input_ids=tokens).logits - b(input_ids=tokens).logits).abs().max()
    assert diff <= 1e-4, diff
    assert (tmp_path / "one-hf" / "config.json").is_file()
    with pytest.raises(SystemExit) as refused:  # mesh3d generate reads families: one line, exit 2
        generate(["--checkpoint", str(tmp_path / "one" / "4"), "--prompt", "hi"])
    assert refused.value.code == 2


def _tied_folder(path):
    """A tiny Gemma 2 (RMSNorms around each block, GeGLU, grouped-query attention, logit
    soft-capping) whose embedding and head are one tensor, as Gemma's are."""
    config = transformers.Gemma2Config(vocab_size=512, hidden_size=64, intermediate_size=128,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                       num_hidden_layers=4, max_position_embeddings=64,
                                       attn_logit_softcapping=None, tie_word_embeddings=True)  # fmt: skip
    torch.manual_seed(0)
    transformers.Gemma2ForCausalLM(config).save_pretrained(path)
    return path


def test_a_tied_model_split_over_stages_stays_tied(tmp_path):
    """The embedding on stage 0 and the head on stage 1 are two copies whose gradients are summed
    every step: 2x2x2 equals one process, and checkpoints cross between the two forms."""
    model = [f"mesh3d.hf_model={_tied_folder(tmp_path / 'gemma2')}"]
    one, three = _one_and_2x2x2(model, tmp_path)
    to_one = run_ranks(1, _run, model + ONE + [
        f"checkpoints.checkpoints_path={tmp_path / 'to_one'}",
        f"checkpoints.resume_checkpoint_path={tmp_path / 'three' / '2'}"], timeout=120)[0]  # fmt: skip
    to_three = run_ranks(8, _run, model + THREE + [
        f"checkpoints.checkpoints_path={tmp_path / 'to_three'}",
        f"checkpoints.resume_checkpoint_path={tmp_path / 'one' / '2'}"], timeout=300)[0]  # fmt: skip
    assert _close(to_one, one[2:]) and _close(to_three, one[2:]), (to_one, to_three, one[2:])
    convert(["to-hf", "--checkpoint", str(tmp_path / "three" / "4"),
             "--output", str(tmp_path / "hf")])  # fmt: skip
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert exported.lm_head.weight is exported.model.embed_tokens.weight


def _moe_folder(path):
    """A tiny Mixtral: 4 stacked experts a layer, top-2 routing."""
    config = transformers.MixtralConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                                        num_attention_heads=4, num_key_value_heads=2,
                                        num_hidden_layers=2, max_position_embeddings=64,
                                        num_local_experts=4, num_experts_per_tok=2)  # fmt: skip
    torch.manual_seed(0)
    transformers.MixtralForCausalLM(config).save_pretrained(path)
    return path


def test_moe_experts_split_over_ep_ranks(tmp_path):
    """dp2 x ep2 x tp2: each rank holds 2 of the 4 experts of a layer, tokens sent to them and
    back; equal to one process, and its checkpoint (experts gathered whole) resumes there."""
    model = [f"mesh3d.hf_model={_moe_folder(tmp_path / 'mixtral')}"]
    ep = ["parallelism.dp=2", "parallelism.tp=2", "parallelism.expert_parallel_size=2",
          "tokens.batch_accumulation_per_replica=2"]  # fmt: skip
    one = run_ranks(1, _run, model + ONE + [f"checkpoints.checkpoints_path={tmp_path / 'one'}"],
                    timeout=120)[0]  # fmt: skip
    split, held = run_ranks(4, _experts_held,
                            model + ep + [f"checkpoints.checkpoints_path={tmp_path / 'ep'}"],
                            timeout=300)[0]  # fmt: skip
    assert held == [2, 2]  # of 4, in each of the 2 layers
    assert len(one) == 4 and _close(split, one), (split, one)
    resumed = run_ranks(1, _run, model + ONE + [
        f"checkpoints.checkpoints_path={tmp_path / 'resumed'}",
        f"checkpoints.resume_checkpoint_path={tmp_path / 'ep' / '2'}"], timeout=120)[0]  # fmt: skip
    assert _close(resumed, one[2:]), (resumed, one[2:])
