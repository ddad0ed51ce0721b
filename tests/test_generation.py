"""Generation: the KV cache gives exactly what rerunning the whole sequence gives, sampling obeys
its flags, and tools/generate.py loads a checkpoint and writes what `generate` writes."""

import io
import json
import shutil
import sys

import pytest
import torch

from megatron.checkpoint.layout import MANIFEST_FILE
from megatron.checkpoint.manifest import json_checksum, write_manifest
from megatron.checkpoint.verify import read_checkpoint
from megatron.cli.generate import main as generate_main
from megatron.errors import CheckpointError, ConfigError
from megatron.inference.checkpoint_model import load_model
from megatron.inference.generation import generate
from megatron.inference.sampling import SamplingConfig, sample_next
from megatron.model import GPTConfig, GPTModel
from tests.inference_fixtures import (
    one_thread,  # noqa: F401 (autouse: one thread per module)
    tiny_model,
    train_checkpoint,
)
from tests.training_fixtures import write_corpus

MODELS = [(1, "learned_absolute"), (1, "rope"), (4, "learned_absolute"), (4, "rope")]


@pytest.mark.parametrize("experts,position", MODELS)
def test_cached_logits_equal_full_forward(experts, position):
    model = tiny_model(experts, position)
    tokens_BS = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full_BSV = model(tokens_BS).logits_BSV
        cache = model.new_kv_cache(2, 12)
        steps = [model(tokens_BS[:, :5], kv_cache=cache).logits_BSV]  # a prompt, then one token at a time
        steps += [model(tokens_BS[:, t : t + 1], kv_cache=cache).logits_BSV for t in range(5, 12)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full_BSV, rtol=1e-4, atol=1e-5)
    assert cache.length == 12


@pytest.mark.parametrize("experts,position", MODELS)
def test_cached_generation_equals_uncached_token_for_token(experts, position):
    model = tiny_model(experts, position)
    prompt_BS = torch.randint(0, 64, (3, 4), generator=torch.Generator().manual_seed(2))
    cached = generate(model, prompt_BS, 20, use_cache=True)
    uncached = generate(model, prompt_BS, 20, use_cache=False)
    assert cached == uncached
    assert [len(row) for row in cached] == [20, 20, 20]


def test_generation_stops_at_eod_and_at_the_context_length():
    model = tiny_model(max_positions=16, seed=2)  # a seed whose greedy output changes token midway
    prompt_1S = torch.tensor([[3, 1, 4, 1, 5]])
    free = generate(model, prompt_1S, 40)[0]
    assert len(free) == 16 - 5  # the context is full: every position has been used
    first = free.index(free[-1])
    assert 0 < first < len(free) - 1
    stopped = generate(model, prompt_1S, 40, eod=free[-1])[0]
    assert stopped == free[:first]  # the end-of-document token itself is not returned


def test_a_prompt_that_fills_the_context_is_refused():
    model = tiny_model(max_positions=8)
    with pytest.raises(ConfigError, match="context holds 8"):
        generate(model, torch.zeros(1, 8, dtype=torch.long), 4)


def test_generation_refuses_a_model_that_drops_tokens():
    torch.manual_seed(0)
    dropping = GPTModel(
        GPTConfig(
            num_layers=2,
            hidden_size=32,
            num_attention_heads=4,
            vocab_size=64,
            max_position_embeddings=16,
            num_experts=(4,),
        )
    ).eval()
    with pytest.raises(ConfigError, match="drop tokens"):
        generate(dropping, torch.zeros(1, 3, dtype=torch.long), 4)


