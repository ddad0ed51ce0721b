"""`tools/preprocess_data.py`: tokenize a corpus into Megatron .bin/.idx files (megatron/data/preprocess.py)."""

from megatron.config.parser import FlagParser, positive_int
from megatron.data.preprocess import preprocess
from megatron.data.tokenizer import NULL_EOD_CONVENTIONS, NULL_EOD_LAST, TOKENIZER_TYPES
from megatron.entry_point import run_entry_point
from megatron.tokenizer_spec import tokenizer_spec_of


def build_parser() -> FlagParser:
    parser = FlagParser(description="Tokenize a corpus into Megatron .bin/.idx files.")
    parser.add_argument("--input", required=True, help="a .jsonl/.json/.parquet/.csv file or a glob of them")
    parser.add_argument("--json-keys", nargs="+", default=["text"], help="columns to tokenize, one output per key")
    parser.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    parser.add_argument("--tokenizer-model", help="SentencePiece model file")
    parser.add_argument("--vocab-file", help="GPT-2 vocab.json")
    parser.add_argument("--merge-file", help="GPT-2 merges.txt")
    parser.add_argument("--vocab-size", type=positive_int, help="NullTokenizer vocabulary size")
    parser.add_argument(
        "--null-tokenizer-eod",
        choices=NULL_EOD_CONVENTIONS,
        default=NULL_EOD_LAST,
        help="NullTokenizer's end-of-document id: the last of --vocab-size ids (current Megatron-LM), "
        "or one extra id, --vocab-size itself (Megatron-DeepSpeed)",
    )
    parser.add_argument("--append-eod", action="store_true", help="end every document with the end-of-document token")
    parser.add_argument("--output-prefix", required=True, help="writes OUTPUT_PREFIX_{key}_document.bin/.idx")
    parser.add_argument("--workers", type=positive_int, default=1, help="tokenizer processes")
    parser.add_argument("--log-interval", type=positive_int, default=100, help="rows between progress updates")
    parser.add_argument(
        "--skip-invalid-utf8",
        action="store_true",
        help="skip (and count) rows whose text is not valid UTF-8, instead of stopping at the first",
    )
    return parser


def _preprocess(argv: list[str] | None) -> None:
    args = build_parser().parse_args(argv)
    prefixes = preprocess(
        args.input,
        args.output_prefix,
        tokenizer_spec_of(args),
        args.json_keys,
        args.append_eod,
        args.workers,
        args.log_interval,
        args.skip_invalid_utf8,
    )
    for prefix in prefixes:
        print(f"wrote {prefix}.bin and {prefix}.idx")


def main(argv: list[str] | None = None) -> None:
    run_entry_point(lambda: _preprocess(argv))  # a bad flag is one sentence too
