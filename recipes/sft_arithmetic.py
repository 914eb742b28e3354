"""An SFT starter, offline: a tiny Llama learns addition (a + b with a, b < 20) from
prompt/completion examples; the summary shows its exact-match accuracy on held-out problems
(pairs it never trained on) before and after.

    python recipes/sft_arithmetic.py [--output runs/sft_arithmetic] [--steps 150] [--held-out 50]
    python recipes/sft_arithmetic.py --eval-every 30     # + a score curve (pip install 'mesh3d[eval]')

Writes `<output>/train.jsonl` (rows {"prompt": "12+7=", "completion": "19"}),
`<output>/tokenizer/tokenizer.json` (a BPE trained on such text: digits, '+', '=', `</s>`),
and trains one process through `mesh3d.train` on an SFT data stage (`sft_dataloader: true`,
packing on), saving the initial and the final weights under `<output>/checkpoints/`. Each is
then loaded as `mesh3d generate` loads a checkpoint and asked the held-out prompts (greedy, KV
cache): a problem counts when the generated text up to EOS is exactly the answer. It prints
each phase, the loss every tenth of the steps, and at the end the final checkpoint's path.

With `--eval-every N` the run also has a `lighteval:` section: the held-out problems become a
local lm-eval multiple-choice task (`<output>/tasks/arith_mc.yaml`: the right sum among three
wrong ones) scored inside the run after every N-th step's checkpoint; the scores go to
`<output>/metrics.jsonl` and the plot `<output>/metrics.png` draws their curve.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
from pathlib import Path

import torch

from mesh3d.config import config_from_dict
from mesh3d.data.synthetic import train_bpe
from mesh3d.data.tokenize import load_tokenizer
from mesh3d.errors import UserError, exit_on_user_error, unwritable
from mesh3d.generation.load import load_model
from mesh3d.generation.sampling import generate
from mesh3d.train.loop import train

MODEL = dict(hidden_size=128, intermediate_size=384, num_attention_heads=4,
             num_key_value_heads=4, num_hidden_layers=3, max_position_embeddings=32,
             vocab_size=320, rms_norm_eps=1e-5, tie_word_embeddings=True, is_llama_config=True,
             eos_token_id=2)  # fmt: skip

CONFIG = dict(
    general=dict(project="sft", run="arithmetic", seed=1),
    logging=dict(log_level="warning", log_level_replica="warning"),
    model=dict(
        dtype="float32",
        init_method=dict(std=0.02),
        make_vocab_size_divisible_by=1,
        model_config=MODEL,
    ),  # fmt: skip
    optimizer=dict(
        zero_stage=0,
        weight_decay=0.0,
        clip_grad=1.0,
        accumulate_grad_in_fp32=True,
        learning_rate_scheduler=dict(
            learning_rate=3e-3,
            lr_warmup_steps=20,
            lr_warmup_style="linear",
            lr_decay_style="cosine",
            min_decay_lr=3e-4,
        ),  # fmt: skip
        optimizer_factory=dict(
            name="adamW", adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, torch_adam_is_fused=False
        ),  # fmt: skip
    ),
    parallelism=dict(dp=1, tp=1, pp=1),
    tokens=dict(sequence_length=32, micro_batch_size=16, batch_accumulation_per_replica=1),
    mesh3d=dict(device="cpu", sft_packing=True),
)


HELD_OUT_MAX = 200  # of 400 problems, drawn with repeats: about 240 are left to train on


def problems(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(0, 19), rng.randint(0, 19)
        out.append({"prompt": f"{a}+{b}=", "completion": str(a + b)})
    return out


def exact_match(step: Path, tokenizer, held: list[dict]) -> int:
    """Held-out problems whose greedy answer (up to EOS, at most 4 tokens) is exactly right."""
    model, mc = load_model(step, torch.device("cpu"))
    right = 0
    for p in held:
        ids = tokenizer.encode(p["prompt"]).ids
        out = generate(model, torch.tensor(ids), 4, eos=mc.eos_token_id)[len(ids) :].tolist()
        if mc.eos_token_id in out:
            out = out[: out.index(mc.eos_token_id)]
        right += tokenizer.decode(out) == p["completion"]
    return right


class Progress:
    """A `train` hook printing the loss every `every` steps (the run's own log is at warning)."""

    def __init__(self, steps: int, every: int):
        self.steps, self.every = steps, every

    def on_step(self, run, step: int, out, metrics: dict) -> None:
        if step % self.every == 0 or step in (1, self.steps):
            print(f"  step {step:>4} / {self.steps}   loss {metrics['lm_loss']:.3f}", flush=True)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--output", default="runs/sft_arithmetic",
                    help="folder for train.jsonl, tokenizer/ and checkpoints/ "
                    "(default: runs/sft_arithmetic, relative to the current folder)")  # fmt: skip
    ap.add_argument("--steps", type=int, default=150,
                    help="training steps of 16 packed sequences each (default 150: 1-3 minutes "
                    "on 2 CPU cores)")  # fmt: skip
    ap.add_argument("--held-out", type=int, default=50,
                    help="problems kept out of training, asked before and after to measure "
                    "exact-match accuracy (default 50, at most 200)")  # fmt: skip
    ap.add_argument("--eval-every", type=int,
                    help="also score the held-out problems as a multiple-choice lm-eval task "
                    "inside the run every N steps (a divisor of --steps; needs mesh3d[eval])")  # fmt: skip
    return ap


