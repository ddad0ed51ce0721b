"""Scoring for evaluation: loglikelihoods equal the model's own token log-probabilities, task
accuracies equal what those log-probabilities say by hand, MoE scores do not depend on batching,
an EP=2 checkpoint scores the same under EP=1, and the lm-eval adapter (when lm-eval is
installed) agrees with the scorer that runs without it."""

import json

import pytest
import torch

from megatron.cli.evaluate_ppl import main as ppl_main
from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.errors import ConfigError, DataError
from megatron.inference.checkpoint_model import LoadedModel, load_model
from megatron.inference.generation import generate_until
from megatron.inference.jsonl import read_jsonl
from megatron.inference.local_tasks import (
    last_word_accuracy,
    two_choice_accuracy,
    two_choice_pairs,
)
from megatron.inference.perplexity import stream_perplexity
from megatron.inference.scoring import (
    encode_pair,
    rolling_loglikelihoods,
    rolling_windows,
    score_continuations,
)
from megatron.parallel import build_parallel_grid
from tasks.eval_harness import evaluate as harness
from tasks.eval_harness.report import markdown_table
from tests.dist_utils import run_distributed
from tests.inference_fixtures import (
    ByteTokenizer,
    one_thread,  # noqa: F401 (autouse: one thread per module)
    tiny_model,
    train_checkpoint,
)
from tests.training_fixtures import write_corpus


def direct_logprobs(model, tokens: list[int]) -> torch.Tensor:
    """log p(tokens[t] | tokens[:t]) for t >= 1, from one plain forward pass."""
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([tokens[:-1]])).logits_BSV[0].float(), dim=-1)
    return logprobs[torch.arange(len(tokens) - 1), torch.tensor(tokens[1:])]


def greedy_next(model, tokens: list[int]) -> int:
    with torch.no_grad():
        return int(model(torch.tensor([tokens])).logits_BSV[0, -1].argmax())


@pytest.mark.parametrize("experts", [1, 4])
def test_loglikelihood_is_the_sum_of_the_models_token_logprobs(experts):
    model = tiny_model(experts)
    g = torch.Generator().manual_seed(0)
    requests = [
        (torch.randint(0, 64, (n,), generator=g).tolist(), torch.randint(0, 64, (m,), generator=g).tolist())
        for n, m in [(5, 3), (1, 1), (12, 4), (7, 1), (20, 12)]
    ]
    scores = score_continuations(model, requests, batch_size=2)
    for (context, continuation), score in zip(requests, scores):
        expected = direct_logprobs(model, context + continuation)[-len(continuation) :]
        assert score.logprob == pytest.approx(float(expected.sum()), abs=1e-4)
        with torch.no_grad():
            argmax = model(torch.tensor([context + continuation])).logits_BSV[0].argmax(-1)[len(context) - 1 : -1]
        assert score.is_greedy == (argmax.tolist() == continuation)
    greedy = [1, 2, 3]
    greedy.append(greedy_next(model, greedy))
    assert score_continuations(model, [(greedy[:3], greedy[3:])])[0].is_greedy


def test_a_request_longer_than_the_context_keeps_its_last_tokens():
    model = tiny_model(max_positions=8)
    tokens = list(range(1, 15))
    score = score_continuations(model, [(tokens[:-3], tokens[-3:])])[0]
    assert score.logprob == pytest.approx(float(direct_logprobs(model, tokens[-9:])[-3:].sum()), abs=1e-4)


def test_rolling_loglikelihood_predicts_every_token_once():
    model = tiny_model(max_positions=8)
    text = torch.randint(0, 63, (19,), generator=torch.Generator().manual_seed(3)).tolist()
    windows = rolling_windows([63, *text], 8)
    assert [t for _, cont in windows for t in cont] == text
    assert all(len(ctx) + len(cont) <= 9 for ctx, cont in windows)
    # by hand: windows of 8 predictions, each read with the 8 tokens before its last prediction
    full = [63, *text]
    expected = sum(
        float(direct_logprobs(model, full[max(0, stop - 9) : stop])[-(stop - start) :].sum())
        for start, stop in [(1, 9), (9, 17), (17, 20)]
    )
    short = text[:7]
    got = rolling_loglikelihoods(model, [text, short], eod=63, batch_size=2)
    assert got[0] == pytest.approx(expected, abs=1e-4)
    assert got[1] == pytest.approx(float(direct_logprobs(model, [63, *short]).sum()), abs=1e-4)


