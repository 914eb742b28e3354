"""`mesh3d generate`: greedy output token for token what transformers' `generate` gives on the
converted model (Llama, Qwen2, Starcoder2), seeded sampling, top-k, and the command line
(tokenizer choice, printed text, errors that exit 2 without a traceback).

The tests of this subject that launch real processes are in
`tests/launch/test_generate_launch.py`."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch

from mesh3d import cli
from mesh3d.checkpoint import hf as convert
from mesh3d.checkpoint.nanotron_weights import write_nanotron_weights
from mesh3d.config import LlamaConfig, Qwen2Config, Starcoder2Config
from mesh3d.data.synthetic import make_tokenizer
from mesh3d.data.tokenize import load_tokenizer
from mesh3d.generate import main
from mesh3d.generation.load import load_model
from mesh3d.generation.sampling import generate, next_token
from mesh3d.models.registry import spec_of

transformers = pytest.importorskip("transformers", reason="transformers (dev extra) not installed")

SIZES = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
             num_hidden_layers=3, max_position_embeddings=64, rms_norm_eps=1e-5, eos_token_id=2)  # fmt: skip
FAMILIES = {
    "llama": LlamaConfig(**SIZES, vocab_size=128),
    "qwen2 bias tied": Qwen2Config(**SIZES, vocab_size=128, attention_bias=True,
                                   tie_word_embeddings=True),
    "starcoder2 grouped-query": Starcoder2Config(
        **{k: v for k, v in SIZES.items() if k not in ("rms_norm_eps", "num_key_value_heads")},
        vocab_size=128, grouped_query=True, num_kv_heads=2, sliding_window_size=4),
}  # fmt: skip
CPU = torch.device("cpu")


def save_step(step, mc, tp: int, pp: int, seed: int = 0):
    """A random single-device model of `mc` saved as Nanotron-layout weights at tp x pp."""
    torch.manual_seed(seed)
    model = spec_of(mc).build(mc, attention="sdpa")
    write_nanotron_weights(step / "model", model.state_dict(), convert.shape_of(mc), tp=tp, pp=pp)
    (step / "model_config.json").write_text(json.dumps(dataclasses.asdict(mc)))
    return model


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_is_transformers_generate(tmp_path, family):
    mc = FAMILIES[family]
    save_step(tmp_path / "ck", mc, tp=2, pp=2)
    convert.to_hf(tmp_path / "ck", tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ours, _ = load_model(tmp_path / "ck", CPU)
    full_length = 0
    for prompt in ([5, 7, 9], [1, 100, 3, 4, 50], [42], [[3, 4, 5, 6], [9, 8, 7, 6]]):
        ids = torch.tensor(prompt if isinstance(prompt[0], list) else [prompt])
        expected = hf.generate(ids, max_new_tokens=12, do_sample=False)
        got = generate(ours, ids, 12, eos=mc.eos_token_id)  # KV cache
        assert got.tolist() == expected.tolist(), (family, prompt)
        plain = generate(ours, ids, 12, eos=mc.eos_token_id, cache=False)  # whole sequence
        assert plain.tolist() == expected.tolist(), (family, prompt)
        full_length += got.shape[1] == ids.shape[1] + 12
    assert full_length >= 2  # most prompts ran all 12 tokens (eos 2 is rarely drawn)

    # an eos the model produces: both stop right after it
    ids = torch.tensor([[5, 7, 9]])
    stop = int(generate(ours, ids, 12)[0, 5])  # the 3rd new token
    expected = hf.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=stop)
    got = generate(ours, ids, 12, eos=stop)
    assert got.tolist() == expected.tolist() and got[0, -1] == stop and got.shape[1] <= 6


def _qwen3_dense(path):
    from test_convert_moe import _random_saved

    cfg = transformers.Qwen3Config(vocab_size=101, hidden_size=64, intermediate_size=96,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                   num_hidden_layers=3, max_position_embeddings=64)  # fmt: skip
    return _random_saved(transformers.Qwen3ForCausalLM(cfg), path)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "qwen2_moe"])
def test_cached_greedy_is_transformers_generate_from_hf(tmp_path, family):
    """Families converted from transformers' own models: the KV-cached greedy tokens equal
    `generate`'s, 40 new tokens, a batch of two prompts and a single one."""
    from test_convert_moe import qwen2_moe, qwen3_moe

    make = {"qwen3": _qwen3_dense, "qwen3_moe": qwen3_moe, "qwen2_moe": qwen2_moe}[family]
    hf = make(tmp_path / "hf")
    convert.from_hf(tmp_path / "hf", tmp_path / "nt")
    ours, mc = load_model(tmp_path / "nt", CPU)
    for prompt in ([[5, 7, 9, 11], [60, 2, 33, 4]], [[42]]):
        ids = torch.tensor(prompt)
        expected = hf.generate(ids, max_new_tokens=40, do_sample=False, eos_token_id=None,
                               pad_token_id=0)  # fmt: skip
        got = generate(ours, ids, 40, vocab_size=101)
        assert got.tolist() == expected.tolist(), (family, prompt)


