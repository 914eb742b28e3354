"""DoReMi's proxy step against a plain step of the same model (issue 49's measure): the proxy
runs the frozen reference and itself forward once more before its usual step.

    python benchmarks/doremi.py            # ~2 min on 2 cores
    python benchmarks/doremi.py --quick

The recipe's two synthetic domains (`recipes/doremi/run.py`) and its config, widened to hidden
256, 4 layers, 8 x 128-token sequences a step, one process, one thread. The reference run (an
ordinary run: bitwise the same as without the `doremi:` section) and the proxy (against that
reference) each train `--steps` steps, alternated `--repeats` times; each reports the median of
rank 0's `elapsed_time_per_iteration_ms` over steps 3 on, and the ratio proxy / plain per
repetition.
Results: benchmarks/results/local/doremi[_quick].json (`--publish`: benchmarks/results/).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from _results import add_publish_flag, print_header, results_dir

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "recipes" / "doremi"))
from run import NAMES, VOCAB, config  # noqa: E402

from mesh3d.config import config_from_dict  # noqa: E402
from mesh3d.data.domains import write_synthetic_domains  # noqa: E402
from mesh3d.train.loop import train  # noqa: E402

WIDE = dict(hidden_size=256, intermediate_size=688, num_attention_heads=8, num_key_value_heads=4,
            num_hidden_layers=4, max_position_embeddings=128)  # fmt: skip


def _config(out: Path, folders, name: str, steps: int, doremi: dict):
    d = config(out, folders, name, steps, doremi)
    d["model"]["model_config"].update(WIDE)
    d["tokens"].update(sequence_length=128, micro_batch_size=4, batch_accumulation_per_replica=2)
    return config_from_dict(d)


def _median_ms(result) -> float:
    return statistics.median(m["elapsed_time_per_iteration_ms"] for m in result.metrics[2:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps, one repetition")
    add_publish_flag(ap)
    a = ap.parse_args()
    head = print_header()
    steps, repeats = (6, 1) if a.quick else (12, 3)
    torch.set_num_threads(1)
    names = ", ".join(NAMES)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        folders = write_synthetic_domains(out / "data", VOCAB, tokens=200_000)
        for r in range(repeats):
            plain = train(_config(out, folders, "reference", steps, dict(domain_names=names)))
            proxy_section = dict(domain_names=names,
                                 ref_model_resume_checkpoint_path=str(out / "reference"))  # fmt: skip
            proxy = train(_config(out, folders, "proxy", steps, proxy_section))
            p, q = _median_ms(plain), _median_ms(proxy)
            rows.append({"plain_ms": p, "proxy_ms": q, "ratio": q / p})
            print(f"repetition {r + 1}: plain step {p:.1f} ms | proxy step {q:.1f} ms | "
                  f"proxy / plain {q / p:.3f}", flush=True)  # fmt: skip
    ratio = statistics.median(x["ratio"] for x in rows)
    print(f"proxy step / plain step (median of {repeats}): {ratio:.3f} "
          "(FLOPs: about 5/3, two extra forwards)")  # fmt: skip
    path = results_dir(a.publish) / f"doremi{'_quick' if a.quick else ''}.json"
    path.write_text(json.dumps({**head, "repetitions": rows, "ratio": ratio}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
