"""What a new user meets first (issue 26, items 4-14): the default run resumes by running it
again, its model runs at tp 2 and 4, the first tweaks of a config are accepted with one warning,
the torchrun rank's launcher lines, exported files, the end-of-run lines and a resumed run's
name. The CLI's helps and the docs' claims are in `tests/unit/test_new_user_cli.py`; the tests
that start processes in `tests/launch/test_new_user_launch.py`."""

from __future__ import annotations

from pathlib import Path

import pytest

from mesh3d import launch
from mesh3d.checks import validate
from mesh3d.config import expand_run_name, load_config


@pytest.fixture
def no_corpus(monkeypatch):
    """The default run without preparing its data (its folder overrides are not needed here)."""
    import mesh3d.data.corpus as corpus

    monkeypatch.setattr(corpus, "default_run_overrides", lambda: [])


def test_default_run_has_one_folder_and_resumes(no_corpus):
    """Two launches of `mesh3d train` resolve to the same run folder, and the second resumes."""
    first = launch._resolved(launch._split([]))
    second = launch._resolved(launch._split([]))
    assert first == second
    cfg = load_config(*first)
    assert cfg.general.run == "default" == expand_run_name(cfg.general.run)
    assert cfg.checkpoints.checkpoints_path == "runs/default/checkpoints"
    assert cfg.mesh3d.existing_checkpoints == "resume"


def test_the_default_run_keeps_a_checkpoints_path_given_to_it(no_corpus):
    """Another run name moves the default's checkpoints with it; a path the user gave stays."""
    cfg = load_config(*launch._resolved(launch._split(["general.run=other"])))
    assert cfg.checkpoints.checkpoints_path == "runs/other/checkpoints"
    given = ["general.run=other", "checkpoints.checkpoints_path=/tmp/mine"]
    cfg = load_config(*launch._resolved(launch._split(given)))
    assert str(cfg.checkpoints.checkpoints_path) == "/tmp/mine"


def test_an_empty_run_name_reaches_the_checks(no_corpus):
    """The launcher's expanded name is a quoted YAML string: '' stays '' (not null, the default)."""
    from mesh3d.errors import ConfigError

    with pytest.raises(ConfigError, match="`general.run` '' must name a folder inside runs/"):
        validate(load_config(*launch._resolved(launch._split(["general.run=''"]))))


@pytest.mark.parametrize("tp,pp", [(2, 1), (4, 1), (2, 2)])
def test_default_model_runs_tensor_parallel(no_corpus, tp, pp):
    """The default model's heads divide by 2 and 4 (docs/sft-and-generation.md: `generate --tp 2 --pp 2`)."""
    path, overrides = launch._resolved(launch._split([]))
    cfg = load_config(path, [*overrides, f"parallelism.tp={tp}", f"parallelism.pp={pp}"])
    validate(cfg, world_size=tp * pp)


RECIPE = "recipes/configs/cpu_tiny.yaml"
REPO = Path(__file__).resolve().parents[2]


def test_torchrun_rank_0_shows_what_the_launcher_shows(monkeypatch, capsys):
    """Item 7: under torchrun the default run prepared its data in silence and the config's
    warnings came bare on stderr; `mesh3d train` shows both with its LAUNCHER prefix. Rank 0
    now shows them the same way (then leaves the logger to the run's own set-up)."""
    import logging

    import torch.distributed as dist

    import mesh3d.data.corpus as corpus
    import mesh3d.mesh
    from mesh3d.checks.validate import WARNED_ENV
    from mesh3d.log import logger

    def prepared() -> list[str]:
        logger.info("preparing the default run's data once: ...")
        return []

    monkeypatch.setattr(corpus, "default_run_overrides", prepared)
    monkeypatch.setattr(mesh3d.mesh, "init_distributed", lambda **kw: None)
    monkeypatch.setattr(dist, "broadcast_object_list", lambda objects, src: None)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv(WARNED_ENV, "")
    logger.handlers.clear()
    launch._resolved_on_ranks(launch._split(["tokens.train_steps=2"]))
    out, err = capsys.readouterr()
    assert "[INFO|LAUNCHER]: preparing the default run's data once" in out
    assert "[WARNING|LAUNCHER]: `tokens.val_check_interval` (50) is larger" in out
    assert err == ""
    assert logger.handlers == [] and logger.level == logging.NOTSET  # the run sets its own


