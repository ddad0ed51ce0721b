"""A length of training as its flag gave it: Megatron's --X-iters, --X-samples or --X-tokens.

It is kept as given and converted on use, because the conversion needs the global batch, which
defaults to micro batch x data-parallel size and so is known only once the world size is.
"""

from dataclasses import dataclass
from typing import Literal

SpanUnit = Literal["iters", "samples", "tokens"]


@dataclass(frozen=True)
class Span:
    unit: SpanUnit
    amount: int

    def tokens(self, global_batch_size: int, seq_length: int) -> int:
        per_unit = {"iters": global_batch_size * seq_length, "samples": seq_length, "tokens": 1}[self.unit]
        return self.amount * per_unit

    def iterations(self, global_batch_size: int, seq_length: int) -> int:
        """Whole iterations that cover the span (a partial last one counts)."""
        per_iteration = {"iters": 1, "samples": global_batch_size, "tokens": global_batch_size * seq_length}
        return -(-self.amount // per_iteration[self.unit])
