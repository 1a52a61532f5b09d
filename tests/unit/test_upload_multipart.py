"""router.ingress.file_upload.MultipartToFile: a multipart body pushed in arbitrary
chunks gives the same fields and the same file bytes as the body whole --
whatever the split, even through the boundary, a CRLF or a part's headers --
and a bad body leaves no file behind."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from router.ingress.file_upload import MultipartToFile, Received, boundary_of
from router.services.batch.files import FileStore

BOUNDARY = b"----weirBoundaryX7y"


def body_of(purpose: bytes, data: bytes, filename: bytes = b"in.jsonl") -> bytes:
    return (
        b"--" + BOUNDARY + b"\r\n"
        b'Content-Disposition: form-data; name="purpose"\r\n\r\n' + purpose + b"\r\n"
        b"--" + BOUNDARY + b"\r\n"
        b'Content-Disposition: form-data; name="file"; filename="' + filename + b'"\r\n'
        b"Content-Type: application/jsonl\r\n\r\n" + data + b"\r\n"
        b"--" + BOUNDARY + b"--\r\n"
    )


def split(body: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(body) + 1) for c in cuts})
    edges = [0, *points, len(body)]
    return [body[a:b] for a, b in zip(edges, edges[1:]) if b > a]


# File bytes that look like the framing: CRLFs, dashes, a prefix of the boundary.
_tricky = st.lists(
    st.sampled_from([b"\r\n", b"--", b"\r\n--", b"\r\n--" + BOUNDARY[:5], b"-", b"\r", b"\n", b'{"a": 1}\n', b"x"]),
    max_size=40,
).map(b"".join)


@settings(max_examples=300, deadline=None)
@given(
    data=st.one_of(st.binary(max_size=3000), _tricky),
    cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=12),
    by_one=st.booleans(),
)
def test_any_chunking_gives_the_same_fields_and_file(data, cuts, by_one):
    body = body_of(b"batch", data)
    chunks = [body[i : i + 1] for i in range(len(body))] if by_one and len(body) < 1500 else split(body, cuts)
    with tempfile.TemporaryDirectory() as d:
        store = FileStore(Path(d))
        parsed = MultipartToFile(store, BOUNDARY, 1 << 20)
        for c in chunks:
            parsed.write([c])
        got = parsed.finish()
        assert isinstance(got, Received), got
        assert got.fields == {"purpose": "batch"} and got.filename == "in.jsonl"
        assert got.file is not None and got.file.size == len(data)
        assert got.file.tmp.read_bytes() == data
        assert got.blank == (not data.strip())
        got.file.discard()
        assert os.listdir(store.dir) == []


@settings(max_examples=100, deadline=None)
@given(cut=st.integers(min_value=1, max_value=400))
def test_a_body_cut_short_anywhere_is_refused_and_leaves_nothing(cut):
    body = body_of(b"batch", b'{"custom_id": "a"}\n' * 10)
    with tempfile.TemporaryDirectory() as d:
        store = FileStore(Path(d))
        parsed = MultipartToFile(store, BOUNDARY, 1 << 20)
        parsed.write([body[: min(cut, len(body) - 1)]])
        got = parsed.finish()
        assert not isinstance(got, Received)
        assert os.listdir(store.dir) == []


def test_a_file_over_the_limit_is_413_and_is_removed_at_once(tmp_path):
    store = FileStore(tmp_path)
    parsed = MultipartToFile(store, BOUNDARY, 100)
    body = body_of(b"batch", b"x" * 101)
    parsed.write([body[:150]])
    parsed.write([body[150:]])
    assert os.listdir(store.dir) == []  # removed when the limit was passed, not at the end
    got = parsed.finish()
    assert not isinstance(got, Received) and not isinstance(got, OSError)
    assert got.status == 413 and got.code == "request_too_large"


def test_two_file_parts_or_too_many_fields_are_refused(tmp_path):
    store = FileStore(tmp_path)
    part = b"--" + BOUNDARY + b'\r\nContent-Disposition: form-data; name="file"; filename="a"\r\n\r\nx\r\n'
    parsed = MultipartToFile(store, BOUNDARY, 1 << 20)
    parsed.write([part + part + b"--" + BOUNDARY + b"--\r\n"])
    got = parsed.finish()
    assert not isinstance(got, Received) and "Only one `file` part" in got.message  # type: ignore[union-attr]
    assert os.listdir(store.dir) == []
    field = b"--" + BOUNDARY + b'\r\nContent-Disposition: form-data; name="f%d"\r\n\r\nv\r\n'
    parsed = MultipartToFile(store, BOUNDARY, 1 << 20)
    parsed.write([b"".join(field % i for i in range(17)) + b"--" + BOUNDARY + b"--\r\n"])
    got = parsed.finish()
    assert not isinstance(got, Received) and got.status == 400  # type: ignore[union-attr]


def test_the_boundary_comes_from_a_multipart_content_type_only():
    assert boundary_of('multipart/form-data; boundary="abc"') == b"abc"
    assert boundary_of("multipart/form-data; boundary=abc") == b"abc"
    assert boundary_of("multipart/form-data") is None
    assert boundary_of("application/json; boundary=abc") is None
    assert boundary_of(None) is None
