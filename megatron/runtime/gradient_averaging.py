"""DeepSpeed's data-parallel gradient averaging, split into the division before the all-reduce and
the one after it."""

from megatron.runtime.config.schema import RuntimeConfig


def gradient_averaging(config: RuntimeConfig, dp_size: int) -> tuple[float, float]:
    """DeepSpeed's averaging over data-parallel ranks as (divisor before the all-reduce, divisor
    after it): the predivide factor and dp/factor, or dp and 1 with prescale_gradients, or no
    division at all with gradient_allreduce_op "sum"."""
    if config.gradient_allreduce_op == "sum":
        return 1.0, 1.0
    if config.prescale_gradients:
        return float(dp_size), 1.0
    factor = config.gradient_predivide_factor
    return factor, dp_size / factor
