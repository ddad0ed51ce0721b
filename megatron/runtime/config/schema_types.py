"""The value types and the strict section base shared by the runtime config's schema modules."""

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field


def _integral(value: Any) -> Any:
    """DeepSpeed's configs write element counts like 5e8: a float with no fraction is that integer."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _no_boolean(value: Any) -> Any:
    """`true` equals 1 to Python, so a Literal of integers takes it as 1: refuse it by name."""
    if isinstance(value, bool):
        raise ValueError("a boolean is not a ZeRO stage; write 0, 1, 2 or 3")
    return value


# fp16 loss scales: below 2 ** -24, fp16's smallest step, a scaled gradient under 1 keeps no precision;
# above 2 ** 127, the largest power of two in fp32 (initial_scale_power's bound), a scaled loss of 2 is not finite
LOSS_SCALE_RANGE = (2.0**-24, 2.0**127)
LOSS_SCALE_WORDS = "from 2**-24 (fp16's smallest positive number) to 2**127 (the largest power of two in fp32)"


def _loss_scale(value: float) -> float:
    if not LOSS_SCALE_RANGE[0] <= value <= LOSS_SCALE_RANGE[1]:
        raise ValueError(f"a loss scale must be {LOSS_SCALE_WORDS}")
    return value


def _static_loss_scale(value: float) -> float:
    if value != 0 and not LOSS_SCALE_RANGE[0] <= value <= LOSS_SCALE_RANGE[1]:
        raise ValueError(f"a static loss scale must be {LOSS_SCALE_WORDS}, or 0 for a dynamic one")
    return value


Count = Annotated[int, BeforeValidator(_integral), Field(ge=0)]
PositiveCount = Annotated[int, BeforeValidator(_integral), Field(ge=1)]
NonNegative = Annotated[float, Field(ge=0)]
Positive = Annotated[float, Field(gt=0)]
Beta = Annotated[float, Field(ge=0, lt=1)]
# 2 ** power must stay a finite fp32 number (the largest power of two there is 2 ** 127)
ScalePower = Annotated[int, BeforeValidator(_integral), Field(ge=0, le=127)]
ZeroStage = Annotated[Literal[0, 1, 2, 3], BeforeValidator(_no_boolean)]
LossScale = Annotated[float, AfterValidator(_loss_scale)]
StaticLossScale = Annotated[float, Field(ge=0), AfterValidator(_static_loss_scale)]  # 0: dynamic
# a block read by DeepSpeed features that have no effect here: its inside is not checked
Block = dict[str, Any]


class Section(BaseModel):
    """Strict: "false" is not a boolean nor "1e-3" a number, no NaN or infinity, no unknown keys."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)
