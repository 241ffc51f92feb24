"""lich: a synchronous agent loop in one file.

lich drives a chat model through a think-act-observe loop: it calls the model, runs
the tools the model asks for, feeds the results back, compresses history when the
context budget demands it, and records every run as a JSONL session that can be
resumed. No asyncio; ``requests`` is its only dependency, imported when first used.

    import lich

    tools = lich.Tools()

    @tools.tool
    def add(a: int, b: int) -> int:
        "Add two numbers."
        return a + b

    chat = lich.chat_from_spec("openai:gpt-4.1-mini")
    run = lich.run_agent("What is 2 + 40?", chat=chat, tools=tools, max_turns=5,
                         session_dir="sessions")
    print(run.final["content"], run.session_path)

``python lich.py "prompt"`` is a command-line agent on the same module.
"""

import functools
import json
import logging
import os
import random
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Protocol, TypedDict, runtime_checkable
from urllib.parse import urlsplit

__version__ = "0.1.0"

__all__ = [
    # errors
    "AbortError", "ProviderError", "SessionNotFound",
    # data
    "Message", "ToolCall", "ToolSpec", "Usage",
    "ChatResult", "ToolResult", "LoopOutcome", "ToolRunner",
    # events
    "AgentEmitter",
    # tokens and compression
    "KEEP_RECENT_TURNS", "TRANSCRIPT_MAX_CHARS", "COMPRESSION_SYSTEM_PROMPT",
    "estimate_text_tokens", "estimate_messages_tokens", "should_compress",
    "compress_messages", "compress_if_needed",
    # the loop
    "seed_system_prompt", "call_chat", "run_tool_calls", "run_conversation",
    "format_tool_result_content", "tool_message_from_result",
    # sessions
    "SessionHandle", "AgentRunResult", "open_session", "run_agent",
    "read_session_messages", "resolve_session",
    # providers
    "OpenAIChat", "AnthropicChat", "run_with_retries", "Router", "chat_from_spec",
    # command line
    "main",
]

_log = logging.getLogger("lich")


# ============================================================================
# Errors
# ============================================================================


class AbortError(Exception):
    """The caller's signal was set: the loop, a stream or a backoff stopped early."""


class ProviderError(Exception):
    """A chat provider failed; ``kind`` says how, ``retryable`` whether trying again may help."""

    RETRYABLE_KINDS = frozenset({"rate_limit", "overloaded", "server", "timeout", "network"})

    def __init__(self, message, kind="server", *, status=None, provider="", retryable=None,
                 retry_after=None):
        super().__init__(message)
        self.message = message
        self.kind = kind
        self.status = status
        self.provider = provider
        self.retryable = kind in self.RETRYABLE_KINDS if retryable is None else retryable
        self.retry_after = retry_after

    def __repr__(self):
        return (f"ProviderError({self.message!r}, kind={self.kind!r}, status={self.status!r}, "
                f"provider={self.provider!r}, retryable={self.retryable!r}, "
                f"retry_after={self.retry_after!r})")


class SessionNotFound(LookupError):
    """A session reference matched no session file, or more than one."""


# ============================================================================
# Data
# ============================================================================


class ToolCall(TypedDict):
    """A tool call the model asked for; ``arguments`` is the model's raw JSON text."""

    id: str
    name: str
    arguments: str


class Message(TypedDict, total=False):
    """A provider-neutral chat message, JSON-ready.

    system / user:  {"role": "system" | "user", "content": str}
    assistant:      {"role": "assistant", "content": str, "tool_calls": [ToolCall, ...]}
                    (``content`` is "" when the model said nothing; ``tool_calls`` may be
                    absent or empty)
    tool:           {"role": "tool", "tool_call_id": str, "name": str, "content": str,
                     "is_error": bool}
    """

    role: str
    content: str
    tool_calls: List[ToolCall]
    tool_call_id: str
    name: str
    is_error: bool


class ToolSpec(TypedDict):
    """A tool offered to the model; ``parameters`` is a JSON Schema object."""

    name: str
    description: str
    parameters: Dict[str, Any]


class Usage(TypedDict):
    """Token counts of one chat call (or a run's sum)."""

    input_tokens: int
    output_tokens: int


def _zero_usage():
    return {"input_tokens": 0, "output_tokens": 0}


@dataclass
class ChatResult:
    """What one chat call returned."""

    message: dict
    usage: dict = field(default_factory=_zero_usage)
    model: Optional[str] = None
    stop_reason: Optional[str] = None


@dataclass
class ToolResult:
    """What one tool call returned; a failure is data the model sees, not an exception."""

    ok: bool
    output: str = ""
    error: Optional[str] = None


@dataclass
class LoopOutcome:
    """How ``run_conversation`` ended."""

    messages: list
    final: Optional[dict]
    result: Optional[ChatResult]
    turns_used: int
    stopped_reason: str


@runtime_checkable
class ToolRunner(Protocol):
    """Anything that offers tool specs and runs tool calls, never raising."""

    def specs(self) -> list: ...

    def run(self, call: dict, signal: Optional[threading.Event] = None) -> ToolResult: ...


# ============================================================================
# Events
# ============================================================================


