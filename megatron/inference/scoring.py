"""Scoring text with the model, the way lm-eval's LM interface asks for it, without lm-eval:

- loglikelihood: log p(continuation | context), summed over the continuation's tokens, and whether
  greedy decoding would have produced the continuation;
- rolling loglikelihood: log p(text) of a whole text in windows of the model's context length.

Requests are sorted by length and batched (right padding: a causal model's outputs at real tokens
never see the padding after them, and dropless MoE routes every token on its own).
"""

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

from megatron.data.tokenizer import Tokenizer
from megatron.errors import ConfigError
from megatron.inference.mode import require_inference_mode
from megatron.model import GPTModel

Request = tuple[list[int], list[int]]  # (context ids, continuation ids)


class Score(NamedTuple):
    logprob: float  # summed over the continuation's tokens
    is_greedy: bool  # every continuation token is the model's argmax


def encode_pair(tokenizer: Tokenizer, context: str, continuation: str) -> Request:
    """Token ids of a context and its continuation, as lm-eval's HF model does: trailing spaces of
    the context move to the continuation, and the continuation is what tokenizing the joined text
    adds after the context's tokens. An empty context becomes the end-of-document token."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    if not context:
        return [tokenizer.eod], tokenizer.tokenize(continuation)
    whole, context_ids = tokenizer.tokenize(context + continuation), tokenizer.tokenize(context)
    return context_ids, whole[len(context_ids) :]


@torch.no_grad()
def score_continuations(model: GPTModel, requests: Sequence[Request], batch_size: int = 8) -> list[Score]:
    """Score each continuation after its context. A request longer than the model's context keeps
    its last tokens (the context is cut from the left)."""
    require_inference_mode(model)
    max_len = model.config.max_position_embeddings
    for context, continuation in requests:
        if not context or not continuation:
            raise ConfigError("a scoring request needs at least one context and one continuation token")
        if len(continuation) > max_len:
            raise ConfigError(
                f"a continuation of {len(continuation)} tokens does not fit the model's context of {max_len}"
            )
    device = model.word_embeddings.weight.device
    # the model reads every token but the last; the last len(continuation) outputs predict it
    inputs = [(list(ctx) + list(cont))[-(max_len + 1) : -1] for ctx, cont in requests]
    order = sorted(range(len(requests)), key=lambda i: -len(inputs[i]))
    scores: list[Score | None] = [None] * len(requests)
    for start in range(0, len(order), batch_size):
        rows = order[start : start + batch_size]
        width = len(inputs[rows[0]])
        tokens_BS = torch.zeros(len(rows), width, dtype=torch.long, device=device)
        for b, i in enumerate(rows):
            tokens_BS[b, : len(inputs[i])] = torch.tensor(inputs[i])
        logprobs_BSV = F.log_softmax(model(tokens_BS).logits_BSV.float(), dim=-1)
        for b, i in enumerate(rows):
            target = torch.tensor(requests[i][1], device=device)
            end = len(inputs[i])
            logprobs_CV = logprobs_BSV[b, end - len(target) : end]
            scores[i] = Score(
                float(logprobs_CV.gather(1, target[:, None]).sum()), bool((logprobs_CV.argmax(dim=-1) == target).all())
            )
    return scores


def rolling_windows(tokens: Sequence[int], max_length: int) -> list[Request]:
    """Requests that predict tokens[1:] in disjoint windows of up to `max_length` tokens, each
    read with as much preceding context as the model holds (lm-eval's rolling windows)."""
    requests, start = [], 1
    while start < len(tokens):
        stop = min(start + max_length, len(tokens))
        requests.append((list(tokens[max(0, stop - 1 - max_length) : start]), list(tokens[start:stop])))
        start = stop
    return requests


def rolling_loglikelihoods(
    model: GPTModel, texts: Sequence[Sequence[int]], eod: int, batch_size: int = 8
) -> list[float]:
    """log p(text) of each token list, every token predicted, the first after the end-of-document
    token; the windows of all texts are batched together."""
    windows = [rolling_windows([eod, *tokens], model.config.max_position_embeddings) for tokens in texts]
    scores = iter(score_continuations(model, [w for text in windows for w in text], batch_size))
    return [sum(next(scores).logprob for _ in text) for text in windows]
