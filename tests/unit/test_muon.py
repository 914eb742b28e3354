"""`name: muon` on one process: Muon on the decoder layers' 2-D weights and AdamW on the rest
equal `torch.optim.Muon` + `torch.optim.AdamW(foreach=False)` on the same split, bitwise; the
split, the checks and the refusals (layouts: tests/ranks/test_muon_ranks.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from parity import TINY

from mesh3d.checks.validate import validation_errors
from mesh3d.config import apply_overrides, config_from_dict
from mesh3d.config.schema import MuonOptimizerArgs
from mesh3d.errors import UserError
from mesh3d.train.muon import MuonAdamW, split_groups


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(50, 16)
        self.layers = torch.nn.ModuleList(
            torch.nn.ModuleDict({"proj": torch.nn.Linear(16, 24), "norm": torch.nn.LayerNorm(24),
                                 "back": torch.nn.Linear(24, 16, bias=False)}) for _ in range(2))  # fmt: skip
        self.lm_head = torch.nn.Linear(16, 50, bias=False)


@pytest.mark.parametrize("nesterov, adjust", [(True, None), (False, "match_rms_adamw")])
def test_one_process_equals_torchs_muon_and_adamw(nesterov, adjust):
    torch.manual_seed(0)
    ours_model = Tiny()
    ref_model = copy.deepcopy(ours_model)
    f = MuonOptimizerArgs(nesterov=nesterov, adjust_lr_fn=adjust)
    names = {id(p): n for n, p in ours_model.named_parameters()}
    groups = [{"params": list(ours_model.parameters()), "weight_decay": 0.1, "lr": 0.02}]
    ours = MuonAdamW(split_groups(groups, names, f.muon_params), 0.02, f)
    assert [g["kind"] for g in ours.param_groups] == ["muon", "adamw"]
    muon_names = sorted(n for n, p in ours_model.named_parameters()
                        if id(p) in {id(q) for q in ours.param_groups[0]["params"]})  # fmt: skip
    assert muon_names == ["layers.0.back.weight", "layers.0.proj.weight",
                          "layers.1.back.weight", "layers.1.proj.weight"]  # fmt: skip
    ref_params = dict(ref_model.named_parameters())
    ref_muon = torch.optim.Muon([ref_params[n] for n in muon_names], lr=0.02, weight_decay=0.1,
                                momentum=0.95, nesterov=nesterov, adjust_lr_fn=adjust)  # fmt: skip
    rest = [p for n, p in ref_model.named_parameters() if n not in muon_names]
    ref_adam = torch.optim.AdamW(rest, lr=0.02, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                                 foreach=False)  # fmt: skip
    for step in range(4):
        g = torch.Generator().manual_seed(step)
        for p, q in zip(ours_model.parameters(), ref_model.parameters()):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        ours.step()
        ref_muon.step()
        ref_adam.step()
        for (n, p), q in zip(ours_model.named_parameters(), ref_model.parameters()):
            assert torch.equal(p, q), (step, n)


def test_patterns_that_match_nothing_or_a_non_matrix_are_refused():
    model = Tiny()
    names = {id(p): n for n, p in model.named_parameters()}
    groups = [{"params": list(model.parameters()), "weight_decay": 0.0, "lr": 0.1}]
    with pytest.raises(UserError, match=r"\['blocks\\\\.'\] match\(es\) no parameter"):
        split_groups(groups, names, [r"blocks\."], explicit=True)
    with pytest.raises(
        UserError, match="layers.0.proj.bias of shape \\[24\\]: Muon orthogonalizes 2-D"
    ):
        split_groups(groups, names, [r"layers\."], explicit=True)
    kinds = [g["kind"] for g in split_groups(groups, names, [r"layers\."])]  # the default's way
    assert kinds == ["muon", "adamw"]


def test_bad_muon_settings_are_named():
    base = apply_overrides(config_from_dict(copy.deepcopy(TINY)), [
        "optimizer.optimizer_factory={name: muon, ns_dtype: float16, adjust_lr_fn: spectral, "
        "ns_steps: 0, momentum: 1.5, muon_params: ['(']}",
    ])  # fmt: skip
    text = " | ".join(validation_errors(base))
    for part in ("ns_dtype` 'float16'", "adjust_lr_fn` 'spectral'", "ns_steps` must be in [1, 99]",
                 "momentum` must be in [0, 1)", "muon_params[0]` '(' is not a regular expression"):  # fmt: skip
        assert part in text, text
