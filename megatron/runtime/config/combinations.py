"""Settings that are each valid but not together, refused when the config is read (so that
`pretrain_gpt.py --dry-run` reports them) rather than when the engine builds its optimizer."""

from typing import TYPE_CHECKING

from megatron.errors import ConfigError

if TYPE_CHECKING:  # schema.py calls this module when it validates a config
    from megatron.runtime.config.schema import RuntimeConfig


COMPRESSED_OPTIMIZERS = ("OneBitAdam", "ZeroOneAdam", "OneBitLamb")


def refuse_contradictions(config: "RuntimeConfig") -> None:
    kind = config.optimizer.type
    if kind == "Lamb" and config.zero_optimization.stage:
        raise ConfigError(
            "optimizer Lamb needs whole tensors for its per-tensor trust ratio, but ZeRO hands the optimizer "
            "flat shards; use Adam/AdamW with ZeRO, or zero_optimization.stage 0 with Lamb"
        )
    offloaded = config.zero_optimization.offload_optimizer.device != "none"
    if kind in COMPRESSED_OPTIMIZERS:
        refuse_onebit_contradictions(config, offloaded)
        return
    if kind != "Lamb" and not offloaded and not config.optimizer.params.given().get("bias_correction", True):
        raise ConfigError(
            "optimizer.params.bias_correction false is implemented by the offloaded CPU Adam and "
            "by Lamb only; drop it, or set zero_optimization.offload_optimizer"
        )


def tied_embedding_refusal(zero_stage: int) -> str | None:
    """Why a word embedding tied across the first and last pipeline stages cannot train under this
    ZeRO stage (its gradient is summed over the two stages at the step, which stages 2 and 3 would
    already have reduced), or None where it can."""
    if zero_stage <= 1:
        return None
    return (
        f"ZeRO stage {zero_stage} reduces gradients during backward, before the tied word "
        "embedding's gradient can be summed over the first and last pipeline stages; use --zero-stage 0 or 1, "
        "or --untie-embeddings-and-output-weights"
    )


def refuse_onebit_contradictions(config: "RuntimeConfig", offloaded: bool) -> None:
    """What the 1-bit optimizers run with, as in DeepSpeed: ZeRO stage 0, the optimizer on the
    device, and the plain mean of the gradients over data parallelism (their own tensors are
    averaged the same way)."""
    kind = config.optimizer.type
    if config.zero_optimization.stage:
        raise ConfigError(
            f"optimizer {kind} compresses whole momenta, which ZeRO stage {config.zero_optimization.stage} "
            "partitions (DeepSpeed refuses the pair too); use zero_optimization.stage 0"
        )
    if offloaded:
        raise ConfigError(f"optimizer {kind} runs on the device; remove zero_optimization.offload_optimizer")
    if config.prescale_gradients or config.gradient_predivide_factor != 1.0 or config.gradient_allreduce_op != "mean":
        raise ConfigError(
            f"optimizer {kind} averages its momenta over data parallelism; drop prescale_gradients, "
            "gradient_predivide_factor and gradient_allreduce_op sum"
        )
