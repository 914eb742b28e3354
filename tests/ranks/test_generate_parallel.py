"""`mesh3d generate` at tp/pp: greedy tokens at tp 2, pp 2 and tp 2 x pp 2 are the one-process
`generate`'s on the same checkpoint, with the KV cache (each rank's layers and heads) and without,
and for a left-padded batch of prompts of different lengths each row is its prompt's alone; the
torchrun command line prints the one-process text (one prompt, and a file of prompts).

Two launches. 2 ranks: train one step of a tiny Llama at tp 2 (odd vocabulary: padded at tp 2),
of a tiny Qwen2 (biases, tied embeddings, a NoPE layer, a sliding window, REDUCE_SCATTER) at
pp 2, of a tiny Qwen3 (and Qwen3-MoE) at tp 2 and of a tiny Starcoder2 at tp 2 (multi-query, windows,
dropout in training), each saving its checkpoint; generate from each at tp 2 and at
pp 2; run the command at pp 2, and at a layout that is not the world size. 4 ranks: generate
from each at tp 2 x pp 2, greedy and sampled.
"""

from __future__ import annotations

import contextlib
import copy
import io

import pytest
import torch
from dist import run_ranks
from parity import TINY

from mesh3d.config import apply_overrides, config_from_dict
from mesh3d.data.synthetic import make_tokenizer
from mesh3d.generate import main
from mesh3d.generation.cache import left_pad
from mesh3d.generation.load import load_model
from mesh3d.generation.parallel import generate_parallel, load_parallel_model
from mesh3d.generation.sampling import generate
from mesh3d.generation.single import new_tokens
from mesh3d.train.loop import train

VOCAB = 301  # the tokenizer's 300 ids fit; odd, so tp 2 pads it
PROMPTS = torch.tensor([[5, 7, 9, 11, 13], [1, 100, 3, 4, 50]])
RAGGED = [[5, 7, 9], [1, 100, 3, 4, 50]]  # left-padded to 5: pads [2, 0]
NEW = 10  # 5 + 10 tokens fit TINY's 16 positions
EOS = 2
SEED = 1


def _qwen2() -> dict:
    d = copy.deepcopy(TINY)
    mc = d["model"]["model_config"]
    del mc["is_llama_config"]
    mc.update(is_qwen2_config=True, attention_bias=True, tie_word_embeddings=True,
              no_rope_layer=2, sliding_window_size=6)  # fmt: skip
    d["parallelism"]["tp_mode"] = "REDUCE_SCATTER"
    return d


def _qwen3() -> dict:
    """Qwen3: the step folder's config.yaml is Nanotron's Qwen2; the family and head size are
    in its metadata's `mesh3d:` settings."""
    d = copy.deepcopy(TINY)
    mc = d["model"]["model_config"]
    del mc["is_llama_config"]
    mc["is_qwen2_config"] = True
    d["mesh3d"].update(model_family="qwen3", head_dim=16)  # 8 heads x 16 > hidden 64
    return d


def _qwen3_moe() -> dict:
    """Qwen3-MoE with renormalized router weights: `norm_topk_prob` lives in `mesh3d:`, so the
    parallel path must read it back from the metadata as the one-process path does from
    model_config.json (it once rebuilt the model with False)."""
    d = _qwen3()
    d["model"]["model_config"]["moe_config"] = dict(
        num_experts=4, top_k=2, moe_intermediate_size=32, enable_shared_expert=False, layers=[-1]
    )
    d["mesh3d"]["norm_topk_prob"] = True
    return d


def _starcoder2() -> dict:
    """Starcoder2: multi-query (its one k/v head whole on each tp rank), a window on all layers
    but the global one, dropout 0.1 while training (none when generating)."""
    d = copy.deepcopy(TINY)
    d["model"]["model_config"] = dict(
        is_starcoder2_config=True, hidden_size=64, intermediate_size=128, num_attention_heads=8,
        num_hidden_layers=2, max_position_embeddings=16, vocab_size=VOCAB, sliding_window_size=6,
        global_attn_layers=[1])  # fmt: skip
    return d


FAMILIES = {
    "llama": (TINY, "parallelism.tp=2"),
    "qwen2": (_qwen2(), "parallelism.pp=2"),
    "qwen3": (_qwen3(), "parallelism.tp=2"),
    "qwen3-moe": (_qwen3_moe(), "parallelism.tp=2"),
    "starcoder2": (_starcoder2(), "parallelism.tp=2"),
}


def _train(root, name: str) -> None:
    base, layout = FAMILIES[name]
    cfg = apply_overrides(config_from_dict(copy.deepcopy(base)), [
        layout, f"model.model_config.vocab_size={VOCAB}", "tokens.train_steps=1",
        f"checkpoints.checkpoints_path={root / name}", "checkpoints.checkpoint_interval=1",
        f"tokenizer.tokenizer_name_or_path={root / 'tok'}",
    ])  # fmt: skip
    train(cfg)


def _greedy(root, layouts, sample: bool = False) -> dict:
    """Greedy tokens of both checkpoints at each (tp, pp); with `sample`, sampled ones too."""
    out = {}
    for name in FAMILIES:
        for tp, pp in layouts:
            model = load_parallel_model(root / name / "1", tp, pp, batch=2, length=15)
            out[name, tp, pp] = generate_parallel(model, PROMPTS, NEW, eos=EOS).tolist()
            plain = generate_parallel(model, PROMPTS, NEW, eos=EOS, cache=False)
            out[name, tp, pp, "no cache"] = plain.tolist()
            ids, pads = left_pad(RAGGED, 0)
            for cache in (True, False):
                got = generate_parallel(model, ids, NEW, eos=EOS, cache=cache, pads=pads)
                out[name, tp, pp, "ragged", cache] = new_tokens(got.tolist(), 5, EOS)
            if sample:
                gen = torch.Generator().manual_seed(SEED)
                got = generate_parallel(model, PROMPTS, NEW, 2.0, 50, EOS, gen)
                out[name, tp, pp, "sampled"] = got.tolist()
    return out


