"""LoRA (`mesh3d.lora`) on a Hugging Face base: one process equals peft's `LoraModel` on the same
base trained by a plain loop on the same batches from the same adapter initialisation;
dp2 x tp2 x pp2 (ZeRO-1, sequence parallel) equals one process within 1e-5; a one-process
checkpoint resumes at 2 x 2 x 2 and a 2 x 2 x 2 one at dp4 x tp2 (full shard); the PEFT export
loaded by peft and the merged Hugging Face export give the model's logits, and generation at
tp 2 x pp 2 (the adapters live on the base) picks the merged model's tokens; the base stays
bitwise frozen; a checkpoint holds the adapters only.

One 1-rank launch (the reference, a run that saves at step 2 and its exact resume) and one
8-rank launch; a 4-rank generation; ~30 s on 2 cores.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from dist import run_ranks
from parity import TINY, VOCAB, full_weights, layout_overrides, rel

transformers = pytest.importorskip("transformers", reason="transformers is not installed")
peft = pytest.importorskip("peft", reason="peft is not installed (pip install -e '.[dev]')")

LORA = ["mesh3d.lora={r: 4, lora_alpha: 8, target_modules: all-linear}", "tokens.train_steps=4",
        "optimizer.learning_rate_scheduler.learning_rate=0.01"]  # fmt: skip
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _hf_base(folder) -> None:
    """A tiny random LlamaForCausalLM with TINY's shapes, saved as a Hugging Face folder."""
    mc = TINY["model"]["model_config"]
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=mc["hidden_size"], intermediate_size=mc["intermediate_size"],
        num_attention_heads=mc["num_attention_heads"], num_key_value_heads=mc["num_key_value_heads"],
        num_hidden_layers=mc["num_hidden_layers"], max_position_embeddings=16, rms_norm_eps=1e-5,
        tie_word_embeddings=False, rope_theta=10000.0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).to(torch.float32).save_pretrained(folder)


class Record:
    """Each step's batches and learning rate on this rank."""

    def __init__(self):
        self.batches, self.lrs = [], []

    def on_step(self, run, step, out, metrics):
        self.batches.append([(i.clone(), lab.clone()) for i, lab, *_ in out.batches])
        self.lrs.append(metrics["lr"])


def _runs(rank: int, world: int, runs: list[list[str]]) -> list[dict]:
    from mesh3d.config import apply_overrides, config_from_dict
    from mesh3d.train.hooks import KeepModel
    from mesh3d.train.loop import train

    out = []
    for overrides in runs:
        cfg = apply_overrides(config_from_dict(copy.deepcopy(TINY)), overrides)
        rec = Record()
        res = train(cfg, hooks=[KeepModel(), rec])
        frozen = all(
            not p.requires_grad for n, p in res.model.named_parameters() if "lora_" not in n
        )
        out.append(dict(
            loss=[m["lm_loss"] for m in res.metrics], grad_norm=[m["grad_norm"] for m in res.metrics],
            weights=full_weights(res.model, res.mesh), frozen=frozen,
            batches=rec.batches if world == 1 else None, lrs=rec.lrs,
            optimizer_states=sum(1 for s in res.optimizer.state.values() if s),
        ))  # fmt: skip
    return out


def _generate_parallel(rank: int, world: int, step, prompt) -> list[int]:
    from mesh3d.generation.parallel import generate_parallel, load_parallel_model

    model = load_parallel_model(step, tp=2, pp=2, batch=1, length=16, device="cpu")
    return generate_parallel(model, prompt, 10).tolist()


def _ck(root, name: str, resume: str | None = None) -> list[str]:
    out = [f"checkpoints.checkpoints_path={root / name}", "checkpoints.checkpoint_interval=2"]
    return out + ([f"checkpoints.resume_checkpoint_path={root / resume}"] if resume else [])


def _max_rel(run: dict, ref: dict, names=None) -> float:
    diffs = [rel(torch.tensor(run["loss"]), torch.tensor(ref["loss"])),
             rel(torch.tensor(run["grad_norm"]), torch.tensor(ref["grad_norm"]))]  # fmt: skip
    for k in names or ref["weights"]:
        diffs.append(rel(run["weights"][k][:VOCAB], ref["weights"][k][:VOCAB]))
    return max(diffs)


def _peft_loop(base_dir, ref: dict) -> tuple[list[float], dict]:
    """peft's LoraModel on the transformers base, trained by a plain loop on the reference run's
    batches and learning rates, from the reference's initial adapters."""
    from mesh3d.models.lora import adapter_init

    model = transformers.LlamaForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS)
    model = peft.get_peft_model(model, cfg)
    ours_of = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if (
                "lora_" in name
            ):  # base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight
                ours = name.removeprefix("base_model.model.model.").replace(".default", "")
                ours_of[name] = ours
                p.copy_(adapter_init(ours, tuple(p.shape), TINY["general"]["seed"]))
    params = [p for n, p in model.named_parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1.0, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.01)
    # the `lr` logged at step s is the rate step s + 1 uses (Nanotron's); step 1 uses the peak
    # (constant warmup)
    used = [0.01] + ref["lrs"][:-1]
    losses = []
    for batches, lr in zip(ref["batches"], used, strict=True):
        ids = torch.cat([b[0] for b in batches])
        labels = torch.cat([b[1] for b in batches])
        logits = model(input_ids=ids).logits.float()
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
        )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, TINY["optimizer"]["clip_grad"])
        for g in opt.param_groups:
            g["lr"] = lr
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    adapters = {ours_of[n]: p.detach().clone() for n, p in model.named_parameters() if n in ours_of}
    return losses, adapters


