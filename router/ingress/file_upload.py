"""An upload's body, parsed and written to disk as it arrives, off the event loop.

The HTTP server hands each chunk of a ``POST /v1/files`` body to an
``Upload`` (router.ingress.routes.BodySink) the moment it reads it; the Upload
passes the chunks, in order, to its ``MultipartToFile`` on a thread of the
file pool, which parses them (python-multipart's push parser) and writes the
``file`` part straight to a temporary file (router.services.batch.files.FileWriter).
Nothing waits for the disk on the loop, and no body is ever whole in memory:
when more than ``HIGH_WATER`` bytes are read but not yet written, the server
stops reading the socket until the thread catches up (TCP, then Envoy, then
the client wait), so an upload holds at most ``HIGH_WATER`` plus one socket
read in memory, whatever its size and however slow the disk.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple

from python_multipart.multipart import MultipartParser, parse_options_header

from router.ingress.routes import Answer
from router.services.batch.files import FileStore, FileWriter
from shared.errors import Code, error
from shared.protocol import ErrorInfo

HIGH_WATER = 256 << 10  # bytes read but not yet written, per upload, before reading pauses
MAX_FIELDS = 16  # form fields besides the file
MAX_FIELD_BYTES = 4096  # each (``purpose`` is a word)
FILE_FIELD = "file"


class Received(NamedTuple):
    """A complete upload's body: its small fields, and its file part sealed on disk (or None)."""

    fields: dict[str, str]
    file: FileWriter | None
    filename: str | None
    blank: bool  # the file holds nothing but whitespace (or nothing)


class _Bad(Exception):
    """The body is not an acceptable upload (400, or ``info``'s status)."""

    def __init__(self, info: ErrorInfo) -> None:
        super().__init__(info.message)
        self.info = info


def boundary_of(content_type: str | None) -> bytes | None:
    """The multipart boundary of a ``Content-Type``, or None if it is not multipart/form-data."""
    ctype, params = parse_options_header(content_type or "")
    boundary = params.get(b"boundary")
    return boundary if ctype == b"multipart/form-data" and boundary else None


class MultipartToFile:
    """The thread side of one upload: ``write`` its chunks in order, then
    ``finish`` (or ``discard``); one call at a time (``Upload`` sees to it).
    A body that turns out bad stops being parsed, and its file is removed at
    once; ``finish`` reports why."""

    def __init__(self, store: FileStore, boundary: bytes, max_file_bytes: int) -> None:
        self.store = store
        self.max_file_bytes = max_file_bytes
        self.fields: dict[str, str] = {}
        self.file: FileWriter | None = None
        self.filename: str | None = None
        self.failed: ErrorInfo | None = None  # a bad body (4xx)
        self.disk_error: OSError | None = None  # the disk refused (full)
        self.ended = False  # the closing boundary was read
        self.blank = True  # no byte of the file but whitespace so far
        self._header_name = b""
        self._header_value = b""
        self._headers: dict[bytes, bytes] = {}
        self._part: FileWriter | bytearray | None = None
        self._part_name = ""
        self.parser: MultipartParser | None = MultipartParser(
            boundary,
            {
                "on_part_begin": self._on_part_begin,
                "on_header_field": self._on_header_field,
                "on_header_value": self._on_header_value,
                "on_header_end": self._on_header_end,
                "on_headers_finished": self._on_headers_finished,
                "on_part_data": self._on_part_data,
                "on_part_end": self._on_part_end,
                "on_end": self._on_end,
            },
        )

    # ------------------------------------------------------------ the parser's callbacks

    def _on_part_begin(self) -> None:
        self._headers = {}
        self._part = None

    def _on_header_field(self, data: bytes, start: int, end: int) -> None:
        self._header_name += data[start:end]

    def _on_header_value(self, data: bytes, start: int, end: int) -> None:
        self._header_value += data[start:end]  # (each line bounded by the parser's max_header_size)

    def _on_header_end(self) -> None:
        self._headers[self._header_name.lower()] = self._header_value
        self._header_name, self._header_value = b"", b""

    def _on_headers_finished(self) -> None:
        _, disp = parse_options_header(self._headers.get(b"content-disposition", b""))
        raw_name = disp.get(b"name")
        name = "" if raw_name is None else raw_name.decode("utf-8", "replace")
        self._part_name = name
        if name == FILE_FIELD:
            if self.file is not None:
                raise _Bad(error(Code.BAD_REQUEST, "Only one `file` part is allowed.", param="file"))
            filename = disp.get(b"filename")
            self.filename = None if filename is None else filename.decode("utf-8", "replace")
            self.file = self._part = self.store.stage()
        elif raw_name is not None:
            if len(self.fields) >= MAX_FIELDS:
                raise _Bad(error(Code.BAD_REQUEST, f"At most {MAX_FIELDS} form fields besides `file`."))
            self._part = bytearray()
        # (a part without a name is skipped)

    def _on_part_data(self, data: bytes, start: int, end: int) -> None:
        part = self._part
        if isinstance(part, FileWriter):
            if part.size + (end - start) > self.max_file_bytes:
                raise _Bad(
                    error(
                        Code.REQUEST_TOO_LARGE,
                        f"The file exceeds the limit of {self.max_file_bytes} bytes",
                        param="file",
                    )
                )
            if self.blank and data[start:end].strip():
                self.blank = False
            part.write(memoryview(data)[start:end])
        elif part is not None:
            if len(part) + (end - start) > MAX_FIELD_BYTES:
                raise _Bad(error(Code.BAD_REQUEST, f"The form field {self._part_name!r} is too long."))
            part += data[start:end]

    def _on_part_end(self) -> None:
        if isinstance(self._part, bytearray):
            self.fields[self._part_name] = self._part.decode("utf-8", "replace")
        self._part = None

    def _on_end(self) -> None:
        self.ended = True

    # ------------------------------------------------------------ the upload's calls (a thread)

    def write(self, chunks: list[bytes]) -> None:
        parser = self.parser
        if parser is None:
            return  # failed already: the rest of the body is read and dropped
        try:
            for chunk in chunks:
                parser.write(chunk)
        except _Bad as e:
            self._fail(e.info)
        except OSError as e:
            self.disk_error = e
            self._fail(None)
        except Exception as e:  # python-multipart's own errors on a malformed body
            self._fail(error(Code.BAD_REQUEST, f"Malformed upload: {e}", param="file"))

    def finish(self) -> Received | ErrorInfo | OSError:
        """The body is complete: its file sealed (fsync'ed), or why not (nothing is left then)."""
        if self.disk_error is not None:
            return self.disk_error
        if self.failed is not None:
            return self.failed
        if not self.ended:
            self._fail(None)
            return error(Code.BAD_REQUEST, "Malformed upload: the body ended before its closing boundary.")
        if self.file is not None:
            try:
                self.file.seal()
            except OSError as e:
                self._fail(None)
                return e
        return Received(self.fields, self.file, self.filename, self.blank)

    def discard(self) -> None:
        self._fail(None)

    def _fail(self, info: ErrorInfo | None) -> None:
        if info is not None and self.failed is None:
            self.failed = info
        self.parser = None
        self._part = None
        if self.file is not None:
            self.file.discard()
            self.file = None