class AgentEmitter:
    """Delivers loop events (plain dicts with a ``"type"``) to subscribed handlers.

    Handlers run synchronously in the emitting thread, in subscription order. ``emit``
    iterates a snapshot, so a handler may unsubscribe itself or others; a handler that
    raises is logged on the ``lich`` logger and the others still run.
    """

    def __init__(self):
        self._handlers = ()  # (type or None, handler) pairs; replaced, never mutated
        self._lock = threading.Lock()

    def on(self, type: str, handler: Callable[[dict], Any]) -> Callable[[], None]:
        """Call ``handler(event)`` for every event of ``type``; returns the unsubscribe function."""
        return self._subscribe(type, handler)

    def on_any(self, handler: Callable[[dict], Any]) -> Callable[[], None]:
        """Call ``handler(event)`` for every event; returns the unsubscribe function."""
        return self._subscribe(None, handler)

    def emit(self, event: dict) -> None:
        """Deliver ``event`` to the handlers subscribed when the call began."""
        event_type = event["type"]
        for wanted, handler in self._handlers:
            if wanted is None or wanted == event_type:
                try:
                    handler(event)
                except Exception:
                    _log.exception("event handler %r failed on %r event", handler, event_type)

    def _subscribe(self, event_type, handler):
        entry = (event_type, handler)
        with self._lock:
            self._handlers = self._handlers + (entry,)

        def unsubscribe():
            with self._lock:
                handlers = list(self._handlers)
                for i, existing in enumerate(handlers):
                    if existing is entry:
                        del handlers[i]
                        self._handlers = tuple(handlers)
                        break

        return unsubscribe


# ============================================================================
# Tokens and compression
# ============================================================================


# ============================================================================
# The loop
# ============================================================================


# ============================================================================
# Sessions
# ============================================================================


# ============================================================================
# Providers
# ============================================================================

_OPENAI_BASE_URL = "https://api.openai.com/v1"
_ANTHROPIC_BASE_URL = "https://api.anthropic.com"
_ANTHROPIC_VERSION = "2023-06-01"
_DEFAULT_TIMEOUT = 600             # seconds; the read timeout, between bytes of a stream too
_CONNECT_TIMEOUT = 10.0            # seconds; capped by the caller's timeout
_ANTHROPIC_MAX_TOKENS = 4096       # the Messages API requires an output cap on every request
_ERROR_TEXT_MAX_CHARS = 2000       # provider error text kept in a ProviderError message
_SNIPPET_MAX_CHARS = 200           # body excerpt quoted when a response is not what we expect
_SSE_MAX_EVENT_BYTES = 32 << 20    # one SSE line or event; a longer one is a broken stream
_STREAM_READ_BYTES = 1024          # read size for a stream without chunked encoding
_STREAM_DRAIN_MAX_BYTES = 64 << 10  # read after the end marker so the connection can be reused
_MAX_RETRY_AFTER = 60.0            # run_with_retries: longer server-requested waits are not waited
_RAW_ARGUMENTS_KEY = "_raw_arguments"  # Anthropic input for tool arguments that are not a JSON object

_STOP_REASONS = {
    "end_turn": "stop", "stop_sequence": "stop", "tool_use": "tool_calls",
    "max_tokens": "length", "model_context_window_exceeded": "length",
    "function_call": "tool_calls",
}
_OVERFLOW_CODES = frozenset({"context_length_exceeded", "context_window_exceeded",
                             "request_too_large", "string_above_max_length"})
_OVERFLOW_TEXT = re.compile(
    r"context[ _-]?(?:length|window|size)|prompt (?:is )?too long|input (?:is )?too long"
    r"|maximum (?:context|prompt) length|too many (?:input |prompt )?tokens"
    r"|exceeds? the (?:maximum|max) (?:number of )?(?:input )?tokens"
    r"|reduce the length of the (?:messages|prompt|input)", re.IGNORECASE)
_ERRNO_TEXT = re.compile(r"\[Errno -?\d+\] [^'\")]+")
_LOOPBACK_HOST = re.compile(r"(?:localhost|.+\.localhost|127(?:\.\d{1,3}){3}|::1)\Z", re.IGNORECASE)
_HTTP_URL = re.compile(r"https?://[^/?#\s]", re.IGNORECASE)
_SPEC = re.compile(r"\s*([A-Za-z][\w.-]*)\s*:\s*(.*?)(?:@(https?://\S+))?\s*\Z", re.DOTALL)


_json_decode = json.JSONDecoder().decode  # for str: json.loads minus its per-call checks


def _requests():
    """The requests module, imported on first use so that ``import lich`` stays light."""
    import requests
    return requests


def _is_loopback(url):
    return bool(_LOOPBACK_HOST.match(urlsplit(url).hostname or ""))


def _timeouts(timeout):
    """``timeout`` as requests' (connect, read) pair."""
    if isinstance(timeout, tuple):
        return timeout
    if timeout is None:
        return (_CONNECT_TIMEOUT, None)
    return (min(_CONNECT_TIMEOUT, timeout), timeout)


def _snippet(body):
    text = body.decode("utf-8", "replace") if isinstance(body, (bytes, bytearray)) else str(body)
    text = text.strip()
    return text[:_SNIPPET_MAX_CHARS] + ("..." if len(text) > _SNIPPET_MAX_CHARS else "")


def _count(value):
    """A token count from a usage field: an int, or 0 when absent or not a number."""
    if type(value) is int:
        return value
    if isinstance(value, float):
        try:
            return int(value)
        except (ValueError, OverflowError):  # nan, inf
            return 0
    return 0


def _normalise_stop(reason):
    if reason is None or not isinstance(reason, str):
        return None
    return _STOP_REASONS.get(reason, reason)


