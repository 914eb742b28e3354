"""Make a small real-text dataset for CPU runs, offline: generated documents, a BPE tokenizer
trained on them, and a Nanoset folder written by `python -m mesh3d.data.tokenize`.

    python recipes/tiny_data.py [--output runs/tiny_data] [--documents 4000]
    torchrun --nproc_per_node=1 recipes/train.py --config-file recipes/configs/cpu_nanoset.yaml

Writes `<output>/tokenizer/tokenizer.json`, `<output>/text.jsonl` and `<output>/tokenized/`
(datatrove's `.ds` format), the paths `cpu_nanoset.yaml` points at.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from mesh3d.data.synthetic import make_documents, make_tokenizer
from mesh3d.data.tokenize import main as tokenize_main
from mesh3d.errors import UserError, exit_on_user_error, unwritable


@exit_on_user_error
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--output", default="runs/tiny_data")
    ap.add_argument("--documents", type=int, default=4000)
    args = ap.parse_args(argv)
    if args.documents < 1:
        raise UserError(f"--documents {args.documents} must be >= 1")
    out = Path(args.output)
    try:  # before anything is written
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise unwritable("--output", out, e) from None
    tokenizer = make_tokenizer(out / "tokenizer", vocab_size=512)
    text = out / "text.jsonl"
    with open(text, "w", encoding="utf-8") as f:
        for doc in make_documents(args.documents, seed=7):
            f.write(json.dumps({"text": doc}) + "\n")
    return tokenize_main(
        ["--tokenizer", str(tokenizer), "--input", str(text), "--output", str(out / "tokenized")]
    )


if __name__ == "__main__":
    raise SystemExit(main())