def test_pairs_are_encoded_as_lm_eval_encodes_them():
    tokenizer = ByteTokenizer()
    assert encode_pair(tokenizer, "ab ", "c") == ([97, 98], [32, 99])
    assert encode_pair(tokenizer, "", "hi") == ([256], [104, 105])


def test_last_word_accuracy_matches_the_models_own_predictions():
    model = tiny_model(vocab=384, max_positions=64)
    tokenizer = ByteTokenizer()
    docs, expected = [], []
    for i, context in enumerate(["the cat sat on", "a b c", "to be or not to", "one two three four"]):
        ids = tokenizer.tokenize(context + " ")
        guess = greedy_next(model, ids)
        if 33 <= guess < 127 and i % 2 == 0:  # a printable byte: the model's own one-letter last word
            word = chr(guess)
        else:
            word = "zq"
        docs.append({"text": f"{context} {word}"})
        # by hand: correct when every byte of " word" is the argmax after what precedes it
        ctx_ids, cont_ids = tokenizer.tokenize(context), tokenizer.tokenize(" " + word)
        full = ctx_ids + cont_ids
        with torch.no_grad():
            argmax = model(torch.tensor([full])).logits_BSV[0].argmax(-1)[len(ctx_ids) - 1 : -1].tolist()
        expected.append(argmax == cont_ids)
    assert any(expected) or not any(expected)  # the expectation comes from the model, whatever it is
    assert last_word_accuracy(model, tokenizer, docs, batch_size=3) == sum(expected) / len(docs)


def test_two_choice_accuracy_matches_the_models_own_logprobs():
    model = tiny_model(vocab=384, max_positions=96)
    tokenizer = ByteTokenizer()
    docs, correct = [], 0
    for i, (goal, sol1, sol2) in enumerate(
        [
            ("To dry a towel,", "hang it up.", "fold it wet."),
            ("To boil water,", "heat it.", "freeze it."),
            ("To open a jar,", "twist the lid.", "shake it."),
            ("To sort a list,", "call sorted.", "reverse it."),
        ]
    ):
        doc = {"goal": goal, "sol1": sol1, "sol2": sol2}
        lps = []
        for context, choice in two_choice_pairs(doc):
            ids = tokenizer.tokenize(context)
            lps.append(float(direct_logprobs(model, ids + tokenizer.tokenize(choice))[len(ids) - 1 :].sum()))
        better = int(lps[1] > lps[0])
        doc["label"] = better if i < 3 else 1 - better  # three right answers, one wrong: 0.75
        correct += doc["label"] == better
        docs.append(doc)
    assert correct == 3
    assert two_choice_accuracy(model, tokenizer, docs, batch_size=3) == 0.75


def test_moe_scores_are_the_same_twice_and_for_any_batch_size():
    model = tiny_model(experts=4, topk=1)
    g = torch.Generator().manual_seed(5)
    requests = [
        (torch.randint(0, 64, (n,), generator=g).tolist(), torch.randint(0, 64, (3,), generator=g).tolist())
        for n in (4, 9, 2, 15, 6)
    ]
    first = score_continuations(model, requests, batch_size=5)
    second = score_continuations(model, requests, batch_size=5)
    single = score_continuations(model, requests, batch_size=1)
    assert first == second
    for a, b in zip(first, single):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-5) and a.is_greedy == b.is_greedy


def test_scoring_refuses_a_model_in_training_mode():
    model = tiny_model().train()
    with pytest.raises(ConfigError, match="model.eval"):
        score_continuations(model, [([1], [2])])


REQUESTS = [([5, 6, 7], [8, 9]), ([1], [2, 3, 4]), ([10, 11, 12, 13, 14, 15], [16])]
LAST_WORD_DOCS = [{"text": "5 6 7 8"}, {"text": "1 2 3"}, {"text": "30 31 32 33 34"}]


def _scores(save: str, ep_size: int) -> dict[str, torch.Tensor]:
    grid = build_parallel_grid(torch.device("cpu"), ep_size=ep_size)
    loaded = load_model(save, grid)
    local_experts = loaded.model.layers[1].mlp.experts.w1.shape[0]
    scores = score_continuations(loaded.model, REQUESTS, batch_size=2)
    generated = generate_until(loaded.model, loaded.tokenizer, [[5, 6, 7], [9, 9, 9]], [], 5)
    return {
        "logprobs": torch.tensor([s.logprob for s in scores], dtype=torch.float64),
        "greedy": torch.tensor([s.is_greedy for s in scores]),
        "last_word": torch.tensor(last_word_accuracy(loaded.model, loaded.tokenizer, LAST_WORD_DOCS)),
        "generated": torch.tensor([loaded.tokenizer.tokenize(text) for text in generated]),
        "local_experts": torch.tensor(local_experts),
    }


