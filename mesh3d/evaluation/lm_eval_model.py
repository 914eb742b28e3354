"""mesh3d's model as an lm-evaluation-harness model (`lm_eval.api.model.TemplateLM`).

lm-eval tokenizes requests through `tok_encode` (the checkpoint's tokenizer as transformers
loads it, without special tokens, as its own `hf` model does) and hands token lists to
`_loglikelihood_tokens`; the rolling log-likelihood cuts a document into the same disjoint
windows as the `hf` model (`Scorer.rolling`); `generate_until` decodes greedily and cuts the
text at the first stop sequence (`Scorer.greedy_until`, shared with `lighteval_model.py`). So on the same weights the numbers are
the `hf` model's, at any tp x pp.

Every rank of the model's world runs the whole evaluation with the same requests (the model
says rank 0 of world 1 to lm-eval, which then splits nothing): each batch is one collective
forward, and only global rank 0 writes the results (`cli.py`).
"""

from __future__ import annotations

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
        out = self.scorer.continuations([(c, k) for _, c, k in requests], self.max_length + 1)
        for (key, _, _), result in zip(requests, out):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, result)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        docs = [self.tok_encode(req.args[0]) for req in requests]
        return self.scorer.rolling(docs, self.prefix_token_id)

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        eos_text = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        asks = []
        for req in requests:
            context, kwargs = req.args
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            steps = int(kwargs.get("max_gen_toks", self.max_gen_toks))
            asks.append((self.tok_encode(context), steps, (*until, eos_text)))
        out = self.scorer.greedy_until(asks, self.tok_decode, self.eot_token_id)
        for req, (text, _) in zip(requests, out):
            self.cache_hook.add_partial("generate_until", req.args, text)
        return [text for text, _ in out]
