"""Which tokenizer, as `build_tokenizer` takes it: the preprocessing workers build theirs from it,
and a checkpoint records the run's (manifest.py), so that inference and export rebuild the same
tokenizer without a flag spelling. Small and hashable, unlike a tokenizer."""

from dataclasses import dataclass, fields

# Where NullTokenizer's end-of-document id goes. "last": the last of --vocab-size ids, as current
# Megatron-LM (megatron.core's NullTokenizer, eod_id = vocab_size - 1) and Megatron-Bridge.
# "extra": one id past them, vocab_size + 1 ids in all, as Megatron-DeepSpeed and Megatron-LM's
# earlier _NullTokenizer. The two are the same tokenizer for --vocab-size values one apart.
NULL_EOD_LAST = "last"
NULL_EOD_EXTRA = "extra"
NULL_EOD_CONVENTIONS = (NULL_EOD_LAST, NULL_EOD_EXTRA)


@dataclass(frozen=True)
class TokenizerSpec:
    tokenizer_type: str
    tokenizer_model: str | None = None  # file paths as the run gave them
    vocab_file: str | None = None
    merge_file: str | None = None
    vocab_size: int | None = None  # NullTokenizer's size
    null_tokenizer_eod: str = NULL_EOD_LAST


def tokenizer_spec_of(flags: object) -> TokenizerSpec:
    """The spec the tokenizer flags held by `flags` name: parsed arguments or a DataConfig, whose
    attributes carry the spec's field names."""
    return TokenizerSpec(**{field.name: getattr(flags, field.name) for field in fields(TokenizerSpec)})