def _retry_after(headers):
    """Seconds the server asks us to wait, from ``retry-after-ms`` or ``Retry-After``; or None."""
    value = headers.get("retry-after-ms")
    if value:
        try:
            seconds = float(value) / 1000.0
        except ValueError:
            seconds = -1.0
        if 0.0 <= seconds < 1e9:
            return seconds
    value = headers.get("retry-after")
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        import email.utils  # only on this rare error path
        from datetime import datetime, timezone
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError, OverflowError):
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=timezone.utc)
        return max(0.0, (when - datetime.now(timezone.utc)).total_seconds())
    return seconds if 0.0 <= seconds < 1e9 else None


def _error_from_wire(body):
    """(text, codes) from an error body of any provider; ``codes`` are its code and type strings."""
    raw = body.decode("utf-8", "replace").strip() if body else ""
    try:
        data = json.loads(raw) if raw[:1] in ("{", "[") else None
    except ValueError:
        data = None
    text, codes = _error_fields(data)
    if not text:
        text = raw or "(empty body)"
    if len(text) > _ERROR_TEXT_MAX_CHARS:
        text = text[:_ERROR_TEXT_MAX_CHARS] + "..."
    return text, codes


def _error_fields(data):
    """(text or None, codes) from a parsed error object: OpenAI's, Anthropic's, FastAPI's..."""
    text = None
    codes = ()
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict):
            text = error.get("message")
            codes = tuple(str(error[k]) for k in ("code", "type") if error.get(k) is not None)
            metadata = error.get("metadata")
            if isinstance(metadata, dict) and isinstance(metadata.get("raw"), str):
                text = f"{text}: {metadata['raw']}" if isinstance(text, str) else metadata["raw"]
        elif isinstance(error, str):
            text = error
        if not isinstance(text, str) or not text:
            for key in ("message", "detail"):
                value = data.get(key)
                if isinstance(value, str) and value:
                    text = value
                    break
                if value:
                    text = json.dumps(value, ensure_ascii=False)
                    break
    return (text if isinstance(text, str) and text else None), codes


def _classify_http_error(status, body, headers):
    """(message, kind, retryable, retry_after) for a non-2xx response, per API.md's table."""
    text, codes = _error_from_wire(body)
    retryable = None
    if status in (401, 403):
        kind = "auth"
    elif status == 404:
        kind = "not_found"
    elif status == 408:
        kind = "timeout"
    elif status == 429:
        kind = "rate_limit"
        if "insufficient_quota" in codes:
            retryable = False  # a billing stop: waiting does not help
    elif status in (503, 529) or "overloaded_error" in codes:
        kind = "overloaded"
    elif 400 <= status < 500:
        overflow = status == 413 or not _OVERFLOW_CODES.isdisjoint(codes) \
            or _OVERFLOW_TEXT.search(text) is not None
        kind = "overflow" if overflow else "bad_request"
    elif status >= 500:
        kind = "server"
    else:
        kind = "invalid_response"
    label = f" ({codes[0]})" if codes else ""
    return f"HTTP {status}{label}: {text}", kind, retryable, _retry_after(headers)


def _tool_input(arguments):
    """Anthropic's ``input`` object for a ToolCall's raw arguments text."""
    if not arguments or not arguments.strip():
        return {}
    try:
        value = json.loads(arguments)
    except ValueError:
        value = None
    if isinstance(value, dict):
        return value
    # Anthropic accepts only an object; keep what the model wrote so it can see its mistake.
    return {_RAW_ARGUMENTS_KEY: arguments}


class _OversizedEvent(Exception):
    """An SSE line or event larger than _SSE_MAX_EVENT_BYTES."""


def _sse_events(chunks, signal):
    """Yield (event name or None, data bytes) per Server-Sent Event read from byte chunks.

    Comments, ``id:`` and ``retry:`` lines are skipped; several ``data:`` lines are joined
    with newlines. The signal is checked before each chunk is parsed.
    """
    pending = []  # pieces of a line whose end has not arrived
    pending_size = 0
    event = None
    data = None
    for chunk in chunks:
        if signal is not None and signal.is_set():
            raise AbortError("chat stream aborted")
        if b"\n" not in chunk:
            pending.append(chunk)
            pending_size += len(chunk)
            if pending_size > _SSE_MAX_EVENT_BYTES:
                raise _OversizedEvent(f"an SSE line exceeds {_SSE_MAX_EVENT_BYTES} bytes")
            continue
        if pending:
            pending.append(chunk)
            chunk = b"".join(pending)
        lines = chunk.split(b"\n")
        last = lines.pop()
        pending = [last] if last else []
        pending_size = len(last)
        for line in lines:
            if line[-1:] == b"\r":
                line = line[:-1]
            if not line:
                if data is not None:
                    yield event, data
                event = data = None
            elif line[:5] == b"data:":
                value = line[6:] if line[5:6] == b" " else line[5:]
                if data is None:
                    data = value
                else:
                    data = data + b"\n" + value
                    if len(data) > _SSE_MAX_EVENT_BYTES:
                        raise _OversizedEvent(
                            f"an SSE event exceeds {_SSE_MAX_EVENT_BYTES} bytes")
            elif line[:6] == b"event:":
                event = line[6:].strip()
    line = b"".join(pending).rstrip(b"\r")
    if line[:5] == b"data:":  # a last line without its newline
        value = line[6:] if line[5:6] == b" " else line[5:]
        data = value if data is None else data + b"\n" + value
    if data is not None:
        yield event, data


