"""Autoregressive generation with a KV cache: the prompt runs once, then each step feeds only the
new token. `use_cache=False` reruns the whole sequence every step (the reference the cache must
match). Under torchrun with expert parallelism every rank runs the same steps on the same tokens
(rank 0's choice is broadcast), since the MoE layers exchange tokens between ranks each step.

Shapes: B prompts (of equal length), S prompt length, V vocabulary.
"""

from collections.abc import Callable

import torch
import torch.distributed as dist

from megatron import comm
from megatron.data.tokenizer import Tokenizer
from megatron.errors import ConfigError
from megatron.inference.mode import require_inference_mode
from megatron.inference.sampling import SamplingConfig, sample_next
from megatron.model import GPTModel

StopFn = Callable[[list[int]], bool]


def _agree(tokens_B: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size() > 1:
        comm.broadcast(tokens_B, src=0)
    return tokens_B


@torch.no_grad()
def generate(
    model: GPTModel,
    prompt_BS: torch.Tensor,
    max_new_tokens: int,
    eod: int | None = None,
    sampling: SamplingConfig = SamplingConfig(),
    vocab_size: int | None = None,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
    stop: StopFn | None = None,
) -> list[list[int]]:
    """The new tokens of each row, ending before its first `eod`, when `stop(tokens so far)` is
    true, after `max_new_tokens`, or when the model's context is full. `vocab_size` (the
    tokenizer's) keeps padded vocabulary ids from being chosen."""
    require_inference_mode(model)
    batch, prompt_len = prompt_BS.shape
    max_len = model.config.max_position_embeddings
    if prompt_len >= max_len:
        raise ConfigError(
            f"the prompt has {prompt_len} tokens but the model's context holds {max_len}; shorten the prompt"
        )
    total = min(prompt_len + max_new_tokens, max_len)
    cache = model.new_kv_cache(batch, total) if use_cache else None
    tokens_BT = prompt_BS
    logits_BV = model(prompt_BS, kv_cache=cache).logits_BSV[:, -1]
    new: list[list[int]] = [[] for _ in range(batch)]
    done = [max_new_tokens <= 0] * batch
    while not all(done):
        next_B = _agree(sample_next(logits_BV[:, :vocab_size], sampling, generator))
        for row, token in enumerate(next_B.tolist()):
            if done[row]:
                continue
            if token == eod:
                done[row] = True
                continue
            new[row].append(token)
            done[row] = len(new[row]) >= max_new_tokens or (stop is not None and stop(new[row]))
        tokens_BT = torch.cat([tokens_BT, next_B[:, None]], dim=1)
        if tokens_BT.shape[1] >= total:
            break
        output = model(next_B[:, None], kv_cache=cache) if use_cache else model(tokens_BT)
        logits_BV = output.logits_BSV[:, -1]
    return new


def generate_until(
    model: GPTModel,
    tokenizer: Tokenizer,
    contexts: list[list[int]],
    until: list[str],
    max_new_tokens: int,
    batch_size: int = 8,
    sampling: SamplingConfig = SamplingConfig(),
) -> list[str]:
    """Text generated after each context, cut before the first of the `until` strings (lm-eval's
    generate_until). Contexts of equal length run as one batch; one too long keeps its last tokens."""
    contexts = [c[-(model.config.max_position_embeddings - 1) :] or [tokenizer.eod] for c in contexts]
    device = model.word_embeddings.weight.device
    stop = (lambda ids: any(s in tokenizer.detokenize(ids) for s in until)) if until else None
    by_length: dict[int, list[int]] = {}
    for i, context in enumerate(contexts):
        by_length.setdefault(len(context), []).append(i)
    texts = [""] * len(contexts)
    for rows in by_length.values():
        for start in range(0, len(rows), batch_size):
            batch = rows[start : start + batch_size]
            prompt_BS = torch.tensor([contexts[i] for i in batch], device=device)
            new = generate(model, prompt_BS, max_new_tokens, tokenizer.eod, sampling, tokenizer.vocab_size, stop=stop)
            for i, ids in zip(batch, new):
                texts[i] = tokenizer.detokenize(ids)
                for s in until:
                    texts[i] = texts[i].split(s, 1)[0]
    return texts
