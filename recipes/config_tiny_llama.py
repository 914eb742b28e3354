"""Write a starter config like Nanotron's `examples/config_tiny_llama.py` does.

    python recipes/config_tiny_llama.py --output config_tiny_llama.yaml

Same tiny Llama (hidden 16, 2 layers, 4 heads, vocab 256, tied embeddings), optimizer and
2x2x2 layout as Nanotron's example. Differences: the data stages use dummy data
(`dataset: null`) instead of a Hugging Face dataset and no `checkpoints` section is written
(mesh3d has neither yet), and `batch_accumulation_per_replica` is 2, not 1, because
torch's 1F1B schedule needs at least as many microbatches as stages (Nanotron's needs pp-1).
"""

from __future__ import annotations

import argparse

from mesh3d.config import config_from_dict, save_config
from mesh3d.errors import exit_on_user_error
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


def tiny_llama_config() -> dict:
    """Nanotron's tiny-llama example as a plain dict of the Nanotron schema."""
    stage = lambda name, start: dict(  # noqa: E731
        name=name,
        start_training_step=start,
        data=dict(dataset=None, seed=42, num_loading_workers=1),
    )
    return dict(
        general=dict(project="debug", run="tiny_llama_%date_%jobid", seed=42),
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


@exit_on_user_error
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--output", default="config_tiny_llama.yaml", help="where to write the YAML")
    args = ap.parse_args(argv)
    d = tiny_llama_config()
    m = d["model"]["model_config"]
    h, f, v, L = m["hidden_size"], m["intermediate_size"], m["vocab_size"], m["num_hidden_layers"]
    print(f"Model has {human_format(v * h * 2 + L * (3 * h * f + 4 * h * h))} parameters")
    save_config(config_from_dict(d), args.output)
    print(f"Config written to {args.output}")


if __name__ == "__main__":
    main()
