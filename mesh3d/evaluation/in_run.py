"""Downstream scores inside a training run (the `lighteval:` section), at the training layout.

After the checkpoint of every `lighteval.eval_interval`-th step is saved, every rank of the run
runs the same lm-eval evaluation (`lm_eval_model.Mesh3dLM`) on the training model parts as they
are: `TrainingScorer` pads each batch of requests to the run's global batch of
`tokens.sequence_length`-token rows, gives every dp replica its slice and each replica's
microbatches go through the run's own forward (its pipeline schedule in forward-only mode, as
validation does: `train/evaluate.py`), the last stage turning logits into per-token
log-probabilities and arg-max hits (`StepLoss.instead`) where it would compute the loss. One
all-reduce over the world gives every rank the whole batch's numbers. Nothing is gathered or
converted and no second job starts; the parts run in eval mode and are put back (FSDP
resharded), and the random states are restored, so the run trains on exactly as it would have
(`tests/ranks/test_eval_in_run.py`).

The engine is lm-eval (Nanotron's task strings mapped to lm-eval tasks) unless
`mesh3d.eval_engine: lighteval`, which scores the task strings and custom-task file as Nanotron
gives them to lighteval (`lighteval_model.Mesh3dLightevalModel` on the same scorer).
Scores go to the metrics file, TensorBoard and W&B (`eval/<task>/<metric>`), the console and
the end-of-run summary; the engine's results of each step under
`lighteval.logging.local_output_path` (else `<run>/evals`)/`<step>/`. An evaluation that fails
is one logged line and the run trains on (`mesh3d.eval_failure: stop` stops it).
"""

from __future__ import annotations

import contextlib
import random
import re
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from mesh3d.errors import RunStopped, UserError
from mesh3d.evaluation.scorer import Scorer, token_outputs
from mesh3d.log import logger
from mesh3d.mesh import share
from mesh3d.parallel.pipeline import is_v_schedule, run_schedule
from mesh3d.parallel.pipeline_forward import forward_walk
from mesh3d.train.evaluate import _reshard
from mesh3d.train.step import _autocast, _loss_ctx


