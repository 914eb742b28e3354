"""Domains of the training samples, for DoReMi (docs/doremi.md).

A domain is one source of a stage's blend: folder k of a Nanoset stage's `dataset_folder`, or
the dataset saved in `<hf_dataset_or_datasets>/<domain_names[k]>` (Nanotron's form,
`data/domain_datasets.py`), is domain k (`doremi.domain_names[k]`). The blend index already
says which source each global sample comes from (`BlendedSamples.sample_source`), so the domain of every sample of a step is known on
every rank from the step alone, with no extra column in the data and no collective: the same
global batch, the same domain ids, whatever the layout.

`write_synthetic_domains` writes a small corpus of domains of chosen difficulty (a fixed
repeated pattern is easy, uniform random tokens are hard) as datatrove folders, for the tests
and `recipes/doremi/`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from mesh3d.data.token_writer import TokenFileWriter
from mesh3d.errors import UserError


def check_domains(data) -> None:
    """Raise `UserError` unless every data stage of `data` (the run's `StagedData`) is a blend
    of the domains, whose index says each sample's domain."""
    for i, ds in enumerate(data.datasets):
        if not hasattr(ds, "sample_source"):
            raise UserError(
                f"DoReMi reads the domain of each sample from a blend of the domains; "
                f"{data.sources[i]} is not one: give the stage a dataset_folder with one folder "
                "per domain (tokenize each with `python -m mesh3d.data.tokenize`), or "
                "hf_dataset_or_datasets with one saved dataset per domain"
            )


def stage_domains(data, step: int) -> torch.Tensor:
    """[GBS] int64: the domain of each sample of step `step`'s global batch, in global order
    (dp rank r holds rows r·GBS/dp .. (r+1)·GBS/dp - 1). `data`: the run's `StagedData`,
    checked by `check_domains`."""
    i = data.stage_at(step)
    ds = data.datasets[i]
    local_step = step - max(data.starts[i], 1) + 1
    first = (local_step - 1) * data.gbs
    return torch.tensor([ds.sample_source(first + j)[0] for j in range(data.gbs)])


def write_synthetic_domains(root: str | Path, vocab_size: int, tokens: int = 40_000,
                            seed: int = 0) -> list[Path]:  # fmt: skip
    """Two datatrove folders under `root`, `easy` (one short pattern repeated: a model learns
    it in a few steps) and `hard` (uniform random tokens: nothing to learn), `tokens` tokens
    each in documents of 256; returns [easy, hard]."""
    rng = np.random.default_rng(seed)
    pattern = rng.integers(1, vocab_size, 7).tolist()
    docs = {
        "easy": [(pattern * 37)[:255] for _ in range(tokens // 256)],
        "hard": [rng.integers(1, vocab_size, 255).tolist() for _ in range(tokens // 256)],
    }
    out = []
    for name, documents in docs.items():
        folder = Path(root) / name
        folder.mkdir(parents=True, exist_ok=True)
        with TokenFileWriter(folder / "000_synthetic.ds", "synthetic", vocab_size, eos=0) as w:
            w.add(documents)
        out.append(folder)
    return out
