"""Where tool calls sit in JSON text that is still being generated (pure).

``CallScan`` reads a growing text once, character by character, and records
for each call object its ``name`` (once the string is closed) and the span of
its arguments value (``parameters`` in a ``required`` array, ``arguments``
in a hermes ``<tool_call>`` object).  The spans are prefix-stable: scanning a
prefix gives the same spans cut to that prefix, so a stream can send a call's
name the moment it is complete and its arguments as they are made, verbatim,
and a whole response read the same way has the same calls.

The state machine is vLLM's ``_scan_required_tool_calls``
(vllm/tool_parsers/streaming.py), made incremental and taught the hermes
object; only the call objects' own keys are interpreted, so braces, brackets
and quotes inside values and strings cannot confuse it.
"""

from __future__ import annotations

import json

_KEY, _COLON, _VALUE, _IN_STRING, _IN_CONTAINER, _IN_SCALAR, _AFTER = range(7)


class CallSpan:
    """One call object: its name (None until complete) and its arguments'
    span (``args_end`` None while the value is still being made)."""

    __slots__ = ("name", "args_start", "args_end", "scan")

    def __init__(self, scan: CallScan) -> None:
        self.name: str | None = None
        self.args_start: int | None = None
        self.args_end: int | None = None
        self.scan = scan

    def arguments(self, text: str) -> str:
        """The arguments' text read so far ("" before the value starts)."""
        if self.args_start is None:
            return ""
        end = self.args_end if self.args_end is not None else self.scan.pos
        return text[self.args_start : end]


class CallScan:
    """An array of call objects (``array``: ``tool_choice: required``) or one
    call object (a hermes region), from ``start`` in a growing text."""

    __slots__ = (
        "pos",
        "array",
        "keys",
        "level",
        "depth",
        "in_string",
        "escaped",
        "string_start",
        "cur",
        "expect",
        "key",
        "value_start",
        "spans",
        "end",
    )

    def __init__(self, start: int, array: bool, args_keys: tuple[str, ...]) -> None:
        self.pos = start  # scanned up to here
        self.array = array
        self.keys = args_keys
        self.level = 2 if array else 1  # the depth a call's keys sit at
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.string_start = 0
        self.cur: CallSpan | None = None
        self.expect = _KEY
        self.key: str | None = None
        self.value_start = 0
        self.spans: list[CallSpan] = []
        self.end: int | None = None  # where the JSON value closed, or where the text stopped being one

    def _end_value(self, text: str, pos: int) -> None:
        cur = self.cur
        assert cur is not None
        if self.key in self.keys:
            if cur.args_end is None:
                cur.args_end = pos
        elif self.key == "name" and self.expect == _IN_STRING and cur.name is None:
            try:
                name = json.loads(text[self.value_start : pos])
            except ValueError:
                name = None
            cur.name = name if isinstance(name, str) else None
        self.expect = _AFTER

    def _start_value(self, pos: int, state: int) -> None:
        cur = self.cur
        assert cur is not None
        self.value_start = pos
        if self.key in self.keys and cur.args_start is None:
            cur.args_start = pos
        self.expect = state

    def _stop(self, pos: int) -> None:
        self.end = self.pos = pos

    def scan(self, text: str) -> None:
        """Read what was added to ``text`` since the last call."""
        if self.end is not None:
            return
        level = self.level
        i = self.pos
        n = len(text)
        while i < n:
            ch = text[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
                    if self.depth == level and self.cur is not None:
                        if self.expect == _KEY:
                            self.key = text[self.string_start + 1 : i]
                            self.expect = _COLON
                        elif self.expect == _IN_STRING:
                            self._end_value(text, i + 1)
                i += 1
                continue
            if self.depth == 0 and ch not in "[{" and not ch.isspace():
                return self._stop(i)  # not a call (or text after it)
            if ch == '"':
                if self.depth < level - 1 or (self.depth == level - 1 and self.array):
                    return self._stop(i)  # a string where a call object must be
                self.in_string = True
                self.string_start = i
                if self.depth == level and self.cur is not None and self.expect == _VALUE:
                    self._start_value(i, _IN_STRING)
            elif ch in "{[":
                if self.depth == level - 1:
                    if ch != "{":
                        return self._stop(i)
                    self.cur = CallSpan(self)
                    self.spans.append(self.cur)
                    self.expect, self.key = _KEY, None
                elif self.depth == 0 and ch != "[":
                    return self._stop(i)
                elif self.depth == level and self.cur is not None and self.expect == _VALUE:
                    self._start_value(i, _IN_CONTAINER)
                self.depth += 1
            elif ch in "}]":
                if self.depth == level and self.cur is not None and self.expect == _IN_SCALAR:
                    self._end_value(text, i)
                self.depth -= 1
                if self.depth == level and self.cur is not None and self.expect == _IN_CONTAINER:
                    self._end_value(text, i + 1)
                elif self.depth == level - 1:
                    self.cur = None
                if self.depth <= 0:
                    return self._stop(i + 1)
            elif self.depth == level and self.cur is not None:
                if ch == ":":
                    if self.expect == _COLON:
                        self.expect = _VALUE
                elif ch == ",":
                    if self.expect == _IN_SCALAR:
                        self._end_value(text, i)
                    self.expect, self.key = _KEY, None
                elif ch.isspace():
                    if self.expect == _IN_SCALAR:
                        self._end_value(text, i)
                elif self.expect == _VALUE:
                    self._start_value(i, _IN_SCALAR)
            i += 1
        self.pos = i