def _ack_now(response):
    """Acknowledge the response headers at once instead of after the delayed-ACK timer.

    A server that writes headers and body separately with Nagle's algorithm on (Python's
    http.server does) holds the body until that ACK: ~40 ms on every reused connection.
    TCP_QUICKACK exists on Linux; elsewhere this does nothing.
    """
    import socket  # loaded by requests already
    option = getattr(socket, "TCP_QUICKACK", None)
    if option is not None:
        try:
            response.raw.connection.sock.setsockopt(socket.IPPROTO_TCP, option, 1)
        except (AttributeError, OSError):
            pass


def _body_end_arrived(response):
    """Whether the bytes after a stream's end marker have already arrived.

    Reading them returns the connection to the pool, but waiting for them can cost ~40 ms:
    a server using Nagle's algorithm holds its last small write until our delayed ACK.
    So we look without blocking, and otherwise let the connection be closed.
    """
    try:
        sock = response.raw.connection.sock
        buffered = response.raw._fp.fp  # http.client's reader over the socket
        timeout = sock.gettimeout()
    except AttributeError:
        return False
    try:
        sock.settimeout(0)
        return bool(buffered.peek(1))
    except OSError:  # nothing yet (a TLS socket says so with SSLWantReadError)
        return False
    finally:
        sock.settimeout(timeout)


class _HTTPChat:
    """What OpenAIChat and AnthropicChat share: keys, sessions, the HTTP exchange, errors."""

    _provider = ""
    _key_env = ""
    _url_env = ""
    _public_url = ""
    _path = ""

    def __init__(self, model, *, api_key, base_url, timeout, stream, on_delta, session):
        self.model = model
        self.base_url = (base_url or os.environ.get(self._url_env) or self._public_url).rstrip("/")
        if not _HTTP_URL.match(self.base_url):
            raise ValueError(f"base_url must be an http:// or https:// URL, not {self.base_url!r}")
        self.timeout = timeout
        self.stream = stream
        self.on_delta = on_delta
        self._api_key = api_key or os.environ.get(self._key_env) or None
        self._session = session
        self._local = threading.local()
        self._url = self.base_url + self._path
        self._timeouts = _timeouts(timeout)
        self._headers = self._wire_headers()

    def __repr__(self):
        return (f"{type(self).__name__}(model={self.model!r}, base_url={self.base_url!r}, "
                f"stream={self.stream!r})")

    def __call__(self, messages, *, tools=None, temperature=None, max_tokens=None, signal=None):
        """Send one chat request; returns a ChatResult or raises ProviderError / AbortError."""
        if signal is not None and signal.is_set():
            raise AbortError("chat aborted before sending")
        if self._api_key is None and self._key_required():
            raise self._error(f"no API key for {self.base_url}: set {self._key_env} "
                              f"(or pass api_key=...)", "auth")
        body = self._to_wire(messages, tools, temperature, max_tokens)
        response = self._send(body)
        try:
            if self.stream:
                return self._stream_result(response, signal)
            return self._result(response)
        finally:
            response.close()

    # -- the HTTP exchange --------------------------------------------------------------

    def _http(self):
        if self._session is not None:
            return self._session
        session = getattr(self._local, "session", None)
        if session is None:
            session = self._local.session = _requests().Session()
        return session

    def _send(self, body):
        requests = _requests()
        _log.debug("%s: POST %s model=%s stream=%s", self._provider, self._url, self.model,
                   self.stream)
        try:
            # stream=True even for a plain answer: control returns after the headers
            response = self._http().post(
                self._url, data=json.dumps(body).encode(),
                headers=self._headers, timeout=self._timeouts, stream=True)
        except requests.RequestException as e:
            raise self._transport_error(e, streaming=False) from e
        _ack_now(response)
        status = response.status_code
        if 200 <= status < 300:
            return response
        try:
            content = response.content
        except requests.RequestException:
            content = b""
        finally:
            response.close()
        message, kind, retryable, retry_after = _classify_http_error(
            status, content, response.headers)
        raise self._error(message, kind, status=status, retryable=retryable,
                          retry_after=retry_after)

    def _result(self, response):
        try:
            content = response.content
        except _requests().RequestException as e:
            raise self._transport_error(e, streaming=False) from e
        try:
            data = json.loads(content)
        except ValueError:
            raise self._invalid("body is not JSON", content) from None
        try:
            return self._from_wire(data)
        except (KeyError, IndexError, TypeError, AttributeError, ValueError) as e:
            raise self._invalid(f"unexpected JSON shape ({type(e).__name__}: {e})",
                                content) from e

    def _stream_result(self, response, signal):
        requests = _requests()
        if response.headers.get("content-type", "").startswith("application/json"):
            # A server that ignored stream=true: one delta with the whole text.
            result = self._result(response)
            if result.message["content"] and self.on_delta is not None:
                self.on_delta(result.message["content"])
            return result
        size = None if getattr(response.raw, "chunked", False) else _STREAM_READ_BYTES
        chunks = response.iter_content(size)
        try:
            result = self._from_wire_stream(_sse_events(chunks, signal), self.on_delta)
            if _body_end_arrived(response):
                drained = 0
                for chunk in chunks:  # the chunked terminator: the connection can be reused
                    drained += len(chunk)
                    if drained > _STREAM_DRAIN_MAX_BYTES:
                        break
        except requests.RequestException as e:
            raise self._transport_error(e, streaming=True) from e
        except _OversizedEvent as e:
            raise self._error(f"invalid response: {e}", "invalid_response") from e
        return result

    # -- errors -------------------------------------------------------------------------

    def _error(self, message, kind, **fields):
        message = f"{self._provider}: {message}"
        if self._api_key and self._api_key in message:
            message = message.replace(self._api_key, "[redacted]")
        return ProviderError(message, kind, provider=self._provider, **fields)

    def _invalid(self, reason, body):
        return self._error(f"invalid response: {reason}: {_snippet(body)!r}", "invalid_response")

    def _transport_error(self, e, *, streaming):
        requests = _requests()
        from urllib3.exceptions import ReadTimeoutError
        cause = e.args[0] if e.args else None
        if isinstance(e, requests.Timeout) or isinstance(cause, ReadTimeoutError):
            return self._error(f"timed out ({self._timeouts[0]}s connect, {self._timeouts[1]}s "
                               f"read) on {self._url}", "timeout")
        found = _ERRNO_TEXT.search(str(e))
        reason = found.group(0) if found else _snippet(str(e))
        if streaming:
            return self._error(f"stream broke off before its end: {reason}", "invalid_response")
        return self._error(f"cannot reach {self._url}: {reason}", "network")

    def _body_error(self, payload, where):
        """ProviderError for an error object inside a 2xx body or stream."""
        text, codes = _error_fields(payload)
        if not text:
            text = _snippet(json.dumps(payload, ensure_ascii=False))
        kind = "overloaded" if "overloaded_error" in codes else "invalid_response"
        label = f" ({codes[0]})" if codes else ""
        return self._error(f"error {where}{label}: {text}", kind)

    # -- provider hooks -----------------------------------------------------------------

    def _key_required(self):
        raise NotImplementedError

    def _wire_headers(self):
        raise NotImplementedError

    def _to_wire(self, messages, tools, temperature, max_tokens):
        raise NotImplementedError

    def _from_wire(self, data):
        raise NotImplementedError

    def _from_wire_stream(self, events, on_delta):
        raise NotImplementedError


