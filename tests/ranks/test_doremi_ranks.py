"""DoReMi (`doremi:`, docs/doremi.md) on a synthetic corpus of two domains: `easy` (one short
pattern repeated) and `hard` (uniform random tokens). A reference model trained 6 steps has
learned `easy`; the proxy, trained from scratch against it, lags it most there, so the weight
of `easy` rises from 0.5 (and does so the same way every time: the figures are asserted).
The proxy's weights and losses at dp2 x tp2 x pp2 (REDUCE_SCATTER, ZeRO-1, 1F1B) equal one
process's, and so do its weights at dp2 x tp2 (no pipeline, zero 0) and at tp2 x pp2 under
zbv_zero_bubble (a V schedule: forward-only passes walk the stages); a proxy resumed from its
step-2 checkpoint continues with the same weights; the checkpoint's average weights are the
mean of the logged ones and print as the final run's `doremi:` section; a `doremi:` run on
dummy data stops with one line. The reference run trains bitwise as the same run without the
section, and logs its domains' losses, which add up to its loss.

One 1-rank launch (references, proxies, resumed proxy), one 4-rank and one 8-rank launch:
~15 s on 2 cores.
"""

from __future__ import annotations

import copy

from dist import run_ranks
from parity import TINY, layout_overrides

NAMES = ["easy", "hard"]
STEPS = 4


def _base(tmp_path) -> dict:
    from mesh3d.data.domains import write_synthetic_domains

    easy, hard = write_synthetic_domains(tmp_path / "data", TINY["model"]["model_config"][
        "vocab_size"], tokens=20_000)  # fmt: skip
    base = copy.deepcopy(TINY)
    base["model"]["model_config"]["max_position_embeddings"] = 32
    base["data_stages"] = [dict(name="s", start_training_step=1, data=dict(
        dataset=dict(dataset_folder=[str(easy), str(hard)]), seed=3, num_loading_workers=0))]  # fmt: skip
    base["doremi"] = dict(domain_names=", ".join(NAMES))
    return base


def _runs(rank: int, world: int, runs: list[tuple[dict, list[str]]]) -> list[dict]:
    from mesh3d.config import apply_overrides, config_from_dict
    from mesh3d.errors import UserError
    from mesh3d.train.loop import train

    out = []
    for base, overrides in runs:
        cfg = apply_overrides(config_from_dict(copy.deepcopy(base)), overrides)
        try:
            res = train(cfg)
        except UserError as e:
            out.append(str(e))
            continue
        out.append(dict(
            loss=[m["lm_loss"] for m in res.metrics],
            weights=[[m.get(f"doremi/weight/{n}") for n in NAMES] for m in res.metrics],
            excess=[[m.get(f"doremi/excess/{n}") for n in NAMES] for m in res.metrics],
            domain_loss=[[m.get(f"doremi/loss/{n}") for n in NAMES] for m in res.metrics],
            samples=[[m.get(f"doremi/samples/{n}") for n in NAMES] for m in res.metrics],
        ))  # fmt: skip
    return out


def _ck(tmp_path, name: str, every: int) -> list[str]:
    return [f"checkpoints={{checkpoints_path: {tmp_path / name}, checkpoint_interval: {every}}}"]


