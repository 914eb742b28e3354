"""The training data of a config: one dataset per data stage, and the batches of each step.

Every stage's dataset is built (and so checked) before training starts, on every rank. Step s
reads the active stage's global batch k = s - start + 1, samples [(k-1)*GBS, k*GBS), each dp rank
its contiguous slice: the samples depend only on the step, so a resume at any dp is exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mesh3d import extensions
from mesh3d.config import global_batch_size, stage_sequence_length
from mesh3d.config.schema import NanosetDatasetsArgs, PretrainDatasetsArgs, SFTDatasetsArgs
from mesh3d.data.dummy import DummyTokens, microbatches
from mesh3d.data.stages import consumed_in_stage, stage_index_at
from mesh3d.errors import UserError
from mesh3d.log import logger


def _stage_steps(starts: list[int], index: int, train_steps: int) -> int:
    end = starts[index + 1] - 1 if index + 1 < len(starts) else train_steps
    return max(end - max(starts[index], 1) + 1, 1)


@dataclass(frozen=True)
class StageData:
    """What the builder of a data stage's dataset gets (`num_samples`: the stage's steps x GBS)."""

    cfg: object
    index: int
    dataset: object
    seq: int
    seed: int
    num_samples: int
    gbs: int
    where: str

    @property
    def vocab_size(self) -> int:
        return self.cfg.model.model_config.vocab_size

    def tokenizer(self, required: bool = True) -> str | None:
        """The local tokenizer path; a hub id fails when `required` (the data is tokenized with
        it), else is skipped with a warning (it would only check the vocabulary size)."""
        tok = self.cfg.tokenizer.tokenizer_name_or_path if self.cfg.tokenizer else None
        if tok and not Path(tok).exists():
            if not required:
                logger.warning(
                    f"tokenizer {tok!r} is not a local path: its vocabulary size is not checked"
                )
                return None
            raise UserError(
                f"`tokenizer.tokenizer_name_or_path` {tok!r} is not a local file or folder; mesh3d "
                "runs offline: download the tokenizer first and give its path"
            )
        return tok


def build_dataset(cfg, index: int):
    """The dataset of `data_stages[index]` (dummy tokens when there are no stages)."""
    mc, tok = cfg.model.model_config, cfg.tokens
    stages = cfg.data_stages or []
    if not stages:
        return DummyTokens(
            mc.vocab_size, tok.sequence_length, cfg.general.seed, cfg.mesh3d.dummy_data
        )
    stage, starts = stages[index], [s.start_training_step for s in stages]
    data, gbs, seq = stage.data, global_batch_size(cfg), stage_sequence_length(cfg, stage)
    seed = data.seed if data.seed is not None else 42
    if data.dataset is None:
        return DummyTokens(mc.vocab_size, seq, seed, cfg.mesh3d.dummy_data)
    request = StageData(cfg, index, data.dataset, seq, seed,
                        _stage_steps(starts, index, tok.train_steps) * gbs, gbs,
                        f"data_stages[{index}] ({stage.name!r})")  # fmt: skip
    if isinstance(data.dataset, NanosetDatasetsArgs):
        return _nanoset(request)
    return extensions.load(_builder(cfg, data.dataset, request.where)).build_stage(request)


def _builder(cfg, dataset, where: str) -> str:
    """The capability that builds a stage's `dataset` (`mesh3d/extensions.py`)."""
    if isinstance(dataset, PretrainDatasetsArgs):  # Hugging Face datasets
        if cfg.doremi is not None:  # Nanotron's DoReMi data, one dataset per domain
            return "doremi_datasets"
        return "streaming" if cfg.mesh3d.hf_streaming else "hf_datasets"
    if isinstance(dataset, SFTDatasetsArgs):
        return "sft"
    raise UserError(
        f"`{where}.data.dataset` of type {type(dataset).__name__} is not supported by mesh3d yet"
    )