def test_concurrent_ranks_prepare_the_default_data_once(tmp_path, monkeypatch):
    """Item 7: the ranks of `torchrun --nproc_per_node=N recipes/train.py` (no config) each
    prepared the default run's corpus at the same time; they take turns, one prepares it."""
    import threading
    import time

    import mesh3d.data.corpus as corpus
    import mesh3d.data.synthetic
    import mesh3d.data.tokenize

    made = []

    def train_bpe(texts, folder, vocab_size):
        made.append(folder)
        time.sleep(0.3)  # the others arrive meanwhile
        folder.mkdir()
        return folder

    def tokenize_to_folder(tokenizer, inputs, output):
        Path(output).mkdir()
        return None, 1, 10

    monkeypatch.setenv("MESH3D_CACHE", str(tmp_path))
    monkeypatch.setattr(corpus, "stdlib_files", lambda budget: [])
    monkeypatch.setattr(mesh3d.data.synthetic, "train_bpe", train_bpe)  # imported where used
    monkeypatch.setattr(mesh3d.data.tokenize, "tokenize_to_folder", tokenize_to_folder)
    folders = []
    ranks = [threading.Thread(target=lambda: folders.append(corpus.prepare_stdlib_corpus()))
             for _ in range(3)]  # fmt: skip
    for rank in ranks:
        rank.start()
    for rank in ranks:
        rank.join()
    assert len(made) == 1 and len(set(folders)) == 1 and len(folders) == 3
    assert (folders[0] / "tokenized").is_dir()


def test_short_run_validates_at_its_last_step_with_one_warning():
    """`train_steps` below `val_check_interval`: accepted, one warning, evaluated at the end."""
    from mesh3d.checks import config_warnings
    from mesh3d.train.evaluate import is_evaluation_step

    cfg = load_config(RECIPE, ["tokens.train_steps=20", "tokens.val_check_interval=50",
                               "tokens.limit_val_batches=2"])  # fmt: skip
    validate(cfg, world_size=1)
    (line,) = config_warnings(cfg)
    assert "`tokens.val_check_interval` (50) is larger than `tokens.train_steps` (20)" in line
    assert "at the last step (20)" in line
    assert [s for s in range(1, 21) if is_evaluation_step(cfg.tokens, s)] == [20]


def test_warmup_longer_than_the_run_is_one_warning():
    """cpu_tiny (5 warmup steps) with train_steps=3: one cause, reported once, not 3 errors."""
    from mesh3d.checks import config_warnings
    from mesh3d.train.lr_schedule import lr_at, schedule_kwargs

    cfg = load_config(RECIPE, ["tokens.train_steps=3"])
    validate(cfg, world_size=1)
    (line,) = config_warnings(cfg)
    assert "lr_warmup_steps` (5) is more than tokens.train_steps (3)" in line
    assert cfg.optimizer.learning_rate_scheduler.lr_decay_steps == 0
    lrs = [lr_at(k, **schedule_kwargs(cfg)) for k in range(3)]
    assert lrs == sorted(lrs) and lrs[-1] < cfg.optimizer.learning_rate_scheduler.learning_rate


def test_mesh3d_config_prints_the_warning(capsys):
    from mesh3d.checks.__main__ import main

    main([RECIPE, "tokens.train_steps=3"])
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("warning: `optimizer.learning_rate_scheduler")


def test_weight_files_get_the_usual_mode(tmp_path):
    """safetensors creates 0600 files; HF exports and Nanotron weights are readable by others."""
    import os
    import stat

    import torch

    from mesh3d.checkpoint.nanotron_weights import save_readable

    umask = os.umask(0o022)
    try:
        save_readable({"w": torch.zeros(2)}, tmp_path / "model.safetensors", {"format": "pt"})
    finally:
        os.umask(umask)
    assert stat.S_IMODE((tmp_path / "model.safetensors").stat().st_mode) == 0o644


def test_from_hf_lists_its_few_files_and_counts_the_shards(tmp_path, capsys):
    pytest.importorskip("transformers")
    from test_first_hour import hf_folder

    from mesh3d.convert import main

    hf_folder(tmp_path / "hf")
    main(["from-hf", "--model", str(tmp_path / "hf"), "--output", str(tmp_path / "out"),
          "--tp", "2"])  # fmt: skip
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("wrote ") and "model_config.json" in out[1] and "config.yaml" in out[2]
    assert out[3].startswith("  ") and "weight files under" in out[3] and len(out) == 5


def test_mesh3d_config_check_data_opens_the_dataset_folders(tmp_path, monkeypatch, capsys):
    from mesh3d import cli

    monkeypatch.chdir(tmp_path)  # runs/tiny_data/ is not there
    nanoset = str(launch.DEFAULT_CONFIG.parents[2] / "recipes" / "configs" / "cpu_nanoset.yaml")
    cli.main(["config", nanoset])  # the config alone: fine
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        cli.main(["config", nanoset, "--check-data"])
    assert e.value.code == 2
    err = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]
    assert err == ["error: dataset_folder 'runs/tiny_data/tokenized' does not exist; fix the path "
                   "(`python recipes/tiny_data.py` writes it)"]  # fmt: skip


