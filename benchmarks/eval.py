"""Downstream evaluation speed: `mesh3d eval` against the engine's own transformers backend,
and what an in-run evaluation (`lighteval:`) adds to a run.

    python benchmarks/eval.py            # ~3 min on 2 cores
    python benchmarks/eval.py --quick    # fewer samples and steps
    python benchmarks/eval.py --engine lighteval   # parts 1 and 2 through lighteval, ~2 min

1. Trains the default CPU config's model (mesh3d/configs/default.yaml: a 4-layer Llama,
   hidden 192, its built-in tokenizer) for a few steps, exports it with `mesh3d convert to-hf`
   and writes two local lm-eval tasks over generated text: multiple choice (4 choices) and a
   rolling log-likelihood (perplexity) task.
2. Scores both tasks with `mesh3d eval`'s model (`evaluation.lm_eval_model.Mesh3dLM`, one
   process) and with lm-eval's `hf` model on the export, interleaved `--reps` times, same
   batch size, fp32 on CPU: samples/s of each (median) and their ratio; then mesh3d at tp 2 (two
   ranks) in the same run. The log-likelihoods are compared too (max relative difference).
3. Trains the default config `--steps` steps with and without a `lighteval:` section that
   scores the multiple-choice task every `--every` steps: the added wall time against the
   evaluations' own time (each `[Eval]` line's seconds).
With `--engine lighteval`, part 2 scores the multiple-choice task as a lighteval custom task
through lighteval's pipeline: mesh3d's model (`evaluation.lighteval_model`) at one process and
at tp 2 against lighteval's `TransformersModel` on the export (which batches
`round(batch / choices / 8) * 8` samples, so the default batch 32 gives both sides 32
sequences a forward); part 3 is left out.
Results: benchmarks/results/local/eval[_lighteval][_quick].json (`--publish`: benchmarks/results/).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from _ranks import launch
from _results import add_publish_flag, results_dir

from mesh3d.config import load_config

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = ROOT / "mesh3d" / "configs" / "default.yaml"


def _config(work: Path, steps: int, extra=()):
    from mesh3d.data.corpus import default_run_overrides

    return load_config(DEFAULT, [*default_run_overrides(),
        f"tokens.train_steps={steps}", "logging.log_level=warning", "tokens.val_check_interval=-1", "tokens.limit_val_batches=0",
        f"checkpoints.checkpoints_path={work / 'ck'}", f"checkpoints.checkpoint_interval={steps}",
        *extra,
    ])  # fmt: skip


def _tasks(work: Path, n: int) -> Path:
    from mesh3d.data.synthetic import make_documents

    docs = make_documents(2 * n + 50, seed=11)
    rows = []
    for i in range(n):
        w = docs[i].split()
        others = [docs[n + (i + k) % n].split() for k in range(3)]
        choices = [" ".join(w[8:16])] + [" ".join(o[8:16]) for o in others]
        rows.append({"question": " ".join(w[:8]), "choices": choices, "answer": 0})
    with open(work / "mc.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    with open(work / "text.jsonl", "w") as f:
        f.writelines(json.dumps({"text": d[:600]}) + "\n" for d in docs[2 * n : 2 * n + 20])
    tasks = work / "tasks"
    tasks.mkdir(exist_ok=True)
    head = "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {}\ntest_split: test\n"
    (tasks / "bench_mc.yaml").write_text(
        "task: bench_mc\n" + head.format(work / "mc.jsonl") + "output_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\n'
        "metric_list:\n  - metric: acc\n"
    )
    (tasks / "bench_text.yaml").write_text(
        "task: bench_text\n"
        + head.format(work / "text.jsonl")
        + "output_type: loglikelihood_rolling\n"
        'doc_to_text: ""\ndoc_to_target: "{{text}}"\nmetric_list:\n  - metric: bits_per_byte\n'
    )
    return tasks


LIGHTEVAL_TASK = """from lighteval.metrics.metrics import Metrics
from lighteval.tasks.lighteval_task import LightevalTaskConfig
from lighteval.tasks.requests import Doc


