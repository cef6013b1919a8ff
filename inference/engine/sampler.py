"""Sampler: one token per row of a batch's logits, under each request's sampling parameters (vLLM's order).

Sampling is batched over rows (greedy ``argmax`` for temperature 0; one inverse-CDF draw per row otherwise) with
per-request randomness from a ``random.Random(seed)`` owned by the request (``Sequence.rng``), so a seeded request's
tokens do not depend on its batch companions (up to float rounding of the logits).
"""

from __future__ import annotations

from typing import Any

import torch

from inference.protocol.engine import SamplingParams

from .sequence import Sequence
from .structured import GrammarMask

_LARGE_LOGIT = 1e30  # stands in for +inf after the penalties: finite even divided by the smallest temperature

LogprobEntry = list[Any]
"""``[sampled_logprob, [[id, logprob], ...top-k]]`` of one sampled token."""


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """``torch.argmax(logits, dim=-1)`` of ``[B, vocab]`` logits (same result, ties to the lowest id), on the CPU in
    two passes when the vocabulary splits into blocks of 128, 64 or 32: the block holding each row's maximum (block
    maxima by ``amax``, then the first block that holds it), then the maximum within that block. ``argmax`` over a
    long row has no vectorised CPU kernel and ``amax`` has: [16, 151,680] float32 on 2 threads, 1.0-1.3 ms against
    0.14 ms (D-295), ~8 % of a 16-sequence decode step of the demo model. Logits must hold no NaN (``sample``
    replaces them first). Elsewhere (CUDA, other vocabularies) it is ``torch.argmax``."""
    rows, vocab = logits.shape
    block = next((b for b in (128, 64, 32) if vocab % b == 0), 0)
    if logits.device.type != "cpu" or not block or not logits.is_contiguous():
        return torch.argmax(logits, dim=-1)
    blocks = logits.view(rows, vocab // block, block)
    first = blocks.amax(dim=-1).argmax(dim=-1)  # argmax: the first block holding the row's maximum
    inner = blocks[torch.arange(rows, device=logits.device), first].argmax(dim=-1)
    return first * block + inner


class Sampler:
    """Picks the next token of each sequence of a batch.

    Args:
        device: where the logits are (and the sampler's own tensors go).
        sample_vocab: ids the served tokenizer can decode; logits at or above it are never picked (embedding
            padding of the model's head).
    """

    def __init__(self, device: torch.device, sample_vocab: int):
        self.device = device
        self.sample_vocab = sample_vocab

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, seqs: list[Sequence], grammar: GrammarMask | None = None
               ) -> tuple[list[int], list[LogprobEntry | None] | None]:
        """Pick one token per row of ``logits`` ``[B, vocab]`` (modified in place) for ``seqs`` (same order).

        Applies, as vLLM does: the structured-output mask of ``grammar`` (its rows' disallowed tokens to -inf),
        logit_bias, min_tokens (EOS/stop masked; not on a row the grammar constrains: the grammar decides where
        its output ends), repetition / presence / frequency penalties, temperature (0 = greedy), top_k, top_p,
        min_p. A -inf logit stays -inf under every later step, so the mask may come first. Logprobs (when asked)
        come from the model's distribution after the grammar mask and before anything else (vLLM's default
        ``raw_logprobs``; vLLM applies the grammar bitmask to the logits before its sampler).
        Returns (token ids, per-row logprob entries or None) where an entry is
        ``[sampled_logprob, [[id, logprob], ...top-k]]`` or None for rows that did not ask.
        """
        self._restrict_vocab(logits, seqs)
        if grammar is not None:
            grammar.apply(logits)
        constrained = set(grammar.row_list) if grammar is not None else set()
        want_lp = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        raw_lp = torch.log_softmax(logits[want_lp], dim=-1) if want_lp else None
        for i, s in enumerate(seqs):
            self._apply_request_rules(logits[i], s, i not in constrained)
        # a penalty at the edge of its range (repetition_penalty 5e-324 is 0 in float32: x / 0 = inf) must not
        # turn the row into NaN probabilities, whose inverse-CDF pick is past the vocabulary: +inf becomes a large
        # finite logit (those tokens share the mass), NaN a disallowed one
        torch.nan_to_num_(logits, nan=float("-inf"), posinf=_LARGE_LOGIT)
        tokens = self._pick(logits, seqs)
        if raw_lp is None:
            return tokens, None
        return tokens, self._logprob_entries(raw_lp, want_lp, tokens, seqs)

    def _restrict_vocab(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """Ids past the served tokenizer's vocabulary, and past a request's own ``vocab_size``, to -inf."""
        v = logits.shape[1]
        if self.sample_vocab < v:
            logits[:, self.sample_vocab:] = float("-inf")
        for i, s in enumerate(seqs):  # the served tokenizer may decode fewer ids than the model has
            limit = s.params.vocab_size
            if 0 < limit < min(v, self.sample_vocab):
                logits[i, limit:] = float("-inf")

    def _apply_request_rules(self, row: torch.Tensor, s: Sequence, min_tokens_applies: bool) -> None:
        """logit_bias, min_tokens (when ``min_tokens_applies``: the grammar does not constrain the row) and the
        repetition / presence / frequency penalties of ``s`` on its logits ``row`` ``[vocab]``."""
        sp = s.params
        if s.bias_ids is not None and s.bias_vals is not None:  # set together (``prepare``)
            row.index_add_(0, s.bias_ids, s.bias_vals)
        if len(s.output_token_ids) < sp.min_tokens and min_tokens_applies:
            blocked = list(sp.stop_token_ids) + ([] if sp.ignore_eos else list(sp.eos_token_ids))
            blocked = [t for t in blocked if 0 <= t < row.shape[0]]
            if blocked:
                row[blocked] = float("-inf")
        if sp.repetition_penalty != 1.0:
            seen = s.prompt_ids_t
            assert seen is not None  # set by ``prepare`` when repetition_penalty != 1
            if s.output_token_ids:
                seen = torch.cat([seen, torch.tensor(s.output_token_ids, device=self.device)])
            seen = torch.unique(seen)
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / sp.repetition_penalty, vals * sp.repetition_penalty)
        if (sp.presence_penalty or sp.frequency_penalty) and s.output_token_ids:
            out_ids = torch.tensor(s.output_token_ids, device=self.device)
            uniq, counts = torch.unique(out_ids, return_counts=True)
            row[uniq] -= sp.frequency_penalty * counts.to(row.dtype) + sp.presence_penalty

    def _pick(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """The greedy pick of every row, replaced on rows with a temperature by one inverse-CDF draw from
        ``_probs`` (the request's own random source)."""
        temps = [s.params.temperature for s in seqs]
        chosen = greedy_argmax(logits)
        sampled_rows = [i for i, t in enumerate(temps) if t > 0]
        if sampled_rows:
            rows = torch.tensor(sampled_rows, device=self.device)
            x = logits[rows] / torch.tensor([temps[i] for i in sampled_rows], device=self.device).unsqueeze(1)
            cdf = torch.cumsum(self._probs(x, [seqs[i].params for i in sampled_rows]), dim=-1)
            u = torch.tensor([seqs[i].rng.random() for i in sampled_rows], device=self.device,
                             dtype=cdf.dtype).unsqueeze(1)
            pick = torch.searchsorted(cdf, (u * cdf[:, -1:]).contiguous(), right=True).squeeze(1)
            chosen[rows] = pick.clamp(max=logits.shape[1] - 1)
        tokens: list[int] = chosen.tolist()
        return tokens

    def _probs(self, x: torch.Tensor, sub: list[SamplingParams]) -> torch.Tensor:
        """The distribution of each row of tempered logits ``x`` ``[R, vocab]`` after its request's top_k, top_p
        and min_p (``sub``: their sampling parameters, same order); not renormalised (the draw scales by the
        total)."""
        v = x.shape[1]
        ks = [p.top_k if p.top_k and p.top_k > 0 else 0 for p in sub]
        if any(ks):
            kmax = min(max(ks), v)
            top = torch.topk(x, kmax, dim=-1).values
            kk = torch.tensor([min(k, v) if k else kmax for k in ks], device=self.device) - 1
            kth = top.gather(1, kk.unsqueeze(1))
            limited = torch.tensor([bool(k) for k in ks], device=self.device).unsqueeze(1)
            x = torch.where(limited & (x < kth), torch.full_like(x, float("-inf")), x)
        probs = torch.softmax(x, dim=-1)
        ps = [p.top_p for p in sub]
        if any(p < 1.0 for p in ps):
            sp_, si = torch.sort(probs, dim=-1, descending=True)
            csum = torch.cumsum(sp_, dim=-1)
            top_p = torch.tensor(ps, device=self.device, dtype=probs.dtype).unsqueeze(1)
            drop = (csum - sp_) >= top_p  # keep the smallest prefix whose mass reaches top_p
            sp_ = sp_.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(1, si, sp_)
        mps = [p.min_p for p in sub]
        if any(m > 0 for m in mps):
            thr = probs.max(dim=-1, keepdim=True).values * torch.tensor(
                mps, device=self.device, dtype=probs.dtype).unsqueeze(1)
            probs = probs.masked_fill(probs < thr, 0.0)
        return probs

    def _logprob_entries(self, raw_lp: torch.Tensor, want_lp: list[int], tokens: list[int], seqs: list[Sequence]
                         ) -> list[LogprobEntry | None]:
        """Per row, the logprob entry of its sampled token from ``raw_lp`` (the log-softmax of rows ``want_lp``,
        the rows that asked), or None for a row that did not ask."""
        entries: list[LogprobEntry | None] = [None] * len(seqs)
        kmax = max(seqs[i].params.logprobs or 0 for i in want_lp)  # not None: rows in want_lp asked
        tok_t = torch.tensor([tokens[i] for i in want_lp], device=self.device)
        sampled = raw_lp.gather(1, tok_t.unsqueeze(1)).squeeze(1).tolist()
        if kmax > 0:
            top_v, top_i = torch.topk(raw_lp, kmax, dim=-1)
            tv, ti = top_v.tolist(), top_i.tolist()
        for j, i in enumerate(want_lp):
            k = seqs[i].params.logprobs
            top_lps = [[ti[j][n], tv[j][n]] for n in range(k)] if k else []
            entries[i] = [sampled[j], top_lps]
        return entries