def test_proxy_weights_rise_on_the_lagging_domain_and_equal_one_process_at_2x2x2(tmp_path):
    from mesh3d.train.doremi import average_weights, weights_yaml

    base = _base(tmp_path)
    one = layout_overrides(1, 1, "ALL_REDUCE", 0, False)
    proxy = [f"doremi.ref_model_resume_checkpoint_path={tmp_path / 'ref' / '6'}",
             f"tokens.train_steps={STEPS}"]  # fmt: skip
    runs = [
        (base, one + _ck(tmp_path, "ref", 6) + ["tokens.train_steps=6"]),
        (base, one + proxy + _ck(tmp_path, "proxy", 2)),
        (base, one + proxy + _ck(tmp_path, "resumed", 2)
         + [f"checkpoints.resume_checkpoint_path={tmp_path / 'proxy' / '2'}"]),
    ]  # fmt: skip
    four = ["model.model_config.num_hidden_layers=4", f"tokens.train_steps={STEPS}"]
    proxy4 = [f"doremi.ref_model_resume_checkpoint_path={tmp_path / 'ref4' / '6'}", *four]
    runs += [
        (base, one + _ck(tmp_path, "ref4", 6) + four + ["tokens.train_steps=6"]),
        (base, one + proxy4),
        (base, one + proxy + ["data_stages[0].data.dataset=null"]),
        ({k: v for k, v in base.items() if k != "doremi"}, one + ["tokens.train_steps=6"]),
    ]
    ref, single, resumed, _, single4, dummy, plain = run_ranks(1, _runs, runs, timeout=300)[0]
    assert ref["loss"] == plain["loss"]  # the reference trains as a plain run, bitwise
    assert dummy.startswith("DoReMi reads the domain of each sample from a blend of the domains; "
                            "data_stages[0] ('s'): dummy data is not one"), dummy  # fmt: skip
    assert all(w == [None, None] for w in ref["weights"])  # a reference run has no weights
    # ... but its domains' losses, which add up to its loss (the same samples at every step)
    for loss, losses, samples in zip(ref["loss"], ref["domain_loss"], ref["samples"]):
        assert sum(samples) == 8 and min(samples) > 0
        mean = sum(x * n for x, n in zip(losses, samples)) / sum(samples)
        assert abs(mean - loss) < 1e-6 * loss, (mean, loss)
    assert ref["domain_loss"][-1][0] < ref["domain_loss"][-1][1] - 1  # it learned `easy`
    w = single["weights"]
    # the proxy lags the reference on the learnable domain: its weight rises from 0.5
    assert w[0][0] > 0.6 and w[-1][0] > 0.9, w
    assert all(abs(sum(step) - 1) < 1e-9 for step in w)
    assert resumed["weights"] == w[2:], (resumed["weights"], w)  # continued, bitwise
    assert resumed["loss"] == single["loss"][2:]

    names, avg = average_weights(str(tmp_path / "proxy" / str(STEPS)))
    assert names == NAMES
    mean = [sum(step[i] for step in w) / len(w) for i in range(2)]
    assert max(abs(a - b) for a, b in zip(avg, mean)) < 1e-12, (avg, mean)
    text = weights_yaml(names, avg)
    assert text.startswith("doremi:\n  domain_names: easy, hard\n  domain_weights: 0.")

    three_d = layout_overrides(2, 2, "REDUCE_SCATTER", 1, False) + ["parallelism.pp=2"]
    (three,) = run_ranks(8, _runs, [(base, three_d + proxy)], timeout=300)[0]
    diff = max(abs(a - b) for s3, s1 in zip(three["weights"], w) for a, b in zip(s3, s1))
    print(f"doremi weights, dp2 x tp2 x pp2 vs one process: max |diff| {diff:.2e}")
    print("weights per step (easy, hard):", [[round(x, 5) for x in s] for s in w])
    assert diff < 1e-5, (three["weights"], w)
    loss_diff = max(abs(a - b) / abs(b) for a, b in zip(three["loss"], single["loss"]))
    print(f"doremi loss, dp2 x tp2 x pp2 vs one process: max relative diff {loss_diff:.2e}")
    assert loss_diff < 1e-5, (three["loss"], single["loss"])

    # without a pipeline (dp2 x tp2, zero 0: the bucketed gradient sum); a V schedule, whose
    # forward-only passes walk its stages (tp2 x pp2, zbv_zero_bubble)
    dp_tp = layout_overrides(2, 2, "ALL_REDUCE", 0, False)
    zbv = layout_overrides(1, 2, "ALL_REDUCE", 0, False, microbatches=4) + [
        "parallelism.pp=2", "mesh3d.pp_schedule=zbv_zero_bubble", "mesh3d.pp_virtual_stages=2"]  # fmt: skip
    flat, v_shaped = run_ranks(4, _runs, [(base, dp_tp + proxy), (base, zbv + proxy4)],
                               timeout=300)[0]  # fmt: skip
    for got, want in ((flat, single), (v_shaped, single4)):
        assert isinstance(got, dict), got
        d = max(abs(a - b) for s4, s1 in zip(got["weights"], want["weights"])
                for a, b in zip(s4, s1))  # fmt: skip
        print(f"doremi weights vs one process: max |diff| {d:.2e}")
        assert d < 1e-5, (got["weights"], want["weights"])