def _train_and_score(corpus: str, save: str) -> dict[str, torch.Tensor]:
    train_checkpoint(corpus, save, ep_size=2)
    return _scores(save, 2)


@pytest.fixture(scope="module")
def ep2_checkpoint(tmp_path_factory) -> tuple[str, str, list[dict[str, torch.Tensor]]]:
    """A tiny MoE model trained and saved with EP=2, and its scores loaded back with EP=2."""
    folder = tmp_path_factory.mktemp("evaluation")
    corpus, save = write_corpus(folder), str(folder / "ckpt")
    return corpus, save, run_distributed(_train_and_score, 2, corpus, save)


def test_a_checkpoint_saved_with_ep2_scores_the_same_with_ep1_and_ep2(ep2_checkpoint):
    _, save, ep2 = ep2_checkpoint
    ep1 = _scores(save, 1)
    assert int(ep1["local_experts"]) == 4 and int(ep2[0]["local_experts"]) == 2
    for rank in range(2):
        torch.testing.assert_close(ep2[rank]["logprobs"], ep1["logprobs"], rtol=1e-5, atol=1e-5)
        for key in ("greedy", "last_word", "generated"):
            assert torch.equal(ep2[rank][key], ep1[key]), key


def test_perplexity_tool_on_indexed_data_and_jsonl(ep2_checkpoint, tmp_path, capsys):
    corpus, save, _ = ep2_checkpoint
    loaded = load_model(save)
    stream = [t for i in range(3) for t in MMapIndexedDataset(corpus)[i].tolist()][:40]
    loss, count = stream_perplexity(loaded.model, stream, batch_size=2)
    seq = loaded.config.max_position_embeddings
    by_hand = [
        -float(direct_logprobs(loaded.model, stream[max(0, stop - seq - 1) : stop])[-(stop - start) :].sum())
        for start, stop in [(s, min(s + seq, len(stream))) for s in range(1, len(stream), seq)]
    ]
    assert count == 39 and loss == pytest.approx(sum(by_hand) / 39, abs=1e-5)
    ppl_main(["--load", save, "--data-path", corpus, "--max-tokens", "40", "--batch-size", "3"])
    assert f"tokens: 39 | lm loss: {loss:.4f}" in capsys.readouterr().out
    jsonl = tmp_path / "held_out.jsonl"
    jsonl.write_text('{"text": "5 6 7 8"}\n{"text": "1 2 3"}\n')
    ppl_main(["--load", save, "--jsonl", str(jsonl)])
    jsonl_loss, _ = stream_perplexity(loaded.model, [5, 6, 7, 8, 60, 1, 2, 3, 60])
    assert f"tokens: 8 | lm loss: {jsonl_loss:.4f}" in capsys.readouterr().out