def prompt(line, task_name=None):
    return Doc(task_name=task_name, query=line["question"], choices=[" " + c for c in line["choices"]],
               gold_index=line["answer"])


TASKS_TABLE = [LightevalTaskConfig(name="bench_mc", prompt_function=prompt, hf_repo="{folder}",
                                   hf_subset="default", hf_avail_splits=["test"],
                                   evaluation_splits=["test"], metrics=[Metrics.loglikelihood_acc])]
"""


def _lighteval_task(work: Path) -> Path:
    """work/bench_lighteval.py: the multiple-choice task as a lighteval custom task."""
    (work / "lighteval_mc").mkdir(exist_ok=True)
    (work / "lighteval_mc" / "test.jsonl").write_text((work / "mc.jsonl").read_text())
    path = work / "bench_lighteval.py"
    path.write_text(LIGHTEVAL_TASK.replace("{folder}", str(work / "lighteval_mc")))
    return path


def _lighteval_rank(rank: int, world: int, work: str, batch: int, reps: int, backend: str):
    """lighteval's pipeline on bench_mc: mesh3d's model at tp `world` or lighteval's
    transformers backend on the export (one process), built before the clock starts."""
    from mesh3d.evaluation.lighteval_run import run_lighteval
    from mesh3d.evaluation.lighteval_tasks import task_configs, task_specs

    specs = task_specs("bench_mc")
    configs = task_configs(specs, str(Path(work) / "bench_lighteval.py"))
    if backend == "mesh3d":
        from mesh3d.evaluation.cli import hf_tokenizer
        from mesh3d.evaluation.lighteval_model import Mesh3dLightevalModel
        from mesh3d.evaluation.scorer import Scorer
        from mesh3d.generation.parallel import load_parallel_model

        step = Path(work) / "step"
        model = Mesh3dLightevalModel(Scorer(load_parallel_model(step, world, 1, batch, 128, "cpu")),
                                     hf_tokenizer(step, None))  # fmt: skip
    else:
        from lighteval.models.transformers.transformers_model import (
            TransformersModel,
            TransformersModelConfig,
        )

        model = TransformersModel(TransformersModelConfig(
            model_name=str(Path(work) / "hf"), dtype="float32", device="cpu", batch_size=batch,
            max_length=128))  # fmt: skip
    times, lls = [], None
    for _ in range(reps):
        t0 = time.perf_counter()
        pipeline = run_lighteval(model, specs, configs, None, None)
        times.append(time.perf_counter() - t0)
        if rank == 0:
            (details,) = pipeline.get_details().values()
            lls = [float(x) for d in details for x in d.model_response.logprobs]
    return {"seconds": times, "lls": lls}


def _lighteval_bench(args, work: Path) -> dict:
    """Part 2 through lighteval: requests/s of mesh3d (1 process, tp 2) and of lighteval's
    transformers backend, interleaved; the max relative difference of their log-likelihoods."""
    _lighteval_task(work)
    n = args.samples * 4
    ours, theirs, lls = [], [], {}
    for _ in range(args.reps):
        got = launch(1, _lighteval_rank, str(work), args.batch_size, 1, "mesh3d", timeout=1800)[0]
        ours += got["seconds"]
        lls["mesh3d"] = got["lls"]
        got = launch(1, _lighteval_rank, str(work), args.batch_size, 1, "hf", timeout=1800)[0]
        theirs += got["seconds"]
        lls["hf"] = got["lls"]
    tp2 = launch(2, _lighteval_rank, str(work), args.batch_size, args.reps, "mesh3d",
                 timeout=1800)[0]  # fmt: skip
    rate = {"mesh3d tp1": n / statistics.median(ours), "hf": n / statistics.median(theirs),
            "mesh3d tp2": n / statistics.median(tp2["seconds"])}  # fmt: skip
    diff = max(abs(a - b) / abs(b) for a, b in zip(lls["mesh3d"], lls["hf"], strict=True))
    print(f"lighteval: scoring {args.samples} multiple-choice samples (x4 choices), batch "
          f"{args.batch_size}, median of {args.reps}:")  # fmt: skip
    for key, r in rate.items():
        print(f"  {key:10s} {r:8.1f} requests/s  ({r / rate['hf']:.2f}x lighteval's "
              "transformers backend)")  # fmt: skip
    print(f"  per-request log-likelihood, mesh3d vs transformers: max relative difference "
          f"{diff:.1e}")  # fmt: skip
    return {"requests": n, "requests_per_s": rate, "max_rel_ll_diff": diff}


def _lls(results: dict) -> list[float]:
    out = []
    for task in sorted(results["samples"]):
        for s in sorted(results["samples"][task], key=lambda s: s["doc_id"]):
            for r in s["resps"]:
                out.append(float(r[0][0] if isinstance(r[0], list | tuple) else r[0]))
    return out


def _mesh3d_rank(rank: int, world: int, work: str, batch: int, reps: int) -> dict:
    from lm_eval import simple_evaluate

    from mesh3d.evaluation.cli import check_tasks, hf_tokenizer
    from mesh3d.evaluation.lm_eval_model import Mesh3dLM
    from mesh3d.evaluation.scorer import Scorer
    from mesh3d.generation.parallel import load_parallel_model

    step = Path(work) / "step"
    manager = check_tasks(["bench_mc", "bench_text"], str(Path(work) / "tasks"))
    lm = Mesh3dLM(Scorer(load_parallel_model(step, world, 1, batch, 128, "cpu")),
                  hf_tokenizer(step, None))  # fmt: skip
    times, got = [], None
    for _ in range(reps):
        t0 = time.perf_counter()
        got = simple_evaluate(model=lm, tasks=["bench_mc", "bench_text"], task_manager=manager,
                              log_samples=True, batch_size=batch)  # fmt: skip
        times.append(time.perf_counter() - t0)
    return {"seconds": times, "lls": _lls(got) if got else None}


def _hf_rank(rank: int, world: int, work: str, batch: int) -> dict:
    """lm-eval's `hf` model on the export, built before the clock starts (as mesh3d's is)."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(Path(work) / "tasks"))
    lm = HFLM(pretrained=str(Path(work) / "hf"), dtype="float32", batch_size=batch, device="cpu")
    t0 = time.perf_counter()
    got = simple_evaluate(model=lm, tasks=["bench_mc", "bench_text"], log_samples=True,
                          batch_size=batch, task_manager=manager)  # fmt: skip
    return {"seconds": time.perf_counter() - t0, "lls": _lls(got)}


