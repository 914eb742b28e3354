"""Documents inside packed samples (Nanotron's `_use_doc_masking`): a document starts at a
sample's first token and after every EOS, e.g. ids [[5, 9, 2, 7]] (2 = EOS) -> positions
[[0, 1, 2, 0]], and the label after an EOS is ignored (-100).
"""

from __future__ import annotations

import torch
from torch import Tensor

IGNORE = -100


def document_positions(ids: Tensor, eos_id: int) -> Tensor:
    """[B, S] int64: each token's position in its document (0 at its first token)."""
    b, s = ids.shape
    starts = torch.zeros_like(ids, dtype=torch.bool)
    starts[:, 0] = True
    starts[:, 1:] = ids[:, :-1] == eos_id
    index = torch.arange(s, device=ids.device).expand(b, s)
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - first


def mask_document_starts(labels: Tensor, ids: Tensor, eos_id: int) -> Tensor:
    """`labels` with the prediction of each document's first token ignored (after an EOS)."""
    return torch.where(ids == eos_id, torch.full_like(labels, IGNORE), labels)
