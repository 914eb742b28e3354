"""The README's first commands, verbatim, in a clean clone without Nanotron's fixture configs beside
it: the install line, the default training run, and the test command (collection: running the whole
suite inside itself would recurse), in a fresh virtual environment that sees this one's packages
(torch is not downloaded again). Every other command of the README and of the topic pages under
docs/ is classified here: run by the launch test after the default run, or the reason it is not.

The tests of this subject that launch real processes are in `tests/launch/test_readme_launch.py`."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def first_commands() -> list[str]:
    """The commands of the README's first two bash blocks, comments dropped."""
    blocks = re.findall(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), re.S)[:2]
    lines = [line.split("  #")[0].strip() for block in blocks for line in block.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def test_first_commands_are_install_test_train():
    assert first_commands() == ['pip install "torch==2.13.0" -e ".[dev]"', "python -m pytest -q",
                                "mesh3d train"]  # fmt: skip


# The pages whose bash blocks are commands a user types: the README and every docs/ page.
COMMAND_PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def page_commands(md: Path) -> list[str]:
    """Every command of a page's bash blocks: continuation lines joined (after a `\\`, or an
    indented line under a command, as in a usage synopsis), comments dropped, spaces collapsed."""
    commands: list[str] = []
    for block in re.findall(r"```bash\n(.*?)```", md.read_text(), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            command = " ".join(line.split("  #")[0].split())
            if not command or command.startswith("#"):
                continue
            if line[:1].isspace() and commands:  # the synopsis goes on
                commands[-1] += " " + command
            else:
                commands.append(command)
    return commands


def doc_commands() -> dict[str, list[str]]:
    """page (relative path) -> its commands, for every page that has some."""
    found = {str(md.relative_to(REPO)): page_commands(md) for md in COMMAND_PAGES}
    return {page: commands for page, commands in found.items() if commands}


# What the launch test (tests/launch/test_readme_launch.py) does with each command of the README
# and the docs/ pages, in a clean clone right after the default run (`mesh3d train`): a string is
# the command it runs (as written, or with the pages' placeholders filled: `cfg.yaml`, `CONFIG`,
# `N`, `checkpoints`, the user's own files; `{latest}` is the default run's last step), which
# must exit 0 within a minute; `None` with the reason it is not run there.
# fmt: off
MESH3D_TRAIN_DONE = None, "run first, verbatim, by test_first_commands_run_in_a_clean_clone"
DOC_COMMANDS: dict[str, tuple[str | None, str]] = {
    'pip install "torch==2.13.0" -e ".[dev]"': MESH3D_TRAIN_DONE,
    "python -m pytest -q": (None, "collected (--collect-only) in the clean clone: running the "
                            "suite inside itself would recurse"),
    "mesh3d train": MESH3D_TRAIN_DONE,
    "python recipes/config_tiny_llama.py --output config_tiny_llama.yaml": (
        "python recipes/config_tiny_llama.py --output config_tiny_llama.yaml", ""),
    "mesh3d config cfg.yaml --world-size 8 parallelism.tp=2": (
        "mesh3d config config_tiny_llama.yaml --world-size 8 parallelism.tp=2", ""),
    "mesh3d config cfg.yaml --check-data": (
        "mesh3d config recipes/configs/cpu_tiny.yaml --check-data", ""),
    "mesh3d config": ("mesh3d config", ""),
    "mesh3d train config_tiny_llama.yaml": (
        None, "8 CPU ranks for its 15 steps: 25 s on a 2-core host at load 6 with one thread a "
        "rank, 132 s at load 26 with the clean clone's two; tests/launch/test_config_tiny_llama.py "
        "trains the same config on one rank"),
    "torchrun --nproc_per_node=2 recipes/train.py --config-file cfg.yaml parallelism.dp=2 "
    "tokens.train_steps=20": (
        "torchrun --nproc_per_node=2 recipes/train.py --config-file recipes/configs/cpu_tiny.yaml "
        "parallelism.dp=2 tokens.train_steps=20", ""),
    "torchrun --nproc_per_node=2 recipes/train.py --config-file recipes/configs/cpu_tiny_moe.yaml "
    "parallelism.dp=2 parallelism.expert_parallel_size=2 tokens.train_steps=10": (
        "torchrun --nproc_per_node=2 recipes/train.py --config-file recipes/configs/cpu_tiny_moe.yaml "
        "parallelism.dp=2 parallelism.expert_parallel_size=2 tokens.train_steps=10", ""),
    "python recipes/doremi/run.py": ("python recipes/doremi/run.py", ""),
    # docs/hf-models.md
    "mesh3d train --config-file recipes/configs/cpu_tiny.yaml mesh3d.hf_model=path/to/model "
    "parallelism.dp=2 parallelism.tp=2 parallelism.pp=2 parallelism.tp_mode=ALL_REDUCE "
    "model.dtype=float32": (
        None, "path/to/model stands for the user's folder; tests/ranks/test_hf_train.py trains a "
        "GPT-NeoX folder with this config and layout (8 ranks) through the same train()"),
    # docs/fault-tolerance.md
    "python recipes/fault_tolerance/run_local.py --groups 2 --output runs/ft --config-file "
    "recipes/configs/cpu_tiny.yaml parallelism.tp=2 tokens.train_steps=200": (
        None, "4 ranks for 200 steps: minutes on 2 cores; tests/launch/test_fault_tolerance.py "
        "starts the same lighthouse and groups (2 groups of tp 2) and kills one"),
    "python recipes/fault_tolerance/run_local.py --groups 2 --output runs/ft --kill 1 --kill-at 20 "
    "--config-file recipes/configs/cpu_tiny.yaml tokens.train_steps=200": (
        None, "200 steps, a kill and a restart: minutes on 2 cores; "
        "tests/launch/test_fault_tolerance.py kills and restarts a group the same way"),
    "torchft_lighthouse --min_replicas 1 --quorum_tick_ms 100 --join_timeout_ms 10000": (
        None, "a server that runs until stopped; tests/launch/test_fault_tolerance.py starts "
        "torchft's lighthouse in the test process"),
    "sbatch --nodes=2 --export=ALL,MESH3D_REPLICA_ID=0,TORCHFT_LIGHTHOUSE=http://head:29510 "
    "recipes/slurm/train.sbatch cfg.yaml": (
        None, "needs a Slurm cluster; tests/launch/test_slurm.py submits recipes/slurm/train.sbatch"),
    "sbatch --nodes=2 --export=ALL,MESH3D_REPLICA_ID=1,TORCHFT_LIGHTHOUSE=http://head:29510 "
    "recipes/slurm/train.sbatch cfg.yaml": (
        None, "needs a Slurm cluster; tests/launch/test_slurm.py submits recipes/slurm/train.sbatch"),
    "mesh3d train reference.yaml": (
        None, "the user's own config and per-domain Nanoset folders; recipes/doremi/run.py runs "
        "the same three steps at toy size, tests/ranks/test_doremi_ranks.py checks them"),
    "mesh3d train proxy.yaml": (
        None, "needs the reference run of the user's own config; tests/ranks/test_doremi_ranks.py "
        "trains a proxy against a reference, at one process and dp2 x tp2 x pp2"),
    "python -m mesh3d.train.doremi checkpoints/proxy": (
        None, "needs the user's proxy run; tests/ranks/test_doremi_ranks.py averages a proxy "
        "checkpoint's weights and prints the section, recipes/doremi/run.py uses it"),
    "mesh3d train final.yaml": (
        None, "the user's larger run with the printed weights; recipes/doremi/run.py trains one"),
    "mesh3d plot runs/default/metrics.jsonl": ("mesh3d plot runs/default/metrics.jsonl", ""),
    "mesh3d plot runs/a/metrics.jsonl runs/b/metrics.jsonl --output compare.png": (
        "mesh3d plot runs/default/metrics.jsonl runs/default/metrics.jsonl --output compare.png", ""),
    "mesh3d plan CONFIG [--world-size N] [--json] [key=value ...]": (
        "mesh3d plan recipes/configs/cpu_tiny.yaml --world-size 8 --json parallelism.dp=8", ""),
    "mesh3d plan --search CONFIG --world-size N --hardware h100-80g [--nodes-of 8] [--top 10] "
    "[--json] [--write best.yaml] [key=value ...]": (
        "mesh3d plan --search recipes/configs/cpu_tiny.yaml --world-size 16 --hardware h100-80g "
        "--nodes-of 8 --top 10 --json --write best.yaml", ""),
    "sbatch --nodes=2 recipes/slurm/train.sbatch cfg.yaml [overrides ...]": (
        None, "needs a Slurm cluster: tests/launch/test_slurm.py submits recipes/slurm/train.sbatch "
        "to a one-node cluster it starts"),
    "python recipes/slurm/launch.py --config-file cfg.yaml --gpus-per-node 8 --rdzv-host node0 "
    "[overrides ...]": (
        None, "one command per node of a multi-node job: tests/launch/test_multinode.py runs it on "
        "two local 'nodes'"),
    "python recipes/tiny_data.py": ("python recipes/tiny_data.py", ""),
    "torchrun --nproc_per_node=1 recipes/train.py --config-file recipes/configs/cpu_nanoset.yaml": (
        "torchrun --nproc_per_node=1 recipes/train.py --config-file recipes/configs/cpu_nanoset.yaml",
        ""),
    "python -m mesh3d.data.tokenize --tokenizer ./my_tokenizer --input my_texts/*.jsonl --output "
    'data/tokenized [--text-column text] [--eos-token "</s>"] [--name NAME]': (
        "python -m mesh3d.data.tokenize --tokenizer runs/tiny_data/tokenizer --input my_texts.jsonl "
        '--output data/tokenized --text-column text --eos-token "</s>"', ""),
    "python -m mesh3d.convert from-hf --model ./Llama-3.2-1B --output ./ckpt_from_hf --tp 2 --pp 2": (
        "python -m mesh3d.convert from-hf --model ./hf_out --output ./ckpt_from_hf --tp 2 --pp 2", ""),
    "mesh3d train ./ckpt_from_hf/config.yaml": (
        None, "4 ranks for the 100 steps from-hf's config.yaml sets: over a minute; "
        "tests/ranks/test_hf_in_run.py trains from a from-hf folder"),
    "python -m mesh3d.convert to-hf --checkpoint runs/default/checkpoints --output ./hf_out": (
        "python -m mesh3d.convert to-hf --checkpoint runs/default/checkpoints --output ./hf_out", ""),
    'mesh3d generate --checkpoint runs/default/checkpoints --prompt "Once upon a time"': (
        'mesh3d generate --checkpoint runs/default/checkpoints --prompt "Once upon a time"', ""),
    'mesh3d generate --checkpoint runs/default/checkpoints/STEP --prompt "Once upon a time" --max-new-tokens 100 '
    "--temperature 0.8 --top-k 50 --seed 1": (
        'mesh3d generate --checkpoint runs/default/checkpoints/{latest} --prompt "Once upon a time" '
        "--max-new-tokens 100 --temperature 0.8 --top-k 50 --seed 1", ""),
    "mesh3d generate --checkpoint runs/default/checkpoints --prompts prompts.txt": (
        "mesh3d generate --checkpoint runs/default/checkpoints --prompts prompts.txt", ""),
    "mesh3d generate --checkpoint runs/default/checkpoints --prompts-file chats.jsonl": (
        None, "the default run's tokenizer has no chat template; tests/unit/test_generate.py "
        "runs the command on chats with a tokenizer that has one"),
    "python -m mesh3d.generate ...": (None, "the module form of the lines above, not a command"),
    "torchrun --nproc_per_node=4 -m mesh3d.generate --checkpoint runs/default/checkpoints --prompt "
    '"Once upon a time" --tp 2 --pp 2': (
        "torchrun --nproc_per_node=4 -m mesh3d.generate --checkpoint runs/default/checkpoints "
        '--prompt "Once upon a time" --tp 2 --pp 2', ""),
    "mesh3d eval runs/default/checkpoints --tasks hellaswag,arc_easy --max-samples 200": (
        None, "hub tasks: needs the network; tests/ranks/test_eval.py runs mesh3d eval on local tasks"),
    "mesh3d eval CK --tasks my_task --custom-tasks tasks/ --output-dir evals --batch-size 8": (
        None, "tests/ranks/test_eval.py runs this command on a trained checkpoint and three local "
        "tasks (and compares with lm-eval's hf model)"),
    "torchrun --nproc_per_node=4 -m mesh3d.evaluation.cli CK --tasks my_task --custom-tasks tasks/ "
    "--tp 2 --pp 2": (
        None, "tests/ranks/test_eval.py scores the same tasks at tp 2 x pp 2 on 4 ranks"),
    'mesh3d eval CK --engine lighteval --tasks "lighteval|hellaswag|0|1" --max-samples 200': (
        None, "hub data: needs the network; tests/launch/test_lighteval_tasks_offline.py resolves "
        "this task string offline"),
    "mesh3d eval CK --engine lighteval --tasks my_mc,my_gen --custom-tasks my_tasks.py": (
        None, "tests/ranks/test_eval_lighteval.py runs this command on a trained checkpoint and two "
        "local lighteval tasks (and compares with lighteval's transformers backend)"),
    "python recipes/custom_model.py": ("python recipes/custom_model.py", ""),
    "torchrun --nproc_per_node=8 recipes/custom_model.py --dp 2 --tp 2 --pp 2": (
        None, "8 ranks: tests/ranks/test_library.py runs the same main() at dp 2 x tp 2 x pp 2 and "
        "checks it equals one process"),
    # docs/nanotron-compatibility.md
    "torchrun --nproc_per_node=4 recipes/train.py --config-file cfg.yaml parallelism.dp=2 "
    "parallelism.tp=2 tokens.train_steps=200 data_stages[0].data.seed=3": (
        None, "4 ranks for 200 steps: minutes on 2 cores; the README's torchrun line runs the same "
        "program, and tests/unit/test_config.py types such overrides, list items included"),
    # docs/plan-search.md
    "mesh3d plan --search CONFIG --world-size N [--hardware h100-80g | --hardware-file my.yaml] "
    "[--nodes-of 8] [--top 10] [--json] [--write best.yaml] [key=value ...]": (
        None, "a synopsis: its --hardware form is the planning page's line, which runs; "
        "tests/unit/test_plan_search.py runs --hardware-file"),
    'mesh3d train "mesh3d.lora={r: 16, lora_alpha: 32, target_modules: all-linear}" '
    '"model.init_method={path: runs/default/checkpoints/STEP}" general.run=lora tokens.train_steps=20': (
        'mesh3d train "mesh3d.lora={r: 16, lora_alpha: 32, target_modules: all-linear}" '
        '"model.init_method={path: runs/default/checkpoints/{latest}}" general.run=lora '
        "tokens.train_steps=20", ""),
    "mesh3d convert to-peft --checkpoint runs/lora/checkpoints --output ./adapter": (
        "mesh3d convert to-peft --checkpoint runs/lora/checkpoints --output ./adapter", ""),
    "mesh3d convert to-hf --checkpoint runs/lora/checkpoints --output ./merged": (
        "mesh3d convert to-hf --checkpoint runs/lora/checkpoints --output ./merged", ""),
    'mesh3d generate --checkpoint runs/lora/checkpoints --prompt "def "': (
        'mesh3d generate --checkpoint runs/lora/checkpoints --prompt "def "', ""),
}
# fmt: on


def test_every_doc_command_is_run_or_says_why_not():
    """A command added or changed on the README or a docs/ page must be classified in
    DOC_COMMANDS (a command the launch test runs, or the reason it does not)."""
    pages = doc_commands()
    assert "README.md" in pages and len(pages) >= 8, sorted(pages)  # the pages were read
    for page, commands in pages.items():
        twice = sorted({c for c in commands if commands.count(c) > 1})
        assert not twice, f"{page} gives a command twice: {twice}"
    found = {command for commands in pages.values() for command in commands}
    unclassified = sorted(
        f"{page}: {c}" for page, cs in pages.items() for c in cs if c not in DOC_COMMANDS
    )
    assert not unclassified, "commands to classify in DOC_COMMANDS:\n" + "\n".join(unclassified)
    assert set(DOC_COMMANDS) - found == set(), "classified, no longer on any page"
    for command, (run, why) in DOC_COMMANDS.items():
        assert (run is None) == bool(why), command
        if run is not None:  # the same program and subcommand as the page's
            assert run.split()[:2] == command.split()[:2], command


def test_a_synopsis_spread_over_lines_is_one_command(tmp_path):
    md = tmp_path / "page.md"
    md.write_text(
        "```bash\nmesh3d plan --search CONFIG\n    [--top 10]   # rank\nmesh3d train \\\n"
        "    cfg.yaml\n# a comment\n```\n"
    )
    assert page_commands(md) == ["mesh3d plan --search CONFIG [--top 10]", "mesh3d train cfg.yaml"]


def test_reasons_name_tests_that_exist():
    for _, why in DOC_COMMANDS.values():
        for path in re.findall(r"tests/\S+\.py", why or ""):
            assert (REPO / path).is_file(), path
