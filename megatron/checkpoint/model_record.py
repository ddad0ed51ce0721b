"""The model config as a checkpoint records it: GPTConfig (its MoEConfig nested) written as a JSON
object and read back typed, so a manifest's `run.model` is a GPTConfig, never a dict.

Reading is lenient where the toolkit grew: fields added since take their defaults (what the toolkit
did before they existed) and renamed ones are read under their old names too.
"""

from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Any

from pydantic import PlainSerializer, PlainValidator

from megatron.errors import CheckpointError, ConfigError
from megatron.model.config import GPTConfig
from megatron.model.moe.config import MoEConfig

# GPTConfig fields under the names older checkpoints saved them with
RENAMED_FIELDS = {"layernorm_epsilon": "norm_epsilon"}


class UnfitModelConfig(Exception):
    """A recorded model config this version's GPTConfig cannot take; the reader names the file.
    Not a ValueError, so that pydantic passes it through instead of folding it into its own."""


def model_config_from_json(saved: Any) -> GPTConfig:
    """The GPTConfig `saved` records (tuples come back from JSON as lists, MoEConfig as an object)."""
    if isinstance(saved, GPTConfig):
        return saved
    if not isinstance(saved, dict):
        raise UnfitModelConfig(f"it is a {type(saved).__name__}, not an object")
    renamed = {RENAMED_FIELDS.get(name, name): value for name, value in saved.items()}
    try:
        return GPTConfig(
            **{
                **renamed,
                "num_experts": tuple(renamed.get("num_experts", (1,))),
                "moe": MoEConfig(**renamed.get("moe", {})),
            }
        )
    except (TypeError, ConfigError) as error:
        raise UnfitModelConfig(str(error)) from None


def unfit(source: Path, error: UnfitModelConfig) -> CheckpointError:
    return CheckpointError(
        f"the model config in {source} does not fit this version's GPTConfig ({error}); "
        "load it with the toolkit version that saved it"
    )


def model_config_to_json(config: GPTConfig) -> dict[str, Any]:
    return asdict(config)


# a pydantic field holding a GPTConfig, written and read as above
ModelConfigField = Annotated[
    GPTConfig,
    PlainValidator(model_config_from_json),
    PlainSerializer(model_config_to_json, return_type=dict[str, Any]),
]
