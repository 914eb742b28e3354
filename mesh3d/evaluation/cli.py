"""`mesh3d eval CHECKPOINT --tasks TASKS`: downstream scores of a checkpoint at any layout.

    mesh3d eval runs/default/checkpoints --tasks my_task --custom-tasks tasks/ --max-samples 100
    mesh3d eval CK --engine lighteval --tasks "lighteval|hellaswag|0|1" --max-samples 100
    torchrun --nproc_per_node=4 -m mesh3d.evaluation.cli CK --tasks hellaswag --tp 2 --pp 2
    torchrun --nproc_per_node=8 -m mesh3d.evaluation.cli CK --tasks hellaswag --dp 2 --tp 2 --pp 2

The model is built as training builds it at dp x tp x pp (`generation/parallel.py`: each rank
reads its own weights of a checkpoint saved at any layout; each dp replica holds the whole model
and scores a slice of every batch) and scored (`scorer.Scorer`: log-likelihoods, rolling
log-likelihoods, greedy generations) through one of two engines:

- `--engine lm-eval` (the default), lm-evaluation-harness (`lm_eval_model.Mesh3dLM`):
  `--custom-tasks` is its include path (a folder of task YAMLs); rank 0 writes
  `results.json` and one `samples_<task>.jsonl` per task and prints lm-eval's table.
- `--engine lighteval` (`lighteval_model.Mesh3dLightevalModel`, `lighteval_run.py`): tasks in
  lighteval's or Nanotron's syntax (`hellaswag`, `hellaswag|0`, `lighteval|hellaswag|0|1`),
  `--custom-tasks` its custom-task file; only the requested and custom tasks are imported
  (`lighteval_tasks.py`), so it needs no network; rank 0 writes lighteval's results json and
  details parquet files and prints its table.

A task over local files needs no network with either engine. Checked before the model is built:
the numbers and degrees given, the output folder, the checkpoint, its tokenizer, the engine being
installed, every task name (the nearest names listed), the custom-task path (a YAML that does not
parse, a .py that does not import), lm-eval's task data (a task whose data cannot be downloaded is
named); more few-shot examples than a task has when they are drawn; one line each, exit 2.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import shutil
import tempfile
from pathlib import Path

from mesh3d.errors import UserError, exit_on_user_error, unwritable


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="mesh3d eval", description="downstream scores of a checkpoint, at any tp x pp"
    )
    ap.add_argument("checkpoint", help="a step folder, or a checkpoints folder (its latest step)")
    ap.add_argument("--tasks", required=True,
                    help="comma-separated task names: lm-eval's, or lighteval's (task|shots, "
                         "suite|task|shots|truncate) with --engine lighteval")  # fmt: skip
    ap.add_argument("--engine", choices=("lm-eval", "lighteval"), default="lm-eval",
                    help="the evaluation engine (default lm-eval)")  # fmt: skip
    ap.add_argument("--custom-tasks",
                    help="lm-eval: include path (a folder of task YAMLs); lighteval: its "
                         "custom-task file (a .py with TASKS_TABLE)")  # fmt: skip
    ap.add_argument("--output-dir", default="evals", help="where results go (default ./evals)")
    ap.add_argument("--max-samples", type=int, help="score at most N samples of each task")
    ap.add_argument("--num-fewshot", type=int, help="few-shot examples (default: the task's)")
    ap.add_argument("--batch-size", type=int, default=8, help="sequences a forward (default 8)")
    ap.add_argument("--max-length", type=int,
                    help="longest sequence scored (default: the checkpoint's tokens.sequence_length)")  # fmt: skip
    ap.add_argument("--tokenizer", help="tokenizer.json or a folder holding one")
    ap.add_argument("--apply-chat-template", action="store_true",
                    help="render each request with the tokenizer's chat template (chat models)")  # fmt: skip
    ap.add_argument("--tp", type=int, help="tensor-parallel degree (default: processes / pp)")
    ap.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree (default 1)")
    ap.add_argument("--dp", type=int, default=1,
                    help="data-parallel replicas, each scoring a slice of every batch (default 1)")  # fmt: skip
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    return ap


def _degrees(args, world: int) -> tuple[int, int, int]:
    for flag in ("dp", "tp", "pp"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise UserError(f"--{flag} {getattr(args, flag)} must be >= 1 (a parallel degree)")
    pp, dp = args.pp, args.dp
    tp = args.tp if args.tp is not None else max(world // max(pp * dp, 1), 1)
    if tp < 1 or pp < 1 or dp < 1 or dp * tp * pp != world:
        n = dp * tp * pp
        raise UserError(
            f"--dp {dp} x --tp {tp} x --pp {pp} = {n} ranks, but {world} process(es) run; start "
            f"{n} (torchrun --nproc_per_node={n}) or change --dp/--tp/--pp"
        )
    return dp, tp, pp


def _lm_eval():
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise UserError(
            "mesh3d eval --engine lm-eval needs lm-evaluation-harness: pip install 'mesh3d[eval]' "
            "(or pip install lm_eval)"
        ) from None
    from lm_eval.tasks import TaskManager

    return TaskManager


def check_tasks(tasks: list[str], custom: str | None):
    """lm-eval's task manager for `custom` (an include path), refusing unknown task names."""
    if custom is not None and not Path(custom).is_dir():
        what = "is a file" if Path(custom).exists() else "does not exist"
        raise UserError(f"--custom-tasks {custom} {what}; give a folder of task YAMLs (lm-eval's "
                        "include path: every *.yaml under it is read)")  # fmt: skip
    TaskManager = _lm_eval()  # noqa: N806
    if custom:  # the custom tasks alone when they hold every task: no index of lm-eval's ~10k
        manager = TaskManager(include_path=custom, include_defaults=False)
        if not set(tasks) <= set(manager.all_tasks):
            manager = TaskManager(include_path=custom)
    else:
        manager = TaskManager()
    known = set(manager.all_tasks)
    for task in tasks:
        if task not in known:
            near = difflib.get_close_matches(task, known, n=5)
            hint = f"; nearest: {', '.join(near)}" if near else ""
            if "|" in task:
                hint += "; suite|task|shots strings are lighteval's: add --engine lighteval"
            where = f" in lm-eval's tasks or {custom}" if custom else " in lm-eval's tasks"
            raise UserError(f"--tasks: no task {task!r}{where}{hint}{_unparsed(custom)}")
    return manager