def test_lora_equals_peft_and_one_process_at_2x2x2_resumes_and_exports(tmp_path):
    base_dir = tmp_path / "base_hf"
    _hf_base(base_dir)
    common = LORA + [f"model.init_method={{path: {base_dir}}}"]
    one = layout_overrides(1, 1, "ALL_REDUCE", 0, False)
    ref, _, again = run_ranks(1, _runs, [common + one + _ck(tmp_path, "ref"),
                                         common + one + _ck(tmp_path, "one"),
                                         common + one + _ck(tmp_path, "again", "one/2")],
                              timeout=300)[0]  # fmt: skip
    three_d = layout_overrides(2, 2, "REDUCE_SCATTER", 1, False) + ["parallelism.pp=2"]
    fsdp = layout_overrides(4, 2, "ALL_REDUCE", 0, False) + ["mesh3d.full_shard=true"]
    runs = [common + three_d + _ck(tmp_path, "3d"),
            common + three_d + _ck(tmp_path, "3d_from_one", "one/2"),
            common + fsdp + _ck(tmp_path, "fsdp_from_3d", "3d/2")]  # fmt: skip
    three, from_one, from_3d = run_ranks(8, _runs, runs, timeout=600)[0]
    adapters = [k for k in ref["weights"] if "lora_" in k]
    assert len(adapters) == 2 * 7 * 2 and ref["frozen"] and three["frozen"]
    assert ref["optimizer_states"] == len(adapters)  # no optimizer state for the base

    # peft on transformers, plain loop, same batches and adapter initialisation
    losses, theirs = _peft_loop(base_dir, ref)
    peft_diff = max([rel(torch.tensor(losses), torch.tensor(ref["loss"]))]
                    + [rel(ref["weights"][k], theirs[k]) for k in adapters])  # fmt: skip
    tail = {**ref, "loss": ref["loss"][2:], "grad_norm": ref["grad_norm"][2:]}
    diffs = {"peft LoraModel, plain loop": peft_diff,
             "dp2 x tp2 x pp2, zero 1": _max_rel(three, ref),
             "2x2x2 resumed from one process's step 2": _max_rel(from_one, tail),
             "dp4 x tp2 full shard resumed from 2x2x2's step 2": _max_rel(from_3d, tail)}  # fmt: skip
    print(
        "\nLoRA vs one process, max relative difference:", {k: f"{v:.1e}" for k, v in diffs.items()}
    )
    assert all(v <= 1e-5 for v in diffs.values()), diffs
    assert ref["loss"][-1] < ref["loss"][0]
    assert again["loss"] == ref["loss"][2:] and again["grad_norm"] == ref["grad_norm"][2:]
    assert all(torch.equal(again["weights"][k], ref["weights"][k]) for k in adapters)  # exact
    base = transformers.LlamaForCausalLM.from_pretrained(base_dir).state_dict()
    assert torch.equal(ref["weights"]["layers.0.self_attn.q_proj.weight"],
                       base["model.layers.0.self_attn.q_proj.weight"])  # frozen, bitwise  # fmt: skip

    # the checkpoint: adapters only, and the base it applies to
    step = tmp_path / "ref" / "4"
    saved = {
        p.parent.relative_to(step / "model").as_posix()
        for p in (step / "model").rglob("*.safetensors")
    }
    assert saved == {k.removesuffix(".weight").replace(".", "/") for k in adapters}
    meta = json.loads((step / "checkpoint_metadata.json").read_text())["custom_metas"]["lora"]
    assert meta["base"]["path"] == str(base_dir.resolve()) and meta["r"] == 4

    # exports: PEFT adapter folder onto the HF base, and the merged model, give our logits
    from mesh3d.convert import main as convert
    from mesh3d.generation.load import load_model

    convert(
        ["to-peft", "--checkpoint", str(tmp_path / "ref"), "--output", str(tmp_path / "adapter")]
    )
    convert(["to-hf", "--checkpoint", str(tmp_path / "ref"), "--output", str(tmp_path / "merged")])
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    ours, _ = load_model(step, torch.device("cpu"))
    with torch.no_grad():
        want = ours(ids)[..., :VOCAB]
        hf_base = transformers.LlamaForCausalLM.from_pretrained(base_dir)
        plain = hf_base(input_ids=ids).logits
        via_peft = peft.PeftModel.from_pretrained(hf_base, tmp_path / "adapter")(
            input_ids=ids
        ).logits
        merged = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "merged")(
            input_ids=ids
        ).logits
    # generation at tp 2 x pp 2 runs the base with the adapters live: the merged model's tokens
    from mesh3d.generation.sampling import generate

    prompt = ids[0, :6]
    with torch.no_grad():
        one = generate(ours, prompt, 10, vocab_size=VOCAB).tolist()
    parallel = run_ranks(4, _generate_parallel, step, prompt, timeout=300)
    assert all(p == one for p in parallel), (one, parallel)
    print(
        "logits: PEFT export",
        f"{rel(via_peft, want):.1e}",
        "merged export",
        f"{rel(merged, want):.1e}",
    )
    assert rel(via_peft, want) <= 1e-5 and rel(merged, want) <= 1e-5
    assert rel(via_peft, plain) > 1e-3  # the adapters change the model
