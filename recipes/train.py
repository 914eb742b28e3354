"""Train a Llama from a Nanotron YAML config, on CPU or GPU, at any dp x tp x pp layout.

    torchrun --nproc_per_node=1 recipes/train.py                       # CPU default config
    torchrun --nproc_per_node=8 recipes/train.py --config-file cfg.yaml parallelism.dp=2 ...

Dotted overrides after the options change any config key (typed like the YAML). User mistakes
print one `error: ...` line and exit with code 2 on every rank, before any collective. A run that
stops early exits with its own code (3 non-finite, 4 a rank or the launcher gone, 5 a checkpoint
that could not be written, 75 preempted and saved): see the README, "When things go wrong".
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch.distributed as dist

from mesh3d.config import load_config
from mesh3d.errors import PeerError, exit_on_user_error
from mesh3d.train.loop import train

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "cpu_tiny.yaml"


@exit_on_user_error
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--config-file",
        "--config",
        default=str(DEFAULT_CONFIG),
        help=f"Nanotron YAML config (default: {DEFAULT_CONFIG.name}, CPU-sized)",
    )
    ap.add_argument("--metrics-file", help="append one JSON object per logged iteration here")
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. parallelism.dp=2")
    args = ap.parse_args(argv)
    cfg = load_config(args.config_file, args.overrides)
    peers_gone = False
    try:
        train(cfg, metrics_file=args.metrics_file)
    except PeerError:
        peers_gone = True  # tearing down a group whose peers are gone can hang: just exit
        raise
    finally:
        if dist.is_initialized() and not peers_gone:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
