"""The batched sampler: every logit row of a step in one call.

Rows still short of their ``min_tokens`` cannot draw an end-of-sequence or stop token, and rows
with ``allowed_token_ids`` only those ids (vLLM's logits processors). Rows with a repetition
penalty then have it applied to the logits of every token in their
prompt and output so far (greedy rows too, as in transformers and vLLM). Greedy rows then take
one argmax; sampled rows are scaled, top-k, top-p and min-p filtered together (per-row
values as tensors; transformers' order: temperature, top-k, top-p, min-p), and drawn
together, except rows with their own seed: each of those draws from its request's
generator, so a seeded request gives the same tokens whatever else shares its batch.
Logprobs come from one log-softmax over the raw logits of the rows that want them. The
results reach the host in one transfer.
"""

from __future__ import annotations

import torch

from ..sampling_params import SamplingParams


def allowed_mask(ids: list[int], vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """(vocab,) bool: True at the ``ids`` a row may draw (ids past ``vocab`` ignored). Built once
    per request (the engine keeps it with the sequence): rebuilt every step, a list of millions
    of ids cost seconds a step, stalling every request in the batch."""
    keep = torch.zeros(vocab, dtype=torch.bool, device=device)
    index = torch.tensor(ids, dtype=torch.long, device=device)
    keep[index[index < vocab]] = True
    return keep


def restrict(logits: torch.Tensor, params: list[SamplingParams], generated: list[int] | None,
             eos_token_ids: frozenset[int] = frozenset(),
             masks: list[torch.Tensor | None] | None = None) -> torch.Tensor:
    """Set to -inf the logits a row may not draw: its stop token ids and (unless it ignores them)
    ``eos_token_ids`` while it has generated fewer than ``min_tokens`` (``generated``: tokens
    so far per row), and every id outside its ``allowed_token_ids`` (``masks``: each row's
    :func:`allowed_mask`, built when its request was added; None: built here)."""
    vocab, device = logits.shape[1], logits.device
    rows, cols = [], []
    for i, p in enumerate(params):
        if generated is not None and generated[i] < p.min_tokens:
            ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
            ids = [t for t in ids if 0 <= t < vocab]
            rows += [i] * len(ids)
            cols += ids
    allowed = [i for i, p in enumerate(params) if p.allowed_token_ids is not None]
    if not rows and not allowed:
        return logits
    logits = logits.clone()
    if rows:
        logits[torch.tensor(rows, device=device), torch.tensor(cols, device=device)] = float("-inf")
    if allowed:
        keep = torch.stack([masks[i] if masks is not None and masks[i] is not None
                            else allowed_mask(params[i].allowed_token_ids, vocab, device) for i in allowed])
        index = torch.tensor(allowed, device=device)
        logits.index_copy_(0, index, logits.index_select(0, index).masked_fill(~keep, float("-inf")))
    return logits


def penalize(logits: torch.Tensor, params: list[SamplingParams],
             histories: list[list[int] | None] | None) -> torch.Tensor:
    """Apply each row's repetition penalty (transformers' rule: a seen token's logit is divided
    by the penalty when positive, multiplied when negative) over its ``histories`` entry (the
    prompt and output so far); rows without a penalty are left alone."""
    rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    if not rows:
        return logits
    device = logits.device
    seen = torch.zeros(len(rows), logits.shape[1], dtype=torch.bool, device=device)
    row_of = torch.tensor([j for j, i in enumerate(rows) for _ in histories[i]], dtype=torch.long, device=device)
    token_of = torch.tensor([t for i in rows for t in histories[i]], dtype=torch.long, device=device)
    seen[row_of, token_of] = True
    index = torch.tensor(rows, device=device)
    penalty = torch.tensor([params[i].repetition_penalty for i in rows], device=device, dtype=logits.dtype)[:, None]
    picked = logits.index_select(0, index)
    penalized = torch.where(seen, torch.where(picked < 0, picked * penalty, picked / penalty), picked)
    return logits.index_copy(0, index, penalized)


def _filter(scores: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Apply each row's top-k, top-p and min-p to temperature-scaled scores (rows, vocab)."""
    device = scores.device
    if any(p.top_k for p in params):
        vocab = scores.shape[1]
        ks = [min(p.top_k, vocab) if p.top_k else vocab for p in params]  # host ints: no device read
        top = torch.topk(scores, max(ks)).values
        kth = top.gather(1, torch.tensor(ks, device=device)[:, None] - 1)
        scores = scores.masked_fill(scores < kth, float("-inf"))
    ps = [p.top_p for p in params]
    if any(p < 1.0 for p in ps):
        top_p = torch.tensor(ps, device=device)[:, None]
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
        probs = torch.softmax(sorted_scores, dim=-1)
        drop = (probs.cumsum(-1) - probs > top_p) & (top_p < 1.0)  # keep the smallest set reaching top_p
        scores = scores.scatter(1, order, sorted_scores.masked_fill(drop, float("-inf")))
    min_ps = [p.min_p for p in params]
    if any(min_ps):
        probs = torch.softmax(scores, dim=-1)
        floor = torch.tensor(min_ps, device=device)[:, None] * probs.amax(dim=-1, keepdim=True)
        scores = scores.masked_fill(probs < floor, float("-inf"))  # the likeliest token always stays
    return scores


def _warp(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p, for rows that sample (temperature > 0)."""
    temps = torch.tensor([p.temperature for p in params], device=logits.device)[:, None]
    return _filter(logits / temps, params)


def sampling_scores(logits: torch.Tensor, params: list[SamplingParams],
                    histories: list[list[int] | None] | None = None, generated: list[int] | None = None,
                    eos_token_ids: frozenset[int] = frozenset(),
                    masks: list[torch.Tensor | None] | None = None) -> torch.Tensor:
    """The scores each (non-greedy) row samples from: softmax of these is its distribution."""
    return _warp(penalize(restrict(logits, params, generated, eos_token_ids, masks), params, histories), params)


def sample_batch(logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None],
                 histories: list[list[int] | None] | None = None, generated: list[int] | None = None,
                 eos_token_ids: frozenset[int] = frozenset(),
                 masks: list[torch.Tensor | None] | None = None) -> list[int]:
    """Next token of every row of float32 ``logits`` (rows, vocab); ``histories`` holds the
    prompt and output tokens of each row with a repetition penalty (None elsewhere);
    ``generated``, ``eos_token_ids`` and ``masks``: :func:`restrict`."""
    logits = penalize(restrict(logits, params, generated, eos_token_ids, masks), params, histories)
    tokens = torch.argmax(logits, dim=-1)
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if random_rows:
        index = torch.tensor(random_rows, device=logits.device)
        scores = _warp(logits.index_select(0, index), [params[i] for i in random_rows])
        probs = torch.softmax(scores, dim=-1)
        unseeded = [j for j, i in enumerate(random_rows) if generators[i] is None]
        if unseeded:
            picks = torch.multinomial(probs[unseeded], 1).squeeze(1)
            tokens[index[unseeded]] = picks
        for j, i in enumerate(random_rows):
            if generators[i] is not None:  # the request's own generator lives on the host
                tokens[i] = torch.multinomial(probs[j].cpu(), 1, generator=generators[i]).to(tokens.device)[0]
    return tokens.tolist()


def logprobs_batch(logits: torch.Tensor, tokens: list[int], ks: list[int]) -> list[dict]:
    """{token, logprob, top: {id: logprob}} per row: the chosen token and the k best."""
    logp = torch.log_softmax(logits, dim=-1)
    chosen = logp.gather(1, torch.tensor(tokens, device=logits.device)[:, None]).squeeze(1).tolist()
    k_max = max(ks, default=0)
    top_values, top_ids = ([], [])
    if k_max:
        top = torch.topk(logp, k_max, dim=-1)
        top_values, top_ids = top.values.tolist(), top.indices.tolist()
    out = []
    for row, (token, k) in enumerate(zip(tokens, ks)):
        top_k = dict(zip(top_ids[row][:k], top_values[row][:k])) if k else {}
        out.append({"token": token, "logprob": chosen[row], "top": top_k})
    return out
