"""The exported tokenizer's check (megatron/hf/tokenizer_check.py), as a new user meets
it: a SentencePiece BPE model trained with SentencePiece's own trainer on Python source with no CJK
and no emoji (so the probe texts hold unknown pieces), the corpus preprocessed with it, a
Mixtral-shaped model trained on it and exported by tools/checkpoint/convert.py. The export gives
our ids, text (unknown pieces included) and logits; a really different tokenizer, or any other
difference on the probe texts or on the training data's own documents, is refused; a tokenizer
that only renders the unknown piece differently is let through with a log line, on export and on
import."""

import json
import random
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import sentencepiece

from megatron.data import preprocess
from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.data.preprocess import TokenizerSpec
from megatron.data.tokenizer import SentencePieceTokenizer
from megatron.errors import CheckpointError
from megatron.hf.from_hf import import_from_hf
from megatron.hf.to_hf import check_tokenizer
from megatron.hf.tokenizer_check import PROBE_TEXTS
from megatron.hf.tokenizer_files import export_tokenizer
from tests import inference_fixtures
from tests.test_hf_interop import MODERN, hf_logits, our_logits, relative_error, token_ids, train_checkpoint

transformers = pytest.importorskip(
    "transformers",
    reason="the Hugging Face interop tests need transformers (pip install transformers, or the package's test extra)",
)

REPO = Path(__file__).resolve().parents[1]
one_thread = inference_fixtures.one_thread  # autouse: this module's tiny models run on one thread
VOCAB_SIZE = 1000
# the Mixtral-shaped model
MIXTRAL = dict(
    MODERN,
    untie_embeddings_and_output_weights=True,
    group_query_attention=True,
    num_query_groups=2,
    num_experts=4,
    expert_interval=1,
    moe_ffn_hidden_size=32,
    topk=2,
    disable_moe_token_dropping=True,
)
# code that quotes markup, at the end of a long document: text a tokenizer that reads "<s>" as its
# special token splits differently
MARKUP = "".join(f"line_{i} = {i}\n" for i in range(200)) + 'STRIKE = "<s>struck</s>"  # and <unk> stays text\n'


