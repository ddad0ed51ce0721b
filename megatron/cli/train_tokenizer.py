"""`tools/train_tokenizer.py`: train a SentencePiece tokenizer (megatron/data/tokenizer_training.py)."""

from megatron.config.parser import FlagParser, positive_float, positive_int
from megatron.data.tokenizer_training import train_tokenizer
from megatron.entry_point import run_entry_point


def build_parser() -> FlagParser:
    parser = FlagParser(description="Train a SentencePiece tokenizer for tools/preprocess_data.py.")
    parser.add_argument(
        "--input",
        nargs="+",
        required=True,
        help="plain-text files (one sentence per line), or .jsonl/.json/.csv/.parquet corpora",
    )
    parser.add_argument("--vocab-size", type=positive_int, required=True)
    parser.add_argument("--model-prefix", required=True, help="writes PREFIX.model and PREFIX.vocab")
    parser.add_argument("--model-type", choices=("bpe", "unigram"), default="bpe")
    parser.add_argument("--json-keys", nargs="+", default=["text"], help="fields read from each record")
    parser.add_argument("--character-coverage", type=positive_float, default=0.9995)
    parser.add_argument(
        "--max-sentence-length", type=positive_int, default=4192, help="longer sentences (in bytes) are skipped"
    )
    return parser


def _train(argv: list[str] | None) -> None:
    args = build_parser().parse_args(argv)
    path = train_tokenizer(
        args.input,
        args.vocab_size,
        args.model_prefix,
        args.model_type,
        args.json_keys,
        args.character_coverage,
        args.max_sentence_length,
    )
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> None:
    run_entry_point(lambda: _train(argv))
