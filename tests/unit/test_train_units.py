"""Unit tests of the training pieces: LR schedule, number format, FLOPs, loss, dummy data."""

import math

import pytest
import torch

from mesh3d.data.dummy import DummyTokens, microbatches
from mesh3d.train.loss import normalized_loss, token_loss_sum
from mesh3d.train.lr_schedule import lr_at
from mesh3d.train.metrics import format_iteration_line, human_format, llama_flops

TINY = dict(  # Nanotron's tiny example: lr 3e-4, W=2, cosine, D=13, min 1e-5
    learning_rate=3e-4,
    warmup_steps=2,
    warmup_style="linear",
    decay_style="cosine",
    decay_steps=13,
    decay_start=None,
    min_lr=1e-5,
)


def test_lr_nanotron_tiny_example_logged_values():
    # Nanotron logs lr(s) at step s: 0.00015, 0.0003, 0.000296, 0.000283 ... 1e-05
    logged = [lr_at(s, **TINY) for s in range(1, 16)]
    assert [human_format(x) for x in logged[:4]] == ["0.00015", "0.0003", "0.000296", "0.000283"]
    assert logged[14] == pytest.approx(1e-5)
    # Kept on purpose from Nanotron: the first optimizer step uses lr(0) = 0 with linear warmup.
    assert lr_at(0, **TINY) == 0.0


def test_lr_hand_computed_styles():
    base = dict(learning_rate=1.0, warmup_steps=4, warmup_style="linear", decay_start=None)
    lin = dict(base, decay_style="linear", decay_steps=10, min_lr=0.1)
    assert lr_at(2, **lin) == pytest.approx(0.5)  # 2/4 of warmup
    assert lr_at(4, **lin) == pytest.approx(1.0)
    assert lr_at(9, **lin) == pytest.approx(0.1 + 0.9 * (10 - 5) / 10)  # k-A = 5
    assert lr_at(14, **lin) == pytest.approx(0.1)  # k >= A + D
    sq = dict(lin, decay_style="1-sqrt")
    assert lr_at(8, **sq) == pytest.approx(0.1 + 0.9 * (1 - math.sqrt(0.4)))
    cos = dict(lin, decay_style="cosine")
    assert lr_at(9, **cos) == pytest.approx(0.1 + 0.9 * 0.5)  # half way: cos(pi/2) = 0
    const = dict(lin, warmup_style="constant")
    assert lr_at(1, **const) == 1.0
    delayed = dict(lin, decay_start=8)  # hold the peak between warmup and decay start
    assert lr_at(6, **delayed) == 1.0
    assert lr_at(8, **delayed) == pytest.approx(1.0)
    assert lr_at(13, **delayed) == pytest.approx(0.1 + 0.9 * 0.5)
    flat = dict(lin, warmup_steps=0, decay_steps=0)
    assert lr_at(0, **flat) == 1.0 and lr_at(100, **flat) == 1.0


@pytest.mark.parametrize(
    "x,s",
    [
        (1024, "1.02K"),
        (410.0, "410"),
        (5.5512, "5.55"),
        (393216, "393K"),
        (2.3e-06, "2.3e-06"),
        (1.5e9, "1.5G"),
        (0, "0"),
    ],
)
def test_human_format(x, s):
    assert human_format(x) == s


def test_llama_flops_hand_computed():
    # L=1, h=4, nq=2 (dh=2), nkv=1, F=8, V=10, S=3, B=1
    qkv = 2 * 3 * 4 * 2 * 2 + 2 * 3 * 4 * 2 * 1 * 2  # 48 + 48
    attn = 2 * 2 * 3 * 2 * 3 * 2  # scores + AV = 72 + 72 = 144 total
    out = 2 * 2 * 3 * 2 * 4  # 96
    mlp = 4 * 3 * 4 * 8 + 2 * 3 * 8 * 4  # 384 + 192
    head = 2 * 3 * 4 * 10  # 240
    assert llama_flops(1, 4, 2, 1, 8, 10, 3, 1) == 3 * (qkv + attn + out + mlp + head)


def test_iteration_line_format():
    m = {"iteration": 3, "consumed_tokens": 3072, "lm_loss": 5.5512, "lr": 0.000296}
    line = format_iteration_line(m, 15)
    assert line == "iteration: 3 / 15 | consumed_tokens: 3.07K | lm_loss: 5.55 | lr: 0.000296"


def test_padded_vocab_columns_do_not_change_loss():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11)
    labels = torch.randint(0, 11, (2, 5))
    padded = torch.cat([logits, torch.full((2, 5, 5), 30.0)], dim=-1)  # huge padded logits
    assert torch.equal(token_loss_sum(padded, labels, 11), token_loss_sum(logits, labels, 11))
    mean = torch.nn.functional.cross_entropy(logits.reshape(-1, 11), labels.reshape(-1))
    assert torch.allclose(token_loss_sum(logits, labels, 11) / 10, mean)


def test_normalized_loss_sums_to_global_mean():
    torch.manual_seed(0)
    logits, labels = torch.randn(4, 6, 7), torch.randint(0, 7, (4, 6))
    parts = sum(normalized_loss(logits[i : i + 1], labels[i : i + 1], 7, 24) for i in range(4))
    mean = torch.nn.functional.cross_entropy(logits.reshape(-1, 7), labels.reshape(-1))
    assert torch.allclose(parts, mean, rtol=1e-6)


def test_dummy_global_batch_same_at_any_dp():
    data = DummyTokens(vocab_size=50, seq_len=8, seed=3)
    one = microbatches(data, step=2, global_batch_size=8, dp_rank=0, dp=1, micro_batch_size=2)
    four = [microbatches(data, 2, 8, r, 4, 2) for r in range(4)]
    rows1 = torch.cat([x for x, _ in one])
    rows4 = torch.cat([x for mbs in four for x, _ in mbs])
    assert torch.equal(rows1, rows4)
    assert not torch.equal(rows1, torch.cat([x for x, _ in microbatches(data, 3, 8, 0, 1, 2)]))


def test_dummy_kinds():
    rnd = DummyTokens(vocab_size=64, seq_len=4096, seed=0)
    x, y = rnd[0]
    assert x.shape == y.shape == (4096,) and int(x.max()) < 64 and not torch.equal(x[1:], y[:-1])
    assert torch.equal(rnd[5][0], DummyTokens(64, 4096, 0)[5][0])  # deterministic per index
    lrn = DummyTokens(vocab_size=64, seq_len=16, seed=0, kind="learnable")
    x, y = lrn[7]
    assert torch.equal(x[1:], y[:-1]) and torch.equal(y, (5 * x + 3) % 64)


def test_progress_lines(caplog):
    import logging

    from mesh3d.log import Progress

    caplog.set_level(logging.INFO, logger="mesh3d")
    ticks = iter([5.0, 12.0, 13.0, 30.0])
    p = Progress("Saving", 4, every_s=10.0)
    p._clock, p.start, p._last = lambda: next(ticks), 0.0, 0.0
    for _ in range(3):
        p.update()  # at 5 s (quiet), 12 s (logs 2/4 with an eta), 13 s (quiet)
    p.count += 1
    assert p.done() == 30.0
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["Saving: 2/4 (50%), 12 s, eta 12 s", "Saving: 4/4 done in 30.0 s"]
