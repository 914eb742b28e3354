"""Log-likelihoods and greedy continuations of token sequences on a model at any tp x pp.

Every rank of the model's world calls the same method with the same sequences (an evaluation
engine runs whole on every rank, `lm_eval_model.py`) and gets the same numbers back: the last
pipeline stage's tp ranks gather the vocabulary-sharded logits, compute each position's
log-probability of its target (fp32 log-softmax over the real vocabulary) and whether it is the
arg-max, and the picking rank (tp rank 0 of the last stage) broadcasts both to every rank.

Sequences are scored in batches of the model's microbatch size, longest first (less padding),
right-padded: under causal attention the padding after a position changes nothing there. With
pipeline stages every batch has the built shape (rows and length) since the stages exchange
activations of that shape; on one stage a batch is as long as its longest sequence.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from mesh3d.generation.parallel import ParallelModel, generate_parallel
from mesh3d.parallel.pipeline_forward import forward_walk


def token_outputs(logits: Tensor, targets: Tensor) -> Tensor:
    """[3, B, n]: each target's log-probability under `logits` [B, n, V] (fp32, the real
    vocabulary), whether it is the arg-max (1.0 / 0.0), and the arg-max (ids < 2**24 are exact
    in fp32)."""
    logp = torch.log_softmax(logits, dim=-1).gather(-1, targets[..., None])[..., 0]
    top = logits.argmax(-1)
    return torch.stack([logp, (top == targets).float(), top.float()])


class Scorer:
    """`model` (`generation.parallel.load_parallel_model`) as a scoring function."""

    def __init__(self, model: ParallelModel):
        self.model = model
        dims = model.layout.dims
        # pipeline stages take the built shape only; dp replicas take equal slices
        self.fixed = model.parts.schedule is not None or dims.dp > 1
        self.batch = model.layout.microbatch_size * dims.dp  # rows per call, over the replicas
        self.length = model.layout.sequence_length  # the longest input (a sequence is one more)
        self.vocab = model.layout.vocab_size

    @torch.no_grad()
    def score(self, seqs: list[list[int]], spans: list[int]) -> list[tuple[float, bool]]:
        """For each sequence of at most `length` + 1 tokens: the summed log-probability of its
        last `span` tokens given the ones before each, and whether greedy decoding picks them
        all."""
        order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i]))
        out: list[tuple[float, bool] | None] = [None] * len(seqs)
        for at in range(0, len(order), self.batch):
            rows = order[at : at + self.batch]
            for i in rows:
                if not 2 <= len(seqs[i]) <= self.length + 1 or not 1 <= spans[i] < len(seqs[i]):
                    raise ValueError(f"sequence {i}: {len(seqs[i])} tokens, span {spans[i]}; "
                                     f"the model takes 2 to {self.length + 1}")  # fmt: skip
            n = self.length if self.fixed else len(seqs[rows[0]]) - 1
            b = self.batch if self.fixed else len(rows)
            x = torch.zeros(b, n, dtype=torch.int64)
            targets = torch.zeros(b, n, dtype=torch.int64)
            for r, i in enumerate(rows):
                s = torch.tensor(seqs[i])
                x[r, : len(s) - 1], targets[r, : len(s) - 1] = s[:-1], s[1:]
            logp, hit, _ = self._token_scores(x, targets)
            for r, i in enumerate(rows):
                m, k = len(seqs[i]) - 1, spans[i]
                out[i] = (float(logp[r, m - k : m].double().sum()), bool(hit[r, m - k : m].all()))
        return out  # type: ignore[return-value]

    def continuations(self, pairs: list[tuple[list[int], list[int]]],
                      keep: int) -> list[tuple[float, bool]]:  # fmt: skip
        """`score` of each (context, continuation) token pair cut from the left to its last
        `keep` tokens (at most `length` + 1): the continuation's summed log-probability and
        whether greedy decoding picks it."""
        seqs = [(context + continuation)[-keep:] for context, continuation in pairs]
        spans = [min(len(c), len(s) - 1) for (_, c), s in zip(pairs, seqs)]
        return self.score(seqs, spans)

    def rolling(self, docs: list[list[int]], prefix: int) -> list[float]:
        """Each token list's log-likelihood, scored in disjoint windows of `length` predicted
        tokens, each window's input the `length` tokens before its last one (the first
        window's starts at `prefix`): lm-eval's rolling windows with a context of one."""
        n, seqs, spans, owner = self.length, [], [], []
        for i, tokens in enumerate(docs):
            full = [prefix, *tokens]  # full[j + 1] is tokens[j]
            for start in range(0, len(tokens), n):
                end = min(start + n, len(tokens))
                seqs.append(full[max(0, end - n) : end + 1])
                spans.append(end - start)
                owner.append(i)
        totals = [0.0] * len(docs)
        for i, (logp, _) in zip(owner, self.score(seqs, spans)):
            totals[i] += logp
        return totals

    def greedy_until(self, requests: list[tuple[list[int], int, tuple[str, ...]]], decode,
                     eos: int | None) -> list[tuple[str, list[int]]]:  # fmt: skip
        """Each (context tokens, most new tokens, stop texts) request's greedy continuation
        as (its text from `decode`, cut before the first of each stop text in turn; its new
        tokens); requests with the same budget and stops run batched together."""
        groups: dict[tuple, list[int]] = {}
        for i, (_, steps, stops) in enumerate(requests):
            groups.setdefault((steps, tuple(stops)), []).append(i)
        out: list[tuple[str, list[int]]] = [("", [])] * len(requests)
        for (steps, stops), idx in groups.items():
            news = self.greedy([requests[i][0] for i in idx], steps, eos)
            for i, new in zip(idx, news):
                text = decode(new)
                for stop in stops:
                    if stop:
                        text = text.split(stop)[0]
                out[i] = (text, new)
        return out

    def _token_scores(self, x: Tensor, targets: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(log-probability of each target [B, n] fp32, whether it is the arg-max [B, n], the
        arg-max [B, n]) on every rank; each dp replica computes its slice of the B rows, and one
        all-reduce over the world, to which only each replica's picking rank adds, gives every
        rank all of them."""
        model, device = self.model, self.model.device
        rows = x.shape[0]
        per, d = rows // model.layout.dims.dp, model.layout.coords["dp"]
        x, targets = (
            x[d * per : (d + 1) * per].to(device),
            targets[d * per : (d + 1) * per].to(device),
        )

        def scores(logits: Tensor, _) -> Tensor:
            if isinstance(logits, DTensor):
                logits = logits.full_tensor()
            return token_outputs(logits[..., : self.vocab].float(), targets)

        parts = model.parts
        if parts.schedule is None:
            got = scores(parts.modules[0](x), None)
        else:
            act = model.layout.activation()
            act = torch.empty((x.shape[0], x.shape[1], act.shape[-1]), dtype=act.dtype,
                              device="meta")  # fmt: skip
            done = forward_walk(parts.stages, 1, x, x, None, scores, act)
            got = done[0] if done else None
        out = torch.zeros(3, rows, x.shape[1], device=device)
        if got is not None and (not dist.is_initialized() or dist.get_rank() == model.picker):
            out[:, d * per : (d + 1) * per] = got
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(out)
        out = out.cpu()
        return out[0], out[1].bool(), out[2].long()

    @torch.no_grad()
    def greedy(self, contexts: list[list[int]], max_new: int, eos: int | None) -> list[list[int]]:
        """Each context's greedy continuation of up to `max_new` tokens (ending at `eos`),
        batched as the model was built (the last batch filled with copies)."""
        from mesh3d.generation.cache import left_pad
        from mesh3d.generation.single import new_tokens

        room = self.length - max_new
        if room < 1:
            raise ValueError(f"{max_new} new tokens leave no room for a context in "
                             f"{self.length}")  # fmt: skip
        out: list[list[int]] = []
        dp, d = self.model.layout.dims.dp, self.model.layout.coords["dp"]
        per = self.batch // dp
        for at in range(0, len(contexts), self.batch):
            chunk = [c[-room:] for c in contexts[at : at + self.batch]]
            rows = chunk + [chunk[-1]] * (self.batch - len(chunk))
            ids, pads = left_pad(rows[d * per : (d + 1) * per], 0)  # this replica's rows
            got = generate_parallel(self.model, ids, max_new, eos=eos,
                                    pads=pads if pads.any() else None)  # fmt: skip
            mine = new_tokens(got.tolist(), ids.shape[1], eos)
            if dp > 1:  # every replica's rows, in replica order
                everyone: list = [None] * dist.get_world_size()
                dist.all_gather_object(everyone, (d, mine))
                by_replica = dict(everyone)
                mine = [row for r in range(dp) for row in by_replica[r]]
            out += mine[: len(chunk)]
        return out
