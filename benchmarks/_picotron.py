"""Hugging Face Picotron as a peer way of `throughput.py --peer --picotron DIR` (issue 34).

    git clone https://github.com/huggingface/picotron DIR     # measured at commit 59714b1
    pip install datasets transformers                        # what Picotron imports
    python benchmarks/throughput.py --peer --picotron DIR

Picotron's own `train.py` (its loop, `train_step` / 1F1B, tensor-parallel layers, data-parallel
buckets, pipeline communication) runs unmodified under torchrun on CPU with gloo, at the peer
shape of `_ways.SHAPES` (untied embeddings: Picotron always builds its own output projection).
This file, run as the torchrun script, is the launcher; before it runs `train.py` as `__main__`
it stands in for what needs a GPU or a network, and changes no training code:
- flash-attn / triton imports become empty modules (`FLASH_ATTEN=0` makes Picotron use its own
  RMSNorm, rotary embedding and `F.scaled_dot_product_attention`, so nothing in them is called);
- `torch.cuda.synchronize` (called after every pipeline send) and `torch.cuda.memory_reserved`
  (a log line) do nothing; `get_num_params` (a log line; builds a CUDA tensor) counts on CPU;
- the dataset, tokenizer, model config and weight download are local: seeded random token ids
  written as text and "tokenized" back, the peer shape as the config, and a zero weight file
  that Picotron loads and then re-initializes (`reset_parameters`).
Timing: a step runs from one `optimizer.zero_grad()` (the first call of Picotron's step) to the
next, or to `destroy_process_group` after the last step; the last global rank (a last pipeline
stage) writes each step's wall seconds and loss. Picotron's initialization differs per layout,
so its losses are reported, not compared with mesh3d's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
VOCAB_ROWS, ROW_TOKENS, DATA_SEED = 1000, 128, 1234  # 1000 rows of 128 ids: enough for 20 steps


class PicotronMissing(RuntimeError):
    """The `--picotron` folder is not a Picotron checkout, or its imports are missing."""


def check_checkout(path: Path) -> Path:
    """`path` resolved, if it holds Picotron's `train.py` and `picotron/` and its imports are
    installed; else `PicotronMissing` saying what to do."""
    path = path.expanduser().resolve()
    if not (path / "train.py").is_file() or not (path / "picotron" / "model.py").is_file():
        raise PicotronMissing(
            f"--picotron {path}: no Picotron checkout there (train.py and picotron/model.py "
            "expected); clone https://github.com/huggingface/picotron (measured at 59714b1)"
        )
    missing = [m for m in ("datasets", "transformers") if not _importable(m)]
    if missing:
        raise PicotronMissing(
            f"--picotron needs {' and '.join(missing)} (Picotron imports them): "
            f"pip install {' '.join(missing)}"
        )
    return path


def _importable(module: str) -> bool:
    from importlib.util import find_spec

    return find_spec(module) is not None


def config(shape: tuple, dims: tuple[int, int, int], steps: int, threads: int) -> dict:
    """Picotron's JSON config for `shape` (`_ways.SHAPES` order) at `dims` = (dp, tp, pp), the
    global batch of 1x1x1 (dp divides the accumulation)."""
    h, ffn, layers, heads, kv, vocab, seq, mbs, acc = shape
    dp, tp, pp = dims
    return {
        "distributed": {"tp_size": tp, "cp_size": 1, "pp_size": pp, "dp_size": dp,
                        "pp_engine": "1f1b", "backend": "gloo", "use_cpu": True},
        "model": {"name": "synthetic/llama", "num_hidden_layers": layers,
                  "num_attention_heads": heads, "num_key_value_heads": kv, "dtype": "float32",
                  "use_flash_attention": False, "use_fused_adam": False},
        "training": {"seed": 42, "learning_rate": 3e-4, "total_train_steps": steps,
                     "seq_length": seq, "micro_batch_size": mbs,
                     "gradient_accumulation_steps": acc // dp, "num_samples": None,
                     "max_tokens": None},
        "dataset": {"name": "synthetic", "subset_name": None, "num_workers": 0, "num_proc": 1},
        "checkpoint": {"save_dir": "ckpt", "save_frequency": 10**9, "load_path": ""},
        "logging": {"use_wandb": False, "project_name": "picotron", "run_name": "peer"},
        "environment": {"OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false",
                        "FLASH_ATTEN": "0", "HF_TOKEN": None},
        "mesh3d_shape": list(shape),  # read by the launcher below; Picotron ignores it
    }  # fmt: skip


def zero_weights(shape: tuple, folder: Path) -> None:
    """`folder/hf_model_safetensors/model.safetensors`: zeros in Llama's names and full shapes
    (Picotron loads its slices, then re-initializes every parameter)."""
    import torch
    from safetensors.torch import save_file

    h, ffn, layers, heads, kv, vocab = shape[:6]
    d = h // heads
    sd = {"model.embed_tokens.weight": torch.zeros(vocab, h), "model.norm.weight": torch.zeros(h)}
    for i in range(layers):
        p = f"model.layers.{i}."
        sd |= {p + "input_layernorm.weight": torch.zeros(h),
               p + "post_attention_layernorm.weight": torch.zeros(h),
               p + "self_attn.q_proj.weight": torch.zeros(heads * d, h),
               p + "self_attn.k_proj.weight": torch.zeros(kv * d, h),
               p + "self_attn.v_proj.weight": torch.zeros(kv * d, h),
               p + "self_attn.o_proj.weight": torch.zeros(h, h),
               p + "mlp.gate_proj.weight": torch.zeros(ffn, h),
               p + "mlp.up_proj.weight": torch.zeros(ffn, h),
               p + "mlp.down_proj.weight": torch.zeros(h, ffn)}  # fmt: skip
    (folder / "hf_model_safetensors").mkdir(parents=True, exist_ok=True)
    save_file(sd, str(folder / "hf_model_safetensors" / "model.safetensors"))


def run_picotron(checkout: Path, shape: tuple, dims: tuple[int, int, int], steps: int,
                 threads: int) -> dict:  # fmt: skip
    """One Picotron run in fresh torchrun processes: tokens/s and loss of every step, wall s."""
    ranks = dims[0] * dims[1] * dims[2]
    with tempfile.TemporaryDirectory(prefix="mesh3d-picotron-") as tmp:
        work = Path(tmp)
        cfg = work / "config.json"
        cfg.write_text(json.dumps(config(shape, dims, steps, threads)))
        zero_weights(shape, work)
        out = work / "steps.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={ranks}", __file__, "--config", str(cfg)]  # fmt: skip
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), PICOTRON_DIR=str(checkout),
                   MESH3D_PICOTRON_OUT=str(out))  # fmt: skip
        t0 = time.time()
        proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
        wall = time.time() - t0
        if proc.returncode != 0:
            raise RuntimeError(
                f"Picotron {dims} failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
            )
        steps_rec = json.loads(out.read_text())
    h, ffn, layers, heads, kv, vocab, seq, mbs, acc = shape
    tokens = mbs * acc * seq
    return dict(ranks=ranks, threads=threads, wall_s=wall,
                step_tokens_per_sec=[tokens / s["wall"] for s in steps_rec],
                losses=[s["loss"] for s in steps_rec])  # fmt: skip


# ---- the torchrun script: stand-ins, step timing, then Picotron's train.py as __main__ ----


def _random_text(vocab: int):
    """The dataset: seeded random token ids, written as text (Picotron tokenizes them back)."""
    import datasets
    import torch

    g = torch.Generator().manual_seed(DATA_SEED)
    ids = torch.randint(0, vocab, (VOCAB_ROWS, ROW_TOKENS), generator=g)
    return datasets.Dataset.from_dict({"text": [" ".join(map(str, r.tolist())) for r in ids]})


class Tokenizer:
    """Reads the ids written as text back (module level: Picotron broadcasts it pickled)."""

    def batch_encode_plus(self, texts, **kwargs):
        import numpy as np

        return {"input_ids": [np.array(t.split(), dtype=np.int64) for t in texts]}


def _launch() -> None:
    import runpy
    import types

    checkout = Path(os.environ["PICOTRON_DIR"])
    sys.path.insert(0, str(checkout))
    cfg = json.loads(Path(sys.argv[sys.argv.index("--config") + 1]).read_text())
    h, ffn, layers, heads, kv, vocab, seq = cfg["mesh3d_shape"][:7]
    os.environ.setdefault("HF_TOKEN", "unused")  # train.py asks for one; nothing is downloaded
    os.environ["DTYPE"] = "float32"  # Picotron's rotary tables default to bf16

    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    def never(*a, **k):
        raise RuntimeError("a flash-attn / triton kernel was called on CPU")

    stubs = {"flash_attn": {}, "flash_attn.flash_attn_interface": {"flash_attn_func": never},
             "flash_attn.layers": {}, "flash_attn.layers.rotary": {"apply_rotary_emb": never},
             "flash_attn.ops": {}, "flash_attn.ops.triton": {},
             "flash_attn.ops.triton.layer_norm": {"layer_norm_fn": never}}  # fmt: skip
    for name, attrs in stubs.items():
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        sys.modules[name] = module
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.memory_reserved = lambda *a, **k: 0

    import picotron.data as pdata
    import picotron.process_group_manager as pgm
    import picotron.utils as putils
    import torch.distributed as dist
    import transformers

    def num_params(model) -> int:
        tp = pgm.process_group_manager.tp_world_size
        sharded = ("attention", "mlp", "embed", "final_proj")
        n = sum(p.numel() * (tp if any(k in name.lower() for k in sharded) else 1)
                for name, p in model.named_parameters())  # fmt: skip
        t = torch.tensor(n)
        dist.all_reduce(t, group=pgm.process_group_manager.pp_group)
        return int(t.item())

    model_cfg = dict(hidden_size=h, intermediate_size=ffn, num_hidden_layers=layers,
                     num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
                     rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=seq,
                     tie_word_embeddings=False)  # fmt: skip
    putils.get_num_params = num_params
    pdata.load_dataset = lambda *a, **k: _random_text(vocab)
    # by its module's name: train.py then runs as __main__, where pickling cannot find it
    from _picotron import Tokenizer as ByName

    pdata.AutoTokenizer = types.SimpleNamespace(from_pretrained=lambda *a, **k: ByName())
    putils.download_model = lambda *a, **k: None
    transformers.AutoConfig.from_pretrained = lambda *a, **k: types.SimpleNamespace(**model_cfg)

    steps: list[dict] = []
    state = {"t0": None, "loss": None}

    def close_step() -> None:
        now = time.perf_counter()
        if state["t0"] is not None:
            steps.append({"wall": now - state["t0"], "loss": state["loss"]})
        state["t0"] = now

    class TimedAdamW(torch.optim.AdamW):
        def zero_grad(self, *a, **k):  # the first call of each step in train.py's loop
            close_step()
            return super().zero_grad(*a, **k)

    torch.optim.AdamW = TimedAdamW
    average = putils.average_loss_across_dp_cp_ranks

    def average_and_keep(loss, device):
        state["loss"] = float(average(loss, device))
        return state["loss"]

    putils.average_loss_across_dp_cp_ranks = average_and_keep
    destroy = dist.destroy_process_group

    def destroy_and_write(*a, **k):
        close_step()
        if dist.get_rank() == dist.get_world_size() - 1:
            Path(os.environ["MESH3D_PICOTRON_OUT"]).write_text(json.dumps(steps))
        return destroy(*a, **k)

    dist.destroy_process_group = destroy_and_write
    sys.argv = [str(checkout / "train.py"), *sys.argv[1:]]
    runpy.run_path(str(checkout / "train.py"), run_name="__main__")


if __name__ == "__main__":
    _launch()
