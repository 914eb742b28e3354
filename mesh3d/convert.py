"""`mesh3d convert to-hf | from-hf | to-peft` (also `python -m mesh3d.convert`): the command
line of the conversions in `mesh3d/checkpoint/hf.py` (and `checkpoint/lora_files.py`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from mesh3d import extensions
from mesh3d.checkpoint.hf import from_hf, hf_model_of, to_hf
from mesh3d.checkpoint.load import verified, weights_dir
from mesh3d.errors import exit_on_user_error
from mesh3d.models.dtypes import DTYPES

__all__ = ["from_hf", "main", "to_hf"]


@exit_on_user_error
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="mesh3d convert",
        description="Convert weights between Hugging Face and Nanotron's checkpoint layout.",
    )
    sub = ap.add_subparsers(dest="command", required=True)
    a = sub.add_parser(
        "to-hf",
        help="checkpoint step folder -> Hugging Face model folder",
        description="Write config.json + model.safetensors (e.g. LlamaForCausalLM) from a step folder "
        "holding model_config.json and model/ (saved at any tp/pp), or a checkpoints folder "
        "(latest.txt). The padded vocabulary is kept; the checkpoint's tokenizer/ is copied.",
    )
    a.add_argument("--checkpoint", required=True, help="e.g. checkpoints/1000, or checkpoints")
    a.add_argument("--output", required=True, help="folder for the Hugging Face model")
    a.add_argument("--dtype", choices=sorted(DTYPES), help="cast weights (default: as stored)")
    a.add_argument("--model", help="a checkpoint of any transformers model (mesh3d.save_state of "
                   "parallelize_hf / build_hf_stage parts): its original folder, for the "
                   "architecture, config and tokenizer (mesh3d.export_hf)")  # fmt: skip
    b = sub.add_parser(
        "from-hf",
        help="Hugging Face model folder -> Nanotron-layout weights checkpoint",
        description="Write <output>/model/... (Nanotron layout at --tp/--pp), model_config.json "
        "and config.yaml, a training config that starts from these weights (init_method: "
        "{path: <output>}) with small defaults for the rest. No optimizer state is written.",
    )
    b.add_argument("--model", required=True, help="local Hugging Face model folder")
    b.add_argument("--output", required=True, help="folder for the converted checkpoint")
    b.add_argument("--tp", type=int, default=1, help="tensor-parallel layout of the files")
    b.add_argument("--pp", type=int, default=1, help="pipeline-parallel layout of the files")
    c = sub.add_parser(
        "to-peft",
        help="LoRA step folder -> PEFT adapter folder",
        description="Write adapter_config.json + adapter_model.safetensors from the step folder "
        "of a run with mesh3d.lora (saved at any tp/pp): peft's PeftModel.from_pretrained loads "
        "it onto the Hugging Face export of the base. `to-hf` of the same folder writes the "
        "merged model.",
    )
    c.add_argument("--checkpoint", required=True, help="e.g. checkpoints/1000, or checkpoints")
    c.add_argument("--output", required=True, help="folder for the PEFT adapter")
    args = ap.parse_args(argv)
    trained = hf_model_of(args.checkpoint) if args.command == "to-hf" else None
    if args.command == "to-hf" and (args.model or trained):  # a transformers model's
        from mesh3d.checkpoint.hf_export import export_hf

        step = (
            args.checkpoint
            if args.model
            else verified(weights_dir(args.checkpoint, "--checkpoint"))
        )
        out = export_hf(step, args.model or trained, args.output)
        paths = sorted(p for p in out.iterdir() if p.is_file())
    elif args.command == "to-hf":
        paths = to_hf(args.checkpoint, args.output, args.dtype)
    elif args.command == "to-peft":
        step = verified(weights_dir(args.checkpoint, "--checkpoint"))
        paths = extensions.load("lora_files").write_peft(step, Path(args.output))
    else:
        paths = from_hf(args.model, args.output, args.tp, args.pp)
    shards = [p for p in paths if p.parent != Path(args.output)]  # from-hf's model/ files
    source = ""
    if args.command in ("to-hf", "to-peft") and not getattr(args, "model", None):
        source = f" from {weights_dir(args.checkpoint, '--checkpoint')}"  # latest.txt's step
    print(f"wrote {len(paths)} files under {args.output}{source}:")
    for p in (p for p in paths if p not in shards):
        print(f"  {p}")
    if shards:
        print(f"  {len(shards)} weight files under {Path(args.output) / 'model'}/")
    if args.command == "from-hf":
        yaml_path = Path(args.output).resolve() / "config.yaml"
        print(f"train from it: mesh3d train {yaml_path}  (starts its {args.tp * args.pp} "
              "processes itself)")  # fmt: skip


if __name__ == "__main__":
    main()
