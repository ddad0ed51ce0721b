"""The value types and the strict section base shared by the runtime config's schema modules."""

from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field


def _integral(value: Any) -> Any:
    """DeepSpeed's configs write element counts like 5e8: a float with no fraction is that integer."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


Count = Annotated[int, BeforeValidator(_integral), Field(ge=0)]
PositiveCount = Annotated[int, BeforeValidator(_integral), Field(ge=1)]
NonNegative = Annotated[float, Field(ge=0)]
Positive = Annotated[float, Field(gt=0)]
Beta = Annotated[float, Field(ge=0, lt=1)]
# 2 ** power must stay a finite fp32 number (the largest power of two there is 2 ** 127)
ScalePower = Annotated[int, BeforeValidator(_integral), Field(ge=0, le=127)]
# a block read by DeepSpeed features that have no effect here: its inside is not checked
Block = dict[str, Any]


class Section(BaseModel):
    """Strict: "false" is not a boolean nor "1e-3" a number, no NaN or infinity, no unknown keys."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)