def _assistant_message(text, tool_calls):
    message = {"role": "assistant", "content": text}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return message


class OpenAIChat(_HTTPChat):
    """A ChatFn over OpenAI Chat Completions, and so over any OpenAI-compatible server.

    The base URL includes ``/v1`` (default ``OPENAI_BASE_URL`` or OpenAI's); the key comes
    from ``api_key`` or ``OPENAI_API_KEY``, and without one no Authorization header is sent.
    """

    _provider = "openai"
    _key_env = "OPENAI_API_KEY"
    _url_env = "OPENAI_BASE_URL"
    _public_url = _OPENAI_BASE_URL
    _path = "/chat/completions"

    def __init__(self, model, *, api_key=None, base_url=None, timeout=_DEFAULT_TIMEOUT,
                 stream=False, on_delta=None, session=None):
        super().__init__(model, api_key=api_key, base_url=base_url, timeout=timeout,
                         stream=stream, on_delta=on_delta, session=session)
        # OpenAI's newer models refuse the deprecated max_tokens; other servers may not
        # know max_completion_tokens yet.
        public = self.base_url == _OPENAI_BASE_URL
        self._max_tokens_field = "max_completion_tokens" if public else "max_tokens"

    def _key_required(self):
        return self.base_url == _OPENAI_BASE_URL

    def _wire_headers(self):
        headers = {"Content-Type": "application/json"}
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        return headers

    def _to_wire(self, messages, tools, temperature, max_tokens):
        wire = []
        for m in messages:
            role = m["role"]
            if role == "tool":
                wire.append({"role": "tool", "tool_call_id": m["tool_call_id"],
                             "content": m.get("content") or ""})
            elif role == "assistant" and m.get("tool_calls"):
                wire.append({
                    "role": "assistant", "content": m.get("content") or None,
                    "tool_calls": [{"id": c["id"], "type": "function",
                                    "function": {"name": c["name"],
                                                 "arguments": c.get("arguments") or "{}"}}
                                   for c in m["tool_calls"]]})
            elif len(m) == 2 and isinstance(m.get("content"), str):
                wire.append(m)  # already exactly the wire shape
            else:
                wire.append({"role": role, "content": m.get("content") or ""})
        body = {"model": self.model, "messages": wire}
        if tools:
            body["tools"] = [{"type": "function", "function": {
                "name": t["name"], "description": t.get("description") or "",
                "parameters": t.get("parameters") or {"type": "object", "properties": {}}}}
                for t in tools]
        if temperature is not None:
            body["temperature"] = temperature
        if max_tokens is not None:
            body[self._max_tokens_field] = max_tokens
        if self.stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        return body

    def _from_wire(self, data):
        if "choices" not in data and data.get("error"):
            raise self._body_error(data, "in a 2xx body")
        choices = data["choices"]
        choice = next((c for c in choices if c.get("index", 0) == 0), choices[0])
        message = choice["message"]
        content = message.get("content")
        if isinstance(content, list):  # content parts, from a few compatible servers
            content = "".join(p.get("text") or "" for p in content if isinstance(p, dict))
        elif content is not None and not isinstance(content, str):
            raise TypeError(f"message content is a {type(content).__name__}")
        if not content:
            # A refusal arrives with null content; it is what the model said.
            refusal = message.get("refusal")
            content = refusal if isinstance(refusal, str) else ""
        calls = []
        for i, call in enumerate(message.get("tool_calls") or ()):
            function = call["function"]
            name = function["name"]
            if not isinstance(name, str) or not name:
                raise ValueError("a tool call without a name")
            arguments = function.get("arguments")
            if not isinstance(arguments, str):
                arguments = "{}" if arguments is None else json.dumps(arguments,
                                                                       ensure_ascii=False)
            call_id = call.get("id")
            calls.append({"id": call_id if isinstance(call_id, str) and call_id else f"call_{i}",
                          "name": name, "arguments": arguments or "{}"})
        usage = data.get("usage") or {}
        return ChatResult(
            message=_assistant_message(content, calls),
            usage={"input_tokens": _count(usage.get("prompt_tokens")),
                   "output_tokens": _count(usage.get("completion_tokens"))},
            model=data.get("model") or self.model,
            stop_reason=_normalise_stop(choice.get("finish_reason")))

    def _from_wire_stream(self, events, on_delta):
        parts = []
        slots = {}  # index (or id for index-less calls) -> [id, name, [argument fragments]]
        finish = usage = model = None
        done = False
        for event, data in events:
            if data == b"[DONE]":
                done = True
                break
            try:
                chunk = _json_decode(data.decode())
            except ValueError:
                raise self._invalid("SSE data is not JSON", data) from None
            if event == b"error" or not isinstance(chunk, dict) or chunk.get("error"):
                if isinstance(chunk, dict):
                    raise self._body_error(chunk, "event in stream")
                raise self._invalid("SSE data is not a JSON object", data)
            text = None
            try:
                if model is None:
                    model = chunk.get("model")
                for choice in chunk.get("choices") or ():
                    if choice.get("index", 0) != 0:
                        continue
                    delta = choice.get("delta")
                    if delta:
                        text = delta.get("content")
                        calls = delta.get("tool_calls")
                        if calls:
                            self._add_call_deltas(slots, calls, data)
                    if choice.get("finish_reason"):
                        finish = choice["finish_reason"]
                if chunk.get("usage"):
                    usage = chunk["usage"]
            except (KeyError, IndexError, TypeError, AttributeError) as e:
                raise self._invalid(f"unexpected chunk shape ({type(e).__name__}: {e})",
                                    data) from e
            if text:
                if not isinstance(text, str):
                    raise self._invalid("delta content is not a string", data)
                parts.append(text)
                if on_delta is not None:
                    on_delta(text)
        if not done:
            raise self._error("invalid response: stream ended before [DONE]",
                              "invalid_response")
        calls = []
        for i, (call_id, name, fragments) in enumerate(slots.values()):
            if not name:
                raise self._error(f"invalid response: streamed tool call {i} has no name",
                                  "invalid_response")
            calls.append({"id": call_id or f"call_{i}", "name": name,
                          "arguments": "".join(fragments) or "{}"})
        usage = usage if isinstance(usage, dict) else {}
        return ChatResult(
            message=_assistant_message("".join(parts), calls),
            usage={"input_tokens": _count(usage.get("prompt_tokens")),
                   "output_tokens": _count(usage.get("completion_tokens"))},
            model=model or self.model, stop_reason=_normalise_stop(finish))

    def _add_call_deltas(self, slots, calls, data):
        for call in calls:
            function = call.get("function") or {}
            if not all(isinstance(v, str) for v in (call.get("id") or "",
                                                     function.get("name") or "")):
                raise TypeError("a tool call id or name that is not a string")
            key = call.get("index")
            if key is None:  # Mistral sends whole calls without an index
                key = ("id", call["id"]) if call.get("id") else ("position", len(slots))
            slot = slots.get(key)
            if slot is None:
                if not (call.get("id") or function.get("name")):
                    raise self._invalid(f"tool-call delta for index {key!r} that was never "
                                        f"opened", data)
                slot = slots[key] = [None, None, []]
            if call.get("id") and not slot[0]:
                slot[0] = call["id"]
            if function.get("name") and not slot[1]:
                slot[1] = function["name"]
            arguments = function.get("arguments")
            if arguments:
                if not isinstance(arguments, str):
                    arguments = json.dumps(arguments, ensure_ascii=False)
                slot[2].append(arguments)


