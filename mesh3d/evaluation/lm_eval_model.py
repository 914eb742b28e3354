"""mesh3d's model as an lm-evaluation-harness model (`lm_eval.api.model.TemplateLM`).

lm-eval tokenizes requests through `tok_encode` (the checkpoint's tokenizer as transformers
loads it, without special tokens, as its own `hf` model does) and hands token lists to
`_loglikelihood_tokens`; the rolling log-likelihood cuts a document into the same disjoint
windows as the `hf` model (`lm_eval.utils.get_rolling_token_windows`); `generate_until` decodes
greedily and cuts the text at the first stop sequence. So on the same weights the numbers are
the `hf` model's, at any tp x pp.

Every rank of the model's world runs the whole evaluation with the same requests (the model
says rank 0 of world 1 to lm-eval, which then splits nothing): each batch is one collective
forward, and only global rank 0 writes the results (`cli.py`).
"""

from __future__ import annotations

from lm_eval import utils
from lm_eval.api.model import TemplateLM

from mesh3d.evaluation.scorer import Scorer


class Mesh3dLM(TemplateLM):
    """`scorer` and `tokenizer` (a transformers tokenizer) for lm-eval."""

    def __init__(self, scorer: Scorer, tokenizer, max_gen_toks: int = 256):
        super().__init__()
        self.scorer, self.tokenizer, self.max_gen_toks = scorer, tokenizer, max_gen_toks

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self.scorer.length

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", "mesh3d"))

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, **kwargs
    ) -> list[int]:
        return self.tokenizer.encode(string, add_special_tokens=bool(add_special_tokens))

    def apply_chat_template(
        self, chat_history: list[dict], add_generation_prompt: bool = True
    ) -> str:
        """A chat task's turns as text, through the tokenizer's chat template (`cli.py` refuses
        `--apply-chat-template` for a tokenizer without one)."""
        return self.tokenizer.apply_chat_template(
            chat_history, tokenize=False, add_generation_prompt=add_generation_prompt,
            continue_final_message=not add_generation_prompt,
        )  # fmt: skip

    def tok_decode(self, tokens: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        seqs, spans = [], []
        for _, context, continuation in requests:
            seqs.append((context + continuation)[-(self.max_length + 1) :])
            spans.append(min(len(continuation), len(seqs[-1]) - 1))
        out = self.scorer.score(seqs, spans)
        for (key, _, _), result in zip(requests, out):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, result)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owner = [], []
        for i, (string,) in enumerate(req.args for req in requests):
            for w in map(utils.make_disjoint_window, utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):  # fmt: skip
                windows.append((None, *w))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (logp, _) in zip(owner, self._loglikelihood_tokens(windows)):
            totals[i] += logp
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        eos_text = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        groups: dict[tuple, list[int]] = {}
        for i, req in enumerate(requests):
            _, kwargs = req.args
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            if eos_text not in until:
                until.append(eos_text)
            steps = int(kwargs.get("max_gen_toks", self.max_gen_toks))
            groups.setdefault((tuple(until), steps), []).append(i)
        out = [""] * len(requests)
        for (until, steps), idx in groups.items():
            contexts = [self.tok_encode(requests[i].args[0]) for i in idx]
            news = self.scorer.greedy(contexts, steps, self.eot_token_id)
            for i, new in zip(idx, news):
                text = self.tok_decode(new)
                for stop in until:
                    if stop:
                        text = text.split(stop)[0]
                out[i] = text
                self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return out
