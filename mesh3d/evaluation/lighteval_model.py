"""mesh3d's model as a lighteval model (`lighteval.models.abstract_model.LightevalModel`).

Requests are turned into tokens as lighteval's transformers backend turns them
(`TransformersModel`, 0.13): the prompt from lighteval's `PromptManager`, each choice tokenized
apart from its context (`tok_encode_pair(..., pairwise=True)`, special tokens added to the
context), a pair cut from the left to the model's length; a generation gets at most the task's
`generation_size` new tokens (what is left of the length when it has none), stops at the eos
token and the task's stop sequences, and its decoded text is cut before each of them. The
numbers come from `scorer.Scorer`, shared with the lm-eval model, so on the same weights they
are the transformers backend's at any dp x tp x pp. Perplexity tasks are scored in lm-eval's
rolling windows (`Scorer.rolling`).

Every rank runs the whole pipeline with the same requests (each batch one collective forward);
only global rank 0 writes results (`lighteval_run.py`, which also turns lighteval's sample
cache off: it is keyed by the model's name, and would hand a later checkpoint an earlier one's
answers).
"""

from __future__ import annotations

import os

from lighteval.models.abstract_model import LightevalModel, ModelConfig
from lighteval.models.model_output import ModelResponse
from lighteval.tasks.prompt_manager import PromptManager
from lighteval.tasks.requests import Doc

from mesh3d.evaluation.scorer import Scorer


class Mesh3dLightevalModel(LightevalModel):
    """`scorer` and `tokenizer` (a transformers tokenizer) for lighteval; `name` goes into the
    results' paths (`results/<name>/`)."""

    def __init__(self, scorer: Scorer, tokenizer, name: str = "mesh3d", chat: bool = False):
        self.scorer, self._tokenizer = scorer, tokenizer
        self.config = ModelConfig(model_name=name)
        self.prompts = PromptManager(use_chat_template=chat, tokenizer=tokenizer)
        self.chat = chat

    @property
    def tokenizer(self):
        return self._tokenizer

    @property
    def add_special_tokens(self) -> bool:
        return True  # as the transformers backend's default

    @property
    def max_length(self) -> int:
        return self.scorer.length

    @property
    def disable_tqdm(self) -> bool:
        return os.environ.get("RANK", "0") != "0"

    @property
    def _prefix(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    def loglikelihood(self, docs: list[Doc]) -> list[ModelResponse]:
        pairs, owner, contexts = [], [], []
        for i, doc in enumerate(docs):
            ctx, conts = self.tok_encode_pair(self.prompts.prepare_prompt(doc), doc.choices,
                                              pairwise=True)  # fmt: skip
            contexts.append(ctx[0] if ctx else [])
            for c, k in zip(ctx, conts):
                pairs.append((c or [self._prefix], k))  # an empty context: the prefix token
                owner.append(i)
        scores = self.scorer.continuations(pairs, self.max_length)
        out = [ModelResponse(input_tokens=c) for c in contexts]
        for i, (logp, greedy), (_, cont) in zip(owner, scores, pairs):
            out[i].logprobs.append(logp)
            out[i].argmax_logits_eq_gold.append(greedy)
            out[i].output_tokens.append(cont)
        return out

    def loglikelihood_rolling(self, docs: list[Doc]) -> list[ModelResponse]:
        tokens = [self.tok_encode(doc.query, add_special_tokens=False) for doc in docs]
        totals = self.scorer.rolling(tokens, self._prefix)
        return [ModelResponse(logprobs=[t], input_tokens=x) for t, x in zip(totals, tokens)]

    def greedy_until(self, docs: list[Doc]) -> list[ModelResponse]:
        eos = self.tokenizer.eos_token
        asks = []
        for doc in docs:
            if (doc.num_samples or 1) > 1:
                raise ValueError(f"task {doc.task_name}: {doc.num_samples} samples a prompt "
                                 "need sampling; mesh3d eval decodes greedily")  # fmt: skip
            context = self.tok_encode(self.prompts.prepare_prompt(doc))
            room = self.max_length - len(context)
            steps = max(1, min(doc.generation_size or room, room))
            stops = (eos,) if self.chat else (eos, *(doc.stop_sequences or ()))
            asks.append((context, steps, tuple(s for s in stops if s)))
        got = self.scorer.greedy_until(asks, self._decode, self.tokenizer.eos_token_id)
        return [ModelResponse(text=[text], output_tokens=[new], input_tokens=context)
                for (text, new), (context, _, _) in zip(got, asks)]  # fmt: skip

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)