def _command(*argv: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `mesh3d generate` in this process."""
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(list(argv))
        except SystemExit as e:
            code = e.code
    return code, out.getvalue(), err.getvalue()


def _two_ranks(rank: int, world: int, root) -> dict:
    for name in FAMILIES:
        _train(root, name)
    results = _greedy(root, [(2, 1), (1, 2)])
    args = ["--checkpoint", str(root / "llama"), "--prompt", "The cat was", "--max-new-tokens", "8"]
    results["command"] = _command(*args, "--pp", "2")
    many = ["--checkpoint", str(root / "llama"), "--prompts", str(root / "prompts.txt"),
            "--max-new-tokens", "8"]  # fmt: skip
    results["batch"] = _command(*many, "--tp", "2")
    results["refused"] = _command(*args, "--tp", "1")
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("gen-parallel")
    make_tokenizer(root / "tok", vocab_size=300)
    (root / "prompts.txt").write_text("The cat was\nA dog\nIt is the end of\n")
    two = run_ranks(2, _two_ranks, root, timeout=300)
    four = run_ranks(4, lambda rank, world: _greedy(root, [(2, 2)], sample=True), timeout=180)
    return root, two, four


@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_tokens_at_tp_and_pp_are_one_process(runs, name):
    root, two, four = runs
    model, mc = load_model(root / name / "1", torch.device("cpu"))
    expected = generate(model, PROMPTS, NEW, eos=EOS, vocab_size=VOCAB).tolist()
    assert len(expected[0]) > 5 + 2  # not stopped at once by eos
    alone = [generate(model, torch.tensor(p), NEW, eos=EOS, vocab_size=VOCAB) for p in RAGGED]
    ragged = [new_tokens([a.tolist()], len(p), EOS)[0] for a, p in zip(alone, RAGGED)]
    for results, layouts in ((two, [(2, 1), (1, 2)]), (four, [(2, 2)])):
        for rank, got in enumerate(results):
            for tp, pp in layouts:
                assert got[name, tp, pp] == expected, (name, tp, pp, rank)  # KV cache
                assert got[name, tp, pp, "no cache"] == expected, (name, tp, pp, rank)
                for cache in (True, False):
                    assert got[name, tp, pp, "ragged", cache] == ragged, (name, tp, pp, cache)

    # sampling: the last stage's tp rank 0 draws with the seeded generator, every rank gets it
    gen = torch.Generator().manual_seed(SEED)
    sampled = generate(model, PROMPTS, NEW, 2.0, 50, EOS, gen, vocab_size=VOCAB).tolist()
    assert sampled != expected
    assert all(got[name, 2, 2, "sampled"] == sampled for got in four)


def test_the_parallel_model_has_every_setting_the_checkpoint_was_trained_with(runs):
    from mesh3d.generation.parallel import generation_config

    root, _, _ = runs
    for name in FAMILIES:
        _, mc = load_model(root / name / "1", torch.device("cpu"))
        cfg = generation_config(root / name / "1", tp=2, pp=2, batch=1, length=8, device="cpu")
        ours = cfg.model.model_config
        assert type(ours) is type(mc), name
        for key in ("head_dim", "norm_topk_prob", "moe_config", "no_rope_layer"):
            assert getattr(ours, key, None) == getattr(mc, key, None), (name, key)


def test_command_prints_the_one_process_text_on_rank_0(runs, monkeypatch):
    root, two, _ = runs
    args = ["--checkpoint", str(root / "llama"), "--prompt", "The cat was", "--max-new-tokens", "8"]
    for var in ("WORLD_SIZE", "RANK"):
        monkeypatch.delenv(var, raising=False)
    code, expected, err = _command(*args)
    assert code == 0 and expected.startswith("The cat was") and "on cpu" in err, err
    (code0, out0, err0), (code1, out1, err1) = (r["command"] for r in two)
    assert (code0, out0, code1, out1, err1) == (0, expected, 0, "", ""), (err0, err1)
    assert "(saved with the checkpoint)" in err0 and "at tp 1 x pp 2" in err0

    # a file of prompts at tp 2: one left-padded batch, the one-process text
    many = ["--checkpoint", str(root / "llama"), "--prompts", str(root / "prompts.txt"),
            "--max-new-tokens", "8"]  # fmt: skip
    code, expected, err = _command(*many)
    assert code == 0 and expected.count("\n") == 3 + 3 + 2, err  # outputs, headers, blank lines
    assert expected.startswith("--- prompt 1 of 3 ---\nThe cat was"), expected
    (code0, out0, err0), (code1, out1, _) = (r["batch"] for r in two)
    assert (code0, out0, code1, out1) == (0, expected, 0, ""), err0
    assert "at tp 2 x pp 1" in err0 and "(KV cache)" in err0

    # a layout other than the world size: exit 2 on every rank, before any collective
    for rank, result in enumerate(two):
        code, out, err = result["refused"]
        assert code == 2 and out == "" and "Traceback" not in err
        assert f"error: [rank {rank}] --tp 1 x --pp 1 = 1 processes, but 2 were launched" in err
        assert "torchrun --nproc_per_node=1" in err
    code, _, err = _command(*args, "--tp", "2")  # one process
    assert code == 2 and "but this is one process (no torchrun)" in err
