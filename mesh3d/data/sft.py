"""Supervised fine-tuning data: Nanotron's `SFTDatasetsArgs` (`hf_dataset_or_datasets` with
`sft_dataloader`), rows of `prompt` and `completion`.

Loading is the pretraining path's (`mesh3d.data.hf.load_rows`: local json/jsonl/parquet/arrow
files, folders, `save_to_disk` folders; a hub id fails with one line saying to download it).
`debug_max_samples` keeps the first N rows, before tokenization, as Nanotron does.

Each example, as Nanotron's `process_sft` builds it:

    ids        = tokenize(prompt + completion) + [EOS]     (the tokenizer's special tokens added)
    prompt_len = len(tokenize(prompt))
    ids        = ids[:S + 1]                                (truncation: the END is cut, so a
                                                             truncated example has no EOS)
    inputs     = ids[:-1]   targets = ids[1:]   positions = 0 .. len(ids) - 2
    a target trains (its label is kept) iff its index in `ids` is >= prompt_len: the loss is on
    the completion tokens and the EOS only.

An example whose prompt fills the S + 1 tokens has no completion token left: it is counted,
reported in one warning line and skipped (Nanotron filters these out too); a dataset where no
example is left is a `UserError`. Nothing divides by a zero count.

Sequences (`mesh3d.sft_packing`, default true): several examples share one sequence of S tokens,
greedily in (shuffled) order, a new sequence starting when the next example does not fit.
Positions restart at 0 for each example, and the model attends within a document (positions
restarting at 0 start one: `models/llama.py::attention_mask`), so examples never see each other.
Without packing each example is one sequence, as in Nanotron. The rest of a sequence is padding:
EOS ids, labels ignored, positions 0, 1, .. of their own segment (so nothing real attends to it).
Nanotron pads each map batch to its longest example on the left; mesh3d pads on the right to S,
which gives each example the same loss (causal attention never lets a real token see padding).
Token efficiency (real tokens / sequence tokens) is logged when the dataset is built.

Chat data (a `messages` column instead of prompt/completion): `mesh3d.data.chat` renders each
conversation with the tokenizer's chat template and trains the assistant turns
(`mesh3d.sft_assistant_turns`: all or last); packing, truncation and skipping are the same.

Samples: `ds[i]` -> (input_ids [S], label_ids [S], positions [S]) int64; sequence order is a
permutation per epoch from (seed, epoch), repeated when the run needs more sequences.

Validation (`tokens.val_check_interval`, `tokens.limit_val_batches` = L, on the first data
stage): the last L * GBS sequences of the packed set are held out (`held_sample(i)`) and never
trained on. The examples were shuffled (seed) before packing and an example lies in one sequence
only, so the held-out examples are a seeded random subset that training never sees; the
validation loss is the completion-only loss over them (`train/evaluate.py`: the sum of their
trained tokens' cross-entropies / their count). Too few sequences for both is a `UserError`.

The loss is normalized by the completion tokens of the whole global batch (all microbatches, all
dp ranks; `train/step.py::prepare_batches`), so every layout trains the same model. This weighs
every completion token equally: a long completion counts more than a short one, unlike averaging
each example's mean token loss (per-sample averaging), which weighs every example equally.
"""

from __future__ import annotations

import numpy as np
import torch

from mesh3d.data.documents import IGNORE
from mesh3d.data.sft_rows import check_text_column, text_of, undecodable
from mesh3d.errors import UserError
from mesh3d.log import logger

PROMPT, COMPLETION, MESSAGES = "prompt", "completion", "messages"


def check_columns(columns: list[str], where: str) -> None:
    """Raise `UserError` unless the rows have `prompt` and `completion` (or `messages`)."""
    if {PROMPT, COMPLETION} <= set(columns) or MESSAGES in columns:
        return
    raise UserError(
        f"{where}: SFT data needs columns 'prompt' and 'completion' (or 'messages'); the dataset "
        f"has {', '.join(map(repr, columns)) or 'no columns'}; rename its columns (e.g. "
        "`ds.rename_column(...)`) or use a pretraining dataset (text_column_name) instead"
    )


def encode_example(tokenizer, prompt: str, completion: str, eos: int, seq_len: int):
    """(ids truncated to S + 1, prompt length) of one example (see the module docstring)."""
    ids = tokenizer.encode(prompt + completion).ids + [eos]
    prompt_len = len(tokenizer.encode(prompt).ids)
    return ids[: seq_len + 1], prompt_len