def _sinks(console: str, steps: int = 200):
    from mesh3d.train.sinks import MetricSinks

    cfg = load_config(RECIPE, ["mesh3d.wandb=false", f"mesh3d.console={console}",
                               f"tokens.train_steps={steps}"])  # fmt: skip
    return MetricSinks(cfg, True, None)


def test_compact_console_is_one_short_line_per_step(caplog):
    import logging

    record = {"iteration": 12, "consumed_tokens": 1000, "lm_loss": 5.12341, "lr": 0.003,
              "tokens_per_sec": 2950.0, "grad_norm": 1.0}  # fmt: skip
    with caplog.at_level(logging.INFO, logger="mesh3d"):
        compact = _sinks("compact")
        compact.progress(record, [1.0] * 12)
        compact.write(record, [1.0] * 12)  # the Nanotron line is left out of the console
        _sinks("nanotron").progress(record, [1.0] * 12)  # nothing: nanotron's form only
    lines = [r.getMessage() for r in caplog.records if r.name == "mesh3d"]
    assert lines == ["step 12/200 | loss 5.1234 | lr 3.00e-03 | 2,950 tokens/s | eta 0:03:08"]
    assert _sinks("auto").compact is False  # the tests' output is not a terminal


def test_eta_is_steady_when_one_step_is_slow():
    """A median of the run's steps: one slow step (a loaded host) barely moves it."""
    sinks = _sinks("nanotron", steps=100)
    steady = sinks.eta(50, [5.0] + [1.0] * 49)
    assert steady == 50.0 and sinks.eta(51, [5.0] + [1.0] * 49 + [10.0]) == 49.0


def test_console_value_is_checked():
    from mesh3d.checks import validation_errors

    errors = validation_errors(load_config(RECIPE, ["mesh3d.console=fancy"]), 1)
    assert len(errors) == 1 and "`mesh3d.console` 'fancy'" in errors[0]


def test_starter_config_writes_only_the_mesh3d_keys_it_changes(tmp_path):
    import yaml
    from test_bench_throughput import ROOT

    sys_path = str(ROOT / "recipes")
    import sys

    if sys_path not in sys.path:
        sys.path.insert(0, sys_path)
    import config_tiny_llama

    config_tiny_llama.main(["--output", str(tmp_path / "a.yaml")])
    assert yaml.safe_load((tmp_path / "a.yaml").read_text())["mesh3d"] == {
        "dummy_data": "learnable"
    }
    config_tiny_llama.main(["--output", str(tmp_path / "b.yaml"), "--dummy-data", "random"])
    assert "mesh3d" not in yaml.safe_load((tmp_path / "b.yaml").read_text())


def test_exported_tokenizer_loads_with_its_special_tokens(tmp_path):
    transformers = pytest.importorskip("transformers")
    from mesh3d.checkpoint.hf import set_special_tokens
    from mesh3d.config.schema import LlamaConfig
    from mesh3d.data.synthetic import make_tokenizer

    make_tokenizer(tmp_path, vocab_size=300)  # specials <unk> 0, <s> 1, </s> 2; no roles
    assert transformers.AutoTokenizer.from_pretrained(tmp_path).eos_token is None
    assert set_special_tokens(tmp_path, LlamaConfig()) == [tmp_path / "tokenizer_config.json"]
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<s>", "</s>", "</s>")
    assert tok.eos_token_id == 2


def test_from_hf_keeps_null_special_token_ids(tmp_path):
    """An HF config with bos/eos null: from-hf's config.yaml says null, not Nanotron's 1 / 2."""
    import json

    import yaml

    pytest.importorskip("transformers")
    from test_first_hour import hf_folder

    from mesh3d.checkpoint.hf import from_hf

    hf_folder(tmp_path / "hf")
    cfg_path = tmp_path / "hf" / "config.json"
    hf_cfg = json.loads(cfg_path.read_text()) | {"bos_token_id": None, "eos_token_id": None}
    cfg_path.write_text(json.dumps(hf_cfg))
    from_hf(tmp_path / "hf", tmp_path / "out")
    mc = yaml.safe_load((tmp_path / "out" / "config.yaml").read_text())["model"]["model_config"]
    assert mc["bos_token_id"] is None and mc["eos_token_id"] is None
    cfg = load_config(tmp_path / "out" / "config.yaml")
    assert cfg.model.model_config.eos_token_id is None
    validate(cfg, world_size=1)