class TrainingScorer(Scorer):
    """`Scorer` on a run's model parts at the run's layout (every rank calls it alike)."""

    def __init__(self, run):
        layout = run.layout
        self.run, self.parts, self.layout, self.device = run, run.parts, layout, run.device
        self.batch = layout.global_batch  # rows per forward, over every dp replica
        self.length = layout.sequence_length
        self.vocab = layout.vocab_size
        self.fixed = True  # every batch: the run's global batch of full-length rows

    @torch.no_grad()
    def score(self, seqs, spans):
        modes = [m.training for m in self.parts.modules]
        for m in self.parts.modules:
            m.eval()
        try:
            return super().score(seqs, spans)
        finally:
            for m, mode in zip(self.parts.modules, modes):
                m.train(mode)
            _reshard(self.parts.modules)

    def _token_scores(self, x: Tensor, targets: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        layout, parts, device = self.layout, self.parts, self.device
        rows, n = self.batch, self.length
        full_x = torch.zeros(rows, n, dtype=torch.int64)
        full_t = torch.zeros(rows, n, dtype=torch.int64)
        full_x[: x.shape[0], : x.shape[1]], full_t[: x.shape[0], : x.shape[1]] = x, targets
        dp, rank = layout.dims.dp, layout.coords["dp"]
        per = rows // dp
        mine_x = full_x[rank * per : (rank + 1) * per].to(device)
        mine_t = full_t[rank * per : (rank + 1) * per].to(device)
        got: list[Tensor] = []

        def keep(logits: Tensor, labels: Tensor) -> Tensor:
            if isinstance(logits, DTensor):
                logits = logits.full_tensor()
            got.append(token_outputs(logits[..., : self.vocab].float(), labels))
            return torch.zeros((), device=logits.device)

        positions = None
        if layout.positions_everywhere or layout.doc_masking:
            positions = torch.arange(n, device=device).expand(per, n).contiguous()
        loss_fn, autocast, tp = parts.loss_fn, layout.autocast_dtype, layout.dims.tp
        if parts.schedule is None:
            model = parts.modules[0]
            for i in range(0, per, layout.microbatch_size):
                sl = slice(i, i + layout.microbatch_size)
                kwargs = {} if positions is None else {"positions": positions[sl]}
                with _autocast(device, autocast):
                    logits = model(mine_x[sl], **kwargs)
                with _loss_ctx(tp):
                    keep(logits, mine_t[sl])
        else:
            loss_fn.instead = keep
            try:
                inputs = mine_x if parts.has_first else None
                labels = mine_t if parts.has_last else None
                with _autocast(device, autocast), _loss_ctx(tp):
                    if is_v_schedule(layout.schedule):
                        forward_walk(parts.stages, layout.microbatches, inputs, labels,
                                     positions, loss_fn, layout.activation())  # fmt: skip
                    else:
                        run_schedule(parts.schedule, parts.stages, inputs, labels, positions,
                                     forward_only=True)  # fmt: skip
            finally:
                loss_fn.instead = None
        out = torch.zeros(3, rows, n, device=device)
        c = layout.coords
        if got and c["tp"] == 0 and c.get("cp", 0) == 0:  # one writer per dp replica's rows
            out[:, rank * per : (rank + 1) * per] = torch.cat(got, dim=1)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(out)
        out = out[:, : x.shape[0], : x.shape[1]].cpu()
        return out[0], out[1].bool(), out[2].long()

    @torch.no_grad()
    def greedy(self, contexts, max_new, eos):
        """Greedy continuations without a KV cache: each new token is one forward of the
        whole batch at the run's layout (the arg-max at each row's last position)."""
        room = self.length - max_new
        if room < 1:
            raise ValueError(f"{max_new} new tokens leave no room in {self.length}")
        out = []
        modes = [m.training for m in self.parts.modules]
        for m in self.parts.modules:
            m.eval()
        try:
            for at in range(0, len(contexts), self.batch):
                rows = [list(c[-room:]) for c in contexts[at : at + self.batch]]
                new = [[] for _ in rows]
                for _ in range(max_new):
                    live = [r for r, n in enumerate(new) if not (n and n[-1] == eos)]
                    if not live:
                        break
                    x = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.int64)
                    for r, row in enumerate(rows):
                        x[r, : len(row)] = torch.tensor(row)
                    _, _, top = self._token_scores(x, torch.zeros_like(x))
                    for r in live:
                        token = int(top[r, len(rows[r]) - 1])
                        rows[r].append(token)
                        new[r].append(token)
                out += new
        finally:
            for m, mode in zip(self.parts.modules, modes):
                m.train(mode)
            _reshard(self.parts.modules)
        return out


