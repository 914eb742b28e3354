"""A tiny trained checkpoint with a tokenizer, three local lm-eval tasks over jsonl files
(multiple choice, greedy generation, rolling log-likelihood) and two of them as a lighteval
custom-task file: what the `mesh3d eval` tests score with no network."""

from __future__ import annotations

import copy
import json
from pathlib import Path

from parity import TINY

from mesh3d.config import apply_overrides, config_from_dict
from mesh3d.data.synthetic import make_documents, make_tokenizer

VOCAB = 301  # the tokenizer's 300 ids fit; odd, so tp 2 pads it
SEQ = 64
TASKS = ("tiny_mc", "tiny_gen", "tiny_text")


def train_config(root: Path, steps: int = 3, extra: list[str] = ()):
    return apply_overrides(config_from_dict(copy.deepcopy(TINY)), [
        f"model.model_config.vocab_size={VOCAB}", f"tokens.train_steps={steps}",
        f"model.model_config.max_position_embeddings={SEQ}", f"tokens.sequence_length={SEQ}",
        f"checkpoints.checkpoints_path={root / 'ck'}", f"checkpoints.checkpoint_interval={steps}",
        f"tokenizer.tokenizer_name_or_path={root / 'tok'}", *extra,
    ])  # fmt: skip


def write_tasks(root: Path) -> Path:
    """root/tasks/*.yaml over root/*.jsonl; the tokenizer in root/tok."""
    make_tokenizer(root / "tok", vocab_size=VOCAB - 1)
    docs = make_documents(40, seed=9)
    rows = {"mc": [], "gen": [], "text": []}
    for i, d in enumerate(docs[:20]):
        w, other = d.split(), docs[(i + 1) % 20].split()
        rows["mc"].append({"question": " ".join(w[:3]), "answer": i % 3, "choices": [
            " ".join(w[3:6]), " ".join(other[:3]), " ".join(w[6:8]) or "so it goes"]})  # fmt: skip
    for d in docs[20:30]:
        w = d.split()
        rows["gen"].append({"prompt": " ".join(w[:4]), "target": " ".join(w[4:6])})
    rows["text"] = [{"text": d[:300]} for d in docs[30:36]]
    for name, items in rows.items():
        with open(root / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in items)
    tasks = root / "tasks"
    tasks.mkdir(exist_ok=True)
    head = "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {}\ntest_split: test\n"
    (tasks / "tiny_mc.yaml").write_text(
        "task: tiny_mc\n" + head.format(root / "mc.jsonl") + "output_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\n'
        "metric_list:\n  - metric: acc\n"
    )
    (tasks / "tiny_gen.yaml").write_text(
        "task: tiny_gen\n" + head.format(root / "gen.jsonl") + "output_type: generate_until\n"
        'doc_to_text: "{{prompt}}"\ndoc_to_target: "{{target}}"\n'
        'generation_kwargs:\n  until: ["."]\n  max_gen_toks: 8\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n"
    )
    (tasks / "tiny_text.yaml").write_text(
        "task: tiny_text\n"
        + head.format(root / "text.jsonl")
        + "output_type: loglikelihood_rolling\n"
        'doc_to_text: ""\ndoc_to_target: "{{text}}"\n'
        "metric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n"
    )
    return tasks


LIGHTEVAL_TASKS = '''"""tiny_mc and tiny_gen as lighteval tasks over local jsonl folders (no network)."""

from lighteval.metrics.metrics import Metrics
from lighteval.tasks.lighteval_task import LightevalTaskConfig
from lighteval.tasks.requests import Doc


def mc_prompt(line, task_name=None):
    return Doc(task_name=task_name, query=line["question"],
               choices=[" " + c for c in line["choices"]], gold_index=line["answer"])


def gen_prompt(line, task_name=None):
    return Doc(task_name=task_name, query=line["prompt"], choices=[" " + line["target"]],
               gold_index=0)


def _task(name, prompt, folder, metric, **kw):
    return LightevalTaskConfig(name=name, prompt_function=prompt, hf_repo=folder,
                               hf_subset="default", hf_avail_splits=["test"],
                               evaluation_splits=["test"], metrics=[metric], **kw)


TASKS_TABLE = [
    _task("tiny_mc", mc_prompt, "{root}/lighteval/mc", Metrics.loglikelihood_acc),
    _task("tiny_gen", gen_prompt, "{root}/lighteval/gen", Metrics.exact_match,
          generation_size=8, stop_sequence=["."]),
]
'''


def write_lighteval_tasks(root: Path) -> Path:
    """root/lighteval_tasks.py: tiny_mc and tiny_gen (of `write_tasks`) as lighteval's custom
    tasks, each over a folder holding test.jsonl."""
    for name in ("mc", "gen"):
        (root / "lighteval" / name).mkdir(parents=True, exist_ok=True)
        (root / "lighteval" / name / "test.jsonl").write_text((root / f"{name}.jsonl").read_text())
    path = root / "lighteval_tasks.py"
    path.write_text(LIGHTEVAL_TASKS.replace("{root}", str(root)))
    return path


def per_sample(results: dict) -> dict:
    """{task: [each sample's responses as plain numbers / text]} of lm-eval's results."""

    def plain(x):
        if isinstance(x, (list, tuple)):
            return [plain(v) for v in x]
        if isinstance(x, (bool, str)) or x is None:
            return x
        return float(x)

    return {t: [plain(s["resps"]) for s in sorted(rows, key=lambda s: s["doc_id"])]
            for t, rows in results["samples"].items()}  # fmt: skip