def test_the_end_of_a_run_names_where_tensorboard_wrote(tmp_path, caplog):
    import logging

    pytest.importorskip("tensorboard")
    from mesh3d.train.sinks import MetricSinks

    cfg = load_config(RECIPE, ["mesh3d.wandb=false", f"mesh3d.tensorboard_dir={tmp_path / 'tb'}"])
    with caplog.at_level(logging.INFO, logger="mesh3d"):
        sinks = MetricSinks(cfg, True, None)
        sinks.write({"iteration": 1, "lm_loss": 1.0}, [0.1])
        sinks.close()
    lines = [r.getMessage() for r in caplog.records if "TensorBoard" in r.getMessage()]
    assert lines == [f"TensorBoard scalars written to {tmp_path / 'tb'} "
                     f"(tensorboard --logdir {tmp_path / 'tb'})"]  # fmt: skip


def test_the_end_of_a_run_names_where_wandb_wrote(caplog):
    """Item 13's W&B half (the TensorBoard half above): an offline run's folder and how to
    upload it, before the summary; the run is finished."""
    import logging
    from types import SimpleNamespace

    from mesh3d.train.sinks import MetricSinks

    finished = []
    run = SimpleNamespace(id="ab12", url=None, dir="wandb/offline-run-x/files",
                          finish=lambda: finished.append(True))  # fmt: skip
    with caplog.at_level(logging.INFO, logger="mesh3d"):
        sinks = MetricSinks(load_config(RECIPE, ["mesh3d.wandb=false"]), True, None)
        sinks.wandb = run
        sinks.close()
    lines = [r.getMessage() for r in caplog.records if "Weights & Biases" in r.getMessage()]
    assert lines == ["Weights & Biases run ab12 written to wandb/offline-run-x/files "
                     "(offline: wandb sync to upload)"]  # fmt: skip
    assert finished == [True] and sinks.wandb is None


def test_torchao_kernel_noise_is_dropped_and_its_other_records_kept():
    """Item 10: with torchao installed, `import transformers` printed "Failed to load ..." per
    prebuilt kernel that does not fit this torch; `import mesh3d` drops those records (and
    torch's register_constant deprecation note) while torchao's other records still show. The
    launch test runs the real import in a fresh process."""
    import logging

    import mesh3d  # noqa: F401  (installs the filters)

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    ao, tree = logging.getLogger("torchao"), logging.getLogger("torch.utils._pytree")
    ao.addHandler(handler)
    tree.addHandler(handler)
    try:
        ao.warning("Failed to load /x/_C_mxfp8.so: Could not load this library")
        ao.warning("float8 needs a recent GPU")
        tree.warning("%s is an Enum subclass and is now natively supported", "E")
        tree.warning("something else")
    finally:
        ao.removeHandler(handler)
        tree.removeHandler(handler)
    assert [r.getMessage() for r in records] == ["float8 needs a recent GPU", "something else"]


def test_resumed_run_with_a_date_in_its_name_keeps_its_first_name(tmp_path, monkeypatch):
    """Item 4: a config named `cpu_tiny_%date_%jobid` resumed (explicitly, or by
    `existing_checkpoints=resume`) takes the name its checkpoint was written under, so its
    metrics stay in one `runs/<name>/metrics.jsonl`; a fresh start still gets a new name."""
    import json

    import yaml

    monkeypatch.chdir(tmp_path)
    ckpts = tmp_path / "ckpts"
    step = ckpts / "4"
    step.mkdir(parents=True)
    (step / "checkpoint_metadata.json").write_text(json.dumps({"step": 4}))
    (step / "config.yaml").write_text(
        yaml.safe_dump({"general": {"run": "cpu_tiny_20261201_0900_local"}})
    )
    (ckpts / "latest.txt").write_text("4")
    base = [
        str(REPO / RECIPE),
        f"checkpoints.checkpoints_path={ckpts}",
        "checkpoints.checkpoint_interval=10",
    ]

    def run_name(*overrides: str) -> str:
        path, resolved = launch._resolved(launch._split([*base, *overrides]))
        return load_config(path, resolved).general.run

    assert run_name(f"checkpoints.resume_checkpoint_path={step}") == "cpu_tiny_20261201_0900_local"
    assert run_name(f"checkpoints.resume_checkpoint_path={ckpts}") == "cpu_tiny_20261201_0900_local"
    assert run_name("mesh3d.existing_checkpoints=resume") == "cpu_tiny_20261201_0900_local"
    fresh = run_name()  # not resuming: a new date
    assert fresh.startswith("cpu_tiny_") and fresh != "cpu_tiny_20261201_0900_local"
    assert run_name("general.run=mine", f"checkpoints.resume_checkpoint_path={step}") == "mine"
    typo = run_name(f"checkpoints.resume_checkpoint_path={tmp_path / 'nope'}")  # reported later
    assert typo.startswith("cpu_tiny_") and "%" not in typo
