"""Hjson (hjson.github.io), which DeepSpeed reads its configs with: JSON whose keys need no quotes,
whose strings may be quoteless (to the end of the line) or '''multi-line''', whose commas may be
line breaks, with `#`, `//` and `/* */` comments and the root object's braces optional. Parsed
here into the same dict json would give, duplicate keys refused as DeepSpeed refuses them."""

import json
import re
from collections.abc import Callable
from typing import Any

PUNCTUATORS = set("{}[],:")
_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
_LITERALS = {"true": True, "false": False, "null": None}


class HjsonError(ValueError):
    def __init__(self, message: str, text: str, at: int) -> None:
        line = text.count("\n", 0, at) + 1
        column = at - (text.rfind("\n", 0, at) + 1) + 1
        super().__init__(f"{message} at line {line} column {column}")


class _Reader:
    def __init__(self, text: str, pairs_hook: Callable[[list[tuple[str, Any]]], dict[str, Any]]) -> None:
        self.text, self.at, self.pairs_hook = text, 0, pairs_hook

    def fail(self, message: str) -> HjsonError:
        return HjsonError(message, self.text, self.at)

    def skip(self, newlines: bool = True) -> None:
        """Whitespace (line breaks too unless told otherwise) and comments."""
        text = self.text
        while self.at < len(text):
            char = text[self.at]
            if char in " \t\r" or (newlines and char == "\n"):
                self.at += 1
            elif char == "#" or text.startswith("//", self.at):
                end = text.find("\n", self.at)
                self.at = len(text) if end < 0 else end
            elif text.startswith("/*", self.at):
                end = text.find("*/", self.at + 2)
                if end < 0:
                    raise self.fail("a /* comment is not closed")
                self.at = end + 2
            else:
                return

    def peek(self) -> str:
        return self.text[self.at] if self.at < len(self.text) else ""

    def document(self) -> dict[str, Any]:
        self.skip()
        if self.peek() == "{":
            value = self.value()
        else:
            value = self.members(closing="")
        self.skip()
        if self.at != len(self.text):
            raise self.fail("unexpected text after the config object")
        return value

    def members(self, closing: str) -> dict[str, Any]:
        pairs: list[tuple[str, Any]] = []
        while True:
            self.skip()
            if self.peek() == closing:
                self.at += len(closing)
                return self.pairs_hook(pairs)
            key = self.key()
            self.skip()
            if self.peek() != ":":
                raise self.fail(f"expected ':' after the key {key!r}")
            self.at += 1
            pairs.append((key, self.value()))
            self.separator()

    def separator(self) -> None:
        """A comma, a line break or the closing bracket next."""
        self.skip(newlines=False)
        if self.peek() == ",":
            self.at += 1
        elif self.peek() not in ("\n", "}", "]", ""):
            raise self.fail("expected a comma or a line break")

    def key(self) -> str:
        if self.peek() in ('"', "'"):
            return self.quoted()
        start = self.at
        while self.at < len(self.text) and self.text[self.at] not in PUNCTUATORS and not self.text[self.at].isspace():
            self.at += 1
        if self.at == start:
            raise self.fail("expected a key")
        return self.text[start : self.at]

    def value(self) -> Any:
        self.skip()
        char = self.peek()
        if char == "{":
            self.at += 1
            return self.members(closing="}")
        if char == "[":
            self.at += 1
            items = []
            while True:
                self.skip()
                if self.peek() == "]":
                    self.at += 1
                    return items
                items.append(self.value())
                self.separator()
        if self.text.startswith("'''", self.at):
            return self.multiline()
        if char in ('"', "'"):
            return self.quoted()
        if char == "" or char in ",:]}":
            raise self.fail("expected a value")
        return self.quoteless()

    def quoted(self) -> str:
        quote, start = self.peek(), self.at
        self.at += 1
        while self.at < len(self.text) and self.text[self.at] != quote:
            self.at += 2 if self.text[self.at] == "\\" else 1
        if self.at >= len(self.text):
            self.at = start
            raise self.fail("a string is not closed")
        self.at += 1
        if quote == '"':
            return json.loads(self.text[start : self.at])
        # a '...' string has JSON's escapes, with \' for a quote and " needing none
        body = self.text[start + 1 : self.at - 1]
        return json.loads('"' + re.sub(r"\\'|\"", lambda m: '\\"' if m.group(0) == '"' else "'", body) + '"')

    def multiline(self) -> str:
        end = self.text.find("'''", self.at + 3)
        if end < 0:
            raise self.fail("a ''' string is not closed")
        body = self.text[self.at + 3 : end]
        self.at = end + 3
        lines = body.strip("\n").split("\n")
        indent = min((len(line) - len(line.lstrip()) for line in lines if line.strip()), default=0)
        return "\n".join(line[indent:] for line in lines)

    def quoteless(self) -> Any:
        """A number, true, false or null ending at a comma, bracket, comment or line end; else a
        string to the end of the line."""
        end = self.text.find("\n", self.at)
        end = len(self.text) if end < 0 else end
        line = self.text[self.at : end]
        word = re.match(r"[^,\]}\s#]+", line)
        if word is not None:
            token = word.group(0)
            rest = line[len(token) :].lstrip(" \t\r")
            if rest == "" or rest[0] in ",]}#" or rest.startswith(("//", "/*")):
                if token in _LITERALS:
                    self.at += len(token)
                    return _LITERALS[token]
                if _NUMBER.fullmatch(token):
                    self.at += len(token)
                    return json.loads(token)
        self.at = end
        return line.rstrip()


def parse_hjson(text: str, pairs_hook: Callable[[list[tuple[str, Any]]], dict[str, Any]] = dict) -> dict[str, Any]:
    """The object in Hjson `text`; HjsonError names the line and column of the first fault."""
    return _Reader(text, pairs_hook).document()