def _after_tool_results(block):
    return block["type"] != "tool_result"


class AnthropicChat(_HTTPChat):
    """A ChatFn over Anthropic's Messages API.

    The base URL excludes ``/v1`` (default ``ANTHROPIC_BASE_URL`` or Anthropic's); the key
    comes from ``api_key`` or ``ANTHROPIC_API_KEY`` and is required except on loopback.
    ``max_tokens`` is the output cap sent when a call gives none.
    """

    _provider = "anthropic"
    _key_env = "ANTHROPIC_API_KEY"
    _url_env = "ANTHROPIC_BASE_URL"
    _public_url = _ANTHROPIC_BASE_URL
    _path = "/v1/messages"

    def __init__(self, model, *, api_key=None, base_url=None, timeout=_DEFAULT_TIMEOUT,
                 stream=False, on_delta=None, session=None, max_tokens=_ANTHROPIC_MAX_TOKENS):
        super().__init__(model, api_key=api_key, base_url=base_url, timeout=timeout,
                         stream=stream, on_delta=on_delta, session=session)
        self.max_tokens = max_tokens

    def _key_required(self):
        return not _is_loopback(self.base_url)

    def _wire_headers(self):
        headers = {"Content-Type": "application/json", "anthropic-version": _ANTHROPIC_VERSION}
        if self._api_key:
            headers["x-api-key"] = self._api_key
        return headers

    def _to_wire(self, messages, tools, temperature, max_tokens):
        system = []
        wire = []
        for m in messages:
            role = m["role"]
            content = m.get("content") or ""
            if role == "system":
                if content:
                    system.append(content)
                continue
            if role == "tool":
                role = "user"
                blocks = [{"type": "tool_result", "tool_use_id": m["tool_call_id"],
                           "content": content, "is_error": bool(m.get("is_error"))}]
            elif role == "assistant":
                blocks = [{"type": "text", "text": content}] if content else []
                for call in m.get("tool_calls") or ():
                    blocks.append({"type": "tool_use", "id": call["id"], "name": call["name"],
                                   "input": _tool_input(call.get("arguments"))})
            else:
                blocks = [{"type": "text", "text": content}] if content else []
            if not blocks:
                continue  # Anthropic refuses empty messages
            if wire and wire[-1]["role"] == role:
                wire[-1]["content"].extend(blocks)  # the API wants roles to alternate
            else:
                wire.append({"role": role, "content": blocks})
        for m in wire:
            blocks = m["content"]
            if len(blocks) == 1 and blocks[0]["type"] == "text":
                m["content"] = blocks[0]["text"]
            elif m["role"] == "user":
                blocks.sort(key=_after_tool_results)  # tool results must lead a user turn
        body = {"model": self.model,
                "max_tokens": self.max_tokens if max_tokens is None else max_tokens,
                "messages": wire}
        if system:
            body["system"] = "\n\n".join(system)
        if tools:
            body["tools"] = [{
                "name": t["name"], "description": t.get("description") or "",
                "input_schema": t.get("parameters") or {"type": "object", "properties": {}}}
                for t in tools]
        if temperature is not None:
            body["temperature"] = temperature
        if self.stream:
            body["stream"] = True
        return body

    @staticmethod
    def _usage(usage, into):
        """Update ``into`` (input, output) from an Anthropic usage object; cached input counts."""
        if not isinstance(usage, dict):
            return into
        inputs = ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")
        if any(k in usage for k in inputs):
            into[0] = sum(_count(usage.get(k)) for k in inputs)
        if "output_tokens" in usage:
            into[1] = _count(usage["output_tokens"])
        return into

    def _from_wire(self, data):
        if data.get("type") == "error":
            raise self._body_error(data, "in a 2xx body")
        texts = []
        calls = []
        for block in data["content"]:
            kind = block["type"]
            if kind == "text":
                if not isinstance(block["text"], str):
                    raise TypeError("text block without a string")
                texts.append(block["text"])
            elif kind == "tool_use":
                if not (isinstance(block["id"], str) and isinstance(block["name"], str)):
                    raise TypeError("tool_use block without a string id and name")
                calls.append({"id": block["id"], "name": block["name"],
                              "arguments": json.dumps(block.get("input") or {},
                                                      ensure_ascii=False)})
            # thinking, redacted_thinking and server tool blocks are not answer text
        usage = self._usage(data.get("usage"), [0, 0])
        return ChatResult(
            message=_assistant_message("".join(texts), calls),
            usage={"input_tokens": usage[0], "output_tokens": usage[1]},
            model=data.get("model") or self.model,
            stop_reason=_normalise_stop(data.get("stop_reason")))

    def _from_wire_stream(self, events, on_delta):
        parts = []
        blocks = {}  # index -> None (text, thinking, ...) or [id, name, [json fragments], input]
        usage = [0, 0]
        stop = model = None
        done = False
        for event, data in events:
            try:
                payload = _json_decode(data.decode())
            except ValueError:
                raise self._invalid("SSE data is not JSON", data) from None
            if not isinstance(payload, dict):
                raise self._invalid("SSE data is not a JSON object", data)
            kind = payload.get("type") or (event.decode("utf-8", "replace") if event else None)
            text = None
            try:
                if kind == "content_block_delta":
                    index = payload["index"]
                    if index not in blocks:
                        raise self._invalid(f"delta for content block {index!r} that was "
                                            f"never started", data)
                    delta = payload["delta"]
                    delta_type = delta.get("type")
                    if delta_type == "text_delta":
                        text = delta["text"]
                    elif delta_type == "input_json_delta" and blocks[index] is not None:
                        fragment = delta["partial_json"]
                        if not isinstance(fragment, str):
                            raise TypeError("partial_json is not a string")
                        blocks[index][2].append(fragment)
                elif kind == "content_block_start":
                    block = payload["content_block"]
                    if block["type"] == "tool_use":
                        if not (isinstance(block["id"], str) and isinstance(block["name"], str)):
                            raise TypeError("tool_use block without a string id and name")
                        blocks[payload["index"]] = [block["id"], block["name"], [],
                                                    block.get("input")]
                    else:
                        blocks[payload["index"]] = None
                        if block["type"] == "text":
                            text = block.get("text")
                elif kind == "message_start":
                    message = payload["message"]
                    model = message.get("model")
                    self._usage(message.get("usage"), usage)
                elif kind == "message_delta":
                    stop = (payload.get("delta") or {}).get("stop_reason") or stop
                    self._usage(payload.get("usage"), usage)
                elif kind == "message_stop":
                    done = True
                    break
                elif kind == "error":
                    raise self._body_error(payload, "event in stream")
                # ping, content_block_stop and unknown events carry nothing we need
            except (KeyError, IndexError, TypeError, AttributeError) as e:
                raise self._invalid(f"unexpected event shape ({type(e).__name__}: {e})",
                                    data) from e
            if text:
                if not isinstance(text, str):
                    raise self._invalid("text delta is not a string", data)
                parts.append(text)
                if on_delta is not None:
                    on_delta(text)
        if not done:
            raise self._error("invalid response: stream ended before message_stop",
                              "invalid_response")
        calls = []
        for block in blocks.values():
            if block is not None:
                call_id, name, fragments, start_input = block
                arguments = "".join(fragments)
                if not arguments.strip():
                    arguments = json.dumps(start_input or {}, ensure_ascii=False)
                calls.append({"id": call_id, "name": name, "arguments": arguments})
        return ChatResult(
            message=_assistant_message("".join(parts), calls),
            usage={"input_tokens": usage[0], "output_tokens": usage[1]},
            model=model or self.model, stop_reason=_normalise_stop(stop))