def _nanoset(s: StageData):
    """A Nanoset stage: Nanotron's tokenized folders (`dataset_folder`), blended."""
    from mesh3d.data.nanoset import Nanoset, check_enough
    from mesh3d.data.tokenizer import check_tokenizer_vocab

    tokenizer, d = s.tokenizer(required=False), s.dataset
    if tokenizer:
        check_tokenizer_vocab(tokenizer, s.vocab_size)
    ds = Nanoset(d.dataset_folder, d.dataset_weights, s.seq, s.num_samples, s.seed,
                 s.vocab_size, token_size_in_bytes=d.token_size_in_bytes,
                 read_paths=d.dataset_read_path, max_tokens=d.dataset_max_tokens)  # fmt: skip
    check_enough(ds.epoch_len, s.gbs, f"{s.where} dataset_folder {d.dataset_folder}")
    return ds


def _files(dataset) -> str:
    """What a stage reads, for error messages."""
    if dataset is None:
        return "dummy data"
    if isinstance(dataset, NanosetDatasetsArgs):
        return f"dataset_folder {dataset.dataset_folder}"
    return f"hf_dataset_or_datasets {dataset.hf_dataset_or_datasets}"


class StagedData:
    """Every stage's dataset, built up front; `batches(step, ...)` gives a rank's microbatches."""

    def __init__(self, cfg):
        stages = cfg.data_stages or []
        self.names = [s.name for s in stages] or ["dummy"]
        self.starts = [s.start_training_step for s in stages] or [1]
        self.lengths = [stage_sequence_length(cfg, s) for s in stages] or [cfg.tokens.sequence_length]  # fmt: skip
        self.gbs = global_batch_size(cfg)
        self.train_steps = cfg.tokens.train_steps
        self.datasets = [build_dataset(cfg, i) for i in range(len(self.starts))]
        self.workers = [0 if s.data.dataset is None else s.data.num_loading_workers
                        for s in stages] or [0]  # fmt: skip
        self.sources = [f"data_stages[{i}] ({s.name!r}): {_files(s.data.dataset)}"
                        for i, s in enumerate(stages)] or ["dummy data"]  # fmt: skip
        self._logged: int | None = None
        self.resumed: tuple[int, int] | None = None  # (step, samples) of the checkpoint
        from mesh3d.data.validation import held_out

        # samples each stage trains on (a stage that never starts: one batch, to be safe)
        reads = [_stage_steps(self.starts, i, self.train_steps) * self.gbs
                 for i in range(len(self.starts))]  # fmt: skip
        self.validation = held_out(cfg, self.datasets, reads)  # None unless the run evaluates

    def stage_at(self, step: int) -> int:
        return stage_index_at(self.starts, step)

    def sequence_length_at(self, step: int) -> int:
        """The sequence length of the stage active at `step`."""
        return self.lengths[self.stage_at(step)]

    def tokens_through(self, step: int, global_batch: int) -> int:
        """Tokens of steps 1..`step` at `global_batch` samples a step, each at its stage's length."""
        ends = [*(s - 1 for s in self.starts[1:]), step]
        return sum(
            max(min(step, end) - max(begin, 1) + 1, 0) * global_batch * length
            for begin, end, length in zip(self.starts, ends, self.lengths, strict=True)
        )

    def batches(self, step: int, dp_rank: int, dp: int, micro_batch_size: int) -> list:
        """This dp rank's microbatches of `step` from the stage active at it."""
        self.log_stage(step)
        return self.read(step, dp_rank, dp, micro_batch_size)

    def read(self, step: int, dp_rank: int, dp: int, micro_batch_size: int) -> list:
        """`batches` without the log line (what a loader worker calls)."""
        i = self.stage_at(step)
        local_step = step - max(self.starts[i], 1) + 1
        return microbatches(self.datasets[i], local_step, self.gbs, dp_rank, dp, micro_batch_size)

    def log_stage(self, step: int) -> None:
        """Log the stage plan line when `step` enters another stage than the last logged."""
        i = self.stage_at(step)
        if i != self._logged:
            self._logged = i
            remaining = min(self.last_step(i), self.train_steps) - step + 1  # a run may end first
            logger.info(
                f"[Training Plan] Stage {self.names[i]} has {remaining} remaining training steps "
                f"and has consumed {consumed_in_stage(self.starts, step, self.gbs, self.resumed)} samples"
            )

    def last_step(self, index: int) -> int:
        """The last step of stage `index` (tokens.train_steps for the last stage)."""
        return self.starts[index + 1] - 1 if index + 1 < len(self.starts) else self.train_steps