@pytest.fixture(scope="module")
def model():
    mc = LlamaConfig(**SIZES, vocab_size=128)
    torch.manual_seed(3)
    return spec_of(mc).build(mc, attention="sdpa").eval()


def test_sampling_is_reproducible_with_a_seed(model):
    ids = torch.tensor([5, 7, 9])

    def sample(seed: int, **kw) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed)
        return generate(model, ids, 12, temperature=2.0, generator=gen, **kw)

    assert torch.equal(sample(1), sample(1))
    assert not torch.equal(sample(1), sample(2))
    assert not torch.equal(sample(1), generate(model, ids, 12))  # not greedy
    assert torch.equal(sample(1, top_k=1), generate(model, ids, 12))  # top-1 is greedy
    assert sample(1, vocab_size=10)[3:].max() < 10  # padding ids are never picked


def test_top_k_restricts_tokens():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.5, -1.0, 2.9]])
    gen = torch.Generator().manual_seed(0)
    top3 = {int(next_token(logits, 5.0, 3, gen)) for _ in range(300)}
    assert top3 == {1, 3, 5}
    free = {int(next_token(logits, 5.0, None, gen)) for _ in range(300)}
    assert free == set(range(6))
    assert int(next_token(logits)) == 1  # temperature 0: argmax
    with pytest.raises(ValueError, match="top_k >= 1"):
        generate(torch.nn.Identity(), torch.tensor([1]), 3, top_k=0)


# ---- the command line ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """A checkpoints folder (latest.txt -> 7) whose step holds a tiny Llama (pp 2) and, in
    tokenizer/, the BPE tokenizer it goes with (300 ids, `</s>` = 2 = eos)."""
    root = tmp_path_factory.mktemp("gen")
    tok = make_tokenizer(root / "tok", vocab_size=300).parent
    step = root / "ckpts" / "7"
    save_step(step, LlamaConfig(**SIZES, vocab_size=300), tp=1, pp=2)
    (step / "checkpoint_metadata.json").write_text("{}")
    shutil.copytree(tok, step / "tokenizer")
    (root / "ckpts" / "latest.txt").write_text("7")
    return root


def run_main(capsys, *argv: str, entry=main) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of the command in this process."""
    try:
        entry(list(argv))
        code = 0
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_prints_the_prompt_and_the_generated_text(ckpts, capsys):
    code, out, err = run_main(capsys, "generate", "--checkpoint", str(ckpts / "ckpts"),
                              "--prompt", "The cat was", "--max-new-tokens", "8",
                              entry=cli.main)  # fmt: skip
    assert code == 0, err
    assert "(saved with the checkpoint)" in err
    assert " s at tp 1 x pp 1 on cpu (KV cache, " in err, err  # the layout, as at tp x pp
    tok = load_tokenizer(ckpts / "tok")
    model, _ = load_model(ckpts / "ckpts" / "7", CPU)
    prompt = tok.encode("The cat was").ids
    ids = generate(model, torch.tensor(prompt), 8, eos=2).tolist()
    assert len(ids) > len(prompt)
    assert out == tok.decode(ids, skip_special_tokens=True) + "\n"
    assert out.startswith("The cat was") and len(out) > len("The cat was\n")