def _backoff_delay(attempt, base_delay, max_delay):
    """Exponential backoff for retry ``attempt`` (0-based) with jitter, within [cap/2, cap]."""
    cap = min(max_delay, base_delay * (2 ** attempt))
    return cap * (0.5 + random.random() / 2)


def run_with_retries(fn, *, retries=4, base_delay=1.0, max_delay=30.0,
                     max_retry_after=_MAX_RETRY_AFTER, signal=None):
    """Call ``fn()``, retrying retryable ProviderErrors with backoff; waits end on ``signal``."""
    attempt = 0
    while True:
        if signal is not None and signal.is_set():
            raise AbortError("aborted before calling the provider")
        try:
            return fn()
        except ProviderError as e:
            if not e.retryable or attempt >= retries:
                raise
            if e.retry_after is not None and e.retry_after > max_retry_after:
                raise
            delay = _backoff_delay(attempt, base_delay, max_delay)
            if e.retry_after is not None:
                delay = max(delay, e.retry_after)
            attempt += 1
            _log.info("retry %d/%d in %.2fs after %s error: %s", attempt, retries, delay,
                      e.kind, e)
            if signal is None:
                time.sleep(delay)
            elif signal.wait(delay):
                raise AbortError("aborted while waiting to retry") from e


class Router:
    """A ChatFn that tries each ChatFn in turn, each through ``run_with_retries``.

    It moves on after any ProviderError except ``bad_request`` and ``overflow`` (which the
    next provider would refuse too), stops at once when the signal is set, and raises the
    last error when every provider failed.
    """

    _FINAL_KINDS = frozenset({"bad_request", "overflow"})

    def __init__(self, chats, *, retries=2, base_delay=1.0, max_delay=30.0):
        self.chats = list(chats)
        if not self.chats:
            raise ValueError("Router needs at least one chat")
        self.retries = retries
        self.base_delay = base_delay
        self.max_delay = max_delay

    def __repr__(self):
        return f"Router({self.chats!r})"

    def __call__(self, messages, *, tools=None, temperature=None, max_tokens=None, signal=None):
        """Answer with the first provider that succeeds; see the class docstring."""
        last = None
        for i, chat in enumerate(self.chats):
            if signal is not None and signal.is_set():
                raise AbortError("aborted before trying the next provider")
            more = i + 1 < len(self.chats)
            call = functools.partial(chat, messages, tools=tools, temperature=temperature,
                                     max_tokens=max_tokens, signal=signal)
            try:
                return run_with_retries(
                    call, retries=self.retries, base_delay=self.base_delay,
                    max_delay=self.max_delay,
                    # with a provider left, a long server-requested wait is not worth it
                    max_retry_after=self.max_delay if more else _MAX_RETRY_AFTER,
                    signal=signal)
            except ProviderError as e:
                if e.kind in self._FINAL_KINDS:
                    raise
                last = e
                if more:
                    _log.info("provider %r failed (%s: %s); trying the next", chat, e.kind, e)
        raise last


