"""A checkpoint of any `transformers` causal LM trained through mesh3d, back to a Hugging Face folder.

`mesh3d.save_state` writes such a model (or this rank's pipeline stages of it, `build_hf_stage`)
under the model's own parameter names, each tensor whole, at any dp / tp / pp; `load_state`
reads it back at any other layout. `export_hf` puts the saved weights into one unparallelized
copy of the model (its architecture and config from the model object, folder or hub id given)
and writes the folder `from_pretrained` loads: config.json, safetensors weights, and the
tokenizer files of the source folder when it has them.

    mesh3d.save_state("ckpt/100", stages, optimizer, mesh=mesh)      # every rank, any layout
    mesh3d.export_hf("ckpt/100", "path/to/original", "exported/100")  # one process
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from torch import nn
from torch.distributed.tensor import DTensor

from mesh3d.checkpoint.any_model import load_state
from mesh3d.errors import UserError
from mesh3d.hf_models import load_hf

# files of a Hugging Face folder that belong to its tokenizer (copied beside the weights)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                    "generation_config.json", "chat_template.jinja")  # fmt: skip


def export_hf(
    checkpoint: str | os.PathLike,
    model: nn.Module | str | os.PathLike,
    output: str | os.PathLike,
) -> Path:
    """Write the weights `mesh3d.save_state` saved in `checkpoint` as a Hugging Face folder at
    `output` (`model.save_pretrained`), loadable with `AutoModelForCausalLM.from_pretrained`.
    `model`: the architecture the checkpoint was trained as, unparallelized (its weights are
    replaced), or a local folder / hub id of it, whose tokenizer files are copied too. One
    process, the whole model in memory. The folder is written beside `output` and renamed into
    place when complete; an existing `output` is refused. Returns `output`.

    Example:

        mesh3d.export_hf("runs/hf/checkpoints/100", "models/pythia-tiny", "exported/100")
        transformers.AutoModelForCausalLM.from_pretrained("exported/100")
    """
    output = Path(output)
    if output.exists():
        raise UserError(f"export: {output} exists; remove it or choose another --output")
    source = None if isinstance(model, nn.Module) else Path(os.fspath(model))
    model = load_hf(model)
    if any(isinstance(p, DTensor) for p in model.parameters()):
        raise UserError(
            f"export: the {type(model).__name__} given is parallelized (DTensor parameters); "
            "give an unparallelized model, or its folder"
        )
    load_state(checkpoint, model)
    tmp = output.with_name(f".tmp-{output.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp)
        if source is not None and source.is_dir():
            for name in _TOKENIZER_FILES:
                if (source / name).is_file() and not (tmp / name).exists():
                    shutil.copy2(source / name, tmp / name)
        tmp.rename(output)
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(f"export: cannot write {output} ({err.strerror or err})") from None
    return output