def _unparsed(custom: str | None) -> str:
    """The hint naming the first task YAML under `custom` that does not parse ("" if none);
    lm-eval's own tags (`!function ...`) are taken as they come."""
    import yaml

    class AnyTag(yaml.SafeLoader):
        pass

    AnyTag.add_multi_constructor("!", lambda loader, suffix, node: None)
    for path in sorted(Path(custom).glob("**/*.yaml")) if custom else ():
        try:
            yaml.load(path.read_text(encoding="utf-8"), Loader=AnyTag)  # noqa: S506 - safe + tags
        except (yaml.YAMLError, UnicodeDecodeError) as e:
            mark = getattr(e, "problem_mark", None)
            at = f", line {mark.line + 1}" if mark else ""
            return f"; {path}{at} did not parse ({str(e).splitlines()[0]})"
    return ""


def load_tasks(manager, tasks: list[str]) -> list:
    """lm-eval's `tasks` built, their data fetched, before the model is: a task whose data
    cannot be downloaded is one line naming it. Each task's, group's or tag's own tasks and
    groups (not their members) are returned, for `simple_evaluate`."""
    from huggingface_hub.errors import LocalEntryNotFoundError

    built = []
    for task in tasks:
        try:
            got = manager.load(task)
        except (ConnectionError, LocalEntryNotFoundError) as e:
            why = (str(e) or type(e).__name__).splitlines()[0]
            raise UserError(
                f"--tasks: the data of task {task!r} could not be downloaded ({why}); connect to "
                "the Hub, or set HF_DATASETS_OFFLINE=1 with the data in the datasets cache"
            ) from None
        members = {name for names in got["group_map"].values() for name in names}
        built += [x for n, x in {**got["groups"], **got["tasks"]}.items() if n not in members]
    return built


def hf_tokenizer(step: Path, flag: str | None):
    """The checkpoint's tokenizer as transformers loads it from its Hugging Face export (bos and
    eos named from the model config, as `mesh3d convert` writes them)."""
    from mesh3d.checkpoint.model_config import read_model_config_json
    from mesh3d.generation.single import find_tokenizer

    path, _ = find_tokenizer(step, flag)
    return tokenizer_as_exported(Path(path), read_model_config_json(step))


