"""Reading a runtime config file as DeepSpeed does: it reads them with hjson, so ds_config files
in the wild carry comments (`//`, `#`, `/* */`), trailing commas, unquoted keys and strings, and
line breaks for commas. JSON with comments and trailing commas is read directly; anything else as
Hjson (hjson_text.py). Duplicate keys are refused, as DeepSpeed refuses them."""

import base64
import binascii
import json
import re
from pathlib import Path
from typing import Any

from megatron.errors import ConfigError
from megatron.runtime.config.hjson_text import HjsonError, parse_hjson

# a JSON string, or a comment, or a comma that only closing brackets follow
_TOKENS = re.compile(
    r'"(?:[^"\\]|\\.)*"|//[^\n]*|#[^\n]*|/\*.*?\*/|,(?=\s*(?:(?://[^\n]*|#[^\n]*|/\*.*?\*/)\s*)*[}\]])', re.DOTALL
)


def strip_comments(text: str) -> str:
    """JSON text without comments and trailing commas (strings are left as they are)."""

    def keep(match: re.Match[str]) -> str:
        token = match.group(0)
        # a block comment leaves its line breaks, so that errors still name the right line
        return token if token.startswith('"') else "\n" * token.count("\n")

    return _TOKENS.sub(keep, text)


_URL_SAFE = str.maketrans("-_", "+/")


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
    return parse_config_text(text, str(path))


def read_config_source(source: str | Path) -> tuple[dict[str, Any], str]:
    """A config file, or (as DeepSpeed takes it) the config itself in URL-safe base64; with the
    name to use for it in errors."""
    if isinstance(source, Path) or Path(source).exists():
        return read_config_file(source), str(source)
    try:
        text = base64.b64decode(source.translate(_URL_SAFE), validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError, ValueError):
        text = ""
    if not text.lstrip().startswith("{"):  # a mistyped path, most likely
        raise ConfigError(
            f"the runtime config {source[:80]} does not exist (nor is it base64-encoded JSON); check the path"
        )
    return parse_config_text(text, "the base64 runtime config"), "the base64 runtime config"


def parse_config_text(text: str, path: str) -> dict[str, Any]:
    """The config object in `text` (from `path`, for errors)."""
    try:
        try:
            config = json.loads(strip_comments(text), object_pairs_hook=_no_duplicates)
        except json.JSONDecodeError:  # Hjson, as DeepSpeed reads its configs (a superset of JSON)
            config = parse_hjson(text, pairs_hook=_no_duplicates)
    except HjsonError as exc:
        raise ConfigError(f"cannot read the runtime config {path}: {exc}; it must be JSON or Hjson") from None
    except ConfigError as exc:
        raise ConfigError(f"the runtime config {path}: {exc}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"the runtime config {path} must hold a JSON object")
    return config