def example_rows(ids: list[int], prompt_len: int | list[bool]) -> tuple[list, list, list]:
    """(inputs, labels, positions) of one encoded example: the label of target ids[k] is kept
    when k >= `prompt_len`, or when `prompt_len[k]` (a per-id trained flag, chat data)."""
    trained = prompt_len if isinstance(prompt_len, list) else None
    inputs, targets = ids[:-1], ids[1:]
    labels = [
        t if (trained[j + 1] if trained is not None else j + 1 >= prompt_len) else IGNORE
        for j, t in enumerate(targets)
    ]
    return inputs, labels, list(range(len(inputs)))


def pack(examples: list[tuple], seq_len: int, pad: int, packing: bool) -> np.ndarray:
    """[N, 3, S] int64 sequences: (inputs, labels, positions) of the examples, packed greedily
    in order (one per sequence without packing), the rest padding."""
    groups: list[list[tuple]] = []
    used = seq_len  # forces a first sequence
    for ex in examples:
        n = len(ex[0])
        if not packing or used + n > seq_len:
            groups.append([])
            used = 0
        groups[-1].append(ex)
        used += n
    out = np.empty((len(groups), 3, seq_len), dtype=np.int64)
    for g, group in enumerate(groups):
        inputs = [t for ex in group for t in ex[0]]
        labels = [t for ex in group for t in ex[1]]
        positions = [t for ex in group for t in ex[2]]
        rest = seq_len - len(inputs)
        out[g, 0] = inputs + [pad] * rest
        out[g, 1] = labels + [IGNORE] * rest
        out[g, 2] = positions + list(range(rest))
    return out


class SFTSequences:
    """Map-style: `ds[i]` -> (inputs [S], labels [S], positions [S]) for global sample i."""

    def __init__(self, sequences: np.ndarray, num_samples: int, seed: int, real_tokens: int,
                 held: int = 0):  # fmt: skip
        self.all_sequences = len(sequences)
        self.sequences = sequences[: len(sequences) - held]  # trained on
        self.held = sequences[len(sequences) - held :]  # validation only
        self.num_samples, self.seed = num_samples, seed
        self.epoch_len = len(self.sequences)
        self.real_tokens = real_tokens
        self._orders: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return self.num_samples

    @property
    def token_efficiency(self) -> float:
        """Real (non-padding) input tokens / sequence tokens."""
        return self.real_tokens / (self.all_sequences * self.sequences.shape[-1])

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            self._orders = {
                epoch: np.random.default_rng([self.seed, epoch]).permutation(self.epoch_len)
            }
        return self._orders[epoch]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        epoch, k = divmod(index, self.epoch_len)
        seq = torch.from_numpy(self.sequences[self._order(epoch)[k]])
        return seq[0], seq[1], seq[2]

    def held_sample(self, i: int) -> tuple[torch.Tensor, ...]:
        """Held-out sequence i: (inputs [S], labels [S], positions [S])."""
        seq = torch.from_numpy(self.held[i])
        return seq[0], seq[1], seq[2]


def _prompt_completion(rows, tokenizer, tokenizer_path: str, seq_len: int, where: str):
    """(encoded examples, has-a-target test, padding id) of prompt/completion rows."""
    from mesh3d.data.tokenizer import find_eos

    for column in (PROMPT, COMPLETION):
        check_text_column(rows, column, where)
    eos = find_eos(tokenizer)
    if eos is None:
        raise UserError(
            f"tokenizer {tokenizer_path!r} has no EOS token (</s>, <|endoftext|>, "
            "<|end_of_text|> or <eos>); SFT appends one to every example: use a tokenizer "
            "with one"
        )
    encoded = (
        encode_example(tokenizer, text_of(p, PROMPT, i, where), text_of(c, COMPLETION, i, where),
                       eos, seq_len)
        for i, (p, c) in enumerate(zip(rows[PROMPT], rows[COMPLETION], strict=True))
    )  # fmt: skip
    return encoded, lambda ids, prompt_len: prompt_len < len(ids), eos


