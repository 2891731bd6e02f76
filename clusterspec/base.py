"""What every section of the spec is: a frozen pydantic model that refuses unknown keys."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Frozen(BaseModel):
    """Immutable once validated; a key the model does not know is refused."""

    model_config = ConfigDict(frozen=True, extra="forbid")
