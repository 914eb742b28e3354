"""SFT training (`data/sft.py`): the step-1 loss against transformers, and layout parity.

Reference: the test tokenizes every example itself (prompt + completion + EOS), runs a
transformers `LlamaForCausalLM` holding the run's initial weights on each example alone (no
padding, no packing), and sums the cross-entropy of the completion targets over all examples,
divided by their count. A run whose one global batch holds every example (learning rate 1e-30,
far below a weight's fp32 rounding step, so the weights it returns are the initial ones) must report that loss at step 1, packed and not.
Then dp2 x tp2 x pp2 runs (one 8-rank launch) train SFT data packed and unpacked, and packed
with LoRA adapters, each like its one-process run (one 1-rank launch; fp32, relative difference
<= 1e-5 over losses, grad norms and weights; LoRA's weights with the adapters merged).

Chat data (`messages` with system, user and assistant turns, rendered with mesh3d's default
ChatML template, assistant turns trained), packed, at dp1 x cp2 x tp2 (4 ranks) equals one
process within 1e-5: the packed examples restart their positions, so attention across the cp
shards must keep to each example (document masking, `RunLayout.documents`). In the same
launches: a chat run at that layout stopped at step 2 and resumed equals the straight run
bitwise (losses, grad norms, weights), and one process resuming its step-2 checkpoint continues
the one-process run within 1e-5.

Validation and resume (one 1-rank and one 2-rank launch): the held-out SFT sequences' val_loss
equals the transformers completion-only loss of the held-out examples (found by their tokens in
the data file, none of them in a training sequence) under the run's final weights; the same
val_loss at dp 2. An SFT run stopped at step 3 and resumed equals the straight run step for
step (losses, grad norms, val_loss bitwise); resumed at dp 2 within 1e-6.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from data_fixtures import make_tokenizer
from dist import run_ranks
from parity import TINY, max_rel_diff, train_runs

from mesh3d.data.sft import build_sequences

SEQ = 32
VOCAB = 320
N_EXAMPLES = 8


def _examples() -> list[dict]:
    rows = [{"prompt": f"Q: {i}+{3 * i}=", "completion": f" {4 * i}"} for i in range(N_EXAMPLES)]
    rows[3]["completion"] = " the sum is twelve"  # a longer completion
    rows[5]["prompt"] = "Q: five+15="
    return rows


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("sft")
    make_tokenizer(d / "tok", vocab_size=300)
    with open(d / "sft.jsonl", "w") as f:
        for r in _examples():
            f.write(json.dumps(r) + "\n")
    with open(d / "many.jsonl", "w") as f:  # enough packed sequences for 3 steps of 4
        for i in range(60):
            f.write(json.dumps({"prompt": f"Q: {i}*2=", "completion": f" {2 * i}"}) + "\n")
    return d


BASE = copy.deepcopy(TINY)
BASE["model"]["model_config"].update(vocab_size=VOCAB, max_position_embeddings=SEQ)
BASE["tokens"]["sequence_length"] = SEQ


def _overrides(d, packing: bool, *more: str, file: str = "sft.jsonl") -> list[str]:
    stage = (f"data_stages=[{{name: sft, start_training_step: 1, data: {{seed: 5, dataset: "
             f"{{hf_dataset_or_datasets: {d / file}, sft_dataloader: true}}}}}}]")  # fmt: skip
    return [f"tokenizer.tokenizer_name_or_path={d / 'tok'}", stage,
            f"mesh3d.sft_packing={str(packing).lower()}", *more]  # fmt: skip


def _hf_reference(weights: dict, tok_dir, examples: list[dict] | None = None) -> float:
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer

    mc = BASE["model"]["model_config"]
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=mc["hidden_size"], intermediate_size=mc["intermediate_size"],
        num_attention_heads=mc["num_attention_heads"], num_key_value_heads=mc["num_key_value_heads"],
        num_hidden_layers=mc["num_hidden_layers"], rms_norm_eps=mc["rms_norm_eps"],
        max_position_embeddings=SEQ, tie_word_embeddings=False, hidden_act="silu",
    )  # fmt: skip
    cfg._attn_implementation = "eager"
    model = transformers.LlamaForCausalLM(cfg).eval()
    state = {("" if k == "lm_head.weight" else "model.") + k: v for k, v in weights.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    tok = Tokenizer.from_file(str(tok_dir / "tok" / "tokenizer.json"))
    eos = tok.token_to_id("</s>")
    total, count = 0.0, 0
    with torch.no_grad():
        for ex in examples if examples is not None else _examples():
            ids = tok.encode(ex["prompt"] + ex["completion"]).ids + [eos]
            prompt = len(tok.encode(ex["prompt"]).ids)
            assert len(ids) <= SEQ + 1
            logits = model(torch.tensor([ids[:-1]])).logits[0].double()
            targets = torch.tensor(ids[1:])
            ce = torch.nn.functional.cross_entropy(logits, targets, reduction="none")
            total += float(ce[prompt - 1 :].sum())  # targets at index >= prompt in `ids`
            count += len(ids) - prompt
    return total / count


def test_step_one_loss_equals_transformers_completion_loss(data):
    import datasets

    rows = datasets.Dataset.from_list(_examples())
    packed = len(build_sequences(rows, str(data / "tok"), SEQ, 5, True, None, "t")[0])
    assert packed < N_EXAMPLES  # packing puts several examples in one sequence
    zero_lr = ["tokens.train_steps=1", "optimizer.learning_rate_scheduler.learning_rate=1e-30",
               "optimizer.learning_rate_scheduler.min_decay_lr=1e-30", "tokens.micro_batch_size=1"]  # fmt: skip
    runs = [  # one global batch = every sequence, so every example
        _overrides(data, False, *zero_lr, f"tokens.batch_accumulation_per_replica={N_EXAMPLES}"),
        _overrides(data, True, *zero_lr, f"tokens.batch_accumulation_per_replica={packed}"),
    ]
    single, multi = run_ranks(1, train_runs, runs, BASE, timeout=300)[0]
    ref = _hf_reference(single["weights"], data)
    assert torch.equal(single["weights"]["lm_head.weight"], multi["weights"]["lm_head.weight"])
    print(f"\nstep-1 loss: transformers {ref:.8f}, one per sequence {single['loss'][0]:.8f}, "
          f"packed {multi['loss'][0]:.8f}")  # fmt: skip
    assert abs(single["loss"][0] - ref) <= 1e-5 * ref
    assert abs(multi["loss"][0] - ref) <= 1e-5 * ref


def test_dp2_tp2_pp2_sft_matches_one_process(data):
    """Packed and unpacked SFT data, and packed with LoRA adapters (`mesh3d.lora`): one 1-rank
    launch trains the references, one 8-rank launch the layouts."""
    common = ["tokens.train_steps=3", "tokens.micro_batch_size=1",
              "model.model_config.num_hidden_layers=4"]  # fmt: skip
    lora = ["mesh3d.lora={r: 4, target_modules: all-linear}",
            "optimizer.learning_rate_scheduler.learning_rate=0.01"]  # fmt: skip
    variants = {
        "packing on": (True, []),
        "packing off": (False, []),
        "packing on, LoRA": (True, lora),
    }
    ones = [_overrides(data, p, *common, *extra, "tokens.batch_accumulation_per_replica=4",
                       file="many.jsonl") for p, extra in variants.values()]  # fmt: skip
    refs = run_ranks(1, train_runs, ones, BASE, timeout=300)[0]
    assert all(ref["loss"][-1] < ref["loss"][0] for ref in refs)
    assert refs[0]["loss"] != refs[1]["loss"]  # packing changes the sequences
    layout = ["parallelism.dp=2", "parallelism.tp=2", "parallelism.pp=2",
              "parallelism.tp_mode=REDUCE_SCATTER", "tokens.batch_accumulation_per_replica=2"]  # fmt: skip
    runs = [_overrides(data, p, *common, *extra, *layout, file="many.jsonl")
            for p, extra in variants.values()]  # fmt: skip
    results = run_ranks(8, train_runs, runs, BASE, timeout=600)
    diffs = {}
    for i, name in enumerate(variants):
        run = results[0][i]
        for r in results[1:]:
            assert r[i]["loss"] == run["loss"]
            assert not r[i]["replica_mismatches"]
        ref = refs[i]
        if name.endswith("LoRA"):  # the adapters merged: what the model computes (see below)
            factors = max_rel_diff(run, ref, vocab=VOCAB)
            assert factors <= 1e-4, factors
            run, ref = _merged(run), _merged(ref)
        diffs[name] = max_rel_diff(run, ref, vocab=VOCAB)
    frozen = refs[2]["weights"]["layers.0.mlp.up_proj.weight"]
    assert torch.equal(frozen, results[0][2]["weights"]["layers.0.mlp.up_proj.weight"])
    print("\ndp2 x tp2 x pp2 SFT vs one process, max relative difference:",
          {k: f"{v:.2e}" for k, v in diffs.items()})  # fmt: skip
    assert all(v <= 1e-5 for v in diffs.values()), diffs


def _merged(run: dict) -> dict:
    """`run` with each LoRA adapter folded into its weight (W + 2 B A: lora_alpha 8 / r 4).

    The adapter factors alone differ between layouts by up to ~3e-5 after 3 steps: B starts at
    zero, so A's first gradients (proportional to B) are ~1e-6, Adam's eps, where its update
    g / (|g| + eps) turns fp32 summation-order noise into relative differences of the update
    (losses and grad norms stay within 2e-7). The product B A, what the model computes, is
    compared within 1e-5 like every other weight."""
    w = dict(run["weights"])
    for k in [k for k in w if k.endswith(".lora_A.weight")]:
        m = k.removesuffix(".lora_A.weight")
        w[f"{m}.weight"] = w[f"{m}.weight"] + 2.0 * w.pop(f"{m}.lora_B.weight") @ w.pop(k)
    return {**run, "weights": w}


# --- chat data at context parallelism --------------------------------------------------------

CHAT_SEQ = 64  # the conversations render to 22-56 tokens: packing puts up to 2 in a sequence


def _conversations(n: int = 32) -> list[dict]:
    rows = []
    for i in range(n):
        m = [{"role": "user", "content": f"{i}+{i}"}, {"role": "assistant", "content": f"{2 * i}"}]
        if i % 4 == 0:
            m = [{"role": "system", "content": "Add."}, *m]
        if i % 3 == 0:
            m += [{"role": "user", "content": "and"}, {"role": "assistant", "content": f"{i}"}]
        rows.append({"messages": m})
    return rows


@pytest.fixture(scope="module")
def chat_data(data):
    """The test tokenizer with ChatML's <|im_start|> and <|im_end|> (mesh3d's default chat
    template), and a jsonl of conversations with system, user and assistant turns."""
    from tokenizers import Tokenizer

    t = Tokenizer.from_file(str(data / "tok" / "tokenizer.json"))
    t.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    (data / "chat_tok").mkdir()
    t.save(str(data / "chat_tok" / "tokenizer.json"))
    with open(data / "chat.jsonl", "w") as f:
        for r in _conversations():
            f.write(json.dumps(r) + "\n")
    return data


def test_chat_sft_at_cp2_tp2_matches_one_process_and_resumes(chat_data, tmp_path):
    """Chat data, packed (examples restart their positions: document masking across the cp
    shards), at dp1 x cp2 x tp2 (REDUCE_SCATTER) against one process; at that layout a run
    stopped at step 2 and resumed continues the straight run bitwise, and one process resumes
    its step-2 checkpoint like the one-process straight run (<= 1e-5)."""
    d = chat_data
    stage = (f"data_stages=[{{name: chat, start_training_step: 1, data: {{seed: 5, dataset: "
             f"{{hf_dataset_or_datasets: {d / 'chat.jsonl'}, sft_dataloader: true}}}}}}]")  # fmt: skip
    common = [f"tokenizer.tokenizer_name_or_path={d / 'chat_tok'}", stage,
              "mesh3d.sft_packing=true", f"tokens.sequence_length={CHAT_SEQ}",
              f"model.model_config.max_position_embeddings={CHAT_SEQ}",
              "tokens.micro_batch_size=1", "tokens.batch_accumulation_per_replica=4"]  # fmt: skip
    layout = ["parallelism.context_parallel_size=2", "parallelism.tp=2",
              "parallelism.tp_mode=REDUCE_SCATTER"]  # fmt: skip
    cp = [
        common + layout + _ckpt(tmp_path / "straight", 4),
        common + layout + _ckpt(tmp_path / "first", 2, interval=2),
        common + layout + _ckpt(tmp_path / "resumed", 4, resume=tmp_path / "first"),
    ]
    results = run_ranks(4, train_runs, cp, BASE, timeout=500)
    for i in range(len(cp)):
        for r in results[1:]:
            assert r[i]["loss"] == results[0][i]["loss"]
            assert not r[i]["replica_mismatches"]
    straight, first, resumed = results[0]
    one = [common + _ckpt(tmp_path / "one", 4),
           common + _ckpt(tmp_path / "one_resumed", 4, resume=tmp_path / "first" / "2")]  # fmt: skip
    ref, ref_resumed = run_ranks(1, train_runs, one, BASE, timeout=300)[0]
    assert ref["loss"][-1] < ref["loss"][0]
    diff = max_rel_diff(straight, ref, vocab=VOCAB)
    print(f"\nchat SFT, dp1 x cp2 x tp2 vs one process: max relative difference {diff:.2e}")
    assert diff <= 1e-5
    assert first["loss"] == straight["loss"][:2]
    assert resumed["loss"] == straight["loss"][2:]  # bitwise
    assert resumed["grad_norm"] == straight["grad_norm"][2:]
    assert all(torch.equal(w, straight["weights"][k]) for k, w in resumed["weights"].items())
    got, want = torch.tensor(ref_resumed["loss"]), torch.tensor(ref["loss"][2:])
    at_one = float((got - want).abs().max() / want.abs().max())
    print(f"cp2 x tp2 chat checkpoint resumed by one process: losses within {at_one:.2e}")
    assert at_one <= 1e-5, (got, want)


# --- validation on SFT data, exact resume ------------------------------------------------

VAL = ["tokens.micro_batch_size=1", "tokens.val_check_interval=2", "tokens.limit_val_batches=1"]


def _ckpt(path, steps: int, interval: int = 100, resume=None) -> list[str]:
    out = [f"checkpoints.checkpoints_path={path}", f"checkpoints.checkpoint_interval={interval}",
           f"tokens.train_steps={steps}"]  # fmt: skip
    return out + ([f"checkpoints.resume_checkpoint_path={resume}"] if resume else [])


def _val_runs(rank: int, world: int, runs: list[list[str]]) -> list[dict]:
    """Inside a rank: train each override list of BASE; losses, grad norms, val losses by
    step, rank-0 weights."""
    from parity import full_weights

    from mesh3d.config import apply_overrides, config_from_dict
    from mesh3d.train.hooks import KeepModel
    from mesh3d.train.loop import train

    out = []
    for overrides in runs:
        res = train(apply_overrides(config_from_dict(copy.deepcopy(BASE)), overrides),
                    hooks=[KeepModel()])  # fmt: skip
        weights = full_weights(res.model, res.mesh)
        out.append(dict(
            loss=[m["lm_loss"] for m in res.metrics],
            grad_norm=[m["grad_norm"] for m in res.metrics],
            val={m["iteration"]: m["val_loss"] for m in res.metrics if "val_loss" in m},
            weights=weights if rank == 0 else None,
        ))  # fmt: skip
    return out


@pytest.fixture(scope="module")
def val_runs(data):
    d = data / "val"
    one = [
        _overrides(data, True, *VAL, "tokens.batch_accumulation_per_replica=4",
                   *_ckpt(d / "straight", 6), file="many.jsonl"),
        _overrides(data, True, *VAL, "tokens.batch_accumulation_per_replica=4",
                   *_ckpt(d / "first", 3, interval=3), file="many.jsonl"),
        _overrides(data, True, *VAL, "tokens.batch_accumulation_per_replica=4",
                   *_ckpt(d / "resumed", 6, resume=d / "first"), file="many.jsonl"),
    ]  # fmt: skip
    dp2 = ["parallelism.dp=2", "tokens.batch_accumulation_per_replica=2"]
    two = [
        _overrides(data, True, *VAL, *dp2, *_ckpt(d / "dp2", 6), file="many.jsonl"),
        _overrides(data, True, *VAL, *dp2, *_ckpt(d / "dp2_resumed", 6, resume=d / "first" / "3"),
                   file="many.jsonl"),
    ]  # fmt: skip
    ones = run_ranks(1, _val_runs, one, timeout=300)[0]
    twos = run_ranks(2, _val_runs, two, timeout=300)
    assert twos[0][0]["val"] == twos[1][0]["val"]  # every rank reports the same
    return dict(zip(["straight", "first", "resumed"], ones)) | dict(
        zip(["dp2", "dp2_resumed"], twos[0])
    )


def _held_out_rows(data) -> tuple[list[dict], set[tuple]]:
    """The data file's rows whose tokens are in the held-out sequences, and the token tuples of
    the examples in the training sequences."""
    from tokenizers import Tokenizer

    from mesh3d.config import apply_overrides, config_from_dict
    from mesh3d.data.build import build_dataset
    from mesh3d.data.documents import IGNORE

    cfg = apply_overrides(config_from_dict(copy.deepcopy(BASE)), _overrides(
        data, True, *VAL, "tokens.batch_accumulation_per_replica=4", "tokens.train_steps=6",
        file="many.jsonl"))  # fmt: skip
    ds = build_dataset(cfg, 0)

    def examples(sequences) -> set[tuple]:
        out = set()
        for inputs, labels, positions in sequences:
            starts = [i for i, p in enumerate(positions) if p == 0] + [len(positions)]
            for a, b in zip(starts, starts[1:]):
                if (labels[a:b] != IGNORE).any():  # not padding: a whole example
                    last = [t for t in labels[a:b] if t != IGNORE][-1]
                    out.add((*inputs[a:b].tolist(), int(last)))
        return out

    held, trained = examples(ds.held), examples(ds.sequences)
    assert len(ds.held) == 4 and held and not held & trained
    tok = Tokenizer.from_file(str(data / "tok" / "tokenizer.json"))
    eos = tok.token_to_id("</s>")
    rows = [json.loads(line) for line in (data / "many.jsonl").read_text().splitlines()]
    by_ids = {(*tok.encode(r["prompt"] + r["completion"]).ids, eos): r for r in rows}
    assert held <= by_ids.keys()
    return [by_ids[ids] for ids in held], trained


def test_sft_validation_loss_is_the_completion_loss_of_the_held_out_examples(val_runs, data):
    run = val_runs["straight"]
    assert sorted(run["val"]) == [2, 4, 6]
    rows, _ = _held_out_rows(data)
    ref = _hf_reference(run["weights"], data, rows)  # weights after step 6: its val pass's
    print(f"\nSFT val_loss at step 6: {run['val'][6]:.8f}, transformers on the "
          f"{len(rows)} held-out examples {ref:.8f}")  # fmt: skip
    assert abs(run["val"][6] - ref) <= 1e-5 * ref
    dp2 = val_runs["dp2"]["val"]
    assert dp2.keys() == run["val"].keys()
    assert all(abs(dp2[k] - v) <= 1e-6 * v for k, v in run["val"].items()), (dp2, run["val"])


def test_sft_exact_resume(val_runs):
    straight, first, resumed = val_runs["straight"], val_runs["first"], val_runs["resumed"]
    assert first["loss"] == straight["loss"][:3]
    assert resumed["loss"] == straight["loss"][3:]  # bitwise: floats compared with ==
    assert resumed["grad_norm"] == straight["grad_norm"][3:]
    assert resumed["val"] == {k: v for k, v in straight["val"].items() if k > 3}
    got, ref = torch.tensor(val_runs["dp2_resumed"]["loss"]), torch.tensor(straight["loss"][3:])
    assert float((got - ref).abs().max() / ref.abs().max()) <= 1e-6, (got, ref)