@pytest.mark.parametrize("batch_size", [1, 2, 5])
def test_perplexity_progress_counts_every_token_and_keeps_the_loss(batch_size, capsys):
    model = tiny_model(4)
    stream = torch.randint(0, 64, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    windows = rolling_windows(stream, model.config.max_position_embeddings)
    in_one_call = -sum(score.logprob for score in score_continuations(model, windows, batch_size)) / 199
    assert stream_perplexity(model, stream, batch_size) == (pytest.approx(in_one_call, abs=1e-6), 199)
    assert capsys.readouterr().err == ""  # quiet unless asked (ranks other than the first)
    assert stream_perplexity(model, stream, batch_size, progress=True) == (pytest.approx(in_one_call, abs=1e-6), 199)
    assert "199/199" in capsys.readouterr().err and len(windows) > batch_size


def test_evaluate_script_writes_results_and_the_paper_table(ep2_checkpoint, tmp_path, capsys):
    _, save, _ = ep2_checkpoint
    data = tmp_path / "data"
    data.mkdir()
    (data / "lambada_local.jsonl").write_text("".join(json.dumps(doc) + "\n" for doc in LAST_WORD_DOCS))
    out = tmp_path / "out"
    harness.main(
        [
            "--load",
            save,
            "--tasks",
            "lambada_local",
            "--task-data-dir",
            str(data),
            "--output_path",
            str(out),
            "--batch_size",
            "2",
        ]
    )
    results = json.loads((out / "results.json").read_text())
    loaded = load_model(save)
    expected = last_word_accuracy(loaded.model, loaded.tokenizer, LAST_WORD_DOCS)
    assert results["results"]["lambada_local"]["acc,none"] == pytest.approx(expected)
    table = (out / "results.md").read_text()
    assert table.startswith("| model | LAMBADA (local) |") and f"{100 * expected:.2f}" in table
    assert "LAMBADA (local)" in capsys.readouterr().out


def test_evaluate_script_without_lm_eval_says_how_to_install_it(ep2_checkpoint, capsys, monkeypatch):
    monkeypatch.setattr(harness, "lm_eval_installed", lambda: False)
    with pytest.raises(SystemExit) as exit_info:
        harness.main(["--load", ep2_checkpoint[1], "--tasks", "boolq,lambada_local"])
    assert exit_info.value.code == 1
    assert "pip install .[eval]" in capsys.readouterr().err


def test_markdown_table_follows_the_papers_column_order():
    results = {
        "results": {
            "custom": {"acc,none": 0.5},
            "piqa": {"acc,none": 0.61, "acc_norm,none": 0.62},
            "lambada_openai": {"perplexity,none": 40.0, "acc,none": 0.4},
        }
    }
    lines = markdown_table(results, "1.3B+MoE-128").splitlines()
    assert lines[0] == "| model | LAMBADA | PIQA | custom |"
    assert lines[2] == "| 1.3B+MoE-128 | 40.00 | 61.00 | 50.00 |"


def test_lm_eval_adapter_agrees_with_the_local_scorer(tmp_path):
    pytest.importorskip(
        "lm_eval", reason="lm-eval is an optional extra (pip install .[eval]); its adapter is untested here"
    )
    from lm_eval import simple_evaluate

    from tasks.eval_harness.lm_adapter import MegatronLM

    model, tokenizer = tiny_model(vocab=384, max_positions=96), ByteTokenizer()
    loaded = LoadedModel(model, tokenizer, model.config, 0, tmp_path)
    piqa = [
        {"goal": "To dry a towel,", "sol1": "hang it up.", "sol2": "fold it wet.", "label": 0},
        {"goal": "To boil water,", "sol1": "heat it.", "sol2": "freeze it.", "label": 1},
        {"goal": "To open a jar,", "sol1": "twist the lid.", "sol2": "shake it.", "label": 1},
    ]
    lambada = [{"text": "the cat sat on the mat"}, {"text": "a b c d"}]
    for name, docs in (("piqa_local", piqa), ("lambada_local", lambada)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(doc) + "\n" for doc in docs))
    specs = harness.local_task_configs(["piqa_local", "lambada_local"], str(tmp_path))
    results = simple_evaluate(model=MegatronLM(loaded, batch_size=2), tasks=specs, num_fewshot=0)["results"]
    assert results["piqa_local"]["acc,none"] == pytest.approx(two_choice_accuracy(model, tokenizer, piqa))
    assert results["lambada_local"]["acc,none"] == pytest.approx(last_word_accuracy(model, tokenizer, lambada))
    rolling = MegatronLM(loaded).loglikelihood_rolling([type("Request", (), {"args": ("hello world",)})()])
    assert rolling[0] == pytest.approx(rolling_loglikelihoods(model, [tokenizer.tokenize("hello world")], 256)[0])


@pytest.mark.parametrize(
    "content, message",
    [
        (b'{"text": "a"}\n{"text": "b"\n', r"t.jsonl line 2 is not valid JSON"),
        (b'{"text": "a"}\n\n{"other": 1}\n', r"t.jsonl line 3 lacks text; every line needs text"),
        (b'{"text": "a \xff"}\n', r"t.jsonl line 1 holds text that is not valid UTF-8"),
        (b"[1, 2]\n", r"t.jsonl line 1 is a list, not a JSON object"),
    ],
)
def test_evaluation_jsonl_errors_name_the_line(tmp_path, content, message):
    (tmp_path / "t.jsonl").write_bytes(content)
    with pytest.raises(DataError, match=message):
        read_jsonl(tmp_path / "t.jsonl", ("text",))
