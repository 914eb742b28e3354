"""DoReMi's three runs at toy size on one CPU process (docs/doremi.md), in about ten seconds.

    python recipes/doremi/run.py [--output runs/doremi]

Writes two synthetic domains (`easy`: one short pattern repeated; `hard`: uniform random
tokens), then trains (1) a reference model on both, sampled uniformly; (2) a proxy from scratch
against it, printing its domain weights step by step; (3) a final model sampled by the proxy's
average weights, printing the `doremi:` section it used. The proxy's metrics file
(`runs/doremi/proxy/metrics.jsonl`) is what `mesh3d plot` draws, its domain weights in a panel
of their own. Each run is an ordinary `mesh3d.train`
of one config with a `doremi:` section, as the three `mesh3d train` commands of docs/doremi.md.

Each run starts over (`mesh3d.existing_checkpoints=overwrite`), deleting the step folders of the
run before it, so `--output` must be a new or empty folder, or one this script made (it writes
`.doremi-run` in it): a folder of your own checkpoints (`--output checkpoints`) is refused, exit
2. Stopped by Ctrl-C, it says so in one line (exit 75, or 130 for a second Ctrl-C); it cannot
resume: run it again, and it starts its three runs over.
"""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

import torch
import yaml

from mesh3d.config import config_from_dict
from mesh3d.data.domains import write_synthetic_domains
from mesh3d.errors import Preempted, RunStopped, UserError, exit_on_user_error, unwritable
from mesh3d.train.doremi import average_weights, weights_yaml
from mesh3d.train.loop import train

VOCAB = 256
NAMES = ["easy", "hard"]
MARKER = ".doremi-run"  # written in the --output folder this script made: it may overwrite it


def config(out: Path, folders: list[Path], name: str, steps: int, doremi: dict) -> dict:
    """A ~0.2M-parameter Llama on the two domains (fp32, one process)."""
    return dict(
        general=dict(project="doremi", run=name, seed=7),
        logging=dict(log_level="warning", log_level_replica="warning"),
        model=dict(dtype="float32", init_method=dict(std=0.05), model_config=dict(
            hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            num_hidden_layers=2, max_position_embeddings=32, vocab_size=VOCAB,
            is_llama_config=True, tie_word_embeddings=False)),
        optimizer=dict(zero_stage=0, weight_decay=0.01, clip_grad=1.0,
                       accumulate_grad_in_fp32=True,
                       learning_rate_scheduler=dict(learning_rate=3e-3, lr_warmup_steps=1,
                                                    lr_warmup_style="linear"),
                       optimizer_factory=dict(name="adamW", adam_beta1=0.9, adam_beta2=0.95,
                                              adam_eps=1e-8, torch_adam_is_fused=False)),
        parallelism=dict(dp=1, tp=1, pp=1),
        tokens=dict(sequence_length=16, train_steps=steps, micro_batch_size=4,
                    batch_accumulation_per_replica=2),
        data_stages=[dict(name="domains", start_training_step=1, data=dict(
            dataset=dict(dataset_folder=[str(f) for f in folders]), seed=3,
            num_loading_workers=0))],
        checkpoints=dict(checkpoints_path=str(out / name), checkpoint_interval=steps),
        doremi=doremi,
        mesh3d=dict(device="cpu", existing_checkpoints="overwrite"),
    )  # fmt: skip


def loss_span(result) -> str:
    """ "loss <first step's> -> <last step's>" of a run's result."""
    return f"loss {result.metrics[0]['lm_loss']:.3f} -> {result.metrics[-1]['lm_loss']:.3f}"


def output_folder(output: str) -> Path:
    """The --output folder, made and marked: refused (`UserError`, before anything is written)
    when it is empty, not a folder we can write, or a non-empty folder this script did not make
    (its runs overwrite the step folders of `<output>/reference`, `proxy` and `final`)."""
    if not output.strip():
        raise UserError(
            f"--output {output!r} is empty: it would write into the current folder; give a "
            "new folder, e.g. --output runs/doremi"
        )
    out = Path(output)
    if out.is_dir() and not (out / MARKER).is_file() and any(out.iterdir()):
        raise UserError(
            f"--output {output}: the folder holds files this script did not write (no {MARKER} "
            "in it), and its runs would overwrite checkpoints there; give a new or empty folder, "
            "e.g. --output runs/doremi"
        )
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / MARKER).write_text("made by recipes/doremi/run.py, which may overwrite it\n")
    except OSError as e:
        raise unwritable("--output", output, e) from None
    return out


def stopped(error: RunStopped, run: str, output: str) -> RunStopped:
    """`error` (a stop of the `run` run), its advice made this script's: it cannot resume, so
    running it again starts over. The same class, so the same exit code (75 for `Preempted`)."""
    message = str(error)
    if isinstance(error, Preempted):  # its advice, `mesh3d.existing_checkpoints=resume`, is
        message = message.split(". To continue")[0].split(". Launch the same")[0]  # the CLI's
    again = f"python recipes/doremi/run.py --output {shlex.quote(output)}"
    error.args = (f"the {run} run: {message}; this script cannot resume: run `{again}` again "
                  "to start its three runs over",)  # fmt: skip
    return error


@exit_on_user_error
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--output",
        default="runs/doremi",
        help=f"folder for data and runs: new, empty or made by this script (it has {MARKER})",
    )
    output = parser.parse_args(argv).output
    out = output_folder(output)
    torch.set_num_threads(1)
    folders = write_synthetic_domains(out / "data", VOCAB, tokens=20_000)
    names = ", ".join(NAMES)
    run = "reference"
    try:
        ref = train(
            config_from_dict(config(out, folders, "reference", 8, dict(domain_names=names)))
        )
        print(f"1. reference: {loss_span(ref)}")

        run = "proxy"
        proxy_doremi = dict(
            domain_names=names, ref_model_resume_checkpoint_path=str(out / "reference")
        )
        metrics = out / "proxy" / "metrics.jsonl"  # `mesh3d plot` draws its domain weights
        proxy = train(
            config_from_dict(config(out, folders, "proxy", 10, proxy_doremi)), str(metrics)
        )
        print("2. proxy: domain weights per step")
        print("   step  " + "  ".join(f"{n:>8}" for n in NAMES))
        for m in proxy.metrics:
            weights = "  ".join(f"{m[f'doremi/weight/{n}']:8.5f}" for n in NAMES)
            print(f"   {m['iteration']:4d}  {weights}")

        section = weights_yaml(*average_weights(str(out / "proxy")))
        print("3. final run with the proxy's average weights:\n" + section, end="")
        run = "final"
        final_doremi = yaml.safe_load(section)["doremi"]
        final = train(config_from_dict(config(out, folders, "final", 8, final_doremi)))
        print(f"   final: {loss_span(final)}")
        print(f"the proxy's curves, its domain weights included: mesh3d plot {metrics}")
    except RunStopped as e:  # Ctrl-C (Preempted, exit 75), a non-finite loss, ...
        raise stopped(e, run, output) from None


if __name__ == "__main__":
    main()
