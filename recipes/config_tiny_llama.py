"""Write a starter config like Nanotron's `examples/config_tiny_llama.py` does.

    python recipes/config_tiny_llama.py --output config_tiny_llama.yaml
    torchrun --nproc_per_node=8 recipes/train.py --config-file config_tiny_llama.yaml

Same tiny Llama (hidden 16, 2 layers, 4 heads, vocab 256, tied embeddings), optimizer, 2x2x2
layout and checkpoints (`checkpoints/`, every 10 steps) as Nanotron's example. Differences:

- data: the two data stages use dummy data (`dataset: null`) instead of a Hugging Face dataset
  from the Hub, so the config runs offline. By default the dummy tokens follow a next-token rule
  (`mesh3d.dummy_data: learnable`), so the loss falls, if slowly for this 12K-parameter model at
  Nanotron's learning rate (5.56 -> 5.51 over the 15 steps); `--dummy-data random` keeps
  Nanotron's uniform random tokens, on which the loss stays at ln(256) = 5.55 (nothing to
  learn). `recipes/configs/cpu_tiny.yaml` is the config whose loss visibly falls on CPU.
- the `mesh3d:` section that `learnable` writes is mesh3d's own: Nanotron's strict parser refuses
  it. With `--dummy-data random` no such section is written and the file loads in Nanotron too.
- `batch_accumulation_per_replica` is 2, not 1: torch's 1F1B schedule needs at least as many
  microbatches as stages (Nanotron's needs pp - 1).
- the parameter count printed is the number training logs as "Total number of parameters" (the
  vocabulary padded for tp, a tied embedding counted once), not the rough formula of Nanotron's
  script.

A second run in the same folder stops because `checkpoints/` holds checkpoints: resume it with
`checkpoints.resume_checkpoint_path=checkpoints` or start over with
`mesh3d.existing_checkpoints=overwrite` (dotted overrides after the config file).

An `--output` that cannot be written (empty, a folder, a path under a file, a place you cannot
write) stops with one `error:` line naming it, exit 2.
"""

from __future__ import annotations

import argparse

from mesh3d.config import config_from_dict, save_config
from mesh3d.errors import UserError, exit_on_user_error, unwritable
from mesh3d.plan import make_plan
from mesh3d.train.metrics import human_format

MODEL = dict(
    bos_token_id=1,
    eos_token_id=2,
    hidden_act="silu",
    hidden_size=16,
    initializer_range=0.02,
    intermediate_size=64,
    is_llama_config=True,
    max_position_embeddings=256,
    num_attention_heads=4,
    num_hidden_layers=2,
    num_key_value_heads=4,
    pad_token_id=None,
    pretraining_tp=1,
    rms_norm_eps=1e-05,
    rope_scaling=None,
    tie_word_embeddings=True,
    use_cache=True,
    vocab_size=256,
)


def tiny_llama_config(dummy_data: str = "learnable") -> dict:
    """Nanotron's tiny-llama example as a plain dict of the Nanotron schema; `dummy_data`
    "learnable" adds mesh3d's section that makes the dummy tokens learnable."""
    stage = lambda name, start: dict(  # noqa: E731
        name=name,
        start_training_step=start,
        data=dict(dataset=None, seed=42, num_loading_workers=1),
    )
    d = dict(
        general=dict(project="debug", run="tiny_llama_%date_%jobid", seed=42),
        checkpoints=dict(checkpoints_path="checkpoints", checkpoint_interval=10),
        model=dict(
            dtype="bfloat16",
            init_method=dict(std=0.025),
            make_vocab_size_divisible_by=1,
            model_config=MODEL,
        ),
        tokenizer=dict(tokenizer_name_or_path="robot-test/dummy-tokenizer-wordlevel"),
        optimizer=dict(
            zero_stage=0,
            weight_decay=0.01,
            clip_grad=1.0,
            accumulate_grad_in_fp32=True,
            learning_rate_scheduler=dict(
                learning_rate=3e-4,
                lr_warmup_steps=2,
                lr_warmup_style="linear",
                lr_decay_style="cosine",
                min_decay_lr=1e-5,
            ),
            optimizer_factory=dict(
                name="adamW",
                adam_eps=1e-08,
                adam_beta1=0.9,
                adam_beta2=0.95,
                torch_adam_is_fused=True,
            ),
        ),
        parallelism=dict(
            dp=2,
            pp=2,
            tp=2,
            pp_engine="1f1b",
            tp_mode="REDUCE_SCATTER",
            tp_linear_async_communication=True,
        ),
        tokens=dict(
            sequence_length=256,
            train_steps=15,
            micro_batch_size=2,
            batch_accumulation_per_replica=2,  # torch's 1F1B needs microbatches >= pp
        ),
        data_stages=[stage("Stable Training Stage", 1), stage("Annealing Phase", 10)],
    )
    if dummy_data != "random":
        d["mesh3d"] = dict(dummy_data=dummy_data)
    return d


@exit_on_user_error
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--output", default="config_tiny_llama.yaml", help="where to write the YAML")
    ap.add_argument(
        "--dummy-data",
        choices=("learnable", "random"),
        default="learnable",
        help="learnable (default): mesh3d's next-token rule, the loss falls; random: Nanotron's "
        "uniform tokens, no mesh3d: section",
    )
    args = ap.parse_args(argv)
    fix = "give a file path you can write, e.g. --output config_tiny_llama.yaml"
    if not args.output.strip():
        raise UserError(f"--output {args.output!r} is empty; {fix}")
    cfg = config_from_dict(tiny_llama_config(args.dummy_data))
    n = make_plan(cfg).total_params  # also validates the config at its 8 ranks
    try:
        save_config(cfg, args.output)
    except OSError as e:
        raise unwritable("--output", args.output, e, fix) from None
    print(f"Model has {human_format(n)} parameters ({n:,})")
    print(f"Config written to {args.output}")


if __name__ == "__main__":
    main()
