"""Reading a runtime config file as DeepSpeed does: it reads them with hjson, so ds_config files
in the wild carry comments (`//`, `#`, `/* */`) and trailing commas. Those two are read here;
hjson's other forms (unquoted keys and strings, newlines instead of commas) are refused with one
sentence. Duplicate keys are refused, as DeepSpeed refuses them."""

import json
import re
from pathlib import Path
from typing import Any

from megatron.errors import ConfigError

# a JSON string, or a comment, or a comma that only closing brackets follow
_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|//[^\n]*|#[^\n]*|/\*.*?\*/|,(?=\s*(?:(?://[^\n]*|#[^\n]*|/\*.*?\*/)\s*)*[}\]])',
                     re.DOTALL)


def strip_comments(text: str) -> str:
    """JSON text without comments and trailing commas (strings are left as they are)."""
    def keep(match: re.Match[str]) -> str:
        token = match.group(0)
        # a block comment leaves its line breaks, so that errors still name the right line
        return token if token.startswith('"') else "\n" * token.count("\n")
    return _TOKENS.sub(keep, text)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [key for key, _ in pairs]
    repeated = sorted({key for key in keys if keys.count(key) > 1})
    if repeated:
        raise ConfigError(f"key {repeated[0]!r} appears twice in one block; keep one of them")
    return dict(pairs)


def read_config_file(path: str | Path) -> dict[str, Any]:
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read the runtime config {path}: {exc}") from None
    try:
        config = json.loads(strip_comments(text), object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"cannot read the runtime config {path}: {exc.msg} at line {exc.lineno} column {exc.colno}; it must be "
            "JSON, with comments and trailing commas allowed (quote every key and string)"
        ) from None
    except ConfigError as exc:
        raise ConfigError(f"the runtime config {path}: {exc}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"the runtime config {path} must hold a JSON object")
    return config
