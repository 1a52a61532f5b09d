"""The one JSON encoder every response body and SSE event is built with."""

from __future__ import annotations

import msgspec

_encoder = msgspec.json.Encoder()
encode = _encoder.encode