def outside_the_corpus(character: str) -> bool:
    return ord(character) >= 0x2E80  # CJK and everything above it, emoji included


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[str, Path]:
    """The corpus, tokenizer, dataset, checkpoint and export, once; name -> path."""
    folder = tmp_path_factory.mktemp("spm")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    sources = [
        path.read_text(encoding="utf-8")
        for name in ("json", "email", "http", "logging")
        for path in sorted((stdlib / name).glob("*.py"))
    ]
    documents = [text for text in sources if text.strip() and not any(map(outside_the_corpus, text))] + [MARKUP]
    (folder / "corpus.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in documents))
    (folder / "corpus.txt").write_text("\n".join(documents))
    sentencepiece.SentencePieceTrainer.train(
        input=str(folder / "corpus.txt"),
        model_prefix=str(folder / "sp"),
        vocab_size=VOCAB_SIZE,
        model_type="bpe",
        character_coverage=1.0,
        minloglevel=2,
    )
    spec = TokenizerSpec("SentencePieceTokenizer", tokenizer_model=str(folder / "sp.model"))
    [prefix] = preprocess.preprocess(
        str(folder / "corpus.jsonl"), str(folder / "code"), spec, ["text"], append_eod=True
    )
    checkpoint = train_checkpoint(
        prefix,
        folder / "ckpt",
        MIXTRAL,
        tokenizer_type="SentencePieceTokenizer",
        tokenizer_model=str(folder / "sp.model"),
    )
    export = subprocess.run(
        [
            sys.executable,
            str(REPO / "tools/checkpoint/convert.py"),
            "--to",
            "hf",
            "--load",
            str(checkpoint),
            "--save",
            str(folder / "hf"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    (folder / "export.log").write_text(f"rc {export.returncode}\n{export.stdout}{export.stderr}")
    return {
        "folder": folder,
        "corpus": folder / "corpus.jsonl",
        "model": folder / "sp.model",
        "prefix": Path(prefix),
        "checkpoint": checkpoint,
        "hf": folder / "hf",
        "log": folder / "export.log",
    }


def corpus_texts(trained: dict[str, Path]) -> list[str]:
    return [json.loads(line)["text"] for line in trained["corpus"].read_text().splitlines()]


def copy_with(trained: dict[str, Path], name: str, file: str, change) -> Path:
    """A copy of the export whose `file` (a JSON file) went through `change`."""
    folder = trained["folder"] / name
    shutil.copytree(trained["hf"], folder)
    content = json.loads((folder / file).read_text())
    change(content)
    (folder / file).write_text(json.dumps(content))
    return folder


def without_unknown_rendering(content: dict) -> None:
    """The decoder transformers builds: the export's first and last steps (the unknown piece's) gone."""
    content["decoder"]["decoders"] = content["decoder"]["decoders"][1:-1]


def test_a_vocabulary_without_cjk_or_emoji_exports_with_our_ids_text_and_logits(trained):
    log = trained["log"].read_text()
    assert log.startswith("rc 0\n"), log
    assert (
        " > the exported tokenizer gives our ids and text on 4 probe texts and 32 documents of the training "
        "data\n" in log
    )
    ours = SentencePieceTokenizer(str(trained["model"]))
    theirs = transformers.AutoTokenizer.from_pretrained(str(trained["hf"]))
    texts = corpus_texts(trained)
    assert not any(outside_the_corpus(c) for text in texts for c in text)
    assert any(ours.unknown_id in ours.tokenize(text) for text in PROBE_TEXTS)  # the case the check refused
    for text in (*PROBE_TEXTS, *texts):
        ids = ours.tokenize(text)
        assert theirs(text, add_special_tokens=False)["input_ids"] == ids
        assert theirs.decode(ids) == ours.detokenize(ids)
    ids = token_ids(VOCAB_SIZE)
    assert relative_error(our_logits(trained["checkpoint"], ids), hf_logits(trained["hf"], ids)) < 1e-4


def test_any_ids_decode_as_sentencepiece_decodes_them_an_unknown_piece_first_too(trained):
    ours = SentencePieceTokenizer(str(trained["model"]))
    theirs = transformers.AutoTokenizer.from_pretrained(str(trained["hf"]))
    sp = sentencepiece.SentencePieceProcessor(model_file=str(trained["model"]))
    pieces = [i for i in range(sp.get_piece_size()) if not sp.is_control(i)]
    space = sp.piece_to_id("\u2581")
    rng = random.Random(0)
    for _ in range(2000):
        ids = [ours.unknown_id if rng.random() < 0.25 else rng.choice(pieces) for _ in range(rng.randint(1, 8))]
        if ids[0] == space and len(ids) > 1 and sp.id_to_piece(ids[1]).startswith("\u2581"):
            continue  # SentencePiece drops each leading piece's space while its text is empty, transformers one
        assert theirs.decode(ids) == ours.detokenize(ids), ids
    assert theirs.decode([ours.unknown_id, ours.unknown_id]) == " ⁇  ⁇ "


def test_a_really_different_tokenizer_is_still_refused(trained, tmp_path):
    other_text = tmp_path / "other.txt"
    other_text.write_text("\n".join(f"the {i} brown foxes jump over {i + 1} lazy dogs; café naïve" for i in range(500)))
    sentencepiece.SentencePieceTrainer.train(
        input=str(other_text), model_prefix=str(tmp_path / "other"), vocab_size=200, model_type="bpe", minloglevel=2
    )
    other = SentencePieceTokenizer(str(tmp_path / "other.model"))
    export_tokenizer("SentencePieceTokenizer", {"tokenizer_model": str(tmp_path / "other.model")}, other, tmp_path, 64)
    ours = SentencePieceTokenizer(str(trained["model"]))
    with pytest.raises(
        CheckpointError,
        match=r"it splits probe text 1 \('The quick brown fox jumps over the lazy "
        r"dog.'\) into ids \[\d+, .*\] where ours gives \[",
    ):
        check_tokenizer(ours, tmp_path, None, lambda line: None)


def test_a_difference_in_the_training_data_alone_refuses_naming_the_document(trained):
    ours = SentencePieceTokenizer(str(trained["model"]))
    # transformers' default: "<s>" in text becomes the special token, where SentencePiece spells it out
    folder = copy_with(
        trained,
        "special_tokens_read",
        "tokenizer_config.json",
        lambda content: content.update(split_special_tokens=False),
    )
    lines: list[str] = []
    check_tokenizer(ours, folder, None, lines.append)  # the probe texts hold no special token's text
    assert lines == [
        " > the exported tokenizer gives our ids and text on 4 probe texts and 0 documents of the training data"
    ]
    documents = len(MMapIndexedDataset(str(trained["prefix"])))
    with pytest.raises(
        CheckpointError,
        match=rf"it splits document {documents - 1} of {trained['prefix']} "
        r"\('[^']*\"<s>[^']*'\) into ids \[(\d+, ){15}\d+\] where ours gives "
        r"\[(\d+, ){15}\d+\]; nothing was written",
    ):
        check_tokenizer(ours, folder, [str(trained["prefix"])], lines.append)  # the ids around the difference shown


def test_a_decoding_difference_other_than_the_unknown_piece_refuses(trained):
    ours = SentencePieceTokenizer(str(trained["model"]))
    folder = copy_with(
        trained,
        "no_strip",
        "tokenizer.json",
        lambda content: content["decoder"]["decoders"].remove({"type": "Strip", "content": " ", "start": 1, "stop": 0}),
    )
    with pytest.raises(
        CheckpointError,
        match=r"it decodes probe text 1 as ' The quick brown fox jumps over the lazy "
        r"dog.' where ours gives 'The quick brown fox jumps over the lazy dog.'",
    ):
        check_tokenizer(ours, folder, [str(trained["prefix"])], lambda line: None)


def test_rendering_the_unknown_piece_otherwise_is_the_one_difference_allowed_and_logged(trained):
    ours = SentencePieceTokenizer(str(trained["model"]))
    folder = copy_with(trained, "renders_unk", "tokenizer.json", without_unknown_rendering)
    lines: list[str] = []
    check_tokenizer(ours, folder, [str(trained["prefix"])], lines.append)
    assert lines == [
        " > the exported tokenizer gives our ids and text on 4 probe texts and 32 documents of the "
        "training data, but for the unknown piece, which it renders as '<unk>' where ours gives ' ⁇ '"
    ]


def test_import_checks_a_sentencepiece_tokenizer_with_unknown_pieces_the_same_way(trained, tmp_path):
    folder = copy_with(trained, "import_renders_unk", "tokenizer.json", without_unknown_rendering)
    lines: list[str] = []
    import_from_hf(str(folder), str(tmp_path / "renders_unk"), log=lines.append)
    assert lines[0] == (
        f" > note: {folder}'s Hugging Face tokenizer and ours from the same files give the same ids "
        "and text on the probe texts but for the unknown piece, which it renders as '<unk>' where ours "
        "gives ' ⁇ '"
    )
    lines.clear()
    import_from_hf(str(trained["hf"]), str(tmp_path / "ours"), log=lines.append)
    assert not any("note" in line for line in lines), lines
    wrong = copy_with(
        trained, "import_no_strip", "tokenizer.json", lambda content: content["decoder"]["decoders"].pop(-2)
    )
    lines.clear()
    import_from_hf(str(wrong), str(tmp_path / "no_strip"), log=lines.append)
    assert lines[0].startswith(
        f" > note: {wrong}'s Hugging Face tokenizer and ours from the same files differ: it "
        "decodes probe text 1 as ' The quick"
    )
