"""Checks of the `doremi:` section (Nanotron's examples/doremi; docs/doremi.md).

`domain_names` and `domain_weights` load as Nanotron writes them, comma-separated strings
("Github, ArXiv"), or as YAML lists. The weights, when given, are one finite weight >= 0 per
domain summing to 1 (within 1e-3, Nanotron's tolerance). Each Nanoset stage has one folder
per domain, in the order of `domain_names`; a stage's own `dataset_weights`, when given beside
`domain_weights`, must be the same. A stage with `hf_dataset_or_datasets` is Nanotron's form,
one folder with one saved dataset per domain (`data/domain_datasets.py`): a single folder, not
streamed. Every token's loss is counted in its sample's domain, so the samples are dense
pretraining samples of a dense model: no SFT data, no document masking, no context
parallelism, no MoE (not supported yet). What needs the files (the reference checkpoint, the
domain folders, dummy data) is checked when the run starts (`train/doremi.py`, the data build).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from mesh3d.config.schema import (
    Config,
    DoReMiArgs,
    NanosetDatasetsArgs,
    PretrainDatasetsArgs,
    SFTDatasetsArgs,
)
from mesh3d.errors import not_supported_yet

SECTION = "doremi"


def domain_names(d: DoReMiArgs) -> list[str]:
    """The domain names as a list (a comma string split and stripped)."""
    names = d.domain_names.split(",") if isinstance(d.domain_names, str) else d.domain_names
    return [str(n).strip() for n in names]


def domain_weights(d: DoReMiArgs) -> list[float] | None:
    """The weights as floats (None: not given). Raises ValueError on a value that is not a
    number (`doremi_errors` reports it)."""
    w = d.domain_weights
    if w is None:
        return None
    items = w.split(",") if isinstance(w, str) else w
    return [float(str(x).strip()) for x in items]


def sampling_weights(cfg: Config) -> list[float] | None:
    """The domains' sampling weights: `domain_weights`, else uniform in a proxy run, else None
    (a Nanoset stage's own `dataset_weights`, else the domains' sample counts)."""
    weights = domain_weights(cfg.doremi)
    if weights is None and cfg.doremi.ref_model_resume_checkpoint_path is not None:
        k = len(domain_names(cfg.doremi))
        weights = [1.0 / k] * k
    return weights


def doremi_errors(cfg: Config) -> Iterator[str]:
    """Every problem of `cfg.doremi` as one message naming the key, the values and the fix."""
    d = cfg.doremi
    names = domain_names(d)
    if len(names) < 2 or any(not n for n in names):
        yield (f"`{SECTION}.domain_names` {names} must name 2 or more domains, none empty "
               "(e.g. 'Github, ArXiv' or a list), one per folder of the Nanoset stage")  # fmt: skip
    elif len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        yield f"`{SECTION}.domain_names` names {twice} more than once; give each domain once"
    try:
        weights = domain_weights(d)
    except ValueError:
        weights = None
        yield (f"`{SECTION}.domain_weights` {d.domain_weights!r} is not a list of numbers; "
               "give one weight per domain (e.g. '0.3, 0.7') or null")  # fmt: skip
    if weights is not None:
        yield from _weight_errors(weights, names)
    if not (math.isfinite(d.step_size) and d.step_size > 0):
        yield f"`{SECTION}.step_size` must be a finite number > 0 (Nanotron's is 1.0), got {d.step_size}"
    if not 0 <= d.smoothing_param <= 1:
        yield (f"`{SECTION}.smoothing_param` must be in [0, 1] (Nanotron's is 1e-3), "
               f"got {d.smoothing_param}")  # fmt: skip
    yield from _stage_errors(cfg, names, weights)
    yield from _run_errors(cfg)


def _weight_errors(weights: list[float], names: list[str]) -> Iterator[str]:
    key = f"`{SECTION}.domain_weights`"
    if len(weights) != len(names):
        yield (f"{key} has {len(weights)} values {weights} but domain_names has {len(names)} "
               f"domains {names}; give one weight per domain, in the same order")  # fmt: skip
    elif not all(math.isfinite(w) and w >= 0 for w in weights):
        yield f"{key} {weights} must be finite and >= 0"
    elif abs(sum(weights) - 1.0) > 1e-3:
        yield (f"{key} {weights} sum to {sum(weights):.6g}; they must sum to 1 (within 1e-3): "
               "divide each by their sum")  # fmt: skip


def _stage_errors(cfg: Config, names: list[str], weights: list[float] | None) -> Iterator[str]:
    for i, stage in enumerate(cfg.data_stages or []):
        ds, where = stage.data.dataset, f"data_stages[{i}] ({stage.name!r})"
        if isinstance(ds, SFTDatasetsArgs):
            yield (f"`{where}.data.dataset` is SFT data, which DoReMi does not weigh by domain; "
                   "use a Nanoset stage with one folder per domain")  # fmt: skip
        if isinstance(ds, PretrainDatasetsArgs):
            yield from _domain_dataset_errors(cfg, ds, where)
        if not isinstance(ds, NanosetDatasetsArgs):
            continue
        folders = ds.dataset_folder
        if len(folders) != len(names):
            yield (f"`{where}.data.dataset.dataset_folder` has {len(folders)} folders but "
                   f"`{SECTION}.domain_names` has {len(names)} domains {names}; give one folder "
                   "per domain, in the order of domain_names")  # fmt: skip
        elif weights is not None and ds.dataset_weights is not None:
            total = sum(ds.dataset_weights) or 1.0
            own = [w / total for w in ds.dataset_weights]
            if any(abs(a - b) > 1e-6 for a, b in zip(own, weights, strict=True)):
                yield (f"`{where}.data.dataset.dataset_weights` {ds.dataset_weights} differ from "
                       f"`{SECTION}.domain_weights` {weights}: the domain weights are the "
                       "sampling weights; drop dataset_weights")  # fmt: skip


def _domain_dataset_errors(cfg: Config, ds: PretrainDatasetsArgs, where: str) -> Iterator[str]:
    """A stage of Nanotron's DoReMi form: one folder, one saved dataset per domain under it."""
    if not isinstance(ds.hf_dataset_or_datasets, str):
        yield (f"`{where}.data.dataset.hf_dataset_or_datasets` is {ds.hf_dataset_or_datasets!r}; "
               f"with a `{SECTION}:` section it is one folder holding one dataset per domain "
               "(Nanotron's DoReMi form), named as in domain_names: give that folder")  # fmt: skip
    if cfg.mesh3d.hf_streaming:
        yield (f"`mesh3d.hf_streaming` streams text; `{where}` with a `{SECTION}:` section reads "
               "pre-tokenized domain datasets: set mesh3d.hf_streaming to false")  # fmt: skip


def _run_errors(cfg: Config) -> Iterator[str]:
    mc = cfg.model.model_config
    if getattr(mc, "_use_doc_masking", False):
        yield (f"`{SECTION}:` with document masking (model_config._use_doc_masking) is not "
               "supported by mesh3d yet: DoReMi compares dense token losses per domain; set "
               "_use_doc_masking to false")  # fmt: skip
    cp = cfg.parallelism.context_parallel_size
    if cp > 1:
        yield not_supported_yet("parallelism.context_parallel_size",
                                f"{cp} with a `{SECTION}:` section; set it to 1")  # fmt: skip
    if getattr(mc, "moe_config", None) is not None:
        yield not_supported_yet("model.model_config.moe_config",
                                f"with a `{SECTION}:` section; use a dense model")  # fmt: skip