def test_cli_prompts_file_one_line_each_cache_or_not(ckpts, capsys, tmp_path):
    lines = ["The cat was", "", "A dog", "It is the"]
    (tmp_path / "p.txt").write_text("\n".join(lines) + "\n")
    outs = {}
    for flags in ((), ("--no-cache",)):
        code, out, err = run_main(capsys, "generate", "--checkpoint", str(ckpts / "ckpts"),
                                  "--prompts", str(tmp_path / "p.txt"), "--max-new-tokens", "6",
                                  *flags, entry=cli.main)  # fmt: skip
        assert code == 0, err
        assert ("no cache" if flags else "KV cache") in err and "tokens/s" in err
        outs[flags] = out
    tok = load_tokenizer(ckpts / "tok")
    model, _ = load_model(ckpts / "ckpts" / "7", CPU)
    expected = []
    for text in (t for t in lines if t):  # each prompt alone, the empty line skipped
        ids = generate(model, torch.tensor(tok.encode(text).ids), 6, eos=2, cache=False).tolist()
        expected.append(tok.decode(ids, skip_special_tokens=True) + "\n")
    assert outs[()] == outs[("--no-cache",)] == batch_output(expected)
    (tmp_path / "empty.txt").write_text("\n\n")
    code, _, err = run_main(capsys, "generate", "--checkpoint", str(ckpts / "ckpts"),
                            "--prompts", str(tmp_path / "empty.txt"), entry=cli.main)  # fmt: skip
    assert code == 2 and err.count("error:") == 1 and "no non-empty line" in err


def batch_output(outputs: list[str]) -> str:
    """What `generate` prints for a batch: each output under `--- prompt i of n ---`, a blank
    line between them."""
    n = len(outputs)
    return "\n".join(f"--- prompt {i} of {n} ---\n{o}" for i, o in enumerate(outputs, 1))


def test_missing_checkpoint_names_the_folder_a_run_wrote(ckpts, capsys, tmp_path, monkeypatch):
    """The README's `--checkpoint checkpoints` where the first run wrote
    runs/default/checkpoints: the refusal names that folder."""
    monkeypatch.chdir(tmp_path)
    args = ["--checkpoint", "checkpoints", "--prompt", "The"]
    code, _, err = run_main(capsys, *args)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert "--checkpoint checkpoints: no such folder" in err and "runs/<run name>" in err, err
    shutil.copytree(ckpts / "ckpts", tmp_path / "runs" / "default" / "checkpoints")
    (tmp_path / "runs" / "other" / "checkpoints").mkdir(parents=True)
    code, _, err = run_main(capsys, *args)
    assert code == 2 and err.count("\n") == 1, err
    assert "did you mean --checkpoint runs/default/checkpoints (or runs/other/checkpoints)" in err
    code, out, err = run_main(capsys, "--checkpoint", "runs/default/checkpoints", "--prompt",
                              "The", "--max-new-tokens", "2")  # fmt: skip
    assert code == 0 and out.startswith("The") and "--- prompt" not in out, err


def test_tokenizer_from_flag_then_folder_then_config(ckpts, capsys, tmp_path):
    step = tmp_path / "5"
    shutil.copytree(ckpts / "ckpts" / "7", step, ignore=shutil.ignore_patterns("tokenizer"))
    args = ["--checkpoint", str(step), "--prompt", "The", "--max-new-tokens", "3"]
    code, _, err = run_main(capsys, *args)
    assert code == 2 and err.startswith("error: no tokenizer for") and "--tokenizer" in err
    assert "Traceback" not in err

    (step / "config.yaml").write_text("tokenizer:\n  tokenizer_name_or_path: org/some-tokenizer\n")
    code, _, err = run_main(capsys, *args)
    assert code == 2 and "names 'org/some-tokenizer', which is not a local path" in err

    (step / "config.yaml").write_text(f"tokenizer:\n  tokenizer_name_or_path: {ckpts / 'tok'}\n")
    code, out, err = run_main(capsys, *args)
    assert code == 0 and "config.yaml tokenizer.tokenizer_name_or_path" in err
    assert out.startswith("The")

    code, _, err = run_main(capsys, *args, "--tokenizer", str(ckpts / "tok" / "tokenizer.json"))
    assert code == 0 and "(--tokenizer)" in err


# ---- a batch of prompts of different lengths, chats ----------------------------------------


BATCH_FAMILIES = {
    "llama": FAMILIES["llama"],
    "qwen2 bias window nope": Qwen2Config(**SIZES, vocab_size=128, attention_bias=True,
                                          sliding_window_size=4, no_rope_layer=2),
    "starcoder2 grouped-query": FAMILIES["starcoder2 grouped-query"],
}  # fmt: skip