_PROVIDERS = {"anthropic": AnthropicChat, "openai": OpenAIChat}
_SPEC_OPTIONS = frozenset({"api_key", "base_url", "timeout", "stream", "on_delta", "max_tokens",
                           "retries", "base_delay", "max_delay"})
_CHAT_OPTIONS = ("api_key", "base_url", "timeout", "stream", "on_delta")


def chat_from_spec(spec, **options):
    """A ChatFn for ``"provider:model[@base_url]"``; comma-separated specs give a Router."""
    unknown = sorted(set(options) - _SPEC_OPTIONS)
    if unknown:
        raise TypeError(f"chat_from_spec() got an unexpected keyword argument {unknown[0]!r}")
    parts = [p.strip() for p in spec.split(",")] if isinstance(spec, str) else []
    if not parts or not all(parts):
        raise ValueError(f"invalid model spec {spec!r}: expected 'provider:model[@base_url]'")
    chats = []
    for part in parts:
        found = _SPEC.match(part)
        if not found or not found.group(2).strip():
            raise ValueError(f"invalid model spec {part!r}: expected 'provider:model[@base_url]'")
        provider, model, url = found.group(1).lower(), found.group(2).strip(), found.group(3)
        cls = _PROVIDERS.get(provider)
        if cls is None:
            raise ValueError(f"unknown provider {provider!r} in {part!r}; known providers: "
                             f"{', '.join(sorted(_PROVIDERS))}")
        kwargs = {k: options[k] for k in _CHAT_OPTIONS if k in options}
        if url:
            kwargs["base_url"] = url
        if cls is AnthropicChat and "max_tokens" in options:
            kwargs["max_tokens"] = options["max_tokens"]
        chats.append(cls(model, **kwargs))
    if len(chats) == 1:
        return chats[0]
    return Router(chats, **{k: options[k] for k in ("retries", "base_delay", "max_delay")
                            if k in options})


# ============================================================================
# Tools
# ============================================================================


# ============================================================================
# Command line
# ============================================================================


def main(argv=None) -> int:
    """Run the lich command line; returns the process exit code."""
    args = sys.argv[1:] if argv is None else list(argv)
    if args == ["--version"]:
        print(f"lich {__version__}")
        return 0
    print("lich: the command line is not built yet; try --version", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
