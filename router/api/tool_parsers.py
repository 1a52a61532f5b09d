"""Tool calls in a model's own format (``tool_call_parser``), found in its text.

Each parser reproduces the ``extract_tool_calls`` of vLLM's parser of the
same name (vllm/tool_parsers/): the same calls, arguments re-serialized the
same way (``json.dumps(..., ensure_ascii=False)``), the same content, the
same fallback to plain content when the text does not parse.
tests/unit/test_tools.py runs both on one corpus and compares.  weir does not
import vLLM's classes: they import torch and vLLM's server (9 s of CPU and
~550 MB measured on this VM), which the router must not carry.

``AutoStream`` is the streaming side of ``llama3_json``: content before a
call streams at once; from the first sign of a call the text is held, and at
the end the whole text is parsed as above.  (hermes calls are read as they
are generated, by router.api.tools.ChoiceToolStream; ``extract`` keeps
vLLM's whole-text reading of them, the reference that test compares.)
"""

from __future__ import annotations

import json
import re
from typing import Any, NamedTuple


class ParsedCall(NamedTuple):
    name: str
    arguments: str  # JSON text


TOOL_PARSERS = ("hermes", "llama3_json")

_HERMES_START = "<tool_call>"
_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
_LLAMA_BOT = "<|python_tag|>"
_decoder = json.JSONDecoder()


def _call(name: Any, arguments: Any) -> ParsedCall:
    if not isinstance(name, str):
        raise TypeError("a tool call's name must be a string")
    return ParsedCall(name, json.dumps(arguments, ensure_ascii=False))


def _hermes(text: str) -> tuple[list[ParsedCall], str | None]:
    if _HERMES_START not in text:
        return [], text
    try:
        raws = [json.loads(a or b) for a, b in _HERMES.findall(text)]
        calls = [_call(r["name"], r["arguments"]) for r in raws]
    except Exception:  # vLLM's parser: any failure -> the text is content
        return [], text
    content = text[: text.find(_HERMES_START)]
    return calls, content or None


def _llama3_json(text: str) -> tuple[list[ParsedCall], str | None]:
    if _LLAMA_BOT not in text and "{" not in text:
        return [], text
    calls: list[ParsedCall] = []
    end = -1
    try:
        for m in re.finditer(r"\{", text):
            start = m.start()
            if start <= end:
                continue  # inside the object parsed last
            obj, length = _decoder.raw_decode(text[start:])
            end = start + length
            calls.append(_call(obj["name"], obj["arguments"] if "arguments" in obj else obj["parameters"]))
    except Exception:
        return [], text
    return (calls, None) if calls else ([], text)


_EXTRACT = {"hermes": _hermes, "llama3_json": _llama3_json}


def extract(parser: str, text: str) -> tuple[list[ParsedCall], str | None]:
    """(calls, content) from a whole response; no calls: ([], text)."""
    return _EXTRACT[parser](text)


def tag_overlap(text: str, tag: str) -> int:
    """Length of the longest prefix of ``tag`` that ends ``text``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class AutoStream:
    """One streamed choice under ``tool_choice: auto``: ``feed`` returns the
    content that may be sent now; ``finish`` the rest and the calls."""

    __slots__ = ("parser", "text", "sent", "held")

    def __init__(self, parser: str) -> None:
        self.parser = parser
        self.text = ""
        self.sent = 0  # chars of text sent as content
        self.held = False  # a call started: nothing more streams as content

    def feed(self, delta: str) -> str:
        self.text += delta
        if self.held:
            return ""
        text = self.text
        if self.parser == "hermes":
            at = text.find(_HERMES_START, max(0, self.sent - len(_HERMES_START)))
            if at >= 0:
                self.held = True
                sendable = at
            else:
                sendable = len(text) - tag_overlap(text, _HERMES_START)
        else:  # llama3_json: a call is the whole output, from its first character
            stripped = text.lstrip()
            if not stripped:
                return ""
            if stripped.startswith("{") or _LLAMA_BOT.startswith(stripped[: len(_LLAMA_BOT)]):
                if self.sent == 0:
                    self.held = True
                    return ""
            sendable = len(text)
        out = text[self.sent : sendable] if sendable > self.sent else ""
        self.sent = max(self.sent, sendable)
        return out

    def finish(self) -> tuple[list[ParsedCall], str]:
        """The calls, and the content not sent yet."""
        calls, content = extract(self.parser, self.text)
        if not calls:
            return [], self.text[self.sent :]
        # hermes: content is what preceded the first tag (sent already)
        rest = (content or "")[self.sent :]
        return calls, rest