@pytest.mark.parametrize("family", list(BATCH_FAMILIES))
def test_left_padded_batch_rows_equal_each_prompt_alone(family):
    """Prompts of 1, 3 and 6 tokens as one left-padded batch (cache or not): each row's greedy
    tokens are its prompt's alone, token for token; an EOS that one row produces stops that row
    only (windows of 4 tokens: they count real tokens only; a NoPE layer)."""
    from mesh3d.generation.cache import left_pad
    from mesh3d.generation.single import new_tokens

    mc = BATCH_FAMILIES[family]
    torch.manual_seed(5)
    model = spec_of(mc).build(mc, attention="sdpa").eval()
    with torch.no_grad():  # larger weights than the init's: varied tokens, not one repeated
        for w in model.parameters():
            if w.dim() > 1:
                w.normal_(0, 0.3)
    prompts = [[5, 7, 9], [42], [1, 100, 3, 4, 50, 6]]
    alone = [generate(model, torch.tensor(p), 12).tolist()[len(p) :] for p in prompts]
    assert len({tuple(a) for a in alone}) > 1
    k = next(k for k in range(2, 12) if alone[0][k] not in alone[0][:k])
    stop = alone[0][k]  # row 0 stops after its (k+1)th token
    expected = []
    for p in prompts:
        got = generate(model, torch.tensor(p), 12, eos=stop).tolist()
        expected.append(got[len(p) :])
    assert len(expected[0]) == k + 1 and len({len(e) for e in expected}) > 1
    ids, pads = left_pad(prompts, pad=0)
    assert pads.tolist() == [3, 5, 0] and ids.shape == (3, 6)
    for cache in (True, False):
        out = generate(model, ids, 12, eos=stop, cache=cache, pads=pads)
        assert new_tokens(out.tolist(), 6, stop) == expected, (family, cache)


def test_cli_chat_jsonl_rendered_with_the_chat_template(ckpts, capsys, tmp_path):
    """--prompts-file x.jsonl: chats rendered with the tokenizer's chat template and its
    generation prompt (and a plain {"prompt"} line), one batch; each output is the rendered
    prompt followed by what generating it alone gives."""
    tok_dir = tmp_path / "tok"
    shutil.copytree(ckpts / "tok", tok_dir)
    template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}assistant:{% endif %}")  # fmt: skip
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    chats = [[{"role": "user", "content": "The cat was"}],
             [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "A dog"}]]  # fmt: skip
    lines = [json.dumps({"messages": c}) for c in chats] + [json.dumps({"prompt": "It is the"})]
    (tmp_path / "p.jsonl").write_text("\n".join(lines) + "\n")
    code, out, err = run_main(capsys, "--checkpoint", str(ckpts / "ckpts"), "--prompts-file",
                              str(tmp_path / "p.jsonl"), "--tokenizer", str(tok_dir),
                              "--max-new-tokens", "6")  # fmt: skip
    assert code == 0, err
    assert "3 prompts in one batch" in err
    tok = load_tokenizer(tok_dir)
    model, _ = load_model(ckpts / "ckpts" / "7", CPU)
    rendered = ["user: The cat was\nassistant:", "system: Be brief.\nuser: A dog\nassistant:"]
    expected = []
    for text, chat in ((rendered[0], True), (rendered[1], True), ("It is the", False)):
        ids = tok.encode(text, add_special_tokens=not chat).ids
        got = generate(model, torch.tensor(ids), 6, eos=2).tolist()
        expected.append(tok.decode(got, skip_special_tokens=True) + "\n")
    assert out == batch_output(expected)
    assert out.startswith("--- prompt 1 of 3 ---\nuser: The cat was\nassistant:")

    (tmp_path / "bad.jsonl").write_text('{"text": "x"}\n')
    code, _, err = run_main(capsys, "--checkpoint", str(ckpts / "ckpts"), "--prompts",
                            str(tmp_path / "bad.jsonl"))  # fmt: skip
    assert code == 2 and 'line 1 has neither "messages"' in err and "its keys: text" in err
    (tmp_path / "chat.jsonl").write_text(lines[0] + "\n")
    no_template = ["--checkpoint", str(ckpts / "ckpts"), "--prompts", str(tmp_path / "chat.jsonl")]
    code, _, err = run_main(capsys, *no_template)  # no template, no ChatML tokens
    assert code == 2 and "no chat template" in err and err.count("\n") == 1
    assert f"--prompts {tmp_path / 'chat.jsonl'} holds chats" in err, err
    code, _, err = run_main(capsys, *no_template[:2], "--prompts-file", no_template[3])
    assert code == 2 and err.count("\n") == 1, err
    assert f"error: --prompts-file {tmp_path / 'chat.jsonl'} holds chats" in err, err
    assert "this tokenizer" in err and "give plain prompts" in err, err
    assert "dataset" not in err and "'prompt' and 'completion'" not in err, err
