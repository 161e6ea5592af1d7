"""The batched sampler: every logit row of a step in one call.

Greedy rows take one argmax; sampled rows are scaled, top-k and top-p filtered together
(per-row k and p as tensors), and drawn together, except rows with their own seed: each of
those draws from its request's generator, so a seeded request gives the same tokens
whatever else shares its batch. Logprobs come from one log-softmax over the rows that want
them. The results reach the host in one transfer.
"""

from __future__ import annotations

import torch

from .sampling import SamplingParams


def _filter(scores: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Apply each row's top-k and top-p to temperature-scaled scores (rows, vocab)."""
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
    return scores


def sample_batch(logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None]) -> list[int]:
    """Next token of every row of float32 ``logits`` (rows, vocab)."""
    tokens = torch.argmax(logits, dim=-1)
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if random_rows:
        index = torch.tensor(random_rows, device=logits.device)
        temps = torch.tensor([params[i].temperature for i in random_rows], device=logits.device)[:, None]
        scores = _filter(logits.index_select(0, index) / temps, [params[i] for i in random_rows])
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
