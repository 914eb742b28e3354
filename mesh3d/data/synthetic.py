"""Generated text and a small BPE tokenizer trained on it, for examples and tests (no download).

`make_documents` is deterministic for a seed: English-like sentences over a generated lexicon.
`make_tokenizer` trains a byte-level BPE on such documents (specials `<unk>`, `<s>`, `</s>`) and
saves it as `tokenizer.json`, which `python -m mesh3d.data.tokenize` and the configs accept.
"""

from __future__ import annotations

import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

_ONSETS = ["b", "c", "d", "f", "g", "h", "l", "m", "n", "p", "r", "s", "t", "w", "th", "st", "br"]
_VOWELS = ["a", "e", "i", "o", "u", "ea", "ou", "ai"]
_CODAS = ["", "", "n", "r", "s", "t", "ng", "ck", "ll"]
_COMMON = ["the", "of", "and", "to", "in", "is", "that", "it", "was", "for", "on", "with", "as"]


def _lexicon(rng: random.Random, size: int = 400) -> list[str]:
    words = set()
    while len(words) < size:
        syllables = rng.choice((1, 1, 2, 2, 3))
        words.add(
            "".join(
                rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
                for _ in range(syllables)
            )
        )
    return sorted(words)


def make_documents(n: int = 300, seed: int = 0) -> list[str]:
    """`n` documents of 1-6 sentences of generated words, the same for the same seed."""
    rng = random.Random(seed)
    words = _lexicon(rng)
    docs = []
    for _ in range(n):
        sentences = []
        for _ in range(rng.randint(1, 6)):
            sent = [
                rng.choice(_COMMON) if rng.random() < 0.3 else rng.choice(words)
                for _ in range(rng.randint(4, 14))
            ]
            sentences.append(" ".join(sent).capitalize() + rng.choice((".", ".", ".", "?", "!")))
        docs.append(" ".join(sentences))
    return docs


def train_bpe(texts, folder: str | Path, vocab_size: int) -> Path:
    """A byte-level BPE (specials `<unk>`, `<s>`, `</s>`) trained on `texts`; saved as
    `folder/tokenizer.json`, whose path is returned."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    path = Path(folder) / "tokenizer.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


def make_tokenizer(folder: str | Path, vocab_size: int = 800, seed: int = 0) -> Path:
    """Train a byte-level BPE on generated text; save `folder/tokenizer.json` and return it."""
    return train_bpe(make_documents(1000, seed=seed + 1), folder, vocab_size)
