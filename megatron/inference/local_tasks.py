"""Two zero-shot tasks on local JSONL files, scored without lm-eval, built exactly as lm-eval's
task files build them (tasks/eval_harness/tasks/*.yaml), so both give the same accuracy:

- last word (LAMBADA): {"text": ...}; context = all words but the last, continuation = " " + the
  last word; correct when greedy decoding produces the whole last word.
- two choices (PIQA): {"goal", "sol1", "sol2", "label"}; context = "Question: {goal}\\nAnswer:",
  choices " " + sol1 and " " + sol2; correct when the labelled choice has the higher log-likelihood.
"""

from typing import Any

from megatron.data.tokenizer import Tokenizer
from megatron.inference.scoring import encode_pair, score_continuations
from megatron.model import GPTModel


def last_word_pair(doc: dict[str, Any]) -> tuple[str, str]:
    words = doc["text"].split(" ")
    return " ".join(words[:-1]), " " + words[-1]


def two_choice_pairs(doc: dict[str, Any]) -> list[tuple[str, str]]:
    context = f"Question: {doc['goal']}\nAnswer:"
    return [(context, " " + doc["sol1"]), (context, " " + doc["sol2"])]


def last_word_accuracy(model: GPTModel, tokenizer: Tokenizer, docs: list[dict[str, Any]], batch_size: int = 8) -> float:
    requests = [encode_pair(tokenizer, *last_word_pair(doc)) for doc in docs]
    scores = score_continuations(model, requests, batch_size)
    return sum(score.is_greedy for score in scores) / len(scores)


def two_choice_accuracy(
    model: GPTModel, tokenizer: Tokenizer, docs: list[dict[str, Any]], batch_size: int = 8
) -> float:
    requests = [encode_pair(tokenizer, *pair) for doc in docs for pair in two_choice_pairs(doc)]
    scores = score_continuations(model, requests, batch_size)
    correct = 0
    for i, doc in enumerate(docs):
        first, second = scores[2 * i].logprob, scores[2 * i + 1].logprob
        correct += int(second > first) == int(doc["label"])  # a tie picks the first, as argmax does
    return correct / len(docs)
