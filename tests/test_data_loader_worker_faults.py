"""An error raised inside a DataLoader worker (issue 29): torch re-raises it in the main process as
"Caught DataError in DataLoader worker process 0" over the worker's traceback; the loader's
iterator must raise the worker's one sentence instead, and leave every other error as torch has it.
"""

import numpy as np
import pytest
import torch

from megatron.data.gpt_dataset import GPTDataset
from megatron.data.loader import build_pretraining_loader
from megatron.errors import DataError
from tests.test_gpt_dataset import write_corpus

SENTENCE = "token id 99 is outside the vocabulary of 61 ids; preprocess the data with the same tokenizer as training."


class RaisingDataset(torch.utils.data.Dataset):
    """Eight samples; reading sample 2 raises `error` (a fault injected through the constructor)."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        if i == 2:
            raise self.error
        return {"text": np.arange(5)}


@pytest.mark.parametrize("num_workers", [1, 0], ids=["in a worker", "in this process"])
def test_a_data_error_is_raised_as_its_own_sentence(num_workers):
    batches = iter(build_pretraining_loader(RaisingDataset(DataError(SENTENCE)), 0, 2, 0, 1, num_workers))
    assert next(batches)["text"].shape == (2, 5)
    with pytest.raises(DataError) as error:
        next(batches)
    assert str(error.value) == SENTENCE


def test_a_token_outside_the_vocabulary_read_in_a_worker_is_its_own_sentence(tmp_path):
    indexed = write_corpus(tmp_path / "d", [30] * 10)  # ids 0..299
    dataset = GPTDataset("train", indexed, np.arange(10), 20, 8, seed=1, vocab_size=61)
    with pytest.raises(DataError) as error:
        next(iter(build_pretraining_loader(dataset, 0, 2, 0, 1, num_workers=1)))
    message = str(error.value)
    assert message.startswith(f"{tmp_path}/d: document ") and "\n" not in message, message
    assert message.endswith(
        "outside the vocabulary of 61 ids; preprocess the data with the same tokenizer as training."
    )


def test_a_bug_in_a_worker_keeps_torch_s_traceback():
    """Not a UserError: a bug, whose traceback is what its reader needs."""
    batches = iter(build_pretraining_loader(RaisingDataset(ZeroDivisionError("division by zero")), 0, 2, 0, 1, 1))
    next(batches)
    with pytest.raises(ZeroDivisionError) as error:
        next(batches)
    assert str(error.value).startswith("Caught ZeroDivisionError in DataLoader worker process 0.\nOriginal Traceback")