def test_sampling_flags():
    logits_BV = torch.tensor([[0.0, 3.0, 2.9, 1.0, -1.0]]).repeat(400, 1)
    greedy = sample_next(logits_BV, SamplingConfig())
    assert (greedy == 1).all()
    assert (sample_next(logits_BV, SamplingConfig(temperature=1.0, top_k=1)) == 1).all()
    assert (sample_next(logits_BV, SamplingConfig(temperature=1.0, top_p=0.01)) == 1).all()
    top2 = sample_next(logits_BV, SamplingConfig(temperature=1.0, top_k=2), torch.Generator().manual_seed(0))
    assert set(top2.tolist()) == {1, 2}
    # p(1) + p(2) = 0.83 of the mass: top-p 0.8 needs both, and never reaches the others
    top_p = sample_next(logits_BV, SamplingConfig(temperature=1.0, top_p=0.8), torch.Generator().manual_seed(0))
    assert set(top_p.tolist()) == {1, 2}
    free = sample_next(logits_BV, SamplingConfig(temperature=1.0), torch.Generator().manual_seed(0))
    assert set(free.tolist()) == {0, 1, 2, 3, 4}
    again = sample_next(logits_BV, SamplingConfig(temperature=1.0), torch.Generator().manual_seed(0))
    assert torch.equal(free, again)
    with pytest.raises(ConfigError, match="--top-p"):
        SamplingConfig(temperature=1.0, top_p=0.0)
    with pytest.raises(ConfigError, match="--temperature"):
        SamplingConfig(temperature=-1.0)


def test_padded_vocabulary_ids_are_never_generated():
    model = tiny_model(vocab=64)
    with torch.no_grad():
        model.word_embeddings.weight[50:] = model.word_embeddings.weight[50:] * 0 + 1.0  # make padding ids likely
    prompt_BS = torch.randint(0, 50, (2, 3), generator=torch.Generator().manual_seed(0))
    rows = generate(model, prompt_BS, 10, vocab_size=50)
    assert all(token < 50 for row in rows for token in row)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("generation")
    save = str(folder / "ckpt")
    train_checkpoint(write_corpus(folder), save)
    return save


def test_generate_tool_writes_what_generate_writes(checkpoint, tmp_path, capsys, monkeypatch):
    loaded = load_model(checkpoint)
    assert loaded.iteration == 3 and loaded.config.is_moe and not loaded.config.moe.drop_tokens
    expected = generate(loaded.model, torch.tensor([[5, 6, 7]]), 6, loaded.tokenizer.eod, vocab_size=61)[0]
    text = loaded.tokenizer.detokenize([5, 6, 7] + expected)

    generate_main(["--load", checkpoint, "--prompt", "5 6 7", "--max-new-tokens", "6", "--temperature", "0"])
    assert capsys.readouterr().out.strip() == text

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("5 6 7\n\n9 9\n")
    generate_main(["--load", checkpoint, "--prompt-file", str(prompts), "--max-new-tokens", "6", "--temperature", "0"])
    lines = capsys.readouterr().out.split("\n\n")
    assert lines[0] == text and lines[1].startswith("9 9") and len(lines) == 3

    monkeypatch.setattr(sys, "stdin", io.StringIO("5 6 7\n"))
    generate_main(["--load", checkpoint, "--max-new-tokens", "6", "--temperature", "0"])
    assert text in capsys.readouterr().out


def test_generate_tool_sampling_is_reproducible_by_seed(checkpoint, capsys):
    flags = ["--load", checkpoint, "--prompt", "5 6 7", "--max-new-tokens", "12", "--top-k", "20"]
    outputs = []
    for seed in ("1", "1", "2"):
        generate_main(flags + ["--seed", seed])
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] != outputs[2]


def test_generate_tool_errors_are_one_sentence(checkpoint, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        generate_main(["--load", str(tmp_path), "--prompt", "1"])
    assert exit_info.value.code == 1
    assert "latest_checkpointed_iteration.txt is missing; pass the --save directory" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        generate_main(["--load", checkpoint, "--prompt", "1", "--top-p", "2"])
    assert capsys.readouterr().err.startswith("error: --top-p must be in (0, 1]")


def test_a_checkpoint_without_a_usable_model_config_is_refused(checkpoint, tmp_path):
    copy = tmp_path / "ckpt"
    shutil.copytree(checkpoint, copy)
    folder = copy / "iter_0000003"
    text = (folder / MANIFEST_FILE).read_text()
    raw = json.loads(text)
    raw["run"]["model"]["attention_heads"] = 4  # a field this version's GPTConfig lacks
    raw["checksum"] = json_checksum(raw)
    (folder / MANIFEST_FILE).write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="does not fit this version's GPTConfig"):
        load_model(copy)
    (folder / MANIFEST_FILE).write_text(text)
    write_manifest(folder, read_checkpoint(folder).model_copy(update={"run": None}))  # saved by an engine alone
    with pytest.raises(CheckpointError, match="holds no model config"):
        load_model(copy)
