"""A new user's first hour, end to end: a Hugging Face folder (weights + tokenizer) -> `from-hf`
-> its config.yaml trains as is -> the step folder keeps the tokenizer (in the manifest) ->
`mesh3d generate` and `to-hf` on the checkpoints folder (the tokenizer comes along); plus the
defaults of that config, the log line of `init_method.path`, and which tokenizer files are
copied, and the refusals of an `init_method.path` that is not the model.

The tests of this subject that need a process group are in
`tests/ranks/test_first_hour_ranks.py`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from logs import logged

from mesh3d.checkpoint import hf as convert
from mesh3d.checkpoint.tokenizer_files import copy_into_folder, tokenizer_files
from mesh3d.checks import validate
from mesh3d.config import load_config
from mesh3d.data.synthetic import make_tokenizer
from mesh3d.errors import UserError
from mesh3d.layout import RunLayout
from mesh3d.train.build import initial_weights

transformers = pytest.importorskip("transformers", reason="transformers (dev extra) not installed")


def hf_folder(path, max_positions: int = 64):
    """A tiny random LlamaForCausalLM with a 300-id BPE tokenizer, saved as a user downloads it."""
    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   num_hidden_layers=2, max_position_embeddings=max_positions,
                                   bos_token_id=1, eos_token_id=2)  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    make_tokenizer(path, vocab_size=300)
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    (path / "special_tokens_map.json").write_text(json.dumps({"eos_token": "</s>"}))
    return path


def test_from_hf_config_defaults_validate(tmp_path):
    hf = hf_folder(tmp_path / "hf", max_positions=4096)
    convert.from_hf(hf, tmp_path / "nt", tp=2, pp=2)
    cfg = load_config(tmp_path / "nt" / "config.yaml")
    validate(cfg, 4)
    t, opt = cfg.tokens, cfg.optimizer
    assert (t.sequence_length, t.train_steps, t.micro_batch_size,
            t.batch_accumulation_per_replica) == (1024, 100, 1, 1)  # fmt: skip
    sched = opt.learning_rate_scheduler
    assert opt.optimizer_factory.name == "adamW" and opt.zero_stage == 0 and opt.clip_grad == 1.0
    assert opt.accumulate_grad_in_fp32
    assert sched.learning_rate == sched.min_decay_lr == 3e-5 and 0 < sched.lr_warmup_steps <= 10
    assert [s.data.dataset for s in cfg.data_stages] == [None]
    assert cfg.checkpoints.checkpoints_path == str((tmp_path / "nt" / "checkpoints").resolve())
    assert cfg.tokenizer.tokenizer_name_or_path == str(hf.resolve())
    assert (cfg.parallelism.tp, cfg.parallelism.pp, cfg.parallelism.dp) == (2, 2, 1)
    with pytest.raises(
        UserError, match=r"(?s)cannot be trained at --tp 3 --pp 1: .*num_attention_heads"
    ):
        convert.from_hf(hf, tmp_path / "tp3", tp=3)
    assert not (tmp_path / "tp3").exists()  # refused before anything was written


def test_init_method_path_logs_what_it_loaded(tmp_path):
    convert.from_hf(hf_folder(tmp_path / "hf"), tmp_path / "nt", tp=2, pp=2)
    cfg = load_config(tmp_path / "nt" / "config.yaml")
    seen, source = logged(lambda: initial_weights(cfg, RunLayout.of(cfg)))
    # 2 layers x 9 tensors (q, k, v, o, gate, up, down, 2 norms) + embedding, final norm, lm_head
    per_layer = 64 * 64 * 2 + 32 * 64 * 2 + 3 * 96 * 64 + 2 * 64
    n = 2 * 300 * 64 + 64 + 2 * per_layer
    assert seen == [
        f"Initial weights from {tmp_path / 'nt' / 'model'}: 21 tensors, {n:,} parameters"
    ]
    assert source("norm.weight", (64,)).shape == (64,)


def _refusal(cfg_path, folder) -> str:
    cfg = load_config(cfg_path, [f"model.init_method={{path: {folder}}}"])
    with pytest.raises(UserError) as e:
        initial_weights(cfg, RunLayout.of(cfg))
    assert "\n" not in str(e.value)
    return str(e.value)


def test_init_method_path_refusals_name_what_differs(tmp_path):
    """An HF folder with a tensor of the wrong shape (was a RuntimeError in `materialize`), a
    folder that is no model (was about Nanotron's model/ files) and a config.json whose
    hidden_size was edited (was reported as an unsupported head_dim)."""
    from safetensors.torch import load_file, save_file

    hf = hf_folder(tmp_path / "hf")
    convert.from_hf(hf, tmp_path / "nt")
    cfg_path = tmp_path / "nt" / "config.yaml"
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_bytes((hf / "config.json").read_bytes())
    weights = load_file(hf / "model.safetensors")
    weights["model.layers.1.mlp.up_proj.weight"] = torch.zeros(64, 64)
    save_file(weights, bad / "model.safetensors")
    msg = _refusal(cfg_path, bad)
    assert f"{bad / 'model.safetensors'}: tensor model.layers.1.mlp.up_proj.weight" in msg, msg
    assert "shape (64, 64) but config.json gives (96, 64)" in msg, msg
    (tmp_path / "empty").mkdir()
    msg = _refusal(cfg_path, tmp_path / "empty")
    assert "neither config.json" in msg and "Hugging Face model folder" in msg, msg
    assert "model_weight" not in msg and "pp-rank" not in msg, msg
    (bad / "config.json").unlink()
    assert "has *.safetensors but no config.json" in _refusal(cfg_path, bad)
    hf_json = json.loads((hf / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**hf_json, "hidden_size": 128}))
    msg = _refusal(cfg_path, bad)
    assert "hidden_size 128 / num_attention_heads 4 = 32" in msg and "edited" in msg, msg


def test_which_tokenizer_files_are_copied(tmp_path):
    folder = tmp_path / "tok"
    make_tokenizer(folder, vocab_size=300)
    (folder / "vocab.txt").write_text("not copied")
    assert [n for n, _ in tokenizer_files(folder)] == ["tokenizer.json"]
    single = tmp_path / "my_tokenizer.json"
    single.write_bytes((folder / "tokenizer.json").read_bytes())
    assert tokenizer_files(single) == [("tokenizer.json", single)]
    assert tokenizer_files("HuggingFaceTB/SmolLM2-135M") == []  # a hub name: nothing copied
    assert tokenizer_files(None) == []
    copy_into_folder(single, tmp_path / "out")
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == single.read_bytes()


# ---- issue 43: the first hour, tried again from a fresh clone ------------------------------

ROOT = Path(__file__).resolve().parents[2]


def _recipe(name: str):
    """A module of recipes/ (not a package), imported by file."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "recipes" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_sft_recipe_describes_every_option():
    """Its --help left --output, --steps and --held-out undescribed (its run, which prints
    progress and the checkpoint's path: tests/ranks/test_first_hour_ranks.py)."""
    actions = [a for a in _recipe("sft_arithmetic").parser()._actions if a.dest != "help"]
    assert {a.dest for a in actions} == {"output", "steps", "held_out", "eval_every"}
    assert all(a.help for a in actions), [a.dest for a in actions if not a.help]


@pytest.mark.parametrize(
    "recipe,flags,says",
    [("sft_arithmetic", ["--steps", "0"], "--steps 0 must be >= 1"),
     ("sft_arithmetic", ["--held-out", "100000"], "--held-out 100000 must be 1..200"),
     ("sft_arithmetic", ["--eval-every", "7", "--steps", "10"], "--eval-every 7 must be >= 1 and divide"),
     ("sft_arithmetic", ["--output", "FILE"], "a file is where a folder is needed"),
     ("tiny_data", ["--documents", "0"], "--documents 0 must be >= 1"),
     ("tiny_data", ["--output", "FILE"], "a file is where a folder is needed"),
     ("doremi/run", ["--output", "FILE"], "a file is where a folder is needed"),
     ("doremi/run", ["--output", "/proc/d"], "`--output` /proc/d: cannot write there"),
     ("doremi/run", ["--output", ""], "--output '' is empty"),
     ("doremi/run", ["--output", "."], "--output .: the folder holds files this script did not"),
     ("config_tiny_llama", ["--output", "FILE/x.yaml"], "a file is where a folder is needed"),
     ("config_tiny_llama", ["--output", "."], "`--output` .: cannot write there (Is a directory)"),
     ("config_tiny_llama", ["--output", "/proc/x.yaml"], "`--output` /proc/x.yaml: cannot write"),
     ("config_tiny_llama", ["--output", ""], "--output '' is empty")],
)  # fmt: skip
def test_recipes_refuse_bad_flags_before_writing(
    tmp_path, capsys, monkeypatch, recipe, flags, says
):
    """They wrote data and a tokenizer, then stopped with a traceback (or trained 150 steps)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "FILE").write_text("")
    argv = [*flags, *([] if "--output" in flags else ["--output", "out"])]
    with pytest.raises(SystemExit) as e:
        _recipe(recipe).main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and says in err and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["FILE"]  # nothing written


def test_doremi_recipe_refuses_a_folder_it_did_not_make(tmp_path, capsys, monkeypatch):
    """`--output checkpoints` (where docs/doremi.md's real runs keep `checkpoints/proxy`) ran
    with `mesh3d.existing_checkpoints=overwrite` and deleted their step folders."""
    monkeypatch.chdir(tmp_path)
    step = tmp_path / "checkpoints" / "proxy" / "10"
    step.mkdir(parents=True)
    (step / "model.safetensors").write_text("real weights")
    with pytest.raises(SystemExit) as e:
        _recipe("doremi/run").main(["--output", "checkpoints"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert "--output checkpoints: the folder holds files this script did not write" in err, err
    assert [p.relative_to(tmp_path).as_posix() for p in sorted(tmp_path.rglob("*"))] == [
        "checkpoints", "checkpoints/proxy", "checkpoints/proxy/10",
        "checkpoints/proxy/10/model.safetensors"]  # fmt: skip


def test_doremi_recipe_stopped_says_to_rerun_it(tmp_path, capsys, monkeypatch):
    """Ctrl-C ended in a `Preempted` traceback advising `mesh3d.existing_checkpoints=resume`,
    which the script cannot take: one line, exit 75, saying to run the script again; the folder
    it made (marked) is its own to write again."""
    from mesh3d.errors import Preempted

    monkeypatch.chdir(tmp_path)
    doremi = _recipe("doremi/run")
    monkeypatch.setattr(doremi.torch, "set_num_threads", lambda n: None)  # not for the tests

    def stopped_by_ctrl_c(cfg, *args, **kwargs):  # what `train` raises (mesh3d.train.loop)
        path = cfg.checkpoints.checkpoints_path
        raise Preempted(
            f"SIGINT received: stopped after step 3 and saved {path}/3. To continue, launch "
            f"the command again with mesh3d.existing_checkpoints=resume (or "
            f"checkpoints.resume_checkpoint_path={path})"
        )

    monkeypatch.setattr(doremi, "train", stopped_by_ctrl_c)
    for _ in range(2):  # the second time in the folder it made
        with pytest.raises(SystemExit) as e:
            doremi.main(["--output", "out dir"])
        err = capsys.readouterr().err
        assert e.value.code == 75 and err.count("\n") == 1 and "Traceback" not in err, err
        assert err.startswith("preempted: the reference run: SIGINT received: stopped after "
                              "step 3 and saved out dir/reference/3; this script cannot "
                              "resume: run `python recipes/doremi/run.py --output 'out dir'` "
                              "again"), err  # fmt: skip
        assert "existing_checkpoints" not in err and "resume_checkpoint_path" not in err, err
    assert (tmp_path / "out dir" / doremi.MARKER).is_file()


@pytest.mark.parametrize(
    "flags,says",
    [(["--dp", "3"], "--dp 3 must divide the global batch of 8 samples (else some are dropped); "
                     "use --dp 1, 2 or 4"),
     (["--dp", "8"], "--dp 8 leaves 1 sample(s) per rank, which its 2 microbatches do not divide"),
     (["--tp", "3"], "--tp 3 must divide the model's 4 attention heads; use --tp 1, 2 or 4"),
     (["--pp", "4"], "--pp 4 is more pipeline stages than the 2 microbatches; use --pp 1 or 2"),
     (["--dp", "0"], "--dp 0 must be >= 1"),
     (["--pp", "-1"], "--pp -1 must be >= 1"),
     (["--steps", "0"], "--steps 0 must be >= 1"),
     (["--dp", "2"], "--dp 2 x --tp 1 x --pp 1 = 2 processes, but 1 started; launch `torchrun "
                     "--nproc_per_node=2 recipes/custom_model.py`")],
)  # fmt: skip
def test_custom_model_refuses_bad_flags_before_any_process_group(capsys, monkeypatch, flags, says):
    """--dp 3 dropped samples (a loss of 3.5761, not dp 1's 4.7641), --steps 0 printed
    `losses:` and exited 0, and the rest were `[rank0]` ConfigError tracebacks naming
    `parallelism.dp`, not the flag."""
    import torch.distributed as dist

    monkeypatch.delenv("WORLD_SIZE", raising=False)  # one process, as `python recipes/...`
    custom = _recipe("custom_model")
    with pytest.raises(SystemExit) as e:
        custom.main(flags)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("error: ") and says in err, err
    assert not dist.is_initialized()
    custom.check(2, 2, 2, 1, world=8)  # the README's 8-rank layout is accepted
    custom.check(4, 1, 1, 20, world=4)


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `mesh3d ARGV` in this process."""
    from mesh3d import cli

    try:
        cli.main(list(argv))
        code = 0
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_without_a_config_plans_the_default_run(capsys):
    """`mesh3d plan` required a config; it plans the built-in default run and says so, and a
    world size the layout does not make suggests --world-size (not torchrun's flag)."""
    from mesh3d.config import DEFAULT_CONFIG

    code, out, err = _cli(capsys, "plan")
    assert code == 0, err
    assert err == f"no config given: planning mesh3d's built-in default run ({DEFAULT_CONFIG}, " \
        "what `mesh3d train` trains without a config)\n"  # fmt: skip
    assert out.startswith("mesh3d plan: 1 ranks") and "2,410,176 parameters" in out
    code, out, _ = _cli(capsys, "plan", "parallelism.tp=2")  # overrides without a config
    assert code == 0 and out.startswith("mesh3d plan: 2 ranks")
    code, _, err = _cli(capsys, "plan", "--world-size", "8")
    assert code == 2 and err.count("error:") == 1 and "Traceback" not in err, err
    assert "give --world-size 1" in err and "nproc_per_node" not in err, err


# the published parameter counts of each model
PRESET_PARAMS = {"llama3-8b": 8_030_261_248, "llama3-70b": 70_553_706_496,
                 "llama3-405b": 405_853_388_800, "smollm-135m": 134_515_008,
                 "smollm-360m": 361_821_120, "smollm-1.7b": 1_711_376_384}  # fmt: skip


def test_plan_presets_are_the_published_models_and_take_overrides(capsys):
    from mesh3d.plan.presets import PRESETS, preset_overrides

    assert set(PRESETS) == set(PRESET_PARAMS)
    for name in ("llama3-8b", "smollm-135m"):  # (the others: the same path, minutes of meta)
        code, out, err = _cli(capsys, "plan", "--preset", name)
        assert code == 0, err
        assert f"{PRESET_PARAMS[name]:,} parameters" in out, (name, out.splitlines()[0])
    for name, n in PRESET_PARAMS.items():  # Llama's count from the preset's numbers alone
        c = PRESETS[name]
        h, kv = c["hidden_size"], c["num_key_value_heads"] * c["hidden_size"]
        kv //= c["num_attention_heads"]
        layer = 2 * h * h + 2 * h * kv + 3 * h * c["intermediate_size"] + 2 * h
        embed = c["vocab_size"] * h * (1 if c["tie_word_embeddings"] else 2)
        assert embed + c["num_hidden_layers"] * layer + h == n, name
        assert f"model.model_config.hidden_size={h}" in preset_overrides(name)
    code, out, err = _cli(capsys, "plan", "--preset", "llama3-8b",
                          "model.model_config.num_hidden_layers=2")  # fmt: skip
    assert code == 0 and "8,030,261,248" not in out and "parameters" in out, err
    code, _, err = _cli(capsys, "plan", "--preset", "llama4")
    assert code == 2 and "llama3-8b" in err


def test_plan_search_write_says_what_it_took_from_the_config(capsys, tmp_path):
    """--write wrote `checkpoints: null` and `dummy_data: learnable` without a word: they are
    the config's own (no checkpoints section; synthetic data), and now it says so."""
    config = str(ROOT / "recipes" / "configs" / "cpu_tiny.yaml")
    best = tmp_path / "best.yaml"
    code, out, err = _cli(capsys, "plan", "--search", config, "--world-size", "2",
                          "--hardware", "h100-80g", "--top", "1", "--write", str(best))  # fmt: skip
    assert code == 0, err
    last = out.splitlines()[-1]
    assert last.startswith(f"the layout keys changed; the rest is {config} as given"), last
    assert "checkpoints: null (it has no checkpoints section" in last, last
    assert "mesh3d.dummy_data: learnable (synthetic data" in last, last


def test_plan_search_write_of_the_default_run_writes_a_config_that_trains(capsys, tmp_path):
    """A fresh clone's second hour: `plan --search --write` without a config wrote the default
    run's placeholder dataset folder (`mesh3d train` on it: "does not exist") and claimed
    synthetic data. It now writes the default run's prepared data and names its checkpoints."""
    from mesh3d.config import load_config

    best = tmp_path / "best.yaml"
    code, out, err = _cli(capsys, "plan", "--search", "--world-size", "2", "--hardware",
                          "h100-80g", "--top", "1", "--write", str(best))  # fmt: skip
    assert code == 0, err
    last = out.splitlines()[-1]
    assert "dummy_data" not in last and "the default run's data, prepared in its cache" in last
    assert "checkpoints_path: runs/default/checkpoints (the default run's" in last, last
    cfg = load_config(best)
    (folder,) = cfg.data_stages[0].data.dataset.dataset_folder
    assert Path(folder).is_dir() and any(Path(folder).iterdir()), folder
    assert Path(cfg.tokenizer.tokenizer_name_or_path).is_dir()
    assert cfg.parallelism.dp * cfg.parallelism.tp * cfg.parallelism.pp == 2


def _logged(fn) -> list[str]:
    """The messages mesh3d's logger gets while `fn()` runs (at INFO)."""
    return logged(fn)[0]


def test_disk_items_are_in_the_unit_their_names_say():
    """`hd_total_memory_tb: 271G`: Nanotron's keys said TB, the value was bytes."""
    import shutil

    from mesh3d.train.metrics import format_iteration_line, memory_metrics

    m = memory_metrics()
    assert m["hd_total_memory_tb"] == pytest.approx(shutil.disk_usage("/").total / 1e12, rel=1e-3)
    line = format_iteration_line({"iteration": 1, **m}, 10)
    for item in line.split(" | ")[1:]:
        if item.startswith("hd_"):
            assert not item[-1].isalpha(), line  # 0.271, not 271G


def test_first_lines_say_cpu_and_compile_before_the_first_step():
    from mesh3d.train.loop import start_notes

    cfg = load_config(ROOT / "mesh3d" / "configs" / "default.yaml")
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert any(
        "on CPU: the iteration line's *_per_gpu items" in n for n in start_notes(cfg, cpu, 0)
    )
    assert not any("CPU" in n for n in start_notes(cfg, cuda, 0))
    assert not any("torch.compile" in n for n in start_notes(cfg, cpu, 0))
    compiled = load_config(ROOT / "mesh3d" / "configs" / "default.yaml", ["mesh3d.compile=true"])
    notes = start_notes(compiled, cpu, 0)
    assert any(
        n.startswith("torch.compile (mesh3d.compile): the first step compiles") for n in notes
    )
    assert not any("torch.compile" in n for n in start_notes(compiled, cpu, 200))  # nothing to run
    assert start_notes(cfg, cpu, cfg.tokens.train_steps) == []  # no iteration line to explain


def test_launcher_names_where_the_run_writes_and_the_cache(tmp_path, monkeypatch):
    """`runs/default` is relative to the current folder, and the prepared-data cache was
    documented nowhere: the launcher's line names both, absolute."""
    import mesh3d.data.corpus as corpus
    from mesh3d import launch

    monkeypatch.setattr(corpus, "default_run_overrides", lambda: [])
    monkeypatch.setenv("MESH3D_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    cfg = load_config(*launch._resolved(launch._split([])))
    line = launch.where_it_writes(cfg, None, default_run=True)
    assert line == (
        f"writing {tmp_path / 'runs/default/metrics.jsonl'} (and its plot beside it), "
        f"checkpoints in {tmp_path / 'runs/default/checkpoints'}; the default run's data is "
        f"prepared once into {tmp_path / 'cache'} (set MESH3D_CACHE to use another folder)"
    )
    own = launch.where_it_writes(cfg, "m/x.jsonl", default_run=False)
    assert own.startswith(f"writing {tmp_path / 'm/x.jsonl'}") and "MESH3D_CACHE" not in own
