"""What every section of the spec is: a frozen pydantic model that refuses unknown keys."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

# No text setting is longer than this, whatever its field allows besides: the longest the shipped
# recipes and examples hold is about 110 characters (a reason for an environment variable). Each
# setting with a tighter rule of its own (a tag, a path, an ARN) says so in its validator.
TEXT_MAX_CHARS = 4096


class Frozen(BaseModel):
    """Immutable once validated; a key the model does not know is refused; no text is unbounded."""

    model_config = ConfigDict(frozen=True, extra="forbid", str_max_length=TEXT_MAX_CHARS)
