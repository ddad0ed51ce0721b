"""The command-line parser every tool uses: a bad flag is one sentence (a `ConfigError` that the
entry point prints on rank 0 only) naming the flag and the nearest valid one, never a usage dump
on every rank; `--help` shows each flag's default. Value types here check ranges as they parse,
so a bad number stops before any work."""

import argparse
import copy
import difflib
import math
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from megatron.errors import ConfigError


def _no_default(action: argparse.Action) -> bool:
    """Nothing worth showing: no value, an off switch, or a suppressed default (0 and 0.0 are shown)."""
    return action.default is None or action.default is False or action.default == argparse.SUPPRESS


class _HelpWithDefaults(argparse.ArgumentDefaultsHelpFormatter):
    """argparse adds "(default: X)" only to flags that have a help text; give it to all of them,
    except where there is no default to show."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if _no_default(action):
            return action.help
        return super()._get_help_string(action)

    def _format_action(self, action: argparse.Action) -> str:
        if action.help is None and action.option_strings and not _no_default(action):
            action = copy.copy(action)
            action.help = "(default: %(default)s)"
        return super()._format_action(action)


class FlagParser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)  # an abbreviation that later becomes ambiguous breaks scripts
        kwargs.setdefault("formatter_class", _HelpWithDefaults)
        super().__init__(*args, **kwargs)

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> argparse.Namespace:  # type: ignore[override]
        argv = sys.argv[1:] if args is None else list(args)
        # a misspelled flag first: argparse would otherwise report the flag it hides as missing
        misspelled = [
            token
            for token in argv
            if token.startswith("--") and token.split("=", 1)[0] not in self._option_string_actions
        ]
        if misspelled:
            self.error(self._unknown(misspelled))
        parsed, unknown = self.parse_known_args(argv, namespace)
        if unknown:
            self.error(self._unknown(unknown))
        return parsed

    def _unknown(self, tokens: list[str]) -> str:
        flags = [token.split("=", 1)[0] for token in tokens if token.startswith("-")]
        if not flags:
            return f"unexpected value {tokens[0]!r}: every value follows the flag it belongs to"
        close = difflib.get_close_matches(flags[0], list(self._option_string_actions), n=1, cutoff=0.6)
        hint = f"did you mean {close[0]}?" if close else f"{self.prog} --help lists every flag"
        return f"unknown flag {flags[0]}; {hint}"

    def error(self, message: str) -> NoReturn:
        raise ConfigError(message.removeprefix("argument "))


def finite_float(text: str) -> float:
    """A float flag: 'nan' and 'inf' parse as floats but mean a typo or a broken script."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def ranged(base: Callable[[str], float | int], ok: Callable[[float], bool], what: str) -> Callable[[str], Any]:
    """A flag type: `base` parses the text, `ok` accepts the value; otherwise "'TEXT' is not WHAT"."""

    def parse(text: str) -> float | int:
        try:
            value = base(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
        return value

    parse.__name__ = what  # argparse names the type in its own messages
    return parse


positive_int = ranged(int, lambda v: v > 0, "a positive integer")
non_negative_int = ranged(int, lambda v: v >= 0, "zero or a positive integer")
positive_float = ranged(finite_float, lambda v: v > 0, "a positive number")
non_negative_float = ranged(finite_float, lambda v: v >= 0, "zero or a positive number")
probability = ranged(finite_float, lambda v: 0 <= v < 1, "a probability in [0, 1)")
