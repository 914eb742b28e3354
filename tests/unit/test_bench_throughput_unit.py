"""benchmarks/throughput.py and benchmarks/gpu.sh, run as a user would (subprocesses).

This file holds the tests of that subject that run in one process without a process group; the
others are in `tests/launch/test_bench_throughput.py`."""

import importlib
import sys

import pytest
from test_bench_throughput import ROOT


def test_compiled_ways_ratios_and_table():
    if str(ROOT / "benchmarks") not in sys.path:  # as when the script runs
        sys.path.insert(0, str(ROOT / "benchmarks"))
    bench = importlib.import_module("throughput")
    seconds = dict(mesh3d=1.0, plain=1.0, transformers=1.2, mesh3d_compiled=1.0,
                   transformers_compiled=0.8)  # fmt: skip
    impls = {  # round 1: compiling (30 s), left out as a warm-up round
        name: dict(step_seconds=[30.0] + [s] * 4, losses=[5.0, 4.0, 3.0, 2.0, 1.0])
        for name, s in seconds.items()
    }
    ratios = bench.summarize(impls, tokens=1000, warmup=1)
    assert ratios["mesh3d_compiled_over_transformers"] == pytest.approx(1.2)
    assert ratios["mesh3d_compiled_over_transformers_compiled"] == pytest.approx(0.8)
    assert ratios["mesh3d_compiled_over_transformers_paired_ci95"] == pytest.approx((1.2, 1.2))
    assert ratios["mesh3d_compiled_over_transformers_target"] == 1.15
    text = bench.table(dict(impls=impls, ratios=ratios))
    assert "| transformers_compiled | 1250 | 5.00000 | 1.00000 |" in text, text
    assert "| mesh3d_compiled / transformers | 1.200 | 1.200 [1.200, 1.200] | ≥ 1.15 |" in text
    assert "| mesh3d_compiled / transformers_compiled | 0.800 | 0.800 [0.800, 0.800] |" in text


def _benchmarks_on_path():
    if str(ROOT / "benchmarks") not in sys.path:  # as when the script runs
        sys.path.insert(0, str(ROOT / "benchmarks"))


@pytest.mark.parametrize(
    "argv, said",
    [
        (["--peer", "--picotron", "{tmp}"], "no Picotron checkout there (train.py and"),
        (["--picotron", "{tmp}"], "--picotron is a peer way: add --peer"),
    ],
)
def test_picotron_flag_refuses_what_cannot_run(tmp_path, capsys, argv, said):
    """`--picotron DIR` without a checkout in DIR, or without `--peer`: exit 2 and one line
    saying what to do, before anything runs."""
    _benchmarks_on_path()
    bench = importlib.import_module("throughput")
    with pytest.raises(SystemExit) as e:
        bench.main([a.format(tmp=tmp_path) for a in argv])
    assert e.value.code == 2
    assert said in capsys.readouterr().err


def test_picotron_config_weights_and_ratios(tmp_path):
    """Picotron's config is the peer shape at the layout's accumulation, its zero weight file has
    Llama's full shapes, and the mesh3d / Picotron ratios and their table rows come from the
    same repetitions."""
    _benchmarks_on_path()
    from _peer import over_picotron, table
    from _picotron import config, zero_weights
    from _ways import SHAPES
    from safetensors.torch import load_file

    cfg = config(SHAPES["peer"], (2, 2, 2), 20, 1)
    assert cfg["distributed"] | {"use_cpu": True} == dict(
        tp_size=2, cp_size=1, pp_size=2, dp_size=2, pp_engine="1f1b", backend="gloo", use_cpu=True
    )
    t = cfg["training"]
    assert (t["micro_batch_size"], t["gradient_accumulation_steps"], t["seq_length"]) == (4, 4, 128)
    assert config(SHAPES["peer"], (1, 1, 1), 20, 2)["training"]["gradient_accumulation_steps"] == 8
    zero_weights(SHAPES["peer"], tmp_path)
    sd = load_file(tmp_path / "hf_model_safetensors" / "model.safetensors")
    assert sd["model.embed_tokens.weight"].shape == (512, 256)
    assert sd["model.layers.3.self_attn.k_proj.weight"].shape == (128, 256)  # 2 kv heads of 64
    assert sd["model.layers.0.mlp.down_proj.weight"].shape == (256, 1024)
    assert len(sd) == 2 + 9 * 4

    def reps(*tps):
        return [dict(tokens_per_sec_median=x, losses=[5.0, 4.0]) for x in tps]

    runs = {"mesh3d_1x1x1_cores": reps(4000, 4400), "mesh3d_1x1x1": reps(2500, 2500),
            "plain_1x1x1": reps(2500, 2500),
            "mesh3d_2x2x2_all_reduce": reps(3000, 2600), "picotron_1x1x1_cores": reps(4000, 4000),
            "picotron_2x2x2": reps(2500, 2600)}  # fmt: skip
    ratios = over_picotron(runs)["mesh3d_over_picotron"]
    assert ratios["mesh3d_2x2x2_all_reduce_over_picotron"]["per_repetition"] == [1.2, 1.0]
    assert ratios["mesh3d_2x2x2_all_reduce_over_picotron"]["median"] == pytest.approx(1.1)
    assert ratios["mesh3d_1x1x1_cores_over_picotron"]["per_repetition"] == [1.0, 1.1]
    assert ratios["picotron_efficiency"]["per_repetition"] == [0.625, 0.65]
    result = dict(runs=runs, efficiency={w: dict(per_repetition=[1, 1], median=1) for w in runs},
                  loss_parity=dict(rtol=1e-4, max_rel_diff_first=0, max_rel_diff_last=0, ok=True),
                  picotron="/x/picotron", mesh3d_over_picotron=ratios)  # fmt: skip
    text = table(result)
    assert "| mesh3d_2x2x2_all_reduce_over_picotron | 1.100 (1.200, 1.000) |" in text, text
    assert "1×1×1 on all threads 4000 (4000, 4000), 2×2×2 2550 (2500, 2600) tokens/s" in text
