"""OpenAI's request and response shapes: parse and check a request's JSON, shape the answers and errors.

Pure functions and dataclasses (no web framework, no model): `parse_chat` and
`parse_completion` turn a request body into a `Request` or raise `ApiError` naming the
parameter at fault; `ApiError.body` is OpenAI's ``{"error": {"message", "type", "param",
"code"}}``. Parameters that change what the model would say and are not implemented
(penalties, ``logit_bias``, tools, ``echo``, ``best_of``, ``suffix``, a JSON response format)
are refused with a 400 rather than ignored; the rest of what clients send (``user``,
``metadata``, ``store``, ...) is ignored.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from distconf.client.textgen import Sampling

__all__ = ["ApiError", "Request", "MAX_N", "MAX_STOP", "MAX_TOP_LOGPROBS", "parse_chat", "parse_completion",
           "new_id", "now"]

MAX_N = 8
"""Most choices one request may ask for (``n``)."""
MAX_STOP = 4
"""Most stop strings (OpenAI's limit)."""
MAX_TOP_LOGPROBS = 20
"""Most alternatives per token (chat ``top_logprobs``; completions ``logprobs`` allows 5, as OpenAI)."""
DEFAULT_COMPLETION_TOKENS = 16
"""``max_tokens`` of a completion that gives none (OpenAI's default)."""

_UNSUPPORTED = {  # parameter -> the value that means "not used"
    "frequency_penalty": 0, "presence_penalty": 0, "logit_bias": None, "tools": None, "functions": None,
    "tool_choice": None, "function_call": None, "echo": False, "best_of": 1, "suffix": None, "audio": None,
    "prediction": None, "modalities": None,
}
_ROLES = {"system", "user", "assistant", "developer"}


class ApiError(Exception):
    """An error answer: HTTP ``status`` and OpenAI's error object."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    @property
    def body(self) -> dict[str, Any]:
        """``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Request:
    """A checked generation request.

    ``messages`` (chat) or ``prompt`` (completions) is set; ``max_tokens`` None means
    "as many as the context allows" (chat). ``logprobs`` says whether pieces' log-probabilities
    are returned, ``sampling.top_logprobs`` how many alternatives.
    """

    kind: str  # "chat" or "completion"
    model: str
    sampling: Sampling
    max_tokens: int | None
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    messages: tuple[dict[str, str], ...] = ()
    prompt: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def new_id(prefix: str) -> str:
    """A fresh object id such as ``chatcmpl-…``."""
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    """OpenAI's ``created``: Unix seconds."""
    return int(time.time())


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_value")


def _number(body: dict[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _bad(name, f"{name} must be a number, got {value!r}")
    if not low <= value <= high:
        raise _bad(name, f"{name} must be between {low:g} and {high:g}, got {value!r}")
    return float(value)


def _integer(body: dict[str, Any], name: str, default: int | None, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(name, f"{name} must be an integer, got {value!r}")
    if not low <= value <= high:
        raise _bad(name, f"{name} must be between {low} and {high}, got {value}")
    return value


def _flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _bad(name, f"{name} must be true or false, got {value!r}")
    return value


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise _bad("stop", "stop must be a non-empty string or a list of them")
    if len(stops) > MAX_STOP:
        raise _bad("stop", f"stop may hold at most {MAX_STOP} strings, got {len(stops)}")
    return tuple(stops)


def _refuse_unsupported(body: dict[str, Any]) -> None:
    for name, unused in _UNSUPPORTED.items():
        value = body.get(name)
        if value is not None and value != unused and value != [] and value != {}:
            raise ApiError(400, f"{name} is not supported by this server", param=name, code="unsupported_parameter")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise ApiError(400, "only response_format {\"type\": \"text\"} is supported", param="response_format",
                       code="unsupported_parameter")


def _common(body: Any, kind: str, max_tokens_name: str) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "model is required: the id of a model from GET /v1/models", param="model",
                       code="missing_required_parameter" if model is None else "invalid_value")
    _refuse_unsupported(body)
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0:
        temperature = 0.0  # only the most likely token is within top_p=0
        top_p = 1.0
    max_tokens = _integer(body, max_tokens_name, None, 1, 10**6)
    if max_tokens is None and max_tokens_name != "max_tokens":
        max_tokens = _integer(body, "max_tokens", None, 1, 10**6)
    seed = _integer(body, "seed", None, -(2**63), 2**64 - 1)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _bad("stream_options", "stream_options must be an object")
    stream = _flag(body, "stream")
    return {
        "kind": kind, "model": model, "max_tokens": max_tokens, "n": _integer(body, "n", 1, 1, MAX_N),
        "stream": stream, "include_usage": bool(stream and options and options.get("include_usage")),
        "temperature": temperature, "top_p": top_p, "seed": None if seed is None else seed % 2**63,
        "stop": _stop(body),
    }


def _sampling(fields: dict[str, Any], top_logprobs: int) -> Sampling:
    return Sampling(max_tokens=fields["max_tokens"] or 1, temperature=fields["temperature"], top_p=fields["top_p"],
                    seed=fields["seed"], stop=fields["stop"], top_logprobs=top_logprobs)


def _content(message: dict[str, Any], index: int) -> str:
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _bad(f"messages[{index}].content", "only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise _bad(f"messages[{index}].content", "content must be a string or a list of text parts")


def parse_chat(body: Any) -> Request:
    """A ``POST /v1/chat/completions`` body as a `Request` (raises `ApiError` naming the bad parameter)."""
    fields = _common(body, "chat", "max_completion_tokens")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list of {role, content} objects", param="messages",
                       code="missing_required_parameter" if messages is None else "invalid_value")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise _bad(f"messages[{i}]", "each message must be an object with role and content")
        role = message.get("role")
        if role not in _ROLES:
            raise _bad(f"messages[{i}].role", f"role must be one of {sorted(_ROLES)}, got {role!r}")
        checked.append({"role": "system" if role == "developer" else role, "content": _content(message, i)})
    logprobs = _flag(body, "logprobs")
    top = _integer(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS) or 0
    if top and not logprobs:
        raise _bad("top_logprobs", "top_logprobs needs logprobs: true")
    fields["messages"] = tuple(checked)
    return Request(sampling=_sampling(fields, top), logprobs=logprobs,
                   **{k: v for k, v in fields.items() if k in Request.__dataclass_fields__})


def parse_completion(body: Any) -> Request:
    """A ``POST /v1/completions`` body as a `Request` (raises `ApiError` naming the bad parameter)."""
    fields = _common(body, "completion", "max_tokens")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise ApiError(400, "prompt must be a non-empty string (one prompt per request)", param="prompt",
                       code="missing_required_parameter" if prompt is None else "invalid_value")
    top = _integer(body, "logprobs", None, 0, 5)
    if fields["max_tokens"] is None:
        fields["max_tokens"] = DEFAULT_COMPLETION_TOKENS
    fields["prompt"] = prompt
    return Request(sampling=_sampling(fields, top or 0), logprobs=top is not None,
                   **{k: v for k, v in fields.items() if k in Request.__dataclass_fields__})
