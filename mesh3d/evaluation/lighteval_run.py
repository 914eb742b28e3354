"""One lighteval evaluation of a model: lighteval's own `Pipeline` (documents, few-shot
examples, metrics, `EvaluationTracker`) on the tasks `lighteval_tasks.py` selected.

Every rank runs the pipeline alike (each batch of requests one collective forward); global
rank 0 alone computes the metrics and writes lighteval's files under the output folder:
`results/<model>/results_<time>.json` and `details/<model>/<time>/details_<task>_<time>.parquet`
(each sample's prompt, choices, log-likelihoods or generated text, and metrics). No sample
cache is used, for mesh3d's model or lighteval's own.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

# importing lighteval's pipeline imports its transformers backend, which turns autograd off for
# the whole process (`torch.set_grad_enabled(False)` at import): kept as it was, so a run that
# evaluates in the run trains on
with torch.set_grad_enabled(torch.is_grad_enabled()):
    from lighteval.logging.evaluation_tracker import EvaluationTracker
    from lighteval.pipeline import ParallelismManager, Pipeline, PipelineParameters

from mesh3d.evaluation.lighteval_tasks import make_registry


class _NoCache:
    """What lighteval's `Pipeline` asks of a model's sample cache while it starts."""

    def _init_registry(self, registry) -> None:
        return None


class _Pipeline(Pipeline):
    """lighteval's pipeline on a registry of the selected tasks, rank 0 as its main process."""

    def __init__(self, registry, **kwargs):
        self._selected = registry
        super().__init__(**kwargs)

    def _init_tasks_and_requests(self, tasks: str):
        import lighteval.pipeline as pipeline

        # the base method builds `Registry(...)`, which imports every built-in task
        original = pipeline.Registry
        pipeline.Registry = lambda **_: self._selected
        try:
            super()._init_tasks_and_requests(tasks)
        finally:
            pipeline.Registry = original

    def is_main_process(self) -> bool:
        return os.environ.get("RANK", "0") == "0"


def run_lighteval(model, specs: list[tuple[str, int]], configs: dict, output_dir: Path | None,
                  max_samples: int | None) -> Pipeline:  # fmt: skip
    """The pipeline that scored `specs` ([(task, few-shot count)]) on `model` (a
    `LightevalModel`); its files saved under `output_dir` on rank 0 (not when None)."""
    with torch.set_grad_enabled(torch.is_grad_enabled()):  # as it was, whatever lighteval does
        return _run(model, specs, configs, output_dir, max_samples)


def _run(model, specs, configs, output_dir, max_samples) -> Pipeline:
    tracker = EvaluationTracker(output_dir=str(output_dir or "."), save_details=True)
    params = PipelineParameters(launcher_type=ParallelismManager.CUSTOM, max_samples=max_samples)
    tasks = ",".join(f"{name}|{shots}" for name, shots in specs)
    # no sample cache: lighteval's backends keep one under ~/.cache keyed by the model's name and
    # config, so a later checkpoint at the same path would get an earlier one's answers
    model._cache = _NoCache()  # what the pipeline's start asks for; None: its models cache nothing
    pipeline = _Pipeline(make_registry(specs, configs), tasks=tasks, pipeline_parameters=params,
                         evaluation_tracker=tracker, model=model)  # fmt: skip
    model._cache = None
    pipeline.evaluate()
    if output_dir is not None:
        pipeline.save_and_push_results()
    return pipeline