def mc_task(out: Path, held: list[dict]) -> Path:
    """The held-out problems as a local lm-eval multiple-choice task: <out>/tasks/."""
    rng = random.Random(5)
    with open(out / "held_mc.jsonl", "w", encoding="utf-8") as f:
        for p in held:
            right = int(p["completion"])
            wrong = rng.sample([v for v in range(39) if v != right], 3)
            f.write(json.dumps({"prompt": p["prompt"], "choices": [str(right), *map(str, wrong)],
                                "answer": 0}) + "\n")  # fmt: skip
    tasks = out / "tasks"
    tasks.mkdir(exist_ok=True)
    (tasks / "arith_mc.yaml").write_text(
        f"task: arith_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: "
        f"{(out / 'held_mc.jsonl').resolve()}\ntest_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "{{prompt}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\n'
        "metric_list:\n  - metric: acc\n"
    )
    return tasks


def check(args) -> None:
    """Every flag checked before anything is written (`error:` line, exit 2)."""
    bad = [f"--steps {args.steps} must be >= 1"] if args.steps < 1 else []
    if not 1 <= args.held_out <= HELD_OUT_MAX:  # the rest of the 20 x 20 problems train
        bad.append(f"--held-out {args.held_out} must be 1..{HELD_OUT_MAX}")
    every = args.eval_every
    if every is not None and (every < 1 or args.steps % every):
        bad.append(f"--eval-every {every} must be >= 1 and divide --steps {args.steps}")
    if bad:
        raise UserError("; ".join(bad))


@exit_on_user_error
def main(argv: list[str] | None = None) -> dict:
    args = parser().parse_args(argv)
    check(args)
    out = Path(args.output)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise unwritable("--output", out, e) from None
    print(f"writing into {out.resolve()}", flush=True)
    held = problems(args.held_out, seed=2)
    unseen = {p["prompt"] for p in held}
    rows = [p for p in problems(4000, seed=1) if p["prompt"] not in unseen]
    with open(out / "train.jsonl", "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    tok_file = train_bpe([r["prompt"] + r["completion"] for r in rows], out / "tokenizer", 300)
    tokenizer = load_tokenizer(tok_file)
    assert tokenizer.token_to_id("</s>") == MODEL["eos_token_id"]
    print(f"data: {len(rows)} examples in train.jsonl, {len(held)} held out; tokenizer in "
          "tokenizer/", flush=True)  # fmt: skip
    ck = out / "checkpoints"
    stage = {"name": "sft", "start_training_step": 1,
             "data": {"seed": 3, "dataset": {"hf_dataset_or_datasets": str(out / "train.jsonl"),
                                             "sft_dataloader": True}}}  # fmt: skip
    d = copy.deepcopy(CONFIG)
    d["data_stages"] = [stage]
    d["tokens"]["train_steps"] = args.steps
    d["tokenizer"] = {"tokenizer_name_or_path": str(out / "tokenizer")}
    every = args.eval_every or args.steps
    d["checkpoints"] = dict(checkpoints_path=str(ck), checkpoint_interval=every,
                            save_initial_state=True, save_final_state=True)  # fmt: skip
    d["mesh3d"]["existing_checkpoints"] = "overwrite"
    metrics = None
    if args.eval_every is not None:
        tasks = mc_task(out, held)
        d["lighteval"] = {"eval_interval": every, "batch_size": 16,
                          "tasks": {"tasks": "arith_mc", "custom_tasks": str(tasks)}}  # fmt: skip
        metrics = out / "metrics.jsonl"
        metrics.unlink(missing_ok=True)
        print(f"scoring the held-out problems as multiple choice every {every} steps", flush=True)
    cfg = config_from_dict(d)
    print(f"training {args.steps} steps on CPU (one process)", flush=True)
    result = train(
        cfg,
        str(metrics) if metrics else None,
        hooks=[Progress(args.steps, every=max(1, args.steps // 10))],
    )
    losses = [m["lm_loss"] for m in result.metrics]
    print(f"asking the {len(held)} held-out problems, before and after training", flush=True)
    before = exact_match(ck / "0", tokenizer, held)
    after = exact_match(ck / str(args.steps), tokenizer, held)
    n = len(held)
    final = (ck / str(args.steps)).resolve()
    print(f"== SFT arithmetic: {args.steps} steps on {len(rows)} examples ==")
    print(f"train loss   {losses[0]:.3f} -> {losses[-1]:.3f} (completion tokens only)")
    print(f"exact match  {before}/{n} ({before / n:.0%}) before -> {after}/{n} ({after / n:.0%}) "
          "after, held-out problems")  # fmt: skip
    if result.evals:
        curve = ", ".join(
            f"step {e['iteration']}: {e['eval/arith_mc/acc']:.2f}" for e in result.evals
        )
        print(f"choice acc   {curve} (held-out problems, 4 choices, in-run)")
        from mesh3d.plot import write_plot

        print(f"plot         {write_plot([metrics], out / 'metrics.png').resolve()}")
    print(f"checkpoint   {final}")
    print(f'try it       mesh3d generate --checkpoint {final} --prompt "12+7="')
    return {
        "before": before,
        "after": after,
        "held_out": n,
        "losses": losses,
        "checkpoint": final,
        "evals": result.evals,
    }


if __name__ == "__main__":
    main()
