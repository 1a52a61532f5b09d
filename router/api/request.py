"""What every endpoint's parser shares: the headers the ingress reads, body
decoding with OpenAI-style 400s (the offending field in ``param``), and the
shape check a finished ``Submit`` passes before it is returned."""

from __future__ import annotations

import re
from typing import TypeVar

import msgspec

from router.api.checks import check_shape
from router.api.errors import RequestError, invalid
from shared.keys import key_from_headers
from shared.protocol import Routing, Submit, TaskType

T = TypeVar("T")


class RequestMeta(msgspec.Struct, gc=False):
    """What the ingress takes from HTTP headers (see ``meta_from_headers``)."""

    api_key: str | None = None
    priority: str | None = None
    task_type: str | None = None
    allow_fallback: bool = False
    routing: Routing | None = None  # agents' and gateways' headers (router.api.agent_headers)


# A request's task type by name: the body's ``task_type`` or the x-weir-task-type header.
TASK_TYPES = {"short": TaskType.SHORT, "long": TaskType.LONG}


def meta_from_headers(
    authorization: str | None,
    x_api_key: str | None,
    x_weir_priority: str | None = None,
    x_weir_task_type: str | None = None,
    x_weir_allow_fallback: str | None = None,
) -> RequestMeta:
    """``x-api-key`` wins over ``Authorization: Bearer`` because it is the
    header Envoy's per-key rate limit counts; the key is taken as Envoy takes
    it (shared.keys.key_from_headers) and a malformed one refused at admission."""
    key = key_from_headers(x_api_key, authorization)
    allow = (x_weir_allow_fallback or "").strip().lower() in ("1", "true", "yes")
    return RequestMeta(key or None, x_weir_priority or None, x_weir_task_type or None, allow)


_AT_PATH = re.compile(r" - at `(?:key` in `)?\$\.?([^`]*)`$")  # "at `key` in `$.logit_bias`": a dict key
_MISSING = re.compile(r"^Object missing required field `([^`]+)`")


def _from_validation_error(e: msgspec.ValidationError) -> RequestError:
    """msgspec says e.g. "Expected `int`, got `str` - at `$.max_tokens`";
    OpenAI clients want the offending field in ``param``."""
    text = str(e)
    at = _AT_PATH.search(text)
    path = at.group(1) if at else ""
    message = text[: at.start()] if at else text
    missing = _MISSING.match(message)
    if missing:
        path = f"{path}.{missing.group(1)}" if path else missing.group(1)
    param = path.replace("[...]", "") or None  # a dict's value ("logit_bias[...]"): the dict
    return invalid(f"{message} (at '{param}')" if param else message, param=param)


def decode_body(decoder: msgspec.json.Decoder[T], body: bytes) -> T:
    if not body:
        raise invalid("Request body is empty; expected a JSON object")
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as e:
        raise _from_validation_error(e) from None
    except msgspec.DecodeError as e:
        raise invalid(f"Malformed JSON body: {e}") from None
    except RecursionError:  # msgspec's answer to absurdly deep nesting
        raise invalid("Malformed JSON body: nested too deeply") from None


def check_submit_shape(sub: Submit) -> None:
    """The same shape rules as for ZeroMQ submissions (router.tenancy.identity), at once."""
    err = check_shape(sub)
    if err is not None:
        raise RequestError(err)