def build_sequences(rows, tokenizer_path: str, seq_len: int, seed: int, packing: bool,
                    debug_max_samples: int | None, where: str, turns: str = "all"):  # fmt: skip
    """(sequences [N, 3, S], real tokens, examples kept, examples skipped) of SFT `rows`."""
    from mesh3d.data.tokenizer import load_tokenizer

    check_columns(rows.column_names, where)
    if debug_max_samples is not None:
        rows = rows.select(range(min(debug_max_samples, len(rows))))
    tokenizer = load_tokenizer(tokenizer_path)
    chat = not (PROMPT in rows.column_names and COMPLETION in rows.column_names)
    seen = [0]  # conversations with an assistant turn
    if chat:
        from mesh3d.data.chat import chat_examples

        encoded, has_target, eos = chat_examples(rows[MESSAGES], tokenizer, tokenizer_path,
                                                 seq_len, where, turns, seen)  # fmt: skip
    else:
        encoded, has_target, eos = _prompt_completion(rows, tokenizer, tokenizer_path, seq_len,
                                                      where)  # fmt: skip
    examples, skipped = [], 0
    try:
        for ids, trained in encoded:
            if has_target(ids, trained):
                examples.append(example_rows(ids, trained))
            else:
                skipped += 1
    except UnicodeDecodeError as e:
        raise undecodable(rows, where, e) from None
    if chat and not seen[0]:
        raise UserError(
            f"{where}: none of the {len(rows)} conversations has an assistant turn (a message "
            "with 'role': 'assistant'); SFT trains on the assistant turns: add them, or give "
            "'prompt' and 'completion' columns instead"
        )
    if skipped:
        logger.warning(
            f"{where}: {skipped} of {len(rows)} SFT examples have no completion (or assistant) "
            f"token within tokens.sequence_length + 1 = {seq_len + 1} tokens (the prompt fills "
            "the sequence, or a conversation has no assistant turn): skipped"
        )
    if not examples:
        raise UserError(
            f"{where}: none of the {len(rows)} SFT examples has a completion token within "
            f"tokens.sequence_length + 1 = {seq_len + 1} tokens; raise tokens.sequence_length or "
            "shorten the prompts"
        )
    order = np.random.default_rng([seed, 2**31]).permutation(len(examples))
    examples = [examples[i] for i in order]
    real = sum(len(ex[0]) for ex in examples)
    return pack(examples, seq_len, eos, packing), real, len(examples), skipped


def load_sft_dataset(args, tokenizer_path: str | None, seq_len: int, seed: int,
                     num_samples: int, vocab_size: int, *, packing: bool = True,
                     where: str = "hf_dataset_or_datasets", turns: str = "all",
                     cache_dir: str | None = None, held: int = 0,
                     global_batch: int = 1) -> SFTSequences:  # fmt: skip
    """The SFT samples of `args` (an `SFTDatasetsArgs`), the last `held` sequences held out for
    validation; see the module docstring."""
    from mesh3d.data.hf import check_tokenizer_vocab, load_rows

    if not tokenizer_path:
        raise UserError(
            "SFT data (hf_dataset_or_datasets) needs a tokenizer: set "
            "tokenizer.tokenizer_name_or_path to a local folder with tokenizer.json"
        )
    check_tokenizer_vocab(tokenizer_path, vocab_size)
    rows = load_rows(args, cache_dir)
    source = f"{where} hf_dataset_or_datasets {args.hf_dataset_or_datasets}"
    sequences, real, kept, _ = build_sequences(
        rows, tokenizer_path, seq_len, seed, packing, args.debug_max_samples, source, turns
    )
    left = max(len(sequences) - held, 0)
    if held and left < global_batch:
        raise UserError(
            f"{where}: validation (tokens.limit_val_batches) holds out {held} of the "
            f"{len(sequences)} SFT sequences ({kept} examples, "
            f"{'packed' if packing else 'one per sequence'}), leaving {left} to train on, fewer "
            f"than one global batch of {global_batch}; lower tokens.limit_val_batches or add "
            "examples"
        )
    ds = SFTSequences(sequences, num_samples, seed, real, held)
    logger.info(
        f"{where}: {kept} SFT examples in {len(sequences)} sequences of {seq_len} tokens "
        f"({'packed' if packing else 'one per sequence'}); token efficiency "
        f"{ds.token_efficiency:.1%} (real tokens / sequence tokens)"
        + (f"; the last {held} sequences held out for validation" if held else "")
    )
    return ds


def build_stage(s) -> SFTSequences:
    """An `sft_dataloader` stage (`data/build.py`'s `StageData` `s`); the first stage holds out
    `tokens.limit_val_batches` global batches for validation."""
    from mesh3d.data.nanoset import check_enough

    cfg, tok = s.cfg, s.cfg.tokens
    validating = s.index == 0 and tok.val_check_interval > 0 and tok.limit_val_batches > 0
    ds = load_sft_dataset(s.dataset, s.tokenizer(), s.seq, s.seed, s.num_samples, s.vocab_size,
                          packing=cfg.mesh3d.sft_packing, where=s.where,
                          turns=cfg.mesh3d.sft_assistant_turns, global_batch=s.gbs,
                          held=tok.limit_val_batches * s.gbs if validating else 0)  # fmt: skip
    check_enough(ds.epoch_len, s.gbs, f"{s.where} hf_dataset_or_datasets")
    return ds