def _train_rank(rank: int, world: int, work: str, steps: int, extra: list[str]) -> dict:
    from mesh3d.train.loop import train

    t0 = time.perf_counter()
    res = train(_config(Path(work), steps, extra))
    return {"seconds": time.perf_counter() - t0, "evals": res.evals}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--engine", choices=("lm-eval", "lighteval"), default="lm-eval")
    ap.add_argument("--batch-size", type=int, help="default 16 (lm-eval), 32 (lighteval)")
    ap.add_argument("--samples", type=int, default=200, help="multiple-choice samples")
    ap.add_argument("--steps", type=int, default=60, help="part 3: steps of each run")
    ap.add_argument("--every", type=int, default=20, help="part 3: steps between evaluations")
    add_publish_flag(ap)
    args = ap.parse_args(argv)
    if args.quick:
        args.reps, args.samples, args.steps, args.every = 1, 40, 20, 10
    if args.batch_size is None:
        args.batch_size = 32 if args.engine == "lighteval" else 16
    print("command:", "python", *map(shlex.quote, sys.argv))
    print(f"torch {torch.__version__} | cores {os.cpu_count()} | {datetime.date.today()}")
    os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="mesh3d-eval-bench-"))
    tasks = _tasks(work, args.samples)
    launch(1, _train_rank, str(work / "model"), 20, [], timeout=900)  # the checkpoint scored
    (work / "step").symlink_to(work / "model" / "ck" / "20")
    from mesh3d.convert import main as convert

    convert(["to-hf", "--checkpoint", str(work / "step"), "--output", str(work / "hf")])
    name = (
        f"eval{'_lighteval' if args.engine == 'lighteval' else ''}{'_quick' if args.quick else ''}"
    )
    if args.engine == "lighteval":
        result = {"date": str(datetime.date.today()), "torch": torch.__version__,
                  "cores": os.cpu_count(), "engine": "lighteval", "samples": args.samples,
                  "batch_size": args.batch_size, **_lighteval_bench(args, work)}  # fmt: skip
        out = results_dir(args.publish) / f"{name}.json"
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {out}")
        return 0
    n = args.samples * 4 + 20  # requests: 4 choices a sample, and the rolling documents' windows
    ours, theirs, lls = [], [], {}
    for _ in range(args.reps):  # interleaved, so both see the same machine
        got = launch(1, _mesh3d_rank, str(work), args.batch_size, 1, timeout=1800)[0]
        ours += got["seconds"]
        lls["mesh3d"] = got["lls"]
        got = launch(1, _hf_rank, str(work), args.batch_size, timeout=1800)[0]
        theirs.append(got["seconds"])
        lls["hf"] = got["lls"]
    tp2 = launch(2, _mesh3d_rank, str(work), args.batch_size, args.reps, timeout=1800)[0]
    rate = {"mesh3d tp1": n / statistics.median(ours), "hf": n / statistics.median(theirs),
            "mesh3d tp2": n / statistics.median(tp2["seconds"])}  # fmt: skip
    diff = max(abs(a - b) / abs(b) for a, b in zip(lls["mesh3d"], lls["hf"], strict=True))
    print(f"scoring {args.samples} multiple-choice samples (x4 choices) + 20 documents, batch "
          f"{args.batch_size}, median of {args.reps}:")  # fmt: skip
    for key, r in rate.items():
        print(f"  {key:10s} {r:8.1f} requests/s  ({r / rate['hf']:.2f}x lm-eval's hf model)")
    print(f"  per-request log-likelihood, mesh3d vs hf: max relative difference {diff:.1e}")
    extra = [f"lighteval={{batch_size: {args.batch_size}, eval_interval: {args.every}, "
             f"tasks: {{tasks: bench_mc, custom_tasks: {tasks}}}}}",
             f"checkpoints.checkpoint_interval={args.every}"]  # fmt: skip
    without = launch(1, _train_rank, str(work / "without"), args.steps,
                     [f"checkpoints.checkpoint_interval={args.every}"], timeout=1800)[0]  # fmt: skip
    with_ = launch(1, _train_rank, str(work / "with"), args.steps, extra, timeout=1800)[0]
    added = with_["seconds"] - without["seconds"]
    own = sum(e["eval_time_s"] for e in with_["evals"])
    print(f"in-run evaluation, {args.steps}-step runs saving every {args.every} steps: "
          f"{without['seconds']:.1f} s without, {with_['seconds']:.1f} s with "
          f"{len(with_['evals'])} evaluations of bench_mc: +{added:.1f} s, the evaluations' own "
          f"time {own:.1f} s")  # fmt: skip
    result = {"date": str(datetime.date.today()), "torch": torch.__version__,
              "cores": os.cpu_count(), "samples": args.samples, "batch_size": args.batch_size,
              "requests": n, "requests_per_s": rate, "max_rel_ll_diff": diff,
              "in_run": {"steps": args.steps, "every": args.every,
                         "without_s": without["seconds"], "with_s": with_["seconds"],
                         "evaluations_own_s": own,
                         "evaluations": len(with_["evals"])}}  # fmt: skip
    out = results_dir(args.publish) / f"{name}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