class Upload:
    """The loop side of one upload (router.ingress.routes.BodySink): chunks queue
    here and go to the thread in order, one batch at a time; ``feed`` says
    False once ``HIGH_WATER`` bytes wait, and ``resume`` is called when the
    thread has caught up to half of it.  ``finish`` waits for the last
    write, then lets ``done`` answer from what was received."""

    def __init__(
        self,
        pool: concurrent.futures.Executor,
        body: MultipartToFile,
        done: Callable[[Received | ErrorInfo | OSError], Awaitable[Answer]],
        aborted: Callable[[], None] | None = None,
    ) -> None:
        self.loop = asyncio.get_running_loop()
        self.pool = pool
        self.body = body
        self.done = done  # the body is complete: answers (whatever it decides, its own cleanup)
        self.aborted = aborted  # the body never will be (its reservation returns)
        self.resume: Callable[[], None] | None = None
        self.held = 0  # bytes read and not yet written (queued + in the thread)
        self._queue: list[bytes] = []
        self._busy = False  # a batch of chunks is in the thread
        self._aborted = False
        self._idle: asyncio.Future[None] | None = None

    def feed(self, chunk: bytes) -> bool:
        if self._aborted:
            return True
        self._queue.append(chunk)
        self.held += len(chunk)
        if not self._busy:
            self._next()
        return self.held < HIGH_WATER

    def _next(self) -> None:
        chunks, self._queue = self._queue, []
        self._busy = True
        n = sum(map(len, chunks))
        self.loop.run_in_executor(self.pool, self.body.write, chunks).add_done_callback(
            lambda fut: self._written(fut, n)
        )

    def _written(self, fut: asyncio.Future[Any], n: int) -> None:
        self._busy = False
        self.held -= n
        fut.exception()  # (write reports its failures itself; nothing else raises)
        if self._aborted:
            self.pool.submit(self.body.discard)
            return
        if self._queue:
            self._next()
        elif self._idle is not None and not self._idle.done():
            self._idle.set_result(None)
        if self.held <= HIGH_WATER // 2 and self.resume is not None:
            self.resume()

    async def finish(self) -> Answer:
        try:
            while self._busy:
                self._idle = self.loop.create_future()
                await self._idle
            got = await self.loop.run_in_executor(self.pool, self.body.finish)
        except BaseException:
            if self.aborted is not None:
                self.aborted()  # (``done`` is never reached: its room returns here)
            raise
        return await self.done(got)

    def abort(self) -> None:
        """The body will never be complete (client gone, over the limit): nothing is kept."""
        if self._aborted:
            return
        self._aborted = True
        self._queue.clear()
        if not self._busy:
            self.pool.submit(self.body.discard)
        if self.aborted is not None:
            self.aborted()