@contextlib.contextmanager
def kept_random_state(device: torch.device):
    """Python's, numpy's and torch's random states (CUDA's too) as they were before."""
    state = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if device.type == "cuda" else None
    try:
        yield
    finally:
        random.setstate(state[0])
        np.random.set_state(state[1])
        torch.random.set_rng_state(state[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def _numbers(results: dict) -> dict[str, float]:
    """`eval/<task>/<metric>` -> value of lm-eval's or lighteval's results (stderrs, lighteval's
    `all` and non-numbers left out; lighteval's `task:shots` named `task`)."""
    out = {}
    for task, metrics in results.get("results", {}).items():
        if task == "all":
            continue
        task = re.sub(r"[:|]\d+$", "", task)
        for key, value in metrics.items():
            if "stderr" in key or isinstance(value, bool) or not isinstance(value, int | float):
                continue
            out[f"eval/{task}/{key.split(',')[0]}"] = float(value)
    return out


AS_KEYS = {"--custom-tasks": "`lighteval.tasks.custom_tasks`", "--tasks": "`lighteval.tasks.tasks`",
           "add --engine lighteval": "set mesh3d.eval_engine: lighteval"}  # fmt: skip


def _as_keys(message: str) -> str:
    """A `mesh3d eval` message about its flags, in the words of the `lighteval:` section."""
    for flag, key in AS_KEYS.items():
        message = message.replace(flag, key)
    return message


class InRunEvaluation:
    """The `lighteval:` section of a run, checked when the run starts (every rank alike: task
    names, tokenizer, the engine installed) and run by `after_save`."""

    def __init__(self, cfg, run_dir: Path):
        from mesh3d.checks.eval_checks import eval_interval, lm_eval_tasks
        from mesh3d.evaluation.cli import check_tasks, tokenizer_as_exported

        section = cfg.lighteval
        tasks = section["tasks"]
        custom = tasks.get("custom_tasks")
        self.lighteval = cfg.mesh3d.eval_engine == "lighteval"
        try:
            if self.lighteval:
                from mesh3d.evaluation.lighteval_tasks import task_configs, task_specs

                self.specs = task_specs(tasks["tasks"])
                self.configs = task_configs(self.specs, custom)
            else:
                self.groups: dict[int | None, list[str]] = {}
                for task, shots in lm_eval_tasks(tasks["tasks"]):
                    self.groups.setdefault(shots, []).append(task)
                self.manager = check_tasks([t for g in self.groups.values() for t in g], custom)
        except UserError as e:  # the checks are `mesh3d eval`'s: name the config's keys
            raise UserError(_as_keys(str(e))) from None
        self.max_samples = tasks.get("max_samples")
        self.batch_size = section.get("batch_size") or 8
        self.interval = eval_interval(cfg)
        self.stop_on_failure = cfg.mesh3d.eval_failure == "stop"
        logging = section.get("logging") or {}
        self.output = Path(logging.get("local_output_path") or run_dir / "evals")
        path = cfg.tokenizer.tokenizer_name_or_path if cfg.tokenizer else None
        if not path or not Path(path).exists():
            raise UserError(
                f"`lighteval` scores with the run's tokenizer, and tokenizer.tokenizer_name_or_path "
                f"{path!r} is not a local path: give a folder with tokenizer.json"
            )
        self.tokenizer = tokenizer_as_exported(Path(path), cfg.model.model_config)

    def _lm_eval(self, scorer: TrainingScorer, out: Path) -> dict[str, float]:
        """lm-eval's scores (on rank 0; {} elsewhere), its files written under `out`."""
        from lm_eval import simple_evaluate

        from mesh3d.evaluation.cli import write_results
        from mesh3d.evaluation.lm_eval_model import Mesh3dLM

        lm, scores = Mesh3dLM(scorer, self.tokenizer), {}
        for shots, tasks in self.groups.items():
            got = simple_evaluate(model=lm, tasks=tasks, num_fewshot=shots, limit=self.max_samples,
                                  task_manager=self.manager, log_samples=True,
                                  batch_size=self.batch_size)  # fmt: skip
            if got is not None:  # rank 0 (LOCAL_RANK 0)
                scores.update(_numbers(got))
                write_results(got, out)
        return scores

    def _lighteval(self, scorer: TrainingScorer, out: Path) -> dict[str, float]:
        """lighteval's scores (on rank 0; {} elsewhere), its files written under `out`."""
        from mesh3d.evaluation.lighteval_model import Mesh3dLightevalModel
        from mesh3d.evaluation.lighteval_run import run_lighteval

        model = Mesh3dLightevalModel(scorer, self.tokenizer)
        pipeline = run_lighteval(model, self.specs, self.configs, out, self.max_samples)
        return _numbers(pipeline.get_results()) if pipeline.is_main_process() else {}

    def due(self, step: int, last: bool) -> bool:
        return step % self.interval == 0 or last

    def after_save(self, run, step: int) -> dict[str, float]:
        """Score the model of the checkpoint just saved at `step`; the scores on every rank
        ({} when the evaluation failed and the run goes on)."""
        t0 = time.time()
        scores, error = {}, None
        try:
            with kept_random_state(run.device):
                score = self._lighteval if self.lighteval else self._lm_eval
                scores = score(TrainingScorer(run), self.output / str(step))
        except Exception as e:  # noqa: BLE001 - one line; the run trains on unless told to stop
            error = f"{type(e).__name__}: {e}".splitlines()[0]
        scores, error, took = share((scores, error, time.time() - t0))  # rank 0's, everywhere
        if error is not None:
            text = f"the evaluation of step {step} failed ({error})"
            if self.stop_on_failure:
                raise RunStopped(f"{text}; mesh3d.eval_failure: stop ended the run. The "
                                 f"checkpoint of step {step} is saved and untouched")  # fmt: skip
            logger.warning(f"{text}; training goes on (mesh3d.eval_failure: stop would end it)")
            return {}
        shown = " | ".join(f"{k.removeprefix('eval/')} {v:.4f}" for k, v in scores.items())
        logger.info(f"[Eval] step {step} ({took:.1f} s): {shown}")
        return {**scores, "eval_time_s": took}
