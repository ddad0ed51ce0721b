"""A checkpoint of this toolkit as an lm-eval model (its `LM` interface). The scoring itself is in
megatron/inference (tested without lm-eval); this file only translates requests and answers.
Under torchrun with expert parallelism every rank runs every request (the MoE layers exchange
tokens each forward), so the adapter reports a single lm-eval rank."""

import json
from typing import Any

from lm_eval.api.model import LM

from megatron.inference.checkpoint_model import LoadedModel
from megatron.inference.generation import generate_until
from megatron.inference.sampling import SamplingConfig
from megatron.inference.scoring import (
    encode_pair,
    rolling_loglikelihoods,
    score_continuations,
)


class MegatronLM(LM):
    def __init__(self, loaded: LoadedModel, batch_size: int = 8, max_gen_toks: int = 256) -> None:
        super().__init__()
        self.model, self.tokenizer = loaded.model, loaded.tokenizer
        self.batch_size, self.max_gen_toks = batch_size, max_gen_toks

    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = [encode_pair(self.tokenizer, *request.args) for request in requests]
        return [(score.logprob, score.is_greedy) for score in score_continuations(self.model, pairs, self.batch_size)]

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        texts = [self.tokenizer.tokenize(request.args[0]) for request in requests]
        return rolling_loglikelihoods(self.model, texts, self.tokenizer.eod, self.batch_size)

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Requests with the same generation settings run together, batched by context length."""
        groups: dict[str, list[int]] = {}
        for i, request in enumerate(requests):
            groups.setdefault(json.dumps(request.args[1], sort_keys=True, default=str), []).append(i)
        answers = [""] * len(requests)
        for indices in groups.values():
            kwargs = requests[indices[0]].args[1]
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            temperature = float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0
            contexts = [self.tokenizer.tokenize(requests[i].args[0]) for i in indices]
            texts = generate_until(
                self.model,
                self.tokenizer,
                contexts,
                until,
                int(kwargs.get("max_gen_toks", self.max_gen_toks)),
                self.batch_size,
                SamplingConfig(temperature=temperature),
            )
            for i, text in zip(indices, texts):
                answers[i] = text
        return answers