def check_tokenizer(flag: str) -> None:
    """Refuse a `--tokenizer` that is not a tokenizer.json or a folder holding one."""
    path = Path(flag)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        what = f"holds no {file.name}" if path.is_dir() else "does not exist"
        raise UserError(f"--tokenizer {flag} {what}; give a tokenizer.json or a folder holding one")
    try:
        ok = "model" in json.loads(file.read_text(encoding="utf-8"))
    except (ValueError, TypeError):  # not JSON, or JSON but not an object
        ok = False
    if not ok:
        raise UserError(f"--tokenizer {file} is not a tokenizer.json (a JSON object with a "
                        "`model`, as `tokenizers` saves it); give one or a folder holding one")  # fmt: skip


def tokenizer_as_exported(src: Path, mc):
    """The tokenizer at `src` (a tokenizer.json or a folder holding one) as transformers loads
    it from a Hugging Face export of a model with config `mc`."""
    from transformers import AutoTokenizer

    from mesh3d.checkpoint.hf import set_special_tokens
    from mesh3d.checkpoint.tokenizer_files import FILES

    folder = Path(tempfile.mkdtemp(prefix="mesh3d-eval-tok-"))
    try:
        if src.is_file():
            shutil.copy(src, folder / "tokenizer.json")
        else:
            for name in FILES:
                if (src / name).is_file():
                    shutil.copy(src / name, folder / name)
        set_special_tokens(folder, mc)
        return AutoTokenizer.from_pretrained(str(folder))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def write_results(results: dict, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    samples = results.pop("samples", {}) or {}
    for task, rows in samples.items():
        with open(out / f"samples_{task}.jsonl", "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, default=str) + "\n")
    path = out / "results.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(results, indent=2, default=str) + "\n")
    os.replace(tmp, path)
    return path


def _scorer(step: Path, args, tp: int, pp: int, dp: int):
    """(the checkpoint's tokenizer, a `Scorer` of its model built at dp x tp x pp)."""
    tokenizer = hf_tokenizer(step, args.tokenizer)
    if getattr(args, "apply_chat_template", False) and not getattr(
        tokenizer, "chat_template", None
    ):
        raise UserError(
            f"--apply-chat-template: the tokenizer of {step} has no chat template; give "
            "--tokenizer <a folder whose tokenizer_config.json has chat_template> or leave the "
            "flag out (the tasks are then scored as plain text)"
        )
    from mesh3d.evaluation.scorer import Scorer
    from mesh3d.generation.parallel import load_parallel_model

    length = _max_length(step, args)
    per = max(1, -(-args.batch_size // dp))  # sequences a replica's forward takes
    return tokenizer, Scorer(load_parallel_model(step, tp, pp, per, length, args.device, dp))


def _max_length(step: Path, args) -> int:
    """--max-length, else the checkpoint's tokens.sequence_length (2048 when it has none)."""
    from mesh3d.generation.single import saved_config

    if args.max_length is not None:
        return args.max_length
    return int((saved_config(step).get("tokens") or {}).get("sequence_length") or 2048)


def evaluate(step: Path, args, tp: int, pp: int, dp: int = 1) -> dict | None:
    """lm-eval's results of `args.tasks` on `step` at dp x tp x pp: every rank calls it and runs
    the same requests (each dp replica scores its slice of every batch); lm-eval returns the
    results on rank 0 (LOCAL_RANK 0), None elsewhere."""
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    manager = check_tasks(tasks, args.custom_tasks)
    loaded = load_tasks(manager, tasks)
    tokenizer, scorer = _scorer(step, args, tp, pp, dp)
    from lm_eval import simple_evaluate

    from mesh3d.evaluation.lm_eval_model import Mesh3dLM

    chat = getattr(args, "apply_chat_template", False)
    try:  # the few-shot examples are drawn before any request is scored
        return simple_evaluate(model=Mesh3dLM(scorer, tokenizer), tasks=loaded,
                               num_fewshot=args.num_fewshot, limit=args.max_samples,
                               task_manager=manager, log_samples=True,
                               batch_size=args.batch_size, apply_chat_template=chat)  # fmt: skip
    except ValueError as e:
        if not str(e).startswith("Sample larger than population"):
            raise
        raise UserError(f"--num-fewshot {args.num_fewshot} is more than a task of --tasks "
                        f"{args.tasks} has examples to draw; lower it") from None  # fmt: skip


def evaluate_lighteval(step: Path, args, tp: int, pp: int, dp: int = 1, output: Path | None = None):
    """lighteval's pipeline of `args.tasks` on `step` at dp x tp x pp, every rank calling it
    alike; rank 0's has the results (`get_results()`, `get_details()`) and wrote lighteval's
    files under `output` (when given)."""
    from mesh3d.evaluation.lighteval_tasks import task_configs, task_specs

    specs = task_specs(args.tasks, args.num_fewshot)
    configs = task_configs(specs, args.custom_tasks)
    tokenizer, scorer = _scorer(step, args, tp, pp, dp)
    from mesh3d.evaluation.lighteval_model import Mesh3dLightevalModel
    from mesh3d.evaluation.lighteval_run import run_lighteval

    model = Mesh3dLightevalModel(
        scorer, tokenizer, chat=getattr(args, "apply_chat_template", False)
    )
    return run_lighteval(model, specs, configs, output, args.max_samples)


def _check_sizes(args, length: int, dp: int) -> None:
    """Refuse a --batch-size x --max-length that the model's config check would refuse as
    `tokens.micro_batch_size` or `tokens.sequence_length`, naming the flags instead."""
    from mesh3d.checks.size_checks import MAX_SIZE, MAX_STEP_TOKENS

    if length > MAX_SIZE:
        raise UserError(f"--max-length {length} is more than {MAX_SIZE} (2**31 - 1); lower it")
    tokens = max(1, -(-args.batch_size // dp)) * dp * length
    if tokens > MAX_STEP_TOKENS:
        raise UserError(f"--batch-size {args.batch_size} x --max-length {length} is {tokens} "
                        f"tokens a forward, more than {MAX_STEP_TOKENS} (2**34); lower "
                        "--batch-size (or --max-length)")  # fmt: skip


def _check_lora_base(step: Path) -> None:
    """Refuse a LoRA run's checkpoint whose base folder is gone, in the words of this command
    (the config check would name `model.init_method.path`, a key the user never set here)."""
    from mesh3d.checkpoint.training import lora_of

    base = (lora_of(step) or {}).get("base") or {}
    if base.get("init") == "path" and not Path(base.get("path", "")).exists():
        raise UserError(
            f"checkpoint {step} holds LoRA adapters for the base {base['path']}, which is gone; "
            "put the base back there (the adapters are useless without it)"
        )


@exit_on_user_error
def main(argv: list[str] | None = None) -> None:
    import torch.distributed as dist

    from mesh3d.checkpoint.load import weights_dir
    from mesh3d.mesh import shutdown_distributed

    args = _parser().parse_args(argv)
    if not args.tasks.replace(",", "").strip():
        raise UserError(f"--tasks {args.tasks!r} names no task; give one or more, comma-separated "
                        "(e.g. --tasks hellaswag,arc_easy)")  # fmt: skip
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dp, tp, pp = _degrees(args, world)
    for flag, least in (("batch_size", 1), ("max_samples", 1), ("max_length", 1),
                        ("num_fewshot", 0)):  # fmt: skip
        value = getattr(args, flag)
        if value is not None and value < least:
            raise UserError(f"--{flag.replace('_', '-')} {value} must be >= {least}")
    step = weights_dir(args.checkpoint, "checkpoint")
    _check_lora_base(step)
    _check_sizes(args, _max_length(step, args), dp)
    if args.tokenizer:
        check_tokenizer(args.tokenizer)
    started = dist.is_initialized()
    out = Path(args.output_dir)
    try:  # before the evaluation, not after it
        out.mkdir(parents=True, exist_ok=True)
        if not os.access(out, os.W_OK):
            raise PermissionError(13, "Permission denied")
    except OSError as e:
        raise unwritable("--output-dir", out, e) from None
    if args.engine == "lighteval":
        results = evaluate_lighteval(step, args, tp, pp, dp, out)
    else:
        results = evaluate(step, args, tp, pp, dp)
    if not started:
        shutdown_distributed()
    if int(os.environ.get("RANK", "0")) != 0 or results is None:
        return
    if args.engine == "lighteval":
        from lighteval.utils.utils import make_results_table

        print(make_results_table(results.get_results()))
        path = f"{out / 'results'} (details: {out / 'details'})"
    else:
        from lm_eval.utils import make_table

        print(make_table(results))
        path = write_results(results, out)
    print(f"{step}: scores at dp {dp} x tp {tp} x pp {pp} written to {path}")


if __name__ == "__main__":
    main()
