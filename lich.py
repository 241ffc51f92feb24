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

# No ``from __future__ import annotations``: with it, a dataclass looks its module up in
# sys.modules, and a plug-in host that loads this file as a module of its own may not put
# it there.
import sys

__version__ = "0.2.0"

if __name__ == "__main__" and sys.argv[1:] == ["--version"]:
    # Answered before the imports below: `python lich.py` has no bytecode cache, so every
    # millisecond of module set-up shows in this command.
    sys.stdout.write(f"lich {__version__}\n")
    sys.exit(0)

_SIGINT_KILLS_AS_IT_LOADS = False  # set below; main() then gives Python's own handling back

if __name__ == "__main__":  # a Ctrl-C while the script loads ends it as a Ctrl-C, untold
    import signal as _signals

    if _signals.getsignal(_signals.SIGINT) is _signals.default_int_handler:  # not a SIG_IGN
        _signals.signal(_signals.SIGINT, _signals.SIG_DFL)  # it was given
        _SIGINT_KILLS_AS_IT_LOADS = True
    del _signals

import codecs
import errno
import functools
import inspect
import json
import math
import operator
import os
import re
import stat
import threading
import time
import types
import typing
import weakref
from collections import deque
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Optional, Protocol, TypedDict, runtime_checkable

__all__ = [
    # errors
    "AbortError", "ProviderError", "SessionNotFound", "MCPError",
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
    "read_session_messages", "list_sessions", "resolve_session",
    # providers
    "OpenAIChat", "AnthropicChat", "run_with_retries", "Router", "Limiter", "chat_from_spec",
    # tools
    "Tools", "coding_tools", "DEFAULT_MAX_OUTPUT_CHARS", "mcp_tools", "MCPTools",
    "combine_tools",
    # many runs
    "BatchResult", "run_batch",
    # tracing
    "trace_otel",
    # command line
    "main",
]


class _LazyLogger:
    """``logging.getLogger("lich")``, looked up on first use: importing logging costs ~4.5 ms,
    a third of what ``import lich`` may cost (bench/RESULTS.md)."""

    def __getattr__(self, name):
        import logging

        return getattr(logging.getLogger("lich"), name)


_log = _LazyLogger()


# ============================================================================
# Errors
# ============================================================================


class AbortError(Exception):
    """The caller's signal was set: the loop, a stream or a backoff stopped early."""


class ProviderError(Exception):
    """A chat provider failed; ``kind`` says how, ``retryable`` whether trying again may help.

    ``after_output`` is True when the failure broke off a stream that had already shown
    text through ``on_delta``: another try would show that text twice, so such an error
    is neither retried nor failed over.
    """

    RETRYABLE_KINDS = frozenset({"rate_limit", "overloaded", "server", "timeout", "network"})

    def __init__(self, message, kind="server", *, status=None, provider="", retryable=None,
                 retry_after=None):
        super().__init__(message)
        self.message = message
        self.kind = kind
        self.status = status
        self.provider = provider
        self.retryable = kind in self.RETRYABLE_KINDS if retryable is None else retryable
        if retry_after is not None and not isinstance(retry_after, (int, float)):
            try:  # a header's text, passed on as it came ("2"): its seconds
                retry_after = float(retry_after)
            except (TypeError, ValueError):
                retry_after = None  # no wait that can be read
        if retry_after is not None and not 0.0 <= retry_after < 1e9:  # nan, inf, -5, a date in 9999:
            retry_after = None  # no wait to take (a Limiter would pause every caller for good)
        self.retry_after = retry_after
        self.after_output = False

    def __repr__(self):
        return (f"ProviderError({self.message!r}, kind={self.kind!r}, status={self.status!r}, "
                f"provider={self.provider!r}, retryable={self.retryable!r}, "
                f"retry_after={self.retry_after!r})")


class SessionNotFound(LookupError):
    """A session reference matched no session file, or more than one."""


class MCPError(Exception):
    """An MCP server could not be started or did not answer its handshake."""


def _exception_text(exc) -> str:
    """``Type: message`` of an exception (API.md's form), also when its ``__str__`` raises
    (a tool's own exception class may be broken): then as Python's tracebacks say it."""
    try:
        message = str(exc)
    except Exception:
        message = "<exception str() failed>"
    if not message and isinstance(exc, MemoryError):  # Python's has no words of its own
        message = "out of memory"
    return f"{type(exc).__name__}: {message}"


def _raised_by_a_signal_handler(exc) -> bool:
    """Whether ``exc`` came out of a Python signal handler installed now, not out of the code
    it interrupted: a server stopping its worker (gunicorn's timeout, Celery's revoke and
    cold shutdown raise SystemExit from one), which no tool call may take for its failure."""
    import signal as signals

    handlers = []
    for number in signals.valid_signals():
        try:
            handler = signals.getsignal(number)
        except (OSError, ValueError):
            continue
        while isinstance(handler, functools.partial):
            handler = handler.func
        if callable(handler):
            handler = getattr(handler, "__func__", handler)  # a bound method: its function
            handlers.append(getattr(handler, "__code__", None)  # else an object's __call__
                            or getattr(getattr(type(handler).__call__, "__func__",
                                               type(handler).__call__), "__code__", None))
    frames = exc.__traceback__
    while frames is not None:
        if any(frames.tb_frame.f_code is code for code in handlers):
            return True
        frames = frames.tb_next
    return False


_after_fork_renewals = []  # what a forked child makes its own, in the order given
_state_pid = os.getpid()  # the process that the module's state (locks, watched calls) is of
_renewing = False  # while a thread renews it in a child forked without Python's hooks
_renewal_lock = threading.RLock()  # a renewal may take a lock of lich's, which looks again


def _after_fork(renew):
    """Have ``renew()`` run in a forked child: at the fork, or, where the process was
    forked without Python's hooks (uWSGI forks its workers in C, unless told
    --py-call-osafterfork), at lich's first use there that _check_fork guards."""
    _after_fork_renewals.append(renew)


def _renew_after_fork():
    global _renewing, _state_pid
    _renewing = True
    try:
        for renew in _after_fork_renewals:
            renew()
    finally:
        _renewing = False
        _state_pid = os.getpid()  # last: no other thread goes on before all is renewed


def _check_fork():
    """Renew the module's state in a child that Python's fork hooks did not (a getpid)."""
    if os.getpid() != _state_pid:
        with _renewal_lock:
            if os.getpid() != _state_pid and not _renewing:
                _renew_after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_renew_after_fork)


class _ForkSafeLock:
    """A lock of the module that a forked child gets free: a thread of its parent may have
    held it at the fork, and nothing in the child would ever release it."""

    def __init__(self):
        self._lock = threading.Lock()
        _after_fork(self._renew)

    def _renew(self):
        self._lock = threading.Lock()

    def acquire(self, blocking=True):
        _check_fork()
        return self._lock.acquire(blocking)

    def release(self):
        self._lock.release()

    def __enter__(self):
        _check_fork()
        self._lock.acquire()

    def __exit__(self, *exc_info):
        self._lock.release()


_REDACTED = "[redacted]"
_SECRET_WINDOW = 8  # no run of this many characters of a key may be shown anywhere
# API key in use -> the set of its runs of _SECRET_WINDOW characters. Changed by copy (under
# _secrets_lock): a reader takes the dict as it is, without the lock.
_secrets = {}
_secret_users = {}  # API key in use -> how many live objects hold it
# A key for each holder gone: finalizers only append (the collector may run them in a thread
# that holds _secrets_lock), and the counts are brought down under the lock.
_secret_holders_gone = deque()
_secrets_lock = _ForkSafeLock()
# What _redact_secrets looks for, made anew when _secrets changes: (that _secrets, the
# windows of all its keys, a regex of the runs of the characters its keys are made of)
_secret_index = ({}, frozenset(), None)


def _add_secret(key: str, holder) -> None:
    """Remember ``key`` as in use while ``holder`` (a chat, an MCP server) lives: tool results
    and what providers say never show a piece of it. (A key shorter than that is no secret
    worth the damage hiding it would do.) So a server that makes a chat per request, with
    its user's key, looks for the keys of live chats only."""
    global _secrets
    if len(key) < _SECRET_WINDOW:
        return
    windows = frozenset(key[i:i + _SECRET_WINDOW] for i in range(len(key) - _SECRET_WINDOW + 1))
    with _secrets_lock:
        _count_secret_holders_gone()
        _secret_users[key] = _secret_users.get(key, 0) + 1
        if key not in _secrets:
            _secrets = {**_secrets, key: windows}
    weakref.finalize(holder, _secret_holders_gone.append, key)
    if _redact_log_record not in _log.filters:  # from the first key on, logs are redacted too
        _log.addFilter(_redact_log_record)


def _count_secret_holders_gone() -> None:
    """Bring the counts of holders down (``_secrets_lock`` held); a key none holds any more
    is no longer looked for."""
    global _secrets
    while _secret_holders_gone:
        key = _secret_holders_gone.popleft()
        left = _secret_users.get(key, 0) - 1
        if left > 0:
            _secret_users[key] = left
        else:
            _secret_users.pop(key, None)
            if key in _secrets:
                _secrets = {k: v for k, v in _secrets.items() if k != key}


def _redact_log_record(record) -> bool:
    """The ``lich`` logger's filter: a record's message and traceback with keys redacted.
    The traceback's text is set (logging's formatters print it rather than make their own);
    ``exc_info`` stays for handlers that want the exception itself."""
    try:
        message = record.getMessage()
    except Exception:  # a bad format: logging reports it as it would
        return True
    redacted = _redact_secrets(message)
    if redacted is not message:
        record.msg, record.args = redacted, ()
    if record.exc_info and record.exc_info[0] is not None:
        import traceback

        record.exc_text = _redact_secrets("".join(traceback.format_exception(*record.exc_info)).rstrip())
    return True


def _writable(text: str) -> str:
    """``text`` with each lone surrogate made U+FFFD. JSON may escape one ("\\ud800") and
    json.loads keeps it, but no UTF-8 stream can write it: an error that carried one raised
    UnicodeEncodeError wherever it was printed or logged."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return re.sub("[\ud800-\udfff]", "\ufffd", text)
    return text


_JSON_ESCAPE = r"\\u([0-9a-fA-F]{4})"


def _secrets_to_find():
    """``_secret_index`` for the keys in use now; the windows of many keys are found in one
    pass, so a server holding the keys of 500 users redacts as fast as one holding one."""
    global _secret_index
    secrets, index = _secrets, _secret_index
    if index[0] is not secrets:
        characters = "".join(sorted(set("".join(secrets))))
        key_characters = (re.compile(f"[{re.escape(characters)}]{{{_SECRET_WINDOW},}}")
                          if secrets else None)
        index = _secret_index = (secrets, frozenset().union(*secrets.values()), key_characters)
    return index


def _redact_secrets(text: str) -> str:
    """``text`` with every run of 8 characters of a key in use (also \\u-escaped) redacted."""
    if _secret_holders_gone and _secrets_lock.acquire(blocking=False):  # never waits: a
        try:  # finalizer that logs may run here while this thread holds the lock
            _count_secret_holders_gone()
        finally:
            _secrets_lock.release()
    secrets, windows, key_characters = _secrets_to_find()
    if not secrets or not text:
        return text
    original = text
    if "\\u" in text:  # a key echoed as JSON escapes (\\u0073k-...) shows once decoded
        text = re.sub(_JSON_ESCAPE, lambda m: chr(int(m.group(1), 16)), text)
    # Where any key shows, for every key at once: only runs of the characters keys are made
    # of can hold one, and each window of such a run is looked up in the set of all windows.
    # Keys that share characters (sk-...-0123456789-...) are each found whole, and the
    # windows found are joined.
    last = _SECRET_WINDOW
    starts = [found.start() + i for found in key_characters.finditer(text)
              for i in range(found.end() - found.start() - last + 1)
              if text[found.start() + i:found.start() + i + last] in windows]
    if not starts:
        return original  # text without a key is given back as it was
    runs = []  # [start, end] of the text hidden
    for start in starts:
        if runs and start <= runs[-1][1]:
            runs[-1][1] = max(runs[-1][1], start + _SECRET_WINDOW)
        else:
            runs.append([start, start + _SECRET_WINDOW])
    pieces, shown_from = [], 0
    for start, end in runs:
        pieces += [text[shown_from:start], _REDACTED]
        shown_from = end
    pieces.append(text[shown_from:])
    return "".join(pieces)


# The names of query parameters and headers whose values are credentials.
_CREDENTIAL_NAME = re.compile(r"(?i)key|token|secret|passw|auth|sig|credential|session")


def _add_url_secrets(url: str, holder) -> None:
    """Remember the user-info of ``url`` and its credential query values (``?api_key=...``)
    as secrets while ``holder`` lives; other query values (``?api-version=2024-06-01``) are
    no secret."""
    from urllib.parse import parse_qsl, urlsplit

    try:
        parts = urlsplit(url)
        secrets = [parts.username or "", parts.password or "",
                   *(value for name, value in parse_qsl(parts.query) if _CREDENTIAL_NAME.search(name))]
    except ValueError:
        return
    for secret in secrets:
        _add_secret(secret, holder)


def _redact_url(url: str) -> str:
    """``url`` without user-info or query values: what lich may show of a base URL."""
    url = re.sub(r"(?i)^([a-z][a-z0-9+.-]*://)[^/?#@]*@", r"\1" + _REDACTED + "@", url)
    # query values end at a space too: a URL inside a message stops there
    return re.sub(r"([?&][^=&#\s]*=)[^&#\s]*", r"\1" + _REDACTED, url)


# ============================================================================
# Data
# ============================================================================


class ToolCall(TypedDict):
    """A tool call the model asked for; ``arguments`` is the model's raw JSON text.

    A tool function parameter annotated ``lich.ToolCall`` receives the call itself.
    """

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
    tool_calls: list[ToolCall]
    tool_call_id: str
    name: str
    is_error: bool


class ToolSpec(TypedDict):
    """A tool offered to the model; ``parameters`` is a JSON Schema object."""

    name: str
    description: str
    parameters: dict[str, Any]


class _UsageCounts(TypedDict):
    input_tokens: int
    output_tokens: int


class Usage(_UsageCounts, total=False):
    """Token counts of one chat call (or a run's sum). ``input_tokens`` is the whole input,
    cached tokens included; the other keys are there when the provider reports them."""

    cache_read_tokens: int
    cache_write_tokens: int
    reasoning_tokens: int


def _zero_usage():
    return {"input_tokens": 0, "output_tokens": 0}


def _add_usage(total: dict, usage) -> dict:
    """Add every count of ``usage`` into ``total``; returns ``total``."""
    for key, value in (usage or {}).items():
        if isinstance(value, int) and not isinstance(value, bool):
            total[key] = total.get(key, 0) + value
    return total


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
    """How ``run_conversation`` ended; ``output`` is the parsed structured output, if asked."""

    messages: list
    final: Optional[dict]
    result: Optional[ChatResult]
    turns_used: int
    stopped_reason: str
    output: Any = None


@runtime_checkable
class ToolRunner(Protocol):
    """Anything that offers tool specs and runs tool calls, never raising."""

    def specs(self) -> list: ...

    def run(self, call: dict, signal: Optional[threading.Event] = None) -> ToolResult: ...


_compact_json = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode  # made once:
_ascii_json = json.JSONEncoder(separators=(",", ":")).encode  # json.dumps builds one per call


def _json_line(value) -> bytes:
    """``value`` as one line of compact JSON in UTF-8, for the files lich appends to; a lone
    surrogate (an emoji cut in half, a file name that is not UTF-8) as its ``\\u`` escape."""
    try:
        return (_compact_json(value) + "\n").encode()
    except UnicodeEncodeError:
        return (_ascii_json(value) + "\n").encode()


def _not_json(name):
    """Python's json reads NaN and Infinity; JSON has neither."""
    raise ValueError(f"{name} is not a JSON value")


def _finite_float(text):
    """A JSON number as a float; one too large for a float (1e400) is refused, not infinity."""
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"{text} is too large a number")
    return value


def _strict_json(text):
    """``json.loads`` of JSON only: NaN, Infinity and 1e400, which Python reads and would
    write back as no JSON reader takes them, are a ValueError."""
    return json.loads(text, parse_constant=_not_json, parse_float=_finite_float)


# --- JSON Schema: the subset lich writes, checked by one validator ---
# Tool arguments (Tools) and structured output (the loop) are both checked here.

_JSON_TYPES = {"string": "a string", "integer": "an integer", "number": "a number",
               "boolean": "a boolean", "array": "an array", "object": "an object",
               "null": "null"}
_ECHO_MAX_CHARS = 80  # how much of a rejected value an error message quotes


def _json_kind(value) -> str:
    """The JSON type of a decoded value, as a phrase for error messages."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    for kind, phrase in ((str, "a string"), (float, "a number"), (list, "an array"),
                         (dict, "an object")):
        if isinstance(value, kind):
            return phrase
    return "null" if value is None else f"a {type(value).__name__}"


def _echo(value) -> str:
    """A value as JSON, cut to ``_ECHO_MAX_CHARS``, to quote in an error message."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError):
        try:
            text = repr(value)
        except ValueError:  # an int of more digits than Python writes out
            text = f"an integer of {value.bit_length()} bits"
    return text if len(text) <= _ECHO_MAX_CHARS else text[:_ECHO_MAX_CHARS] + "..."


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_json_type(value, kind) -> bool:
    if kind == "integer":  # 2.0 too, as JSON Schema says: models write offsets so
        return (isinstance(value, int) and not isinstance(value, bool)
                or isinstance(value, float) and value.is_integer())
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "string":
        return isinstance(value, str)
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "array":
        return isinstance(value, list)
    if kind == "object":
        return isinstance(value, dict)
    return value is None if kind == "null" else True


def _type_check(value, kinds, where, problems) -> bool:
    """Whether ``value`` is of the JSON type ``kinds`` names, or of one it lists (none: any); if
    not, says so."""
    kinds = [kinds] if isinstance(kinds, str) else kinds
    if not kinds or any(_is_json_type(value, k) for k in kinds):
        return True
    problems.append((where, " or ".join(_JSON_TYPES.get(k, k) for k in kinds), _json_kind(value)))
    return False


def _takes_type(value, schema, root) -> bool:
    """Whether ``schema``, or the one its ``$ref`` names, has a ``type`` that ``value`` is of."""
    while isinstance(schema, dict) and "type" not in schema and "$ref" in schema and root is not None:
        schema = _ref_target(root, schema["$ref"])  # no loop: the check before a run refuses one
    return isinstance(schema, dict) and "type" in schema and _type_check(value, schema["type"], "", [])


def _refuses_its_tag(value, schema, root) -> bool:
    """Whether the object ``value`` holds a property that ``schema`` (or the one its ``$ref``
    names) fixes to other values by ``const`` or ``enum``: the tag of a tagged union (a
    Pydantic discriminator's ``kind``) saying the value is meant for another branch."""
    while isinstance(schema, dict) and "$ref" in schema and root is not None:
        schema = _ref_target(root, schema["$ref"])  # no loop: the check before a run refuses one
    properties = schema.get("properties") if isinstance(schema, dict) else None
    if not isinstance(value, dict) or not isinstance(properties, dict):
        return False
    for key, tag in properties.items():
        while isinstance(tag, dict) and "$ref" in tag and root is not None:
            tag = _ref_target(root, tag["$ref"])
        if key not in value or not isinstance(tag, dict):
            continue
        if "const" in tag and not _same_json(value[key], tag["const"]):
            return True
        if isinstance(tag.get("enum"), list) and not any(_same_json(value[key], a) for a in tag["enum"]):
            return True
    return False


def _branch_check(value, branch, where, root, memo):
    """``value`` checked against one branch of an anyOf or oneOf, as ``(checked, problems)``:
    once a walk for each value, branch and place. Branches that recurse (an expression tree's
    Add and Mul, each holding either) met a failing answer's depths again from each branch,
    twice as long a level. The entry holds the value, so its id is not reused meanwhile."""
    key = (id(value), id(branch), where)
    if key not in memo:
        found = []
        memo[key] = (value, _schema_check(value, branch, where, found, root, memo), found)
    return memo[key][1:]


def _any_of_check(value, branches, where, problems, root, memo, results=None):
    """``value`` checked against ``anyOf`` ``branches``: as the first that it fits made it;
    else, when each is an enum or null, one problem naming their values; else the problems
    of the branch that took its type (of its ``type``, or failing only within it) with the
    fewest (the first of equals; when such branches each fail once at one place, as the
    branches of a tagged union fail on the tag, one problem naming what each wants there);
    else one problem naming them all. Of a tagged union, only the branches whose tag the
    value holds count as taking its type, when some do: a dog that lacks a field is told
    that, not to be a cat. ``results`` are the branches' own ``(checked, problems)`` when
    the caller has them already."""
    refusals, taken, tagged = [], [], []
    for i, branch in enumerate(branches):
        checked, found = _branch_check(value, branch, where, root, memo) if results is None else results[i]
        if not found:
            return checked
        if any(at != where for at, _, _ in found) or _takes_type(value, branch, root):
            taken.append(found)  # its type fitted, a bound or something within did not: tell that
            tagged.append(not _refuses_its_tag(value, branch, root))
        refusals.append(found[0])
    if any(tagged) and not all(tagged):
        taken = [found for found, its_tag in zip(taken, tagged) if its_tag]
    least = min(map(len, taken), default=0)
    fewest = [found for found in taken if len(found) == least]
    if all(isinstance(b, dict) and ("enum" in b or b.get("type") == "null") for b in branches):
        allowed = [a for b in branches for a in b.get("enum", [None])]
        named = ", ".join(json.dumps(a) for a in allowed if a is not None)
        expected = "null" if not named else "one of " + named + (" or null" if None in allowed else "")
        problems.append((where, expected, _echo(value)))
    elif least == 1 and len(fewest) > 1 and len({(at, got) for (at, _, got), in fewest}) == 1:
        (at, _, got), = fewest[0]
        problems.append((at, " or ".join(dict.fromkeys(e for (_, e, _), in fewest)), got))
    elif taken:
        problems.extend(fewest[0])
    else:
        expected = dict.fromkeys(e for _, e, _ in refusals)  # each once, in order
        problems.append((where, " or ".join(expected), refusals[0][2]))
    return value


def _one_of_check(value, branches, where, problems, root, memo):
    """``value`` checked against ``oneOf`` ``branches``: it must fit exactly one."""
    results = [_branch_check(value, branch, where, root, memo) for branch in branches]
    fits = [checked for checked, found in results if not found]
    if len(fits) == 1:
        return fits[0]
    if not fits:
        return _any_of_check(value, branches, where, problems, root, memo, results)
    problems.append((where, f"valid under exactly one of its oneOf schemas (it fits {len(fits)})",
                     _echo(value)))
    return value


def _ref_target(root, ref):
    """The schema a local ``$ref`` names -- ``#``, or a JSON Pointer into ``root``'s
    ``$defs`` or ``definitions`` (``#/$defs/Name``), which the check before a run has read
    whole -- or None for any other."""
    if not isinstance(ref, str) or not (ref == "#" or ref.startswith(("#/$defs/", "#/definitions/",
                                                                      "#/%24defs/"))):
        return None
    if "%" in ref:  # a URI fragment may escape characters (rare: loaded only then)
        from urllib.parse import unquote

        ref = unquote(ref)
    target = root
    for token in ref[1:].split("/")[1:] if ref != "#" else ():
        token = token.replace("~1", "/").replace("~0", "~")
        if isinstance(target, dict) and token in target:
            target = target[token]
        elif isinstance(target, list) and re.fullmatch("0|[1-9][0-9]*", token) and int(token) < len(target):
            target = target[int(token)]
        else:
            return None
    return target if isinstance(target, (dict, bool)) else None


def _ref_loop(root):
    """Why ``root`` cannot be checked when one of its ``$ref`` leads back to itself with no
    property or item in between (a value would be checked against it for ever), or None."""
    def same_place(schema):  # the schemas a value is checked against where it stands
        if not isinstance(schema, dict):
            return []
        found = [_ref_target(root, schema["$ref"])] if "$ref" in schema else []
        found += [*schema.get("anyOf", ()), *schema.get("oneOf", ()), *schema.get("allOf", ())]
        return found + [schema["not"]] if "not" in schema else found

    done = set()  # ids of schemas whose every way was walked without a loop

    def walk(schema, on_the_way):
        if id(schema) in on_the_way:
            return True
        if id(schema) in done:
            return False
        on_the_way.add(id(schema))
        loop = any(walk(s, on_the_way) for s in same_place(schema) if isinstance(s, dict))
        on_the_way.discard(id(schema))
        done.add(id(schema))
        return loop

    def refs(node):  # every $ref anywhere in root
        if isinstance(node, dict):
            if isinstance(node.get("$ref"), str):
                yield node["$ref"]
            for value in node.values():
                yield from refs(value)
        elif isinstance(node, list):
            for value in node:
                yield from refs(value)

    for ref in dict.fromkeys(refs(root)):
        target = _ref_target(root, ref)
        if isinstance(target, dict) and walk(target, set()):
            return f"output_schema's $ref {_echo(ref)} leads back to itself with nothing between"
    return None


def _same_json(value, allowed) -> bool:
    """Whether ``value`` is the JSON value ``allowed``: True is not 1, and 2.0 is 2, at any depth."""
    if isinstance(value, list) and isinstance(allowed, list):
        return len(value) == len(allowed) and all(map(_same_json, value, allowed))
    if isinstance(value, dict) and isinstance(allowed, dict):
        return value.keys() == allowed.keys() and all(_same_json(v, allowed[k]) for k, v in value.items())
    return value == allowed and (type(value) is type(allowed)
                                 or _is_number(value) and _is_number(allowed))


_BOUNDS = {"minimum": ("at least", operator.ge), "maximum": ("at most", operator.le),
           "exclusiveMinimum": ("greater than", operator.gt),
           "exclusiveMaximum": ("less than", operator.lt)}
_DRAFT_4_EXCLUSIVE = {"minimum": "exclusiveMinimum", "maximum": "exclusiveMaximum"}  # as booleans
_SIZES = {str: ("minLength", "maxLength", "character"), list: ("minItems", "maxItems", "item")}


def _decimal_parts(number):
    """``number`` as ``(n, e)`` with ``number == n * 10**e``, as JSON writes it: a float by its
    shortest repr, so 0.1 is 1 and -1, not the binary fraction nearest a tenth."""
    if isinstance(number, int):
        return number, 0
    mantissa, _, exponent = repr(number).partition("e")
    whole, _, fraction = mantissa.partition(".")
    return int(whole + fraction), int(exponent or 0) - len(fraction)


def _is_multiple(value, step) -> bool:
    """Whether ``value`` is a whole multiple of ``step`` (> 0), exactly, in decimal: 0.3 is
    one of 0.1, though 0.3 / 0.1 is 2.9999999999999996 in floats; big integers stay integers."""
    if isinstance(value, int) and isinstance(step, int):
        return value % step == 0
    (n, e), (d, f) = _decimal_parts(value), _decimal_parts(step)
    low = min(e, f)
    return n * 10 ** (e - low) % (d * 10 ** (f - low)) == 0


def _json_key(value):
    """A hashable key equal for values JSON holds equal: 1 and 1.0 alike, true not 1, an
    object's keys in any order, at any depth."""
    if isinstance(value, bool) or value is None:
        return (value,)  # a tuple: (True,) is not 1
    if isinstance(value, list):
        return ("array", *map(_json_key, value))
    if isinstance(value, dict):
        return ("object", frozenset((k, _json_key(v)) for k, v in value.items()))
    return value  # a string, or a number: 1 == 1.0 and their hashes agree


def _value_check(value, schema, where, problems):
    """The keywords that hold a value of one type: a number's ``minimum``, ``maximum``, the
    exclusive ones and ``multipleOf``; a string's ``minLength`` and ``maxLength`` (in
    characters) and ``pattern`` (Python's ``re.search``); an array's ``minItems``,
    ``maxItems`` and ``uniqueItems``. Draft 4's ``exclusiveMinimum: true`` (or
    ``exclusiveMaximum``) makes ``minimum`` (``maximum``) exclusive."""
    if _is_number(value):
        for keyword, (words, holds) in _BOUNDS.items():
            bound = schema.get(keyword)
            if schema.get(_DRAFT_4_EXCLUSIVE.get(keyword)) is True:
                words, holds = _BOUNDS[_DRAFT_4_EXCLUSIVE[keyword]]
            if _is_number(bound) and not holds(value, bound):
                problems.append((where, f"{words} {_echo(bound)}", _echo(value)))
        step = schema.get("multipleOf")
        if step is not None and not _is_multiple(value, step):
            problems.append((where, f"a multiple of {_echo(step)}", _echo(value)))
    elif type(value) in _SIZES:
        low, high, unit = _SIZES[type(value)]
        size = len(value)
        for keyword, words, holds in ((low, "at least", operator.ge), (high, "at most", operator.le)):
            bound = schema.get(keyword)
            if _is_number(bound) and not holds(size, bound):
                bound = int(bound) if isinstance(bound, float) and bound.is_integer() else bound
                problems.append((where, f"{words} {_echo(bound)} {unit if bound == 1 else unit + 's'} long",
                                 f"{size} {unit if size == 1 else unit + 's'}"))
        if isinstance(value, str):
            pattern = schema.get("pattern")
            if pattern is not None and not re.search(pattern, value):
                problems.append((where, f"a string matching {_echo(pattern)}", _echo(value)))
        elif schema.get("uniqueItems") is True:
            seen = {}  # each item's key: the index it first stood at
            for i, item in enumerate(value):
                first = seen.setdefault(_json_key(item), i)
                if first != i:
                    problems.append((where, "an array of unique items",
                                     f"one with {_echo(value[first])} at [{first}] and [{i}]"))
                    break


def _schema_check(value, schema, where, problems, root=None, memo=None):
    """``value`` checked against ``schema`` (type, enum, const, anyOf, oneOf, allOf, not,
    $ref into ``root``, items, prefixItems, properties, patternProperties, required,
    additionalProperties, and the keywords of ``_value_check``); each mismatch appends
    ``(where, expected, got)`` to ``problems``.
    Returns the value, an integer made a float where the schema wants only a number, and a
    whole float an int where it wants only an integer."""
    memo = {} if memo is None else memo  # one for the walk: see _branch_check
    if schema is False:
        problems.append((where, "absent (the schema allows no value here)", _echo(value)))
        return value
    if not isinstance(schema, dict) or not schema:
        return value
    # A $ref's target and an allOf's branches are checked once for each value and place, as
    # anyOf's are: a chain of definitions each the allOf of two $refs to the next took time
    # doubling with each link (a fuzzer's finding: 24 s for an answer "x" at 20 links).
    if root is not None and "$ref" in schema:
        value, found = _branch_check(value, _ref_target(root, schema["$ref"]), where, root, memo)
        if found:
            problems.extend(found)
            return value
    for keyword, check in (("anyOf", _any_of_check), ("oneOf", _one_of_check)):
        if keyword in schema:
            count = len(problems)
            value = check(value, schema[keyword], where, problems, root, memo)
            if len(problems) > count:
                return value
    if "allOf" in schema:
        count, told = len(problems), set()
        for branch in schema["allOf"]:
            value, found = _branch_check(value, branch, where, root, memo)
            for problem in found:  # each told once
                if problem not in told:
                    told.add(problem)
                    problems.append(problem)
        if len(problems) > count:
            return value
    if "not" in schema:
        found = []
        _schema_check(value, schema["not"], where, found, root, memo)
        if not found:
            problems.append((where, 'a value its "not" schema refuses', _echo(value)))
            return value
    kinds = schema.get("type")
    kinds = [kinds] if isinstance(kinds, str) else kinds or []
    if "const" in schema or "enum" in schema:
        _value_check(value, schema, where, problems)  # all keywords hold, these too
        if "const" in schema:
            if not _same_json(value, schema["const"]):
                problems.append((where, _echo(schema["const"]), _echo(value)))
                return value
            value = schema["const"]
        if "enum" in schema:
            allowed = schema["enum"]
            for fit in allowed:  # True is not 1, and 2.0 is 2 (given back as the schema writes it)
                if _same_json(value, fit):
                    value = fit
                    break
            else:
                named = ", ".join(json.dumps(a) for a in allowed if a is not None)
                problems.append((where, "one of " + named + (" or null" if None in allowed else ""),
                                 _echo(value)))
                return value
        # its type holds too, if its values disagree; and an array's items or an object's
        # properties, required and additional ones (all were left unchecked)
        if not _type_check(value, kinds, where, problems) or not isinstance(value, (list, dict)):
            return value
    elif not _type_check(value, kinds, where, problems):
        return value
    else:
        _value_check(value, schema, where, problems)
    if isinstance(value, int) and not isinstance(value, bool):
        if "number" not in kinds or "integer" in kinds:
            return value
        try:
            return float(value)
        except OverflowError:  # 1 and 400 zeros: no float holds it
            problems.append((where, "a number a float can hold", "a larger one"))
            return value
    if isinstance(value, float) and "integer" in kinds and "number" not in kinds:
        return int(value)
    if isinstance(value, list):
        items = schema.get("items")
        positional = schema.get("prefixItems", items if isinstance(items, list) else ())
        rest = schema.get("additionalItems") if isinstance(items, list) else items
        if not positional and rest is None:
            return value
        return [_schema_check(item, positional[i] if i < len(positional) else rest,
                              f"{where}[{i}]", problems, root, memo)
                for i, item in enumerate(value)]
    if isinstance(value, dict):
        properties = schema.get("properties") or {}
        patterns = schema.get("patternProperties") or {}
        extra = schema.get("additionalProperties", True)
        checked = {}
        for key, item in value.items():
            path = f"{where}[{json.dumps(key, ensure_ascii=False)}]"
            matched = [s for pattern, s in patterns.items() if re.search(pattern, key)]
            if key in properties:
                checked[key] = _schema_check(item, properties[key], path, problems, root, memo)
            elif not matched and extra is False:
                problems.append((path, "absent (no such property)", _echo(item)))
            elif not matched:
                checked[key] = _schema_check(item, extra, path, problems, root, memo)
            for pattern_schema in matched:
                checked[key] = _schema_check(checked.get(key, item), pattern_schema, path,
                                             problems, root, memo)
        for key in schema.get("required") or ():
            if key not in value:
                problems.append((f"{where}[{json.dumps(key)}]", "present (it is required)",
                                 "missing"))
        return checked
    return value


def _schema_problem(schema, where, root=None):
    """Why ``schema`` cannot be checked against -- a keyword that ``_schema_check`` reads
    is not of its JSON Schema shape, or a ``$ref`` names nothing in ``root`` -- or None."""
    if isinstance(schema, bool):  # true and false are schemas too
        return None
    if not isinstance(schema, dict):
        return f"{where} must be an object, not {_json_kind(schema)}"
    if "type" in schema:
        kinds = [schema["type"]] if isinstance(schema["type"], str) else schema["type"]
        if (not isinstance(kinds, list) or not kinds
                or not all(isinstance(k, str) and k in _JSON_TYPES for k in kinds)):
            return (f'{where}["type"] must be one of {", ".join(_JSON_TYPES)} or a list of them, '
                    f'not {_echo(schema["type"])}')
    for keyword, ok, shape in (("enum", isinstance(schema.get("enum"), list), "an array"),
                               *((k, isinstance(schema.get(k), list) and schema.get(k),
                                  "a non-empty array") for k in ("anyOf", "oneOf", "allOf")),
                               ("prefixItems", isinstance(schema.get("prefixItems"), list),
                                "an array"),
                               ("required", isinstance(schema.get("required"), list) and all(
                                   isinstance(k, str) for k in schema.get("required")),
                                "an array of strings"),
                               *((k, isinstance(schema.get(k), dict), "an object")
                                 for k in ("properties", "patternProperties"))):
        if keyword in schema and not ok:
            return f'{where}["{keyword}"] must be {shape}, not {_echo(schema[keyword])}'
    for keyword in _BOUNDS:  # numbers JSON can write; draft 4's exclusive ones are booleans
        bound = schema.get(keyword)
        if keyword in schema and not (_is_number(bound) and (isinstance(bound, int) or math.isfinite(bound))
                                      or isinstance(bound, bool) and keyword.startswith("exclusive")):
            return f'{where}["{keyword}"] must be a number, not {_echo(bound)}'
    for keyword in ("minLength", "maxLength", "minItems", "maxItems"):
        bound = schema.get(keyword)
        if keyword in schema and not (isinstance(bound, int) and not isinstance(bound, bool) and bound >= 0
                                      or isinstance(bound, float) and bound.is_integer() and bound >= 0):
            return f'{where}["{keyword}"] must be a whole number of 0 or more, not {_echo(bound)}'
    step = schema.get("multipleOf")
    if "multipleOf" in schema and not (_is_number(step) and (isinstance(step, int) or math.isfinite(step))
                                       and step > 0):
        return f'{where}["multipleOf"] must be a number greater than 0, not {_echo(step)}'
    if "uniqueItems" in schema and not isinstance(schema["uniqueItems"], bool):
        return f'{where}["uniqueItems"] must be true or false, not {_echo(schema["uniqueItems"])}'
    if root is not None and "$ref" in schema and _ref_target(root, schema["$ref"]) is None:
        return (f'{where}["$ref"] must point within the schema ("#/$defs/Name"), '
                f'not {_echo(schema["$ref"])}')
    if "pattern" in schema and not isinstance(schema["pattern"], str):
        return f'{where}["pattern"] must be a string, not {_echo(schema["pattern"])}'
    for keyword, verb, patterns in (("pattern", "is", [schema["pattern"]] if "pattern" in schema else ()),
                                    ("patternProperties", "has", schema.get("patternProperties") or ())):
        for pattern in patterns:
            try:
                re.compile(pattern)
            except (re.error, OverflowError) as e:  # OverflowError: a{4294967296}
                return f'{where}["{keyword}"] {verb} a pattern Python cannot read: {_echo(pattern)} ({e})'
    inner = [(f'{where}["{named}"][{json.dumps(key, ensure_ascii=False)}]', value)
             for named in ("properties", "patternProperties", "$defs", "definitions")
             if isinstance(schema.get(named), dict) for key, value in schema[named].items()]
    inner += [(f'{where}["{keyword}"]', schema[keyword])
              for keyword in ("items", "additionalProperties", "additionalItems", "not")
              if keyword in schema and not (keyword == "items" and isinstance(schema["items"], list))]
    if isinstance(schema.get("items"), list):  # draft-04 to 2019-09: a schema per position
        inner += [(f'{where}["items"][{i}]', item) for i, item in enumerate(schema["items"])]
    inner += [(f'{where}["{keyword}"][{i}]', branch)
              for keyword in ("anyOf", "oneOf", "allOf", "prefixItems")
              for i, branch in enumerate(schema.get(keyword) or ())]
    for path, value in inner:
        problem = _schema_problem(value, path, root)
        if problem:
            return problem
    return None


# ============================================================================
# Events
# ============================================================================


def _unwrapped_function(fn):
    """What a call of ``fn`` calls in the end: the function of a ``functools.partial``
    (however deep) or of a ``staticmethod``; ``fn`` itself otherwise."""
    while True:
        if isinstance(fn, functools.partial):
            fn = fn.func
        elif isinstance(fn, staticmethod):
            fn = fn.__func__
        else:
            return fn


def _called_code(fn):
    """The function whose code a call of ``fn`` runs: a class's ``__init__``, an object's
    ``__call__``, a function or method itself."""
    fn = _unwrapped_function(fn)
    if inspect.isroutine(fn):
        return fn
    return fn.__init__ if inspect.isclass(fn) else type(fn).__call__


def _refuse_async(fn, what):
    """A TypeError when a call of ``fn`` only makes a coroutine or an async generator (an
    ``async def`` function, a partial of one, an object whose ``__call__`` is one): lich
    calls ``what`` synchronously, and would take that object for its answer, never run."""
    if callable(fn):
        code = _called_code(fn)
        if any(inspect.iscoroutinefunction(f) or inspect.isasyncgenfunction(f) for f in (fn, code)):
            raise TypeError(f"{what} is an async function, and lich calls it synchronously: give "
                            f"a function that runs it and returns its result (from a thread of "
                            f"an asyncio app, asyncio.run_coroutine_threadsafe(...).result())")


def _refuse_coroutine(answer, what):
    """A TypeError when ``answer``, what ``what`` returned, is a coroutine (closed first, not
    left unawaited): a sync function that called an async one, whose body lich never runs."""
    if inspect.iscoroutine(answer):
        answer.close()
        raise TypeError(f"{what} returned a coroutine, and lich calls it synchronously: return "
                        f"the async function's result (from a thread of an asyncio app, "
                        f"asyncio.run_coroutine_threadsafe(...).result())")


class AgentEmitter:
    """Delivers loop events (plain dicts with a ``"type"``) to subscribed handlers.

    Handlers run synchronously in the emitting thread, in subscription order. ``emit``
    iterates a snapshot, so a handler may unsubscribe itself or others; a handler that
    raises, or returns a coroutine (closed), is logged on the ``lich`` logger and the
    others still run.
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
                    answer = handler(event)
                    if answer is not None:
                        _refuse_coroutine(answer, "the event handler")
                except (Exception, SystemExit) as e:  # but for a server stopping its worker
                    if isinstance(e, SystemExit) and _raised_by_a_signal_handler(e):
                        raise
                    _log.exception("event handler %r failed on %r event", handler, event_type)

    def __getstate__(self):
        return {"_handlers": self._handlers}

    def __setstate__(self, state):
        self._handlers = state["_handlers"]
        self._lock = threading.Lock()

    def _subscribe(self, event_type, handler):
        if not callable(handler):  # show(x) for show: each event would log its failure
            raise TypeError(f"the event handler must be callable, not {type(handler).__name__}")
        _refuse_async(handler, "the event handler")
        entry = (event_type, handler)
        with self._lock:
            self._handlers = self._handlers + (entry,)

        def unsubscribe():
            with self._lock:
                self._handlers = tuple(h for h in self._handlers if h is not entry)

        return unsubscribe


def _emit(emitter, event):
    if emitter is not None:
        emitter.emit(event)


# ============================================================================
# Tokens and compression
# ============================================================================

KEEP_RECENT_TURNS = 8
TRANSCRIPT_MAX_CHARS = 24_000
# What the loop and the summarizer say of an async def ChatFn, its coroutine closed
_ASYNC_CHAT = ("the chat returned coroutine, not a ChatResult: an async def ChatFn, which lich "
               "calls synchronously")

COMPRESSION_SYSTEM_PROMPT = (
    "You compress agent conversation history into terse factual summaries. Preserve: goals, "
    "decisions, file paths, commands run, errors, open questions. Output plain text only."
)
_SUMMARY_HEAD = "[context summary of earlier turns]\n"
_SUMMARY_TAIL = "\n[end summary]"
_TOOL_MESSAGE_OVERHEAD_TOKENS = 8


def estimate_text_tokens(text: str) -> int:
    """A coarse token count: one token per four characters, rounded up."""
    return (len(text) + 3) // 4


# What an assistant message with tool calls may carry back to its provider beside them (the
# README's reasoning): sent with every later request, so counted, as its JSON text
_REASONING_KEYS = ("thinking", "reasoning_content", "reasoning_details")


def _tool_calls_json(tool_calls) -> str:
    return json.dumps(tool_calls, separators=(",", ":"), ensure_ascii=False)


def _estimate_message_tokens(message) -> int:
    tokens = estimate_text_tokens(message.get("content") or "")
    role = message.get("role")
    if role == "assistant":
        tool_calls = message.get("tool_calls")
        if tool_calls:
            tokens += estimate_text_tokens(_tool_calls_json(tool_calls))
            for key in _REASONING_KEYS:
                reasoning = message.get(key)
                if reasoning:
                    tokens += estimate_text_tokens(reasoning if isinstance(reasoning, str) else
                                                   json.dumps(reasoning, separators=(",", ":"),
                                                              ensure_ascii=False, default=repr))
    elif role == "tool":
        tokens += _TOOL_MESSAGE_OVERHEAD_TOKENS
    return tokens


def estimate_messages_tokens(messages) -> int:
    """The estimate of a whole history: contents, assistant tool calls, 8 per tool message."""
    return sum(map(_estimate_message_tokens, messages))


def should_compress(messages, budget, threshold=0.8) -> bool:
    """True when the history's estimate reaches ``budget * threshold``."""
    return estimate_messages_tokens(messages) >= budget * threshold


def _partition(messages):
    """Split into (system, older, recent); recent never starts with a tool message."""
    system = [m for m in messages if m.get("role") == "system"]
    rest = [m for m in messages if m.get("role") != "system"]
    start = max(len(rest) - KEEP_RECENT_TURNS, 0)
    while start > 0 and rest[start].get("role") == "tool":
        start -= 1
    return system, rest[:start], rest[start:]


def _omitted_marker(count) -> str:
    return f"[... {count} characters omitted ...]"


def _truncate(text, limit):
    """``text`` cut to its head and tail, ``limit`` characters of it kept, around a marker."""
    if len(text) <= limit:
        return text
    tail = limit // 2
    head = limit - tail
    return f"{text[:head]}\n{_omitted_marker(len(text) - limit)}\n{text[len(text) - tail:]}"


def _cut_middle(text, limit) -> str:
    """``text`` in at most ``limit`` characters (some thousands), its marker line counted."""
    if len(text) <= limit:
        return text
    return _truncate(text, limit - len(_omitted_marker(len(text))) - 2)


def _cut_head(text, limit) -> str:
    """The end of ``text`` in at most ``limit`` characters (some thousands), after a marker
    line for what went before."""
    if len(text) <= limit:
        return text
    kept = limit - len(_omitted_marker(len(text))) - 1
    return f"{_omitted_marker(len(text) - kept)}\n{text[len(text) - kept:]}"


def _transcript(messages) -> str:
    """The older messages as the summarizer reads them, in at most TRANSCRIPT_MAX_CHARS.

    A longer transcript keeps the first message (the task, or the summary before) and the
    newest lines: a quarter or more for the first, its middle cut when it is longer, the
    rest for the newest, with a marker where text was left out.
    """
    lines = []
    for message in messages:
        line = f"[{message.get('role')}] {message.get('content') or ''}"
        if message.get("tool_calls"):
            line += " tool_calls=" + _tool_calls_json(message["tool_calls"])
        lines.append(line)
    text = "\n".join(lines)
    if len(text) <= TRANSCRIPT_MAX_CHARS:
        return text
    if len(lines) == 1:
        return _cut_middle(text, TRANSCRIPT_MAX_CHARS)
    rest = "\n".join(lines[1:])
    first = _cut_middle(lines[0], max(TRANSCRIPT_MAX_CHARS // 4, TRANSCRIPT_MAX_CHARS - 1 - len(rest)))
    return f"{first}\n{_cut_head(rest, TRANSCRIPT_MAX_CHARS - 1 - len(first))}"


def compress_messages(chat, messages, *, signal=None):
    """Summarise all but the recent messages with ``chat``; returns (new_messages, summary_chars).

    The result is ``[*system, summary as a user message, *recent]``, where recent is the
    last KEEP_RECENT_TURNS non-system messages, reaching back so that an assistant
    message is never separated from its tool results. Compression is an optimisation:
    when the summarizer fails (or says nothing) the messages come back unchanged with 0.
    """
    system, older, recent = _partition(messages)
    if not older:
        return messages, 0
    request = [{"role": "system", "content": COMPRESSION_SYSTEM_PROMPT},
               {"role": "user", "content": _transcript(older)}]
    try:
        answer = chat(request, tools=None, signal=signal)
        if inspect.iscoroutine(answer):  # an async def ChatFn: never run, not left unawaited
            answer.close()
            raise TypeError(_ASYNC_CHAT)
        summary = answer.message.get("content") or ""
        if not isinstance(summary, str):  # blocks, say: a failure like any other
            raise TypeError(f"the summary is a {type(summary).__name__}, not a string")
    except AbortError as exc:
        if signal is None or not signal.is_set():  # not the caller's stop: a failure to tell of
            _log.warning("history compression failed, keeping the full history: %s: %s",
                         type(exc).__name__, exc)
        return messages, 0
    except Exception as exc:
        _log.warning("history compression failed, keeping the full history: %s: %s",
                     type(exc).__name__, exc)
        return messages, 0
    if not summary.strip():
        _log.warning("history compression returned an empty summary, keeping the full history")
        return messages, 0
    summary_message = {"role": "user", "content": _SUMMARY_HEAD + summary + _SUMMARY_TAIL}
    return [*system, summary_message, *recent], len(summary)


def compress_if_needed(chat, history, *, context_budget_tokens, compress_threshold=0.8,
                       signal=None, emitter=None) -> Optional[int]:
    """Compress ``history`` in place when it is over the threshold and has something to summarise.

    Returns the summary's length (0 when the attempt fell back), or None when no
    attempt was made: no budget, below ``budget * threshold``, or nothing older than the
    recent messages. An attempt is framed by ``compress_start`` and ``compress_end``.
    """
    if context_budget_tokens is None:
        return None
    estimated = estimate_messages_tokens(history)
    if estimated < context_budget_tokens * compress_threshold:
        return None
    if not _partition(history)[1]:  # KEEP_RECENT_TURNS or fewer: nothing older to summarise
        return None
    _emit(emitter, {"type": "compress_start", "estimated_tokens": estimated})
    try:
        compressed, summary_chars = compress_messages(chat, history, signal=signal)
    except BaseException as exc:  # Ctrl-C in a notebook: the events pair, a tracer's spans end
        _emit(emitter, {"type": "compress_end", "summary_chars": 0})
        _emit(emitter, {"type": "error", "error": exc})
        raise
    if compressed is not history:
        history[:] = compressed
    _emit(emitter, {"type": "compress_end", "summary_chars": summary_chars})
    return summary_chars


# ============================================================================
# The loop
# ============================================================================

_ABORT_MESSAGE = "agent loop aborted"
_NO_TOOLS_ERROR = "no tools are available; answer without calling tools"
_MAX_TOOL_CALLS_PER_ANSWER = 128  # the rest of a longer batch fail unrun: a history stays small
_CUT_CALL_ERROR = ("not run: the answer reached its output token limit while writing this call, "
                   "so its arguments may be incomplete; ask for less in one call (a long file "
                   "in parts)")
_OUTPUT_FORMAT_NAME = "output"
# (a language tag only before a line break or a space: ```42``` is 42; the body greedy, as a
# lazy one before \s*``` took time growing with the square of a run of spaces)
_FENCED_JSON = r"(?s)\A\s*```(?:[A-Za-z0-9_-]*[ \t]*\r?\n|[A-Za-z0-9_-]+[ \t]+)?(.*)```\s*\Z"
# The thinking some servers leave in the answer's text (vLLM's MiniMax parser, llama.cpp's
# --reasoning-format none), before what the model answers
_THINKING_FIRST = r"(?s)\A\s*<think>.*?</think>"


def seed_system_prompt(messages, system_prompt) -> list:
    """A copy of ``messages`` whose first system message is ``system_prompt``.

    No system message: it is prepended. Same content: the copy is unchanged. Different
    content: it is replaced in the copy. ``system_prompt=None`` leaves the copy as it is.
    """
    seeded = list(messages)
    if system_prompt is None:
        return seeded
    for i, message in enumerate(seeded):
        if message.get("role") == "system":
            if message.get("content") != system_prompt:
                seeded[i] = {"role": "system", "content": system_prompt}
            return seeded
    seeded.insert(0, {"role": "system", "content": system_prompt})
    return seeded


def _call_ids(messages) -> set:
    """The ids of the tool calls of the assistant messages in ``messages``."""
    return {call.get("id") for m in messages if isinstance(m, dict) and m.get("role") == "assistant"
            for call in m.get("tool_calls") or ()
            if isinstance(call, dict) and isinstance(call.get("id"), str)}


def _unique_call_ids(calls, used, counters) -> list:
    """``calls`` with every id that is empty, not a string, in ``used`` or earlier in ``calls``
    replaced by a fresh one (in a copy). ``used`` is only read; ``counters`` holds the next
    suffix to try per id, so that many repeats cost linear time.

    Providers refuse a history whose tool call ids repeat (Anthropic: "tool_use ids must be
    unique"), and some models and servers repeat them or leave them out.
    """
    seen = set()  # ids of ``calls`` kept or given so far
    for call in calls:  # the common case, kept cheap: every id is fine
        call_id = call.get("id")
        if not (isinstance(call_id, str) and call_id) or call_id in used or call_id in seen:
            break
        seen.add(call_id)
    else:
        return calls
    seen.clear()
    taken = {c.get("id") for c in calls if isinstance(c.get("id"), str)}  # a fresh id takes none
    fixed = None
    for i, call in enumerate(calls):
        call_id = call.get("id")
        if isinstance(call_id, str) and call_id and call_id not in used and call_id not in seen:
            seen.add(call_id)
            continue
        base = call_id if isinstance(call_id, str) and call_id else "call"
        n = counters.get(base, 2)
        while f"{base}_{n}" in used or f"{base}_{n}" in seen or f"{base}_{n}" in taken:
            n += 1
        counters[base] = n + 1
        fixed = fixed or list(calls)
        fixed[i] = {**call, "id": f"{base}_{n}"}
        seen.add(f"{base}_{n}")
    return calls if fixed is None else fixed


def call_chat(chat, history, *, turn, tools=None, temperature=None, max_tokens=None,
              signal=None, emitter=None, response_format=None) -> ChatResult:
    """One chat call framed by ``llm_start`` and ``llm_end``; a failure emits ``error`` and re-raises.

    A tool call id that is empty or repeats one of the answer or of ``history`` is replaced
    by a fresh one before ``llm_end``, so the history stays one a provider accepts.
    ``response_format`` is passed to the chat only when set.
    """
    return _call_chat(chat, history, _call_ids(history), {}, turn=turn, tools=tools,
                      temperature=temperature, max_tokens=max_tokens, signal=signal,
                      emitter=emitter, response_format=response_format)


def _chat_extras(response_format):
    """The keywords a chat call gets beyond the narrow ones: response_format, only when set."""
    return {} if response_format is None else {"response_format": response_format}


def _offered_specs(tools):
    """The specs a ToolRunner offers, as a list (a generator's too), or None for none."""
    if tools is None:
        return None
    specs = tools.specs()
    if inspect.iscoroutine(specs):  # an async def specs: never run, not left unawaited
        specs.close()
        raise TypeError("the tool runner's specs() returned coroutine, not a list: an async def "
                        "specs, which lich calls synchronously")
    return list(specs or ()) or None


def _check_chat_result(result):
    """A TypeError unless ``result`` is a ChatResult whose message the loop can use: the one
    check of what a ChatFn returns, so that nothing later trips over its shape."""
    if not isinstance(result, ChatResult) or not isinstance(result.message, dict):
        if type(result).__name__ == ChatResult.__name__:  # a vendored copy's, say
            raise TypeError(_of_another_copy("chat", result))
        if inspect.iscoroutine(result):  # an async def ChatFn: never run, said once, not twice
            result.close()
            raise TypeError(_ASYNC_CHAT)
        raise TypeError(f"the chat returned {type(result).__name__}, not a ChatResult "
                        f"holding a message dict")
    role, content = result.message.get("role"), result.message.get("content")
    if role != "assistant":  # the session would keep a message it cannot read back
        raise TypeError(f"the chat's message has the role {role!r}, not 'assistant'")
    if content is not None and not isinstance(content, str):
        raise TypeError(f"the chat's message content is a {type(content).__name__}, not a string")
    if result.usage is not None and not isinstance(result.usage, dict):  # an SDK's own object
        raise TypeError(f"the chat's usage is a {type(result.usage).__name__}, not a dict of "
                        f"token counts")
    calls = result.message.get("tool_calls")
    if calls is None:
        return
    if not isinstance(calls, list):
        raise TypeError(f"the chat's tool_calls is a {type(calls).__name__}, not a list")
    for i, call in enumerate(calls):
        if not isinstance(call, dict):
            raise TypeError(f"the chat's tool call {i} is a {type(call).__name__}, not a dict")
        for key in ("name", "arguments"):
            if not isinstance(call.get(key), str):
                raise TypeError(f"the chat's tool call {i}: its {key} is a "
                                f"{type(call.get(key)).__name__}, not a string")


def _of_another_copy(what, result) -> str:
    """Why the ``what`` (chat, tool runner) cannot be used: its result is of the class of that
    name of another copy of lich (one vendored beside an installed one, say)."""
    return (f"the {what} returned a {type(result).__name__} of another copy of lich (module "
            f"{type(result).__module__!r}; this one is {__name__!r}): a {what} and the loop "
            f"that calls it must come from one copy")


def _call_chat(chat, history, used_ids, id_counters, *, turn, tools, temperature, max_tokens,
               signal, emitter, response_format):
    """``call_chat`` with the history's call ids already known; ``used_ids`` grows by the answer's."""
    _emit(emitter, {"type": "llm_start", "turn": turn})
    try:
        # A copy of the list: a ChatFn that takes the system prompt out (messages.pop(0)) or
        # adds to it changes no history; it grows after the call, not in the chat's hands.
        result = chat(list(history), tools=tools, temperature=temperature, max_tokens=max_tokens,
                      signal=signal, **_chat_extras(response_format))
        _check_chat_result(result)
    except BaseException as exc:  # Ctrl-C in a notebook too: a tracer's spans end
        _log.debug("chat call failed on turn %d", turn, exc_info=True)
        _emit(emitter, {"type": "error", "error": exc})
        raise
    if not isinstance(result.message.get("content"), str):  # None or absent: "", as a session reads back
        result = replace(result, message={**result.message, "content": ""})
    calls = result.message.get("tool_calls")
    if calls:
        unique = _unique_call_ids(calls, used_ids, id_counters)
        if unique is not calls:
            result = replace(result, message={**result.message, "tool_calls": unique})
        used_ids.update(c["id"] for c in unique)
    _emit(emitter, {"type": "llm_end", "turn": turn, "result": result})
    return result


def format_tool_result_content(result: ToolResult) -> str:
    """The tool message content: the raw output on success, else a JSON object with the error."""
    if result.ok:
        return result.output
    return json.dumps({"ok": False, "output": result.output, "error": result.error},
                      ensure_ascii=False)


def tool_message_from_result(call: dict, result: ToolResult) -> dict:
    """The tool message that answers ``call`` with ``result``."""
    return {"role": "tool", "tool_call_id": call.get("id"), "name": call.get("name"),
            "content": format_tool_result_content(result), "is_error": not result.ok}


def _run_one_tool(tools, call, signal) -> ToolResult:
    if tools is None:
        return ToolResult(ok=False, error=_NO_TOOLS_ERROR)
    try:
        # A copy: the call is the history's own, and a tool that changes what it is handed
        # (a lich.ToolCall parameter) must not change the history or its session.
        result = tools.run(dict(call), signal)
    except (Exception, SystemExit) as exc:  # argparse's exit too, but for a server stopping it
        if isinstance(exc, SystemExit) and _raised_by_a_signal_handler(exc):
            raise
        _log.debug("tool runner raised on %r", call.get("name"), exc_info=True)
        return ToolResult(ok=False, error=_exception_text(exc))
    if inspect.iscoroutine(result):  # an async def run: never run, not left unawaited
        result.close()
        return ToolResult(ok=False, error="TypeError: the tool runner returned coroutine, not a "
                                          "ToolResult: an async def run, which lich calls "
                                          "synchronously")
    if not isinstance(result, ToolResult):
        return ToolResult(ok=False, error="TypeError: " + (
            _of_another_copy("tool runner", result) if type(result).__name__ == "ToolResult"
            else f"the tool runner returned {type(result).__name__}, not a ToolResult"))
    if type(result.ok) is not bool:  # "false" would be taken for a success
        return ToolResult(ok=False, error=f"TypeError: the tool runner returned a ToolResult whose "
                                          f"ok is {type(result.ok).__name__}, not bool")
    output = "" if result.output is None else result.output
    for value in (output, result.error):
        if value is not None and not isinstance(value, str):  # no session or provider takes it
            return ToolResult(ok=False, error=f"TypeError: the tool runner returned a ToolResult "
                                              f"holding {type(value).__name__}, not str")
    # A key a tool found (`cat /proc/$PPID/environ`) must not reach the history, a session or
    # the next request.
    redacted = _redact_secrets(output), _redact_secrets(result.error)
    if result.output is None or redacted != (result.output, result.error):
        return ToolResult(ok=result.ok, output=redacted[0], error=redacted[1])
    return result


def _skip_tool_call(call, history, *, turn, error, emitter):
    result = ToolResult(ok=False, error=error)
    history.append(tool_message_from_result(call, result))
    _emit(emitter, {"type": "tool_call_end", "turn": turn, "call": call, "result": result,
                    "cancelled": True})


def run_tool_calls(tools, calls, history, *, turn, signal=None, emitter=None) -> None:
    """Run ``calls`` one after another, appending one tool message per call to ``history``.

    A call not yet started when ``signal`` is set is skipped: its tool message says
    "aborted" and its ``tool_call_end`` is ``cancelled`` with no ``tool_call_start``. Of an
    answer asking for more than 128 calls, the calls past the 128th are skipped the same way.
    """
    for i, call in enumerate(calls):
        if i >= _MAX_TOOL_CALLS_PER_ANSWER:
            _skip_tool_call(call, history, turn=turn, emitter=emitter,
                            error=f"not run: the answer asked for {len(calls)} tool calls and "
                                  f"at most {_MAX_TOOL_CALLS_PER_ANSWER} run per answer; ask "
                                  f"for fewer at a time")
            continue
        if signal is not None and signal.is_set():
            _skip_tool_call(call, history, turn=turn, error="aborted", emitter=emitter)
            continue
        try:
            _emit(emitter, {"type": "tool_call_start", "turn": turn, "call": call})
            result = _run_one_tool(tools, call, signal)
            history.append(tool_message_from_result(call, result))
            _emit(emitter, {"type": "tool_call_end", "turn": turn, "call": call, "result": result,
                            "cancelled": False})
        except BaseException as exc:  # Ctrl-C in a tool (or a handler): as in a chat call,
            _emit(emitter, {"type": "error", "error": exc})  # a tracer's spans end
            raise


def _check_loop_keywords(caller, names, taken=()):
    """The TypeError Python would raise for ``caller(**loop_params)`` with a keyword that
    ``run_conversation`` does not take (or that ``caller`` sets itself: ``taken``), raised
    before any run starts."""
    known = inspect.signature(run_conversation).parameters
    for name in names:
        if name not in known or known[name].kind is not inspect.Parameter.KEYWORD_ONLY \
                or name in taken:
            raise TypeError(f"{caller}() got an unexpected keyword argument {name!r}")


def _check_loop_options(loop_params):
    """``_check_run_options`` of the options given among a run's ``loop_params``."""
    _check_run_options(**{name: loop_params[name] for name in (
        "max_turns", "output_schema", "context_budget_tokens", "compress_threshold")
        if name in loop_params})


def _check_run_options(max_turns, output_schema=None, context_budget_tokens=None,
                       compress_threshold=0.8):
    """A run's options checked before it calls anything, so a mistake costs no model call."""
    if isinstance(max_turns, bool) or not isinstance(max_turns, int):
        raise TypeError(f"max_turns must be an int >= 1, not {type(max_turns).__name__}")
    if max_turns < 1:
        raise ValueError(f"max_turns must be an int >= 1, not {max_turns}")
    # a number read from an environment variable is a str: it failed mid-run, in Python's words
    if context_budget_tokens is not None and not _is_number(context_budget_tokens):
        raise TypeError(f"context_budget_tokens must be a number or None, not "
                        f"{type(context_budget_tokens).__name__}")
    if not _is_number(compress_threshold):
        raise TypeError(f"compress_threshold must be a number, not "
                        f"{type(compress_threshold).__name__}")
    if output_schema is not None:
        try:
            problem = (_schema_problem(output_schema, "output_schema", output_schema)
                       or _ref_loop(output_schema)
                       if isinstance(output_schema, dict) else
                       f"output_schema must be an object, not {_json_kind(output_schema)}")
        except RecursionError:
            problem = "output_schema is nested too deeply"
        if problem:
            raise ValueError(problem)


def _parse_output(text, schema):
    """(value, None) when ``text`` is JSON valid under ``schema``, else (None, what is wrong).

    A Markdown code fence around the JSON is tolerated: models add one unasked; so is a
    ``<think>`` block before it, the thinking a server left in the text, and a byte order
    mark (U+FEFF) before it all.
    """
    text = text.removeprefix("\ufeff")
    thinking = re.match(_THINKING_FIRST, text)
    if thinking is not None:
        text = text[thinking.end():]
    fenced = re.match(_FENCED_JSON, text)
    try:
        value = _strict_json(fenced.group(1) if fenced else text)
    except (ValueError, RecursionError) as e:
        return None, f"it is not valid JSON ({e})"
    problems = []
    try:
        checked = _schema_check(value, schema, "answer", problems, schema)
        if not problems:  # its integers as the model wrote them: a "number" made them floats
            return _integers_as_given(value, checked), None
    except RecursionError:  # a tree deeper than Python's stack, under a recursive $ref
        return None, "it is nested too deeply to check against the schema"
    described = "; ".join(f"{where} must be {expected}, not {got}"
                          for where, expected, got in problems[:10])
    return None, f"it does not match the schema: {described}"


def _integers_as_given(given, checked):
    """``checked`` (what _schema_check gave back for ``given``) with each integer of
    ``given`` that it made a float given back: 9007199254740993 is no float, 5 is not 5.0."""
    if checked is given:  # unchanged, and all it holds
        return given
    if isinstance(checked, float) and isinstance(given, int) and not isinstance(given, bool):
        return given
    if isinstance(checked, list) and isinstance(given, list) and len(checked) == len(given):
        return [_integers_as_given(a, b) for a, b in zip(given, checked)]
    if isinstance(checked, dict) and isinstance(given, dict):
        return {key: _integers_as_given(given[key], item) if key in given else item
                for key, item in checked.items()}
    return checked


def _output_correction(error, schema) -> dict:
    """The user message that says why an answer cannot be used, and what to answer: with
    the schema, which a ChatFn or server that leaves ``response_format`` aside (DeepSeek's
    and Ollama's Anthropic endpoints drop it unsaid) never showed the model."""
    try:
        asked = f"valid under this JSON Schema: {json.dumps(schema, ensure_ascii=False)}"
    except (ValueError, RecursionError):  # a bound of more digits than Python writes, say
        asked = "that matches the required schema."
    return {"role": "user", "content": f"Your answer cannot be used: {error}. Answer again with "
                                      f"only a JSON value {asked}"}


def run_conversation(chat, tools, messages, *, max_turns, system_prompt=None, temperature=None,
                     max_tokens=None, context_budget_tokens=None, compress_threshold=0.8,
                     signal=None, emitter=None, output_schema=None) -> LoopOutcome:
    """Drive ``chat`` and ``tools`` until the model answers without tool calls.

    Each turn makes exactly one chat call: ``max_turns`` is a budget of chat calls, not
    of tools. A turn whose assistant message has no tool calls is the final answer
    (``stopped_reason="final"``). A signal set before a turn stops the run
    (``"aborted"``, after an ``error`` event carrying AbortError). Tool calls asked for
    on the last allowed turn are not run (``"budget"``). Of an answer cut at its output
    token limit (``stop_reason="length"``) the last tool call is not run either: its
    arguments may end short. A chat failure emits ``error`` and propagates; a tool failure
    is a tool message the model reads.

    With ``output_schema`` (a JSON Schema object) the chat is also given
    ``response_format={"name": "output", "schema": output_schema}``, and a final answer
    must be JSON valid under the schema: otherwise an ``output_invalid`` event carries the
    user message that says what is wrong, which joins the history for one more turn. The
    parsed value is the outcome's ``output``.

    ``messages`` is not changed; the outcome's ``messages`` is the working history, after
    compression when ``context_budget_tokens`` is set.
    """
    _check_run_options(max_turns, output_schema, context_budget_tokens, compress_threshold)
    history = seed_system_prompt(messages, system_prompt)
    specs = _offered_specs(tools)
    response_format = (None if output_schema is None
                       else {"name": _OUTPUT_FORMAT_NAME, "schema": output_schema})
    # Kept as the history grows, so a turn costs the same at turn 10 and at turn 1,000.
    estimated = estimate_messages_tokens(history) if context_budget_tokens is not None else 0
    used_ids, id_counters = _call_ids(history), {}
    result = None
    for turn in range(1, max_turns + 1):
        _emit(emitter, {"type": "turn_start", "turn": turn})
        if signal is not None and signal.is_set():
            _emit(emitter, {"type": "error", "error": AbortError(_ABORT_MESSAGE)})
            return LoopOutcome(history, None, None, turn - 1, "aborted")
        if (context_budget_tokens is not None
                and estimated >= context_budget_tokens * compress_threshold):
            if compress_if_needed(chat, history, context_budget_tokens=context_budget_tokens,
                                  compress_threshold=compress_threshold, signal=signal,
                                  emitter=emitter):
                estimated = estimate_messages_tokens(history)
            if signal is not None and signal.is_set():  # set while the summary was asked for
                _emit(emitter, {"type": "error", "error": AbortError(_ABORT_MESSAGE)})
                return LoopOutcome(history, None, None, turn - 1, "aborted")
        result = _call_chat(chat, history, used_ids, id_counters, turn=turn, tools=specs,
                            temperature=temperature, max_tokens=max_tokens, signal=signal,
                            emitter=emitter, response_format=response_format)
        message = result.message
        history.append(message)
        grown = len(history) - 1
        calls = message.get("tool_calls")
        if not calls:
            output, error = (None, None) if output_schema is None else _parse_output(
                message.get("content") or "", output_schema)
            if error is None:
                _emit(emitter, {"type": "final", "message": message, "result": result})
                _emit(emitter, {"type": "turn_end", "turn": turn})
                return LoopOutcome(history, message, result, turn, "final", output)
            if turn == max_turns:
                break
            if result.stop_reason == "length":  # asked again alike, it would be cut again
                error += "; it was cut at the output token limit: write a shorter one"
            correction = _output_correction(error, output_schema)
            history.append(correction)
            _emit(emitter, {"type": "output_invalid", "turn": turn, "error": error,
                            "message": correction})
        elif turn == max_turns:
            for call in calls:
                _skip_tool_call(call, history, turn=turn, error="turn_budget_exhausted",
                                emitter=emitter)
            break
        else:
            # its arguments end short; past the 128th it is skipped as those are
            cut = calls[-1] if (result.stop_reason == "length"
                                and len(calls) <= _MAX_TOOL_CALLS_PER_ANSWER) else None
            run_tool_calls(tools, calls[:-1] if cut else calls, history, turn=turn, signal=signal,
                           emitter=emitter)
            if cut:
                _skip_tool_call(cut, history, turn=turn, emitter=emitter, error="aborted" if (
                    signal is not None and signal.is_set()) else _CUT_CALL_ERROR)
        if context_budget_tokens is not None:
            estimated += sum(map(_estimate_message_tokens, history[grown:]))
    _emit(emitter, {"type": "budget_exhausted", "turns_used": max_turns})
    _emit(emitter, {"type": "turn_end", "turn": max_turns})
    return LoopOutcome(history, None, result, max_turns, "budget")


# ============================================================================
# Sessions
# ============================================================================

_SESSION_SUFFIX = ".jsonl"
_MESSAGE_ROLES = frozenset({"system", "user", "assistant", "tool"})
_LABEL_MAX_CHARS = 64
_SESSION_NAME_ATTEMPTS = 1000
_SESSION_LINK_CHECK_SECONDS = 1.0  # how often an append looks whether its file was removed
_SESSION_PIECE_CHARS = 1 << 20  # a longer line is read in pieces: kept if it starts a record

# --- recording ---


def _record_line(kind: str, value) -> bytes:
    now = time.time()
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1000):03d}Z"
    return _json_line({"ts": stamp, "kind": kind, kind: value})


class SessionHandle:
    """An open session file: JSONL records appended whole, one line per call, thread-safe.

    Each append is written with one ``os.write`` on an ``O_APPEND`` descriptor and is in
    the file when the call returns. A write that fails part-way is cut back when nothing
    else was appended meanwhile, so the file holds whole lines only; the OSError goes to
    the caller. An append to a file that was removed (its folder deleted) raises
    FileNotFoundError (looked at once a second at most). A handle belongs to the process
    that opened it: after ``fork()`` the child gets a RuntimeError and must open its own.
    Handles do not pickle.
    """

    def __init__(self, path: str, fd: int):
        self.path = path
        self.id = os.path.basename(path)[:-len(_SESSION_SUFFIX)]
        self._fd = fd
        self._pid = os.getpid()
        self._torn = False  # a failed write could not be cut back: start the next on a new line
        self._link_checked = -math.inf  # when the file was last seen to have a name
        self._lock = threading.Lock()
        self._close_fd = weakref.finalize(self, os.close, fd)  # a handle nobody closed

    def append_message(self, msg: dict) -> None:
        """Append a ``{"kind": "message"}`` record."""
        self._append(_record_line("message", msg))

    def append_meta(self, meta: dict) -> None:
        """Append a ``{"kind": "meta"}`` record."""
        self._append(_record_line("meta", meta))

    def close(self) -> None:
        """Close the file; appending afterwards raises ValueError."""
        if os.getpid() != self._pid:  # a forked child's copy, whose lock a parent's thread may hold
            fd, self._fd = self._fd, None
            if fd is not None:
                self._close_fd.detach()  # the parent's descriptor: not ours to close
                os.close(fd)
            return
        with self._lock:
            if self._fd is not None:
                self._close_fd()
                self._fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()

    def __repr__(self):
        return f"SessionHandle(id={self.id!r})"

    def __reduce__(self):
        raise TypeError(f"cannot pickle a SessionHandle ({self.id}): it is an open file of "
                        f"this process; pass the session folder and open one on the other side")

    def _append(self, line: bytes) -> None:
        if os.getpid() != self._pid:  # before the lock, which a parent's thread may have held
            raise RuntimeError(f"session {self.id} was opened by process {self._pid}; "
                               f"open a session of your own in this process")
        with self._lock:
            if self._fd is None:
                raise ValueError(f"session {self.id} is closed")
            if self._torn:
                line = b"\n" + line
            view = memoryview(line)
            written = 0
            try:
                while written < len(line):
                    written += os.write(self._fd, view[written:])
            except BaseException:
                self._cut_back(written)
                raise
            self._torn = False
            now = time.monotonic()
            if now >= self._link_checked + _SESSION_LINK_CHECK_SECONDS:  # each time: +23 % an append
                if self._removed():  # its folder was removed: nothing would be kept
                    raise FileNotFoundError(errno.ENOENT, "the session file was removed",
                                            self.path)
                self._link_checked = now

    def _removed(self) -> bool:
        """Whether the file has no name left: no link, and its path names no file or
        another one (a FUSE mount may say 0 links of a file that is there)."""
        mine = os.fstat(self._fd)
        if mine.st_nlink:
            return False
        try:
            there = os.stat(self.path)
        except FileNotFoundError:
            return True
        except OSError:
            return False
        return (there.st_dev, there.st_ino) != (mine.st_dev, mine.st_ino)

    def _cut_back(self, written):
        """Remove the ``written`` bytes of a failed append: appended last, they end the file
        (unless another writer came after them, and then they stay as a torn line)."""
        if not written:
            return
        try:
            os.ftruncate(self._fd, os.fstat(self._fd).st_size - written)
        except OSError:
            self._torn = True


def _clean_label(label) -> str:
    cleaned = re.sub(r"[^A-Za-z0-9_.-]+", "-", str(label or ""))
    cleaned = re.sub(r"\.{2,}", ".", cleaned)
    return cleaned.strip("-.")[:_LABEL_MAX_CHARS].rstrip("-.")


def _session_stems(session_dir: str, stamp: str) -> list:
    """The counters of the session names that use ``stamp``."""
    start = f"{stamp}-"  # one pattern for all stamps: a pattern per second filled re's cache
    return [int(found.group(1)) for found in (
        _SESSION_COUNTER.fullmatch(name, len(start)) for name in os.listdir(session_dir)
        if name.startswith(start)) if found]


_SESSION_CLAIM_SUFFIX = ".claim"  # a session file's name while its counter is claimed
_SESSION_COUNTER = re.compile(r"(\d+)(?:-[^/]*)?" + re.escape(_SESSION_SUFFIX)
                              + f"(?:{re.escape(_SESSION_CLAIM_SUFFIX)})?")


_session_names_lock = _ForkSafeLock()  # threads of one process never take one counter at once


def open_session(session_dir, label=None) -> SessionHandle:
    """Create ``<session_dir>/<UTC timestamp>-<counter>[-<label>].jsonl`` and open it.

    The directory is created with mode 0700; the file is created exclusively, so two
    processes never share one: the counter moves on instead, across labels too.
    """
    session_dir = os.fsdecode(session_dir)  # a bytes path too, as os's functions take
    os.makedirs(session_dir, mode=0o700, exist_ok=True)
    label = _clean_label(label)
    with _session_names_lock:
        return _new_session(session_dir, label)


def _new_session(session_dir, label):
    """The session file of the first free counter of this second (open_session's work)."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    suffix = (f"-{label}" if label else "") + _SESSION_SUFFIX
    counter = max(_session_stems(session_dir, stamp), default=0) + 1
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | getattr(os, "O_CLOEXEC", 0)
    for _ in range(_SESSION_NAME_ATTEMPTS):
        path = os.path.join(session_dir, f"{stamp}-{counter}{suffix}")
        # Claimed under a name that list_sessions does not list, and renamed once it is
        # ours: a file that steps aside was listed, and gone when it was read.
        claim = path + _SESSION_CLAIM_SUFFIX
        try:
            fd = os.open(claim, flags, 0o600)
        except FileExistsError:
            counter += 1
            continue
        # Another process may have taken this counter under another label meanwhile:
        # whoever sees a second claim steps aside, so two never both keep one.
        try:  # the listing may fail too (no descriptor left): the claim goes with it
            ours = _session_stems(session_dir, stamp).count(counter) == 1
            if ours:
                os.rename(claim, path)
        except BaseException:
            os.close(fd)
            os.unlink(claim)
            raise
        if ours:
            return SessionHandle(path, fd)
        os.close(fd)
        os.unlink(claim)
        counter += 1
    raise FileExistsError(f"no free session name for {stamp} after {_SESSION_NAME_ATTEMPTS} tries")


@dataclass
class AgentRunResult(LoopOutcome):
    """A ``LoopOutcome`` plus where the run was recorded and what it cost."""

    session_path: Optional[str] = None
    usage_total: dict = field(default_factory=_zero_usage)


class _Recorder:
    """Turns one run's events into session records and sums its usage.

    Best effort: the first failing write (or a session object that lacks a method) logs
    one warning and stops the recording; the run goes on.
    """

    def __init__(self, session):
        self.session = session
        self.usage = _zero_usage()

    def message(self, message: dict) -> None:
        self._write("append_message", message)

    def meta(self, meta: dict) -> None:
        self._write("append_meta", meta)

    def on_event(self, event: dict) -> None:
        kind = event["type"]
        if kind == "llm_end":
            result = event["result"]
            _add_usage(self.usage, result.usage)
            self.message(result.message)
        elif kind == "tool_call_end":
            self.message(tool_message_from_result(event["call"], event["result"]))
        elif kind == "output_invalid":
            self.message(event["message"])
        elif kind == "budget_exhausted":
            self.meta({"event": "budget_exhausted", "turns_used": event["turns_used"]})
        elif kind == "compress_end":
            self.meta({"event": "compress", "summary_chars": event["summary_chars"]})

    def _write(self, method, record) -> None:
        if self.session is None:
            return
        try:
            getattr(self.session, method)(record)
        except Exception as exc:
            _log.warning("session recording stopped: %s: %s: %s",
                         getattr(self.session, "id", "?"), type(exc).__name__, exc)
            _sessions_with_a_gap.mark(self.session)  # later runs would write after the gap
            self.session = None


class _SessionMarks:
    """Session objects of this process that something was noted of, held weakly (strongly
    when they take no weak reference) and told apart by identity, not equality."""

    def __init__(self):
        self._marked = {}  # id(session) -> weakref to it, or the session itself
        self._lock = _ForkSafeLock()  # every recorded run in a forked child asks for it

    def mark(self, session) -> bool:
        """Note ``session``; True when it was not noted before."""
        key = id(session)
        with self._lock:
            known = self._marked.get(key)
            if known is not None and (known() if isinstance(known, weakref.ref) else known) is session:
                return False
            try:
                self._marked[key] = weakref.ref(session, lambda _, key=key: self._marked.pop(key, None))
            except TypeError:  # no weak references to it: kept for the life of the process
                self._marked[key] = session
            return True

    def __contains__(self, session) -> bool:
        with self._lock:
            known = self._marked.get(id(session))
        return known is not None and (known() if isinstance(known, weakref.ref) else known) is session


_sessions_holding_history = _SessionMarks()  # run_agent wrote a whole history there
_sessions_with_a_gap = _SessionMarks()  # a record of a run failed to go there: no more go
_recording_in_this_thread = threading.local()  # .sessions: those its runs record into now


def _seeding_additions(previous: list, seeded: list) -> list:
    """What seeding added to ``previous``: the new user message and a new or changed system one."""
    added = [seeded[-1]]
    old_system = next((m for m in previous if m.get("role") == "system"), None)
    new_system = next((m for m in seeded if m.get("role") == "system"), None)
    if new_system is not None and new_system is not old_system:
        added.insert(0, new_system)
    return added


def _tools_root(tools) -> str:
    root = getattr(tools, "root", None)
    return root if isinstance(root, str) else os.getcwd()


def run_agent(prompt, *, chat, tools=None, history=None, session=None, session_dir=None,
              label=None, emitter=None, **loop_params) -> AgentRunResult:
    """Run one user turn, ``history`` + ``prompt``, through ``run_conversation`` and record it.

    ``loop_params`` are ``run_conversation``'s, ``max_turns`` among them (required). With
    ``session`` -- a SessionHandle, or any object with ``.path``, ``.id``, ``append_message``,
    ``append_meta`` and ``close`` -- the run is recorded there; else with ``session_dir``
    into a new session file; with neither, nowhere. A session holds, in order:
    ``run_start`` (with ``cwd``, ``model`` and the lich version), the seeded messages, each
    assistant and tool message as it happens,
    ``budget_exhausted`` / ``compress`` markers, and ``run_end`` with the run's summed
    usage -- or ``run_error`` before the exception propagates. A session that run_agent
    already wrote to in this process gets only what seeding added (pass the previous run's
    ``messages`` as ``history``). Recording never fails the run: the first failing write
    logs a warning and recording stops, in that session for good (a later run's records
    would follow a gap).
    """
    _check_loop_keywords("run_agent", loop_params)  # before a session file is made for nothing
    if not isinstance(prompt, str):  # a list of blocks ran, and its session read back without it
        raise TypeError(f"prompt must be a str, not {type(prompt).__name__}")
    if "max_turns" not in loop_params:
        raise TypeError("run_agent() missing 1 required keyword-only argument: 'max_turns'")
    _check_loop_options(loop_params)
    previous = list(history or ())
    seeded = seed_system_prompt(previous + [{"role": "user", "content": prompt}],
                                loop_params.pop("system_prompt", None))
    owned = False
    if session is None and session_dir is not None:
        try:
            session, owned = open_session(session_dir, label), True
        except OSError as exc:
            _log.warning("session recording is off: cannot create a session file: %s: %s",
                         type(exc).__name__, exc)
    if session is not None and session in _sessions_with_a_gap:
        _log.warning("session recording is off: %s: a record of an earlier run could not be "
                     "written, and what follows would not make a whole history",
                     getattr(session, "id", "?"))
        session = None
    recording_here = getattr(_recording_in_this_thread, "sessions", None)
    if recording_here is None:
        recording_here = _recording_in_this_thread.sessions = []
    if session is not None and any(held is session for held in recording_here):
        # a run started inside a run (a tool's sub-agent): its records would fall between
        # the outer run's call and its result, and the file would not read back
        _log.warning("session recording is off: %s records the run that started this one; "
                     "give this run a session of its own", getattr(session, "id", "?"))
        session = None
    recording = session is not None
    if recording:
        recording_here.append(session)
    recorder = _Recorder(session)
    try:
        if session is not None:
            model = getattr(chat, "model", None)
            recorder.meta({"event": "run_start", "input_chars": len(prompt),
                           "history_size": len(previous), "cwd": _tools_root(tools),
                           "model": model if isinstance(model, str) else None,
                           "lich": __version__})
            fresh = owned or _sessions_holding_history.mark(session)
            for message in seeded if fresh else _seeding_additions(previous, seeded):
                recorder.message(message)
        # The run's own emitter: the recorder hears this run only, also when the caller's
        # emitter is shared by runs in other threads (whose handlers it hears first).
        run_emitter = AgentEmitter()
        if emitter is not None:
            run_emitter.on_any(emitter.emit)
        run_emitter.on_any(recorder.on_event)
        try:
            outcome = run_conversation(chat, tools, seeded, emitter=run_emitter, **loop_params)
        except BaseException as exc:
            recorder.meta({"event": "run_error",
                           "error": _redact_secrets(_exception_text(exc))})
            raise
        recorder.meta({"event": "run_end", "stopped_reason": outcome.stopped_reason,
                       "usage": recorder.usage})
    finally:
        if recording:
            del recording_here[next(i for i, held in enumerate(recording_here) if held is session)]
        if owned:
            session.close()
    return AgentRunResult(outcome.messages, outcome.final, outcome.result, outcome.turns_used,
                          outcome.stopped_reason, outcome.output,
                          session_path=getattr(session, "path", None), usage_total=recorder.usage)


# --- reading ---


def _clean_message(message) -> Optional[dict]:
    """``message`` if it has a shape a provider accepts (a None content becomes ""), else None."""
    # ``type(x) is`` rather than isinstance: this runs per record of files of 100 MB, where it
    # is measurably faster (bench/RESULTS.md, session read); JSON gives only exact types.
    if type(message) is not dict:
        return None
    role = message.get("role")
    if type(role) is not str or role not in _MESSAGE_ROLES:  # a list or object is unhashable
        return None
    content = message.get("content")
    if type(content) is not str:
        if content is not None:
            return None
        message = {**message, "content": ""}
    if role == "tool":
        return message if type(message.get("tool_call_id")) is str else None
    if role == "assistant":
        calls = message.get("tool_calls")
        if calls is not None and not (type(calls) is list and all(map(_is_tool_call, calls))):
            return None
    return message


def _is_tool_call(call) -> bool:
    return (type(call) is dict and type(call.get("id")) is str
            and type(call.get("name")) is str and type(call.get("arguments")) is str)


def _interrupted_tool_message(call: dict) -> dict:
    return tool_message_from_result(call, ToolResult(ok=False, error="interrupted"))


def _repair_history(messages) -> list:
    """Pair every tool call with exactly one tool message and drop the user messages a run
    left without an answer.

    A tool message is kept only when it follows (with only tool messages between) the
    assistant message that asked for it; a call left unanswered gets an "interrupted"
    tool message after the answers that were recorded. A call id that is empty or used
    before is renamed (see ``_unique_call_ids``), in its tool message too. ``messages``
    holds a ``_RunMark`` for each run's start, end and compression, in a file that several
    runs went to (one handle, one conversation). At a run's start, what its history did
    not hold goes: the records of a run before it that failed or was stopped (and did not
    compress its history, which would make its history shorter than the file), past the
    history the next run was given; and user messages left without an answer, as trailing
    ones do at the end. A system message right after a run's start is the prompt that run
    set, new or changed, and stands first, in place of any before it, as the run had it,
    unless nothing of that run is kept; of a run that recorded its whole history (a
    handle's first), only when a user message (its prompt) follows that history.
    """
    repaired = []
    pending = []  # [call, answered] of the last assistant's calls, while tool messages follow
    waiting = {}  # the id recorded in the file -> its unanswered entries of ``pending``, in order
    used, counters = set(), {}
    prompts_set = []  # a _RunSystem per run of the file that set a system prompt, in order
    run_started = False
    given = 0  # the size of the history the run under way was given
    own_from = None  # where the records of the run under way begin, past any history
    reused = False  # its history is not among its records (a handle it reused, or none)
    cut_short = compressed = False  # it failed or was stopped; it compressed its history
    cut_from = None  # where the records of the runs cut short before it, one after another, begin
    chain_inserts = run_inserts = 0  # system prompts those runs, and the run under way, put first
    # A run that recorded its whole history (the first of a handle) puts a system prompt it
    # set before that history's messages: a system message first is that prompt when the
    # message after the history's is a user message (its prompt), not an answer.
    whole = None  # [messages of it seen, its first is a system message, its prompt's place if not set]
    for message in messages:
        if type(message) is _RunMark:
            if message.event == "compress":
                compressed = True
            elif message.event == "end":
                cut_short = message.cut_short
            else:  # a run starts
                if whole is not None and own_from is None and whole[2] is not None:
                    own_from = whole[2]  # the run before it ended at its prompt
                keep = message.history_size
                # the history given is the one the run before it compressed, shorter than the
                # file: nothing can be counted (not the history it was given itself, say)
                shortened = compressed and (own_from is None or keep < own_from)
                if cut_short and not shortened and own_from is not None:
                    cut_from = own_from if cut_from is None else min(cut_from, own_from)
                    chain_inserts += run_inserts
                else:
                    cut_from, chain_inserts = None, 0
                # a history given before those runs lacks the prompts they put first
                at = None if cut_from is None else max(keep + chain_inserts, cut_from)
                if at is not None and len(repaired) > at:
                    repaired.extend(_interrupted_tool_message(call) for call, answered in pending
                                    if not answered)
                    pending, waiting = [], {}
                    if repaired[at]["role"] != "tool":  # not inside a call's answers
                        del repaired[at:]
                        used, counters = _call_ids(repaired), {}  # as the next run's loop has them
                # a history from before the runs cut short lacks the prompts they put first
                # (one that is the file's reading holds them: it reaches past their start)
                before = cut_from is not None and keep + chain_inserts <= cut_from
                shifted = _drop_unanswered(repaired, prompts_set, keep=len(repaired) if shortened
                                           else keep + (chain_inserts if before else 0))
                if cut_from is not None:  # where it began, as the messages stand now
                    cut_from = max(0, cut_from - shifted)
                    chain_inserts = max(0, chain_inserts - shifted)
                run_started, given, reused, run_inserts = True, keep, bool(repaired) or not keep, 0
                own_from, cut_short, compressed = None, False, False
                whole = None if reused else [0, False, None]
            continue
        if whole is not None and own_from is None:
            seen = whole[0]
            whole[0] += 1
            if seen == 0:
                whole[1] = message["role"] == "system"
            if seen == given:  # its prompt, unless a system prompt it set came first
                whole[2] = len(repaired)
                if not whole[1]:
                    own_from = whole[2]
            elif whole[1] and seen == given + 1:
                if message["role"] == "user":  # the prompt: the system message first was set
                    prompts_set.append(_RunSystem(None, len(repaired)))
                    run_inserts += 1
                    if cut_from is not None:
                        cut_from += 1
                    own_from = len(repaired)
                else:  # an answer: the prompt came before it
                    own_from = whole[2]
        seeded_system, run_started = run_started and message["role"] == "system", False
        if own_from is None and reused and not seeded_system:  # what seeding added: its prompt
            own_from = len(repaired)
        role = message["role"]
        if role == "tool":
            entries = waiting.get(message["tool_call_id"])
            if entries:
                entry = entries.popleft()
                entry[1] = True
                if entry[0]["id"] != message["tool_call_id"]:
                    message = {**message, "tool_call_id": entry[0]["id"]}
                repaired.append(message)
            continue
        if pending:
            repaired.extend(_interrupted_tool_message(call) for call, answered in pending
                            if not answered)
            pending, waiting = [], {}
        if role == "assistant" and message.get("tool_calls"):
            recorded = message["tool_calls"]
            calls = _unique_call_ids(recorded, used, counters)
            if calls is not recorded:
                message = {**message, "tool_calls": calls}
            for call, old in zip(calls, recorded):
                used.add(call["id"])
                entry = [call, False]
                pending.append(entry)
                waiting.setdefault(old["id"], deque()).append(entry)
        # a system message first of all, from a history given, is that history's, not one set
        if seeded_system and (repaired or not given):
            replaced = repaired[0] if repaired and repaired[0]["role"] == "system" else None
            if replaced is not None:
                repaired[0] = message
            else:
                repaired.insert(0, message)
                run_inserts += 1
                if cut_from is not None:
                    cut_from += 1  # it moved one on
            prompts_set.append(_RunSystem(replaced, len(repaired)))
            continue
        repaired.append(message)
    repaired.extend(_interrupted_tool_message(call) for call, answered in pending if not answered)
    _drop_unanswered(repaired, prompts_set, keep=0)
    return repaired


class _RunMark:
    """A run's meta record among a file's messages: its start ("start", with the size of
    the history it was given), its end ("end", cut short when it failed or was stopped),
    or a compression of its history ("compress")."""

    __slots__ = ("cut_short", "event", "history_size")

    def __init__(self, event, history_size=0, cut_short=False):
        self.event = event
        self.history_size = history_size
        self.cut_short = cut_short


class _RunSystem:
    """The system prompt a run of a file set: the one it replaced (None: it was put first),
    and how many messages were kept then."""

    __slots__ = ("kept", "replaced")

    def __init__(self, replaced, kept):
        self.replaced = replaced
        self.kept = kept


def _drop_unanswered(repaired, prompts_set, *, keep) -> int:
    """At a run's end in a file (the next run's start, or the end): drop the user messages past
    the first ``keep`` that got no answer; the system prompt of each run of which nothing is
    left then goes too, latest first (``prompts_set``, _RunSystems, loses them). Returns how
    many messages went from the front (system prompts that had been put first)."""
    while len(repaired) > keep and repaired[-1]["role"] == "user":
        repaired.pop()
    if not repaired:  # nothing is left: nor any prompt set
        prompts_set.clear()
    removed = 0
    while prompts_set and len(repaired) <= prompts_set[-1].kept:
        undone = prompts_set.pop()
        if undone.replaced is not None:
            repaired[0] = undone.replaced
        else:
            del repaired[0]
            removed += 1
    return removed


def read_session_messages(path) -> list:
    """The conversation recorded in a session file, as a history a provider accepts.

    Lenient: lines that are not JSON, records of other kinds and messages of unknown
    roles or shapes are skipped. User messages that a run left without an answer (it
    failed before one) are dropped at the end; at a later run's ``run_start``, what that
    run's history did not hold (see ``_repair_history``); a system prompt that a later run
    of the file set stands first, and interrupted tool calls are closed, so reading a file
    written from the result gives the same list. A missing file raises FileNotFoundError.
    """
    # Text lines ending at "\n" only, decoded once by the file (json.loads of bytes would
    # sniff each line's encoding): a third faster on a 30 MB session. A byte order mark
    # that an editor put first is not part of the first record.
    with open(path, encoding="utf-8-sig", errors="replace", newline="\n") as lines:
        return _repair_history(_recorded_messages(_session_lines(lines), path))


_decode_json = json.JSONDecoder().decode


def _session_lines(lines):
    """The lines of an open session file. A long line that does not start as a record does
    (the NUL bytes a crash can leave, a gigabyte without a newline) is passed over in pieces:
    only its first piece is given."""
    piece = functools.partial(lines.readline, _SESSION_PIECE_CHARS)  # no frame a line
    for line in iter(piece, ""):
        if line.endswith("\n") or len(line) < _SESSION_PIECE_CHARS:
            yield line
            continue
        pieces = [line] if line.lstrip().startswith("{") else None
        for more in iter(piece, ""):
            if pieces is not None:
                pieces.append(more)
            if more.endswith("\n") or len(more) < _SESSION_PIECE_CHARS:
                break
        yield "".join(pieces) if pieces is not None else line  # its start: said not JSON


def _recorded_messages(lines, path):
    """The messages of the message records among ``lines``, in order, and a ``_RunMark``
    for each meta record of a run's start, end or compression; other lines skipped, each
    said on the ``lich`` logger at DEBUG (a hand edit that broke one is found so)."""
    for number, line in enumerate(lines, 1):
        try:
            record = _decode_json(line)
        except (ValueError, RecursionError):
            if line.strip():
                _log.debug("%s: line %d skipped: it is not JSON", path, number)
            continue
        if type(record) is not dict:
            continue
        kind = record.get("kind")
        if kind == "message":
            message = _clean_message(record.get("message"))
            if message is not None:
                yield message
            else:
                _log.debug("%s: line %d skipped: a message of no known role or shape", path, number)
        elif kind == "meta" and type(record.get("meta")) is dict:
            meta = record["meta"]
            event = meta.get("event")
            if event == "run_start":
                size = meta.get("history_size")
                yield _RunMark("start", history_size=size if type(size) is int and size > 0 else 0)
            elif event in ("run_end", "run_error"):
                yield _RunMark("end", cut_short=event == "run_error"
                               or meta.get("stopped_reason") == "aborted")
            elif event == "compress" and meta.get("summary_chars") != 0:  # 0: it fell back
                yield _RunMark("compress")


def list_sessions(session_dir) -> list:
    """The paths of the session files in ``session_dir``, newest (by modification time) first."""
    session_dir = os.fsdecode(session_dir)  # a bytes path too: the paths are str
    found = []
    try:
        with os.scandir(session_dir) as entries:
            for entry in entries:
                try:
                    if entry.name.endswith(_SESSION_SUFFIX) and entry.is_file():
                        found.append((entry.stat().st_mtime_ns, entry.name))
                except OSError:  # removed meanwhile
                    continue
    except OSError:
        return []
    found.sort(key=lambda found: (found[0], _session_order(found[1])), reverse=True)
    return [os.path.join(session_dir, name) for _, name in found]


def _session_order(name):
    """A session name as a sort key: its stamp, then its counter as a number (-10 after -9)."""
    stamp, _, rest = name.partition("-")
    counter = rest.split("-", 1)[0].split(".", 1)[0]
    # isdecimal, not isdigit: "²" is a digit that int() refuses
    return (stamp, int(counter) if counter.isdecimal() else -1, name)


def resolve_session(session_dir, ref) -> str:
    """The path of the session ``ref`` names: "latest", an exact id, or a unique id prefix.

    Raises SessionNotFound, whose message echoes ``ref`` but never the directory.
    """
    if (not isinstance(ref, str) or not ref or "/" in ref or os.sep in ref or "\\" in ref
            or ".." in ref or "\0" in ref):
        raise SessionNotFound(f"session not found: {ref}")
    paths = list_sessions(session_dir)
    if ref == "latest":
        if not paths:
            raise SessionNotFound(f"session not found: {ref}")
        return paths[0]
    names = {os.path.basename(path): path for path in paths}
    if ref + _SESSION_SUFFIX in names:
        return names[ref + _SESSION_SUFFIX]
    matches = [path for name, path in names.items() if name.startswith(ref)]
    if len(matches) == 1:
        return matches[0]
    if matches:
        raise SessionNotFound(f"ambiguous session id: {ref}")
    raise SessionNotFound(f"session not found: {ref}")


# ============================================================================
# HTTP
# ============================================================================

# The exchanges of providers and of MCP over HTTP: requests sessions of lich's own, a
# whole-exchange clock and a signal that cut the socket, bounded bodies and SSE events.

_CONNECT_TIMEOUT = 10.0            # seconds; capped by the caller's timeout
_SNIPPET_MAX_CHARS = 200           # body excerpt quoted when a response is not what we expect
_BODY_MAX_BYTES = 64 << 20         # a whole answer, streamed or not; a longer one is not an answer
_SSE_MAX_EVENT_BYTES = 32 << 20    # one SSE line or event
_ERROR_BODY_MAX_BYTES = 1 << 20    # an error body: only its start is read
_BODY_READ_BYTES = 64 << 10        # read size for whole bodies and streams without chunks
_WATCH_SECONDS = 0.1               # how often a cut is looked for: a signal is seen this soon
_STREAM_DRAIN_SECONDS = 0.2        # after a stream's end marker: time to read the body's end
_MAX_REDIRECTS = 5                 # same-origin 307/308 redirects followed per request
_ERRNO_TEXT = r"\[Errno -?\d+\] [^'\")]+"
_HTTP_URL = r"(?i)https?://[^/?#\s]"


def _snippet(body):
    """The start of a body to quote in an error, secrets redacted."""
    text = body.decode("utf-8", "replace") if isinstance(body, (bytes, bytearray)) else str(body)
    text = _redact_secrets(text.strip())
    return text[:_SNIPPET_MAX_CHARS] + ("..." if len(text) > _SNIPPET_MAX_CHARS else "")


def _system_error(error):
    """urllib3's error inside ``requests``' error ``error``, and the system's error with an
    errno in it (a reset, a refusal), or None: a server that ended its answer early (a
    short body, a bad chunk) has none."""
    while error.args and isinstance(error.args[0], BaseException):  # requests' wrapping
        error = error.args[0]
    if isinstance(error, OSError) and error.errno:  # a reset, a TLS record that failed
        return error, error
    # urllib3's ("Connection broken: ...", the error)
    cause = error.args[1] if len(error.args) == 2 else error
    return error, cause if isinstance(cause, OSError) and cause.errno else None


def _wrapped_errors(error):
    """``requests``' error ``error`` and those inside it, outermost first (in its arguments,
    or urllib3's ``reason``): a few wrappings deep, never a loop."""
    for _ in range(8):
        if error is None:
            return
        yield error
        inner = getattr(error, "reason", None)
        if not isinstance(inner, BaseException):
            inner = next((a for a in error.args if isinstance(a, BaseException)), None)
        error = inner


def _tunnel_answer(error):
    """The status line a proxy answered ``CONNECT`` with ("403 Forbidden"), from inside
    ``requests``' error ``error`` (http.client's "Tunnel connection failed: ..."), or None."""
    for each in _wrapped_errors(error):
        if len(each.args) == 1 and isinstance(each.args[0], str):
            found = re.match(r"Tunnel connection failed: (\d{3}\b.*)", each.args[0], re.DOTALL)
            if found:
                return found.group(1).strip()
    return None


def _tls_failure(error):
    """The ``ssl.SSLError`` inside ``requests``' error ``error`` (in its arguments, or
    urllib3's ``reason``), or None."""
    import ssl

    return next((each for each in _wrapped_errors(error) if isinstance(each, ssl.SSLError)), None)


def _readable_url(url) -> bool:
    """Whether urllib3 can read ``url`` (a proxy's: an unencoded '#' in a password cannot)."""
    from urllib3.util import parse_url

    try:
        parse_url(url)
    except ValueError:  # urllib3's LocationParseError
        return False
    return True


def _unreachable_reason(error) -> str:
    """Why ``requests`` could not reach a server: its ``[Errno N] text`` when it has one (not
    urllib3's paragraph around it), secrets and URL user-info redacted."""
    import http.client

    error, system = _system_error(error)
    if system is not None:
        error = system
    else:  # urllib3's "Connection aborted." (or its proxy's words) says less than what it holds
        for each in _wrapped_errors(error):
            if isinstance(each, http.client.RemoteDisconnected):
                return "the connection was closed without an answer"
            if isinstance(each, http.client.BadStatusLine):
                return f"an answer that is not HTTP: {_snippet(str(each))!r}"
            if isinstance(each, http.client.LineTooLong):
                return _snippet(str(each))
        if len(error.args) == 2 and isinstance(error.args[0], str):
            error = error.args[0]
    text = _redact_url(_redact_secrets(str(error)))
    found = re.search(_ERRNO_TEXT, text)
    return found.group(0) if found else _snippet(text)


def _drain_stream(chunks, exchange):
    """Read what follows an answer in a stream (the chunked terminator), so that the
    connection can serve the next request; a server that holds it open is cut soon."""
    exchange.draining = True
    exchange.deadline = time.monotonic() + _STREAM_DRAIN_SECONDS
    _watchdog.watch(exchange)
    drained = 0
    try:
        for chunk in chunks:
            drained += len(chunk)
            if drained > _BODY_READ_BYTES or exchange.due():
                break
    except Exception as e:  # cut, reset: the connection is not reused, the answer stands
        _log.debug("the end of a stream was not read: %s", e)


def _arriving_chunks(response):
    """A streamed response's bytes as they arrive, decoded: chunk by chunk, or without
    chunked encoding as each read returns (``iter_content`` would wait for a whole buffer)."""
    raw = response.raw
    if getattr(raw, "chunked", False):
        return response.iter_content(None)
    if hasattr(raw, "read1"):
        return iter(functools.partial(raw.read1, _BODY_READ_BYTES, decode_content=True), b"")
    # urllib3 1.x has no read1, and its read waits for a whole buffer: a stream that pings
    # before its answer would wait for ever. Its _fp (frozen since 1.26) is http.client's
    # response, whose read1 returns what one read brings; an encoded body goes as before.
    fp = getattr(raw, "_fp", None)
    if hasattr(fp, "read1") and response.headers.get("content-encoding", "identity") == "identity":
        return _read1_chunks(fp)
    return response.iter_content(_BODY_READ_BYTES)


def _read1_chunks(fp):
    """The chunks of http.client response ``fp``'s ``read1`` to its end; a broken connection
    is urllib3's ProtocolError, as urllib3's own reads raise it."""
    import socket

    import urllib3

    while True:
        try:
            chunk = fp.read1(_BODY_READ_BYTES)
        except socket.timeout as e:  # requests' read timeout: retryable, as urllib3 says it
            raise urllib3.exceptions.ReadTimeoutError(None, None, "Read timed out.") from e
        except OSError as e:
            raise urllib3.exceptions.ProtocolError(f"Connection broken: {e!r}", e) from e
        if not chunk:
            return
        yield chunk


def _requests():
    """The requests module, imported on first use so that ``import lich`` stays light."""
    requests = sys.modules.get("requests")
    if requests is not None and not getattr(getattr(requests, "__spec__", None),
                                            "_initializing", False):
        return requests  # imported whole: no import lock taken (a microsecond or six a call)
    import importlib

    try:  # Not ``import requests``: a thread that waited on another's import which failed
        # (no file descriptor left, say) got the half-made module from it, and then an
        # AttributeError; import_module imports it again.
        return importlib.import_module("requests")
    except ModuleNotFoundError as e:
        if e.name != "requests":
            raise
        raise ModuleNotFoundError("lich's providers need the requests package: pip install "
                                  "requests", name="requests") from None


def _check_seconds(name, value, *, none=False):
    """A TypeError or ValueError naming ``name`` unless ``value`` is a finite number of
    seconds above 0 (or, with ``none``, None): requests and the clocks take nothing else."""
    if value is None and none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds{' or None' if none else ''}, "
                        f"not {value!r}")
    if not 0 < value < math.inf:  # NaN too
        raise ValueError(f"{name} must be a finite number of seconds above 0, not {value}")


def _timeouts(timeout):
    """``timeout`` (seconds, a (connect, read) pair, or None) as requests' (connect, read)
    pair; a TypeError or ValueError when it is none of these."""
    if isinstance(timeout, tuple):
        if len(timeout) != 2:
            raise ValueError(f"timeout must be seconds or a (connect, read) pair, not {timeout!r}")
        for part in timeout:
            _check_seconds("timeout", part, none=True)
        return timeout
    _check_seconds("timeout", timeout, none=True)
    if timeout is None:
        return (_CONNECT_TIMEOUT, None)
    return (min(_CONNECT_TIMEOUT, timeout), timeout)


def _whole_timeout(timeout):
    """The seconds one whole exchange may take, or None."""
    if isinstance(timeout, tuple):
        return None if None in timeout else sum(timeout)
    return timeout


class _StreamTooLong(Exception):
    """An SSE line, an event or a whole stream larger than its bound."""


def _sse_events(chunks, check, kept=None):
    """Yield (event name or None, data bytes) per Server-Sent Event read from byte chunks.

    Comments are skipped, and ``id:`` and ``retry:`` lines too, but that a dict ``kept``
    gets the last of each (``"id"``, and ``"retry"`` in milliseconds); several ``data:``
    lines are joined with newlines; an ``error:`` line (llama.cpp's) is an ``error`` event
    of its value. ``check()`` runs before each chunk is parsed (it raises to stop).
    """
    pending = []  # pieces of a line whose end has not arrived
    pending_size = total = 0
    event = data = None
    after_cr = False  # the last chunk ended in \r: a \n that begins the next ends no line
    for chunk in chunks:
        check()
        total += len(chunk)
        if total > _BODY_MAX_BYTES:
            raise _StreamTooLong(f"the stream exceeds {_BODY_MAX_BYTES} bytes")
        if after_cr and chunk:
            after_cr = False
            if chunk[:1] == b"\n":
                chunk = chunk[1:]
        if b"\r" in chunk:  # CRLF, or a lone CR, ends a line as LF does (the SSE spec's three)
            after_cr = chunk[-1:] == b"\r"
            chunk = chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        if b"\n" not in chunk:
            pending.append(chunk)
            pending_size += len(chunk)
            if pending_size > _SSE_MAX_EVENT_BYTES:
                raise _StreamTooLong(f"an SSE line exceeds {_SSE_MAX_EVENT_BYTES} bytes")
            continue
        if pending:
            pending.append(chunk)
            chunk = b"".join(pending)
        lines = chunk.split(b"\n")
        last = lines.pop()
        pending = [last] if last else []
        pending_size = len(last)
        for line in lines:
            if not line:
                if data is not None:
                    yield event, bytes(data)
                event = data = None
            elif line[:5] == b"data:":
                value = line[6:] if line[5:6] == b" " else line[5:]
                if data is None:
                    data = value
                else:  # a bytearray grows in place: many data lines cost linear time
                    data = bytearray(data) if isinstance(data, bytes) else data
                    data += b"\n" + value
                    if len(data) > _SSE_MAX_EVENT_BYTES:
                        raise _StreamTooLong(f"an SSE event exceeds {_SSE_MAX_EVENT_BYTES} bytes")
            elif line[:6] == b"event:":
                event = line[6:].strip()
            elif line[:6] == b"error:":  # llama.cpp's own field, its error object: an error event
                event, data = b"error", line[7:] if line[6:7] == b" " else line[6:]
            elif kept is not None and line[:3] == b"id:" and b"\0" not in line:
                kept["id"] = (line[4:] if line[3:4] == b" " else line[3:]).decode("utf-8", "replace")
            elif kept is not None and line[:6] == b"retry:" and line[6:].strip().isdigit() \
                    and len(line) < 16:  # milliseconds: more digits than Python reads is no wait
                kept["retry"] = int(line[6:].strip())
    check()  # a socket cut by the signal or the clock ends the chunks as if the stream ended
    line = b"".join(pending)
    if line[:5] == b"data:":  # a last line without its newline
        value = line[6:] if line[5:6] == b" " else line[5:]
        data = value if data is None else bytes(data) + b"\n" + value
    if data is not None:
        yield event, bytes(data)


def _origin(url) -> str:
    """``scheme://host[:port]`` of ``url``, lower-cased, without user-info or a default port."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    host = (parts.hostname or "").lower()
    if ":" in host:  # IPv6 in its brackets: [::1]:8080 is not [::1:8080]
        host = f"[{host}]"
    scheme = parts.scheme.lower()
    port = f":{parts.port}" if parts.port and parts.port != {"http": 80, "https": 443}.get(scheme) else ""
    return f"{scheme}://{host}{port}"


def _wire_json(value) -> bytes:
    """``value`` as UTF-8 JSON, each lone surrogate (a file name that is not UTF-8, say) made
    U+FFFD: providers refuse a request that escapes one ("no low surrogate in string")."""
    text = json.dumps(value, ensure_ascii=False)
    try:
        return text.encode()
    except UnicodeEncodeError:
        return re.sub("[\ud800-\udfff]", "\ufffd", text).encode()


_EXCHANGE_WAIT_STEP_SECONDS = 0.05  # how soon a wait within an exchange sees it cut
_SOCKET_ATTRIBUTES = ("socket", "fd", "_sock")  # where a wrapper of a socket keeps it


class _Exchange:
    """One HTTP exchange, which the watchdog cuts when its signal is set or its time is up.

    Cutting shuts the socket down, so a thread blocked waiting for headers or body bytes
    wakes at once; ``cut`` then says why ("aborted", "timeout", or what ``cut_now`` was given).
    """

    def __init__(self, signal, seconds):
        self.signal = signal
        self.deadline = None if seconds is None else time.monotonic() + seconds
        self.cut = None
        self.draining = False  # reading past the end of an answer: a cut there costs nothing
        self._sock = None
        self._lock = threading.Lock()
        self._open = True

    def __enter__(self):
        if self.signal is not None or self.deadline is not None:
            _watchdog.watch(self)
        # an exchange begun within another (an MCP server's request answered mid-call) gives
        # the thread back to the outer one when it ends
        self._thread = threading.get_ident()
        self._outer = _exchanges_sending.get(self._thread)
        _exchanges_sending[self._thread] = self
        return self

    def __exit__(self, *exc_info):
        if self._outer is None:
            _exchanges_sending.pop(self._thread, None)
        else:
            _exchanges_sending[self._thread] = self._outer
        with self._lock:
            self._open = False
            self._sock = None
        _watchdog.forget(self)

    def attach(self, sock):
        """The socket the request went out on; cut at once if the exchange already is."""
        with self._lock:
            if self._open:
                self._sock = sock
                if self.cut is not None:
                    self._shutdown()

    def due(self):
        return _cut_reason(self.deadline, self.signal)

    def cut_now(self, reason):
        with self._lock:
            if self._open and self.cut is None:
                self.cut = reason
                self._shutdown()

    def check(self):
        """Raise _Cut when the exchange is (or should be) cut: per chunk, without the watchdog."""
        reason = self.cut or self.due()
        if reason is not None:
            raise _Cut(reason)

    def wait(self, seconds):
        """Wait ``seconds`` between two requests of the exchange; _Cut once it is cut."""
        until = time.monotonic() + seconds
        while True:
            self.check()
            left = until - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(left, _EXCHANGE_WAIT_STEP_SECONDS))

    def _shutdown(self):
        import _socket  # the sockets' own type, which no monkey-patching replaces

        sock = self._sock
        # The socket a wrapper holds: urllib3's TLS inside an HTTPS proxy's TLS (.socket),
        # eventlet's green socket (.fd), gevent's (._sock). A few steps at most, so that an
        # object that answers every name cannot keep the watchdog walking.
        for _ in range(len(_SOCKET_ATTRIBUTES)):
            if sock is None or isinstance(sock, _socket.socket):
                break
            sock = next(filter(None, (getattr(sock, name, None) for name in _SOCKET_ATTRIBUTES)), None)
        if isinstance(sock, _socket.socket):
            try:  # the plain socket's shutdown: an SSL socket's own would unwrap it under a reader
                _socket.socket.shutdown(sock, _socket.SHUT_RDWR)
            except (OSError, TypeError):
                pass


class _Cut(Exception):
    """The exchange was cut: ``args[0]`` is "aborted", "timeout" or another ``cut_now`` reason."""


def _cut_reason(deadline, signal):
    """"aborted" when ``signal`` (an Event or None) is set, "timeout" once the clock has
    passed ``deadline`` (a time or None), else None."""
    if signal is not None and signal.is_set():
        return "aborted"
    return "timeout" if deadline is not None and time.monotonic() >= deadline else None


class _Watchdog:
    """One thread, started when first needed, that cuts the exchanges that are due."""

    def __init__(self):
        self._renew()
        _after_fork(self._renew)

    def _renew(self):
        """No exchange watched. Also what a forked child's watchdog becomes: its copies of
        the parent's exchanges hold the parent's sockets, and cutting one when its time was
        up cut the connection the parent had gone on to use for another request."""
        self._exchanges = set()
        self._cond = threading.Condition()  # a thread of the parent may have held it
        self._pid = None  # the process whose thread it is: a fork starts its own

    def watch(self, exchange):
        _check_fork()
        with self._cond:
            self._exchanges.add(exchange)
            if self._pid != os.getpid():
                try:
                    threading.Thread(target=self._run, name="lich-watchdog", daemon=True).start()
                    self._pid = os.getpid()
                except RuntimeError as e:  # at exit (an atexit handler's first request, 3.12+):
                    if "shutdown" not in str(e):  # unwatched then, requests' own timeouts hold;
                        raise  # but no thread for want of threads is an error, as it was
            self._cond.notify()

    def forget(self, exchange):
        _check_fork()
        with self._cond:
            self._exchanges.discard(exchange)

    def running(self) -> bool:
        """Whether this process has the thread (none could start at exit, on 3.12+)."""
        return self._pid == os.getpid()

    def _run(self):
        while True:
            with self._cond:
                while not self._exchanges:
                    self._cond.wait()
                exchanges = list(self._exchanges)
            for exchange in exchanges:
                reason = exchange.due()
                if reason is not None:
                    exchange.cut_now(reason)
            time.sleep(_WATCH_SECONDS)


_watchdog = _Watchdog()
# thread id -> the exchange that thread is sending. Not a threading.local made at import:
# gevent or eventlet patching threading after lich was imported (as gunicorn's --preload
# does) makes get_ident() tell greenlets apart, but not such a local, and a greenlet's
# request was then cut by another's time limit.
_exchanges_sending = {}


@functools.cache
def _watched_adapter_class():
    """A requests adapter whose connections hand their socket to the thread's exchange.

    urllib3's documented extension points (pool classes and their ``ConnectionCls``) let
    the watchdog reach the socket a request waits on, which nothing in requests exposes.
    """
    requests = _requests()
    from urllib3 import connection, connectionpool

    class Watched:
        sending_unbounded = False

        def _new_conn(self):
            # The socket goes to the exchange once it is connected: a proxy's CONNECT that
            # never answers is cut as a request is (a TLS handshake is not: wrapping the
            # socket detaches the one the exchange holds)
            sock = super()._new_conn()
            exchange = _exchanges_sending.get(threading.get_ident())
            if exchange is not None:
                exchange.attach(sock)
            return sock

        def request(self, *args, **kwargs):
            # urllib3 sends a request under its connect timeout (10 s at most), which a large
            # body on a slow uplink outlasts. A request of an exchange goes out on a socket
            # handed over first, its time bounded by the exchange (the watchdog cuts it, and
            # none is no limit), not by a send timeout.
            exchange = _exchanges_sending.get(threading.get_ident())
            limited = exchange is not None and (exchange.deadline is not None
                                                or exchange.signal is not None)
            if exchange is None or (limited and not _watchdog.running()):
                return super().request(*args, **kwargs)  # unwatched (at exit): urllib3's timeouts hold
            if self.sock is None:
                self.connect()  # under the connect timeout, a proxy's tunnel included
            exchange.attach(self.sock)
            self.sending_unbounded = True
            try:
                return super().request(*args, **kwargs)
            finally:
                self.sending_unbounded = False

        def send(self, data):
            if self.sending_unbounded:  # urllib3 sets the connect timeout again as it begins
                self.sock.settimeout(None)
            return super().send(data)

        def getresponse(self, *args, **kwargs):
            exchange = _exchanges_sending.get(threading.get_ident())
            if exchange is not None:
                exchange.attach(self.sock)
            return super().getresponse(*args, **kwargs)

    class HTTPConnection(Watched, connection.HTTPConnection):
        pass

    class HTTPSConnection(Watched, connection.HTTPSConnection):
        pass

    class HTTPPool(connectionpool.HTTPConnectionPool):
        ConnectionCls = HTTPConnection

    class HTTPSPool(connectionpool.HTTPSConnectionPool):
        ConnectionCls = HTTPSConnection

    class WatchedAdapter(requests.adapters.HTTPAdapter):
        def cert_verify(self, conn, url, verify, cert):
            # requests verifies no certificate for an http:// URL, the TLS of an https://
            # proxy that carries it (a key and the proxy's password with it) included: that
            # one is verified as an https:// URL's proxy is
            proxy = getattr(conn, "proxy", None)
            if verify and proxy is not None and proxy.scheme == "https" and url[:7].lower() == "http://":
                url = "https://" + url[7:]
            return super().cert_verify(conn, url, verify, cert)

        def init_poolmanager(self, *args, **kwargs):
            super().init_poolmanager(*args, **kwargs)
            self.poolmanager.pool_classes_by_scheme = {"http": HTTPPool, "https": HTTPSPool}

        def proxy_manager_for(self, proxy, **proxy_kwargs):
            manager = super().proxy_manager_for(proxy, **proxy_kwargs)
            if not proxy.lower().startswith("socks"):  # SOCKS pools have classes of their own
                manager.pool_classes_by_scheme = {"http": HTTPPool, "https": HTTPSPool}
            return manager

    return WatchedAdapter


@functools.cache
def _session_class():
    """A requests session that sees no redirect target in any response: each 3xx is lich's.

    Even with allow_redirects=False, requests readies the next request of a redirect: it
    reads the whole body, however long, and parses the Location, raising ValueError on one
    that is no URL. With no target it hands the response over as it came.
    """
    class Session(_requests().Session):
        def get_redirect_target(self, response):
            return None

    return Session


# what a session reads from the environment when it is made
_CONNECTION_VARIABLES = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY", "http_proxy",
                         "https_proxy", "all_proxy", "no_proxy", "REQUESTS_CA_BUNDLE",
                         "CURL_CA_BUNDLE")


def _new_http_session(url):
    """A requests session for ``url`` whose proxies and CA bundle are read from the
    environment now, not on every request (which costs requests ~0.25 ms a call)."""
    requests = _requests()
    session = _session_class()()
    adapter = _watched_adapter_class()()
    session.mount("http://", adapter)
    session.mount("https://", adapter)
    session.proxies = requests.utils.get_environ_proxies(url)
    for proxy in session.proxies.values():  # its password, even in a URL requests refuses
        userinfo = re.match(r"(?i)[a-z][a-z0-9+.-]*://(.*)@", proxy)  # ('#' in it: to the last '@')
        if userinfo:  # not the user's name: a word tool results may hold ("administrator")
            from urllib.parse import unquote

            password = userinfo.group(1).partition(":")[2]
            for spelled in {password, unquote(password)}:  # as written, and as sent
                _add_secret(spelled, session)
    session.verify = os.environ.get("REQUESTS_CA_BUNDLE") or os.environ.get("CURL_CA_BUNDLE") or True
    session.trust_env = False
    import http.cookiejar  # its users keep their own: one chat's must not go with another's

    session.cookies.set_policy(http.cookiejar.DefaultCookiePolicy(allowed_domains=[]))
    return session


def _sent_with_cookies(send, url, jar, **options):
    """``send(url, ...)`` (a session's post, get or delete) with the cookies of ``jar``, and
    those the answer sets kept there; the response. ``jar`` None: no cookies of lich's."""
    response = send(url, cookies=jar, **options)
    if jar is not None:
        _requests().cookies.extract_cookies_to_jar(jar, response.request, response.raw)
    return response


class _SessionsOfAThread(dict):
    """origin -> (variables, requests session) of one thread, the least recently used
    first. Those it holds are closed when the thread ends and its locals go, or at exit
    (urllib3 1.x leaves a dropped pool's sockets to the garbage collector, which warns of
    each), but not by a forked child: they are the parent's."""

    def __init__(self):
        super().__init__()
        self.pid = os.getpid()
        self.open = []  # its sessions, for the finalizer, which must not hold the dict
        weakref.finalize(self, _close_http_sessions, self.open, self.pid)  # at exit too


def _close_http_sessions(sessions, pid):
    if os.getpid() == pid:
        for session in sessions:
            session.close()


def _http_session_of_this_thread(local, url):
    """The requests session kept in ``local`` (a ``threading.local``) for the origin of
    ``url`` and the proxy and CA variables as they are now, made on first use and made
    again in a forked child: the parent's pooled connections are not the child's to use
    (two processes on one socket read each other's answers). It keeps no cookies: its users
    keep their own (a session many chats share must not send one chat's to another). A
    thread keeps the sessions of its last _HTTP_ORIGINS_KEPT origins: a worker thread that
    serves a tenant's server each request must not keep a socket open for every one."""
    sessions = getattr(local, "sessions", None)
    if sessions is None or sessions.pid != os.getpid():
        sessions = local.sessions = _SessionsOfAThread()
    try:
        origin = _origin(url)
    except ValueError:  # a port out of range: requests refuses it as it sends, and says so
        origin = url
    variables = tuple(map(os.environ.get, _CONNECTION_VARIABLES))
    made, session = sessions.pop(origin, (None, None))  # put back last: the latest used
    if made != variables:  # new, or the variables changed: the old session's sockets go
        if session is not None:
            _forget_http_session(sessions, session)
        if len(sessions) >= _HTTP_ORIGINS_KEPT:
            _forget_http_session(sessions, sessions.pop(next(iter(sessions)))[1])
        session = _new_http_session(url)
        sessions.open.append(session)
    sessions[origin] = variables, session
    return session


def _forget_http_session(sessions, session):
    session.close()
    sessions.open.remove(session)


# The connections of every chat, per thread: a chat made per request (a web app's, for its
# own on_delta) takes up the connection the last one left open. They keep no cookies (each
# chat keeps its own), so that no chat sends back what a server set for another (another
# user's key).
_chat_connections = threading.local()
_HTTP_ORIGINS_KEPT = 16  # per thread: requests' own pool manager keeps 10 hosts' connections


# ============================================================================
# Providers
# ============================================================================

_OPENAI_BASE_URL = "https://api.openai.com/v1"
# Azure OpenAI takes its key in an ``api-key`` header: its hosts, or its deployments' path
_AZURE_HOSTS = (".openai.azure.com", ".cognitiveservices.azure.com", ".services.ai.azure.com")
_ANTHROPIC_BASE_URL = "https://api.anthropic.com"
_ANTHROPIC_VERSION = "2023-06-01"
_DEFAULT_TIMEOUT = 600             # seconds: the whole exchange, from sending to the last byte
_ANTHROPIC_MAX_TOKENS = 4096       # the Messages API requires an output cap on every request
_ERROR_TEXT_MAX_CHARS = 2000       # provider error text kept in a ProviderError message
_REFUSED_KEPT = 1000               # messages whose refused reasoning a chat remembers, the newest
_SCHEMAS_REFUSED_KEPT = 100        # schemas an AnthropicChat remembers Anthropic refused
_MAX_RETRY_AFTER = 60.0            # run_with_retries: longer server-requested waits are not waited
_RAW_ARGUMENTS_KEY = "_raw_arguments"  # Anthropic input for tool arguments that are not a JSON object
_CACHE_CONTROL = {"type": "ephemeral"}

# --- errors ---

_STOP_REASONS = {
    "end_turn": "stop", "stop_sequence": "stop", "eos": "stop", "eos_token": "stop",
    "tool_use": "tool_calls", "function_call": "tool_calls", "max_tokens": "length",
    "model_context_window_exceeded": "length",
}
_OVERFLOW_CODES = frozenset({"context_length_exceeded", "context_window_exceeded",
                             "request_too_large", "string_above_max_length",
                             "too_many_prompt_tokens", "exceed_context_size_error"})
_OVERFLOW_TEXT = (
    r"(?i)context[ _-]?(?:length|window|size)|prompt (?:is )?too long|input (?:is )?too long"
    r"|maximum (?:context|prompt) length|too many (?:input |prompt )?tokens"
    r"|exceeds? the (?:maximum|max) (?:number of )?(?:input )?tokens|input tokens? exceeds?"
    r"|total length of all messages is too long|reduce the length of the (?:messages|prompt|input)"
    r"|exceeds? (?:the )?context limit|exceeded model token limit"  # Kimi's
    r"|prompt exceeds max(?:imum)? length")  # Zhipu's (open.bigmodel.cn)
# A billing stop said with a 429 or a 5xx (z.ai's 1113, MiniMax's 1008): waiting does not help
_BILLING_TEXT = r"(?i)insufficient[ _](?:account[ _])?(?:balance|quota|credits?|funds)|\brecharge\b"
# each comment ends at its first "-->": a comment that could run on over the next ones made
# a body of many "<!---->" take time doubling with each (a fuzzer's finding)
_HTML_PAGE = r"(?is)(?:<\?xml[^>]*>\s*|<!--(?:[^-]|-(?!->))*-->\s*)*(?:<!doctype html|<html)"
_HEADER_TOKEN = r"[!-~]+\Z"  # printable ASCII without spaces: what an API key can be
_SPEC = r"(?s)\s*([A-Za-z][\w.-]*)\s*:\s*(.*?)(?:@(https?://\S+))?\s*\Z"


def _count(value):
    """A token count from a usage field: an int, or 0 when absent, not a number or negative
    (a negative count would lower a run's total)."""
    if isinstance(value, float) and math.isfinite(value):
        value = int(value)
    return max(value, 0) if isinstance(value, int) and not isinstance(value, bool) else 0


def _normalise_stop(reason):
    if not isinstance(reason, str):
        return None
    reason = reason.lower()
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
    raw = _redact_secrets(body.decode("utf-8", "replace").strip()) if body else ""
    try:
        data = json.loads(raw) if raw[:1] in ("{", "[") else None
    except (ValueError, RecursionError):
        data = None
    text, codes = _error_fields(data)
    if not text:
        text = _page_text(raw) if re.match(_HTML_PAGE, raw) else raw or "(empty body)"
    text = _redact_secrets(text)
    if len(text) > _ERROR_TEXT_MAX_CHARS:
        text = text[:_ERROR_TEXT_MAX_CHARS] + "..."
    return text, codes


_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")


def _page_text(page):
    """What an HTML error page (a proxy's 502) says, in one line: its title, else its text."""
    import html

    # Each search below goes on from where the last ended: a lazy pattern tried at every
    # "<title" or "<script" of a page that never closes them took time growing with the
    # square of the page (a fuzzer's finding: minutes for an error body of 1 MB).
    lowered = page.translate(_ASCII_LOWER)  # as long as the page: its places are the page's
    title = re.search(r"<title[^<>]*>", lowered)
    end = lowered.find("</title", title.end()) if title is not None else -1
    if end >= 0:
        page = page[title.end():end]
    else:  # its text, without the scripts, styles and comments in it
        page = " ".join(_outside_scripts(page, lowered))
    text = " ".join(html.unescape(re.sub(r"<[^<>]*>", " ", page)).split())
    return f"{text[:_SNIPPET_MAX_CHARS]} (an HTML page)" if text else "an HTML page without text"


def _outside_scripts(page, lowered):
    """The pieces of an HTML ``page`` (``lowered``: in lower case) outside its scripts,
    styles and comments; an unclosed one runs to the end."""
    opening = re.compile(r"<(script|style)\b|<!--")
    at = 0
    while True:
        found = opening.search(lowered, at)
        if found is None:
            yield page[at:]
            return
        yield page[at:found.start()]
        closing = lowered.find("-->" if found.group(1) is None else "</" + found.group(1), found.end())
        if closing < 0:
            return
        at = closing + 3 if found.group(1) is None else lowered.find(">", closing) + 1 or len(page)


def _error_fields(data):
    """(text or None, codes) from a parsed error object: OpenAI's, Anthropic's, FastAPI's..."""
    text = None
    codes = ()
    if isinstance(data, list) and len(data) == 1:  # Google's: the error object in an array
        data = data[0]
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
    """(message, kind, retryable, retry_after) for a non-2xx response, per API.md's table;
    the server's ``x-should-retry`` (OpenAI's and Anthropic's, which their SDKs obey) says
    whether a retry may help, when it says so."""
    text, codes = _error_from_wire(body)
    kind, retryable = _status_kind(status, text, codes)
    should_retry = str(headers.get("x-should-retry", "")).strip().lower()
    if should_retry in ("true", "false"):
        retryable = should_retry == "true"
    label = f" ({codes[0]})" if codes else ""
    return f"HTTP {status}{label}: {text}", kind, retryable, _retry_after(headers)


def _status_kind(status, text, codes):
    """(kind, retryable or None for "by kind") of an HTTP status and the error it came with."""
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
            or re.search(_OVERFLOW_TEXT, text) is not None
        kind = "overflow" if overflow else "bad_request"
    elif status >= 500:
        kind = "server"
    else:
        kind = "invalid_response"
    if (status == 429 or status >= 500) and re.search(_BILLING_TEXT, text):
        retryable = False  # a billing stop said in words (z.ai's 1113, MiniMax's 1008)
    return kind, retryable


def _object_kind(text, codes, default):
    """(kind, retryable or None) of an error object that came in a 2xx answer: by its code
    when that is an HTTP status (OpenRouter's, llama.cpp's), else ``default``."""
    if codes and len(codes[0]) == 3 and codes[0].isdecimal() and 400 <= int(codes[0]) < 600:
        return _status_kind(int(codes[0]), text, codes)
    return ("overloaded" if "overloaded_error" in codes else default), None


# --- wire ---


def _assistant_message(text, tool_calls, reasoning=None):
    """The assistant message; with tool calls, the provider's ``reasoning`` ({key: value})
    too, which the provider wants back with them on the next turn."""
    message = {"role": "assistant", "content": text}
    if tool_calls:
        message["tool_calls"] = tool_calls
        if reasoning:
            message.update(reasoning)
    return message


# Structured output for a server that cannot hold its answer to a schema: said in the system prompt
_SCHEMA_INSTRUCTION = ("Answer with one JSON value and nothing else (no prose, no code fence), "
                       "valid under this JSON Schema: ")


class _HTTPChat:
    """What OpenAIChat and AnthropicChat share: keys, sessions, the HTTP exchange, errors,
    the stream reader and the request body assembled from messages encoded once."""

    provider = ""
    key_env = ""   # the environment variable holding the API key
    url_env = ""
    public_url = ""
    _path = ""
    _base_has_v1 = False  # whether a base URL holds /v1 (OpenAI's SDK) or not (Anthropic's)
    _reasoning_keys = ()  # the assistant message's keys for the reasoning this provider wants back
    _reasoning_refusal = ""  # what a 400 says when a server will not take that reasoning
    _format_refusal = ""  # what a 400 says when a server cannot hold an answer to a schema

    def __init__(self, model, *, api_key, base_url, timeout, stream, on_delta, session,
                 extra_body):
        self.model = model
        if base_url is not None and not isinstance(base_url, str):
            raise TypeError(f"base_url must be a string, not {type(base_url).__name__}")
        self.base_url = (base_url or os.environ.get(self.url_env) or self.public_url).rstrip("/")
        if not re.match(_HTTP_URL, self.base_url):
            raise ValueError(f"base_url must be an http:// or https:// URL, not "
                             f"{_redact_url(self.base_url)!r}")
        try:  # "http://[::1" passes that match, and no request can be made of it
            _host_of(self.base_url)
        except ValueError as e:
            raise ValueError(f"base_url must be an http:// or https:// URL, not "
                             f"{_redact_url(self.base_url)!r}: {e}") from e
        self.timeout = timeout
        self.stream = stream
        _refuse_async(on_delta, "on_delta")
        self.on_delta = on_delta
        if extra_body is not None and not isinstance(extra_body, dict):
            raise TypeError(f"extra_body must be a dict, not {type(extra_body).__name__}")
        self.extra_body = extra_body
        self._key_given = bool(api_key)
        self._api_key = api_key
        self._session = session
        self._setup()

    def _setup(self):
        """What is derived from the options; run again when unpickled."""
        # Surrounding whitespace is a copy-paste accident (a CRLF .env file): dropped. A key
        # still holding a space, control or non-ASCII character cannot go into a header: it
        # is refused before requests sees it, whose error would quote the header, key and all.
        key = (self._api_key if self._key_given else os.environ.get(self.key_env)) or ""
        self._api_key = key.strip() or None
        if self._api_key:
            _add_secret(self._api_key, self)
        _add_url_secrets(self.base_url, self)
        self._key_unsendable = self._api_key is not None and not re.match(_HEADER_TOKEN, self._api_key)
        self._local = threading.local()  # per thread: the last request's encoding
        self._cookies = None  # what servers set for this chat (a load balancer's affinity)
        base, question, query = self.base_url.partition("?")  # Azure's ?api-version=...
        self._url = base.rstrip("/") + self._path + question + query
        self._shown_url = _redact_url(self._url)
        self._timeouts = _timeouts(self.timeout)
        self._headers = self._wire_headers()
        # id -> message whose reasoning this server refused (held, so that the id stays its)
        self._refused = {}
        self._format_refused = False  # this model or server has no structured output
        self._schemas_refused = set()  # the JSON of schemas it refused, the others may go

    def __getstate__(self):
        state = {k: v for k, v in self.__dict__.items()
                 if k in ("model", "base_url", "timeout", "stream", "on_delta", "extra_body",
                          "max_tokens", "cache", "_key_given")}
        state["_api_key"] = self._api_key if self._key_given else None  # the other side's own
        state["_session"] = None  # sockets stay in this process
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._setup()

    def __repr__(self):
        return (f"{type(self).__name__}(model={self.model!r}, "
                f"base_url={_redact_url(self.base_url)!r}, stream={self.stream!r})")

    def __call__(self, messages, *, tools=None, temperature=None, max_tokens=None, signal=None,
                 response_format=None):
        """Send one chat request; returns a ChatResult or raises ProviderError / AbortError.

        A server that refuses the reasoning kept in the history (another server's, after a
        failover or a resume) is asked again without it: when that answers, those messages
        go to it without their reasoning from then on, and its own keep theirs."""
        options = {"tools": tools, "temperature": temperature, "max_tokens": max_tokens,
                   "signal": signal, "response_format": response_format}
        try:
            return self._ask(messages, **options)
        except ProviderError as e:
            refused = e
            if e.kind != "bad_request" or not re.search(self._reasoning_refusal, str(e)):
                raise
        fresh = {id(m): m for m in messages if isinstance(m, dict) and m.get("tool_calls")
                 and any(key in m for key in self._reasoning_keys) and self._refused.get(id(m)) is not m}
        if not fresh:
            raise refused
        kept = list(self._refused.items())[-_REFUSED_KEPT:]
        self._refused = {**dict(kept), **fresh}
        try:
            return self._ask(messages, **options)
        except BaseException as e:  # not answered: these marks go (another thread's stay)
            self._refused = {k: m for k, m in self._refused.items() if fresh.get(k) is not m}
            if isinstance(e, ProviderError) and e.kind == "bad_request":
                raise refused from None  # the first answer says what is wrong with the history
            raise

    def _structured(self, messages, response_format, options, send):
        """``send(messages, response_format, options)`` with the structured output this
        server takes: a ``response_format`` until a 400 refuses it (that schema only, when
        the 400 names the schema), then the schema as an instruction in the system prompt."""
        if response_format is None:
            return send(messages, None, options)
        schema = json.dumps(response_format["schema"], ensure_ascii=False)
        if (not self._format_refused and schema not in self._schemas_refused
                and self._format_field not in (self.extra_body or {})  # extra_body's replaces it
                and self._takes_schema(response_format["schema"])):
            try:
                return send(messages, response_format, options)
            except ProviderError as e:
                if e.kind != "bad_request" or not re.search(self._format_refusal, str(e)):
                    raise
                if re.search(r"(?i)\bschema\b|recursive", str(e)):  # this schema's keywords or depth
                    if len(self._schemas_refused) >= _SCHEMAS_REFUSED_KEPT:
                        self._schemas_refused.clear()
                    self._schemas_refused.add(schema)
                else:
                    self._format_refused = True
        return send(self._instructed(messages, _SCHEMA_INSTRUCTION + schema), None, options)

    _format_field = "response_format"  # the body's field that holds a schema

    def _takes_schema(self, schema):
        return True

    def _sends_reasoning(self, message):
        """Whether ``message``'s reasoning goes to this server (it did not refuse it)."""
        return self._refused.get(id(message)) is not message

    def _ask(self, messages, *, tools, temperature, max_tokens, signal, response_format):
        if signal is not None and signal.is_set():
            raise AbortError("chat aborted before sending")
        if self._api_key is None and self._key_required():
            raise self._error(f"no API key for {_redact_url(self.base_url)}: set {self.key_env}",
                              "auth")
        if self._key_unsendable:  # named as the key came: a command-line user has no api_key=
            raise self._error(f"the API key holds a space, a control or a non-ASCII character, "
                              f"which an HTTP header cannot carry: check "
                              f"{'api_key' if self._key_given else self.key_env} for stray "
                              f"characters", "auth")
        body = self._request_body(messages, tools, temperature, max_tokens, response_format)
        with _Exchange(signal, _whole_timeout(self.timeout)) as exchange:
            try:
                response = self._send(body, exchange)
                try:
                    if self.stream and not response.headers.get(
                            "content-type", "").startswith("application/json"):
                        return self._stream_result(response, exchange)
                    result = self._whole_result(response, exchange)
                finally:
                    response.close()
            except _Cut as cut:
                raise self._cut_error(cut.args[0]) from None
        if self.stream and self.on_delta is not None and result.message["content"]:
            # a server that ignored stream=true
            _refuse_coroutine(self.on_delta(result.message["content"]), "on_delta")
        return result

    # -- the HTTP exchange --

    def _http(self):
        if self._session is not None:  # the caller's: theirs to keep apart across a fork
            return self._session
        return _http_session_of_this_thread(_chat_connections, self._url)

    def _cookie_jar(self):
        """This chat's cookies, which go with its requests only (the session it shares with
        the other chats of its thread keeps none); None with a session of the caller's."""
        if self._session is not None:
            return None
        if self._cookies is None:
            self._cookies = _requests().cookies.RequestsCookieJar()
        return self._cookies

    def _send(self, body, exchange):
        """POST ``body``; the response once its headers are in, or a ProviderError."""
        requests = _requests()
        url = self._url
        _log.debug("%s: POST %s model=%s stream=%s", self.provider, self._shown_url, self.model,
                   self.stream)
        for _ in range(_MAX_REDIRECTS + 1):
            try:
                # stream=True even for a whole answer: control returns after the headers
                response = _sent_with_cookies(self._http().post, url, self._cookie_jar(),
                                              data=body, headers=self._headers,
                                              timeout=self._timeouts, stream=True,
                                              allow_redirects=False)
            except (requests.RequestException, OSError, ValueError) as e:
                failure = e
            else:
                failure = None
            if failure is not None:
                # Raised here, not in the handler, so that nothing is chained to it: requests'
                # error quotes the URL whole, a key in its query too, and a traceback or any
                # logger's exception() shows what an error holds (its message says why).
                raise self._send_error(failure, exchange)
            status = response.status_code
            if 200 <= status < 300:
                return response
            if status in (301, 302, 303, 307, 308) and response.headers.get("location"):
                from urllib.parse import urljoin

                response.close()
                try:
                    target = urljoin(url, response.headers["location"])
                    origin = _origin(target)
                except ValueError as e:  # "http://[::1", a port past 65535
                    raise self._error(f"HTTP {status}: redirected to a Location that is no URL "
                                      f"({_redact_secrets(str(e))})", "invalid_response",
                                      status=status) from None
                if origin != _origin(url):  # a key must not follow the conversation
                    raise self._error(f"HTTP {status}: redirected to another origin, "
                                      f"{_redact_url(origin)}, which lich does not "
                                      f"follow; set the base URL to where the API is",
                                      "not_found", status=status)
                if status in (307, 308):
                    url = target
                    continue
                raise self._error(f"HTTP {status}: redirected to {_redact_url(target)}; set the "
                                  f"base URL to where the API is", "not_found", status=status)
            try:
                content = self._read_body(response, _ERROR_BODY_MAX_BYTES, exchange)
            except requests.RequestException:
                content = b""
            finally:
                response.close()
            message, kind, retryable, retry_after = _classify_http_error(
                status, content, response.headers)
            if status == 407:  # a proxy's, for an http:// server (an https:// one's: CONNECT's)
                message += " (the proxy asks for credentials: give them in its URL)"
            elif url[:7].lower() == "http://" and content.lstrip()[:1] not in (b"{", b"["):
                proxy = self._proxy()  # no API's answer: likely the proxy's own page (a 403)
                if proxy:
                    message += f" (through the proxy {_redact_url(_redact_secrets(proxy))})"
            if (status == 404 and "model" not in message.lower()  # a route, not a model, unfound
                    and self.base_url.partition("?")[0].endswith("/v1") != self._base_has_v1):
                message += (" (an OpenAI-compatible base URL most often ends in /v1)"
                            if self._base_has_v1 else " (an Anthropic base URL leaves /v1 out)")
            raise self._error(message, kind, status=status, retryable=retryable,
                              retry_after=retry_after)
        raise self._error(f"more than {_MAX_REDIRECTS} redirects", "not_found")

    def _read_body(self, response, limit, exchange):
        """At most ``limit`` bytes of the body (all of it when shorter)."""
        parts, size = [], 0
        for chunk in response.iter_content(_BODY_READ_BYTES):
            exchange.check()
            parts.append(chunk)
            size += len(chunk)
            if size >= limit:
                break
        return b"".join(parts)[:limit]

    def _whole_result(self, response, exchange):
        try:
            content = self._read_body(response, _BODY_MAX_BYTES + 1, exchange)
        except _requests().RequestException as e:
            exchange.check()
            raise self._transport_error(e, streaming=False, reading=True) from e
        exchange.check()
        if len(content) > _BODY_MAX_BYTES:
            raise self._invalid(f"body larger than {_BODY_MAX_BYTES} bytes", content[:100])
        try:
            data = _json_of(content)
        except (ValueError, RecursionError):  # nested too deeply: a hostile body
            raise self._invalid("body is not JSON", content) from None
        try:
            if not isinstance(data, dict):
                raise TypeError(f"the body is {_json_kind(data)}, not an object")
            return self._from_wire(data)
        except (KeyError, IndexError, TypeError, AttributeError, ValueError) as e:
            raise self._invalid(f"unexpected JSON shape ({type(e).__name__}: {e})",
                                content) from e

    def _stream_result(self, response, exchange):
        """The ChatResult of a streamed answer, ``on_delta`` called with each text piece."""
        requests = _requests()
        import urllib3

        chunks = _arriving_chunks(response)
        # The start of a body that does not say it is a stream, quoted when it holds no event:
        # a proxy's login page, or a plain-text error sent with 200.
        start = bytearray()

        def kept(chunks):
            for chunk in chunks:
                if len(start) < _SNIPPET_MAX_CHARS:
                    start.extend(chunk[:_SNIPPET_MAX_CHARS])
                yield chunk

        if not response.headers.get("content-type", "").startswith("text/event-stream"):
            chunks = kept(chunks)  # a stream says what it is: only another body is looked at

        shown = []
        on_delta = self.on_delta
        if on_delta is not None:
            def on_delta(text, show=self.on_delta):
                answer = show(text)
                if answer is not False:  # False: it was not shown (a piped CLI's)
                    _refuse_coroutine(answer, "on_delta")
                    shown.append(True)
        broken = (requests.RequestException, urllib3.exceptions.HTTPError)
        try:
            try:
                result = self._read_stream(_sse_events(chunks, exchange.check), on_delta, start,
                                           broken)
            except broken as e:
                exchange.check()
                raise self._transport_error(e, streaming=True) from e
            except _StreamTooLong as e:
                raise self._error(f"invalid response: {e}", "invalid_response") from e
        except (ProviderError, _Cut) as e:
            if not shown:
                raise
            # Another try would show that text twice. A cut (the clock of the whole exchange)
            # becomes its error here, to be marked so.
            error = self._cut_error(e.args[0]) if isinstance(e, _Cut) else e
            if isinstance(error, ProviderError):
                error.retryable = False
                error.after_output = True
            if error is e:
                raise
            raise error from None
        _drain_stream(chunks, exchange)
        return result

    def _read_stream(self, events, on_delta, start, broken):
        """Assemble a ChatResult from SSE events with the dialect's ``_Stream``; ``start``
        is the body's start, quoted when it held no event. An exception of ``broken`` (the
        connection's) after the answer's stop reason ends it."""
        state = self._Stream(self)
        parts = []
        held = ""  # a high surrogate that ended an event: its pair's other half comes next
        heard = False
        events = iter(events)
        while True:
            try:
                event, data = next(events)
            except StopIteration:
                break
            except broken:
                if _stream_whole(state):  # a break after the answer's stop reason: it is whole
                    break
                raise
            heard = True
            if data == b"[DONE]":  # OpenAI's end; in another dialect's stream, an early one
                # unless the answer's stop reason came: gateways end Anthropic streams so too
                state.done = state.end_marker == "[DONE]" or state.stop is not None
                break
            try:
                payload = _json_of(data)
            except (ValueError, RecursionError):
                raise self._invalid("SSE data is not JSON", data) from None
            if not isinstance(payload, dict):
                raise self._invalid("SSE data is not a JSON object", data)
            try:
                text = state.feed(event, payload)
            except (KeyError, IndexError, TypeError, AttributeError, ValueError) as e:
                raise self._invalid(f"unexpected event shape ({type(e).__name__}: {e})",
                                    data) from e
            if text and (held or "\ud800" <= text[-1] <= "\udfff"):
                text = _paired_surrogates(held + text)
                held = text[-1] if "\ud800" <= text[-1] <= "\udbff" else ""
                text = text[:-1] if held else text
            if text:
                parts.append(text)
                if on_delta is not None:
                    on_delta(text)
            if state.done:
                break
        if held:
            parts.append(held)
            if on_delta is not None:
                on_delta(held)
        if not _stream_whole(state):
            if not heard and start.strip():
                raise self._invalid("the body is no event stream", start)
            raise self._error(f"invalid response: stream ended before {state.end_marker}",
                              "invalid_response")
        return ChatResult(message=_assistant_message("".join(parts), state.calls(),
                                                     state.reasoning()),
                          usage=state.usage, model=self._answered_model(state.model),
                          stop_reason=_normalise_stop(state.stop))

    def _answered_model(self, model):
        """The model an answer names; the one asked for when it names none (or names it
        with a number or an object, which ChatResult.model may not be)."""
        return model if isinstance(model, str) and model else self.model

    # -- the request body, from messages encoded once --

    def _request_body(self, messages, tools, temperature, max_tokens, response_format) -> bytes:
        """The JSON request body. Each message is converted and encoded once per thread: a
        later request reuses the bytes of every message it shares with the last one (same
        object, same content and tool calls), so a turn costs the same at turn 200 as at 2."""
        local = self._local
        last_messages = getattr(local, "encoded", ())
        if getattr(local, "refused", None) is not self._refused:  # reasoning refused since:
            last_messages, local.refused = (), self._refused  # everything is encoded anew
        parts = []
        known = None
        for i, message in enumerate(messages):
            if i < len(last_messages) and last_messages[i][0] is message:
                entry = last_messages[i]
            else:  # not where it was last time: compression, or a history the caller changed
                if known is None:
                    known = {id(e[0]): e for e in last_messages}
                entry = known.get(id(message))
            if (entry is None or entry[0] is not message or entry[1] is not message.get("content")
                    or entry[2] is not message.get("tool_calls")):
                entry = (message, message.get("content"), message.get("tool_calls"),
                         self._encode_message(message))
            parts.append(entry)
        local.encoded = parts
        fields = {"model": self.model, **self._assemble(parts),
                  **self._body_fields(tools, temperature, max_tokens, response_format)}
        for key, value in (self.extra_body or {}).items():  # None takes a field away
            if value is None:
                fields.pop(key, None)
            else:
                fields[key] = value
        return b"{" + b",".join(_wire_json(k) + b":" + (v if isinstance(v, bytes) else _wire_json(v))
                                for k, v in fields.items()) + b"}"

    def _encoded_tools(self, tools):
        """The tools' JSON, encoded once per list of specs."""
        cached = getattr(self._local, "tools", None)
        if cached is None or cached[0] is not tools:
            cached = self._local.tools = (tools, _wire_json(self._tools_to_wire(tools)))
        return cached[1]

    # -- errors --

    def _error(self, message, kind, **fields):
        # what came from outside (bodies, exception texts) is redacted where it enters
        return ProviderError(f"{self.provider}: {_writable(message)}", kind, provider=self.provider,
                             **fields)

    def _invalid(self, reason, body):
        return self._error(f"invalid response: {reason}: {_snippet(body)!r}", "invalid_response")

    def _cut_error(self, reason):
        if reason == "aborted":
            return AbortError("chat aborted")
        return self._error(f"timed out: no whole answer within {self.timeout}s from "
                           f"{self._shown_url}", "timeout")

    def _send_error(self, e, exchange):
        """The ProviderError (or _Cut) of an exception requests raised as the request went."""
        if isinstance(e, _requests().RequestException):
            exchange.check()
            return self._transport_error(e, streaming=False)
        if isinstance(e, OSError):  # requests' own: a CA bundle that is not there
            return self._error(f"cannot reach {self._shown_url}: {_redact_secrets(str(e))}",
                               "network", retryable=False)
        # a session of the caller's: as on a redirect's bad Location
        return self._error(f"requests raised ValueError on the answer: "
                           f"{_redact_url(_redact_secrets(str(e)))}", "invalid_response")

    def _transport_error(self, e, *, streaming, reading=False):
        requests = _requests()
        from urllib3.exceptions import ReadTimeoutError
        cause = e.args[0] if e.args else None
        if isinstance(e, (requests.Timeout, ReadTimeoutError)) or isinstance(cause, ReadTimeoutError):
            return self._error(f"timed out ({self._timeouts[0]}s connect, {self._timeouts[1]}s "
                               f"read) on {self._shown_url}", "timeout")
        if not (streaming or reading):  # the server, or the proxy, was not reached
            return self._unreached_error(e)
        reason = _unreachable_reason(e)
        if streaming:  # a reset is the network's; a server that ends early, its answer's fault
            return self._error(f"stream broke off before its end: {reason}",
                               "network" if _system_error(e)[1] else "invalid_response")
        return self._error(f"the answer from {self._shown_url} broke off: {reason}", "network")

    def _proxy(self):
        """The URL of the proxy a request goes through, or None."""
        requests = _requests()
        session = self._http()  # a caller's may read the variables as it sends
        proxies = session.proxies or (requests.utils.get_environ_proxies(self._url)
                                      if session.trust_env else {})
        return requests.utils.select_proxy(self._url, proxies)

    def _unreached_error(self, e):
        """The ProviderError of a request that did not reach the server (or whose server said
        nothing): not retryable for what no retry mends (a certificate not trusted, a proxy's
        407 or other refusal, a URL requests cannot read), the proxy named when it went
        through one (a proxy that closes after its 200 to CONNECT looks like the server)."""
        requests = _requests()
        proxy = self._proxy()
        shown = f"the proxy {_redact_url(_redact_secrets(proxy))}" if proxy else "its proxy"
        tls = _tls_failure(e)
        through = f" through {shown}" if proxy else ""
        where = f" ({shown})" if isinstance(e, requests.exceptions.ProxyError) else through
        if tls is not None:
            import ssl

            words = (getattr(tls, "verify_message", None) or getattr(tls, "strerror", None)
                     or str(tls))  # urllib3 1.x's own name check has only its str
            words = _redact_secrets(re.sub(r" \(_ssl\.c:\d+\)$", "", words))
            if isinstance(tls, ssl.SSLCertVerificationError):  # no retry makes it trusted
                hint = (" (a private CA: set REQUESTS_CA_BUNDLE to its file)"
                        if re.search(r"issuer|self.signed", words) else "")
                return self._error(f"cannot reach {self._shown_url}{where}: certificate verify "
                                   f"failed: {words}{hint}", "network", retryable=False)
            return self._error(f"cannot reach {self._shown_url}{where}: {words}", "network")
        if isinstance(e, requests.exceptions.ProxyError):
            if re.search(r"Tunnel connection failed: 407|\b407 Proxy Authentication", str(e)):
                return self._error(f"{shown} asks for credentials (HTTP 407 "
                                   f"Proxy Authentication Required): give them in its URL",
                                   "bad_request", status=407, retryable=False)
            # Its answer to CONNECT: no retry mends a refusal (403, a port it does not tunnel
            # to); its 408 or 429 may pass, and a 5xx says the server behind it is down, as a
            # connection refused would.
            answer = _tunnel_answer(e)
            status = int(answer[:3]) if answer else None
            if status is not None and 400 <= status < 500 and status not in (408, 429):
                return self._error(f"{shown} refused to connect to {self._shown_url} (HTTP "
                                   f"{_snippet(answer)})", "bad_request", status=status,
                                   retryable=False)
            if status is not None:
                return self._error(f"cannot reach {self._shown_url} through {shown}: it "
                                   f"answered HTTP {_snippet(answer)}", "network", status=status)
            return self._error(f"cannot reach {self._shown_url} through {shown}: "
                               f"{_unreachable_reason(e)}", "network")
        if isinstance(e, (requests.exceptions.InvalidURL, requests.exceptions.InvalidSchema)):
            # A proxy variable's URL (an unencoded '#' in a password), whose words may quote
            # the password; a SOCKS proxy without PySocks; a base URL requests cannot read
            why = _unreachable_reason(e)
            if proxy and not _readable_url(proxy):
                why = ("the URL of its proxy cannot be read (a '#', '@' or '/' in a password "
                       "must be %-encoded)")
            elif "@" in why:  # a URL with credentials that lich cannot tell apart: not shown
                why = "a URL requests cannot read (the server's, or its proxy's)"
            return self._error(f"cannot reach {self._shown_url}: {why}", "bad_request",
                               retryable=False)
        return self._error(f"cannot reach {self._shown_url}{through}: {_unreachable_reason(e)}",
                           "network")

    def _body_error(self, payload, where):
        """ProviderError for an error object inside a 2xx body or stream: the payload's
        ``error``, or the payload itself (llama.cpp's ``error:`` line holds it bare)."""
        text, codes = _error_fields(payload)
        if not codes and not isinstance(payload.get("error"), (dict, str)):
            codes = tuple(str(payload[k]) for k in ("code", "type") if payload.get(k) is not None)
        text = _redact_secrets(text) if text else _snippet(json.dumps(payload, ensure_ascii=False))
        kind, retryable = _object_kind(text, codes, "invalid_response")
        label = f" ({codes[0]})" if codes else ""
        return self._error(f"error {where}{label}: {text}", kind, retryable=retryable)

    # -- what each provider defines --
    # _Stream: a class reading one streamed answer, feed(event, payload) -> text or None;
    # _key_required(), _wire_headers(), _encode_message(message), _tools_to_wire(tools);
    # _body_fields(tools, temperature, max_tokens, response_format): the body's fields besides
    # model and messages, bytes values being JSON already; _assemble(encoded): the fields made
    # of the messages, from their (message, content, tool_calls, encoding) entries;
    # _from_wire(data): the ChatResult of a whole answer.


def _json_of(data: bytes):
    """``json.loads`` of a body or event; a byte that is not UTF-8 becomes U+FFFD rather
    than losing the whole answer."""
    try:
        return json.loads(data)
    except UnicodeDecodeError:
        return json.loads(data.decode("utf-8", "replace"))


def _stream_whole(state) -> bool:
    """Whether a dialect's stream state holds a whole answer: its end marker came, or the
    answer's stop reason (OpenAI's finish chunk, Anthropic's message_delta), after which
    some servers and proxies end the stream without the marker."""
    return state.done or state.stop is not None


def _paired_surrogates(text):
    """``text`` with each pair of surrogates made the one character it encodes (JSON spells
    an emoji as two escapes, which a stream may split between events); a lone one stays."""
    if text.isascii():
        return text
    return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "surrogatepass")


def _content_text(content):
    """The text of a message content: a string, or the text parts of a list of typed parts
    (thinking and reasoning parts left out); None when absent."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text") or "" for part in content
                       if isinstance(part, dict) and part.get("type", "text") == "text")
    raise TypeError(f"message content is {_json_kind(content)}")


_NAME_ALPHABET = re.compile(r"[A-Za-z0-9_-]+\Z")


_TOOL_NAME_MAX_CHARS = 64  # what providers take, of the alphabet _in_name_alphabet keeps


def _sha256(text) -> bytes:
    """The SHA-256 of ``text`` (lone surrogates included), for names and ids made from it."""
    import hashlib

    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()


def _in_name_alphabet(text, max_chars=None):
    """``text`` as providers take a tool's name or a call's id (only ``[A-Za-z0-9_-]``, at
    most ``max_chars``): as it is when it fits, else its other characters made '_', cut,
    and a digest of the whole added, so that two texts never become one."""
    if _NAME_ALPHABET.match(text) and (max_chars is None or len(text) <= max_chars):
        return text
    digest = _sha256(text).hex()[:8]
    kept = re.sub(r"[^A-Za-z0-9_-]", "_", text)
    return (kept if max_chars is None else kept[:max_chars - len(digest) - 1]) + "_" + digest


def _tool_input(arguments):
    """A ToolCall's raw arguments text as the JSON object a provider takes back in the
    history: arguments that are not one (cut at the output limit, say) are kept, for the
    model to see its mistake, as ``{"_raw_arguments": text}``. A provider that got them
    back as they were would refuse the whole history, for good (Ollama, Anthropic)."""
    if not arguments or not arguments.strip():
        return {}
    try:
        value = _strict_json(arguments)  # {"a": 1e999} would go as {"a": Infinity}: no JSON
    except (ValueError, RecursionError):
        value = None
    if isinstance(value, dict):
        return value
    return {_RAW_ARGUMENTS_KEY: arguments}


def _wire_tool_name(name):
    """A tool call's name as providers take it back in the history: a model's mistaken name
    (``functions.read_file``) in their alphabet, or they refuse the whole history."""
    return _in_name_alphabet(name, _TOOL_NAME_MAX_CHARS) if isinstance(name, str) and name else "_"


def _wire_parameters(schema):
    """A tool's parameters as providers take them. Anthropic refuses an ``anyOf``, ``oneOf``
    or ``allOf`` at a schema's top ("input_schema does not support oneOf, allOf, or anyOf at
    the top level"), and OpenAI too, which MCP servers list (Notion's, GitLab's): one such
    tool failed every request. It goes as one object of every branch's properties (the
    first schema of a name), requiring what every branch requires (all of ``allOf``'s);
    the server checks the arguments it gets as ever."""
    if not isinstance(schema, dict) or not schema:
        return {"type": "object", "properties": {}}
    combined = [key for key in ("anyOf", "oneOf", "allOf") if isinstance(schema.get(key), list)]
    if not combined:
        return schema

    def names(value):  # a "required" as a server may list it: only a list of names counts
        return [name for name in value if isinstance(name, str)] if isinstance(value, list) else []

    defs = {}
    for key in ("definitions", "$defs"):
        if isinstance(schema.get(key), dict):
            defs[key] = schema[key]
    properties = dict(schema["properties"]) if isinstance(schema.get("properties"), dict) else {}
    required = names(schema.get("required"))
    for key in combined:
        wanted = None
        for branch in schema[key]:
            ref = branch.get("$ref") if isinstance(branch, dict) else None
            if isinstance(ref, str):  # "#/$defs/name" alone: a path further in is not read
                found = re.fullmatch(r"#/(\$defs|definitions)/([^/]+)", ref)
                branch = defs.get(found.group(1), {}).get(found.group(2)) if found else None
            if not isinstance(branch, dict):  # unread: of anyOf or oneOf, it may require
                wanted = [] if key != "allOf" else wanted  # nothing; of allOf, its own are lost
                continue
            if isinstance(branch.get("properties"), dict):
                for name, value in branch["properties"].items():
                    properties.setdefault(name, value)
            needs = names(branch.get("required"))
            wanted = needs if wanted is None else (wanted + needs if key == "allOf"
                                                    else [n for n in wanted if n in needs])
        required = list(dict.fromkeys(required + (wanted or [])))
    flat = {"type": "object", **{key: value for key, value in schema.items() if key not in (
        "anyOf", "oneOf", "allOf", "type", "properties", "required", "additionalProperties")},
        "properties": properties}
    if required:
        flat["required"] = required
    return flat


# --- OpenAI ---


def _openai_usage(usage) -> dict:
    """lich's usage from an OpenAI ``usage`` object; cached and reasoning counts when reported."""
    counts = {"input_tokens": _count(usage.get("prompt_tokens")),
              "output_tokens": _count(usage.get("completion_tokens"))}
    for details, key, ours in (("prompt_tokens_details", "cached_tokens", "cache_read_tokens"),
                               ("completion_tokens_details", "reasoning_tokens", "reasoning_tokens")):
        found = usage.get(details)
        if isinstance(found, dict) and key in found and found[key] is not None:
            counts[ours] = _count(found[key])
    return counts


_NO_ANSWER = "(no answer)"  # what an empty answer says on the wire


def _is_azure(url):
    """Whether ``url`` is Azure OpenAI's: one of its hosts, or a deployment's path."""
    from urllib.parse import urlsplit

    parts = urlsplit(url or "")
    return ((parts.hostname or "").endswith(_AZURE_HOSTS)  # urlsplit lower-cases the host
            or "/openai/deployments/" in parts.path.lower())


_MISTRAL_ID_CHARS = 9
_MISTRAL_ID = rf"[A-Za-z0-9]{{{_MISTRAL_ID_CHARS}}}"  # the tool call ids Mistral's API takes
_OPENAI_ID_MAX_CHARS = 40  # OpenAI's: "string_above_max_length" past it


def _host_of(url):
    from urllib.parse import urlsplit

    return urlsplit(url or "").hostname or ""  # lower-cased


def _mistral_call_id(call_id):
    """The letters and digits Mistral takes, made from ``call_id``: the same for a call and
    its result."""
    digest = int.from_bytes(_sha256(call_id), "big")
    alphabet = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
    letters = []
    for _ in range(_MISTRAL_ID_CHARS):
        digest, index = divmod(digest, 62)
        letters.append(alphabet[index])
    return "".join(letters)


def _openai_call(call_id, name, arguments, extra_content):
    """A ToolCall; with the ``extra_content`` a server attached to it (Gemini's thought
    signature, which it wants back with the call on the next turn)."""
    call = {"id": call_id, "name": name, "arguments": arguments}
    if isinstance(extra_content, dict):
        call["extra_content"] = extra_content
    return call


def _openai_reasoning(thought, details):
    """The reasoning an OpenAI-compatible server wants back with its tool calls: DeepSeek's
    ``reasoning_content``, OpenRouter's ``reasoning_details`` (as they came), or None."""
    reasoning = {}
    if isinstance(thought, str) and thought:
        reasoning["reasoning_content"] = thought
    if isinstance(details, list) and details:
        reasoning["reasoning_details"] = details
    return reasoning or None


_JOINED_DETAIL_FIELDS = ("text", "summary", "data")


class _Pieces(list):
    """The pieces of one text of a streamed reasoning item, joined once the stream ends
    (a list the server sent stays a list)."""


def _join_reasoning_details(items, pieces):
    """Add a stream's ``reasoning_details`` pieces to ``items``: a piece of the item that
    came last (the same index and type) has its texts joined to it, as OpenRouter's stream
    spells one item over many chunks; its other fields are the latest that were given."""
    for piece in pieces:
        if not isinstance(piece, dict):
            continue
        last = items[-1] if items else None
        if last is None or (last.get("index"), last.get("type")) != (piece.get("index"), piece.get("type")):
            items.append({key: _Pieces([value]) if key in _JOINED_DETAIL_FIELDS and isinstance(value, str)
                          else value for key, value in piece.items()})
            continue
        for key, value in piece.items():
            if key in _JOINED_DETAIL_FIELDS and isinstance(value, str):
                if isinstance(last.get(key), _Pieces):
                    last[key].append(value)
                else:
                    last[key] = _Pieces([value])
            elif value is not None or key not in last:
                last[key] = value


def _choice_error(chat, choice, beside=None):
    """The ProviderError of a choice that failed mid-generation, or None: OpenRouter answers
    200 and then says so with ``finish_reason: "error"`` and an ``error`` in the choice, or
    ``beside`` it (the chunk's or body's own ``error``)."""
    if choice.get("finish_reason") != "error" and not isinstance(choice.get("error"), dict):
        return None
    if not isinstance(choice.get("error"), dict) and isinstance(beside, dict):
        choice = {**choice, "error": beside}
    text, codes = _error_fields(choice)
    label = f" ({codes[0]})" if codes else ""
    kind, retryable = _object_kind(text or "", codes, "server")
    return chat._error(f"the answer failed mid-generation{label}: "
                       f"{_redact_secrets(text) if text else 'no reason given'}", kind,
                       retryable=retryable)


class _OpenAIStream:
    """The state of one streamed Chat Completions answer."""

    end_marker = "[DONE]"

    def __init__(self, chat):
        self.chat = chat
        self.done = False
        self.model = self.stop = None
        self.usage = _zero_usage()
        # index (or id for index-less calls) -> [id, name, [argument fragments], extra_content]
        self.slots = {}
        self.moved = {}  # index -> the key of its newest slot, when a new call reused the index
        self.thoughts = []  # reasoning_content pieces
        self.details = []  # reasoning_details items, each of the pieces that came joined

    def feed(self, event, chunk):
        for choice in chunk.get("choices") or ():  # an error that ended the answer: its kind
            failure = _choice_error(self.chat, choice, chunk.get("error"))
            if failure is not None and choice.get("index", 0) == 0:
                raise failure
        if event == b"error" or chunk.get("error"):
            raise self.chat._body_error(chunk, "event in stream")
        if self.model is None:
            self.model = chunk.get("model")
        text = None
        for choice in chunk.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta")
            if delta:
                text = _content_text(delta.get("content"))
                refusal = delta.get("refusal")
                if not text and isinstance(refusal, str):  # what the model said, as unstreamed
                    text = refusal
                thought = delta.get("reasoning_content")
                if isinstance(thought, str):
                    self.thoughts.append(thought)
                if isinstance(delta.get("reasoning_details"), list):
                    _join_reasoning_details(self.details, delta["reasoning_details"])
                if delta.get("tool_calls"):
                    self._add_calls(delta["tool_calls"])
            if choice.get("finish_reason"):
                self.stop = choice["finish_reason"]
        usage = chunk.get("usage") or (chunk.get("x_groq") or {}).get("usage")
        if isinstance(usage, dict):
            self.usage = _openai_usage(usage)
        return text

    def _add_calls(self, calls):
        for call in calls:
            function = call.get("function") or {}
            if not all(isinstance(v, str) for v in (call.get("id") or "", function.get("name") or "")):
                raise TypeError("a tool call id or name that is not a string")
            key = call.get("index")
            if key is None:  # Mistral sends whole calls without an index
                key = ("id", call["id"]) if call.get("id") else ("position", len(self.slots))
            key = self.moved.get(key, key)
            slot = self.slots.get(key)
            if (slot is not None and call.get("id") and slot[0] and call["id"] != slot[0]
                    and function.get("name")):
                # Ollama numbers every call 0: a new id and name at an index in use begin a
                # new call (a server that changes only the id within a call goes on with it)
                key = self.moved[call.get("index")] = ("again", len(self.slots))
                slot = None
            if slot is None:  # its id and name may come in a later delta (no order is
                # promised); a call that never gets a name fails at the end
                slot = self.slots[key] = [None, None, [], None]
            if call.get("id") and not slot[0]:
                slot[0] = call["id"]
            if isinstance(call.get("extra_content"), dict):
                slot[3] = call["extra_content"]
            if function.get("name") and not slot[1]:
                slot[1] = function["name"]
            arguments = function.get("arguments")
            if arguments:
                if not isinstance(arguments, str):
                    arguments = json.dumps(arguments, ensure_ascii=False)
                slot[2].append(arguments)

    def reasoning(self):
        thought = _paired_surrogates("".join(self.thoughts))  # an emoji split between events
        for item in self.details:
            for key, pieces in item.items():
                if isinstance(pieces, _Pieces):
                    item[key] = _paired_surrogates("".join(pieces))
        return _openai_reasoning(thought, self.details)

    def calls(self):
        calls = []
        for i, (call_id, name, fragments, extra) in enumerate(self.slots.values()):
            if not name:
                raise self.chat._error(f"invalid response: streamed tool call {i} has no name",
                                       "invalid_response")
            arguments = _paired_surrogates("".join(fragments))  # an emoji split between events
            calls.append(_openai_call(call_id or f"call_{i}", name, arguments or "{}", extra))
        return calls


class OpenAIChat(_HTTPChat):
    """A ChatFn over OpenAI Chat Completions, and so over any OpenAI-compatible server.

    The base URL includes ``/v1`` (default ``OPENAI_BASE_URL`` or OpenAI's); the key comes
    from ``api_key`` or ``OPENAI_API_KEY``, and without one no Authorization header is sent.
    ``extra_body`` is merged last into every request body.
    """

    provider = "openai"
    key_env = "OPENAI_API_KEY"
    url_env = "OPENAI_BASE_URL"
    public_url = _OPENAI_BASE_URL
    _path = "/chat/completions"
    _base_has_v1 = True
    _Stream = _OpenAIStream
    # DeepSeek's thinking; OpenRouter's reasoning items (Gemini's signatures among them)
    _reasoning_keys = ("reasoning_content", "reasoning_details")
    _reasoning_refusal = (r"(?i)reasoning_(content|details)\W.{0,80}\b(unsupported|not (permitted|"
                          r"allowed|supported)|unknown|unrecognized|extra|unexpected)|\b(unsupported|"
                          r"unknown|unrecognized|extra|additional propert\w+ are not allowed)\b"
                          r".{0,80}\Wreasoning_(content|details)")
    _format_refusal = r"(?i)response_format|json_schema|structured output"

    def __init__(self, model, *, api_key=None, base_url=None, timeout=_DEFAULT_TIMEOUT,
                 stream=False, on_delta=None, session=None, extra_body=None):
        super().__init__(model, api_key=api_key, base_url=base_url, timeout=timeout,
                         stream=stream, on_delta=on_delta, session=session, extra_body=extra_body)

    def __call__(self, messages, *, tools=None, temperature=None, max_tokens=None, signal=None,
                 response_format=None):
        """Send one chat request (see ``_HTTPChat.__call__``). A server that refuses
        ``stream_options`` (older Azure API versions, some proxies) is asked again without
        it, and from then on: its streamed answers then come without usage counts. One that
        refuses a ``json_schema`` response format (DeepSeek's) gets the schema in the system
        prompt instead, from then on."""
        options = {"tools": tools, "temperature": temperature, "max_tokens": max_tokens,
                   "signal": signal}
        return self._structured(messages, response_format, options, self._counting_usage)

    def _counting_usage(self, messages, response_format, options):
        """The answer, with usage counts in a stream where the server takes stream_options."""
        options = {**options, "response_format": response_format}
        try:
            return super().__call__(messages, **options)
        except ProviderError as e:
            if not (self.stream and not self._usage_refused and e.kind == "bad_request"
                    and "stream_options" in str(e)):
                raise
            refusal = e
        self._usage_refused = True
        try:
            answer = super().__call__(messages, **options)
        except BaseException as e:  # not answered without them: they stay asked for
            self._usage_refused = False
            if isinstance(e, ProviderError) and e.kind == "bad_request":  # not about them
                raise refusal from None
            raise
        _log.info("%s refuses stream_options; streaming without usage counts", self._shown_url)
        return answer

    def _setup(self):
        self._usage_refused = False  # the server refused stream_options: asked without it
        host = _host_of(self.base_url)
        # OpenAI's API, also at its data-residency hosts (eu.api.openai.com, us., jp. ...)
        self._openai_itself = host == "api.openai.com" or host.endswith(".api.openai.com")
        # The rule of this server for tool call ids: Mistral's 9 letters and digits, OpenAI's
        # (and Azure's) 40 characters at most; others take any. These servers also get no
        # extra_content back (Gemini's, after a failover); others may be Gemini behind a
        # gateway, which wants it.
        self._id_rule = ("mistral" if host == "mistral.ai" or host.endswith(".mistral.ai") else
                         "openai" if self._openai_itself or _is_azure(self.base_url) else None)
        self._sends_extra_content = self._id_rule is None
        super()._setup()

    def _key_required(self):
        return self._openai_itself

    def _instructed(self, messages, instruction):
        """``messages`` with ``instruction`` ending the leading system prompt (a chat template
        may refuse a system message anywhere else)."""
        if messages and messages[0].get("role") == "system":
            first, content = messages[0], messages[0].get("content")
            content = ([*content, {"type": "text", "text": instruction}] if isinstance(content, list)
                       else f"{content}\n\n{instruction}" if content else instruction)
            return [{**first, "content": content}, *messages[1:]]
        return [{"role": "system", "content": instruction}, *messages]

    def _wire_headers(self):
        headers = {"Content-Type": "application/json"}
        if self._api_key and _is_azure(self.base_url):
            headers["api-key"] = self._api_key
        elif self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        return headers

    def _encode_message(self, m):
        role = m["role"]
        if role == "tool":
            wire = {"role": "tool", "tool_call_id": self._wire_call_id(m["tool_call_id"]),
                    "content": m.get("content") or ""}
        elif role == "assistant" and m.get("tool_calls"):
            wire = {"role": "assistant", "content": m.get("content") or None,
                    "tool_calls": [self._call_to_wire(c) for c in m["tool_calls"]]}
            if self._sends_reasoning(m):  # DeepSeek's thinking wants it, OpenRouter's Gemini too
                if isinstance(m.get("reasoning_content"), str):
                    wire["reasoning_content"] = m["reasoning_content"]
                if isinstance(m.get("reasoning_details"), list):
                    wire["reasoning_details"] = m["reasoning_details"]
        elif role == "assistant" and not (m.get("content") or "").strip():
            # An answer of nothing: Mistral refuses it, for good, and leaving it out would set
            # two user messages side by side, which strict chat templates refuse.
            wire = {"role": "assistant", "content": _NO_ANSWER}
        else:
            wire = {"role": role, "content": m.get("content") or ""}
        return _wire_json(wire)

    def _wire_call_id(self, call_id):
        """A call's id as this server takes it (``_id_rule``): another provider's id, after a
        failover or a resume, or one lich made up, may not fit Mistral's or OpenAI's rule."""
        if not isinstance(call_id, str):
            return call_id
        if self._id_rule == "mistral" and not re.fullmatch(_MISTRAL_ID, call_id):
            return _mistral_call_id(call_id)
        if self._id_rule == "openai" and len(call_id) > _OPENAI_ID_MAX_CHARS:
            return _in_name_alphabet(call_id, _OPENAI_ID_MAX_CHARS)
        return call_id

    def _call_to_wire(self, call):
        arguments = call.get("arguments") or ""
        as_object = _tool_input(arguments)
        if not arguments.strip():
            arguments = "{}"
        elif as_object.get(_RAW_ARGUMENTS_KEY) is arguments:  # not a JSON object: sent wrapped
            arguments = json.dumps(as_object, ensure_ascii=False)
        wire = {"id": self._wire_call_id(call["id"]), "type": "function",
                "function": {"name": _wire_tool_name(call["name"]), "arguments": arguments}}
        if isinstance(call.get("extra_content"), dict) and self._sends_extra_content:
            wire["extra_content"] = call["extra_content"]
        return wire

    def _assemble(self, encoded):
        return {"messages": b"[" + b",".join(entry[3] for entry in encoded) + b"]"}

    def _tools_to_wire(self, tools):
        return [{"type": "function", "function": {
            "name": t["name"], "description": t.get("description") or "",
            "parameters": _wire_parameters(t.get("parameters"))}} for t in tools]

    def _body_fields(self, tools, temperature, max_tokens, response_format):
        fields = {}
        if tools:
            fields["tools"] = self._encoded_tools(tools)
        if temperature is not None:
            fields["temperature"] = temperature
        if max_tokens is not None:
            # OpenAI's newer models refuse the deprecated max_tokens; other servers may not
            # know max_completion_tokens yet.
            fields["max_completion_tokens" if self._openai_itself else "max_tokens"] = max_tokens
        if response_format is not None:
            fields["response_format"] = {"type": "json_schema", "json_schema": {
                "name": response_format["name"], "schema": response_format["schema"]}}
        if self.stream:
            fields["stream"] = True
            if not self._usage_refused:
                fields["stream_options"] = {"include_usage": True}
        return fields

    def _from_wire(self, data):
        if "choices" not in data and data.get("error"):
            raise self._body_error(data, "in a 2xx body")
        choices = data["choices"]
        choice = next((c for c in choices if c.get("index", 0) == 0), choices[0])
        failure = _choice_error(self, choice, data.get("error"))
        if failure is not None:
            raise failure
        message = choice["message"]
        content = _content_text(message.get("content"))
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
            calls.append(_openai_call(call_id if isinstance(call_id, str) and call_id else f"call_{i}",
                                      name, arguments or "{}", call.get("extra_content")))
        reasoning = _openai_reasoning(message.get("reasoning_content"), message.get("reasoning_details"))
        usage = data.get("usage") or (data.get("x_groq") or {}).get("usage")
        return ChatResult(message=_assistant_message(content, calls, reasoning),
                          usage=_openai_usage(usage) if isinstance(usage, dict) else _zero_usage(),
                          model=self._answered_model(data.get("model")),
                          stop_reason=_normalise_stop(choice.get("finish_reason")))


# --- Anthropic ---


_EMPTY_USER_MESSAGE = "(empty message)"  # what a user's message of nothing says to Anthropic
_EMPTY_ERROR_RESULT = "(the tool failed without output)"  # and a failed tool's result of nothing
# a tool the history called, defined for a request given none (Anthropic wants it defined)
_NOT_OFFERED_NOW = "Not offered now: do not call it. Its earlier calls are in the conversation."


def _anthropic_tool_id(call_id):
    """A call's id as Anthropic accepts it: another provider's ``functions.add:0`` becomes
    ``functions_add_0_`` and a digest, the same for the call and its result."""
    return _in_name_alphabet(call_id) if isinstance(call_id, str) else call_id


def _closed_objects(schema):
    """``schema`` with ``additionalProperties: false`` on every object that does not say:
    Anthropic's structured output requires it."""
    if isinstance(schema, list):
        return [_closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {k: _closed_objects(v) if k in ("items", "anyOf", "allOf", "oneOf", "not",
                                             "additionalProperties") else v
              for k, v in schema.items()}
    for named in ("properties", "$defs", "definitions"):  # maps of name -> schema
        if isinstance(schema.get(named), dict):
            closed[named] = {k: _closed_objects(v) for k, v in schema[named].items()}
    kinds = schema.get("type")
    if (kinds == "object" or (isinstance(kinds, list) and "object" in kinds)) \
            and "additionalProperties" not in schema:
        closed["additionalProperties"] = False
    return closed


def _lists_its_properties(schema) -> bool:
    """Whether every object of ``schema`` that does not say what else it allows lists its
    properties: closed as Anthropic's structured output requires, one listing none could
    only be ``{}``, so such a schema goes in the system prompt instead."""
    if isinstance(schema, list):
        return all(map(_lists_its_properties, schema))
    if not isinstance(schema, dict):
        return True
    kinds = schema.get("type")
    if ((kinds == "object" or (isinstance(kinds, list) and "object" in kinds))
            and not schema.get("properties") and "additionalProperties" not in schema):
        return False
    return all(map(_lists_its_properties, schema.values()))


def _anthropic_usage(usage, into):
    """Update ``into`` from an Anthropic usage object: the input counts the cached tokens too.
    Later events of a stream repeat the counts so far: they replace, not add."""
    if not isinstance(usage, dict):
        return
    cached = ("cache_read_tokens", "cache_write_tokens")
    uncached = into.get("input_tokens", 0) - sum(into.get(k, 0) for k in cached)
    if usage.get("input_tokens") is not None:  # null: not said in this event (the SDK's
        uncached = _count(usage["input_tokens"])  # MessageDeltaUsage has them optional)
    if usage.get("output_tokens") is not None:
        into["output_tokens"] = _count(usage["output_tokens"])
    for theirs, ours in (("cache_read_input_tokens", "cache_read_tokens"),
                         ("cache_creation_input_tokens", "cache_write_tokens")):
        if usage.get(theirs) is not None:
            into[ours] = _count(usage[theirs])
    if any(usage.get(k) is not None for k in ("input_tokens", "cache_creation_input_tokens",
                                              "cache_read_input_tokens")):  # an event that
        # leaves a count out keeps the last
        into["input_tokens"] = uncached + sum(into.get(k, 0) for k in cached)
    details = usage.get("output_tokens_details")
    if isinstance(details, dict) and details.get("thinking_tokens") is not None:
        into["reasoning_tokens"] = _count(details["thinking_tokens"])


_THINKING_BLOCKS = ("thinking", "redacted_thinking")


def _thinking_block(block):
    """A thinking block as it must go back to Anthropic: its text (or data) and signature."""
    if block["type"] == "redacted_thinking":
        return {"type": "redacted_thinking", "data": _content_text(block.get("data")) or ""}
    return {"type": "thinking", "thinking": _content_text(block.get("thinking")) or "",
            "signature": _content_text(block.get("signature")) or ""}


class _AnthropicStream:
    """The state of one streamed Messages answer."""

    end_marker = "message_stop"

    def __init__(self, chat):
        self.chat = chat
        self.done = False
        self.model = self.stop = None
        self.usage = _zero_usage()
        self.blocks = {}  # index -> None (text, thinking, ...) or [id, name, [json fragments], input]
        # index -> a thinking or redacted_thinking block, its texts as lists of the pieces
        # that came, joined at the end: adding each piece to a string copied it every time
        self.thinking = {}

    def feed(self, event, payload):
        kind = "error" if event == b"error" else (
            payload.get("type") or (event.decode("utf-8", "replace") if event else None))
        if kind == "content_block_delta":
            index = payload["index"]
            if index not in self.blocks:
                raise ValueError(f"a delta for content block {index!r} that was never started")
            delta = payload["delta"]
            if delta.get("type") == "text_delta":
                return _content_text(delta["text"])
            block = self.thinking.get(index)
            if delta.get("type") == "thinking_delta" and block is not None:
                block["thinking"].append(_content_text(delta["thinking"]) or "")
            elif delta.get("type") == "signature_delta" and block is not None:
                block["signature"].append(_content_text(delta["signature"]) or "")
            if delta.get("type") == "input_json_delta" and self.blocks[index] is not None:
                fragment = delta["partial_json"]
                if not isinstance(fragment, str):
                    raise TypeError("partial_json is not a string")
                self.blocks[index][2].append(fragment)
        elif kind == "content_block_start":
            block = payload["content_block"]
            if block["type"] == "tool_use":
                if not (isinstance(block["id"], str) and isinstance(block["name"], str)):
                    raise TypeError("tool_use block without a string id and name")
                self.blocks[payload["index"]] = [block["id"], block["name"], [], block.get("input")]
            else:
                self.blocks[payload["index"]] = None
                if block["type"] == "text":
                    return _content_text(block.get("text"))
                if block["type"] in _THINKING_BLOCKS:
                    self.thinking[payload["index"]] = {
                        key: value if key == "type" else [value]
                        for key, value in _thinking_block(block).items()}
        elif kind == "message_start":
            message = payload["message"]
            self.model = message.get("model")
            _anthropic_usage(message.get("usage"), self.usage)
        elif kind == "message_delta":
            self.stop = (payload.get("delta") or {}).get("stop_reason") or self.stop
            _anthropic_usage(payload.get("usage"), self.usage)
        elif kind == "message_stop":
            self.done = True
        elif kind == "error":
            raise self.chat._body_error(payload, "event in stream")
        # ping, content_block_stop and unknown events carry nothing we need
        return None

    def reasoning(self):
        if not self.thinking:
            return None
        return {"thinking": [{key: value if key == "type" else _paired_surrogates("".join(value))
                              for key, value in block.items()} for block in self.thinking.values()]}

    def calls(self):
        calls = []
        for block in self.blocks.values():
            if block is not None:
                call_id, name, fragments, start_input = block
                arguments = _paired_surrogates("".join(fragments))  # an emoji split between events
                if not arguments.strip():
                    arguments = json.dumps(start_input or {}, ensure_ascii=False)
                calls.append({"id": call_id, "name": name, "arguments": arguments})
        return calls


class AnthropicChat(_HTTPChat):
    """A ChatFn over Anthropic's Messages API.

    The base URL excludes ``/v1`` (default ``ANTHROPIC_BASE_URL`` or Anthropic's); the key
    comes from ``api_key`` or ``ANTHROPIC_API_KEY`` and is always required. ``max_tokens``
    is the output cap sent when a call gives none. With ``cache`` (the default) the tools,
    the system prompt and the newest message carry ``cache_control`` breakpoints, so each
    turn reads the turns before it from Anthropic's prompt cache. A ``response_format`` is
    sent as ``output_config.format``; a model or server that refuses it gets the schema in
    the system prompt instead, from then on (only that schema, when the refusal names it).
    """

    provider = "anthropic"
    key_env = "ANTHROPIC_API_KEY"
    url_env = "ANTHROPIC_BASE_URL"
    public_url = _ANTHROPIC_BASE_URL
    _path = "/v1/messages"
    _Stream = _AnthropicStream
    _reasoning_keys = ("thinking",)
    # another key's or endpoint's signature, or a server that knows no thinking blocks
    _reasoning_refusal = r"(?i)\binvalid\W+(signature|data)\b|input tag\W+(redacted_)?thinking\b"
    _format_refusal = (r"(?i)output_config|output_format|structured output|schema is too complex"
                       r"|recursive definitions")
    _format_field = "output_config"

    def __init__(self, model, *, api_key=None, base_url=None, timeout=_DEFAULT_TIMEOUT,
                 stream=False, on_delta=None, session=None, max_tokens=_ANTHROPIC_MAX_TOKENS,
                 cache=True, extra_body=None):
        self.max_tokens = max_tokens
        self.cache = cache
        super().__init__(model, api_key=api_key, base_url=base_url, timeout=timeout,
                         stream=stream, on_delta=on_delta, session=session, extra_body=extra_body)

    def __call__(self, messages, *, tools=None, temperature=None, max_tokens=None, signal=None,
                 response_format=None):
        """Send one chat request (see ``_HTTPChat.__call__``). Structured output goes as
        Anthropic's ``output_config``; where this model refuses it, as an instruction."""
        options = {"tools": tools, "temperature": temperature, "max_tokens": max_tokens,
                   "signal": signal}
        return self._structured(messages, response_format, options, self._asked)

    def _asked(self, messages, response_format, options):
        if not options["tools"]:
            # Anthropic refuses a history with tool calls in a request that defines no tools
            # (a resumed run given none): the tools it called are defined, as not offered now
            named = sorted({_wire_tool_name(call.get("name")) for m in messages
                            if m.get("role") == "assistant" for call in m.get("tool_calls") or ()})
            if named:
                options = {**options, "tools": [
                    {"name": name, "description": _NOT_OFFERED_NOW,
                     "parameters": {"type": "object", "properties": {}}} for name in named]}
        return super().__call__(messages, response_format=response_format, **options)

    def _takes_schema(self, schema):
        return _lists_its_properties(schema)

    def _instructed(self, messages, instruction):
        return [*messages, {"role": "system", "content": instruction}]  # joined to the system

    def _key_required(self):
        return True  # Anthropic's API always wants one (API.md), local proxies included

    def _wire_headers(self):
        headers = {"Content-Type": "application/json", "anthropic-version": _ANTHROPIC_VERSION}
        if self._api_key:
            headers["x-api-key"] = self._api_key
        return headers

    def _encode_message(self, m):
        """(role, [(block, its JSON)], the JSON of the content as one string or None)."""
        role = m["role"]
        content = m.get("content") or ""
        if role == "system":
            return role, content, None
        if role == "tool":
            role, failed = "user", bool(m.get("is_error"))
            # Anthropic refuses an error result of no content (lich's own are JSON: a history
            # built elsewhere, or a failover's, may hold one)
            blocks = [{"type": "tool_result", "tool_use_id": _anthropic_tool_id(m["tool_call_id"]),
                       "content": content or (_EMPTY_ERROR_RESULT if failed else ""),
                       "is_error": failed}]
        else:
            # Anthropic refuses a text of whitespace: an assistant's is left out, and a user's
            # says it was empty (left out, the assistant's last message would be a prefill)
            if role == "user" and not content.strip():
                content = _EMPTY_USER_MESSAGE
            blocks = [{"type": "text", "text": content}] if content.strip() else []
            if (role == "assistant" and m.get("tool_calls") and isinstance(m.get("thinking"), list)
                    and self._sends_reasoning(m)):
                # extended thinking wants a tool call's thinking back, first and as it was
                blocks[:0] = [b for b in m["thinking"] if isinstance(b, dict)
                              and b.get("type") in _THINKING_BLOCKS]
            for call in m.get("tool_calls") or () if role == "assistant" else ():
                blocks.append({"type": "tool_use", "id": _anthropic_tool_id(call["id"]),
                               "name": _wire_tool_name(call["name"]),
                               "input": _tool_input(call.get("arguments"))})
        as_text = _wire_json(content) if len(blocks) == 1 and blocks[0]["type"] == "text" else None
        return role, [(block, _wire_json(block)) for block in blocks], as_text

    def _assemble(self, encoded):
        # The turns before the newest one are kept, encoded, from the last request (per
        # thread): a history that only grew re-encodes its newest turn and what is new, so a
        # request costs the same at turn 200 as at 2. Any other change encodes it all again.
        kept = getattr(self._local, "turns", None)
        # Kept: the entries up to the newest turn's first (which must stay, or the turns
        # would group otherwise), the system texts and the encoded turns before it.
        if (kept is not None and len(encoded) >= len(kept[0])
                and all(map(operator.is_, kept[0], encoded))):
            checked, system, wire = kept
            start = len(checked) - 1
        else:
            start, system, wire = 0, [], []
        new_system = []  # (index, text) of the system messages after what is kept
        turns = []  # [role, first index, [entries]]: consecutive messages of one role make one turn
        for i in range(start, len(encoded)):
            entry = encoded[i]
            role, blocks, _ = entry[3]
            if role == "system":
                if blocks:
                    new_system.append((i, blocks))
            elif blocks:  # Anthropic refuses empty messages
                if turns and turns[-1][0] == role:
                    turns[-1][2].append(entry)  # the API wants roles to alternate
                else:
                    turns.append([role, i, [entry]])
        wire = [*wire, *(self._turn(role, [entry[3] for entry in entries],
                                    self.cache and n == len(turns) - 1)  # the cache breakpoint
                         for n, (role, _, entries) in enumerate(turns))]
        system = [*system, *(text for _, text in new_system)]
        if turns:  # next time, everything before the newest turn is known
            start = turns[-1][1]
            self._local.turns = (encoded[:start + 1], system[:len(system) - sum(
                i >= start for i, _ in new_system)], wire[:-1])
        fields = {}
        if system:
            text = "\n\n".join(system)
            fields["system"] = ([{"type": "text", "text": text, "cache_control": _CACHE_CONTROL}]
                                if self.cache else text)
        fields["messages"] = b"[" + b",".join(wire) + b"]"
        return fields

    @staticmethod
    def _turn(role, parts, newest):
        """The JSON of one turn: the messages of one role, one after another."""
        if len(parts) == 1 and parts[0][2] is not None and not newest:
            content = parts[0][2]
        else:
            blocks = [b for part in parts for b in part[1]]
            if role == "user":  # tool results must lead a user turn
                blocks.sort(key=lambda b: b[0]["type"] != "tool_result")
            encoded_blocks = [b[1] for b in blocks]
            if newest:
                encoded_blocks[-1] = _wire_json({**blocks[-1][0], "cache_control": _CACHE_CONTROL})
            content = b"[" + b",".join(encoded_blocks) + b"]"
        return b'{"role":' + _wire_json(role) + b',"content":' + content + b"}"

    def _tools_to_wire(self, tools):
        wire = [{"name": t["name"], "description": t.get("description") or "",
                 "input_schema": _wire_parameters(t.get("parameters"))} for t in tools]
        if self.cache and wire:
            wire[-1]["cache_control"] = _CACHE_CONTROL
        return wire

    def _body_fields(self, tools, temperature, max_tokens, response_format):
        fields = {"max_tokens": self.max_tokens if max_tokens is None else max_tokens}
        if tools:
            fields["tools"] = self._encoded_tools(tools)
        if temperature is not None:
            fields["temperature"] = temperature
        if response_format is not None:
            fields["output_config"] = {"format": {
                "type": "json_schema", "schema": _closed_objects(response_format["schema"])}}
        if self.stream:
            fields["stream"] = True
        return fields

    def _from_wire(self, data):
        if data.get("type") == "error":
            raise self._body_error(data, "in a 2xx body")
        texts = []
        calls = []
        thinking = []
        for block in data["content"]:
            kind = block["type"]
            if kind in _THINKING_BLOCKS:
                thinking.append(_thinking_block(block))
            elif kind == "text":
                if not isinstance(block["text"], str):
                    raise TypeError("text block without a string")
                texts.append(block["text"])
            elif kind == "tool_use":
                if not (isinstance(block["id"], str) and isinstance(block["name"], str)):
                    raise TypeError("tool_use block without a string id and name")
                calls.append({"id": block["id"], "name": block["name"],
                              "arguments": json.dumps(block.get("input") or {},
                                                      ensure_ascii=False)})
            # server tool blocks are not answer text
        usage = _zero_usage()
        _anthropic_usage(data.get("usage"), usage)
        return ChatResult(message=_assistant_message("".join(texts), calls,
                                                     {"thinking": thinking} if thinking else None),
                          usage=usage,
                          model=self._answered_model(data.get("model")),
                          stop_reason=_normalise_stop(data.get("stop_reason")))


_PROVIDERS = {"anthropic": AnthropicChat, "openai": OpenAIChat}
_PROVIDER_KEY_ENVS = frozenset(cls.key_env for cls in _PROVIDERS.values())
_PROVIDER_URL_ENVS = frozenset(cls.url_env for cls in _PROVIDERS.values())

# --- retries, Router, Limiter, chat_from_spec ---


def _backoff_delay(attempt, base_delay, max_delay):
    """Exponential backoff for retry ``attempt`` (0-based) with jitter, within [cap/2, cap]."""
    import random

    cap = min(max_delay, base_delay * (2 ** attempt))
    return cap * (0.5 + random.random() / 2)


def run_with_retries(fn, *, retries=4, base_delay=1.0, max_delay=30.0,
                     max_retry_after=_MAX_RETRY_AFTER, signal=None, on_retry=None):
    """Call ``fn()``, retrying retryable ProviderErrors with backoff; waits end on ``signal``.

    ``on_retry(error, attempt, delay)`` is called before each wait (``attempt`` from 1).
    (A stream that broke off after it had shown text raises a ProviderError that is not
    retryable: a new answer would repeat that text.)
    """
    _refuse_async(on_retry, "on_retry")
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
            if on_retry is not None:
                _refuse_coroutine(on_retry(e, attempt, delay), "on_retry")
            if signal is None:
                time.sleep(delay)
            elif signal.wait(delay):
                raise AbortError("aborted while waiting to retry") from e


class Router:
    """A ChatFn that tries each ChatFn in turn, each through ``run_with_retries``.

    It moves on after any ProviderError except ``bad_request`` and ``overflow`` (which the
    next provider would refuse too) or a stream that broke off after showing text (the
    next answer would repeat it), stops at once when the signal is set, and raises the
    last error when every provider failed. ``on_retry(error, attempt, delay)`` is called
    before each retry's wait, ``on_failover(error, index)`` when it moves to ``chats[index]``.
    """

    _FINAL_KINDS = frozenset({"bad_request", "overflow"})

    def __init__(self, chats, *, retries=2, base_delay=1.0, max_delay=30.0, on_retry=None,
                 on_failover=None):
        self.chats = list(chats)
        if not self.chats:
            raise ValueError("Router needs at least one chat")
        self.retries = retries
        self.base_delay = base_delay
        self.max_delay = max_delay
        _refuse_async(on_retry, "on_retry")
        _refuse_async(on_failover, "on_failover")
        self.on_retry = on_retry
        self.on_failover = on_failover

    @property
    def model(self):
        """The first chat's model, when it names one."""
        return getattr(self.chats[0], "model", None)

    def __repr__(self):
        return f"Router({self.chats!r})"

    def __call__(self, messages, *, tools=None, temperature=None, max_tokens=None, signal=None,
                 response_format=None):
        """Answer with the first provider that succeeds; see the class docstring."""
        last = None
        for i, chat in enumerate(self.chats):
            if signal is not None and signal.is_set():
                raise AbortError("aborted before trying the next provider")
            if i and self.on_failover is not None:
                _refuse_coroutine(self.on_failover(last, i), "on_failover")
            more = i + 1 < len(self.chats)
            # response_format only when set, as the loop passes it: a ChatFn may not take it
            extras = {} if response_format is None else {"response_format": response_format}
            call = functools.partial(chat, messages, tools=tools, temperature=temperature,
                                     max_tokens=max_tokens, signal=signal, **extras)
            try:
                return run_with_retries(
                    call, retries=self.retries, base_delay=self.base_delay,
                    max_delay=self.max_delay,
                    # with a provider left, a long server-requested wait is not worth it
                    max_retry_after=self.max_delay if more else _MAX_RETRY_AFTER,
                    signal=signal, on_retry=self.on_retry)
            except ProviderError as e:
                if e.kind in self._FINAL_KINDS or e.after_output:
                    raise
                last = e
                if more:
                    _log.info("provider %r failed (%s: %s); trying the next", chat, e.kind, e)
        raise last


_received_limiters = {}  # token: the Limiter that copies sent to this process became
_sent_limiters = weakref.WeakValueDictionary()  # token: a Limiter of this process, pickled
_received_limiters_lock = _ForkSafeLock()


_all_limiters = weakref.WeakSet()  # every Limiter of this process, renewed in a forked child


def _forget_limiters_after_fork():
    """A forked child has copies of its parent's limiters, their calls in flight included:
    it gets limiters of its own, those sent to it and those it inherited alike."""
    _received_limiters.clear()
    _sent_limiters.clear()
    for limiter in list(_all_limiters):
        limiter._renew()


_after_fork(_forget_limiters_after_fork)


def _limiter_in_this_process(token, max_concurrent, requests_per_minute, tokens_per_minute):
    with _received_limiters_lock:
        limiter = _sent_limiters.get(token) or _received_limiters.get(token)
        if limiter is None:
            limiter = Limiter(max_concurrent=max_concurrent, requests_per_minute=requests_per_minute,
                              tokens_per_minute=tokens_per_minute)
            limiter._token = token
            _received_limiters[token] = limiter
        return limiter


class Limiter:
    """Limits the calls of any number of chats, from any number of threads.

    At most ``max_concurrent`` calls in flight; requests and estimated input tokens
    (``estimate_messages_tokens``) per rolling minute held under ``requests_per_minute``
    and ``tokens_per_minute`` by waiting. A ``rate_limit`` or ``overloaded`` error with a
    ``retry_after`` pauses every caller until then (and is re-raised). Every wait ends
    with AbortError when the call's signal is set. ``wrap(chat)`` gives the limited ChatFn.
    """

    _WINDOW = 60.0

    def __init__(self, *, max_concurrent=None, requests_per_minute=None, tokens_per_minute=None):
        for name, value in (("max_concurrent", max_concurrent),
                            ("requests_per_minute", requests_per_minute),
                            ("tokens_per_minute", tokens_per_minute)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ValueError(f"{name} must be an int >= 1 or None, not {value!r}")
        self.max_concurrent = max_concurrent
        self.requests_per_minute = requests_per_minute
        self.tokens_per_minute = tokens_per_minute
        self._token = os.urandom(8).hex()  # names it in the processes it is sent to
        self._renew()
        _all_limiters.add(self)

    def _renew(self):
        """No call in flight or in the window. Also what a forked child's copy becomes: its
        parent's calls in flight would never end there (a child of a limiter of
        max_concurrent=1 forked mid-call waited for ever), and a thread of its parent may
        have held the condition's lock."""
        # A Ctrl-C must not keep the lock or a slot for ever (a notebook's next cell through
        # a limiter of one hung): the lock is taken by its own `with` (C code: Condition's
        # __enter__ is a Python frame a Ctrl-C can stop in once it holds the lock), and each
        # call in flight is a token, taken and given back in one step, the giving back the
        # first thing its `finally` does (a call to a Python function may stop at its start).
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._in_flight = set()
        self._waiting = deque()  # the calls waiting, first come first served
        self._starts = deque()  # (start time, estimated tokens) within the window
        self._tokens = 0
        self._paused_until = 0.0

    def __reduce__(self):
        # Every copy sent to one process is that process's one limiter: tasks pickled
        # one by one to a pool or a cluster share its limits there. In this process, that
        # limiter is this one (a Dask cluster of threads pickles its tasks too).
        with _received_limiters_lock:
            _sent_limiters[self._token] = self
        return _limiter_in_this_process, (self._token, self.max_concurrent,
                                          self.requests_per_minute, self.tokens_per_minute)

    def __repr__(self):
        return (f"Limiter(max_concurrent={self.max_concurrent!r}, requests_per_minute="
                f"{self.requests_per_minute!r}, tokens_per_minute={self.tokens_per_minute!r})")

    def wrap(self, chat):
        """``chat`` with its calls limited by this limiter."""
        return _LimitedChat(self, chat)

    def _wait_needed(self, tokens, now):
        """Seconds to wait before a call of ``tokens`` may start (0 to start now)."""
        while self._starts and self._starts[0][0] <= now - self._WINDOW:
            self._tokens -= self._starts.popleft()[1]
        if self._paused_until > now:
            return self._paused_until - now
        if self.max_concurrent is not None and len(self._in_flight) >= self.max_concurrent:
            return _WATCH_SECONDS  # until a call ends (notified) or the signal is looked at
        if (self.requests_per_minute is not None and len(self._starts) >= self.requests_per_minute
                or self.tokens_per_minute is not None and self._starts
                and self._tokens + tokens > self.tokens_per_minute):
            return self._starts[0][0] + self._WINDOW - now
        return 0.0

    def _acquire(self, call, tokens, signal):
        """Wait for the turn of ``call``: the calls start in the order they came (a thread
        that calls again at once, as an agent's next turn does, waits behind the others)."""
        _check_fork()
        with self._lock:
            try:  # appended inside: a Ctrl-C as the append returns leaves no call in line
                self._waiting.append(call)
                while True:
                    if signal is not None and signal.is_set():
                        raise AbortError("aborted while waiting for the limiter")
                    if (self.max_concurrent is not None
                            and len(self._in_flight) >= self.max_concurrent
                            # a copy: a call that ends discards itself without the lock
                            and all(held[0] == call[0] for held in list(self._in_flight))):
                        raise RuntimeError(
                            f"a call through this Limiter (max_concurrent={self.max_concurrent}) "
                            f"from inside its own calls in one thread would wait for ever: that "
                            f"thread holds every slot (a chat or on_delta that runs an agent on "
                            f"a chat of the same limiter); give the inner chat a Limiter of its own")
                    now = time.monotonic()
                    wait = self._wait_needed(tokens, now) if self._waiting[0] is call else _WATCH_SECONDS
                    if wait <= 0:
                        self._in_flight.add(call)
                        self._starts.append((now, tokens))
                        self._tokens += tokens
                        return
                    # a short wait on the condition: a change wakes it, the signal is seen soon
                    self._cond.wait(min(wait, _WATCH_SECONDS))
            finally:  # started, or stopped waiting (the signal, a Ctrl-C): the next in line
                try:  # may start at once
                    self._waiting.remove(call)
                except ValueError:  # a Ctrl-C before it was appended
                    pass
                self._cond.notify_all()

    def _release(self, error):
        """After a call, given back already: the first waiting may start, or all wait out
        a pause."""
        with self._lock:
            if (isinstance(error, ProviderError) and error.kind in ("rate_limit", "overloaded")
                    and error.retry_after):
                self._paused_until = max(self._paused_until, time.monotonic() + error.retry_after)
            self._cond.notify_all()  # the first in line is one of them


class _LimitedChat:
    """A ChatFn whose calls wait for their turn at a Limiter."""

    def __init__(self, limiter, chat):
        self.limiter = limiter
        self.chat = chat

    @property
    def model(self):
        return getattr(self.chat, "model", None)

    def __repr__(self):
        return f"{self.limiter!r}.wrap({self.chat!r})"

    def __call__(self, messages, *, tools=None, temperature=None, max_tokens=None, signal=None,
                 **extras):
        tokens = estimate_messages_tokens(messages) if self.limiter.tokens_per_minute else 0
        call, error = (threading.get_ident(), object()), None  # its thread, and itself
        try:
            self.limiter._acquire(call, tokens, signal)
            return self.chat(messages, tools=tools, temperature=temperature,
                             max_tokens=max_tokens, signal=signal, **extras)
        except BaseException as e:
            error = e
            raise
        finally:
            self.limiter._in_flight.discard(call)  # nothing when a Ctrl-C came before it was counted
            self.limiter._release(error)


_CHAT_OPTIONS = ("api_key", "base_url", "timeout", "stream", "on_delta", "extra_body")
_ROUTER_OPTIONS = ("retries", "base_delay", "max_delay", "on_retry", "on_failover")
_SPEC_OPTIONS = frozenset({*_CHAT_OPTIONS, *_ROUTER_OPTIONS, "max_tokens", "limiter"})


def chat_from_spec(spec, **options):
    """A Router over the ChatFns of ``"provider:model[@base_url]"`` specs, comma-separated.

    Options go where they apply: ``api_key``, ``base_url``, ``timeout``, ``stream``,
    ``on_delta``, ``extra_body`` to each provider (``max_tokens`` to Anthropic's); ``retries``
    (default 2), ``base_delay``, ``max_delay``, ``on_retry``, ``on_failover`` to the Router;
    ``limiter`` (a Limiter) wraps each provider, below the retries.
    """
    unknown = sorted(set(options) - _SPEC_OPTIONS)
    if unknown:
        raise TypeError(f"chat_from_spec() got an unexpected keyword argument {unknown[0]!r}")
    parts = [p.strip() for p in spec.split(",")] if isinstance(spec, str) else []
    if not parts or not all(parts):
        raise ValueError(f"invalid model spec {spec!r}: expected 'provider:model[@base_url]'")
    chats = []
    for part in parts:
        found = re.match(_SPEC, part)
        if not found or not found.group(2).strip():
            raise ValueError(f"invalid model spec {part!r}: expected 'provider:model[@base_url]'")
        provider, model, url = found.group(1).lower(), found.group(2).strip(), found.group(3)
        after = model.rpartition("@")[2] if "@" in model else ""
        if "/" in after or ":" in after:  # a version such as "claude-x@20250929" has neither
            scheme, _, rest = re.split(r"[?#]", after, maxsplit=1)[0].rpartition("://")
            host, slash, _ = rest.partition("/")  # no user-info, path or query: no key
            place = (f"{scheme}://" if scheme else "") + host + (slash and "/...")
            hint = "" if scheme else f" (did you mean http://{place}?)"
            raise ValueError(f"invalid model spec '{provider}:{model.partition('@')[0]}@{place}': "
                             f"the base URL after '@' must begin with http:// or https://{hint}")
        cls = _PROVIDERS.get(provider)
        if cls is None:
            raise ValueError(f"unknown provider {provider!r} in {part!r}; known providers: "
                             f"{', '.join(sorted(_PROVIDERS))}")
        kwargs = {k: options[k] for k in _CHAT_OPTIONS if k in options}
        if url:
            kwargs["base_url"] = url
        if cls is AnthropicChat and "max_tokens" in options:
            kwargs["max_tokens"] = options["max_tokens"]
        chat = cls(model, **kwargs)
        if options.get("limiter") is not None:
            chat = options["limiter"].wrap(chat)
        chats.append(chat)
    return Router(chats, **{k: options[k] for k in _ROUTER_OPTIONS if k in options})


# ============================================================================
# Tools
# ============================================================================

DEFAULT_MAX_OUTPUT_CHARS = 50_000
_TOOL_NAME_RE = rf"[A-Za-z0-9_-]{{1,{_TOOL_NAME_MAX_CHARS}}}\Z"
_ARGS_HEADERS = ("args:", "arguments:", "parameters:", "params:", "keyword args:",
                 "keyword arguments:")
_DOC_SECTIONS = _ARGS_HEADERS + ("returns:", "return:", "yields:", "raises:", "example:",
                                 "examples:", "note:", "notes:", "see also:")
_ARG_DOC_RE = r"\*{0,2}([A-Za-z_]\w*)\s*(?:\([^)]*\))?\s*:\s*(.*)\Z"


class _ToolFailure(Exception):
    """A refusal of a tool: its message is the ``error`` the model sees."""


# --- schemas ---

_SIMPLE_HINTS = {str: "string", int: "integer", float: "number", bool: "boolean"}
_LITERAL_KINDS = {str: "string", int: "integer", bool: "boolean", type(None): "null"}
_NO_HINT = object()


def _nullable_schema(schema):
    """``schema`` widened to admit ``null``: ``anyOf`` it and ``{"type": "null"}``, not a list
    of types, which Gemini refuses (its ``type`` is one name); OpenAI and Anthropic take both."""
    if not schema or schema.get("type") == "null" or {"type": "null"} in schema.get("anyOf", ()):
        return schema  # it admits null already
    return {"anyOf": schema.get("anyOf", [schema]) + [{"type": "null"}]}


def _hint_schema(hint):
    """The JSON Schema of a type hint, or None when JSON Schema cannot express it."""
    if hint is _NO_HINT or hint is Any:
        return {}
    try:
        simple = _SIMPLE_HINTS.get(hint)
    except TypeError:  # an unhashable hint
        simple = None
    if simple is not None:
        return {"type": simple}
    origin = typing.get_origin(hint) or hint
    args = typing.get_args(hint)
    if origin is list:
        item = _hint_schema(args[0]) if args else {}
        if item is None:
            return None
        return {"type": "array", "items": item} if item else {"type": "array"}
    if origin is dict:
        if args and args[0] is not str:
            return None  # JSON object keys are strings
        value = _hint_schema(args[1]) if args else {}
        if value is None:
            return None
        return {"type": "object", "additionalProperties": value} if value else {"type": "object"}
    if origin is typing.Union or origin is getattr(types, "UnionType", None):
        rest = [a for a in args if a is not type(None)]
        if len(rest) != 1 or len(args) != 2:
            return None  # only Optional[X]: a model cannot tell other unions apart reliably
        inner = _hint_schema(rest[0])
        return None if inner is None else _nullable_schema(inner)
    if origin is typing.Literal:
        if not args:  # Literal[()]: no value a call could give
            return None
        by_kind = {}  # its values by JSON type, in their order
        for value in args:
            kind = _LITERAL_KINDS.get(type(value))
            if kind is None:
                return None
            by_kind.setdefault(kind, []).append(value)
        if len(by_kind) == 1:
            [(kind, values)] = by_kind.items()
            return {"type": kind, "enum": values}
        # Values of several types: one branch per type, not a list of types (Gemini refuses one)
        branches = [{"type": kind, "enum": values} for kind, values in by_kind.items()
                    if kind != "null"]
        return {"anyOf": branches + [{"type": "null"}] if "null" in by_kind else branches}
    return None


def _without_null(schema):
    """``schema`` narrowed not to admit ``null`` (the other half of ``_nullable_schema``);
    a schema that admits only ``null`` stays as it is."""
    branches = schema.get("anyOf")
    if branches is None:
        return schema
    rest = [branch for branch in branches if branch != {"type": "null"}]
    return rest[0] if len(rest) == 1 else {"anyOf": rest}


def _is_hint_of(hint, wanted):
    """Whether ``hint`` is ``wanted`` (``threading.Event``, a subclass of it, or
    ``lich.ToolCall``) or ``Optional`` of it."""
    if typing.get_origin(hint) is not None:
        rest = [a for a in typing.get_args(hint) if a is not type(None)]
        return len(rest) == 1 and _is_hint_of(rest[0], wanted)
    if hint is wanted:
        return True
    return (wanted is threading.Event and isinstance(hint, type)
            and issubclass(hint, threading.Event))


def _parse_docstring(doc):
    """(description, {parameter: description}) from a docstring: its first paragraph and a
    Google-style ``Args:`` section."""
    lines = doc.expandtabs().splitlines() if doc else []
    paragraph = []
    for line in lines:
        stripped = line.strip()
        if not stripped:
            if paragraph:
                break
            continue
        if stripped.lower() in _DOC_SECTIONS or stripped.startswith(":"):  # reST's :param x:
            break
        if len(stripped) >= 3 and set(stripped) == {"-"}:  # NumPy's underlined section name
            del paragraph[-1:]
            break
        paragraph.append(stripped)
    described = {}
    start = next((i for i, line in enumerate(lines) if line.strip().lower() in _ARGS_HEADERS),
                 None)
    if start is not None:
        # A header on the docstring's first line lost its indentation, and its entries
        # theirs, to ``inspect.getdoc``: there the next section's name or a line of prose
        # ends the section, not a line as far left as the header.
        header_indent = len(lines[start]) - len(lines[start].lstrip()) if start else -1
        entry_indent = None
        current = None
        for line in lines[start + 1:]:
            stripped = line.strip()
            if not stripped:
                continue
            indent = len(line) - len(line.lstrip())
            if indent <= header_indent or (not start and stripped.lower() in _DOC_SECTIONS):
                break  # the next section
            if entry_indent is None:
                entry_indent = indent
            match = re.match(_ARG_DOC_RE, stripped) if indent <= entry_indent else None
            if match:
                current = described[match.group(1)] = [match.group(2)] if match.group(2) else []
            elif current is not None and (start or indent > entry_indent):
                current.append(stripped)
            elif not start:
                break  # prose after the entries
    return " ".join(paragraph), {name: " ".join(words) for name, words in described.items()}


def _type_hints(fn, fn_name):
    """The resolved type hints of ``fn``; a hint that cannot be resolved is a TypeError."""
    target = _called_code(fn)
    try:
        return typing.get_type_hints(target)
    except NameError as e:
        # The return hint plays no part in the tool's schema: one that names what only a
        # type checker imports (``if TYPE_CHECKING:``) is let be.
        annotations = dict(getattr(target, "__annotations__", None) or {})
        if annotations.pop("return", None) is not None:
            try:
                return typing.get_type_hints(types.SimpleNamespace(
                    __annotations__=annotations, __globals__=getattr(target, "__globals__", {})))
            except NameError:
                pass
        raise TypeError(f"cannot register {fn_name}: a type hint cannot be resolved: {e}") from e
    except TypeError as e:
        if target is _unwrapped_function(fn) and inspect.isfunction(target):  # one Python cannot evaluate here
            hint = (" (X | Y needs Python 3.10; write Optional[X] or Union[X, Y])"
                    if sys.version_info < (3, 10) else "")
            raise TypeError(f"cannot register {fn_name}: a type hint cannot be evaluated: "
                            f"{e}{hint}") from e
        return {}  # not a plain function (a built-in...): the signature's hints stand


def _json_ready(value):
    """Whether ``value`` can go into a JSON Schema as a default: JSON has no NaN or
    infinity, and a request holding one is refused (Python would write them)."""
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return False
    return True


def _docstring(fn):
    """``inspect.getdoc(fn)``; where docstrings were dropped (``python -OO``, or lich's
    bytecode compiled so), read from the source when it is at hand, so that the model still
    gets each tool's description. Without it, a warning says that the descriptions are gone."""
    doc = inspect.getdoc(fn)
    if doc == type.__call__.__doc__ and getattr(fn, "__doc__", None) is None:
        doc = None  # "Call self as a function.": what getdoc finds for any bare __call__
    if doc is not None or (sys.flags.optimize < 2 and _docstring.__doc__ is not None):
        return doc
    import ast
    import textwrap
    try:
        [node] = ast.parse(textwrap.dedent(inspect.getsource(fn))).body
        return ast.get_docstring(node)
    except (OSError, TypeError, SyntaxError, ValueError):  # no source, or not one function's
        if (getattr(fn, "__module__", None) == __name__  # a built-in tool: lich's source is gone
                and not _NO_DOCSTRINGS_TOLD.is_set()):
            _NO_DOCSTRINGS_TOLD.set()  # once: each tool would say it again
            _log.warning("the built-in tools have no descriptions for the model: lich runs "
                         "from bytecode compiled without docstrings (-OO) and without its "
                         "source; ship lich.py with it, or compile without -OO")
        return None


_NO_DOCSTRINGS_TOLD = threading.Event()


def _function_tool(fn, name, description):
    """(spec, signal parameter, call parameter) of a function, from its signature and docstring."""
    if not callable(fn):
        raise TypeError(f"a tool must be callable, not {fn!r}")
    if name is None:
        name = getattr(fn, "__name__", None)
        if name is None:
            raise ValueError(f"{fn!r} has no __name__: give the tool a name (name=...)")
    if not isinstance(name, str) or not re.match(_TOOL_NAME_RE, name):
        raise ValueError(f"invalid tool name {name!r}: use 1 to 64 letters, digits, '_' or '-'")
    if description is not None and not isinstance(description, str):
        raise TypeError(f"cannot register {name}: its description must be a str, "
                        f"not {type(description).__name__}")
    code = _called_code(fn)
    if inspect.iscoroutinefunction(code) or inspect.isasyncgenfunction(code):
        raise TypeError(f"cannot register {name}: it is an async function, and lich calls "
                        f"tools synchronously; register a function that runs it "
                        f"(asyncio.run(...)) and returns its result")
    if inspect.isgeneratorfunction(code):
        raise TypeError(f"cannot register {name}: it is a generator function; a tool returns "
                        f"its result (a str, or a list of what it yields)")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError) as e:
        raise TypeError(f"cannot register {name}: {e}") from e
    first = next(iter(signature.parameters.values()), None)
    if (inspect.isfunction(fn) and first is not None and first.name in ("self", "cls")
            and first.annotation is first.empty
            and fn.__qualname__.rpartition(".")[0].rpartition(".")[2] not in ("", "<locals>")):
        raise TypeError(f"cannot register {name}: it is a method of a class, taken unbound "
                        f"(its first parameter is {first.name!r}); register it bound, "
                        f"from an instance (tools.register(obj.{fn.__name__}))")
    hints = _type_hints(fn, name)
    described = _unwrapped_function(fn)  # a partial's docstring is partial's own
    if (code is not described and not inspect.isclass(described)
            and not hasattr(described, "__wrapped__")  # a wrapper says what it wraps does
            and "__doc__" not in getattr(described, "__dict__", {})
            and _docstring(code) is not None):
        described = code  # an object's __call__ says what it does, else the object's class
    doc_description, arg_docs = _parse_docstring(_docstring(described))
    properties, required = {}, []
    signal_param = call_param = None
    for param in signature.parameters.values():
        if param.kind not in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY):
            raise TypeError(f"cannot register {name}: parameter {param.name!r} is "
                            f"{param.kind.description}; a tool takes keyword arguments")
        hint = hints.get(param.name, param.annotation)
        if hint is param.empty:
            hint = _NO_HINT
        special = ("the loop's signal" if _is_hint_of(hint, threading.Event) else
                   "the call" if _is_hint_of(hint, ToolCall) else None)
        if special is not None:
            given = signal_param if special == "the loop's signal" else call_param
            if given is not None:
                raise TypeError(f"cannot register {name}: parameters {given!r} and "
                                f"{param.name!r} both ask for {special}; one may")
            if special == "the loop's signal":
                signal_param = param.name
            else:
                call_param = param.name
            continue
        schema = _hint_schema(hint)
        if schema is None:
            raise TypeError(f"cannot register {name}: parameter {param.name!r} has the type "
                            f"hint {hint!r}, which JSON Schema cannot express; use str, int, "
                            f"float, bool, list, dict, Optional or Literal")
        if param.default is None:
            # Offered with its type alone, without a null alternative: leaving it out means
            # the default, and a null for it is taken as that too.
            schema = _without_null(schema)
        notes = {}
        if param.name in arg_docs:
            notes["description"] = arg_docs[param.name]
        if param.default is param.empty:
            required.append(param.name)
        elif _json_ready(param.default):
            notes["default"] = param.default
        if "anyOf" in schema:  # Gemini takes anyOf only as the one key of its schema
            first, *rest = schema["anyOf"]
            properties[param.name] = {"anyOf": [{**first, **notes}, *rest]}
        else:
            properties[param.name] = {**schema, **notes}
    parameters = {"type": "object", "properties": properties}
    if required:
        parameters["required"] = required
    parameters["additionalProperties"] = False
    spec = {"name": name, "description": doc_description if description is None else description,
            "parameters": parameters}
    return spec, signal_param, call_param


def _plural(word, names):
    """``argument 'a'`` or ``arguments 'a', 'b'``."""
    quoted = ", ".join(f"'{name[:_ECHO_MAX_CHARS]}...'" if len(name) > _ECHO_MAX_CHARS
                       else f"'{name}'" for name in names)  # a model's long name, cut
    return f"{word} {quoted}" if len(names) == 1 else f"{word}s {quoted}"


def _arguments_object(name, raw) -> dict:
    """The arguments of a call to ``name``: the model's raw JSON text parsed (blank or None:
    none), or an object given as it is; _ToolFailure when they are not a JSON object."""
    if isinstance(raw, str) and raw.strip():
        try:
            raw = _strict_json(raw)  # NaN, Infinity, 1e400: no JSON, no float of them
        except RecursionError:
            raise _ToolFailure(f"the arguments of {name} are nested too deeply to read; "
                               f"send one flatter JSON object") from None
        except ValueError as e:
            why = ("a number of more digits than Python reads" if "digits" in str(e)
                   and "integer string conversion" in str(e) else e)
            raise _ToolFailure(f"the arguments of {name} are not valid JSON ({why}); "
                               f"send one JSON object") from None
    elif raw is None or isinstance(raw, str):
        raw = {}
    if not isinstance(raw, dict):
        raise _ToolFailure(f"the arguments of {name} must be a JSON object, not {_json_kind(raw)}")
    return raw


def _defaults_to_none(schema) -> bool:
    notes = schema["anyOf"][0] if "anyOf" in schema else schema  # where _function_tool put them
    return "default" in notes and notes["default"] is None


def _call_arguments(spec, raw):
    """The keyword arguments of a call from the model's raw JSON text, checked against the
    tool's parameters schema; _ToolFailure with every problem when they do not fit."""
    name = spec["name"]
    args = _arguments_object(name, raw)
    schema = spec["parameters"]
    properties = schema.get("properties") or {}
    unknown = [key for key in args if key not in properties]
    missing = [key for key in schema.get("required") or () if key not in args]
    problems = []
    kwargs = {key: None if value is None and _defaults_to_none(properties[key])  # its default
              else _schema_check(value, properties[key], key, problems)
              for key, value in args.items() if key in properties}
    if not (unknown or missing or problems):
        return kwargs
    found = []
    if unknown:
        takes = ", ".join(properties) if properties else "no arguments"
        found.append(f"unknown {_plural('argument', unknown)} ({name} takes {takes})")
    if missing:
        found.append(f"missing required {_plural('argument', missing)}")
    found += [f"argument '{where}' must be {expected}, not {got}" for where, expected, got in problems]
    raise _ToolFailure(f"invalid arguments for {name}: " + "; ".join(found))


# --- Tools ---


class _Tool:
    """One registered function and what ``run`` needs to call it."""

    __slots__ = ("call_param", "fn", "signal_param", "spec")

    def __init__(self, fn, spec, signal_param, call_param):
        self.fn = fn
        self.spec = spec
        self.signal_param = signal_param
        self.call_param = call_param


class Tools:
    """A ToolRunner over plain Python functions.

    Register a function with ``@tools.tool`` (or ``tools.tool(name=..., description=...)``, or
    ``tools.register(fn)``): its JSON Schema comes from its type hints -- ``str``, ``int``,
    ``float``, ``bool``, ``list[X]``, ``dict`` / ``Dict[str, X]``, ``Optional[X]``,
    ``Literal[...]``; a parameter without a hint (or ``Any``) accepts any JSON value -- and
    its docstring: the first paragraph describes the tool, a Google-style ``Args:`` section
    the parameters. A parameter with a default is optional. Two kinds of parameter are not
    offered to the model: one annotated ``threading.Event`` receives the loop's signal (a
    fresh, unset Event when the loop has none), one annotated ``lich.ToolCall`` the call
    itself. ``run`` never raises: bad calls and exceptions become failed ToolResults, and
    output over ``max_output_chars`` keeps its head and tail. Tools of module-level
    functions pickle.
    """

    def __init__(self, *, max_output_chars=DEFAULT_MAX_OUTPUT_CHARS):
        if isinstance(max_output_chars, bool) or not isinstance(max_output_chars, int):
            raise TypeError(f"max_output_chars must be an int, not {max_output_chars!r}")
        if max_output_chars < 1:
            raise ValueError(f"max_output_chars must be 1 or more, not {max_output_chars}")
        self.max_output_chars = max_output_chars
        self._tools = {}

    def tool(self, fn=None, *, name=None, description=None):
        """Register ``fn`` as a tool; usable as ``@tools.tool`` or ``@tools.tool(name=...)``."""
        if fn is None:
            return lambda f: self.register(f, name=name, description=description)
        return self.register(fn, name=name, description=description)

    def register(self, fn, name=None, description=None):
        """Register ``fn`` as a tool and return it unchanged."""
        spec, signal_param, call_param = _function_tool(fn, name, description)
        if spec["name"] in self._tools:
            raise ValueError(f"a tool named {spec['name']!r} is already registered")
        self._tools[spec["name"]] = _Tool(fn, spec, signal_param, call_param)
        return fn

    def specs(self) -> list:
        """The tool specs, in registration order."""
        return [tool.spec for tool in self._tools.values()]

    def run(self, call: dict, signal: Optional[threading.Event] = None) -> ToolResult:
        """Run one tool call; never raises: every failure is a failed ToolResult."""
        try:
            if not isinstance(call, dict):
                return ToolResult(ok=False, error="a tool call must be an object with a name and "
                                                  "arguments")
            tool = self._tools.get(call.get("name")) if isinstance(call.get("name"), str) else None
            if tool is None:
                return ToolResult(ok=False, error=self._limit(self._unknown(call.get("name"))))
            kwargs = _call_arguments(tool.spec, call.get("arguments"))
            if tool.signal_param is not None:
                kwargs[tool.signal_param] = signal if signal is not None else threading.Event()
            if tool.call_param is not None:
                kwargs[tool.call_param] = call
            return self._result(tool.fn(**kwargs))
        except _ToolFailure as e:
            return ToolResult(ok=False, error=self._limit(str(e)))
        except (Exception, SystemExit) as e:  # run never raises, but for a server stopping it
            if isinstance(e, SystemExit) and _raised_by_a_signal_handler(e):
                raise
            _log.debug("tool call %r raised", call, exc_info=True)
            return ToolResult(ok=False, error=self._limit(_exception_text(e)))

    def _result(self, value):
        """A function's return value as a ToolResult, its texts cut to ``max_output_chars``."""
        if isinstance(value, str):
            return ToolResult(ok=True, output=self._limit(value))
        if value is None:
            return ToolResult(ok=True)
        if isinstance(value, ToolResult):
            output, error = value.output, value.error
            return ToolResult(ok=value.ok,
                              output=self._limit(output) if isinstance(output, str) else output,
                              error=self._limit(error) if isinstance(error, str) else error)
        # never run: said, not passed off as a result
        if inspect.isasyncgen(value):  # one never started has nothing to close
            unrun = "an async generator"
        elif inspect.iscoroutine(value) or inspect.isgenerator(value):
            value.close()
            unrun = f"a {type(value).__name__}"
        else:
            unrun = None
        if unrun is not None:
            return ToolResult(ok=False, error=f"TypeError: the tool returned {unrun} object, which "
                                              f"lich does not run; a tool returns its result")
        try:
            text = json.dumps(value, ensure_ascii=False)
        except (TypeError, ValueError, RecursionError):
            try:
                text = repr(value)
            except Exception as e:  # the tool ran: its failure to print is not the tool's
                return ToolResult(ok=False, error=self._limit(
                    f"the tool ran, but its result (a {type(value).__name__}) cannot be "
                    f"shown: {_exception_text(e)}"))
        return ToolResult(ok=True, output=self._limit(text))

    def _unknown(self, name):
        shown = _echo(name) if isinstance(name, str) else repr(name)
        if not self._tools:
            return f"unknown tool {shown}; no tools are available"
        return f"unknown tool {shown}; the available tools are: {', '.join(self._tools)}"

    def _limit(self, text):
        return _truncate(text, self.max_output_chars)


def combine_tools(*runners):
    """One ToolRunner over several: their specs in order, each call routed by its name.

    A name offered twice raises ValueError naming it; the specs are read when the combined
    runner is made and again by each ``specs()`` (an MCP server's list may change: a name
    that then clashes is left out of the later runner's tools, with a warning).
    """
    combined = _CombinedTools(runners)
    combined.combine(strict=True)
    return combined


class _CombinedTools:
    """The ToolRunner of ``combine_tools``."""

    def __init__(self, runners):
        self.runners = list(runners)
        self._routes = {}
        self._clashes = set()

    @property
    def root(self):
        """The first runner's workspace root, if it has one."""
        return next((r.root for r in self.runners if isinstance(getattr(r, "root", None), str)),
                    None)

    def specs(self) -> list:
        return self.combine(strict=False)

    def combine(self, *, strict):
        specs, routes = [], {}
        for runner in self.runners:
            for spec in _offered_specs(runner) or ():
                if spec["name"] in routes:
                    if strict:
                        raise ValueError(f"the tool name {spec['name']!r} is offered twice")
                    if spec["name"] not in self._clashes:  # said once, not at every turn
                        self._clashes.add(spec["name"])
                        _log.warning("the tool name %r is offered twice; the later one is left "
                                     "out", spec["name"])
                    continue
                routes[spec["name"]] = runner
                specs.append(spec)
        self._routes = routes
        return specs

    def run(self, call, signal=None) -> ToolResult:
        name = call.get("name") if isinstance(call, dict) else None
        runner = self._routes.get(name) if isinstance(name, str) else None
        if runner is None:
            shown = _echo(name) if isinstance(name, str) else repr(name)
            return ToolResult(ok=False, error=f"unknown tool {shown}; the available tools are: "
                                              f"{', '.join(self._routes) or 'none'}")
        return runner.run(call, signal)


# --- workspace paths ---

_READ_DEFAULT_LIMIT = 2000      # lines read_file returns unless asked for fewer or more
_LINE_MAX_CHARS = 2000          # read_file cuts longer lines
_READ_MAX_CHARS = 40_000        # read_file stops here and says where to go on
_BINARY_SNIFF_BYTES = 8192      # a NUL byte in this much of a file makes it binary
_PATH_SHOWN_CHARS = 400         # of a path quoted in an error, at most about this much
_FILE_READ_BYTES = 65_536       # one read of the rest of a line too long to keep
_READ_LINE_MAX_BYTES = 64 << 20  # read_file reads no further than a line this long (a sparse
                                # file's hole is one line of NUL bytes, terabytes of them)
_LIST_MAX_FILES = 500           # list_files names at most this many files
_WALK_MAX_ENTRIES = 100_000     # list_files stops scanning after this many entries
_WALK_MAX_DEPTH = 128           # folders deeper than this are not entered (one descriptor each)
_EDIT_MAX_BYTES = 10_000_000    # edit_file refuses bigger files
_EDIT_COUNT_MAX = 1000          # places of old_text counted before "more than" that
_FILE_LOCK_STRIPES = 64         # locks that make the writes of one path wait for each other
_SKIP_DIRS = frozenset({".git", "node_modules", "__pycache__", ".venv", "venv"})
_UTF8_MAX_BYTES = 4
_NOTED_MAX = 5                  # paths named in a note about what was not looked at
# a folder opened beneath another (or the root) following no link
_SUBFOLDER_FLAGS = (os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0)
                    | getattr(os, "O_CLOEXEC", 0))
# a folder passed through on the way to another, or written in: opened for its place alone
# where the system can (Linux's O_PATH), which needs no right to list it, as the shell's
# cd and > need none (a user's drop folder, a root-owned 0711 home)
_PLACE_ONLY = getattr(os, "O_PATH", os.O_RDONLY)
_PASSED_FOLDER_FLAGS = _SUBFOLDER_FLAGS | _PLACE_ONLY


# A path's lock, by its real path's hash: an edit reads, changes and writes its file under it,
# so that two threads editing one file (agents of a batch, on workspaces of one root) keep
# both changes; the second edit read the file before the first was written, and undid it.
_file_locks = [_ForkSafeLock() for _ in range(_FILE_LOCK_STRIPES)]


def _file_lock(real):
    return _file_locks[hash(real) % _FILE_LOCK_STRIPES]


def _realpath(path):
    """``os.path.realpath``; a chain of links too long for Python's recursion is an OSError
    (ELOOP), as the kernel makes one of more than 40 links."""
    try:
        return os.path.realpath(path)
    except RecursionError:
        raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), path) from None


def _fs_failure(error, path):
    """An OSError on ``path`` (as the model gave it) as a _ToolFailure the model can act on."""
    path = _shown_path(path)
    if isinstance(error, FileNotFoundError):
        return _ToolFailure(f"no such file or directory: {path}")
    if isinstance(error, PermissionError):
        return _ToolFailure(f"permission denied: {path}")
    if isinstance(error, NotADirectoryError):
        return _ToolFailure(f"a part of the path is not a directory: {path}")
    if error.errno == errno.ELOOP:
        return _ToolFailure(f"too many levels of symbolic links: {path}")
    return _ToolFailure(f"{error.strerror or error}: {path}")


def _not_a_folder(shown, real):
    """Refuse a file named as a folder (``file.txt/``), as the system refuses it: ``real``,
    the real path that the tools work on, has lost the slash."""
    if shown.endswith(("/", "/.")) and not os.path.isdir(real):
        raise _ToolFailure(f"path ends with '/' but is not a directory: {shown}")


def _unencodable(text, limit):
    """What in ``text`` no file name or process argument can hold, in words, ``limit``
    saying why ("which no file name holds"); or None. That is a NUL character, a lone
    surrogate that stands for no byte (as ``\\udcff`` does), or in an ASCII locale with
    UTF-8 mode off, any character that is not ASCII."""
    if "\0" in text:
        return f"a NUL character, {limit}"
    try:
        os.fsencode(text)
    except UnicodeEncodeError as e:
        char = e.object[e.start]
        if "\ud800" <= char <= "\udfff":
            return f"a lone surrogate ({ascii(char)[1:-1]}), {limit}"
        return (f"{char!r}, which this file system encoding ({sys.getfilesystemencoding()}) "
                f"cannot hold (run Python with LC_ALL=C.UTF-8 or PYTHONUTF8=1)")
    return None


def _shown_path(path) -> str:
    """``path`` as an error message quotes it: a name too long for the system, the model's
    mistake, is not echoed whole (it may be 50,000 characters)."""
    return path if len(path) <= _PATH_SHOWN_CHARS else (
        path[:_PATH_SHOWN_CHARS // 2] + "…" + path[-_PATH_SHOWN_CHARS // 4:])


def _fd_path(fd) -> Optional[str]:
    """The path the kernel gives an open descriptor (Linux), or None where it does not tell."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None


def _walk_tree(top_fd, visit, *, limit=None, depth=0):
    """Walk the folder open as ``top_fd``; ``visit(rel, entry, is_dir, folder_fd)`` is called per
    entry (``rel`` the path from the top, "/"-separated; ``folder_fd`` the descriptor of the
    entry's folder) and returns whether to enter a folder.

    No link is followed: each folder is opened relative to its parent's descriptor with
    O_NOFOLLOW, so the walk cannot leave the top's tree however it changes meanwhile.
    Returns (complete, skipped): whether ``limit`` entries were not reached, and the
    (folder, reason) pairs of folders that could not be read. ``depth`` is the top's own,
    where the walk is part of a larger one. Closes ``top_fd``.
    """
    skipped = []
    frames = []  # [descriptor, path from the top, depth, subfolder names still to enter]
    seen = 0

    def enter(fd, rel, depth):
        nonlocal seen
        subfolders = []
        try:
            with os.scandir(fd) as listing:
                entries = sorted(listing, key=lambda entry: entry.name)
                for entry in entries:
                    seen += 1
                    if limit is not None and seen > limit:
                        return False
                    try:
                        is_dir = entry.is_dir(follow_symlinks=False)
                    except OSError:
                        continue
                    if visit(rel + entry.name, entry, is_dir, fd) and is_dir:
                        subfolders.append(entry.name)
        except OSError as e:
            skipped.append((rel.rstrip("/") or ".", e.strerror or str(e)))
        finally:
            frames.append([fd, rel, depth, sorted(subfolders, reverse=True)])
        return True

    try:
        if not enter(top_fd, "", depth):
            return False, skipped
        while frames:
            fd, rel, depth, subfolders = frames[-1]
            if not subfolders:
                os.close(fd)
                frames.pop()
                continue
            name = subfolders.pop()
            if depth >= _WALK_MAX_DEPTH:
                skipped.append((rel + name, f"deeper than {_WALK_MAX_DEPTH} levels"))
                continue
            try:
                child = os.open(name, _SUBFOLDER_FLAGS, dir_fd=fd)
            except OSError as e:
                skipped.append((rel + name, e.strerror or str(e)))
                continue
            if not enter(child, f"{rel}{name}/", depth + 1):
                return False, skipped
        return True, skipped
    finally:
        for frame in frames:
            os.close(frame[0])


def _skipped_note(skipped, what):
    """A line saying which folders (or files) were not looked at, or None."""
    if not skipped:
        return None
    named = ", ".join(f"{path} ({reason})" for path, reason in skipped[:_NOTED_MAX])
    more = f" and {len(skipped) - _NOTED_MAX} more" if len(skipped) > _NOTED_MAX else ""
    return f"[... not {what}: {named}{more}]"


def _give_group(fd, gid):
    try:
        os.fchown(fd, -1, gid)
    except OSError:
        pass


def _copy_extended_attributes(source, fd):
    """The extended attributes of ``source`` (a POSIX ACL among them) given to the file open
    as ``fd``, where the system has them: a file replaced by a rename kept none, and those
    an ACL let write a shared file could not. What cannot be read or set is let be."""
    if not hasattr(os, "listxattr"):
        return
    try:
        names = os.listxattr(source, follow_symlinks=False)
    except OSError:  # no such attributes here (another system, a file system without them)
        return
    for attribute in names:
        # a user's attributes and an ACL: not a security label or a hash of the old
        # contents, nor file capabilities, which would give the new contents the old rights
        if not attribute.startswith(("user.", "system.posix_acl_access")):
            continue
        try:
            os.setxattr(fd, attribute, os.getxattr(source, attribute, follow_symlinks=False))
        except OSError:
            continue


class _Root:
    """The folder the coding tools work in, and every way they reach into it.

    Paths given by the model are resolved (links included) and must lie inside the root;
    what is then opened is checked again through its descriptor, so a folder swapped for a
    link between the check and the open cannot lead out. Folders are walked without
    following links. Writes go to a temporary file in the same folder, renamed over the
    target, so a file is never left cut.
    """

    def __init__(self, root):
        try:
            real = _realpath(root)
        except OSError as e:
            raise ValueError(f"root is not a directory: {root} ({e.strerror})") from None
        if not os.path.isdir(real):
            raise ValueError(f"root is not a directory: {root}")
        self.path = real
        self._prefix = real if real.endswith(os.sep) else real + os.sep

    def inside(self, real):
        return real == self.path or real.startswith(self._prefix)

    def relative(self, real):
        return "." if real == self.path else real[len(self._prefix):]

    def resolve(self, path):
        """The real path of ``path`` (relative to the root), which must lie inside the root."""
        unheld = _unencodable(path, "which no file name holds")
        if unheld:
            raise _ToolFailure(f"path contains {unheld}: {_shown_path(repr(path))}")
        if path == "~" or path.startswith("~/"):  # written as it stands, a folder named ~
            raise _ToolFailure(f"path begins with ~, which is not expanded here: give the path "
                               f"from the workspace root (./~ names a file called ~): "
                               f"{_shown_path(path)}")
        if re.match(r"[A-Za-z][A-Za-z0-9+.-]*://", path):
            raise _ToolFailure(f"path is a URL, not a path: {_shown_path(path)}")
        try:
            real = _realpath(os.path.join(self.path, path))
        except OSError as e:
            raise _fs_failure(e, path) from None
        if not self.inside(real):
            raise _ToolFailure(f"path is outside the workspace: {_shown_path(path)}")
        return real

    def stat(self, real, shown):
        try:
            return os.stat(real)
        except OSError as e:
            raise _fs_failure(e, shown) from None

    def open_file(self, real, shown):
        """``real`` opened for binary reading, refused unless a regular file inside the root."""
        mode = self.stat(real, shown).st_mode
        _not_a_folder(shown, real)
        if stat.S_ISDIR(mode):
            raise _ToolFailure(f"path is a directory, not a file: {shown}; list_files shows "
                               f"what it holds")
        if not stat.S_ISREG(mode):
            raise _ToolFailure(f"path is not a regular file: {shown}")
        fd = self._open(real, shown, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)
                        | getattr(os, "O_NOCTTY", 0))
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # swapped since the stat
            os.close(fd)
            raise _ToolFailure(f"path is not a regular file: {shown}")
        return os.fdopen(fd, "rb")

    def open_dir(self, real, shown, *, to_list=True):
        """A descriptor of the folder ``real``, refused unless a folder inside the root; not
        ``to_list``, one to write in, which needs no right to list it."""
        if not stat.S_ISDIR(self.stat(real, shown).st_mode):
            raise _ToolFailure(f"path is not a directory: {shown}")
        flags = os.O_RDONLY if to_list else _PLACE_ONLY
        return self._open(real, shown, flags | getattr(os, "O_DIRECTORY", 0))

    def _open(self, real, shown, flags):
        try:
            fd = os.open(real, flags | getattr(os, "O_CLOEXEC", 0))
        except OSError as e:
            raise _fs_failure(e, shown) from None
        opened = _fd_path(fd)
        if opened is not None and self.inside(opened):
            return fd
        if opened is None:  # no kernel answer here: the path must still name what was opened
            try:
                followed = _realpath(real)
                now, was = os.fstat(fd), os.stat(followed)
                if self.inside(followed) and os.path.samestat(now, was):
                    return fd
            except OSError:
                pass
        os.close(fd)
        raise _ToolFailure(f"path is outside the workspace: {_shown_path(shown)}")

    def files(self, top, wanted):
        """(sorted paths from the root of the files under the real folder ``top`` that
        ``wanted(rel, name)`` accepts, whether the scan was complete, its note or None).
        A link is listed when it leads to a regular file inside the root; none is followed."""
        base = self.relative(top)
        prefix = "" if base == "." else base + "/"
        found = []

        def visit(rel, entry, is_dir, folder_fd):
            if is_dir:
                return entry.name not in _SKIP_DIRS
            try:
                if entry.is_symlink():
                    target = _realpath(os.path.join(self.path, prefix + rel))
                    if not (self.inside(target) and os.path.isfile(target)):
                        return False
                elif not entry.is_file(follow_symlinks=False):
                    return False
            except OSError:
                return False
            if wanted(rel, entry.name):
                found.append(prefix + rel)
            return False

        complete, skipped = _walk_tree(self.open_dir(top, base), visit, limit=_WALK_MAX_ENTRIES)
        found.sort()
        return found, complete, _skipped_note(skipped, "listed")

    def _make_folders(self, folder):
        """Create what is missing of the real folder ``folder``, one name at a time from the
        root, following no link: a folder swapped for a link meanwhile makes nothing outside."""
        rel = self.relative(folder)
        if rel == ".":
            return
        fd = os.open(self.path, _PASSED_FOLDER_FLAGS)
        try:
            for part in rel.split("/"):
                try:
                    child = os.open(part, _PASSED_FOLDER_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    try:
                        os.mkdir(part, dir_fd=fd)
                    except FileExistsError:
                        pass  # made meanwhile
                    child = os.open(part, _PASSED_FOLDER_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = child
        finally:
            os.close(fd)

    def write(self, real, shown, data):
        """Replace the file ``real`` (or create it, and its folders) with ``data``, atomically:
        a temporary file in the same folder renamed over it, with the file's mode."""
        _not_a_folder(shown, real)
        folder, name = os.path.split(real)
        try:
            self._make_folders(folder)
        except OSError as e:
            raise _fs_failure(e, shown) from None
        dir_fd = self.open_dir(folder, shown, to_list=False)
        temp = None
        try:
            try:
                old = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                old = None
            if old is not None and not stat.S_ISREG(old.st_mode):
                kind = "a directory" if stat.S_ISDIR(old.st_mode) else "not a regular file"
                raise _ToolFailure(f"path is {kind}: {shown}")
            if old is not None and not os.access(name, os.W_OK, dir_fd=dir_fd):
                # the rename needs only the folder's permission: a read-only file is refused
                # here, as the shell's ``>`` refuses it
                raise _ToolFailure(f"permission denied: {shown} is read-only")
            temp = (f".{os.fsdecode(os.fsencode(name)[:200])}"  # bytes: a name holds 255 of them
                    f".lich-{os.getpid()}-{os.urandom(4).hex()}.tmp")
            try:
                fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0),
                             0o666, dir_fd=dir_fd)
            except PermissionError:
                temp = None  # the file may be writable: the reason is its folder's, said so
                why = " (a file is replaced by one made beside it)" if old else ""
                raise _ToolFailure(f"permission denied: {shown}: lich may not write in its "
                                   f"folder{why}") from None
            with os.fdopen(fd, "wb") as f:
                if old is not None:  # no one reads the new text that the old file kept from them
                    os.fchmod(fd, stat.S_IMODE(old.st_mode) & 0o777)
                f.write(data)
                f.flush()
                if old is not None:  # then what a write or a chown would take away again
                    if (old.st_uid, old.st_gid) != (os.getuid(), os.getgid()):
                        try:
                            os.fchown(fd, old.st_uid, old.st_gid)
                        except OSError:  # not lich's to give away: its group, where lich is
                            _give_group(fd, old.st_gid)  # of it, or its team lost the file
                    os.fchmod(fd, stat.S_IMODE(old.st_mode))  # set-id bits, after the chown
                    _copy_extended_attributes(f"/proc/self/fd/{dir_fd}/{name}", fd)
            os.replace(temp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            temp = None
        except OSError as e:
            raise _fs_failure(e, shown) from None
        finally:
            if temp is not None:
                try:
                    os.unlink(temp, dir_fd=dir_fd)
                except OSError:
                    pass
            os.close(dir_fd)


# --- globs ---

_GLOB_MAX_ALTERNATIVES = 64  # {a,b}{c,d}...: more than this many spelled-out patterns is refused
_STAR = "*"


def _expand_braces(pattern):
    """The patterns ``{a,b}`` alternatives spell out (nested ones too): the first brace that
    closes and holds a comma of its own is spelled out, and each of its patterns in turn (a
    brace or comma escaped with "\\" is a character).
    One pass finds it (a brace closes at the first "}" that balances it; a comma is its
    innermost open brace's), so a glob of thousands of braces takes no quadratic time."""
    opened, commas, groups = [], {}, 0
    first = None  # (the first brace that closes holding a comma, where it closes)
    escaped = False
    for i, c in enumerate(pattern):
        if escaped:  # \{, \, and \} are themselves (the tokens read them so), no alternative
            escaped = False
        elif c == "\\":
            escaped = True
        elif c == "{":
            opened.append(i)
            commas[i] = []
        elif c == "," and opened:
            commas[opened[-1]].append(i)
        elif c == "}" and opened:
            start = opened.pop()
            if commas[start]:
                groups += 1
                if first is None or start < first[0]:
                    first = (start, i)
    if first is None:
        return [pattern]

    def too_many():
        return _ToolFailure(f"the glob {_echo(pattern)} spells out more than "
                            f"{_GLOB_MAX_ALTERNATIVES} patterns")

    if groups >= _GLOB_MAX_ALTERNATIVES:  # each adds a pattern at least (and a level of calls)
        raise too_many()
    start, end = first
    head, tail = pattern[:start], pattern[end + 1:]
    bounds = [start] + commas[start] + [end]
    expanded = []
    for a, b in zip(bounds, bounds[1:]):
        for each in _expand_braces(head + pattern[a + 1:b] + tail):
            expanded.append(each)
            if len(expanded) > _GLOB_MAX_ALTERNATIVES:
                raise too_many()
    return expanded


# [[:name:]] in a class, as git's wildmatch reads it: ASCII alone (and git's isspace has no
# \v or \f)
_GLOB_CLASSES = {
    "alnum": (("0", "9"), ("A", "Z"), ("a", "z")), "alpha": (("A", "Z"), ("a", "z")),
    "blank": (("\t", "\t"), (" ", " ")), "cntrl": (("\0", "\x1f"), ("\x7f", "\x7f")),
    "digit": (("0", "9"),), "graph": (("!", "~"),), "lower": (("a", "z"),),
    "print": ((" ", "~"),), "punct": (("!", "/"), (":", "@"), ("[", "`"), ("{", "~")),
    "space": (("\t", "\n"), ("\r", "\r"), (" ", " ")), "upper": (("A", "Z"),),
    "xdigit": (("0", "9"), ("A", "F"), ("a", "f")),
}
_NO_CHARACTER = (False, ())  # a class of nothing: the token no name gets past


def _glob_class(pattern, i):
    """The class that opens at ``pattern[i]``, read as git's wildmatch reads it: (its token,
    where its "]" is), or None where no "]" closes it. A "]" first is one of it, "\\"
    escapes (a range's ends too), "a-" before "]" is a and -, and an unknown [:name:]
    makes the class match nothing (git gives up on the whole pattern there)."""
    j = i + 1
    negated = pattern[j:j + 1] in ("!", "^")
    j += negated
    ranges, previous, known, n = [], None, True, len(pattern)
    first, close = j, -1  # close: the first "]" after a "[:" seen, kept for the next "[:"
    while j < n and (j == first or pattern[j] != "]"):
        c = pattern[j]
        if c == "\\":
            j += 1
            if j == n:
                return None
            c = previous = pattern[j]
            ranges.append((c, c))
        elif c == "-" and previous is not None and j + 1 < n and pattern[j + 1] != "]":
            j += 1 + (pattern[j + 1] == "\\")
            if j == n:
                return None
            ranges.append((previous, pattern[j]))  # z-a: nothing (z itself was one already)
            previous = None
        elif c == "[" and pattern[j + 1:j + 2] == ":":
            if close < j + 2:  # looked for again only past it: "[:x" * 200,000 took a second
                close = pattern.find("]", j + 2)
            if close < 0:
                return None
            if close > j + 2 and pattern[close - 1] == ":":
                name = pattern[j + 2:close - 1]
                known = known and name in _GLOB_CLASSES
                ranges.extend(_GLOB_CLASSES.get(name, ()))
                j, previous = close, None
            else:  # no ":]" before the "]": the "[" is a character of the class
                ranges.append(("[", "["))
                previous = "["
        else:
            ranges.append((c, c))
            previous = c
        j += 1
    if j >= n:
        return None
    return ((negated, tuple(ranges)) if known else _NO_CHARACTER), j


def _glob_segments(pattern, gitignore=False):
    """A glob's "/"-separated segments, each "**" or tokens: "*", "?", a character, or
    (negated, set of ranges) for a class. "\\x" is x ("\\/" a "/"), a "/" inside a class
    separates nothing. A class left open is a "[" and a trailing lone "\\" a "\\" in a
    glob; in a .gitignore (``gitignore``) either makes the pattern match nothing, as in git."""
    segments, tokens, start = [], [], 0  # start: where the segment begins, to tell "**" apart
    i, n = 0, len(pattern)
    closes = True  # a class may yet close: once one ran to the end, no "[" after it is read
    # as one, or each would read to the end again ("[" * 8000 took 15 s)
    while i <= n:
        c = pattern[i:i + 1]  # "" past the end, which ends the last segment
        if c in ("/", "") or c == "\\" and pattern[i + 1:i + 2] == "/":
            raw = pattern[start:i]  # a string grown a character at a time took quadratic time
            segments.append("**" if len(raw) > 1 and not raw.strip("*") else tokens)  # *** is ** too
            i += 1 + (c == "\\")
            tokens, start = [], i
            continue
        if c == "\\" and i + 1 < n:  # an escaped character stands for itself (a set of one)
            i += 1
            tokens.append((False, ((pattern[i], pattern[i]),)))
        elif c == "\\" and gitignore:
            tokens.append(_NO_CHARACTER)
        elif c == "*":
            if not tokens or tokens[-1] != _STAR:  # ** inside a name is *
                tokens.append(_STAR)
        elif c == "[":
            found = _glob_class(pattern, i) if closes else None
            if found is None and gitignore:
                return [[_NO_CHARACTER]]
            if found is None:
                closes = False
                tokens.append(c)
            else:
                tokens.append(found[0])
                i = found[1]
        else:
            tokens.append(c)
        i += 1
    return segments


def _token_matches(token, c):
    if token == "?":
        return True
    if isinstance(token, tuple):
        negated, ranges = token
        return any(low <= c <= high for low, high in ranges) != negated
    return token == c


def _segment_matches(tokens, name):
    """Whether ``name`` matches a segment's tokens: the star-backtracking walk, O(n*m) at worst."""
    p = i = 0
    star, mark = -1, 0
    while i < len(name):
        if p < len(tokens) and tokens[p] != _STAR and _token_matches(tokens[p], name[i]):
            p += 1
            i += 1
        elif p < len(tokens) and tokens[p] == _STAR:
            star, mark = p, i
            p += 1
        elif star >= 0:
            p = star + 1
            mark += 1
            i = mark
        else:
            return False
    while p < len(tokens) and tokens[p] == _STAR:
        p += 1
    return p == len(tokens)


def _path_matches(segments, parts):
    """Whether the path ``parts`` match glob ``segments`` ("**" spans any number of folders)."""
    def closure(states):  # "**/**": the state past one "**" may stand before another
        pending = list(states)
        while pending:
            p = pending.pop()
            if p < len(segments) and segments[p] == "**" and p + 1 not in states:
                states.add(p + 1)
                pending.append(p + 1)
        return states

    states = closure({0})
    for part in parts:
        following = set()
        for p in states:
            if p < len(segments):
                if segments[p] == "**":
                    following.add(p)
                elif _segment_matches(segments[p], part):
                    following.add(p + 1)
        states = closure(following)
        if not states:
            return False
    return len(segments) in states


class _Glob:
    """A glob test ``(path relative to the folder, file name) -> bool``: ``**`` spans folders,
    ``*`` and ``?`` stay within a name, ``[...]`` is a class and ``{a,b}`` an alternative; a
    pattern without "/" tests the file name at any depth. Matching never backtracks
    without bound, whatever the pattern. ``gitignore=True`` reads a .gitignore's pattern as
    git does: braces are themselves, and "./" is no prefix (git matches no name with it)."""

    def __init__(self, pattern, gitignore=False):
        while pattern.startswith("./") and not gitignore:
            pattern = pattern[2:]
        self.by_name = "/" not in pattern
        self.patterns = [pattern] if gitignore else _expand_braces(pattern)  # braces spelled out
        self.alternatives = [_glob_segments(each, gitignore) for each in self.patterns]

    def __call__(self, rel, name):
        parts = [name] if self.by_name else rel.split("/")
        return any(_path_matches(segments, parts) for segments in self.alternatives)


def _match_all(rel, name):
    return True


def _name_pattern(tokens):
    """A regular expression (its text) that matches what a glob segment's tokens match,
    where it has at most one star (so it cannot backtrack far); else None."""
    if tokens == "**" or tokens.count(_STAR) > 1:
        return None
    parts = []
    for token in tokens:
        if token == _STAR:
            parts.append(".*")
        elif token == "?":
            parts.append(".")
        elif isinstance(token, tuple):
            negated, ranges = token
            body = "".join(re.escape(low) if low == high else f"{re.escape(low)}-{re.escape(high)}"
                           for low, high in ranges)
            parts.append(f"[{'^' if negated else ''}{body}]" if body else "." if negated else "(?!)")
        else:
            parts.append(re.escape(token))
    return "".join(parts)


@functools.lru_cache(maxsize=8)  # a search worker is given the same text batch after batch
def _gitignore_rules(text):
    """The rules of a .gitignore: (negated, folders only, anchored, _Glob segments, and for a
    rule on names alone its regular expression's fullmatch, else None), in a tuple. Git
    matches bytes ("?" or a class takes one byte of a name's UTF-8): the rules are read as
    Latin-1, a byte a character, and so are the names (see _ignored)."""
    rules = []
    text = text.encode("utf-8", "surrogateescape").decode("latin-1")
    for line in text.split("\n"):  # git ends a rule at \n alone (a form feed is a name's)
        line = line.removesuffix("\r")
        stripped = line.rstrip(" ")  # git drops trailing spaces (not tabs), but an escaped one
        if stripped != line:  # (after an odd run of backslashes) and those before it stay
            line = stripped + " " if (len(stripped) - len(stripped.rstrip("\\"))) % 2 else stripped
        if not line or line.startswith("#"):  # a name beginning with # or ! is written \# or \!
            continue
        negated = line.startswith("!")
        line = line[1:] if negated else line
        # git drops one "/" at the end (for folders only) and one at the start (anchored): the
        # rest stays, so that build// and //build match no name
        folders_only = line.endswith("/")
        line = line.removesuffix("/")
        # dir/** (or dir/***): what is inside the folder, not the folder (a ! may take back a file)
        if line.endswith("**") and line.rstrip("*").endswith("/"):
            line += "/*"
        anchored = "/" in line
        line = line.removeprefix("/")
        if line:
            try:
                alternatives = _Glob(line, gitignore=True).alternatives
            except _ToolFailure:
                continue
            names = None  # the common rule (*.pyc, build/): one regex a name, not the walk
            if not anchored and all(len(segments) == 1 for segments in alternatives):
                patterns = [_name_pattern(segments[0]) for segments in alternatives]
                try:
                    if None not in patterns:
                        names = re.compile("|".join(f"(?:{p})" for p in patterns),
                                           re.DOTALL).fullmatch
                except re.error:  # a range such as z-a: the walk says it matches nothing
                    pass
            rules.append((negated, folders_only, anchored, alternatives, names))
    return tuple(rules)


def _ignored(rules, rel, name, is_dir):
    """Whether the .gitignore ``rules`` ignore the path ``rel`` from the root (last rule wins)."""
    if not rel.isascii():  # the bytes, as the rules are read (see _gitignore_rules)
        rel = rel.encode("utf-8", "surrogateescape").decode("latin-1")
        name = name.encode("utf-8", "surrogateescape").decode("latin-1")
    ignored = False
    for negated, folders_only, anchored, alternatives, names in rules:
        if folders_only and not is_dir:
            continue
        if names is not None:
            if names(name):
                ignored = not negated
            continue
        parts = rel.split("/") if anchored else [name]
        if any(_path_matches(segments, parts) for segments in alternatives):
            ignored = not negated
    return ignored


# --- file tools and search ---

_SEARCH_MAX_MATCHES = 200       # search shows at most this many matching lines
_SEARCH_LINE_CHARS = 500        # search cuts the lines it shows to this
_SEARCH_SECONDS = 30            # a search stops after this long, saying so
_SEARCH_BLOCK_BYTES = 16 << 20  # a file is searched in blocks of whole lines of about this size
_SEARCH_LINE_MAX_BYTES = 64 << 20  # a longer line is searched in pieces
_PROCESS_LINE_MAX_BYTES = 256 << 10  # of a line a search process prints (or its stderr), what is kept
_ARGUMENT_MAX_BYTES = (128 << 10) - 1  # Linux's limit on one argument of a process
_PROCESS_POLL_SECONDS = 0.05    # how often a tool's process is checked against signal and clock
_SEARCH_PARTS_MAX = 4           # workers that share a folder's search, one per CPU up to this
_SEARCH_WORKERS_KEPT = 4        # idle search workers kept for the next search
_SEARCH_SPLIT_FOLDERS = 256     # folders looked into to cut a search among workers,
_SEARCH_SPLIT_WORK = 200_000    # as long as their entries times .gitignore's rules stay below
_SEARCH_WORKER_MAX_BYTES = 2 << 30  # a search worker's memory (a pattern that keeps a group
                                    # per repeat asks some 150 bytes per byte of a long line)
_WORKER_BOOT = (  # a search worker: this very file, loaded under another name
    "import sys\n"
    "if len(sys.argv) > 2:  # in a zip: its importer gives the code, of source or bytecode\n"
    "    import types, zipimport\n"
    "    module = sys.modules['lich_search_worker'] = types.ModuleType('lich_search_worker')\n"
    "    module.__file__ = sys.argv[1]\n"
    "    exec(zipimport.zipimporter(sys.argv[2]).get_code(sys.argv[3]), module.__dict__)\n"
    "else:\n"
    "    import importlib.util\n"
    "    spec = importlib.util.spec_from_file_location('lich_search_worker', sys.argv[1])\n"
    "    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)\n"
    "    spec.loader.exec_module(module)\n"
    "module._search_worker()\n")


def _zip_boot_argv():
    """The arguments of ``_WORKER_BOOT`` that find this module in the zip it was imported
    from (a zipapp, a .zip on sys.path): its path, the importer's folder, made absolute as
    the module loads (the folder may change), and its name; else None."""
    import zipimport

    source, loader = globals().get("__file__"), globals().get("__loader__")
    if not (source and isinstance(loader, zipimport.zipimporter)):
        return None
    spec = globals().get("__spec__")
    name = (spec.name if spec is not None else __name__).rpartition(".")[2]
    return [source, os.path.abspath(os.path.join(loader.archive, loader.prefix)), name]


_ZIP_BOOT_ARGV = _zip_boot_argv()


def _worker_boot_argv():
    """The arguments of ``_WORKER_BOOT`` that find this file: its path, or its place in a
    zip; None when there is neither (then the calling thread searches)."""
    source = globals().get("__file__")
    if source and os.path.isfile(source):
        return [os.path.abspath(source)]
    return _ZIP_BOOT_ARGV


def _read_lines(f, max_chars, signal):
    """(text, cut) per line of the binary file ``f``: at most ``max_chars`` characters of the
    line (undecodable bytes replaced) and how many more it had; memory stays bounded. A line
    longer than ``_READ_LINE_MAX_BYTES`` ends the reading, its cut None (not counted to its
    end). A set ``signal`` is a _ToolFailure, checked as a long line is read."""
    cap = max_chars * _UTF8_MAX_BYTES + 2
    while True:
        if signal.is_set():
            raise _ToolFailure("the read was aborted")
        raw = f.readline(cap)
        if not raw:
            return
        if raw.endswith(b"\n") or len(raw) < cap:
            text = raw.decode("utf-8", "replace")
            text = text.removesuffix("\n").removesuffix("\r")
            yield text[:max_chars], max(0, len(text) - max_chars)
            continue
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        text = decoder.decode(raw)
        more, read = 0, len(raw)
        while True:
            if signal.is_set():
                raise _ToolFailure("the read was aborted")
            if read > _READ_LINE_MAX_BYTES:
                yield text[:max_chars], None
                return
            chunk = f.readline(_FILE_READ_BYTES)
            read += len(chunk)
            ended = chunk.endswith(b"\n") or not chunk
            more += len(decoder.decode(chunk.rstrip(b"\r\n") if ended else chunk, final=ended))
            if ended:
                break
        yield text[:max_chars], len(text) - max_chars + more


def _is_binary(f):
    """Whether the binary file ``f`` holds a NUL byte near its start; rewinds it."""
    head = f.read(_BINARY_SNIFF_BYTES)
    f.seek(0)
    return b"\0" in head


def _search_regex(pattern):
    """``pattern`` compiled MULTILINE, quietly: Python's FutureWarning about a '[' in a set
    (POSIX's ``[[:digit:]]``, which ripgrep reads as a class), or 3.9's and 3.10's
    DeprecationWarning about flags after the start, would reach the terminal.

    The warning filters are the process's: only a pattern that may warn changes them, for
    the compile, one search at a time (searches in threads that overlapped restored each
    other's filters, silencing the application's FutureWarnings for good)."""
    if "[" not in pattern and "(?" not in pattern:
        return re.compile(pattern, re.MULTILINE)
    import warnings

    with _search_regex_lock, warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        return re.compile(pattern, re.MULTILINE)


_search_regex_lock = _ForkSafeLock()


def _same_in_ripgrep(pattern) -> bool:
    """Whether ripgrep reads ``pattern`` as Python does, as far as its syntax shows: not when a
    set holds a '[' (a nested set or a POSIX class to ripgrep) or a doubled '&', '-', '~' or
    '|' (set operations); nor with \\< \\> \\b{ \\B{ (word boundaries to ripgrep, plain
    characters to Python), \\A or \\z (a line's ends to ripgrep, the text's to Python), a
    brace with spaces (``{ 0 }``: a count to ripgrep, text to Python), a possessive ``*+``
    (a repeat of a repeat to ripgrep), verbose mode, or flags after the start (the whole
    pattern's to Python 3.9 and 3.10, what follows to ripgrep). What Python or ripgrep
    refuses is no question: each checks it."""
    if (re.search(r"\(\?[a-zA-Z]*x|\{[\d,\s]*\s[\d,\s]*\}|[*+?}]\+", pattern)
            or re.search(r".\(\?[a-zA-Z-]+\)", pattern)):
        return False
    in_set, first, i = False, 0, 0
    while i < len(pattern):
        char = pattern[i]
        if char == "\\":
            escaped = pattern[i + 1:i + 3]
            if not in_set and (escaped[:1] in ("<", ">", "A", "z") or escaped in ("b{", "B{")):
                return False
            i += 2
            continue
        if in_set:
            if char == "[" or (char in "&-~|" and pattern[i + 1:i + 2] == char):
                return False
            in_set = not (char == "]" and i > first)  # a ']' first in a set is one of it
        elif char == "[":
            in_set = True
            first = i + 1 + (pattern[i + 1:i + 2] == "^")
        i += 1
    return True


def _glob_within_ripgreps(glob, patterns) -> bool:
    """Whether ripgrep's ``--glob glob`` keeps every file name that lich's glob (spelled out
    as ``patterns``) matches: not with a "/", an unpaired bracket, a brace lich does not
    spell out ({a}.txt is a name to lich, an error or an alternative to ripgrep), a "?" or a
    negated or non-ASCII class (one byte to ripgrep, one character to lich), a leading "!"
    (an exclusion to ripgrep), an empty alternative (dropped by ripgrep), a pattern that
    ends in "." (ripgrep matches no name with it), a "\\" (ripgrep reads its escapes
    otherwise, in a class above all) or a [:alpha:] (no class to ripgrep)."""
    return ("/" not in glob and "?" not in glob and not glob.startswith("!")
            and "\\" not in glob and "[:" not in glob
            and glob.count("[") == glob.count("]")
            and not ("[" in glob and (not glob.isascii() or re.search(r"\[[!^]", glob)))
            and not re.search(r"[{,][,}]", glob)
            and not any(c in each for each in patterns for c in "{}")
            and not any(each.endswith(".") for each in patterns))


def _search_text(regex, text, number, found):
    """``found(line number, line, column of the match)`` for each line of ``text`` (its first
    line numbered ``number``) in which ``regex`` (compiled MULTILINE) matches: one pass over
    the whole text, the line only looked at again when a match spans lines."""
    if not text:  # no line in no text (an empty file, the empty end of one of whole blocks)
        return
    end = len(text) - 1 if text.endswith("\n") else len(text)  # no line after a last newline
    pos = counted = 0
    while pos <= end:
        match = regex.search(text, pos)
        if match is None or match.start() > end:
            break
        line_start = text.rfind("\n", 0, match.start()) + 1
        line_end = text.find("\n", match.start())
        line_end = len(text) if line_end < 0 else line_end
        number += text.count("\n", counted, line_start)
        counted = line_start
        line = text[line_start:line_end]
        if match.end() <= line_end:
            found(number, line, match.start() - line_start)
        else:
            within = regex.search(line)
            if within is not None:
                found(number, line, within.start())
        pos = line_end + 1


def _search_file(regex, fd, size, found, check):
    """``found(line number, line, column)`` per matching line of the file open as ``fd`` (``size``
    bytes long, by its fstat), read in blocks of whole lines; ``check()`` between blocks. A
    file with a NUL byte near its start is skipped."""
    number, carry, first, offset = 1, b"", True, 0
    # A read allocates what it asks for: a small file is read in one read of its own size.
    want = min(_SEARCH_BLOCK_BYTES, size + 1)
    while True:
        block = os.read(fd, want)
        offset += len(block)
        last = not block or (len(block) < want and offset >= size)  # a short read at its size: the end
        if first:
            if block.find(b"\0", 0, _BINARY_SNIFF_BYTES) >= 0:
                return
            block = block.removeprefix(codecs.BOM_UTF8)  # a mark, not text (ripgrep drops it too)
            first = False
        data = carry + block if carry else block
        cut = len(data) if last else data.rfind(b"\n") + 1
        if cut == 0 and not last:  # no line end yet
            if len(data) < _SEARCH_LINE_MAX_BYTES:
                carry = data
                continue
            cut = len(data)
        chunk, carry = data[:cut], data[cut:]
        text = chunk.decode("utf-8", "replace")
        if "\r" in text:
            text = text.replace("\r\n", "\n")
        _search_text(regex, text, number, found)
        if last:
            return
        number += text.count("\n")
        want = _SEARCH_BLOCK_BYTES  # a file that grew since, or a short read: on in whole blocks
        check()


def _search_tree(regex, fd, is_folder, prefix, wanted, rules, emit, check, *, base="",
                 recursive=True):
    """Search the folder (or file) open as ``fd``: ``emit("m", path, number, line, column)`` per
    match and ``emit("x", path, reason)`` per folder or file not searched. Paths are ``prefix`` plus
    the path from the folder; links are not followed; ``rules`` are the root's .gitignore.
    Where the folder is part of a larger search, ``base`` is its path from the searched
    folder (for ``wanted``), and ``recursive=False`` searches only its own files. Closes
    ``fd``."""
    if not is_folder:
        try:
            _search_file(regex, fd, os.fstat(fd).st_size,
                         lambda n, line, column: emit("m", prefix, n, line, column), check)
        finally:
            os.close(fd)
        return
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) \
        | getattr(os, "O_CLOEXEC", 0)

    def visit(rel, entry, is_dir, folder_fd):
        path = prefix + rel
        if rules and _ignored(rules, path, entry.name, is_dir):
            return False
        if is_dir:
            return recursive and entry.name not in _SKIP_DIRS
        if entry.is_file(follow_symlinks=False) and wanted(base + rel, entry.name):
            check()
            try:
                file_fd = os.open(entry.name, flags, dir_fd=folder_fd)
            except OSError as e:
                if e.errno != errno.ENOENT:  # unreadable; one that vanished meanwhile is no loss
                    emit("x", path, e.strerror or str(e))
                return False
            try:
                status = os.fstat(file_fd)
                if stat.S_ISREG(status.st_mode):
                    _search_file(regex, file_fd, status.st_size,
                                 lambda n, line, column: emit("m", path, n, line, column), check)
            except OSError as e:  # unreadable meanwhile
                emit("x", path, e.strerror or str(e))
            finally:
                os.close(file_fd)
        return False

    _, skipped = _walk_tree(fd, visit, depth=base.count("/"))
    for path, reason in skipped:
        emit("x", prefix + path, reason)


def _open_beneath(folder_fd, rel, flags):
    """``rel`` opened from the folder ``folder_fd`` one name at a time, following no link."""
    parts = rel.split("/")
    fd = folder_fd
    try:
        for part in parts[:-1]:
            child = os.open(part, _PASSED_FOLDER_FLAGS, dir_fd=fd)
            if fd != folder_fd:
                os.close(fd)
            fd = child
        return os.open(parts[-1], flags, dir_fd=fd)
    finally:
        if fd != folder_fd:
            os.close(fd)


def _search_parts():
    """How many workers share a folder's search: one per CPU this process may use, at most
    _SEARCH_PARTS_MAX."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(_SEARCH_PARTS_MAX, cpus or 1))


class _Stopped(Exception):
    """A search stopped in this process: ``args[0]`` is "aborted" or "timeout"."""


def _stop_check(signal, deadline):
    """A check() that raises _Stopped("aborted") once ``signal`` is set and
    _Stopped("timeout") once the clock passes ``deadline``."""
    def check():
        if signal.is_set():
            raise _Stopped("aborted")
        if time.monotonic() >= deadline:
            raise _Stopped("timeout")
    return check


def _search_units(fd, prefix, rules, check):
    """The folder open as ``fd`` cut into pieces for workers that share its search: the first
    ``_SEARCH_SPLIT_FOLDERS`` folders breadth first (fewer where their entries times the
    .gitignore's rules pass ``_SEARCH_SPLIT_WORK``), each for its own files, then every
    folder below them whole. Returns (units, skipped): [path from the folder, whether below
    too] each, and the (path, reason) of folders that could not be read. ``check()`` is
    called every few hundred entries."""
    units, skipped = [], []
    queue = deque([""])
    work = 0
    for _ in range(_SEARCH_SPLIT_FOLDERS):
        if not queue:
            break
        check()
        sub = queue[0]
        try:
            folder_fd = _open_beneath(fd, sub, _SUBFOLDER_FLAGS) if sub else os.dup(fd)
            try:
                with os.scandir(folder_fd) as listing:
                    entries = []
                    for entry in listing:  # a huge folder is not read to its end here
                        entries.append(entry)
                        if len(entries) % 4096 == 0:
                            check()
                            if work + len(entries) * (1 + len(rules)) > _SEARCH_SPLIT_WORK:
                                break
            finally:
                os.close(folder_fd)
        except OSError as e:
            queue.popleft()
            skipped.append((prefix + sub, e.strerror or str(e)))
            continue
        work += len(entries) * (1 + len(rules))
        if work > _SEARCH_SPLIT_WORK:  # too large to look into here: one worker takes it whole
            break
        queue.popleft()
        entries.sort(key=lambda entry: entry.name)
        has_files = False
        for i, entry in enumerate(entries):
            if i % 256 == 255:
                check()
            try:
                is_dir = entry.is_dir(follow_symlinks=False)
            except OSError:
                continue
            if not is_dir:  # which of them to search is the worker's to say
                has_files = True
                continue
            path = f"{sub}/{entry.name}" if sub else entry.name
            if entry.name in _SKIP_DIRS or rules and _ignored(rules, prefix + path, entry.name, True):
                continue
            elif path.count("/") >= _WALK_MAX_DEPTH:  # as _walk_tree does
                skipped.append((prefix + path, f"deeper than {_WALK_MAX_DEPTH} levels"))
            else:
                queue.append(path)
        if has_files:
            units.append([sub, False])
    return [[sub, True] for sub in queue] + units, skipped  # the larger first: an even end


def _search_worker():
    """A search worker's main: one search per job line on stdin, its records as JSON lines on
    stdout, then ``["done"]``. A job with ``units`` searches only those folders of the
    searched one: [path from it, whether to search below]. An alarm ends the process if a
    job outlives its time limit: its default action kills even a process caught in a regex."""
    import signal as signals

    try:  # a search that needs more fails; it does not take the machine's memory
        import resource

        hard = resource.getrlimit(resource.RLIMIT_AS)[1]
        resource.setrlimit(resource.RLIMIT_AS, (_SEARCH_WORKER_MAX_BYTES if hard == resource.RLIM_INFINITY
                                                else min(hard, _SEARCH_WORKER_MAX_BYTES), hard))
    except (ImportError, ValueError, OSError):  # no such limit here
        pass
    out = sys.stdout
    out.reconfigure(line_buffering=True)  # what was found is lich's even if the job is stopped

    def emit(*record):
        if record[0] == "m":  # only what is shown travels: a line stays well under the pipe's cut
            record = (*record[:3], _shown_line(record[3], record[4]))
        out.write(json.dumps(record) + "\n")

    for line in sys.stdin:
        job = json.loads(line)
        signals.alarm(math.ceil(job["seconds"]) + 1)
        try:
            regex = _search_regex(job["pattern"])
            wanted = _Glob(job["glob"]) if job["glob"] else _match_all
            rules = _gitignore_rules(job["gitignore"])
            flags = (os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) if job["folder"] else
                     os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)) | getattr(os, "O_NOFOLLOW", 0)
            root = os.open(job["root"], _PASSED_FOLDER_FLAGS & ~getattr(os, "O_NOFOLLOW", 0))
            try:
                for sub, recursive in job.get("units") or [["", True]]:
                    rel = "/".join(p for p in (job["rel"], sub) if p and p != ".") or "."
                    try:
                        fd = os.open(".", flags, dir_fd=root) if rel == "." else _open_beneath(root, rel, flags)
                    except OSError as e:
                        if not sub:
                            raise
                        emit("x", job["prefix"] + sub, e.strerror or str(e))  # gone meanwhile
                        continue
                    base = sub + "/" if sub else ""
                    _search_tree(regex, fd, job["folder"], job["prefix"] + base, wanted, rules,
                                 emit, lambda: None, base=base, recursive=recursive)
            finally:
                os.close(root)
        except (OSError, re.error, _ToolFailure) as e:
            emit("e", str(e))
        except MemoryError:
            emit("e", f"it needed more than {_SEARCH_WORKER_MAX_BYTES >> 30} GB of memory (a "
                      f"pattern that keeps a group for each repeat, on a long line): simplify the "
                      f"pattern, or narrow the path or glob")
        signals.alarm(0)
        emit("done")
        out.flush()


class _SearchWorkers:
    """Search workers kept between searches, so a search costs no process start; a worker
    whose search must stop (time limit, signal) is killed, never reused."""

    def __init__(self):
        self._idle = []
        self._finalizers = {}  # pid: the finalizer that kills the worker's group
        self._lock = threading.Lock()

    def __getstate__(self):
        return {}

    def __setstate__(self, state):
        self.__init__()

    def search(self, job, on_record, signal, units=None):
        """("done", error or None), ("timeout" | "aborted", None), or None when no worker
        starts. With ``units`` (of the folder the job searches), up to _search_parts() workers
        share them: each is given the next few whenever it is done with its last."""
        import selectors
        workers = []
        for _ in range(_search_parts() if units else 1):
            worker = self._take()
            if worker is None:
                break
            workers.append(worker)
        if not workers:
            return None
        deadline = time.monotonic() + job["seconds"]
        left = deque(units or ())
        pending = {worker: bytearray() for worker in workers}  # output after its last line end
        busy, error, ended, died = set(), [], None, None

        def give(worker):
            """The next few units to ``worker`` (the whole job without units); False when it
            cannot take them (they stay to be given)."""
            batch = []
            if units:
                size = max(1, len(left) // (2 * len(workers)))  # smaller as the end nears
                batch = [left.popleft() for _ in range(min(size, len(left)))]
                task = {**job, "units": batch, "seconds": max(0.0, deadline - time.monotonic())}
            else:
                task = job
            try:
                worker.stdin.write((json.dumps(task) + "\n").encode())
                worker.stdin.flush()
            except OSError:
                left.extendleft(reversed(batch))
                return False
            busy.add(worker)
            return True

        def on_line(line, worker):
            nonlocal died
            try:
                record = json.loads(line)
            except ValueError:  # a record past the cut (a path of thousands of escapes)
                return
            if record[0] == "done":
                busy.discard(worker)
                if left and not error and not give(worker):
                    died = worker
            elif record[0] == "e":
                error.append(record[1])
            else:
                on_record(record)

        try:
            for worker in list(workers):
                if (left or not units) and not give(worker):  # it died while it was kept
                    workers.remove(worker)
                    self._end(worker)
            if not busy:
                return None
            with selectors.DefaultSelector() as selector:
                for worker in workers:
                    selector.register(worker.stdout, selectors.EVENT_READ, worker)
                while busy and died is None:
                    now = time.monotonic()
                    if signal.is_set() or now >= deadline:
                        ended = "aborted" if signal.is_set() else "timeout"
                        break
                    for key, _ in selector.select(min(_PROCESS_POLL_SECONDS, deadline - now)):
                        worker = key.data
                        chunk = os.read(worker.stdout.fileno(), _FILE_READ_BYTES)
                        if not chunk:
                            died = worker
                            break
                        pending[worker] += chunk
                        _split_lines(pending[worker], lambda line, w=worker: on_line(line, w))
        except BaseException:
            for worker in workers:
                self._end(worker)
            raise
        for worker in workers:
            if worker in busy or worker is died:
                self._end(worker)
            else:
                self._keep(worker)
        if died is not None:
            return "done", f"the search worker exited (code {died.returncode})"
        if ended is not None:
            return ended, None
        return "done", (error[0] if error else None)

    def _take(self):
        import subprocess
        with self._lock:
            while self._idle:
                worker = self._idle.pop()
                if worker.poll() is None:
                    return worker
                self._retire(worker)
        boot = _worker_boot_argv()
        if not (sys.executable and boot
                and os.path.basename(sys.executable).lower().startswith(("python", "pypy"))):
            return None  # no Python to start here (an embedding host): search in this process
        # -B and pycache_prefix as this process has them: no __pycache__ beside a vendored lich.py
        flags = ["-B"] if sys.dont_write_bytecode else []  # set by -B, or by the host in code
        if getattr(sys, "pycache_prefix", None):
            flags += ["-X", f"pycache_prefix={sys.pycache_prefix}"]
        try:  # -I and "/": no module of the searched folder (a json.py) is ever imported
            worker = subprocess.Popen([sys.executable, "-I", *flags, "-c", _WORKER_BOOT, *boot],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.DEVNULL, start_new_session=True,
                                      env=_tool_environment(), cwd="/")
        except OSError:
            return None
        # Killed when this object goes (or at exit) unless it ended before: its group id
        # may by then be another process's.
        self._finalizers[worker.pid] = weakref.finalize(self, _stop_search_worker, worker, os.getpid())
        return worker

    def _keep(self, worker):
        with self._lock:
            if len(self._idle) < _SEARCH_WORKERS_KEPT:
                self._idle.append(worker)
                return
        worker.stdin.close()  # it ends at the end of its input
        self._retire(worker)

    def _end(self, worker):
        _kill_group(worker.pid)
        self._retire(worker)

    def _retire(self, worker):
        """Reap an ending worker, close its pipes and forget its finalizer."""
        self._finalizers.pop(worker.pid).detach()
        _close_worker(worker)


def _close_worker(worker):
    for pipe in (worker.stdin, worker.stdout):
        try:
            pipe.close()
        except OSError:  # a write to a worker that died
            pass
    worker.wait()


def _stop_search_worker(worker, owner):
    """A search worker kept idle, when its searcher goes or at exit: killed, by the process
    that started it only (a forked child that exits leaves its parent's workers be)."""
    if os.getpid() == owner:
        _kill_group(worker.pid)
        _close_worker(worker)


def _shown_line(line, column):
    """A matching line as search shows it: whole, or when longer than _SEARCH_LINE_CHARS,
    that many characters around the match at ``column`` with "…" where text was left out."""
    if len(line) <= _SEARCH_LINE_CHARS:
        return line
    width = _SEARCH_LINE_CHARS - 2  # room for both marks: a shown line is never cut again
    start = max(0, min(column - width // 5, len(line) - width))
    end = start + width
    return ("…" if start else "") + line[start:end] + ("…" if end < len(line) else "")


class _Matches:
    """The first matches in (path, line) order, however they arrive, and how many there were."""

    def __init__(self):
        self.clear()

    def clear(self):  # for a search begun again, by another engine
        self.kept = []
        self.total = 0
        self.skipped = []

    def add(self, path, number, line, column=0):
        self.total += 1
        self.kept.append((path, number, _shown_line(line, column)))
        if len(self.kept) >= 2 * _SEARCH_MAX_MATCHES:
            self.kept.sort()
            del self.kept[_SEARCH_MAX_MATCHES:]

    def lines(self):
        self.kept.sort()
        lines = [f"{path}:{number}: {line}" for path, number, line in self.kept[:_SEARCH_MAX_MATCHES]]
        if self.total > _SEARCH_MAX_MATCHES:
            lines.append(f"... {self.total - _SEARCH_MAX_MATCHES} more matches")
        return lines


def _check_argument(name, text):
    """_ToolFailure unless ``text`` can be one argument of a process: nothing
    ``_unencodable``, and within the length Linux gives one argument."""
    unheld = _unencodable(text, "which a process argument cannot hold")
    if unheld:
        raise _ToolFailure(f"{name} contains {unheld}")
    size = len(os.fsencode(text))
    if size > _ARGUMENT_MAX_BYTES:
        raise _ToolFailure(f"{name} is {size:,} bytes, over the {_ARGUMENT_MAX_BYTES:,} a process "
                           f"argument may hold: write long text with write_file, and keep the "
                           f"{name} short")


def _run_reader(argv, on_line, signal, *, cwd=None, stdin=None, seconds=_SEARCH_SECONDS):
    """Run ``argv`` in a process group of its own, ``on_line(bytes)`` per line it prints (each
    cut to _PROCESS_LINE_MAX_BYTES); returns (how it ended: "done", "timeout" or "aborted",
    exit code, the start of its stderr). The group is killed however the call ends."""
    import selectors
    import subprocess
    proc = subprocess.Popen(argv, cwd=cwd, stdin=stdin if stdin is not None else subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, env=_tool_environment())
    errors = bytearray()
    pending = bytearray()
    ended = "done"
    try:
        deadline = time.monotonic() + seconds
        with selectors.DefaultSelector() as selector:
            selector.register(proc.stdout, selectors.EVENT_READ)
            selector.register(proc.stderr, selectors.EVENT_READ)
            open_pipes = 2
            while open_pipes:
                if signal.is_set():
                    ended = "aborted"
                    break
                now = time.monotonic()
                if now >= deadline:
                    ended = "timeout"
                    break
                for key, _ in selector.select(min(_PROCESS_POLL_SECONDS, deadline - now)):
                    chunk = os.read(key.fd, _FILE_READ_BYTES)
                    if not chunk:
                        selector.unregister(key.fileobj)
                        open_pipes -= 1
                    elif key.fileobj is proc.stderr:
                        errors += chunk[:max(0, _PROCESS_LINE_MAX_BYTES - len(errors))]
                    else:
                        pending += chunk
                        _split_lines(pending, on_line)
        if ended == "done" and pending:
            on_line(bytes(pending))
    finally:
        _kill_group(proc.pid)
        proc.stdout.close()
        proc.stderr.close()
        proc.wait()
    return ended, proc.returncode, os.fsdecode(bytes(errors))  # a name in it as lich names it


def _split_lines(pending, on_line):
    """Hand every whole line of ``pending`` to ``on_line``; keep the rest, bounded."""
    start = 0
    while True:
        end = pending.find(b"\n", start)
        if end < 0:
            break
        on_line(bytes(pending[start:min(end, start + _PROCESS_LINE_MAX_BYTES)]))
        start = end + 1
    del pending[:start]
    if len(pending) > 2 * _PROCESS_LINE_MAX_BYTES:  # a line without end: its head is kept
        del pending[_PROCESS_LINE_MAX_BYTES:-_PROCESS_LINE_MAX_BYTES]


def _places(text, part) -> list:
    """The spans of ``part`` in ``text``, overlapping ones too ("end\nend" is twice in
    "end\nend\nend"), up to one more than ``_EDIT_COUNT_MAX``: plain string search, in
    time about the text's length whatever ``part`` holds."""
    spans, at = [], text.find(part)
    while at >= 0 and len(spans) <= _EDIT_COUNT_MAX:
        spans.append((at, at + len(part)))
        at = text.find(part, at + 1)
    return spans


class _Workspace:
    """The coding tools over one root folder; every path is confined to it."""

    def __init__(self, root, approve, shell_timeout, search_timeout):
        self.root = _Root(root)
        self.approve = approve
        self.shell_timeout = shell_timeout
        self.search_timeout = search_timeout
        self._workers = _SearchWorkers()

    def read_file(self, path: str, offset: int = 1, limit: int = _READ_DEFAULT_LIMIT,
                  *, signal: threading.Event) -> str:
        """Read a text file of the workspace: its lines, numbered from 1; long lines are cut.

        Args:
            path: The file, relative to the workspace root.
            offset: The number of the first line to read.
            limit: The most lines to read.
        """
        if offset < 1 or limit < 1:
            raise _ToolFailure("offset and limit must be 1 or more")
        lines = []
        size = number = 0
        go_on = None
        with self.root.open_file(self.root.resolve(path), path) as f:
            if _is_binary(f):
                raise _ToolFailure(f"path is a binary file, not text: {path}")
            for number, (text, cut) in enumerate(_read_lines(f, _LINE_MAX_CHARS, signal), 1):
                if number < offset:
                    if cut is None:
                        raise _ToolFailure(
                            f"line {number} of {path} is longer than {_READ_LINE_MAX_BYTES >> 20} "
                            f"MB: read_file reads no further (search finds what is beyond it)")
                    continue
                line = f"{number:6}\t{text}" + (
                    f" [... the line goes on past {_READ_LINE_MAX_BYTES >> 20} MB; nothing after "
                    f"it is read]" if cut is None else f" [... {cut} more characters]" if cut else "")
                if number >= offset + limit or (lines and size + len(line) > _READ_MAX_CHARS):
                    go_on = number
                    break
                lines.append(line)
                size += len(line) + 1
                if cut is None:
                    break
        if not lines:
            if number == 0:
                return "(the file is empty)"
            raise _ToolFailure(f"offset {offset} is past the end of {path}, which has {number} "
                               f"lines")
        if go_on is not None:
            lines.append(f"[... the file goes on; read more with offset={go_on}]")
        return "\n".join(lines)

    def list_files(self, path: str = ".", pattern: str = "**/*") -> str:
        """List the files under a folder of the workspace, sorted, as paths from the root;
        skips .git, node_modules, __pycache__, .venv and venv.

        Args:
            path: The folder, relative to the workspace root.
            pattern: A glob the file paths, relative to that folder, must match, such as
                "**/*.py" or "src/*.{js,ts}"; one without "/" matches file names at any depth.
        """
        found, complete, note = self.root.files(self.root.resolve(path), _Glob(pattern))
        lines = found[:_LIST_MAX_FILES]
        if len(found) > _LIST_MAX_FILES:
            lines.append(f"... {len(found) - _LIST_MAX_FILES} more")
        if not complete:
            lines.append(f"[... stopped after scanning {_WALK_MAX_ENTRIES} entries; narrow the "
                         f"path or pattern]")
        if note:
            lines.append(note)
        return "\n".join(lines) if lines else f"no files match {pattern} under {path}"

    def search(self, pattern: str, path: str = ".", glob: Optional[str] = None,
               *, signal: threading.Event) -> str:
        """Search the text files of the workspace, line by line, for a regular expression;
        answers with "file:line: text" lines.

        Args:
            pattern: A Python regular expression (the re module's syntax).
            path: The folder or file to search, relative to the workspace root.
            glob: Only search the files matching this glob, such as "*.py" or "src/**/*.ts".
        """
        try:
            regex = _search_regex(pattern)
        except re.error as e:
            raise _ToolFailure(f"invalid regular expression: {e}") from None
        if signal.is_set():
            raise _ToolFailure("the search was aborted")
        real = self.root.resolve(path)
        mode = self.root.stat(real, path).st_mode
        if stat.S_ISDIR(mode):
            fd = self.root.open_dir(real, path)
        elif stat.S_ISREG(mode):
            with self.root.open_file(real, path) as f:
                if _is_binary(f):  # a folder's binary files are passed over; one named is refused
                    raise _ToolFailure(f"path is a binary file, not text: {path}")
                fd = os.dup(f.fileno())
        else:
            raise _ToolFailure(f"path is not a regular file or a directory: {path}")
        folder = stat.S_ISDIR(mode)
        rel = self.root.relative(real)
        prefix = ("" if rel == "." else rel + "/") if folder else rel
        wanted = _Glob(glob) if glob else _match_all
        gitignore = self._gitignore()
        matches = _Matches()
        try:
            ended = self._search_with_rg(pattern, fd, folder, prefix, glob, wanted, gitignore,
                                         matches, signal)
            if ended is None:
                ended = self._search_in_worker(pattern, fd, real, folder, prefix, glob,
                                               gitignore, matches, signal)
            if ended is None:
                ended = self._search_here(regex, fd, folder, prefix, wanted, gitignore, matches,
                                          signal)
        finally:
            os.close(fd)
        if ended == "aborted":
            raise _ToolFailure("the search was aborted")
        lines = matches.lines()
        note = _skipped_note(sorted(matches.skipped), "searched")
        if note:
            lines.append(note)
        if ended == "timeout":
            lines.append(f"[... the search stopped at its time limit of {self.search_timeout:g} s; "
                         f"{'these are the matches found so far; ' if matches.total else ''}"
                         f"narrow the path, glob or pattern]")
        return "\n".join(lines) if lines else "no matches"

    def _gitignore(self):
        """The text of the root's .gitignore, or ""."""
        try:
            with self.root.open_file(os.path.join(self.root.path, ".gitignore"), ".gitignore") as f:
                return f.read(_EDIT_MAX_BYTES).decode("utf-8", "replace")
        except _ToolFailure:
            return ""

    def _search_with_rg(self, pattern, fd, folder, prefix, glob, wanted, gitignore, matches,
                        signal):
        """The search done by ripgrep, when it is on PATH and takes the pattern; else None."""
        import shutil

        rg = shutil.which("rg")
        if rg is None or not _same_in_ripgrep(pattern):
            return None
        try:  # ripgrep takes them as arguments; lich's own search, from a pipe
            _check_argument("pattern", pattern)
            _check_argument("glob", glob or "")
        except _ToolFailure:
            return None
        argv = [rg, "--no-config", "--line-number", "--column", "--with-filename", "--no-heading",
                "--null", "--color=never", "--hidden", "--no-ignore", "--no-follow",
                "--no-ignore-messages", "--crlf"]
        for name in sorted(_SKIP_DIRS):
            argv += ["--glob", f"!{name}/"]
        # ripgrep filters by the glob too (lich checks each path anyway) where it finds all
        # that lich's glob finds
        if glob and _glob_within_ripgreps(glob, wanted.patterns):
            argv += ["--glob", glob]
        rules = _gitignore_rules(gitignore) if gitignore else []
        ignore_file = None
        # From the root, ripgrep skips what is ignored; lich still checks each path, its rules
        # being the exact ones. Not with braces: ripgrep reads {a,b} as alternatives, git not;
        # nor with a line that ends in a blank other than a space or in a backslash and
        # spaces: ripgrep strips every trailing blank unless the line ends in "\ ", git
        # only spaces, keeping one a backslash escapes; nor with a "?" or a negated class
        # (a character to ripgrep, a byte to git), nor with a "\/" or a class holding "\",
        # ":" (git's escapes and [:alpha:]) or what is not ASCII, which ripgrep reads otherwise.
        if (folder and not prefix and rules and "{" not in gitignore
                and not re.search(r"(?:\\|[^\S\r\n ]) *\r?$", gitignore, re.MULTILINE)
                and not re.search(r"\?|\\/|\[(?:[!^]|[^\n]*(?:[\\:]|[^\x00-\x7f]))", gitignore)):
            import tempfile

            handle, ignore_file = tempfile.mkstemp(prefix="lich-gitignore-")
            with os.fdopen(handle, "w", encoding="utf-8") as f:
                f.write(gitignore)
            argv += ["--ignore-file", ignore_file]
        argv += ["--regexp", pattern, "--", "." if folder else "-"]
        checked = {}
        head = []  # the start of a file name that holds a newline, which split ripgrep's line

        def on_line(line):
            if head:
                line = head.pop() + b"\n" + line
            name, found, rest = line.partition(b"\0")
            if not found:  # --null ends every name: this line ends inside one
                head.append(line[:_PROCESS_LINE_MAX_BYTES])
                return
            number, _, rest = rest.partition(b":")
            column, _, text = rest.partition(b":")
            if not number.isdigit():
                return
            # ripgrep prints no column for an empty match at the end of a last line without a
            # line end: the line is all that follows, the match at its end ("10:30", whole,
            # when a column of 10 would lie past the line "30" that ripgrep did not cut)
            if not column.isdigit() or (int(column) - 1 > len(text)
                                        and len(line) < _PROCESS_LINE_MAX_BYTES):
                text = rest
                column = b"%d" % (len(text.rstrip(b"\r")) + 1)
            if folder:
                rel = os.fsdecode(name).removeprefix("./")
                keep = checked.get(rel)
                if keep is None:
                    if rules:  # thousands of rules take time per path: the clock runs here too
                        check()
                    keep = checked[rel] = wanted(rel, rel.rpartition("/")[2]) and not (
                        rules and _rg_path_ignored(rules, prefix, rel))
                if not keep:
                    return
                path = prefix + rel
            else:
                path = prefix
            line = text.rstrip(b"\r").decode("utf-8", "replace")
            at = int(column) - 1  # ripgrep counts bytes; an empty match at a line's end is at its length
            if at <= len(text):
                matches.add(path, int(number), line, len(text[:at].decode("utf-8", "replace")))
            else:  # past what a process's line keeps: its head, and where the match is
                where = f" [the match is at byte {at:,} of this line]"
                matches.add(path, int(number), line[:_SEARCH_LINE_CHARS - len(where) - 1] + "…" + where)

        cwd = f"/proc/self/fd/{fd}" if folder and _fd_path(fd) is not None else None
        if folder and cwd is None:
            cwd = os.path.join(self.root.path, prefix) if prefix else self.root.path
        check = _stop_check(signal, time.monotonic() + self.search_timeout)
        try:
            ended, code, errors = _run_reader(argv, on_line, signal, cwd=cwd,
                                              stdin=None if folder else fd,
                                              seconds=self.search_timeout)
        except _Stopped as stopped:  # ripgrep is stopped with it
            return stopped.args[0]
        except PermissionError:  # a folder that can be listed but not entered: ripgrep cannot
            return None  # start in it; the worker searches, and names what it cannot read
        finally:
            if ignore_file is not None:
                os.unlink(ignore_file)
        if ended == "done" and code == 2 and not matches.total and ("regex" in errors
                                                                    or "glob" in errors):
            return None  # a Python pattern (or a glob) ripgrep does not take: the worker searches
        if ended == "done" and code not in (0, 1, 2):  # it crashed (a panic is 101: no thread
            # could start, say) or was killed: what it printed is a part, and "no matches" a lie
            _log.debug("ripgrep ended with code %s: %s", code, errors[-500:])
            matches.clear()
            return None
        if folder:  # what ripgrep could not read is said, as lich's own search says it
            for unread in re.finditer(r"(?m)^rg: (.+): ([^:\n]+) \(os error (\d+)\)$", errors):
                rel = unread.group(1).removeprefix("./")
                if int(unread.group(3)) != errno.ENOENT and _rg_unread_is_noted(
                        fd, rel, wanted, rules, prefix):
                    matches.skipped.append((prefix + rel, unread.group(2)))
        return ended

    def _search_in_worker(self, pattern, fd, real, folder, prefix, glob, gitignore, matches,
                          signal):
        """The search done by a worker process of lich's own; None where none can start."""
        job = {"pattern": pattern, "glob": glob, "gitignore": gitignore, "folder": folder,
               "root": self.root.path, "rel": self.root.relative(real), "prefix": prefix,
               "seconds": self.search_timeout}

        def on_record(record):
            if record[0] == "m":
                matches.add(record[1], record[2], record[3])
            elif record[0] == "x":
                matches.skipped.append((record[1], record[2]))

        deadline = time.monotonic() + self.search_timeout
        units, skipped = None, []
        if folder and _search_parts() > 1:
            try:
                units, skipped = _search_units(fd, prefix, _gitignore_rules(gitignore),
                                               _stop_check(signal, deadline))
            except _Stopped as stopped:
                return stopped.args[0]
        job["seconds"] = max(0.0, deadline - time.monotonic())
        ended = self._workers.search(job, on_record, signal, units)
        if ended is None:
            return None
        matches.skipped += skipped
        if ended[1] is not None:
            raise _ToolFailure(f"the search failed: {ended[1]}")
        return ended[0]

    def _search_here(self, regex, fd, folder, prefix, wanted, gitignore, matches, signal):
        """The search done in this process: the signal is seen between blocks, but a regex
        that backtracks without end is not stopped (used only where no process can start)."""
        check = _stop_check(signal, time.monotonic() + self.search_timeout)

        def emit(kind, *record):
            if kind == "m":
                matches.add(*record)
            else:
                matches.skipped.append(record)

        try:
            _search_tree(regex, os.dup(fd), folder, prefix, wanted, _gitignore_rules(gitignore),
                         emit, check)
        except _Stopped as stopped:
            return stopped.args[0]
        return "done"

    def write_file(self, path: str, content: str, call: ToolCall) -> str:
        """Create or overwrite a text file of the workspace; missing folders are created.

        Args:
            path: The file, relative to the workspace root.
            content: The whole new text of the file.
        """
        real = self.root.resolve(path)
        try:
            mode = os.stat(real).st_mode
        except FileNotFoundError:
            mode = None
        except OSError as e:
            raise _fs_failure(e, path) from None
        if mode is not None and stat.S_ISDIR(mode):
            raise _ToolFailure(f"path is a directory: {path}")
        if mode is not None and not stat.S_ISREG(mode):
            raise _ToolFailure(f"path is not a regular file: {path}")
        try:
            data = content.encode("utf-8")
        except UnicodeEncodeError as e:
            raise _ToolFailure(f"content cannot be written as UTF-8: {e}") from None
        if self.approve is not None:
            self._approve(call)
            real = self.root.resolve(path)  # again: it may have changed while the user read
        with _file_lock(real):  # not amid an edit's read and write
            self.root.write(real, path, data)
        return f"wrote {len(content)} characters to {path}"

    def edit_file(self, path: str, old_text: str, new_text: str, call: ToolCall) -> str:
        """Replace old_text, which must occur exactly once in the file, with new_text.

        Args:
            path: The file, relative to the workspace root.
            old_text: The text to replace, copied exactly (whitespace included), with enough
                of its surroundings to occur only once.
            new_text: The text to put in its place.
        """
        if not old_text:
            raise _ToolFailure("old_text is empty; copy the exact text to replace from the file")
        real = self.root.resolve(path)
        if self.approve is not None:
            self._edited(real, path, old_text, new_text)  # a failing edit is not asked about
            self._approve(call)
            real = self.root.resolve(path)  # the file may have changed while the user read
        with _file_lock(real):  # read and written with no other write of it between
            edited, mixed = self._edited(real, path, old_text, new_text)
            self.root.write(real, path, edited)
        if mixed:  # a Latin-1 file, say: its new characters are not in its encoding
            return (f"replaced 1 occurrence of old_text in {path}; note: the file is not "
                    f"UTF-8, and new_text's characters that are not ASCII were written as UTF-8")
        return f"replaced 1 occurrence of old_text in {path}"

    def bash(self, command: str, call: ToolCall, signal: threading.Event) -> ToolResult:
        """Run a shell command.

        Args:
            command: The command, run by /bin/sh -c.
        """
        if not command.strip():
            raise _ToolFailure("command is empty")
        _check_argument("command", command)
        self._approve(call)
        return _run_shell(command, self.root.path, self.shell_timeout, signal)

    def _edited(self, real, path, old_text, new_text):
        """(the bytes of the file with its one ``old_text`` replaced, whether a file that is
        not UTF-8 got characters that are not ASCII); _ToolFailure otherwise.

        In a file with CRLF line ends, ``old_text`` matches across them as across LF (what
        read_file shows), and ``new_text`` is written with the line ends of the text it
        replaces, or of most of the file's lines where that text has none.
        """
        with self.root.open_file(real, path) as f:
            data = f.read(_EDIT_MAX_BYTES + 1)
        if len(data) > _EDIT_MAX_BYTES:
            raise _ToolFailure(f"{path} is too large to edit (over {_EDIT_MAX_BYTES} bytes); "
                               f"use write_file or bash")
        if b"\0" in data[:_BINARY_SNIFF_BYTES]:
            raise _ToolFailure(f"path is a binary file, not text: {path}")
        text = data.decode("utf-8", "surrogateescape")
        crlf = "\r\n" in text

        # a line end matches \r\n once, or a lone \n: in a file of both, old_text is counted
        # wherever read_file shows it, not only where its own line ends are
        if crlf and "\n" in old_text:
            import bisect

            ends, at = [], text.find("\r\n")  # where each \r\n's \n is once the \r's are gone
            while at >= 0:
                ends.append(at - len(ends))
                at = text.find("\r\n", at + 2)
            spans = [(start + bisect.bisect_left(ends, start), end + bisect.bisect_left(ends, end))
                     for start, end in _places(text.replace("\r\n", "\n"),
                                               old_text.replace("\r\n", "\n"))]
        if not (crlf and "\n" in old_text) or not spans:  # an old_text ending in a CRLF's \r
            spans = _places(text, old_text)
        if not spans and _has_undecodable(text):
            raise _ToolFailure(f"old_text was not found in {path}, which is not valid UTF-8: "
                               f"the bytes read_file shows as \ufffd cannot be matched; use "
                               f"bash or write_file")
        if not spans:
            raise _ToolFailure(f"old_text was not found in {path}; read the file and copy the "
                               f"text exactly, whitespace included")
        if len(spans) > 1:
            times = f"more than {_EDIT_COUNT_MAX}" if len(spans) > _EDIT_COUNT_MAX else len(spans)
            raise _ToolFailure(f"old_text occurs {times} times in {path}; include more of "
                               f"the surrounding text so that it occurs exactly once")
        start, end = spans[0]
        if crlf and "\n" in new_text:
            new_text = new_text.replace("\r\n", "\n")
            replaced = text[start:end]
            if "\n" in replaced:
                crlf = "\r\n" in replaced
            else:  # most lines end in CRLF
                crlf = 2 * text.count("\r\n") >= text.count("\n")
            if crlf:
                new_text = new_text.replace("\n", "\r\n")
        try:  # the file's own undecodable bytes go back as they were; new_text must be UTF-8
            new = new_text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise _ToolFailure(f"new_text cannot be written as UTF-8: {e}") from None
        return (text[:start].encode("utf-8", "surrogateescape") + new
                + text[end:].encode("utf-8", "surrogateescape"),
                not new.isascii() and _has_undecodable(text))

    def _approve(self, call):
        try:
            approved = self.approve is None or self.approve(call)
        except AbortError as e:  # the question was interrupted: the call is not made, as declined
            raise _ToolFailure(str(e)) from None
        # True runs the call. An answer still to come (a coroutine, a future) is no yes, and
        # None (an approve that fell off its end) a plain no.
        if approved is not None and not isinstance(approved, bool):
            if inspect.iscoroutine(approved):
                approved.close()
            raise _ToolFailure(f"the call was not approved: approve returned "
                               f"{type(approved).__name__}, not a bool")
        if not approved:
            raise _ToolFailure("the user declined this call")


def _has_undecodable(text) -> bool:
    """Whether ``text``, decoded with surrogateescape, held bytes that are not UTF-8."""
    return re.search("[\udc80-\udcff]", text) is not None


def _rg_unread_is_noted(fd, rel, wanted, rules, prefix):
    """Whether lich's own search would say it did not read ``rel``, a path ripgrep could not
    read in the folder open as ``fd``: a folder, or a file the glob wants; neither ignored."""
    if rules and _rg_path_ignored(rules, prefix, rel):
        return False
    parent, _, name = rel.rpartition("/")
    try:
        if stat.S_ISDIR(os.stat(rel, dir_fd=fd, follow_symlinks=False).st_mode):
            return True
    except OSError:  # in a folder that can be listed but not entered: its listing says
        try:
            parent_fd = os.open(parent or ".", os.O_RDONLY | getattr(os, "O_DIRECTORY", 0),
                                dir_fd=fd)
            try:
                with os.scandir(parent_fd) as entries:
                    if any(entry.name == name and entry.is_dir(follow_symlinks=False)
                           for entry in entries):
                        return True
            finally:
                os.close(parent_fd)
        except OSError:
            pass
    return wanted(rel, name)


def _rg_path_ignored(rules, prefix, rel):
    """Whether the root's .gitignore ignores the file ``prefix + rel`` or a folder above it
    below the searched one, ``prefix``: a folder the model named is searched, as by lich's
    own search."""
    parts = (prefix + rel).split("/")
    for i in range(prefix.count("/") + 1, len(parts) + 1):
        if _ignored(rules, "/".join(parts[:i]), parts[i - 1], i < len(parts)):
            return True
    return False


# --- shell ---

_SHELL_KEEP_BYTES = 20_000      # bash keeps this much of the head and of the tail of its output
_SHELL_READ_BYTES = 65_536      # one read from the shell's pipe
_SHELL_DRAIN_SECONDS = 0.2      # output still read after the shell exits, before the kill
_SHELL_LEFT_SECONDS = 0.2       # how long a shell's group may take to empty before it is killed
_SHELL_GROUP_POLL_SECONDS = 0.002
# The shell that runs a command. A watcher waits on fd 3, a pipe whose other end only lich
# holds: a line from lich means the call ended; end of file means lich died (even by
# SIGKILL), and the watcher kills the whole process group. Then the command replaces this
# shell, its stdin empty and fd 3 closed.
_SHELL_SUPERVISOR = ('exec 3<&0; { read _ <&3 || kill -KILL 0; } >/dev/null 2>&1 & '
                     'exec /bin/sh -c "$1" </dev/null 3<&-')


def _tool_environment():
    """The environment of a tool's process: lich's, without the provider keys and base URLs
    that hold credentials (`env` would show them to the model)."""
    return {k: v for k, v in os.environ.items() if k not in _PROVIDER_KEY_ENVS
            and not (k in _PROVIDER_URL_ENVS and _redact_url(v) != v)}


def _group_lives_on(pgid, seconds):
    """Whether a live process of the group ``pgid`` is still there after ``seconds`` (its
    leader reaped; the shell's watcher leaves at once when told)."""
    deadline = time.monotonic() + seconds
    while _group_has_a_live_process(pgid):
        if time.monotonic() >= deadline:
            return True
        time.sleep(_SHELL_GROUP_POLL_SECONDS)
    return False


def _group_has_a_live_process(pgid) -> bool:
    """Whether the group ``pgid`` has a process that is not a zombie. An exited watcher whose
    new parent (a container's init) does not reap it stays a zombie in the group: Linux's
    /proc tells them apart; elsewhere any process counts."""
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    try:
        names = os.listdir("/proc")
    except OSError:
        return True
    group = str(pgid).encode()
    for name in names:
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    fields = f.read().rpartition(b")")[2].split()  # after "pid (command)"
            except OSError:
                continue
            if len(fields) > 2 and fields[2] == group and fields[0] != b"Z":
                return True
    return False


def _output_held(fd, seconds):
    """Whether the pipe ``fd`` is still held open by a writer after ``seconds`` (what comes
    meanwhile is dropped)."""
    import selectors

    deadline = time.monotonic() + seconds
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if selector.select(deadline - time.monotonic()) and not os.read(fd, _SHELL_READ_BYTES):
                return False
    return True


def _kill_group(pgid):
    """SIGKILL every process of the group ``pgid``; whether there was any left to kill."""
    import signal as signals
    try:
        os.killpg(pgid, signals.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return False
    return True


class _HeadTail:
    """A byte sink that keeps the first and the last ``keep`` bytes and counts the rest."""

    def __init__(self, keep):
        self.keep = keep
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def write(self, data):
        self.total += len(data)
        room = self.keep - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data:
            self.tail += data
            if len(self.tail) > 2 * self.keep:
                del self.tail[:-self.keep]

    def text(self):
        """What was kept, decoded (undecodable bytes replaced), with a marker for the rest;
        the bytes of a character the head or the tail cuts through are counted in the rest."""
        tail = self.tail[-self.keep:]
        omitted = self.total - len(self.head) - len(tail)
        if not omitted:
            return bytes(self.head + tail).decode("utf-8", "replace")
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        head = decoder.decode(self.head)  # the start of a character cut at the end waits in it
        start = 0  # the end of a character cut at the tail's start: continuation bytes
        while start < min(len(tail), _UTF8_MAX_BYTES - 1) and tail[start] & 0xC0 == 0x80:
            start += 1
        omitted += len(decoder.getstate()[0]) + start
        return (head + f"\n[... {omitted} bytes omitted ...]\n"
                + tail[start:].decode("utf-8", "replace"))


def _with_newline(text):
    return text + "\n" if text and not text.endswith("\n") else text


def _run_shell(command, cwd, timeout, signal):
    """Run ``command`` with ``/bin/sh -c``: output streamed and capped, the process group
    killed on timeout, on the signal, when the shell is done, and when lich dies."""
    import selectors
    import subprocess
    if signal.is_set():
        return ToolResult(ok=False, error="the command was aborted before it started")
    watch_read, watch_write = os.pipe()
    try:
        proc = subprocess.Popen(["/bin/sh", "-c", _SHELL_SUPERVISOR, "lich-shell", command],
                                cwd=cwd, stdin=watch_read, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                env=_tool_environment())
    except BaseException:
        os.close(watch_write)
        raise
    finally:
        os.close(watch_read)
    sink = _HeadTail(_SHELL_KEEP_BYTES)
    stopped = None
    held = False  # the shell exited while others still held its output: they were killed
    ended = False  # the shell exited by itself
    try:
        deadline = time.monotonic() + timeout
        drain_until = None
        fd = proc.stdout.fileno()
        with selectors.DefaultSelector() as selector:
            selector.register(fd, selectors.EVENT_READ)
            while True:  # read until EOF: every process holding the pipe is gone
                now = time.monotonic()
                if signal.is_set():
                    stopped = "aborted"
                    break
                if now >= deadline:
                    stopped = "timeout"
                    break
                if drain_until is None and proc.poll() is not None:
                    drain_until = now + _SHELL_DRAIN_SECONDS  # a background child holds the pipe
                if drain_until is not None and now >= drain_until:
                    held = True
                    break
                if selector.select(min(_PROCESS_POLL_SECONDS, deadline - now)):
                    chunk = os.read(fd, _SHELL_READ_BYTES)
                    if not chunk:
                        break
                    sink.write(chunk)
        while stopped is None and proc.poll() is None:  # the shell closed its output early
            now = time.monotonic()
            if now >= deadline:
                stopped = "timeout"
            elif signal.wait(min(_PROCESS_POLL_SECONDS, deadline - now)):
                stopped = "aborted"
        ended = stopped is None  # the shell exited by itself
    finally:
        try:
            os.write(watch_write, b"\n")  # the call is over: the watcher may go
        except OSError:
            pass
        os.close(watch_write)
        escaped = False
        try:
            if ended and not held:  # a process started in the background, its output elsewhere?
                proc.wait()
                held = _group_lives_on(proc.pid, _SHELL_LEFT_SECONDS)
        finally:  # the watcher is gone: whatever cuts this short, the group is killed here
            _kill_group(proc.pid)
            try:
                escaped = held and _output_held(fd, _SHELL_DRAIN_SECONDS)  # left the group: setsid
            finally:
                proc.stdout.close()
                proc.wait()
    text = sink.text()
    if stopped == "timeout":
        return ToolResult(ok=False, output=text, error=f"the command timed out after {timeout:g} "
                                                       f"seconds and was killed")
    if stopped == "aborted":
        return ToolResult(ok=False, output=text, error="the command was aborted and killed")
    if escaped:
        text = _with_newline(text) + ("[a background process that left the command's process "
                                      "group still runs]\n")
    elif held:
        text = _with_newline(text) + "[background processes left running were killed]\n"
    code = proc.returncode
    text = _with_newline(text) + f"[exit code {code}]"
    if code == 0:
        return ToolResult(ok=True, output=text)
    if code < 0:
        return ToolResult(ok=False, output=text, error=f"the command was killed by signal {-code}")
    return ToolResult(ok=False, output=text, error=f"the command exited with code {code}")


def coding_tools(root=".", *, allow_write=False, allow_shell=False, approve=None,
                 shell_timeout=120, search_timeout=_SEARCH_SECONDS) -> Tools:
    """The built-in tools of the command line, confined to the folder ``root``.

    ``read_file``, ``list_files`` and ``search`` always; ``write_file`` and ``edit_file`` with
    ``allow_write``; ``bash`` with ``allow_shell``. Every path is resolved, symbolic links
    included, and must lie inside ``root``. ``approve(call) -> bool``, when given, is asked
    before each write or shell call whose arguments are valid; ``True`` runs it, anything else
    declines it.
    ``bash`` runs ``/bin/sh -c`` in ``root`` in a process group of its own, which is killed
    after ``shell_timeout`` seconds, when the signal is set, when the shell exits and when
    lich exits. A ``search`` ends after ``search_timeout`` seconds, saying so, whatever its
    pattern. The returned Tools has ``root``, the real path of the folder.
    """
    if approve is not None and not callable(approve):
        raise TypeError(f"approve must be callable or None, not {approve!r}")
    _refuse_async(approve, "approve")  # its coroutine, never run, was taken for a yes
    _check_seconds("shell_timeout", shell_timeout)
    _check_seconds("search_timeout", search_timeout)
    workspace = _Workspace(root, approve, shell_timeout, search_timeout)
    tools = Tools()
    tools.root = workspace.root.path
    tools.register(workspace.read_file)
    tools.register(workspace.list_files)
    tools.register(workspace.search)
    if allow_write:
        tools.register(workspace.write_file)
        tools.register(workspace.edit_file)
    if allow_shell:
        tools.register(
            workspace.bash, description=(
                f"Run a shell command with /bin/sh in the workspace root; answers with its "
                f"output (stdout and stderr together) and its exit code. Stdin is empty; the "
                f"command is killed after {shell_timeout:g} seconds. Every process it starts "
                f"is killed when it ends, except those that leave its process group (setsid, "
                f"daemons)."))
    return tools


# --- MCP ---

_MCP_PROTOCOL = "2025-11-25"  # the newest revision with the initialize handshake
_MCP_PROTOCOLS = frozenset({"2025-11-25", "2025-06-18", "2025-03-26", "2024-11-05"})
_MCP_CLOSE_SECONDS = 2.0      # close(): stdin closed, then this long before SIGTERM, then SIGKILL
                              # (over HTTP: how long the DELETE may take)
_MCP_STDERR_WAIT_SECONDS = 1.0  # a server that exited: how long its stderr may take to be read
_MCP_STDERR_KEEP = 4000       # the end of a server's stderr kept for error messages
_MCP_LINE_MAX_BYTES = 64 << 20  # one message from a server
_MCP_READ_BYTES = 1 << 16       # one read of a server's output
_MCP_WATCH_SECONDS = 1.0        # how often an idle server's watcher looks whether it is closed
_MCP_LATER_MAX = 1000           # messages waiting to be written for readers (pings answered)
_MCP_MAX_PAGES = 100          # tools/list pages read
_MCP_SCHEMA_MAX_DEPTH = 100   # of a tool's input schema: deeper, a request could not be encoded
_MCP_LISTEN_TRIES = 4         # GET streams that failed in a row before lich stops listening
_MCP_QUIET_STREAM_SECONDS = 5.0  # a GET stream open this long served, whatever it brought
_MCP_RESUME_MS = 1000         # the wait before an answer's stream is taken up again, unless told
_MCP_RESUME_MIN_MS = 100      # and at least this: a server that says 0 is not asked in a storm


def _sendable_schema(schema) -> bool:
    """Whether an MCP tool's input schema can go into a request: no NaN or infinity (which
    Python reads in a server's JSON, and the provider refuses the whole request for), and
    shallow enough to encode (one nested past the stack's depth made every turn fail)."""
    pending = [(schema, 0)]
    while pending:
        value, depth = pending.pop()
        if isinstance(value, float) and not math.isfinite(value):
            return False
        if isinstance(value, (dict, list)):
            if depth >= _MCP_SCHEMA_MAX_DEPTH:
                return False
            items = value.values() if isinstance(value, dict) else value
            pending.extend((item, depth + 1) for item in items)
    return True


class _RPCError(Exception):
    """A JSON-RPC error answer: ``args`` are (code, message)."""


class _Gone(Exception):
    """The MCP server is not there any more: its process ended or it cannot be reached."""


class _SessionExpired(_Gone):
    """An HTTP server no longer knows our session: a new handshake starts another."""


def _says_no_session(body) -> bool:
    """Whether a 400's body is a JSON-RPC error about the session: the TypeScript SDK's
    servers answer so ("Bad Request: No valid session ID provided") for a session they do
    not know (after a restart, say), where the spec says 404."""
    try:
        message = json.loads(body)["error"]["message"]
        return "session" in message.lower()
    except (ValueError, RecursionError, KeyError, TypeError, AttributeError):
        return False


def _rpc_result(answer) -> dict:
    """The result of a JSON-RPC answer (an empty dict when it holds none); _RPCError when
    the answer is an error."""
    if answer.get("error") is not None:  # "error": null beside a result is no error
        error = answer["error"] if isinstance(answer["error"], dict) else {}
        raise _RPCError(error.get("code"), _writable(str(error.get("message") or answer["error"])))
    return answer.get("result") if isinstance(answer.get("result"), dict) else {}


def _mcp_message(data):
    """A message (or a batch) from an MCP server's bytes, or None for what is not JSON; a
    byte that is not UTF-8 in a string is U+FFFD, the rest of the message kept."""
    try:
        return json.loads(data.decode("utf-8", "replace"))
    except (ValueError, RecursionError):
        return None


def _mcp_reply(request) -> dict:
    """lich's answer to a request from a server: a ping is answered, the rest refused (lich
    offers no sampling, elicitation or roots)."""
    answer = {"jsonrpc": "2.0", "id": request["id"]}
    if request.get("method") == "ping":
        answer["result"] = {}
    else:
        answer["error"] = {"code": -32601, "message": f"lich does not offer {request.get('method')}"}
    return answer


def _mcp_content(result) -> str:
    """The text of a tools/call result: text content joined by newlines, other content one
    line each (``[image: image/png, 1234 bytes]``, ``[resource: uri]``)."""
    lines = []
    for item in result.get("content") or ():
        if not isinstance(item, dict):
            continue
        kind = item.get("type")
        if kind == "text":
            lines.append(str(item.get("text", "")))
        elif kind in ("image", "audio"):
            data = item.get("data") if isinstance(item.get("data"), str) else ""
            size = len(data) * 3 // 4 - (len(data) - len(data.rstrip("=")))  # base64's padding
            lines.append(f"[{kind}: {item.get('mimeType', '?')}, {size} bytes]")
        elif kind == "resource_link":
            lines.append(f"[resource: {item.get('uri', '?')}]")
        elif kind == "resource":
            resource = item.get("resource")
            uri = resource.get("uri", "?") if isinstance(resource, dict) else "?"
            lines.append(f"[resource: {uri}]")
        else:
            lines.append(f"[{kind} content]")
    if not lines and result.get("structuredContent") is not None:
        lines.append(json.dumps(result["structuredContent"], ensure_ascii=False))
    return "\n".join(lines)


class _StdioServer:
    """An MCP server run as a process, spoken to in newline-delimited JSON-RPC.

    A thread waiting for an answer reads the server's output itself when no other thread
    reads it: it leads, and hands the other waiting threads their answers; when it has its
    own, one of them leads next. This saves two thread wake-ups a call. When no thread
    leads -- nobody waits, or a caller is still writing its request -- a watcher thread
    reads instead, until the server's output ends or it is closed: it notes a changed tool
    list, and keeps the server from blocking on a full pipe. Answers to the server's own
    requests (pings) are written by a thread of their own, so that reading never waits
    for writing. A write waits at most for its caller's time limit or signal; a line it
    leaves half-written is finished by a thread of its own. Another thread keeps the tail
    of the server's stderr."""

    def __init__(self, argv, env, cwd, on_list_changed):
        import select
        import subprocess
        environ = _tool_environment()
        environ.update(env or {})
        try:
            self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, cwd=cwd, env=environ,
                                         start_new_session=True)
        except OSError as e:
            # a cwd that is no folder fails as a missing command would: name the one at fault
            where = (f" in {os.fsdecode(e.filename)!r}"
                     if cwd is not None and e.filename not in (None, argv[0]) else "")
            raise MCPError(f"cannot start the MCP server {argv[0]!r}{where}: {e.strerror or e}") from e
        os.set_blocking(self.proc.stdin.fileno(), False)  # a write waits in poll, watched
        self.name = os.path.basename(argv[0])
        self.on_list_changed = on_list_changed
        self._lock = threading.Lock()  # the waiting answers, the next id, the stderr tail
        self._writing = threading.Lock()  # stdin
        self._waiting = {}  # id -> [Event, answer or None, whether it waits for the reader]
        self._next_id = 1
        self._later = deque()  # messages to be written by the thread that writes for readers
        self._writing_later = False  # that thread runs
        self._reading = threading.Lock()  # held by the one thread that reads stdout
        self._poller = select.poll()  # the reader's; not select(): stdout may be above fd 1023
        self._poller.register(self.proc.stdout.fileno(), select.POLLIN)
        self._lines = deque()  # whole lines read, not yet taken in
        self._partial = []  # the start of a line not read to its end yet, in pieces
        self._partial_size = 0
        self._dropping = False  # a line too long to be read is read to its end, unkept
        self._eof = threading.Event()  # the server's output ended
        self._closed = False
        self._stderr = deque()
        self._stderr_size = 0
        self._gone = None  # why the server cannot answer any more
        self._stderr_reader = threading.Thread(target=self._read_stderr, name="lich-mcp", daemon=True)
        self._stderr_reader.start()
        threading.Thread(target=self._watch, name="lich-mcp", daemon=True).start()

    def request(self, method, params, seconds, signal):
        deadline = time.monotonic() + seconds
        with self._lock:
            request_id = self._next_id
            self._next_id += 1
            slot = self._waiting[request_id] = [threading.Event(), None, False]
        try:
            self._send({"jsonrpc": "2.0", "id": request_id, "method": method, "params": params},
                       deadline, signal)
            while slot[1] is None and self._gone is None:
                reason = _cut_reason(deadline, signal)
                if reason is not None:
                    raise _Cut(reason)
                left = deadline - time.monotonic()
                slot[2] = True  # before trying to lead: a reader that leaves then wakes us
                if self._reading.acquire(blocking=False):
                    slot[2] = False
                    try:
                        self._read_until(slot, min(_WATCH_SECONDS, left))
                    finally:
                        self._leave_reading()
                else:  # another thread reads: it hands over the answer, or wakes us to read
                    slot[0].wait(min(_WATCH_SECONDS, left))
                    slot[2] = False
                    slot[0].clear()
        except _Cut as cut:  # also when the request was not (all) written: a cancel is harmless
            self._send_soon({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {
                "requestId": request_id, "reason": f"the client {cut.args[0]}"}})
            raise
        finally:
            with self._lock:
                self._waiting.pop(request_id, None)
        answer = slot[1]
        if answer is None:
            raise _Gone(self._gone)
        return _rpc_result(answer)

    def notify(self, method, params=None):
        message = {"jsonrpc": "2.0", "method": method}
        if params is not None:
            message["params"] = params
        try:
            self._send(message, time.monotonic() + _MCP_CLOSE_SECONDS, None)
        except (_Gone, _Cut):
            pass

    def _send(self, message, deadline, signal):
        """Write ``message`` as one line, by ``deadline`` unless ``signal`` is set first
        (else _Cut). A line cut half-way is finished by a thread of its own, which holds
        the writing until then: the server may be busy rather than deaf."""
        import select
        line = memoryview(json.dumps(message, ensure_ascii=False, separators=(",", ":"))
                          .encode("utf-8", "backslashreplace") + b"\n")  # a lone surrogate: \udXXX
        while not self._writing.acquire(timeout=_WATCH_SECONDS):  # another write is under way
            if self._gone is not None:
                raise _Gone(self._gone)
            reason = _cut_reason(deadline, signal)
            if reason is not None:
                raise _Cut(reason)
        held = True
        try:
            if self._gone is not None:
                raise _Gone(self._gone)
            fd = self.proc.stdin.fileno()
            poller = select.poll()
            poller.register(fd, select.POLLOUT)
            while line:
                if self._gone is not None:
                    raise _Gone(self._gone)
                try:
                    line = line[os.write(fd, line):]
                    continue
                except BlockingIOError:
                    pass
                reason = _cut_reason(deadline, signal)
                if reason is not None:
                    if len(line) < len(line.obj):
                        threading.Thread(target=self._finish_line, args=(line, fd, poller),
                                         name="lich-mcp", daemon=True).start()
                        held = False  # the finishing thread releases it
                    raise _Cut(reason)
                poller.poll(min(_WATCH_SECONDS, max(0.0, deadline - time.monotonic())) * 1000)
            return
        except (OSError, ValueError) as e:
            why = f"{getattr(e, 'strerror', None) or e}"
        finally:
            if held:
                self._writing.release()
        # Its input closed: most likely it exited. Its own words, when the reader has them
        # in time, say more than the broken pipe does.
        import subprocess
        try:
            self.proc.wait(_MCP_STDERR_WAIT_SECONDS)
        except subprocess.TimeoutExpired:
            pass  # alive, and not reading: said below
        if self.proc.poll() is not None:
            raise _Gone(self._exit_message())
        raise _Gone(f"the MCP server {self.name} does not read its input: {why}")

    def _finish_line(self, rest, fd, poller):
        """Write the rest of a line whose writer gave up, then let others write."""
        try:
            while rest and self._gone is None:
                try:
                    rest = rest[os.write(fd, rest):]
                except BlockingIOError:
                    poller.poll(_WATCH_SECONDS * 1000)
        except OSError:
            pass  # gone: the reader says why
        finally:
            self._writing.release()

    def _send_soon(self, message):
        """Write ``message`` now if that takes at most _WATCH_SECONDS, else have it written
        later."""
        try:
            self._send(message, time.monotonic(), None)
        except _Cut:  # nothing written: a short line goes into the pipe whole or not at all
            self._send_later(message)
        except _Gone:
            pass

    def _send_later(self, message):
        """Have ``message`` written by the thread that writes for readers (it must never be
        a reader that waits for the server to read)."""
        with self._lock:
            if len(self._later) >= _MCP_LATER_MAX:
                _log.debug("MCP server %s: too many messages waiting to be written; %r dropped",
                           self.name, message)
                return
            self._later.append(message)
            if self._writing_later:
                return
            self._writing_later = True
        threading.Thread(target=self._write_later, name="lich-mcp", daemon=True).start()

    def _write_later(self):
        while True:
            with self._lock:
                if not self._later:
                    self._writing_later = False
                    return
                message = self._later.popleft()
            try:  # in order, however long the server takes to read: up to its end
                self._send(message, math.inf, None)
            except (_Gone, _Cut):
                pass
            except Exception:  # this thread must go on
                _log.debug("cannot write %r to the MCP server %s", message, self.name, exc_info=True)

    def _read_until(self, slot, seconds):
        """Read the server's output until ``slot`` has its answer, the server is gone, or
        ``seconds`` have passed (the reader does this)."""
        deadline = time.monotonic() + seconds
        while slot[1] is None and self._gone is None:
            if self._lines:  # left by a reader stopped by an exception
                self._take_in()
                continue
            left = deadline - time.monotonic()
            if self._poller.poll(max(0.0, left) * 1000):
                self._read_output()
                if left <= 0:
                    return
                continue
            # Exited with nothing left to read (looked at again once it had exited), its
            # output held open by a process it started: no answer will come.
            if self.proc.poll() is not None and not self._poller.poll(0):
                self._end(self._exit_message())
            return

    def _leave_reading(self):
        """The reader goes: one of the threads that wait for it, their answer still to come,
        reads next."""
        self._reading.release()
        with self._lock:
            for slot in self._waiting.values():
                if slot[2] and slot[1] is None:
                    slot[0].set()
                    break

    def _watch(self):
        """Read while no caller does, until the output ends or the server is closed."""
        import select
        poller = select.poll()  # its own: the readers' is used under self._reading only
        poller.register(self.proc.stdout.fileno(), select.POLLIN)
        try:
            while not self._eof.is_set():
                if not poller.poll(_MCP_WATCH_SECONDS * 1000) and self._closed:
                    return  # closed, and quiet: an escaped child of the server holds its output
                if not self._reading.acquire(blocking=False):  # a caller reads: look again later
                    self._eof.wait(_WATCH_SECONDS)
                    continue
                try:
                    if self._lines:
                        self._take_in()
                    while not self._eof.is_set() and poller.poll(0):
                        self._read_output()
                finally:
                    self._leave_reading()
        finally:  # the output ended or the server is closed: no reader reads it again
            with self._reading:
                self.proc.stdout.close()

    def _read_output(self):
        """Read what the server wrote, and take in each whole line (the reader does this)."""
        data = os.read(self.proc.stdout.fileno(), _MCP_READ_BYTES)
        if data:
            lines = data.split(b"\n")
            if len(lines) > 1 and self._dropping:  # the end of a line too long to be read
                del lines[0]
                self._dropping = False
            elif len(lines) > 1 and self._partial:
                lines[0] = b"".join(self._partial) + lines[0]
                self._partial.clear()
                self._partial_size = 0
            if lines[-1] and not (self._dropping and len(lines) == 1):
                self._partial.append(lines[-1])
                self._partial_size += len(lines[-1])
                if self._partial_size > _MCP_LINE_MAX_BYTES:  # too long to be read: dropped
                    self._partial.clear()
                    self._partial_size = 0
                    self._dropping = True
                    _log.warning("the MCP server %s sent a message of more than %d MB, which "
                                 "lich does not read", self.name, _MCP_LINE_MAX_BYTES >> 20)
            self._lines.extend(lines[:-1])
        elif self._partial:  # a last line without its newline
            self._lines.append(b"".join(self._partial))
            self._partial.clear()
        self._take_in()
        if not data:
            import subprocess
            try:
                self.proc.wait(_MCP_STDERR_WAIT_SECONDS)
            except subprocess.TimeoutExpired:  # alive: it will not answer again all the same
                self._end(f"the MCP server {self.name} closed its output")
            else:
                self._end(self._exit_message())
            self._eof.set()

    def _take_in(self):
        """Take in the lines read, one at a time: a reader stopped by an exception leaves
        the rest to the next one."""
        while self._lines:
            # A batch (2025-03-26) is its messages, as over HTTP; what is no message is
            # skipped (MCP servers must not print anything else there).
            message = _mcp_message(self._lines.popleft())
            for each in message if isinstance(message, list) else [message]:
                if isinstance(each, dict):
                    self._received(each)

    def _exit_message(self):
        """Why an exited server cannot answer, in its own last words (read to their end)."""
        self._stderr_reader.join(_MCP_STDERR_WAIT_SECONDS)
        return (f"the MCP server {self.name} exited (code {self.proc.returncode})"
                f"{self.stderr_tail(': ')}")

    def _received(self, message):
        method = message.get("method")
        if method is None:  # an answer
            ident = message.get("id")
            with self._lock:
                # JSON's true is no id, though True == 1 would find request 1's slot
                slot = (self._waiting.get(ident) if isinstance(ident, (int, str))
                        and not isinstance(ident, bool) else None)
            if slot is not None and slot[1] is None:  # the first answer is the answer
                slot[1] = message
                slot[0].set()
        elif "id" in message:  # the server asks
            self._send_later(_mcp_reply(message))
        elif method == "notifications/tools/list_changed":
            self.on_list_changed()

    def _read_stderr(self):
        """Keep the last _MCP_STDERR_KEEP characters of the server's stderr, a line at a time;
        of a longer line, its end."""
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        line = ""
        with self.proc.stderr:  # closed at its end (unless an escaped child holds it open)
            for piece in iter(lambda: self.proc.stderr.readline(_MCP_READ_BYTES), b""):
                line = (line + decoder.decode(piece))[-2 * _MCP_STDERR_KEEP:]
                if piece.endswith(b"\n"):
                    self._keep_stderr(line)
                    line = ""
            if line:
                self._keep_stderr(line)

    def _keep_stderr(self, line):
        # secrets hidden before the cut: one cut through could not be found after
        text = _redact_secrets(line.rstrip())[-_MCP_STDERR_KEEP:]
        _log.debug("mcp %s: %s", self.name, text)
        with self._lock:
            self._stderr.append(text)
            self._stderr_size += len(text)
            while self._stderr_size > _MCP_STDERR_KEEP and len(self._stderr) > 1:
                self._stderr_size -= len(self._stderr.popleft())

    def stderr_tail(self, lead=""):
        with self._lock:
            text = "\n".join(self._stderr).strip()
        return f"{lead}{text}" if text else ""

    def listen(self):
        """Nothing to open: the reader thread hears what the server sends unasked."""

    def _end(self, why):
        with self._lock:
            self._gone = self._gone or why
            waiting = list(self._waiting.values())
        for slot in waiting:
            slot[0].set()

    def close(self):
        self._end(f"the MCP server {self.name} was closed")
        import signal as signals
        import subprocess
        try:
            with self._writing:  # a write under way sees the end within _WATCH_SECONDS
                try:
                    self.proc.stdin.close()
                except OSError:
                    pass
            for stop in (None, signals.SIGTERM):
                if stop is not None:
                    try:
                        os.killpg(self.proc.pid, stop)
                    except (ProcessLookupError, PermissionError):
                        pass
                try:
                    self.proc.wait(_MCP_CLOSE_SECONDS)
                    break
                except subprocess.TimeoutExpired:
                    continue
        finally:  # also when the wait is interrupted: what it started, if it left them behind
            _kill_group(self.proc.pid)
            self.proc.wait()
            self._closed = True


class _HTTPServer:
    """An MCP server spoken to over Streamable HTTP: a POST per message, the answer as JSON
    or as an SSE stream; the session id the server gives is sent back on every request."""

    def __init__(self, url, headers, on_list_changed):
        self.url = url
        self.name = _redact_url(url)
        self.headers = dict(headers or {})
        _add_url_secrets(url, self)
        for name, value in self.headers.items():  # "Bearer <token>": the token is the secret
            if _CREDENTIAL_NAME.search(name):
                _add_secret(str(value).rpartition(" ")[2], self)
        self.on_list_changed = on_list_changed
        self.session_id = None
        # The server forgot our session and none was begun since (its renewal failed): a
        # request without one would be refused, so it begins one first.
        self.session_lost = False
        self.protocol = None
        self._local = threading.local()
        self._sessions = weakref.WeakSet()  # every thread's, for close()
        self._next_id = 1
        self._lock = threading.Lock()
        self._closed = False  # close() was called: calls fail, as over stdio
        self._closing = threading.Event()  # set with _closed: the GET stream's waits end
        self._exchanges = set()  # the calls under way (and the GET stream), which close() cuts
        self._cookies = None  # what the server set
        self._streams = set()  # the GET streams' exchanges, which a new session's cuts

    def _http(self):
        session = _http_session_of_this_thread(self._local, self.url)
        with self._lock:  # closed with the server, its pooled sockets with it, in every thread
            self._sessions.add(session)
        return session

    def _sent(self, method, headers, **options):
        """``method`` (post, get, delete) sent with ``headers`` and the server's cookies, kept
        for every thread (a load balancer's affinity: the CLI starts a server in one thread
        and calls it from another)."""
        with self._lock:
            if self._cookies is None:
                self._cookies = _requests().cookies.RequestsCookieJar()
        return _sent_with_cookies(getattr(self._http(), method), self.url, self._cookies,
                                  headers=headers, allow_redirects=False, **options)

    def _headers(self):
        headers = {"Accept": "application/json, text/event-stream",
                   "Content-Type": "application/json", **self.headers}
        if self.session_id:
            headers["Mcp-Session-Id"] = self.session_id
        if self.protocol:
            headers["MCP-Protocol-Version"] = self.protocol
        return headers

    def _post(self, message, exchange):
        """POST ``message``; the response once its headers are in. A same-origin 307 or 308
        (Starlette's ``/mcp`` to ``/mcp/``) is followed, and its target used from then on."""
        requests = _requests()
        sent_in = self.session_id
        for _ in range(_MAX_REDIRECTS + 1):
            url = self.url
            try:
                response = self._sent("post", self._headers(), data=_wire_json(message),
                                      timeout=(_CONNECT_TIMEOUT, None), stream=True)
            except requests.RequestException as e:
                exchange.check()
                raise _Gone(f"cannot reach the MCP server {self.name}: {_unreachable_reason(e)}") from None
            status = response.status_code
            if status < 300:
                return response
            location = response.headers.get("location") if 300 <= status < 400 else None
            if status in (307, 308) and location:
                from urllib.parse import urljoin
                try:
                    target = urljoin(url, location)
                    same = _origin(target) == _origin(url)
                except ValueError:  # "http://[::1", a port past 65535
                    same = False
                if same:  # the headers (a token) stay with the server they were given for
                    response.close()
                    self.url = target
                    continue
            body = response.raw.read(_ERROR_BODY_MAX_BYTES, decode_content=True)
            response.close()
            if sent_in and (status == 404 or status == 400 and _says_no_session(body)):
                with self._lock:  # not a session another thread has begun meanwhile
                    if self.session_id == sent_in:
                        self.session_id = None
                        self.session_lost = True
                raise _SessionExpired(f"the MCP server {self.name} ended the session")
            to = f" (to {_redact_url(_redact_secrets(location))[:_SNIPPET_MAX_CHARS]})" if location else ""
            raise _Gone(f"the MCP server {self.name} answered HTTP {status}{to}: {_snippet(body)}")
        raise _Gone(f"the MCP server {self.name} redirected more than {_MAX_REDIRECTS} times")

    def request(self, method, params, seconds, signal):
        if self.session_lost and method != "initialize":
            raise _SessionExpired(f"the MCP server {self.name} ended the session")
        with _Exchange(signal, seconds) as exchange:
            with self._lock:
                if self._closed:
                    raise _Gone(f"the MCP server {self.name} was closed")
                request_id = self._next_id
                self._next_id += 1
                self._exchanges.add(exchange)
            message = {"jsonrpc": "2.0", "id": request_id, "method": method, "params": params}
            try:
                response, answer = self._post_and_read(message, exchange)
            except _Cut as cut:
                if cut.args[0] == "closed":
                    raise _Gone(f"the MCP server {self.name} was closed") from None
                # in a thread of its own: a server too busy to read it (its event loop held by
                # a tool) kept the call from ending for the notification's own time limit
                threading.Thread(target=self.notify, name="lich-mcp-cancel", daemon=True, args=(
                    "notifications/cancelled",
                    {"requestId": request_id, "reason": f"the client {cut.args[0]}"})).start()
                raise
            finally:
                with self._lock:
                    self._exchanges.discard(exchange)
        if method == "initialize":
            self.session_id = response.headers.get("mcp-session-id") or self.session_id
            if answer.get("error") is None:  # a refused handshake begins no session
                self.session_lost = False
        return _rpc_result(answer)

    def _post_and_read(self, message, exchange):
        """The response to ``message`` and the answer in it; _Cut when the exchange is cut.

        A server may close an answer's SSE stream before the answer once it has given an event
        id (MCP 2025-11-25): the stream is taken up again by a GET with ``Last-Event-ID``,
        ``retry:`` milliseconds later (else a second; 0.1 s at least), as often as the time
        limit allows."""
        try:
            response = self._post(message, exchange)
            resume = {}  # the stream's last event id and retry, to take it up again by
            try:
                answer = self._answer(response, message["id"], exchange, resume)
            finally:
                response.close()
            while answer is None and "id" in resume:
                exchange.wait(max(resume.get("retry", _MCP_RESUME_MS), _MCP_RESUME_MIN_MS) / 1000)
                stream = self._resumed_stream(resume["id"], exchange)
                if stream is None:
                    break
                try:
                    answer = self._answer(stream, message["id"], exchange, resume)
                finally:
                    stream.close()
            if answer is None:
                exchange.check()
                raise _Gone(f"the MCP server {self.name} ended its answer without one")
            return response, answer
        except _requests().RequestException as e:
            exchange.check()
            raise _Gone(f"the MCP server {self.name} broke off: "
                        f"{_redact_secrets(str(e))[:_SNIPPET_MAX_CHARS]}") from None
        except _StreamTooLong as e:
            raise _Gone(f"the MCP server {self.name} answered more than lich reads: {e}") from None

    def _answer(self, response, request_id, exchange, resume):
        """The answer to ``request_id`` from a JSON body or an SSE stream; None when the
        stream ended without it (``resume`` holds its last event id and retry)."""
        chunks = None  # of an SSE stream
        if response.headers.get("content-type", "").startswith("application/json"):
            body = response.raw.read(_MCP_LINE_MAX_BYTES, decode_content=True)
            messages = [_mcp_message(body)]
            if messages[0] is None:
                raise _Gone(f"the MCP server {self.name} answered with a body that is not JSON: "
                            f"{_snippet(body)}")
        else:
            chunks = _arriving_chunks(response)
            messages = (_mcp_message(data) for _, data in
                        _sse_events(chunks, exchange.check, resume) if data.strip())
        for message in messages:
            for each in message if isinstance(message, list) else [message]:
                answer_id = each.get("id") if isinstance(each, dict) else None
                if (isinstance(each, dict) and each.get("method") is None
                        and answer_id == request_id and not isinstance(answer_id, bool)):
                    if chunks is not None:  # the stream's end, as the server closes it: its
                        _drain_stream(chunks, exchange)  # connection serves the next call
                    return each  # true == 1, but JSON's true is no id
                self._heard(each)
        return None

    def _resumed_stream(self, last_id, exchange):
        """The GET that takes an answer's stream up again after ``last_id``: its response,
        or None when the server offers none."""
        response, status = self._get_stream({"Last-Event-ID": last_id})
        if response is None:
            _log.debug("the MCP server %s did not take its stream up again (HTTP %d)",
                       self.name, status)
            exchange.check()
            if status == 404 and self.session_id:  # not begun again: the tool may have run
                raise _Gone(f"the MCP server {self.name} ended the session during the call")
        return response

    def _get_stream(self, headers):
        """(the response, its status) of a GET for an SSE stream with ``headers`` added; the
        response None (closed) when the server answers anything else."""
        headers = {**self._headers(), "Accept": "text/event-stream", **headers}
        del headers["Content-Type"]
        response = self._sent("get", headers, timeout=(_CONNECT_TIMEOUT, None), stream=True)
        if response.status_code == 200 and response.headers.get(
                "content-type", "").startswith("text/event-stream"):
            return response, 200
        response.close()
        return None, response.status_code

    def _heard(self, message):
        """What the server sent that answers nothing of ours: a request, or a notification."""
        if not isinstance(message, dict) or message.get("method") is None:
            return
        if "id" in message:  # the server asks
            self._deliver(_mcp_reply(message))
        elif message["method"] == "notifications/tools/list_changed":
            self.on_list_changed()

    def listen(self):
        """Open the optional GET stream, on which a server sends what it sends unasked
        (``list_changed``, a ``ping``): a thread reads it while this session lasts."""
        with self._lock:
            ended = list(self._streams)  # an earlier session's, which the server may keep open
        for exchange in ended:
            exchange.cut_now("closed")
        threading.Thread(target=self._listen, args=(self.session_id,), daemon=True,
                         name=f"lich-mcp-listen {self.name}").start()

    def _listen(self, session_id):
        failed = 0  # streams that failed in a row; a server without one says 405 at once
        while failed < _MCP_LISTEN_TRIES:
            with _Exchange(None, None) as exchange:
                with self._lock:
                    if self._closed or self.session_id != session_id:
                        return
                    self._exchanges.add(exchange)
                    self._streams.add(exchange)
                began = time.monotonic()
                heard = 0
                try:
                    heard = self._read_stream(exchange)
                    if heard is None:
                        return
                except Exception as e:  # nothing may escape a thread of lich's: it would print
                    if exchange.cut is not None:  # closed
                        return
                    _log.debug("the GET stream of the MCP server %s broke: %s", self.name,
                               _redact_secrets(str(e)))
                finally:
                    with self._lock:
                        self._exchanges.discard(exchange)
                        self._streams.discard(exchange)
                # one that ended at once, unheard, is no stream; one that lasted served, quiet
                # or broken (a proxy cuts an idle stream)
                served = heard or time.monotonic() - began >= _MCP_QUIET_STREAM_SECONDS
                failed = 0 if served else failed + 1
            if self._closing.wait(2.0 ** failed):  # 1 s after a stream that served, then 2, 4, 8
                return

    def _read_stream(self, exchange):
        """Read one GET stream to its end: how many messages it brought, or None when the
        server offers none."""
        response, status = self._get_stream({})
        if response is None:
            _log.debug("the MCP server %s offers no GET stream (HTTP %d)", self.name, status)
            return None
        try:
            heard = 0
            for _, data in _sse_events(_arriving_chunks(response), exchange.check):
                message = _mcp_message(data) if data.strip() else None
                if message is None and data.strip():
                    continue  # not JSON: skipped, as in an answer
                for each in message if isinstance(message, list) else [message]:
                    heard += 1
                    self._heard(each)
            return heard
        finally:
            response.close()

    def notify(self, method, params=None):
        self._deliver({"jsonrpc": "2.0", "method": method, **({"params": params} if params else {})})

    def _deliver(self, message):
        """POST a message that gets no answer (a notification, or our answer to the server);
        none once closed (a call's cancellation, sent from a thread of its own, may come after)."""
        if self._closed:
            return
        try:
            with _Exchange(None, _CONNECT_TIMEOUT) as exchange:
                self._post(message, exchange).close()
        except (_Gone, _Cut):
            pass

    def stderr_tail(self, lead=""):
        return ""

    def close(self):
        with self._lock:
            self._closed = True
            self._closing.set()
            under_way = list(self._exchanges)
        for exchange in under_way:  # each fails at once, as over stdio
            exchange.cut_now("closed")
        if self.session_id:
            try:
                self._sent("delete", self._headers(), timeout=_MCP_CLOSE_SECONDS)
            except _requests().RequestException:
                pass
        with self._lock:
            sessions = list(self._sessions)
        for session in sessions:  # left to the collector, urllib3 1.x's said "unclosed socket"
            session.close()


class MCPTools:
    """The tools of one MCP server as a ToolRunner, and a context manager that closes it.

    ``specs()`` lists every page of ``tools/list`` (again after the server says its list
    changed); ``run(call, signal)`` sends ``tools/call``, calls from several threads at once,
    and never raises: an error, a set signal, the timeout or a dead server is a failed result.
    """

    def __init__(self, server, *, timeout, prefix):
        self._server = server
        self.timeout = timeout
        self.prefix = prefix
        self.name = server.name
        self.protocol = None
        self.instructions = None
        self._tools = None  # the server's tool specs, or None to list them again
        self._changes = 0  # list_changed notifications heard: a listing they overtook is old
        self._names = {}  # a name offered to the model -> the server's name, where they differ
        self._handshaking = threading.Lock()
        self._pid = os.getpid()  # a forked child must not speak on its parent's connection

    def __repr__(self):
        return f"MCPTools({self.name!r})"

    def __reduce__(self):
        # A batch on a process pool pickles its tools: say what cannot go, not "_thread.lock"
        raise TypeError(f"cannot pickle MCPTools ({self.name}): its server answers only the "
                        f"process that started it; call mcp_tools() in the process that uses it")

    def _not_ours(self):
        """Why this process may not use the server (a forked child's), or None."""
        if os.getpid() == self._pid:
            return None
        return (f"the MCP server {self.name} was started by process {self._pid}; start one in "
                f"this process with mcp_tools()")

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()

    def _handshake(self):
        result = self._server.request("initialize", {
            "protocolVersion": _MCP_PROTOCOL, "capabilities": {},
            "clientInfo": {"name": "lich", "version": __version__}}, self.timeout, None)
        protocol = result.get("protocolVersion")
        if not isinstance(protocol, str) or protocol not in _MCP_PROTOCOLS:  # a list: unhashable
            raise MCPError(f"the MCP server {self.name} speaks protocol {protocol!r}, which lich "
                           f"does not ({', '.join(sorted(_MCP_PROTOCOLS))})")
        self.protocol = self._server.protocol = protocol
        instructions = result.get("instructions")
        if instructions is not None and not isinstance(instructions, str):
            _log.warning("the MCP server %s gave instructions that are %s, not a string: lich "
                         "leaves them out", self.name, _json_kind(instructions))
            instructions = None
        self.instructions = instructions
        self._server.notify("notifications/initialized")
        self._server.listen()

    def _list_changed(self):
        self._changes += 1
        self._tools = None

    def specs(self) -> list:
        """The server's tools as tool specs, names prefixed; a RuntimeError in a forked child."""
        if self._not_ours():
            raise RuntimeError(self._not_ours())
        tools = self._tools
        if tools is None:
            tools, cursor, changes, sent = [], None, self._changes, set()
            for _ in range(_MCP_MAX_PAGES):
                try:
                    page = self._request("tools/list", {"cursor": cursor} if cursor else {}, None)
                except (_RPCError, _Gone, _Cut, MCPError) as e:
                    _log.warning("cannot list the tools of the MCP server %s: %s", self.name,
                                 e.args[-1] if e.args else e)
                    return []
                listed = page.get("tools")
                if listed is not None and not isinstance(listed, list):
                    _log.warning("cannot list the tools of the MCP server %s: its tools are %s, "
                                 "not an array", self.name, _json_kind(listed))
                    return []
                tools += listed or ()
                cursor = page.get("nextCursor")
                if cursor is not None and not isinstance(cursor, str):  # sent back, it is refused
                    _log.warning("the MCP server %s gave a next cursor that is %s, not a string: "
                                 "lich offers the tools of the pages it read", self.name,
                                 _json_kind(cursor))
                    break
                if not cursor:
                    break
                if cursor in sent:  # a loop: its pages would repeat up to the page limit
                    _log.warning("the MCP server %s gave a next cursor it had given before: lich "
                                 "offers the tools of the pages it read", self.name)
                    break
                sent.add(cursor)
            else:
                _log.warning("the MCP server %s gave more than %d pages of tools: lich offers the "
                             "tools of the first %d", self.name, _MCP_MAX_PAGES, _MCP_MAX_PAGES)
            tools = self._usable(tools)
            if changes == self._changes:  # else the list changed meanwhile: asked for again next
                self._tools = tools
        offered = [(self._offered_name(t["name"]), t) for t in tools]
        self._names = {name: t["name"] for name, t in offered if name != self.prefix + t["name"]}
        return [{"name": name,
                 "description": t["description"] if isinstance(t.get("description"), str) else "",
                 "parameters": t["inputSchema"] if isinstance(t.get("inputSchema"), dict)
                 and t["inputSchema"] else {"type": "object", "properties": {}}}
                for name, t in offered]

    def _usable(self, listed) -> list:
        """The listed tools lich can offer: objects with a string name, each name once (a
        provider refuses a name offered twice); the others skipped with a warning."""
        usable, names, offered = [], set(), {}  # offered: the name given -> the server's
        for tool in listed:
            name = tool.get("name") if isinstance(tool, dict) else None
            if not isinstance(tool, dict):
                _log.warning("the MCP server %s listed a tool that is %s, not an object: lich "
                             "skips it", self.name, _json_kind(tool))
            elif not isinstance(name, str):
                _log.warning("the MCP server %s listed a tool whose name is %s, not a string: "
                             "lich skips it", self.name, _json_kind(name))
            elif name in names:
                _log.warning("the MCP server %s listed the tool %r twice: lich offers the first",
                             self.name, name)
            elif self._offered_name(name) in offered:  # "a.b" is offered as "a_b_<digest>"
                _log.warning("the MCP server %s listed the tools %r and %r, which lich would "
                             "offer under one name, %r: lich offers the first", self.name,
                             offered[self._offered_name(name)], name, self._offered_name(name))
            elif not _sendable_schema(tool.get("inputSchema")):
                _log.warning("the MCP server %s listed the tool %r with an input schema that no "
                             "request can carry (a NaN or an infinity, or nested over %d levels): "
                             "lich skips it", self.name, name, _MCP_SCHEMA_MAX_DEPTH)
            else:
                names.add(name)
                offered[self._offered_name(name)] = name
                usable.append(tool)
        return usable

    def _request(self, method, params, signal):
        """The server's result; a session that an HTTP server forgot gets a new handshake
        (one, when several calls find it gone at once)."""
        try:
            return self._server.request(method, params, self.timeout, signal)
        except _SessionExpired:
            with self._handshaking:
                if self._server.session_id is None:
                    self._handshake()
            return self._server.request(method, params, self.timeout, signal)

    def _offered_name(self, name):
        """``prefix + name`` as providers take it (MCP allows '.', '/' and any length)."""
        return _in_name_alphabet(self.prefix + name, _TOOL_NAME_MAX_CHARS)

    def run(self, call: dict, signal: Optional[threading.Event] = None) -> ToolResult:
        """Call the tool on the server; never raises."""
        if self._not_ours():
            return ToolResult(ok=False, error=self._not_ours())
        try:
            name = call.get("name") if isinstance(call, dict) else None
            real = self._names.get(name) if isinstance(name, str) else None
            if real is None and (not isinstance(name, str) or not name.startswith(self.prefix)):
                return ToolResult(ok=False, error=f"unknown tool {name!r} for the MCP server "
                                                  f"{self.name}")
            params = {"name": real if real is not None else name[len(self.prefix):],
                      "arguments": _arguments_object(name, call.get("arguments"))}  # as Tools does
            result = self._request("tools/call", params, signal)
            content = result.get("content")
            if content is not None and not isinstance(content, list):
                _log.warning("the MCP server %s answered the call of %s with content that is %s, "
                             "not an array: lich leaves it out", self.name, params["name"],
                             _json_kind(content))
                result = {**result, "content": []}
            text = _truncate(_mcp_content(result), DEFAULT_MAX_OUTPUT_CHARS)  # as a Tools' tool is
        except _Cut as cut:
            return ToolResult(ok=False, error="aborted" if cut.args[0] == "aborted"
                              else f"timed out after {self.timeout:g} s")
        except _RPCError as e:
            return ToolResult(ok=False, error=f"{e.args[1]} (MCP error {e.args[0]})")
        except _Gone as e:
            return ToolResult(ok=False, error=str(e.args[0] if e.args else e))
        except _ToolFailure as e:
            return ToolResult(ok=False, error=str(e))
        except Exception as e:  # run never raises
            _log.debug("MCP call %r failed", call, exc_info=True)
            return ToolResult(ok=False, error=_exception_text(e))
        if result.get("isError"):
            return ToolResult(ok=False, error=_writable(text) or "the tool reported an error")
        return ToolResult(ok=True, output=text)

    def close(self) -> None:
        """End the server: close its input, wait, terminate, kill (stdio); DELETE (HTTP).
        In a forked child it does nothing: the server is the parent's."""
        if not self._not_ours():
            self._server.close()


def mcp_tools(server, *, env=None, cwd=None, headers=None, timeout=60, prefix="") -> MCPTools:
    """Start (or reach) an MCP server and shake hands with it; returns its MCPTools.

    ``server`` is a command -- a list, or a string split as a shell would -- spoken to over
    stdio, or an ``http://`` / ``https://`` URL spoken to over Streamable HTTP (``headers``
    for its authorization). A stdio server runs in its own process group, in ``cwd``, with
    lich's environment minus the provider keys, plus ``env``; its stderr goes to the
    ``lich`` logger. A server that fails to start or to answer within ``timeout`` seconds
    raises MCPError with its own words.
    """
    _check_seconds("timeout", timeout)
    for name, value in (("env", env), ("headers", headers)):
        if value is not None and not (isinstance(value, dict) and all(
                isinstance(k, str) and isinstance(v, str) for k, v in value.items())):
            raise TypeError(f"{name} must be a dict of strings to strings, not {value!r}")
    holder = []

    def list_changed():
        if holder:
            holder[0]._list_changed()

    if isinstance(server, str) and re.match(_HTTP_URL, server):
        transport = _HTTPServer(server, headers, list_changed)
    else:
        import shlex
        argv = shlex.split(server) if isinstance(server, str) else [str(a) for a in server]
        if not argv:
            raise ValueError("mcp_tools needs a command or a URL")
        transport = _StdioServer(argv, env, cwd, list_changed)
    tools = MCPTools(transport, timeout=timeout, prefix=prefix)
    holder.append(tools)
    try:
        tools._handshake()
    except (_RPCError, _Gone, _Cut) as e:
        tools.close()
        if isinstance(e, _Gone):
            reason = e.args[0]
        elif isinstance(e, _RPCError):
            reason = f"the MCP server {transport.name} refused to start a session: {e.args[1]}"
        else:
            reason = f"the MCP server {transport.name} did not answer within {timeout:g} s"
        tail = transport.stderr_tail("\n") if not isinstance(e, _Gone) else ""
        raise MCPError(reason + tail) from None
    except BaseException:
        tools.close()
        raise
    return tools


# ============================================================================
# Tracing
# ============================================================================


def _chat_identity(chat) -> dict:
    """The ``model`` and ``provider`` of a ChatFn, looking through Routers and limiters (a
    few steps at most: an object that answers every attribute, a mock, would go on for ever)."""
    seen = [chat]
    for _ in range(_CHAT_WRAPPINGS_FOLLOWED):
        chats = getattr(chat, "chats", None)
        inner = chats[0] if isinstance(chats, (list, tuple)) and chats else getattr(chat, "chat", None)
        if inner is None or any(inner is known for known in seen):
            break
        chat = inner
        seen.append(chat)
    model, provider = getattr(chat, "model", None), getattr(chat, "provider", None)
    return {"model": model if isinstance(model, str) else None,
            "provider": provider if isinstance(provider, str) and provider else None}


_CHAT_WRAPPINGS_FOLLOWED = 8  # a Router of limited chats is two


def trace_otel(emitter, *, tracer=None, model=None, provider=None, capture_content=False):
    """Turn the runs on ``emitter`` into OpenTelemetry spans (the GenAI conventions); returns
    the unsubscribe function.

    ``invoke_agent`` (INTERNAL) spans a run, from its first ``turn_start`` to its end, under
    whatever span is current where it starts; it is the parent of a ``chat {model}``
    (CLIENT) span per chat call and an ``execute_tool {name}`` (INTERNAL) span per tool call
    that ran. Failures set the span's status to ERROR and ``error.type``. Arguments, results
    and the assistant's text are recorded only with ``capture_content``. Needs the
    ``opentelemetry-api`` package; ``tracer`` defaults to ``get_tracer("lich", __version__)``.
    """
    try:
        from opentelemetry import context as otel_context
        from opentelemetry import trace
    except ImportError as e:
        raise ImportError("trace_otel needs the OpenTelemetry API: pip install "
                          "opentelemetry-api (and opentelemetry-sdk to export spans)") from e
    tracer = tracer or trace.get_tracer("lich", __version__)
    kinds = trace.SpanKind
    common = {"gen_ai.provider.name": provider, "gen_ai.request.model": model}
    common = {k: v for k, v in common.items() if v is not None}
    # thread id -> the runs under way in that thread, outermost first: runs in threads stay
    # apart, and a run started by a tool of another (a sub-agent) is traced inside it
    runs = {}

    def fail(span, exc_or_type, description=None):
        kind = exc_or_type if isinstance(exc_or_type, str) else (
            exc_or_type.kind if isinstance(exc_or_type, ProviderError) else type(exc_or_type).__name__)
        if description is None:
            try:
                description = str(exc_or_type)
            except Exception:  # an exception class whose __str__ raises
                description = _exception_text(exc_or_type)
        span.set_attribute("error.type", kind)
        span.set_status(trace.Status(trace.StatusCode.ERROR, _redact_secrets(description) or None))

    def end_tool(state, key):
        """The tool span of ``key``, no longer current (None if it was not open)."""
        token = state["current"].pop(key, None)
        if token is not None:
            otel_context.detach(token)
        return state["tools"].pop(key, None)

    def end_run(state, error=None):
        for key in reversed(list(state["tools"])):
            span = end_tool(state, key)
            if error is not None:
                fail(span, error)
            span.end()
        if state["chat"] is not None:
            if error is not None:
                fail(state["chat"], error)
            state["chat"].end()
        agent = state["agent"]
        agent.set_attribute("gen_ai.usage.input_tokens", state["usage"]["input_tokens"])
        agent.set_attribute("gen_ai.usage.output_tokens", state["usage"]["output_tokens"])
        if error is not None:
            fail(agent, error)
        agent.end()
        stack = runs.get(threading.get_ident(), [])
        stack[:] = [run for run in stack if run is not state]
        if not stack:
            runs.pop(threading.get_ident(), None)

    def on_event(event):
        kind = event["type"]
        stack = runs.get(threading.get_ident())
        state = stack[-1] if stack else None
        if kind == "turn_start" and event.get("turn") == 1 and state is not None and not state["tools"]:
            # this thread's run before ended without its last events (Ctrl-C): not one whose
            # tool runs this one
            while stack:
                end_run(stack[-1], "interrupted")
            state = None
        if kind == "turn_start" and event.get("turn") == 1 or kind == "turn_start" and state is None:
            agent = tracer.start_span(
                "invoke_agent", context=otel_context.get_current(), kind=kinds.INTERNAL,
                attributes={"gen_ai.operation.name": "invoke_agent", **common})
            state = {"agent": agent, "context": trace.set_span_in_context(agent), "chat": None,
                     "tools": {}, "current": {}, "usage": _zero_usage()}
            runs.setdefault(threading.get_ident(), []).append(state)
        elif state is None:
            return
        elif kind == "llm_start":
            state["chat"] = tracer.start_span(
                f"chat {model}" if model else "chat", context=state["context"], kind=kinds.CLIENT,
                attributes={"gen_ai.operation.name": "chat", **common})
        elif kind == "llm_end" and state["chat"] is not None:
            span, result = state["chat"], event["result"]
            usage = result.usage or {}
            _add_usage(state["usage"], usage)
            attributes = {"gen_ai.response.model": result.model,
                          "gen_ai.response.finish_reasons": [result.stop_reason] if result.stop_reason else None,
                          "gen_ai.usage.input_tokens": usage.get("input_tokens"),
                          "gen_ai.usage.output_tokens": usage.get("output_tokens"),
                          "gen_ai.usage.cache_read.input_tokens": usage.get("cache_read_tokens")}
            if capture_content:
                attributes["gen_ai.output.messages"] = _redact_secrets(json.dumps(
                    [_output_message(result)], ensure_ascii=False))
            span.set_attributes({k: v for k, v in attributes.items() if v is not None})
            span.end()
            state["chat"] = None
        elif kind == "tool_call_start":
            call = event["call"]
            attributes = {"gen_ai.operation.name": "execute_tool",
                          "gen_ai.tool.name": str(call.get("name")),
                          "gen_ai.tool.call.id": str(call.get("id"))}
            if capture_content:
                attributes["gen_ai.tool.call.arguments"] = _redact_secrets(
                    str(call.get("arguments") or ""))
            span = state["tools"][id(call)] = tracer.start_span(
                f"execute_tool {call.get('name')}", context=state["context"], kind=kinds.INTERNAL,
                attributes=attributes)
            # current while the tool runs: what it traces (a sub-agent's run) nests under it
            state["current"][id(call)] = otel_context.attach(trace.set_span_in_context(span))
        elif kind == "tool_call_end" and not event.get("cancelled"):
            span = end_tool(state, id(event["call"]))
            if span is not None:
                result = event["result"]
                if capture_content:
                    span.set_attribute("gen_ai.tool.call.result",
                                       result.output if result.ok else format_tool_result_content(result))
                if not result.ok:
                    fail(span, "tool_error", result.error)
                span.end()
        elif kind == "error":
            end_run(state, event["error"])  # the loop emits nothing after an error
        elif kind == "budget_exhausted":
            state["agent"].set_attribute("lich.stopped_reason", "budget")
        elif kind == "turn_end":
            end_run(state)

    return emitter.on_any(on_event)


def _output_message(result) -> dict:
    """A ChatResult as one of the GenAI conventions' output messages."""
    message = result.message
    parts = [{"type": "text", "content": message.get("content")}] if message.get("content") else []
    for call in message.get("tool_calls") or ():
        try:
            arguments = json.loads(call.get("arguments") or "{}")
        except (ValueError, RecursionError):
            arguments = call.get("arguments")
        parts.append({"type": "tool_call", "id": call.get("id"), "name": call.get("name"),
                      "arguments": arguments})
    return {"role": "assistant", "parts": parts, "finish_reason": result.stop_reason or "stop"}


# ============================================================================
# Many runs
# ============================================================================

_TASK_ID = r"[A-Za-z0-9_.-]{1,64}\Z"
_TASK_KEYS = frozenset({"id", "prompt", "history", "system_prompt", "root"})


@dataclass
class BatchResult:
    """How one task of ``run_batch`` ended; ``ok`` when it ended with a final answer."""

    id: str
    ok: bool
    stopped_reason: Optional[str]
    final: Optional[str]
    output: Any = None
    error: Optional[str] = None
    usage: dict = field(default_factory=_zero_usage)
    session_path: Optional[str] = None


def _batch_tasks(tasks) -> list:
    """The tasks as dicts with ids, checked before anything runs."""
    checked, ids = [], set()
    for position, task in enumerate(tasks):
        task = {"prompt": task} if isinstance(task, str) else task
        if not isinstance(task, dict) or not isinstance(task.get("prompt"), str):
            raise TypeError(f"task {position} must be a prompt or a dict with a 'prompt' string")
        unknown = sorted(set(task) - _TASK_KEYS)
        if unknown:
            raise ValueError(f"task {position} has unknown keys: {', '.join(unknown)}")
        task_id = task.get("id", str(position))
        if not isinstance(task_id, str) or not re.match(_TASK_ID, task_id):
            raise ValueError(f"task {position}: the id {task_id!r} must be 1 to 64 letters, "
                             f"digits, '_', '.' or '-'")
        if task_id in ids:
            raise ValueError(f"task {position}: the id {task_id!r} is used twice")
        history = task.get("history")
        if history is not None and not (isinstance(history, list) and all(
                isinstance(m, dict) and m.get("role") in ("system", "user", "assistant", "tool")
                for m in history)):  # a message of another role would be sent, and refused
            raise TypeError(f"task {position}: 'history' must be a list of messages")
        if task.get("system_prompt") is not None and not isinstance(task["system_prompt"], str):
            raise TypeError(f"task {position}: 'system_prompt' must be a string")
        if task.get("root") is not None and not isinstance(task["root"], (str, os.PathLike)):
            raise TypeError(f"task {position}: 'root' must be a path")
        ids.add(task_id)
        checked.append({**task, "id": task_id})
    return checked


def _error_text(exc) -> str:
    if isinstance(exc, ProviderError):
        return _redact_secrets(f"{exc.kind}: {exc}")
    return _redact_secrets(_exception_text(exc))


_batch_chats = threading.local()  # per worker thread: spec -> ChatFn, one connection pool each
_BATCH_RETRIES = 8  # a batch's spec chats retry more than one run's: many workers meet 429s
_BATCH_CHATS_KEPT = 4  # spec chats kept per worker thread, for the batches that reuse it


def _run_task(task, chat, tools, limiter, session_dir, trace, loop_params, submission=None) -> BatchResult:
    """One task of a batch, in whatever thread or process runs it; never raises. A task that
    fails still reports what its calls used. ``submission`` is unused: a token of each
    submission, so that an executor that names a task by its arguments (Dask) never hands
    back an earlier submission's result for a task run again."""
    used = _zero_usage()
    session = None
    try:
        if isinstance(chat, str):
            chats = getattr(_batch_chats, "chats", None)
            if chats is None:
                chats = _batch_chats.chats = {}
            key = (chat, id(limiter))  # the cached Router holds the limiter: its id stays its own
            cached = chats.pop(key, None)  # taken out and put back: the dict runs oldest-used first
            if cached is None:
                if len(chats) >= _BATCH_CHATS_KEPT:  # a pool serving batch after batch
                    del chats[next(iter(chats))]  # the least recently used goes, its connections with it
                cached = chat_from_spec(chat, limiter=limiter, retries=_BATCH_RETRIES)
            chat = chats[key] = cached
        elif limiter is not None:
            chat = limiter.wrap(chat)
        if tools is not None and not hasattr(tools, "specs") and callable(tools):
            tools = tools(task)
            _refuse_coroutine(tools, "tools")
        elif tools is None and task.get("root") is not None:
            tools = coding_tools(task["root"])
        params = dict(loop_params)
        if "system_prompt" in task:
            params["system_prompt"] = task["system_prompt"]
        emitter = AgentEmitter()
        emitter.on("llm_end", lambda event: _add_usage(used, event["result"].usage))
        if trace:
            trace_otel(emitter, tracer=None if trace is True else trace, **_chat_identity(chat))
        if session_dir is not None:  # opened here, so that a failed task still points at it
            try:
                session = open_session(session_dir, task["id"])
            except OSError:
                pass  # run_agent tries again, and says why it cannot
        run = run_agent(task["prompt"], chat=chat, tools=tools, history=task.get("history"),
                        session=session, session_dir=None if session else session_dir,
                        label=task["id"], emitter=emitter, **params)
    except AbortError:  # stopped by the signal inside a chat call: at its boundary
        return BatchResult(task["id"], False, "aborted", None, usage=used,
                           session_path=session and session.path)
    except BaseException as exc:  # failures are data: the batch goes on
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        return BatchResult(task["id"], False, None, None, error=_error_text(exc), usage=used,
                           session_path=session and session.path)
    finally:
        if session is not None:
            session.close()
    final = run.final.get("content") if run.final else None
    return BatchResult(task["id"], run.stopped_reason == "final", run.stopped_reason, final,
                       output=run.output, usage=run.usage_total, session_path=run.session_path)


_batch_out_files = set()  # descriptors of the out files of the batches running in this process


def _close_batch_out_files_after_fork():
    """A forked child (a process pool's worker) lets go of its parent's out files: its copy
    would hold their lock after the parent's batch ended."""
    for fd in list(_batch_out_files):
        try:
            os.close(fd)
        except OSError:
            pass
    _batch_out_files.clear()


_after_fork(_close_batch_out_files_after_fork)


def _done_result(line):
    """The BatchResult of a line of an ``out`` file, or None unless it holds a finished task:
    a BatchResult's fields whose ``ok`` is true and whose ``id`` is a string. Its other
    fields are read as null (``usage`` as zero) when of another type: the file may have been
    edited by hand."""
    try:
        result = BatchResult(**json.loads(line))
    except (ValueError, TypeError, RecursionError):
        return None  # a line cut by a kill, or not ours
    if result.ok is not True or not isinstance(result.id, str):
        return None
    texts = {key: value if isinstance(value, str) else None for key, value in (
        ("stopped_reason", result.stopped_reason), ("final", result.final),
        ("error", result.error), ("session_path", result.session_path))}
    usage = result.usage if isinstance(result.usage, dict) else _zero_usage()
    return replace(result, usage=usage, **texts)


_OUT_LOCK_WAIT_SECONDS = 1.0  # how long a batch waits for another to let its out file go
_OUT_LOCK_STEP_SECONDS = 0.01


def _results_file(out, redo):
    """(descriptor opened for appending, {id: BatchResult of the ok lines already there}).

    The file stays locked (``flock``) while the batch runs: a second batch on it would run
    the same pending tasks again, so it is refused. (Where the file system has no locks, it
    goes unlocked.) The caller closes the descriptor with ``_close_results_file``.
    """
    out = os.fspath(out)
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(out, flags, 0o644)
    _batch_out_files.add(fd)
    try:
        try:
            import fcntl
        except ImportError:  # Windows: no lock
            pass
        else:
            # A child a thread is starting holds a copy of the descriptor, and so the lock,
            # until it runs its program: a batch just ended there may still seem to run.
            deadline = time.monotonic() + _OUT_LOCK_WAIT_SECONDS
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    if time.monotonic() < deadline:
                        time.sleep(_OUT_LOCK_STEP_SECONDS)
                        continue
                    raise OSError(errno.EBUSY, "another batch is writing to it", out) from None
                except OSError as e:  # ENOLCK, EOPNOTSUPP: some network and FUSE file systems
                    _log.debug("batch out file %s goes unlocked: %s", out, e)
                break
        done = {}
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # a pipe (--out >(gzip ...)) or a device:
            return fd, done  # nothing to read back, and reading it would wait for ever
        if redo:
            os.ftruncate(fd, 0)
        with open(out, "rb") as f:
            for line in f:
                result = _done_result(line)
                if result is not None:
                    done[result.id] = result
            size = f.tell()
            if size:
                f.seek(size - 1)
                if f.read(1) != b"\n":  # a line cut by a kill: the next starts on its own
                    os.write(fd, b"\n")
    except BaseException:
        _close_results_file(fd)
        raise
    return fd, done


def _close_results_file(fd):
    _batch_out_files.discard(fd)
    try:  # Unlocked before it is closed: a child forked in C (a uWSGI worker, or its HTTP
        # router, which never runs Python) holds a copy of the descriptor, and with it the
        # lock, which then outlived the batch.
        import fcntl

        fcntl.flock(fd, fcntl.LOCK_UN)
    except (ImportError, OSError):  # no flock here (Windows): it was not locked
        pass
    os.close(fd)


def _task_result(future, task):
    """The BatchResult of a task's finished future; a task that raised, or that the executor
    lost, is an ``ok=False`` one."""
    try:  # not result(): its raising would tie this frame to the failure, and a
        failure = future.exception()  # cluster keeps what a future still held is
        return future.result() if failure is None else BatchResult(
            task["id"], False, None, None, error=_error_text(failure))
    except BaseException as exc:  # the executor's failure: this task is lost
        return BatchResult(task["id"], False, None, None, error=_error_text(exc))


def run_batch(tasks, *, chat, tools=None, workers=8, executor=None, session_dir=None, out=None,
              redo=False, limiter=None, max_errors=None, signal=None, on_result=None,
              trace=False, **loop_params) -> list:
    """Run many tasks, each one ``run_agent``; returns their BatchResults in task order.

    ``tasks`` are prompts or dicts ``{"id"?, "prompt", "history"?, "system_prompt"?, "root"?}``
    (ids default to the position; unique, ``[A-Za-z0-9_.-]{1,64}``). ``chat`` is a ChatFn or
    a spec string (a Router per worker, retrying 8 times: a batch meets rate limits);
    ``tools`` a ToolRunner, or ``tools(task)`` giving one; a task's ``root`` without
    ``tools`` means ``coding_tools(root)``. Tasks run on
    ``workers`` threads, or on ``executor`` (any ``concurrent.futures.Executor``: a process
    pool, a Dask client's executor), to which each is submitted whole. ``limiter`` limits
    every call (in each process). ``out`` is a JSONL file: a line per finished task,
    appended and flushed as it finishes; tasks with an ok line there are not run again (a
    killed batch resumes) unless ``redo``. A task that raises is an ``ok=False`` result;
    after ``max_errors`` of them, or once ``signal`` is set, no new task starts (running
    ones stop at their next boundary; tasks never started have ``error`` "not started").
    An event cannot reach another process: on a process pool or a cluster the signal stops
    what has not started, and tasks already running there run to their end.
    ``on_result(result)`` is called in the caller's thread as each task finishes;
    ``trace=True`` traces each run with ``trace_otel`` (``trace`` may also be the tracer to
    use, for threads). ``loop_params`` go to each run.
    """
    from concurrent import futures

    # each task's run has an emitter of its own, which sums its usage
    _check_loop_keywords("run_batch", loop_params, taken=("emitter",))
    if "max_turns" not in loop_params:  # as run_agent says it
        raise TypeError("run_batch() missing 1 required keyword-only argument: 'max_turns'")
    _check_loop_options(loop_params)
    _refuse_async(on_result, "on_result")
    if not hasattr(tools, "specs"):  # a tools(task) that makes each task's ToolRunner
        _refuse_async(tools, "tools")
    if trace is True:  # without OpenTelemetry: its ImportError now, not a failure per task
        trace_otel(AgentEmitter())()
    if max_errors is not None and (isinstance(max_errors, bool) or not isinstance(max_errors, int)
                                   or max_errors < 1):  # 0 would start nothing
        raise ValueError(f"max_errors must be an int >= 1 or None (the failures after which no "
                         f"new task starts), not {max_errors!r}")
    if isinstance(workers, bool) or not isinstance(workers, int):  # None: a bare comparison error
        raise TypeError(f"workers must be an int, not {type(workers).__name__}")
    tasks = _batch_tasks(tasks)
    own = executor is None
    pool = futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="lich-batch") \
        if own else executor
    # The standard library's executors cancel only what has not started
    cancels_queued_only = isinstance(pool, (futures.ThreadPoolExecutor, futures.ProcessPoolExecutor))
    # opened once the pool is made (a mistaken ``workers`` raises first), before it has a thread
    fd, done = _results_file(out, redo) if out is not None else (None, {})
    results = dict(done)
    pending = [task for task in tasks if task["id"] not in results]
    # Tasks in this process stop on this event: set by the caller's signal, or on the way
    # out by an exception (Ctrl-C in the caller, a failing on_result), so none runs on.
    stopping = threading.Event()
    if own or isinstance(executor, futures.ThreadPoolExecutor):
        loop_params["signal"] = stopping
    errors = 0
    running = {}
    broken = None  # why the executor takes no more tasks
    first_stop = None  # what first kept new tasks from starting: "signal", "broken", "errors"

    def stopped_by(cause):  # a signal set by then is named first: it came no later
        nonlocal first_stop
        if first_stop is None:
            first_stop = "signal" if signal is not None and signal.is_set() else cause

    try:
        while pending or running:
            if signal is not None and signal.is_set():
                stopped_by("signal")
                stopping.set()
            stop = stopping.is_set() or broken is not None or (
                max_errors is not None and errors >= max_errors)
            if stop and cancels_queued_only:  # what waits in its queue does not start (a
                for future in running:  # running one runs on); another executor's cancel
                    future.cancel()  # may stop a running task (Dask's): what it has, ends
            while pending and not stop and len(running) < max(1, workers):
                task = pending[0]
                args = (task, chat, tools, limiter, session_dir, trace, loop_params, os.urandom(8))
                try:
                    if own:  # spans of the tasks nest under the caller's current one
                        import contextvars
                        submitted = pool.submit(contextvars.copy_context().run, _run_task, *args)
                    else:
                        submitted = pool.submit(_run_task, *args)
                # a worker's death broke the pool, or the host shut it down (at exit, say)
                except (futures.BrokenExecutor, RuntimeError) as exc:
                    broken = f"the executor takes no more tasks: {_error_text(exc)}"
                    stopped_by("broken")
                    break
                running[submitted] = pending.pop(0)
            if not running:
                break
            finished, _ = futures.wait(running, timeout=_WATCH_SECONDS,
                                       return_when=futures.FIRST_COMPLETED)
            for future in finished:
                task = running.pop(future)
                if future.cancelled():  # never started: it is among the tasks not started
                    pending.append(task)
                    continue
                result = results[task["id"]] = _task_result(future, task)
                errors += not result.ok and result.stopped_reason is None
                if max_errors is not None and errors >= max_errors:
                    stopped_by("errors")
                if fd is not None:
                    os.write(fd, _json_line(asdict(result)))
                if on_result is not None:
                    _refuse_coroutine(on_result(result), "on_result")
            # A cluster keeps a task's result while a future of it is held, and runs it again
            # when the worker that holds it dies (Dask): the batch holds none it has read.
            finished = future = submitted = None
    finally:
        stopping.set()
        try:
            for future in running:
                future.cancel()
            if own:
                pool.shutdown(wait=True)
            if fd is not None:  # tasks that finished on the way out: a resume does not redo them
                for future, task in running.items():
                    if future.done() and not future.cancelled():
                        os.write(fd, _json_line(asdict(_task_result(future, task))))
        finally:  # a second Ctrl-C in the wait above still lets the file go
            if fd is not None:
                _close_results_file(fd)
    why = {"signal": "the signal was set", "broken": broken}.get(first_stop) or \
        f"{errors} {'task' if errors == 1 else 'tasks'} failed (max_errors={max_errors})"
    return [results.get(task["id"]) or BatchResult(task["id"], False, None, None,
                                                   error=f"not started: {why}")
            for task in tasks]


# ============================================================================
# Command line
# ============================================================================

_DEFAULT_MAX_TURNS = 30
_DEFAULT_CONTEXT_BUDGET = 100_000
_DEFAULT_WORKERS = 8
_DEFAULT_OPENAI_MODEL = "openai:gpt-4.1-mini"
_DEFAULT_ANTHROPIC_MODEL = "anthropic:claude-sonnet-4-5"
_LIST_SESSIONS_LIMIT = 20
_PROMPT_SHOWN_CHARS = 200       # of a session's first prompt, in --list-sessions --json
_RECORD_PIECE_BYTES = 1 << 20  # a longer line of a session file is read in pieces: kept if
                                # it starts a record
_QUIT_WINDOW_SECONDS = 2.0      # a second Ctrl-C this soon quits, whatever lich is doing
_QUIT_GRACE_SECONDS = 0.5       # then the run has this long to end, recorded and traced
_TOOL_SUMMARY_CHARS = 60
_PREVIEW_LINES = 3              # lines of a tool's output shown under its line
_PLAIN_LINE_CHARS = 400         # the most of a tool's line or preview line kept in a log
_DIFF_SHOWN_LINES = 40          # an approval's diff longer than this is cut in the middle
_DIFF_LINE_CHARS = 500          # and a line of it longer than this (a minified file's)
_RECAP_LINES = 4                # lines of each message of the last exchange shown on resume
_RECAP_LINE_CHARS = 120         # and the most characters of each of those lines
_TOOL_ELAPSED_SECONDS = 1.0     # a tool running longer shows its elapsed time
_INSTRUCTIONS_MAX_BYTES = 256 << 10  # of AGENTS.md / CLAUDE.md, what goes into the system prompt
_HISTORY_LINES = 1000           # chat input lines kept between chats
_HISTORY_LOCK_SECONDS = 2       # a leaving chat's wait for another's writing of the history
_HISTORY_LOCK_STEP_SECONDS = 0.01
_DIFF_MAX_BYTES = 1 << 20       # of a file about to be overwritten, what its diff is made from
_ANSWER_BYTES = 4096            # an approval's answer: a line, read at most this long at once
_POLL_SECONDS = 0.1             # how often a waiting CLI looks at its run, the signal, stdin
_STDIN_QUIET_SECONDS = 2.0      # a piped stdin silent this long is said to be waited for
_MCP_QUIET_SECONDS = 2.0        # an --mcp server not started after this long is said to be waited for
_MCP_NAMED = r"([a-z][a-z0-9_-]{0,31})="  # --mcp name=SERVER (a command cannot begin so: no shell runs it)
_STDIN_WAIT_NOTE = ("lich: waiting for stdin to end: what it brings is added to the prompt (run with "
                    "</dev/null to add nothing)")
_CLOSE_SECONDS = 6.0            # the most lich waits on its way out for MCP servers and the tracer
_SPINNER_FRAMES = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"
# lich's own marks as a stderr that cannot show them (PYTHONIOENCODING=ascii) writes them
_ASCII_MARKS = str.maketrans({"→": "->", "✓": "ok", "✗": "x", "…": "...", "›": ">",
                              "·": "-", **dict(zip(_SPINNER_FRAMES, "|/-\\|/-\\|/"))})
_SPINNER_INTERVAL = 0.1
_EXIT_OK, _EXIT_ERROR, _EXIT_USAGE, _EXIT_BUDGET, _EXIT_INTERRUPTED = 0, 1, 2, 3, 130
_BATCH_CHAT_RETRIES = 8  # as run_batch's spec chats: a batch's many workers meet rate limits
_INTERRUPTED_NOTE = "[interrupted by the user]"
_BROKE_OFF_NOTE = "[the answer broke off]"  # and of one whose stream failed after some text
_NO_MODEL_HELP = (
    "no model configured: pass -m/--model or set LICH_MODEL (e.g. openai:gpt-4.1-mini or "
    "anthropic:claude-sonnet-4-5), or set OPENAI_API_KEY or ANTHROPIC_API_KEY; for a local "
    "OpenAI-compatible server such as Ollama set OPENAI_BASE_URL=http://localhost:11434/v1")
_DEFAULT_SYSTEM_PROMPT = (
    "You are lich, a careful coding agent working in the folder {root}. "
    "Your tools: {tools}. Paths are relative to that folder and must stay inside it. "
    "Look before you change anything, keep changes small, and say what you did. "
    "{answer}")
_PLAIN_ANSWER = "Answer concisely in plain text."
_SCHEMA_ANSWER = "Your final answer is one JSON value, as the answer's schema asks."
_CHAT_COMMANDS = {  # name: (what it takes, what it does)
    "/model": ("[SPEC]", "show the model, or switch to SPEC for the next turns"),
    "/allow": ("[revoke N|all]", "show what was allowed always, or take it back"),
    "/compact": ("", "compress the conversation now"),
    "/cost": ("", "tokens used in this chat"),
    "/resume": ("[ID|latest]", "continue a recorded session (latest of this folder)"),
    "/sessions": ("", "list recent sessions"),
    "/clear": ("", "start a new conversation and session file"),
    "/help": ("", "this text"),
    "/exit": ("", "leave (/quit and Ctrl-D too)"),
}
_CHAT_KEYS = ('Enter sends; a line ending in \\ goes on to the next; """ on a line of its own '
              'opens and closes a block; pasted text is one message. Ctrl-C stops a turn, twice '
              'quits.')
_HELP_EPILOG = """examples:
  lich "why does the test fail?"                 one question, read-only tools
  lich --allow write --allow shell "fix it"      may edit files and run commands (asks on a terminal)
  git diff | lich "review this"                  piped text is added as context
  lich                                           interactive chat (/help inside)
  lich -i "look around"                          chat, starting with a first prompt
  lich -c "go on"                                continue this folder's latest session
  lich --mcp "uvx mcp-server-time" "time in Lima?"   tools of an MCP server
  lich --schema '{"type":"object"}' "..."        the answer as one JSON value
  lich --batch tasks.jsonl --out results.jsonl   many tasks; run it again to resume

exit codes:
  0 a final answer   1 a provider or runtime error   2 a usage error or unknown session
  3 the turn budget ran out   130 interrupted   128+N ended by signal N (SIGTERM, SIGHUP)

environment:
  LICH_MODEL            the default model spec
  OPENAI_API_KEY, OPENAI_BASE_URL, ANTHROPIC_API_KEY, ANTHROPIC_BASE_URL
  LICH_SESSION_DIR      where sessions go (else $XDG_STATE_HOME/lich/sessions)
  NO_COLOR              no colour; TERM=dumb: no colour, spinner or cursor movement
  OTEL_*                OpenTelemetry exporter settings, with --otel"""


def _cli_log():
    import logging

    return logging.getLogger("lich")


class _UsageError(Exception):
    """A command-line mistake: exit 2 with the message."""


class _Quit(BaseException):
    """A second Ctrl-C (or SIGTERM, SIGHUP): leave now with ``args[0]`` as the exit code.
    A BaseException, as SystemExit is: no ``except Exception`` on the way out keeps it."""


class _StdoutClosed(_Quit):
    """The reader of stdout went away (``lich ... | head``): leave quietly, exit code 0."""


class _StdoutFailed(_Quit):
    """stdout cannot be written (a full disk): stop the run, whose output would be lost,
    and leave with ``args[1]`` said."""


# --- options and defaults ---


def _build_parser():
    import argparse

    parser = argparse.ArgumentParser(
        prog="lich", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=_HELP_EPILOG,
        description="A coding agent on the command line: one-shot with PROMPT, an interactive "
                    "chat without. Piped stdin is added to the prompt as context.")
    add = parser.add_argument
    add("prompt", nargs="?", metavar="PROMPT", help="what to do; omit for interactive chat")
    add("-i", "--interactive", action="store_true", help="stay in chat after PROMPT")
    add = parser.add_argument_group("model").add_argument
    add("-m", "--model", metavar="SPEC", help="provider:model[@base_url], comma-separated for "
        "failover (default: $LICH_MODEL, else by the API key that is set)")
    add("--base-url", metavar="URL", help="the provider's base URL (for each spec without an @URL)")
    add("-s", "--system", metavar="TEXT", help="the system prompt")
    add("--temperature", type=_finite_number, metavar="T", help="sampling temperature")
    add("--max-tokens", type=_positive_int, metavar="N",
        help="the longest answer, in tokens (default: the provider's; Anthropic's is 4096)")
    add("--max-turns", type=_positive_int, default=_DEFAULT_MAX_TURNS, metavar="N",
        help=f"model calls per run (default {_DEFAULT_MAX_TURNS})")
    add("--context-budget", type=_non_negative_int, default=_DEFAULT_CONTEXT_BUDGET,
        metavar="TOKENS", help=f"the history is compressed once its estimate reaches 80%% of "
                               f"this (default {_DEFAULT_CONTEXT_BUDGET}; 0 turns compression off)")
    add("--schema", metavar="JSON|@FILE", help="answer with one JSON value valid under this "
                                               "JSON Schema (printed as one line)")
    add = parser.add_argument_group("tools").add_argument
    add("--allow", action="append", choices=("write", "shell"), default=[],
        help="offer the file-writing or shell tools (repeatable); on a terminal each call "
             "asks first")
    add("--yolo", action="store_true", help="offer write and shell tools and never ask")
    add("--mcp", action="append", default=[], metavar="SERVER", help="offer an MCP server's "
        "tools: a command line or an http(s) URL, name=SERVER to offer them as name_tool "
        "(repeatable)")
    add("--root", default=".", metavar="DIR", help="the tools' workspace (default: .)")
    add("--no-project-instructions", action="store_true",
        help="do not add AGENTS.md (or CLAUDE.md) to the system prompt")
    add = parser.add_argument_group("sessions").add_argument
    add("--session-dir", metavar="DIR", help="where sessions are recorded (default "
        "$LICH_SESSION_DIR, else $XDG_STATE_HOME/lich/sessions, else ~/.local/state/lich/sessions)")
    add("--no-session", action="store_true", help="record nothing")
    add("--label", metavar="L", help="a label for the session file name")
    add("--resume", metavar="ID", help="continue a session: an id, a unique prefix or 'latest'")
    add("-c", "--continue", dest="continue_", action="store_true",
        help="continue the latest session of this folder")
    add("--list-sessions", action="store_true", help="list sessions, newest first")
    add = parser.add_argument_group("batches").add_argument
    add("--batch", metavar="FILE", help="run every task of FILE: JSON lines "
        "({\"id\", \"prompt\", ...}) or one prompt per line")
    add("--workers", type=_positive_int, metavar="N",
        help=f"tasks run at once (default {_DEFAULT_WORKERS})")
    add("--out", metavar="PATH", help="the batch's results file (default: JSON lines on "
        "stdout); an existing one resumes the batch")
    add("--redo", action="store_true", help="run every task again")
    add = parser.add_argument_group("output").add_argument
    add("--json", action="store_true", help="print every loop event as a JSON line on stdout")
    add("--no-stream", action="store_true", help="show the answer when it is complete")
    add("--otel", action="store_true", help="send OpenTelemetry spans, as the OTEL_* "
        "variables say")
    add("-q", "--quiet", action="store_true", help="no tool lines, spinner, notes or usage")
    add("-v", "--verbose", action="store_true", help="debug logs and tracebacks on stderr")
    parser.add_argument("--version", action="version", version=f"lich {__version__}")
    return parser


def _positive_int(text):
    return _int_at_least(text, 1)


def _non_negative_int(text):
    return _int_at_least(text, 0)


def _finite_number(text):
    import argparse

    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):  # JSON has no nan or inf: a server would refuse the body
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}")
    return value


def _int_at_least(text, low):
    import argparse

    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < low:
        raise argparse.ArgumentTypeError(f"expected a whole number >= {low}, got {text!r}")
    return value


def _state_home(environ) -> str:
    state = os.path.expanduser(environ.get("XDG_STATE_HOME") or "")
    if not os.path.isabs(state):  # the XDG spec: a relative path is invalid and ignored
        state = os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(state, "lich")


def _input_history(path) -> list:
    """The chat input kept in the history file (JSON lines: a paste keeps its newlines), its
    last _HISTORY_LINES; [] when there is none. A line that is no JSON string is an entry as
    it stands: the first chats of lich wrote readline's plain lines there, and the file is
    written again from what is read here."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = [line for line in f.read().split("\n") if line.strip()][-_HISTORY_LINES:]
    except OSError:
        return []
    entries = []
    for line in lines:
        try:
            entry = json.loads(line)
        except (ValueError, RecursionError):
            entry = None
        entries.append(entry if isinstance(entry, str) and entry else line)
    return entries


def _history_lock(folder):
    """A descriptor of ``folder`` locked (``flock``) for the input history's writing, or None
    where there is no such lock (Windows, a folder that cannot be read, a file system
    without locks) or it stays taken past _HISTORY_LOCK_SECONDS (a chat stopped mid-save):
    the file is then written unlocked, as a leaving chat must not wait for ever."""
    try:
        import fcntl

        fd = os.open(folder, os.O_RDONLY)
    except (ImportError, OSError):
        return None
    deadline = time.monotonic() + _HISTORY_LOCK_SECONDS
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() < deadline:
                time.sleep(_HISTORY_LOCK_STEP_SECONDS)
                continue
        except OSError:
            pass
        os.close(fd)
        return None


def _sessions_home(given, environ) -> str:
    """Where sessions go: --session-dir, else LICH_SESSION_DIR, else the state folder's. A
    leading ~ is expanded: one in an env file or a systemd unit reaches lich as it is (a
    folder named ~ was made in the current folder, the tools' root)."""
    return os.path.expanduser(given or environ.get("LICH_SESSION_DIR")
                              or os.path.join(_state_home(environ), "sessions"))


def _shown_url(text) -> str:
    """A URL as the terminal shows it: without its user-info and query, where keys are put
    (``http://user:key@host/v1?api_key=...``)."""
    from urllib.parse import urlsplit

    try:
        url = urlsplit(text)
        host = url.hostname or ""
        port = f":{url.port}" if url.port else ""
    except ValueError:
        return "..."
    host = f"[{host}]" if ":" in host else host
    return f"{url.scheme}://{host}{port}{url.path}" + ("?..." if url.query else "")


def _shown_spec(spec) -> str:
    """A model spec as the terminal shows it: each base URL as ``_shown_url`` shows it."""
    return re.sub(r"@(https?://[^,\s]+)", lambda found: "@" + _shown_url(found.group(1)), spec)


def _shown_mcp(server) -> str:
    """An --mcp server as a note names it: its URL as ``_shown_url`` shows it, or its program
    (the rest of a command line may hold a key)."""
    if re.match(r"(?i)https?://", server):
        return _shown_url(server)
    words = server.split()
    return os.path.basename(words[0]) if words else server


def _default_model(environ) -> str:
    if environ.get("LICH_MODEL"):
        return environ["LICH_MODEL"]
    if environ.get("OPENAI_API_KEY") or environ.get("OPENAI_BASE_URL"):
        return _DEFAULT_OPENAI_MODEL
    if environ.get("ANTHROPIC_API_KEY"):
        return _DEFAULT_ANTHROPIC_MODEL
    raise _UsageError(_NO_MODEL_HELP)


def _read_piped(on_wait=None):
    """Piped stdin as text (None when stdin is closed); bytes that are not UTF-8 are replaced,
    as in the shell tool's output. ``on_wait()`` is called when nothing has come for
    ``_STDIN_QUIET_SECONDS`` (a stdin that never ends would be a silent wait)."""
    if sys.stdin is None:  # closed: nothing was piped
        return None
    if on_wait is not None:
        import select

        try:
            quiet = not select.select([sys.stdin], [], [], _STDIN_QUIET_SECONDS)[0]
        except (OSError, ValueError):  # no fd to wait on: read as ever
            quiet = False
        if quiet:
            on_wait()
    raw = getattr(sys.stdin, "buffer", None)
    try:
        return raw.read().decode("utf-8", "replace") if raw is not None else sys.stdin.read()
    except OSError as e:
        if e.errno == errno.EBADF:  # open for writing only: nohup's in place of a terminal
            return None
        raise


def _argument_text(argument) -> str:
    """Text given as an argument, read as UTF-8 as stdin is: where Python decoded the
    command line in an ASCII locale (LC_ALL=C with UTF-8 mode off), each byte that is not
    ASCII came as a lone surrogate, and the model got U+FFFD for it."""
    try:
        return os.fsencode(argument).decode("utf-8") if not argument.isascii() else argument
    except UnicodeError:  # bytes that are not UTF-8: as Python read them
        return argument


def _prompt_with_stdin(prompt, piped) -> str:
    """The prompt, with piped text before it as context in a fenced block."""
    if piped is None or not piped.strip():
        if prompt is None or not prompt.strip():
            raise _UsageError("no prompt: pass PROMPT or pipe text on stdin")
        return prompt
    if prompt is None:
        return piped
    longest = max(map(len, re.findall("`+", piped)), default=0)  # one pass: stdin can be huge
    fence = "`" * max(3, longest + 1)
    return f"{fence}\n{piped.rstrip(chr(10))}\n{fence}\n\n{prompt}"


def _project_instructions(root, term=None):
    """(file name, text) of AGENTS.md in ``root``, else CLAUDE.md, else None. Only a regular
    file inside the root counts: a link to ~/.aws/credentials is not sent to a model. One
    that is there but is passed over or cannot be read is said on ``term``, when given."""
    root = os.path.realpath(root)
    for name in ("AGENTS.md", "CLAUDE.md"):
        try:  # a chain of links too long for realpath's recursion too
            path = os.path.realpath(os.path.join(root, name))
        except RecursionError:
            continue
        if not path.startswith(root.rstrip("/") + "/"):  # only a link leads out
            if term is not None:
                term.error(f"warning: not following {name} of {root}: it links out of that folder")
            continue
        try:
            with os.fdopen(os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW), "rb") as f:
                if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):  # a FIFO would never end
                    if term is not None:
                        term.error(f"warning: not following {name} of {root}: it is no regular file")
                    continue
                text = f.read(_INSTRUCTIONS_MAX_BYTES).decode("utf-8", "replace").strip()
        except OSError as e:
            if term is not None and not isinstance(e, FileNotFoundError) and e.errno != errno.ELOOP:
                term.error(f"warning: cannot read {name} of {root}: {e.strerror or e}")
            continue
        if text:
            return name, text
    return None


def _output_schema(text):
    """The --schema value: JSON, or @FILE holding it; it must be an object."""
    if text.startswith("@"):
        try:  # a byte order mark that an editor put first is not JSON's
            with open(text[1:], encoding="utf-8-sig") as f:
                text = f.read()
        except OSError as e:
            raise _UsageError(f"--schema: cannot read {text[1:]}: {e.strerror or e}") from None
        except UnicodeDecodeError as e:
            raise _UsageError(f"--schema: {text[1:]} is not UTF-8 text ({e.reason} at offset "
                              f"{e.start})") from None
    try:
        schema = json.loads(text)
    except ValueError as e:
        raise _UsageError(f"--schema is not valid JSON: {e}") from None
    except RecursionError:
        raise _UsageError("--schema is nested too deeply") from None
    if not isinstance(schema, dict):
        raise _UsageError("--schema must be a JSON object")
    return schema


_OTEL_EXPORTER_HINTS = {"otlp": "pip install opentelemetry-exporter-otlp",
                        "otlp_proto_http": "pip install opentelemetry-exporter-otlp-proto-http",
                        "otlp_proto_grpc": "pip install opentelemetry-exporter-otlp-proto-grpc"}
# The exporter "otlp" is, by the OTLP protocol variables, as the SDK reads them
_OTLP_EXPORTERS = {"grpc": "otlp_proto_grpc", "http/protobuf": "otlp_proto_http"}
_OTEL_EXPORTER_NAMES = ("OTEL_TRACES_EXPORTER names otlp, console, none, or an exporter an "
                        "installed package adds")


def _otel_provider():
    """The tracer provider the OpenTelemetry SDK makes from the OTEL_* variables; the console
    exporter writes to stderr (stdout carries the answer)."""
    try:
        from importlib.metadata import entry_points

        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import (
            BatchSpanProcessor,
            ConsoleSpanExporter,
        )
    except ImportError:
        raise _UsageError("--otel needs the OpenTelemetry SDK: pip install opentelemetry-api "
                          "opentelemetry-sdk (and an exporter, e.g. "
                          "opentelemetry-exporter-otlp)") from None
    provider = TracerProvider(resource=Resource.create())
    # As the SDK's own configuration reads it: otlp unless told otherwise, "none" for nothing.
    names = [n.strip() for n in (os.environ.get("OTEL_TRACES_EXPORTER") or "otlp").split(",")
             if n.strip() and n.strip().lower() != "none"]
    protocol = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "").strip()
    for name in names:
        if name == "otlp" and protocol:
            if protocol not in _OTLP_EXPORTERS:
                raise _UsageError(f"--otel: the OTLP protocol {protocol!r} is none the "
                                  f"OpenTelemetry SDK exports with ({', '.join(_OTLP_EXPORTERS)})")
            name = _OTLP_EXPORTERS[protocol]
        if name == "console":
            exporter = ConsoleSpanExporter(out=sys.stderr)
        else:
            try:
                found = list(entry_points(group="opentelemetry_traces_exporter", name=name))
            except TypeError:  # Python 3.9: a dict of every group
                found = [e for e in entry_points().get("opentelemetry_traces_exporter", ())
                         if e.name == name]
            if not found:
                raise _UsageError(f"--otel: no OpenTelemetry exporter named {name!r} is "
                                  f"installed ({_OTEL_EXPORTER_HINTS.get(name, _OTEL_EXPORTER_NAMES)})")
            exporter = next(iter(found)).load()()
        provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


# --- the terminal ---

# Control characters but newline and tab, the bidirectional controls (which can show a
# command reversed in a terminal that orders bidirectional text), and the invisible zero
# width space, word joiner and BOM (which make one name look like another). The joiners
# of emoji and of Persian words stay.
_CONTROL = ("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200b\u200e\u200f\u202a-\u202e\u2060"
            "\u2066-\u2069\ufeff]")


def _visible(text) -> str:
    """``text`` with every control character but newline and tab spelled out (``\\x1b``,
    ``\\r``): what the model wrote can neither move the cursor nor recolour the terminal."""
    return re.sub(_CONTROL, lambda m: repr(m.group())[1:-1], text)


def _column_widths(text):
    """The columns a terminal gives each character of ``text``: two for the wide ones of
    CJK and emoji, none for a combining mark."""
    import unicodedata

    return [0 if unicodedata.combining(c) else 2 if unicodedata.east_asian_width(c) in "WF" else 1
            for c in text]


def _columns_of(text) -> int:
    """How many columns ``text`` takes on a terminal."""
    return len(text) if text.isascii() else sum(_column_widths(text))


def _fitting(text, columns) -> int:
    """How many characters of ``text`` fit in ``columns``."""
    if text.isascii():
        return max(0, min(len(text), columns))
    used = 0
    for i, width in enumerate(_column_widths(text)):
        used += width
        if used > columns:
            return i
    return len(text)


def _stderr_size():
    """The size of stderr's terminal, or None when it has none."""
    try:
        return os.get_terminal_size(sys.stderr.fileno())
    except (OSError, ValueError, AttributeError):
        return None


def _one_line(text) -> str:
    """``_visible(text)`` with newlines and tabs spelled out too: a cell of a table row."""
    return _visible(text).replace("\n", "\\n").replace("\t", "\\t")


def _count_text(n) -> str:
    """12345 as "12.3k", 1234567 as "1.2M"."""
    if n < 1000:
        return str(n)
    thousands = f"{n / 1000:.1f}"
    if float(thousands) < 1000:  # 999,999 rounds to "1000.0": a million
        return f"{thousands}k".replace(".0k", "k")
    return f"{n / 1_000_000:.1f}M".replace(".0M", "M")


def _usage_line(usage) -> str:
    """``tokens: 12.3k in (9.8k cached), 1.2k out``."""
    cached = usage.get("cache_read_tokens") or 0
    cached_text = f" ({_count_text(cached)} cached)" if cached else ""
    return (f"tokens: {_count_text(usage.get('input_tokens', 0))} in{cached_text}, "
            f"{_count_text(usage.get('output_tokens', 0))} out")


def _json_text(value) -> str:
    """``value`` as JSON that is valid UTF-8 and that every reader takes: a lone surrogate
    (from a file name that is not UTF-8, or half an emoji) is written as U+FFFD. Its own
    ``\\u`` escape is JSON too, but jq 1.6 and others refuse the whole line."""
    text = json.dumps(value, ensure_ascii=False, default=repr)
    try:
        text.encode()
    except UnicodeEncodeError:
        text = re.sub("[\ud800-\udfff]", "\ufffd", text)
    return text


def _can_show(stream, text) -> bool:
    """Whether ``stream``'s encoding holds ``text`` (an ASCII terminal holds no "›")."""
    try:
        text.encode(getattr(stream, "encoding", None) or "utf-8")
    except (UnicodeEncodeError, LookupError):
        return False
    return True


def _is_utf8(encoding) -> bool:
    try:
        return codecs.lookup(encoding).name in ("utf-8", "utf-8-sig")
    except LookupError:
        return False


class _Terminal:
    """Everything the CLI shows: the answer on stdout; progress, notes and errors on stderr.

    On a stderr terminal (not TERM=dumb) it draws a spinner and redraws lines in place;
    colour unless NO_COLOR. Text that came from the model is shown with its control
    characters spelled out. A closed stdout makes lich leave quietly.
    """

    def __init__(self, *, quiet=False, json_lines=False, environ=None):
        environ = os.environ if environ is None else environ
        self.quiet = quiet
        self.json_lines = json_lines
        self.stdout_tty = _isatty(sys.stdout)
        self._stderr_tty = _isatty(sys.stderr)
        self._stderr_fd = _fd_of(sys.stderr) if self._stderr_tty else None
        self.fancy = self._stderr_tty and environ.get("TERM") != "dumb"
        self.color = self.fancy and not environ.get("NO_COLOR")
        self._columns = environ.get("COLUMNS", "")  # a width given, over the terminal's
        self._open_line = False   # a tool line written, its mark not yet
        self._answer_open = False  # streamed text not yet ended by a newline
        self._question_open = False  # a question asked, not ended by the Enter of its answer
        self._status_open = False  # a status line drawn in place, not ended by a newline
        self._answer_to = None     # where streamed text goes
        self._spinner = None       # (stop Event, thread)
        self._stdout_encoder = None  # stdout's encoding, made once (see _write)
        self._stderr_marks = None  # whether stderr can show lich's marks, known on first use
        self._lock = threading.RLock()

    # -- stdout: the answer

    def delta(self, text) -> bool:
        """Streamed answer text, to stdout on a terminal; whether it was shown. Else it is
        not shown as it comes: the answer goes to stdout whole, and what the model said
        before its tool calls to stderr once the model has answered (streamed to stderr too,
        a piped answer would be on the screen twice)."""
        if not text or not self.stdout_tty:
            return False
        self.stop_spinner()
        with self._lock:
            out = sys.stdout
            self._end_question()
            if self._open_line:
                self._stderr("\n")
                self._open_line = False
            self._write(out, _visible(text) if _isatty(out) else text)
            self._answer_open = not text.endswith("\n")
            self._answer_to = out
            return True

    def end_answer(self):
        with self._lock:
            if self._answer_open:
                self._write(self._answer_to, "\n")
                self._answer_open = False

    def answer(self, text):
        """A whole answer on stdout."""
        if text:
            with self._lock:
                self._end_question()
            self.end_answer()
            shown = _visible(text) if self.stdout_tty else text
            self._write(sys.stdout, shown if shown.endswith("\n") else shown + "\n")

    def json_line(self, value):
        with self._lock:
            self._end_question()
            if self.stdout_tty and self._status_open:  # a batch's result, on the status's screen
                self._stderr("\r\033[K")  # the next status is drawn under it
                self._status_open = False
            self._write(sys.stdout, self._stdout_json(value) + "\n")

    def json_answer(self, value):
        """A structured answer on stdout: one line of JSON."""
        self.answer(self._stdout_json(value))

    def _stdout_json(self, value):
        """``value`` as JSON that stdout's encoding can carry: where it is not UTF-8 (an
        ASCII locale, PYTHONIOENCODING), what is not ASCII is written as JSON's \\u escapes
        (Python's own, \\xe9, would make the line no JSON)."""
        text = _json_text(value)
        encoding = getattr(sys.stdout, "encoding", None) or "utf-8"
        if text.isascii() or _is_utf8(encoding):
            return text
        return re.sub(r"[^\x00-\x7f]+", lambda m: json.dumps(m.group())[1:-1], text)

    # -- stderr: everything else

    def note(self, text):
        if not self.quiet:
            self.line(text)

    def line(self, text, *, dim=False):
        self.stop_spinner()
        text = _visible(text)  # a model's or a server's words cannot move the cursor
        with self._lock:
            self._end_question()
            self._end_status_line()
            self.end_answer()
            self._stderr(self._paint(text, "2") if dim else text)
            self._stderr("\n")

    def error(self, text):
        self.line(f"lich: {text}")

    def tool_line(self, text, room=0):
        """Start a tool's line, leaving ``room`` for its mark, which ends it."""
        if self.quiet or self.json_lines:
            return
        self.stop_spinner()
        with self._lock:
            self._end_question()
            self.end_answer()
            self._stderr(self._paint(self._fit(_visible(text), room), "2"))
            self._open_line = True

    def tool_mark(self, text, ok, preview=()):
        if self.quiet or self.json_lines:
            return
        self.stop_spinner()
        with self._lock:
            mark = self._paint("✓", "32") if ok else self._paint("✗", "31")
            self._stderr((" " if self._open_line else "") + mark + (" " + _visible(text) if text
                                                                    else "") + "\n")
            self._open_line = False
            for line in preview:
                self._stderr(self._paint(self._fit("    " + _visible(line)), "2") + "\n")

    def rows(self) -> int:
        """How many lines stderr's terminal shows (24 when it cannot say)."""
        size = _stderr_size()
        return size.lines if size is not None and size.lines else 24

    def rows_of(self, lines) -> int:
        """How many rows of the terminal ``lines`` take, a long one wrapped."""
        width = max(1, self._width())
        return sum(max(1, -(-_columns_of(_visible(line)) // width)) for line in lines)

    def _width(self) -> int:
        """The width of stderr's terminal, where these lines go (stdout may be a pipe)."""
        try:
            width = max(0, int(self._columns))
        except ValueError:
            width = 0
        if not width:  # Python 3.9 and 3.10 give 0 columns for a pseudo-terminal given no size
            size = _stderr_size()
            width = size.columns if size is not None and size.columns else 100
        return width

    def ask(self, question):
        """Show ``question`` (lines; the last one is where the answer is typed)."""
        self.stop_spinner()
        with self._lock:
            if self._open_line:
                self._stderr("\n")
                self._open_line = False
            self.end_answer()
            self._stderr(_visible(question))
            self._question_open = True

    def question_answered(self, typed):
        """What was read at a question: a line ended by Enter closes its line; Ctrl-D or
        Ctrl-C leaves it open, and what is shown next begins a line of its own."""
        with self._lock:
            if typed is not None and typed.endswith("\n"):
                self._question_open = False

    def _end_question(self):
        if self._question_open:
            self._stderr("\n")
            self._question_open = False

    def status(self, text):
        """A line redrawn in place on a terminal (a batch's progress); else printed."""
        if self.quiet:
            return
        with self._lock:
            if self.fancy:
                self._stderr("\r\033[K" + self._fit(text))
                self._status_open = True
            else:
                self._stderr(text + "\n")

    def typed(self, text):
        """What the chat's input shows on stderr beside readline: a prompt, a line's end."""
        self._stderr(text)

    def end_status(self):
        with self._lock:
            self._end_status_line()

    def _end_status_line(self):
        """End the status line drawn in place, so that a note comes on a line of its own (the
        next status is drawn under it)."""
        if self._status_open:
            self._stderr("\n")
            self._status_open = False

    def start_spinner(self, label="thinking", started=None):
        if not self.fancy or self.quiet or self.json_lines:
            return
        self.stop_spinner()
        stop = threading.Event()
        began = time.monotonic() if started is None else started

        def spin():
            frame = 0
            while not stop.wait(_SPINNER_INTERVAL):
                elapsed = time.monotonic() - began
                extra = f" {elapsed:.0f} s" if elapsed >= _TOOL_ELAPSED_SECONDS else ""
                with self._lock:
                    if _in_the_background(self._stderr_fd):  # it would write over the shell's line
                        continue
                    if not self._open_line and not self._answer_open:  # one line, redrawn:
                        shown = self._fit(f"{label}{extra}", 3)  # never wrapped to a second
                        self._stderr(f"\r{_SPINNER_FRAMES[frame % len(_SPINNER_FRAMES)]} "
                                     f"{shown}\033[K")
                        frame += 1
            with self._lock:
                if frame and not _in_the_background(self._stderr_fd):
                    self._stderr("\r\033[K")

        thread = threading.Thread(target=spin, daemon=True)
        self._spinner = (stop, thread)
        thread.start()

    def stop_spinner(self):
        spinner, self._spinner = self._spinner, None
        if spinner is not None:
            spinner[0].set()
            # not yet started (stopped from another thread at once): it ends as it starts
            if spinner[1] is not threading.current_thread() and spinner[1].is_alive():
                spinner[1].join()

    def _fit(self, text, room=0):
        """``text`` cut to the terminal's width (or, not on a terminal, to a log's line) less
        ``room`` for what follows it on the line (half the width at most), at a word where it
        can be."""
        width = self._width() if self.fancy else _PLAIN_LINE_CHARS
        width = max(width - room, width // 2)
        # a terminal's line counts columns (two for a wide character: CJK, emoji), a log's characters
        if (_columns_of if self.fancy else len)(text) <= width:
            return text
        end = _fitting(text, width - 1) if self.fancy else max(0, width - 1)
        cut = text.rfind(" ", 0, end)
        return text[:cut if cut > end // 2 else end] + "…"

    def _paint(self, text, code):
        return f"\033[{code}m{text}\033[0m" if self.color else text

    def _stderr(self, text):
        if sys.stderr is not None:  # None: closed as lich started (2>&-), nothing is shown
            if self._stderr_marks is None:
                self._stderr_marks = _can_show(sys.stderr, "".join(map(chr, _ASCII_MARKS)))
            self._write(sys.stderr, text if self._stderr_marks else text.translate(_ASCII_MARKS))

    def _write(self, stream, text):
        if stream is None:  # stdout closed as lich started (>&-): as if its reader went away
            raise _StdoutClosed(_EXIT_OK)
        try:
            # The answer, on the process's own stdout: every byte written, or an error. (A
            # stdout put in its place, a notebook's, is written to as it asks.)
            fd = _fd_of(stream) if stream is sys.stdout and stream is sys.__stdout__ else None
            if fd is not None:
                stream.flush()
                encoding = getattr(stream, "encoding", None) or "utf-8"
                if self._stdout_encoder is None:  # one for all writes: a BOM once, if any
                    self._stdout_encoder = codecs.getincrementalencoder(encoding)(
                        getattr(stream, "errors", None) or "strict")
                try:
                    data = self._stdout_encoder.encode(text)
                except UnicodeEncodeError:  # a lone surrogate, or a terminal that is not UTF-8
                    data = text.encode(encoding, "backslashreplace")
                _write_all(fd, data)
                return
            try:
                stream.write(text)
            except UnicodeEncodeError:  # a lone surrogate, or a terminal that is not UTF-8
                encoding = getattr(stream, "encoding", None) or "utf-8"
                stream.write(text.encode(encoding, "backslashreplace").decode(encoding))
            stream.flush()
        except BrokenPipeError:
            if stream is sys.stdout:
                raise _StdoutClosed(_EXIT_OK) from None  # `lich ... | head`: the reader has what it wanted
        except ValueError as e:  # closed
            if isinstance(e, UnicodeError):  # no text of lich's may vanish so
                raise
        except OSError as e:
            # EIO on a terminal: it hung up (a closed window, a dropped ssh). Nothing can be
            # shown on it; SIGHUP stops the run, whose session keeps the turn as after Ctrl-C.
            # (On a file, EIO is a failing disk: the answer is lost, which must not pass.)
            if e.errno == errno.EIO and (self.stdout_tty if stream is sys.stdout
                                         else self._stderr_tty):
                return
            if stream is sys.stdout:  # not an error the run can go on past: all it says is lost
                raise _StdoutFailed(_EXIT_ERROR, f"cannot write the output: "
                                                 f"{e.strerror or e}") from None
            raise


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _fd_of(stream):
    """The file descriptor under ``stream``, or None (a StringIO, a closed file)."""
    try:
        return stream.fileno()
    except (AttributeError, OSError, ValueError):
        return None


def _in_the_background(fd) -> bool:
    """Whether ``fd`` is a terminal whose foreground job is another's than lich's (a shell's
    ``bg`` or ``&``): drawing there writes over the shell's line, and reading it or setting
    its modes stops lich (SIGTTIN, SIGTTOU)."""
    try:
        return os.tcgetpgrp(fd) != os.getpgrp()
    except (OSError, TypeError, ValueError):  # not a terminal, closed, or none
        return False


def _wait_for_the_foreground(fd):
    """Return once lich is the foreground job of the terminal ``fd``: tcdrain, which changes
    nothing, stops a job in the background (SIGTTOU), as the shell's job control means,
    until its ``fg``. At once when that cannot stop lich (an orphaned job, SIGTTOU
    ignored), or ``fd`` is no terminal."""
    import termios

    while True:
        try:
            termios.tcdrain(fd)
            return
        except termios.error as e:  # a signal's handler ran, still in the background: again
            if e.args[0] != errno.EINTR:
                return
        except (OSError, TypeError, ValueError):
            return


def _terminal_modes(fd):
    """The modes of the terminal ``fd`` (termios' list), or None (no terminal)."""
    import termios

    try:
        return termios.tcgetattr(fd)
    except (termios.error, OSError, TypeError, ValueError):
        return None


def _set_terminal_modes(fd, modes):
    """Give the terminal ``fd`` the modes ``modes``, now (nothing when that cannot be done)."""
    import termios

    try:
        termios.tcsetattr(fd, termios.TCSANOW, modes)
    except (termios.error, OSError, TypeError, ValueError):
        pass


def _write_all(fd, data):
    """Write all of ``data`` to ``fd`` or raise. CPython's buffered write keeps nothing of a
    short write's rest: on a disk that fills, sys.stdout drops it without an error."""
    import select

    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view):]
        except BlockingIOError:  # a pipe its reader made non-blocking, full for now
            select.select([], [fd], [])


# --- what runs show ---

_DECLINED = {  # stop reasons that say why an answer is missing or cut
    "refusal": "the model declined to answer (its stop reason is refusal)",
    "content_filter": "the provider's content filter stopped the answer",
}


def _call_arguments_of(call) -> dict:
    try:
        args = json.loads(call.get("arguments") or "{}")
    except (ValueError, RecursionError):
        return {}
    return args if isinstance(args, dict) else {}


def _tool_summary(call) -> str:
    """A few words saying what a tool call does: its first string argument, cut."""
    text = next((v for v in _call_arguments_of(call).values() if isinstance(v, str)), "")
    text = " ".join(text.split())
    if len(text) > _TOOL_SUMMARY_CHARS:
        text = text[:_TOOL_SUMMARY_CHARS - 1] + "…"
    return f"{call.get('name')} {text}".rstrip()


def _lines(text) -> list:
    """The lines of a tool's text: split at \\n, \\r\\n and a lone \\r (a progress bar's), not
    at the other breaks str.splitlines knows (U+2028, a form feed), which a file holds in a line."""
    if not text:
        return []
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    return lines[:-1] if lines[-1] == "" else lines


_SKIPPED = {"turn_budget_exhausted": "not run: the turn budget ran out",
            "aborted": "not run: interrupted"}


def _how_many(n, one, many) -> str:
    return f"{'no' if n == 0 else n} {one if n == 1 else many}"


def _first_lines(lines, n) -> list:
    """The first ``n`` of ``lines``, and a line saying how many more there were."""
    if len(lines) <= n:
        return lines
    return lines[:n] + [f"… {_how_many(len(lines) - n, 'more line', 'more lines')}"]


def _tool_outcome(call, result, elapsed, cancelled, lich_tool):
    """(words after the tool's mark, preview lines) for a finished tool call; ``cancelled``:
    it never ran; ``lich_tool``: it went to lich's own tool of its name, whose arguments and
    output say lines and matches (an MCP server's edit_file has neither old_text nor new_text)."""
    name, args = call.get("name") if lich_tool else None, _call_arguments_of(call)
    output = result.output or ""
    if not result.ok:
        reason = result.error.splitlines()[0] if result.error else "failed"
        reason = _SKIPPED.get(reason, reason) if cancelled else reason
        words, preview = reason, _lines(output)
    elif name == "read_file":
        count = sum(1 for line in _lines(output) if line[:6].strip().isdigit())
        words, preview = _how_many(count, "line", "lines"), []
    elif name == "list_files":
        files = [line for line in _lines(output) if not line.startswith(("[... ", "... ", "no files"))]
        words, preview = _how_many(len(files), "file", "files"), []
    elif name == "search":
        count = sum(1 for line in _lines(output) if re.match(r"[^\n]*:\d+: ", line))
        words, preview = _how_many(count, "match", "matches"), []
        if "[... the search stopped at its time limit" in output:
            words += "; stopped at its time limit"
    elif name == "edit_file":
        old, new = args.get("old_text") or "", args.get("new_text") or ""
        words, preview = f"+{len(_lines(new))} -{len(_lines(old))}", []
    elif name == "write_file":
        words, preview = f"+{_how_many(len(_lines(args.get('content') or '')), 'line', 'lines')}", []
    else:
        words, preview = "", _lines(output)
    if name == "bash" and preview and re.fullmatch(r"\[exit code -?\d+\]", preview[-1]):
        preview = preview[:-1]
    preview = _first_lines(preview, _PREVIEW_LINES)
    if " omitted ...]" in output:
        words += " (output cut)"
    if elapsed >= _TOOL_ELAPSED_SECONDS:
        words += f" ({elapsed:.1f} s)"
    return words.strip(), preview


def _plain(value):
    """A JSON-ready copy of an event value: dataclasses as dicts, exceptions described."""
    if isinstance(value, BaseException):
        described = {"type": type(value).__name__, "message": str(value)}
        for name in ("kind", "status", "provider", "retryable", "retry_after", "after_output"):
            if hasattr(value, name):
                described[name] = getattr(value, name)
        return described
    if hasattr(value, "__dataclass_fields__"):
        return asdict(value)
    return value


class _Progress:
    """One run as the terminal shows it, and the history it has built so far."""

    def __init__(self, cli, seeded):
        self.cli = cli
        self.term = cli.term
        self.history = list(seeded)  # what the session holds of this run
        self.usage = {"input_tokens": 0, "output_tokens": 0}
        self.compressing = False  # the chat's streamed words are a summary, not the answer
        self.thread = None  # the thread the run works in
        self.received = []  # text streamed during the current chat call
        self.shown = False  # and whether any of it was shown
        self._tool_started = None

    def __call__(self, event):
        term, kind = self.term, event["type"]
        if kind == "llm_end":
            for key, value in event["result"].usage.items():
                self.usage[key] = self.usage.get(key, 0) + value
            self.history.append(event["result"].message)
            self.received = []  # that text is in the history now: a later stop does not repeat it
        elif kind == "tool_call_end":
            self.history.append(tool_message_from_result(event["call"], event["result"]))
        elif kind == "output_invalid":
            self.history.append(event["message"])
        if term.json_lines:
            term.json_line({k: _plain(v) for k, v in event.items()})
        elif kind == "llm_start":
            self.received, self.shown = [], False
            term.start_spinner("thinking")
        elif kind == "llm_end":
            term.stop_spinner()
            message = event["result"].message
            if message.get("tool_calls"):
                term.end_answer()
                if message.get("content") and not self.shown and not term.quiet:
                    term.line(message["content"], dim=True)  # said between tools: not the answer
        elif kind == "tool_call_start":
            self._tool_started = time.monotonic()
            term.start_spinner(_visible(_tool_summary(event["call"])), self._tool_started)
        elif kind == "tool_call_end":
            started = self._tool_started if not event["cancelled"] else None
            if started is not None and self.cli.approvals is not None:  # not the time asking took
                started = max(started, self.cli.approvals.answered_at)
            elapsed = time.monotonic() - started if started is not None else 0.0
            call = event["call"]
            words, preview = _tool_outcome(call, event["result"], elapsed, event["cancelled"],
                                           self.cli.is_lich_tool(call.get("name")))
            term.tool_line("→ " + _tool_summary(call), room=len(_visible(words)) + 3)
            term.tool_mark(words, event["result"].ok, preview)
        elif kind == "compress_start":
            self.compressing = True
            term.start_spinner("compressing the history")  # the summary's call: seconds, unshown
        elif kind == "compress_end":
            self.compressing = False
            term.stop_spinner()
            if event["summary_chars"]:  # else stopped, or failed and logged: nothing was compressed
                term.note(f"(history compressed: {event['summary_chars']} characters of summary)")
        elif kind == "output_invalid":
            term.note(f"(the answer did not fit the schema: {_visible(event['error'])}; asking again)")
        elif kind == "error":
            term.stop_spinner()

    def delta(self, text) -> bool:
        self.received.append(text)
        if self.term.delta(text):
            self.shown = True
        return self.shown


# --- approvals ---


def _diff_lines(before, after, path):
    """The unified diff of a file's text ``before`` (None: no such file) and ``after``."""
    import difflib

    def split(text):  # at "\n" only, as the file's lines are: a lone "\r" is shown, escaped
        return text.split("\n")[:-1] if text.endswith("\n") else text.split("\n") if text else []

    old_name = "/dev/null" if before is None else f"a/{path}"
    before, after = (before or "").replace("\r\n", "\n"), after.replace("\r\n", "\n")  # a file's
    lines = list(difflib.unified_diff(split(before), split(after), old_name,  # CRLFs: no change
                                      f"b/{path}", lineterm="", n=2))
    if len(lines) > _DIFF_SHOWN_LINES:
        half = _DIFF_SHOWN_LINES // 2
        cut = _how_many(len(lines) - 2 * half, "line", "lines")
        lines = lines[:half] + [f"[... {cut} not shown ...]"] + lines[-half:]
    half = _DIFF_LINE_CHARS // 2
    return [line if len(line) <= _DIFF_LINE_CHARS + 50 else  # a cut saves something
            f"{line[:half]} [... {_how_many(len(line) - 2 * half, 'character', 'characters')} "
            f"not shown ...] {line[-half:]}" for line in lines]


class _Approvals:
    """The ``approve`` of a chat on a terminal: the whole call shown, then y / n / a / t."""

    def __init__(self, cli):
        self.cli = cli
        self.grants = []  # (tool names, exact key or None, what it covers)
        self.answered_at = 0.0  # when the last question was answered: a tool's time begins then

    def __call__(self, call) -> bool:
        # A diff, a command and a grant of a file only for lich's own tools: another tool of
        # the name (an MCP server's edit_file) has other arguments, which the user must see.
        name, args = call.get("name"), _call_arguments_of(call)
        kind = name if self.cli.is_lich_tool(name) else None
        key = self._key(kind, args, call)
        tools = ("write_file", "edit_file") if kind in ("write_file", "edit_file") else (name,)
        if any(name in granted and exact in (None, key) for granted, exact, _ in self.grants):
            return True
        what = "file" if kind in ("write_file", "edit_file") else "command" if kind == "bash" \
            else "call"
        body = self._body(kind, args, call)
        with self.cli.answer_lines() as answer_lines:  # before the question shows: a key then
            if self.cli.drop_typed_ahead():  # would be a line of its own
                self.cli.term.note("(what was typed before this question is dropped: it needs a "
                                   "fresh answer)")
            lines = [f"→ {_tool_summary(call)}", *("  " + line for line in "\n".join(body).split("\n"))]
            term = self.cli.term
            rows = term.rows_of(lines)
            if rows + 1 > term.rows():  # its first lines are off the screen
                lines.append(f"  ({rows} lines above: scroll up to read the whole {what} from its "
                             f"start)")
            term.ask("\n".join([*lines, f"  allow? [y]es / [N]o / [a]lways this {what} / [t] always {name}: "]))
            try:
                answer = self.cli.read_answer(answer_lines)
            finally:
                self.answered_at = time.monotonic()
        self.cli.term.question_answered(answer)
        if answer is None:
            raise AbortError("interrupted before the user answered")
        answer = answer.strip().lower()
        if answer in ("a", "always"):
            self.grants.append((tools, key, f"{' and '.join(tools)}: {_visible(key)}"))
        elif answer in ("t", "tool"):
            self.grants.append(((name,), None, f"{name}: every call"))
        approved = answer in ("y", "yes", "a", "always", "t", "tool")
        if approved:  # the call runs now: its spinner again (the question stopped it), timed from here
            term.start_spinner(_visible(_tool_summary(call)), self.answered_at)
        return approved

    def _key(self, kind, args, call):
        """What an answer "always" covers; ``kind``: the name of lich's tool, else None."""
        if kind == "bash":
            return str(args.get("command", ""))
        if kind in ("write_file", "edit_file"):
            return str(args.get("path", ""))
        return str(call.get("arguments") or "")

    def _body(self, kind, args, call):
        if kind == "bash":  # whole, but for runs of blank lines, which push its start away
            command = re.sub(r"\n(?:[ \t\r]*\n){3,}", lambda run: (
                f"\n\u22ee {run.group().count(chr(10)) - 1} blank lines\n"), str(args.get("command", "")))
            return ["$ " + _visible(command).replace("\n", "\n    ")]
        path = str(args.get("path", ""))
        if kind == "edit_file":
            before = self._text_of(path) or ""  # its \r\n read as \n, as edit_file matches old_text
            old, new = (str(args.get(key, "")).replace("\r\n", "\n") for key in ("old_text", "new_text"))
            if old and before.count(old) == 1:  # the file's own lines around the change
                old, new = before, before.replace(old, new)
            return self._linked(path) + [_visible(line) for line in _diff_lines(old, new, path)]
        if kind == "write_file":
            return self._linked(path) + [_visible(line) for line in _diff_lines(
                self._text_of(path), str(args.get("content", "")), path)]
        return [_visible(str(call.get("arguments") or "{}"))]

    def _linked(self, path):
        """A line that names the file a write goes to when ``path`` leads there through a
        link (docs/notes.md to .git/config, say): the user is asked about what is written."""
        given = os.path.join(self.cli.root, path)
        try:  # "docs/../config" with docs a link: the write goes where the link leads first
            real = os.path.realpath(given)
        except RecursionError:  # a chain of links: the write fails too
            return []
        given = os.path.normpath(given)
        if real == given:
            return []
        return [f"(a link: this writes {_visible(os.path.relpath(real, self.cli.root))})"]

    def _text_of(self, path):
        """The file as the user sees it, for a diff (None when there is none, "" when it
        cannot be read)."""
        try:
            with open(os.path.join(self.cli.root, path), "rb") as f:
                return f.read(_DIFF_MAX_BYTES).decode("utf-8", "replace").replace("\r\n", "\n")
        except FileNotFoundError:
            return None
        except OSError:
            return ""

    def describe(self):
        return [f"{i}. {label}" for i, (_, _, label) in enumerate(self.grants, 1)]


class _ApprovedTools:
    """A ToolRunner whose every call is approved first (MCP tools on a terminal)."""

    def __init__(self, runner, approve):
        self.runner = runner
        self.approve = approve

    def specs(self):
        return self.runner.specs()

    def run(self, call, signal=None):
        try:
            if not self.approve(call):
                return ToolResult(ok=False, error="the user declined this call")
        except AbortError as e:  # the question was interrupted: the call is not made
            return ToolResult(ok=False, error=str(e))
        return self.runner.run(call, signal)


# --- sessions on the command line ---


class _LazySession:
    """A session of the command line: a run's records wait here until ``answered()`` says
    its first answer came, so that a run that got none (it failed at once, or never reached
    a model) leaves nothing behind, in the file as in the chat; the file is created then."""

    def __init__(self, session_dir, label, term):
        self.session_dir = session_dir
        self.label = label
        self.term = term
        self.handle = None
        self.waiting = []  # this run's records, until its first answer; None: recording is off

    @property
    def path(self):
        return self.handle.path if self.handle is not None else None

    @property
    def id(self):
        return self.handle.id if self.handle is not None else "(a session not yet written)"

    def append_message(self, message):
        self._append("append_message", message)  # a resumed history's answers are not this run's

    def answered(self):
        """The run has an answer (or a note that closes it): its records are written."""
        if self.waiting:
            self._write_waiting()

    def append_meta(self, meta):
        if meta.get("event") == "run_start" and self.waiting is not None and all(
                method == "append_message" for method, _ in self.waiting):
            # A new run: it waits for its answer. The messages a run that got none left
            # waiting come after this start, as in any session: -c reads a file up to its
            # first run_start, which names its folder.
            self.waiting.insert(0, ("append_meta", meta))
            return
        self._append("append_meta", meta)

    def forget_unwritten(self):
        """The run failed before any answer: the chat drops its request, so the file does
        too. The messages seeded before the request (a resumed history, the system prompt)
        were recorded for good: they wait on for the next run's answer."""
        if self.waiting:
            messages = [i for i, (method, _) in enumerate(self.waiting) if method == "append_message"]
            self.waiting = [record for record in self.waiting[:messages[-1] if messages else 0]
                            if record[0] == "append_message"]

    def _append(self, method, record):
        if self.waiting:
            self.waiting.append((method, record))
        elif self.waiting is not None and self.handle is not None:
            getattr(self.handle, method)(record)

    def _write_waiting(self):
        if self.handle is None:
            try:
                self.handle = open_session(self.session_dir, self.label)
            except OSError as e:
                if isinstance(e, NotADirectoryError) or (isinstance(e, FileExistsError)
                                                         and not os.path.isdir(self.session_dir)):
                    reason = "a file stands where a folder must be"
                else:
                    reason = e.strerror or e
                self.term.error(f"warning: session recording is off: cannot create a session "
                                f"file in {self.session_dir}: {reason}")
                self.waiting = None
                return
            kept = _label_of(self.handle.path)
            if self.label and kept != self.label:  # --resume finds it by what it kept
                named = f"is labelled {kept}, the name --resume takes" if kept else "has no label"
                self.term.note(f"the session {named} (a label keeps ASCII letters, digits, "
                               f"_, . and -, 64 at most)")
        waiting, self.waiting = self.waiting, []
        for method, record in waiting:
            try:
                getattr(self.handle, method)(record)
            except (OSError, ValueError) as e:  # a full disk: nothing after the gap is written
                kept = "" if isinstance(e, FileNotFoundError) else "; it keeps the chat before this turn"
                self.term.error(f"warning: session recording is off: cannot write to "
                                f"{self.handle.path}: {getattr(e, 'strerror', None) or e}{kept}")
                self.waiting = None
                return

    def close(self):
        if self.handle is not None:
            self.handle.close()


def _session_records(path):
    """The records of a session file; lines that are not records are skipped (one too long
    that does not start as a record is passed over in pieces). A byte that is not UTF-8 is
    U+FFFD, as a resume reads it."""
    with open(path, "rb") as lines:
        piece = functools.partial(lines.readline, _RECORD_PIECE_BYTES)
        for line in iter(piece, b""):
            if not line.endswith(b"\n") and len(line) == _RECORD_PIECE_BYTES:  # a long line
                pieces = [line] if line.lstrip(b"\xef\xbb\xbf \t\r").startswith(b"{") else None
                for more in iter(piece, b""):
                    if pieces is not None:
                        pieces.append(more)
                    if more.endswith(b"\n") or len(more) < _RECORD_PIECE_BYTES:
                        break
                if pieces is None:  # no record: NUL bytes a crash left, say
                    continue
                line = b"".join(pieces)
            try:
                record = json.loads(line.decode("utf-8-sig", "replace"))
            except (ValueError, RecursionError):
                continue
            if isinstance(record, dict):
                yield record


def _first_prompt(text) -> str:
    """A user message as a title: the prompt after a fenced block of piped text."""
    if text.startswith("```"):
        text = text.rsplit("```\n\n", 1)[-1]
    return " ".join(text.split())


def _session_summary(path) -> dict:
    """What --list-sessions says of one session file."""
    start, last, count, prompt = {}, None, 0, ""
    for record in _session_records(path):
        last = record
        meta = record.get("meta")
        if not start and isinstance(meta, dict) and meta.get("event") == "run_start":
            start = meta
        message = record.get("message")
        if record.get("kind") == "message" and isinstance(message, dict):
            count += 1
            if not prompt and message.get("role") == "user" and isinstance(message.get("content"), str):
                prompt = _first_prompt(message["content"])
    when = (last or {}).get("ts")
    if not isinstance(when, str):  # no record says: the file's time
        mtime = os.path.getmtime(path)
        when = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(mtime)) + f".{int(mtime % 1 * 1000):03d}Z"
    folder, model = start.get("cwd"), start.get("model")  # a file edited by hand may hold anything
    return {"id": os.path.splitext(os.path.basename(path))[0], "path": path, "when": when,
            "folder": folder if isinstance(folder, str) else None,
            "model": model if isinstance(model, str) else None, "messages": count,
            "prompt": prompt[:_PROMPT_SHOWN_CHARS]}


def _session_folder(path):
    """The ``cwd`` of a session's first run_start, as --list-sessions names it. The file is
    read up to that record only: a history seeded before the first run comes before it."""
    for record in _session_records(path):
        meta = record.get("meta")
        if isinstance(meta, dict) and meta.get("event") == "run_start":
            return meta.get("cwd")
    return None


def _label_of(path):
    """The label of a session file named ``<stamp>-<n>-<label>.jsonl``, or None."""
    found = re.fullmatch(r"\d{8}T\d{6}Z-\d+-(.+)\.jsonl", os.path.basename(path))
    return found.group(1) if found else None


def _copied_short(path):
    """(the messages it holds, history_size) when a session holds fewer messages before its
    second run than its first run_start says that run was given: lich stopped (kill -9,
    Ctrl-C twice, a full disk) while it copied a resumed history there, as the first answer
    came; else None. The file it was copied from holds it all."""
    given, messages = None, []
    for record in _session_records(path):
        meta = record.get("meta")
        if isinstance(meta, dict) and meta.get("event") == "run_start":
            if given is not None:
                break
            given = meta.get("history_size")
            if not isinstance(given, int) or isinstance(given, bool):
                return None
        elif record.get("kind") == "message":
            messages.append(record.get("message"))
        if given is not None and len(messages) >= given:  # whole: no need to read on
            return None
    return (messages, given) if given is not None else None


def _continues(path, messages) -> bool:
    """Whether the session ``path`` begins with ``messages`` (system prompts aside, which a
    copy may have changed): the conversation a cut copy was made of."""
    def said(history):
        return [m for m in history if isinstance(m, dict) and m.get("role") != "system"]

    copied = said(messages)
    return said(read_session_messages(path))[:len(copied)] == copied


def _latest_session_in(session_dir, folder, term):
    """The newest session of ``folder`` among the user's own; one that cannot be read is
    passed over with a warning (it may be the newest), and so is a copy cut short, for the
    session it was copied from."""
    cut = None  # (the path of a copy cut short, its messages)
    for path in list_sessions(session_dir):
        try:
            owner = getattr(os, "geteuid", None)  # not on Windows
            if (owner is None or os.stat(path).st_uid == owner()) and _session_folder(path) == folder:
                if cut is not None:
                    if _continues(path, cut[1]):
                        return path
                    continue
                short = _copied_short(path)
                if short is None:
                    return path
                term.error(f"warning: passed over {path}: lich stopped while it copied the "
                           f"conversation there ({len(short[0])} of {short[1]} messages)")
                cut = (path, short[0])
        except FileNotFoundError:  # removed meanwhile
            continue
        except OSError as e:
            term.error(f"warning: passed over {path}: cannot read it: {e.strerror or e}")
    if cut is not None:
        raise SessionNotFound(f"the conversation that {os.path.basename(cut[0])} was copied "
                              f"from is not among this folder's sessions: --resume one by "
                              f"its id (--list-sessions lists them)")
    return None


def _recap(history) -> list:
    """The last exchange of a history, a few lines of each side: the last prompt, and what
    the model said after it (an older answer would look like this prompt's)."""
    said = [(i, m) for i, m in enumerate(history) if m.get("role") in ("user", "assistant")
            and isinstance(m.get("content"), str) and m["content"].strip()]
    asked = next((i for i, m in reversed(said) if m["role"] == "user"), -1)
    answer = next((m for i, m in reversed(said) if m["role"] == "assistant" and i > asked), None)
    lines = []
    for shown, message in (("you", history[asked] if asked >= 0 else None), ("lich", answer)):
        if message is None:
            text = ["(no answer)"] if shown == "lich" and asked >= 0 else []
        else:
            text = [line if len(line) <= _RECAP_LINE_CHARS else line[:_RECAP_LINE_CHARS - 1] + "…"
                    for line in _first_lines(_lines(message["content"].strip()), _RECAP_LINES)]
        if text:
            lines += [f"{shown}: {text[0]}"] + [" " * (len(shown) + 2) + line for line in text[1:]]
    return lines


# --- runs, chat, batch, main ---


class _Interrupts:
    """Ctrl-C as lich reads it: the first stops what runs, a second within 2 s quits."""

    def __init__(self):
        self.last = None
        self.exit_code = _EXIT_INTERRUPTED  # 128 + the signal for SIGTERM and SIGHUP
        self.terminating = False  # SIGTERM or SIGHUP came: stop what runs, then leave
        # While the main thread waits on a run, a signal is noted, not raised: raised inside
        # a lock's wait, a second one at once can break the lock (a hang, or an error).
        self.noting = False
        self.noted = deque()

    def terminate(self, signum) -> bool:
        """SIGTERM or SIGHUP came: lich is to leave with 128 + its number. False when one
        came before (a closing terminal sends SIGHUP twice): that one's code stands."""
        if self.terminating:
            return False
        self.exit_code = 128 + signum
        self.terminating = True
        return True

    def arrived(self):
        """A signal came (its handler's work, in the main thread): KeyboardInterrupt, or
        noted while ``noting``."""
        if not self.noting:
            raise KeyboardInterrupt
        self.noted.append(True)

    def take(self) -> bool:
        """Whether a noted signal was left to handle (it is handled now)."""
        try:
            return self.noted.popleft()
        except IndexError:
            return False

    def forget(self):
        """A new turn began: a Ctrl-C now is a first one, however soon after the last."""
        self.last = None

    def pressed(self):
        now = time.monotonic()
        if self.last is not None and now - self.last < _QUIT_WINDOW_SECONDS:
            raise _Quit(self.exit_code)
        self.last = now


def _hold_interrupts(interrupts):
    """Make Ctrl-C do nothing in the main thread, and SIGTERM and SIGHUP only set lich's exit
    code (while lich closes what it started: raised anywhere there, they would leave a
    server running); returns the function that gives them back."""
    import signal as signals

    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    held = {}
    for name in ("SIGINT", "SIGTERM", "SIGHUP"):
        number = getattr(signals, name, None)
        if number is not None and signals.getsignal(number) is not signals.SIG_IGN:
            held[number] = signals.signal(number, (lambda signum, frame: None) if name == "SIGINT"
                                          else lambda signum, frame: interrupts.terminate(signum))

    def give_back():
        for number, previous in held.items():  # None: a handler Python did not install
            signals.signal(number, previous if previous is not None else signals.SIG_DFL)

    return give_back


class _LineMode:
    """``with _LineMode(fd) as lines``: the terminal ``fd`` taking lines, echoed, whenever
    ``lines.take_lines()`` finds lich its foreground job, until the block ends; then the
    modes it found are given back (unless lich is in the background by then: the
    terminal is the shell's)."""

    def __init__(self, fd):
        self.fd = fd
        self.modes = None  # as first found in the foreground

    def __enter__(self):
        self.take_lines()
        return self

    def take_lines(self) -> bool:
        """Set the modes that take lines, echoed, when lich is the foreground job (after
        ``fg`` the shell may have left its own); whether it is (else nothing is touched)."""
        import termios

        if _in_the_background(self.fd):
            return False
        modes = _terminal_modes(self.fd)
        if modes is None:  # no terminal
            return True
        if self.modes is None:
            self.modes = list(modes)
        lines = termios.ICANON | termios.ECHO
        if modes[3] & lines != lines:
            modes[3] |= lines
            _set_terminal_modes(self.fd, modes)
        return True

    def __exit__(self, *exc_info):
        if self.modes is not None and not _in_the_background(self.fd):
            _set_terminal_modes(self.fd, self.modes)


class _BackAtThePrompt:
    """``with _BackAtThePrompt(fd, redraw)`` around readline's ``input()`` on the terminal
    ``fd``: Ctrl-Z stops lich as ever (its default), and when ``fg`` brings it back readline
    gets back the modes it had set (the shell leaves its own: keys went to readline only at
    Enter, echoed twice) and ``redraw()`` shows the line again. CPython's readline does
    neither (nor does Python's own prompt). Nothing when readline is not in use, or
    SIGCONT has a handler of another's."""

    def __init__(self, fd, redraw):
        self.fd = fd
        self.redraw = redraw
        self.modes = None  # readline's, once it has set them
        self.previous = None

    def __enter__(self):
        import signal as signals

        go_on = getattr(signals, "SIGCONT", None)
        if (go_on is None or "readline" not in sys.modules or not isinstance(self.fd, int)
                or threading.current_thread() is not threading.main_thread()
                or signals.getsignal(go_on) is not signals.SIG_DFL or not os.isatty(self.fd)):
            return self
        import readline

        readline.set_pre_input_hook(self._prepared)
        self.previous = signals.signal(go_on, self._continued)
        return self

    def _prepared(self):
        self.modes = _terminal_modes(self.fd)

    def _continued(self, signum, frame):
        _wait_for_the_foreground(self.fd)  # continued in the background (bg): until fg
        if self.modes is not None and not _in_the_background(self.fd):
            _set_terminal_modes(self.fd, self.modes)
            try:
                self.redraw()
            except (OSError, ValueError):  # a closed stdout is said as the chat goes on
                pass

    def __exit__(self, *exc_info):
        if self.previous is not None:
            import readline
            import signal as signals

            readline.set_pre_input_hook(None)
            signals.signal(signals.SIGCONT, self.previous)


def _hung_up(fd) -> bool:
    """Whether the terminal of ``fd`` is gone (its window closed), not at a Ctrl-D."""
    import select

    if not hasattr(select, "poll"):
        return False
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return any(events & (select.POLLHUP | select.POLLERR) for _, events in poller.poll(0))


def _run_interruptibly(work, signal, cli):
    """``work()`` in a worker thread; Ctrl-C sets ``signal`` (the run stops at its next
    boundary, an HTTP exchange at once), a second Ctrl-C soon after quits. Returns work's
    result or raises its exception."""
    outcome = {}
    done = threading.Event()  # not Thread.join: a join cut by Ctrl-C can misreport is_alive

    def target():
        try:
            outcome["value"] = work()
        except BaseException as exc:
            outcome["error"] = exc
        finally:
            done.set()

    interrupts = cli.interrupts

    def interrupted():
        try:
            interrupts.pressed()
        except _Quit as leaving:  # the signal, set by the first, has most often stopped
            signal.set()  # it by now: its session gets its last records and its spans
            done.wait(_QUIT_GRACE_SECONDS)  # end, or it is left as it is
            if interrupts.take():  # a third Ctrl-C, or SIGTERM: its code is the exit's
                leaving.args = (interrupts.exit_code,)
            leaving.run_ended = done.is_set()
            raise
        if not signal.is_set():
            signal.set()
            cli.term.stop_spinner()
            if interrupts.terminating:  # SIGTERM or SIGHUP: lich leaves once it stops
                cli.term.note(f"told to end (signal {interrupts.exit_code - 128}); stopping")
            else:
                cli.term.note("interrupted; stopping (Ctrl-C again to quit)")

    threading.Thread(target=target, name="lich-run", daemon=True).start()
    interrupts.noting = True
    try:
        finished = False
        while not finished:
            try:
                finished = done.wait(_POLL_SECONDS)
            except KeyboardInterrupt:  # raised by a handler not lich's (a program embedding it)
                interrupts.noted.append(True)
            while interrupts.take():
                interrupted()
    finally:
        interrupts.noting = False
    while interrupts.take():  # one that came as the run ended
        interrupted()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def _schema_refusal(exc):
    """The usage error of --schema for a run's refusal of its ``output_schema``, or None."""
    if isinstance(exc, ValueError) and str(exc).startswith("output_schema"):
        return _UsageError("--schema" + str(exc)[len("output_schema"):])
    return None


def _seconds(seconds) -> str:
    """A wait as the terminal says it: one decimal under 10 s."""
    return f"{seconds:.1f}" if seconds < 10 else f"{seconds:.0f}"


def _describe_error(exc) -> str:
    """The one line a user sees for a failed run: the error's kind (or type) and message."""
    if isinstance(exc, ProviderError):
        # the wait a rate limit asked for: over a minute, lich did not wait; or the retries ran out
        wait = exc.retry_after
        asked = ("" if not exc.retryable or wait is None else
                 f" (the server asks to wait {_seconds(wait)} s)")
        return f"error: {exc.kind}: {exc}{asked}"
    text = _exception_text(exc)
    return f"error: {type(exc).__name__ if text == type(exc).__name__ + ': ' else text}"  # no message


class _Cli:
    """One invocation of the command line: its options resolved into a chat, tools, a terminal."""

    typed = None  # the chat's input lines, once readline keeps a history
    batch_retried = None  # --batch's: shows a retry of a task's request on the progress line

    def __init__(self, args, environ, term, interrupts):
        self.args = args
        self.term = term
        self.interrupts = interrupts
        self.environ = environ
        self.closers = []
        self.interactive = args.batch is None and _isatty(sys.stdin) and (
            args.prompt is None or args.interactive)
        self.asks = (_isatty(sys.stdin) and _isatty(sys.stderr) and not args.yolo
                     and args.batch is None)
        self.schema = _output_schema(args.schema) if args.schema is not None else None
        self.streaming = not (args.no_stream or args.json or self.schema or args.batch)
        self.answer_on_stdout = term.stdout_tty and self.streaming
        self.sessions_home = _sessions_home(args.session_dir, environ)
        self.label = args.label  # else a resumed session's: a conversation keeps its name
        self.session_dir = None if args.no_session else self.sessions_home
        # A batch's sessions go in a folder of their own: -c and --list-sessions keep to chats
        self.batch_session_dir = (None if self.session_dir is None
                                  else os.path.join(self.session_dir, "batch"))
        self.model = args.model or _default_model(environ)
        try:
            self.root = os.path.realpath(args.root)
        except (OSError, RecursionError) as e:  # a relative root in a removed folder; a link chain
            raise _UsageError(f"--root is not a folder: {args.root} "
                              f"({getattr(e, 'strerror', None) or e})") from None
        if not os.path.isdir(self.root):
            raise _UsageError(f"--root is not a folder: {args.root}")
        self.approvals = _Approvals(self) if self.asks else None
        self.allow = set(args.allow) | ({"write", "shell"} if args.yolo else set())
        self.mcp = []
        try:  # what was started is stopped, whatever fails after it
            self.mcp = [self._start_mcp(server) for server in args.mcp]
            self.tools = self._tools(self.root)
            self.system_prompt = self._system_prompt(self.root, told=True)
            self.otel = _otel_provider() if args.otel else None
            if self.otel is not None:
                self.closers.append(self.otel.shutdown)
            self.chat = self._chat(self.model)
            self.usage = {"input_tokens": 0, "output_tokens": 0}  # this chat's, for /cost
            self.signal = threading.Event()
            self.progress = None
        except BaseException:
            self.close()
            raise

    def close(self):
        """Close the MCP servers and the tracer, all at once; Ctrl-C or SIGTERM meanwhile
        cannot cut it short and leave a server running (each close is bounded)."""
        def close_one(close, done):
            try:
                close()
            except Exception:
                _cli_log().debug("closing failed", exc_info=True)
            finally:
                done.set()

        give_back = _hold_interrupts(self.interrupts)
        try:
            closing = [threading.Event() for _ in self.closers]
            for close, done in zip(self.closers, closing):
                threading.Thread(target=close_one, args=(close, done), name="lich-close",
                                 daemon=True).start()
            deadline = time.monotonic() + _CLOSE_SECONDS  # a tracer's exporter may wait 30 s
            for done in closing:
                done.wait(max(0.0, deadline - time.monotonic()))
        finally:
            give_back()

    def _start_mcp(self, server):
        named = re.match(_MCP_NAMED, server)  # name=SERVER: its tools offered as name_tool
        if named is None and re.match(r"[A-Za-z_][A-Za-z0-9_]*=", server):  # TOKEN=... cmd
            raise _UsageError("--mcp: lich runs no shell, so NAME=value before a command sets "
                              "nothing: put it in lich's environment, which the server "
                              "inherits (a lowercase name= names the server)")
        prefix, server = (named.group(1) + "_", server[named.end():]) if named else ("", server)
        if not server.strip():
            raise _UsageError(f"--mcp {named.group(0)}: no server after the name" if named else
                              "--mcp: no server given")
        # A server's first start can be long (npx or uvx fetching it): not a silent wait.
        waiting = threading.Timer(_MCP_QUIET_SECONDS, self.term.note, [
            f"lich: waiting for the MCP server {_shown_mcp(server)} to start"])
        waiting.daemon = True
        waiting.start()
        try:
            tools = mcp_tools(server, cwd=self.root, prefix=prefix)
        except MCPError as e:  # it names the server (its program), a URL's secrets redacted
            raise _UsageError(f"--mcp {named.group(0)}: {e}" if named else f"--mcp: {e}") from None
        except ValueError as e:  # a command that cannot be split
            raise _UsageError(f"--mcp {server}: {e}") from None
        finally:
            waiting.cancel()
        self.closers.append(tools.close)
        return tools

    def _system_prompt(self, root, *, told):
        """The system prompt of a run in ``root``: -s or the default one naming the root and
        the tools, then the root's AGENTS.md (``told``: a note on stderr says so)."""
        args = self.args
        names = ", ".join(spec["name"] for spec in self.tools.specs())
        system = (args.system if args.system is not None
                  else _DEFAULT_SYSTEM_PROMPT.format(root=root, tools=names, answer=(
                      _PLAIN_ANSWER if args.schema is None else _SCHEMA_ANSWER)))
        found = None if args.no_project_instructions else _project_instructions(
            root, self.term if told else None)
        if found is not None:
            system += f"\n\nInstructions of this project, from {found[0]}:\n\n{found[1]}"
            if told:
                self.term.note(f"lich: following {found[0]} of {root}")
        return system

    def _tools(self, root):
        tools = coding_tools(root, allow_write="write" in self.allow,
                             allow_shell="shell" in self.allow, approve=self.approvals)
        # The combined runner routes a name to the first runner that offers it: these.
        self.lich_tools = frozenset(spec["name"] for spec in tools.specs())
        if not self.mcp:
            return tools
        servers = [_ApprovedTools(m, self.approvals) if self.approvals else m for m in self.mcp]
        try:
            return combine_tools(tools, *servers)
        except ValueError as e:
            raise _UsageError(f"--mcp: {e} (--mcp name=SERVER offers a server's tools as "
                              f"name_tool)") from None

    def _chat(self, spec):
        options = {"stream": self.streaming, "on_retry": self._on_retry,
                   "on_failover": self._on_failover}
        if self.streaming:
            options["on_delta"] = self._delta
        if self.args.base_url:
            options["base_url"] = self.args.base_url
        if self.args.batch is not None:
            options["retries"] = _BATCH_CHAT_RETRIES
        try:
            return chat_from_spec(spec, **options)
        except (ValueError, TypeError) as exc:
            raise _UsageError(str(exc)) from None

    def _on_retry(self, error, attempt, delay):
        if self.batch_retried is not None:
            self.batch_retried(error, delay)
        elif self._current(threading.current_thread()):
            self.progress.received = []  # the next try's text is the answer's, from its start
            self.term.note(f"retrying in {_seconds(delay)} s: {error.kind} (attempt {attempt}/"
                           f"{self.chat.retries})")

    def _on_failover(self, error, index):
        if self._current(threading.current_thread()):
            self.progress.received = []
            self.term.note(f"{error.kind} from {self.chat.chats[index - 1]!r}; trying "
                           f"{self.chat.chats[index]!r}")

    def _current(self, thread):
        progress = self.progress
        return progress is not None and progress.thread in (thread, None)

    def _delta(self, text) -> bool:
        """Streamed text, shown when it is the answer of the current run; whether it was
        (not on a pipe: a stream that then breaks is retried)."""
        progress = self.progress
        if (progress is not None and progress.thread is threading.current_thread()
                and not progress.compressing):
            return progress.delta(text)
        return False

    def is_lich_tool(self, name) -> bool:
        """Whether a call of ``name`` goes to lich's own tool (not an MCP server's)."""
        return isinstance(name, str) and name in self.lich_tools

    def drop_typed_ahead(self) -> bool:
        """Throw away what was typed before a question was asked, so that no keystroke made
        before it can answer it; whether there was any."""
        import select
        import termios

        try:
            if _in_the_background(sys.stdin.fileno()):  # what is typed is the shell's; a flush
                return False  # would stop lich (SIGTTOU): the question waits for fg
            pending = bool(select.select([sys.stdin], [], [], 0)[0])
            termios.tcflush(sys.stdin.fileno(), termios.TCIFLUSH)
        except (OSError, ValueError, termios.error):  # not a terminal after all
            return False
        return pending

    def answer_lines(self):
        """``with cli.answer_lines() as lines``, around a question and its ``read_answer``:
        the terminal takes lines, echoed, from before the question shows (a pager's mode
        would take a key as the answer, unseen), and gets its modes back after."""
        return _LineMode(sys.stdin.fileno())

    def read_answer(self, lines):
        """A line typed at an approval question ("" for Ctrl-D), or None when the run was
        interrupted: by Ctrl-C, or by the terminal closing (no answer can come then, and the
        run stops as for Ctrl-C before SIGHUP comes). ``lines``: ``answer_lines()``'s. A
        lich in the background waits, idle, until ``fg`` (it is the run's thread: stopped
        there, it could stop again after a ``kill``'s SIGCONT before the main thread took
        the SIGTERM)."""
        import select

        signal, fd = self.signal, lines.fd
        while not signal.is_set():
            # In the background, its keys are the shell's, and a read would stop lich with
            # the terminal non-blocking (the shell's too)
            if not lines.take_lines():
                signal.wait(_POLL_SECONDS)
                continue
            if not select.select([fd], [], [], _POLL_SECONDS)[0] or _in_the_background(fd):
                continue  # (put in the background as it waited: the key is the shell's)
            # Not a blocking read: a Ctrl-C just after select empties the terminal's line
            # (it flushes what was typed), and such a read would wait for another line.
            blocking = os.get_blocking(fd)
            os.set_blocking(fd, False)
            try:
                typed = os.read(fd, _ANSWER_BYTES)
            except BlockingIOError:
                continue
            finally:
                os.set_blocking(fd, blocking)
            if not typed and _hung_up(fd):
                signal.set()
                return None
            return typed.decode(sys.stdin.encoding or "utf-8", "replace")
        return None

    def open_session(self):
        if self.session_dir is None:
            return None
        return _LazySession(self.session_dir, self.label, self.term)

    # -- one run

    def run(self, prompt, history, session):
        """One user turn; returns (exit code, the history to go on with).

        The history after a failed or interrupted run is what the session file holds, so
        the chat and a later --resume agree; an interrupted request is kept, answered by a
        note that says so.
        """
        term = self.term
        signal = self.signal = threading.Event()
        self.interrupts.forget()  # a Ctrl-C that stopped the turn before is not this one's first
        seeded = seed_system_prompt(list(history) + [{"role": "user", "content": prompt}],
                                    self.system_prompt)
        progress = self.progress = _Progress(self, seeded)
        emitter = AgentEmitter()
        emitter.on_any(progress)
        if session is not None:
            emitter.on("llm_end", lambda event: session.answered())
        if self.otel is not None:
            provider, _, model = self.model.split(",")[0].partition(":")  # the one asked first
            trace_otel(emitter, tracer=self.otel.get_tracer("lich", __version__),
                       provider=provider.strip().lower(), model=model.partition("@")[0])
        args = self.args

        def work():
            progress.thread = threading.current_thread()
            return run_agent(prompt, chat=self.chat, tools=self.tools, history=history,
                             session=session, emitter=emitter, max_turns=args.max_turns,
                             system_prompt=self.system_prompt, temperature=args.temperature,
                             max_tokens=args.max_tokens,
                             context_budget_tokens=args.context_budget or None, signal=signal,
                             output_schema=self.schema)

        try:
            run = _run_interruptibly(work, signal, self)
        except AbortError:
            self._interrupted(progress, session)
            return self.interrupts.exit_code, progress.history
        except _Quit as leaving:
            if getattr(leaving, "run_ended", False):  # closed as one Ctrl-C closes it
                self._interrupted(progress, session)
            raise
        except Exception as exc:
            refusal = _schema_refusal(exc)
            if refusal is not None:  # refused before any call: the chat cannot go on
                raise refusal from None
            _cli_log().debug("the run failed", exc_info=True)
            # An answer that broke off after some of it was shown stays, as after a Ctrl-C;
            # a request that got nothing is dropped (sent again, it is the same)
            broke_off = bool("".join(progress.received).strip())
            if broke_off:
                term.end_answer()
                self._close_turn(progress, session, _BROKE_OFF_NOTE)
            elif session is not None:
                session.forget_unwritten()
            self._end_json(None, progress.usage, session)  # None: it raised, as BatchResult says
            term.error(_describe_error(exc))
            if isinstance(exc, ProviderError) and exc.kind == "overflow":  # each turn would fail so
                budget = self.args.context_budget
                term.note(("lich: the request is larger than the server takes (HTTP 413: a "
                           "proxy before it may set that limit): " if exc.status == 413 else
                           "lich: the conversation is longer than the model takes: ")
                          + (f"a --context-budget below {budget} compresses it sooner" if budget
                             else "compression is off (--context-budget 0)")
                          + ("; /compact compresses it now" if self.interactive else ""))
            if not self.args.json:
                self._note_usage(progress.usage)  # what the calls before it used
            history = progress.history
            while history and history[-1].get("role") == "user":
                history = history[:-1]  # as a resume reads it: no unanswered request
            return _EXIT_ERROR, history
        finally:  # the run's usage, summed from its llm_end events however it ended
            for key, value in progress.usage.items():
                self.usage[key] = self.usage.get(key, 0) + value
        if run.stopped_reason == "aborted":
            self._interrupted(progress, session)
            return self.interrupts.exit_code, progress.history
        self._show(run, session)
        if self.interrupts.terminating:  # told to end as the run ended: 128 + N all the same
            return self.interrupts.exit_code, run.messages
        return (_EXIT_BUDGET if run.stopped_reason == "budget" else _EXIT_OK), run.messages

    def _interrupted(self, progress, session):
        """Close an interrupted turn with a note (and what was shown of its answer)."""
        term = self.term
        term.stop_spinner()
        term.end_answer()
        self._close_turn(progress, session, _INTERRUPTED_NOTE)
        self._end_json("aborted", progress.usage, session)
        term.note("lich: stopped: interrupted")
        if not self.args.json:
            self._note_usage(progress.usage)  # what the calls before the stop used

    def _close_turn(self, progress, session, note_text):
        """End a turn that was cut short with an assistant message: what the model said
        before (shown on the screen), then ``note_text``; in the chat and in the session."""
        last = progress.history[-1] if progress.history else {}
        if last.get("role") in ("user", "tool"):
            said = "".join(progress.received).strip()  # what the model said before the stop
            note = {"role": "assistant", "content": f"{said}\n\n{note_text}" if said else note_text}
            progress.history.append(note)
            if session is not None:
                try:
                    session.append_message(note)
                    session.answered()
                except Exception as e:
                    _cli_log().warning("session recording stopped: %s", e)

    def _end_json(self, stopped_reason, usage, session, output=None):
        if self.args.json:
            end = {"type": "run_end", "stopped_reason": stopped_reason, "usage": usage,
                   "session_path": getattr(session, "path", None)}
            if self.schema is not None:  # the answer --schema asked for, parsed
                end["output"] = output
            self.term.json_line(end)

    def _show(self, run, session):
        """How a run ended, the same for one-shot runs and chat turns."""
        term, args = self.term, self.args
        if args.json:
            self._end_json(run.stopped_reason, run.usage_total, session, run.output)
            return
        if self.schema is not None:
            if run.stopped_reason == "final":
                term.json_answer(run.output)
        elif self.answer_on_stdout:
            term.end_answer()
        elif run.final is not None:
            term.end_answer()
            term.answer(run.final.get("content") or "")
        if run.stopped_reason == "budget":
            how = ('say "go on" to continue' if self.interactive else
                   "raise --max-turns" + (" or continue with -c" if session is not None else ""))
            last = next((m for m in reversed(run.messages) if m.get("role") == "assistant"), {})
            missed = ("an answer that fits the schema" if self.schema is not None and last
                      and not last.get("tool_calls") else "a final answer")  # its last answer did not fit
            term.note(f"lich: stopped: the turn budget ({args.max_turns}) ran out before "
                      f"{missed}; {how}")
        elif run.stopped_reason == "final" and run.result.stop_reason == "length":
            term.note("lich: the answer was cut short: the model reached its output limit or filled its "
                      "context window")  # "length" stands for both
        elif run.stopped_reason == "final" and run.result.stop_reason in _DECLINED:
            term.note(f"lich: {_DECLINED[run.result.stop_reason]}")
        elif run.stopped_reason == "final" and not (run.final.get("content") or "").strip():
            term.note("lich: the model's answer was empty")
        self._note_usage(run.usage_total)

    def _note_usage(self, usage):
        """The tokens a run's calls used, on stderr; none when the provider said nothing."""
        if usage.get("input_tokens") or usage.get("output_tokens"):
            self.term.note(_usage_line(usage))

    # -- modes

    def one_shot(self, prompt, history) -> int:
        session = self.open_session()
        try:
            code, _ = self.run(prompt, history, session)
        finally:
            if session is not None:
                session.close()
        return code

    def _say_missing_keys(self):
        """Name each model of the chat whose provider wants a key that is not set: said when
        the chat starts and at /model, not at the failure of a message typed meanwhile."""
        for chat in self.chat.chats:
            if not os.environ.get(chat.key_env) and (
                    isinstance(chat, AnthropicChat) or chat.base_url == chat.public_url):
                self.term.note(f"lich: {chat.key_env} is not set: {chat.model} cannot answer")

    def repl(self, history, first=None) -> int:
        """The interactive chat: one session file shared by its turns (a new one after
        /clear or /resume)."""
        term = self.term
        history_file = self._load_input_history()
        tools = ", ".join(spec["name"] for spec in self.tools.specs())
        term.note(f"lich {__version__} · {_shown_spec(self.model)} · {self.root} · tools: {tools}")
        term.note("/help for commands, Ctrl-D to leave")
        self._say_missing_keys()
        session = None
        try:
            while not self.interrupts.terminating:  # SIGTERM or SIGHUP: the turn stopped, leave
                if first is not None:
                    line, first = first, None
                    self._show_as_typed(line)
                else:
                    line = self._read_message()
                if line is None:
                    return _EXIT_OK
                command = line.strip()
                name = command.split(None, 1)[0] if command else ""
                # A first word that is a path ("/usr/bin/env: python: not found") is a message.
                is_command = name.startswith("/") and "/" not in name[1:] and "\n" not in command
                if is_command and name in ("/exit", "/quit"):  # "/exit now"
                    return _EXIT_OK
                if is_command:
                    try:
                        history, session = self._command(command, history, session)
                    except KeyboardInterrupt:  # one cut short (/resume of a long file): as at the prompt
                        self._interrupted_at_the_prompt()
                    continue
                if not command:
                    continue
                if session is None:
                    session = self.open_session()
                _, history = self.run(line, history, session)
            return self.interrupts.exit_code
        finally:
            # Leaving: a signal now only sets the code. A closing terminal's SIGHUP comes as
            # its input ends, and raised here it cut the history file's writing short.
            self.interrupts.noting = True
            if session is not None:
                session.close()
            self._save_input_history(history_file)

    def _read_message(self):
        """One message typed at the prompt (None at end of input): a line ending in ``\\``
        goes on, ``\"\"\"`` opens and closes a block; a paste is one message (readline's
        bracketed paste)."""
        to_stderr, prompt, more_prompt = self._prompts()
        while True:
            try:
                line = self._input(prompt, to_stderr)
                if line is None:
                    return None
                if line.strip() == '"""':
                    block = []
                    while True:
                        more = self._input(more_prompt, to_stderr)
                        if more is None or more.strip() == '"""':
                            return "\n".join(block)
                        block.append(more)
                while line.endswith("\\"):
                    more = self._input(more_prompt, to_stderr)
                    line = line[:-1] + "\n" + (more or "")
                    if more is None:
                        break
                return line
            except KeyboardInterrupt:
                self.term.typed("\n")  # off the prompt's line, for the note or the shell's prompt
                self._interrupted_at_the_prompt()

    def _prompts(self):
        """(whether the prompt goes to stderr, the prompt, the prompt of a line that goes on)."""
        to_stderr = not self.term.stdout_tty  # the prompt must not go into piped stdout
        # input() cannot show what the terminal's encoding cannot hold: it would raise
        if _can_show(sys.stderr if to_stderr else sys.stdout, "› …"):
            return to_stderr, "› ", "… "
        return to_stderr, "> ", "... "

    def _show_as_typed(self, message):
        """``-i``'s first prompt, shown as if typed at the prompt, where the prompt goes."""
        to_stderr, prompt, more_prompt = self._prompts()
        shown = prompt + message.replace("\n", "\n" + more_prompt)
        if to_stderr:
            self.term.typed(_visible(shown) + "\n")  # as term.line shows it
        else:
            self.term.line(shown)

    def _interrupted_at_the_prompt(self):
        """Ctrl-C, SIGTERM or SIGHUP while the chat waits for (or does) what was typed: the
        latter two leave; a second Ctrl-C within 2 s quits, a first one says so."""
        if self.interrupts.terminating:
            raise _Quit(self.interrupts.exit_code) from None
        self.interrupts.pressed()
        self.term.note("(Ctrl-C again or Ctrl-D to quit)")

    def _input(self, prompt, to_stderr):
        fd = _fd_of(sys.stdin)
        try:
            # readline keeps the modes it finds as the terminal's own: a shell's, with no
            # echo, when lich came to the prompt in the background
            _wait_for_the_foreground(fd)
            with _BackAtThePrompt(fd, lambda: self._redraw_prompt(prompt, to_stderr)):
                if to_stderr:
                    self.term.typed(prompt)
                    line = input()
                else:
                    line = input(prompt)
            if line and self.typed is not None:  # what readline adds to its history
                self.typed.append(line)
            return line
        except EOFError:
            self.term.typed("\n")
            return None
        except OSError as e:  # the terminal gone, read without readline (stdout not one; PyPy)
            if e.errno != errno.EIO:
                raise
            return None
        except UnicodeDecodeError:  # a terminal whose bytes are not the locale's
            self.term.error("that line is not valid text in this terminal's encoding")
            return ""

    def _redraw_prompt(self, prompt, to_stderr):
        """The prompt and what was typed at it, again (after ``fg``: the shell wrote since)."""
        import readline

        shown = ("\r\033[K" if self.term.fancy else "\n") + prompt + readline.get_line_buffer()
        if to_stderr:
            self.term.typed(shown)
        else:
            sys.stdout.write(shown)
            sys.stdout.flush()

    def _load_input_history(self):
        """Give readline the chat input of earlier chats (JSON lines: a paste keeps its newlines)."""
        try:
            import readline
        except ImportError:
            return None
        if "libedit" not in (readline.__doc__ or "") and self.environ.get("TERM") not in (
                None, "", "dumb"):  # GNU readline's syntax; a dumb terminal would show the codes
            # CPython turns bracketed paste off for its own REPL, and a terminal then types a
            # paste as keys: each of its lines would be sent as a message of its own.
            readline.parse_and_bind("set enable-bracketed-paste on")
        path = os.path.join(_state_home(self.environ), "history")
        for entry in _input_history(path):
            readline.add_history(entry)
        # What this chat adds, kept here: readline's own count stops growing at an
        # inputrc's history-size
        self.typed = []
        return path

    def _save_input_history(self, path):
        """Add this chat's input to the file: read again (under a lock of its folder), so
        that another chat's input saved meanwhile stays, and replaced whole, so that a
        failure mid-write leaves it as it was. A link is followed; a file lich may not read
        or write is left (one it may write but not read would lose every earlier entry)."""
        if path is None or not self.typed:
            return
        import tempfile

        path = os.path.realpath(path)  # a link to a dotfiles repository's file stays a link
        folder, written, lock = os.path.dirname(path), None, None
        try:
            os.makedirs(folder, mode=0o700, exist_ok=True)
            if os.path.exists(path) and not os.access(path, os.R_OK | os.W_OK):
                return
            lock = _history_lock(folder)  # two chats closed at once: one adds after the other
            entries = _input_history(path)
            for entry in self.typed:
                if not entries or entries[-1] != entry:  # as readline adds them
                    entries.append(entry)
            fd, written = tempfile.mkstemp(prefix=".history-", dir=folder)  # 0600: prompts are private
            with open(fd, "w", encoding="utf-8") as f:
                f.writelines(json.dumps(entry) + "\n" for entry in entries[-_HISTORY_LINES:])
            os.replace(written, path)
            written = None
        except OSError as e:
            _cli_log().debug("cannot save the input history: %s", e)
        finally:
            if written is not None:  # not replaced: the file stays as it was
                try:
                    os.unlink(written)
                except OSError:
                    pass
            if lock is not None:
                os.close(lock)

    def _command(self, line, history, session):
        """A chat command; returns the (history, session) to go on with."""
        term = self.term
        command, _, rest = line.partition(" ")
        rest = rest.strip()
        if rest and command in _CHAT_COMMANDS and not _CHAT_COMMANDS[command][0]:
            # "/clear the cache" was likely meant for the model: nothing is done
            term.error(f"{command} takes nothing after it; /help lists the commands")
        elif command == "/help":
            usages = [f"{name} {takes}".strip() for name, (takes, _) in _CHAT_COMMANDS.items()]
            width = max(map(len, usages))
            term.line("\n".join(["commands:", *(f"  {usage:<{width}}  {text}" for usage, (_, text)
                                                 in zip(usages, _CHAT_COMMANDS.values())),
                                 _CHAT_KEYS]))
        elif command == "/model":
            try:
                if rest:
                    self.chat = self._chat(rest)
                    self.model = rest
                term.note(f"model: {_shown_spec(self.model)}")
            except _UsageError as e:  # a mistyped spec keeps the chat and its model
                term.error(f"{e}; the model stays {_shown_spec(self.model)}")
            self._say_missing_keys()
        elif command == "/allow":
            self._allow_command(rest)
        elif command == "/cost":
            term.line(_usage_line(self.usage) + " in this chat")
        elif command == "/compact":
            signal = self.signal = threading.Event()
            asked = []  # whether there was anything to summarise

            def summarise(messages, **options):
                asked.append(True)
                result = self.chat(messages, **options)
                for key, value in result.usage.items():  # /cost counts the summary's call too
                    self.usage[key] = self.usage.get(key, 0) + value
                return result

            term.start_spinner("compressing")
            try:
                compressed, chars = _run_interruptibly(
                    lambda: compress_messages(summarise, history, signal=signal), signal, self)
            finally:
                term.stop_spinner()
            if chars or signal.is_set() or not asked:  # else its failure was shown as a warning
                term.note(f"(history compressed: {chars} characters of summary)" if chars
                          else "compression stopped" if signal.is_set() else "nothing to compress")
            return compressed, session
        elif command == "/sessions":
            _print_sessions(self.sessions_home, term, as_json=False, in_chat=True)
        elif command == "/clear":
            self.label = self.args.label
            if session is not None:
                session.close()
            term.note("new conversation")
            return [], None
        elif command == "/resume":
            try:
                resumed = self.load_session(rest or "latest", folder=not rest)
            except SessionNotFound as exc:
                term.error(str(exc))
                return history, session
            if session is not None:
                session.close()
            return resumed, None
        else:
            import difflib
            near = difflib.get_close_matches(command, list(_CHAT_COMMANDS), n=1)
            hint = f"; did you mean {near[0]}?" if near else "; /help lists them"
            term.error(f"unknown command {command}{hint}")
        return history, session

    def _allow_command(self, rest):
        term = self.term
        if self.approvals is None:
            term.note("nothing is asked here: " + ("--yolo allows everything" if self.args.yolo
                                                  else "--allow is the permission"))
            return
        grants = self.approvals.grants
        if rest in ("revoke all", "revoke *"):
            grants.clear()
        elif rest.startswith("revoke "):
            number = rest.split()[1]
            try:
                index = int(number) - 1
            except ValueError:
                index = -1
            if not 0 <= index < len(grants):  # 0 and -1 are no grant, not the last one
                term.error(f"no grant {number}; /allow lists them")
                return
            del grants[index]
        elif rest:
            term.error("usage: /allow, /allow revoke N, /allow revoke all")
            return
        if grants:
            term.line("\n".join(self.approvals.describe()))
        elif self.allow or self.mcp:
            term.line("nothing is allowed always; each call asks")
        else:  # the read tools never ask, and none other is offered
            term.line("nothing is allowed always, and no tool here asks (--allow offers those that do)")

    def load_session(self, ref, *, folder):
        """The history of a session (``folder``: the latest of this --root), shown briefly."""
        if folder and ref == "latest":
            path = _latest_session_in(self.sessions_home, self.root, self.term)
            unreadable = _unreadable_folder(self.sessions_home) if path is None else None
            if unreadable:
                raise SessionNotFound(unreadable)
            if path is None:
                raise SessionNotFound("no session in this folder")
        else:
            try:
                path = resolve_session(self.sessions_home, ref)
            except SessionNotFound:  # --label L names a conversation: --resume L finds it
                path = next((p for p in list_sessions(self.sessions_home)
                             if _label_of(p) == ref), None)
                unreadable = _unreadable_folder(self.sessions_home) if path is None else None
                if unreadable:  # a folder entered but not listed: a session in it by its name
                    named = os.path.join(self.sessions_home, f"{ref}.jsonl")
                    if (ref == "latest" or not re.fullmatch(r"[^/\\\0]+", ref) or ".." in ref
                            or not os.path.isfile(named)):
                        raise SessionNotFound(unreadable) from None
                    path = named
                if path is None:
                    raise
        try:
            history = read_session_messages(path)
        except FileNotFoundError:
            raise SessionNotFound(f"session not found: {ref}") from None
        except OSError as e:  # unreadable: as unusable as a missing one
            raise SessionNotFound(f"cannot read the session {ref}: {e.strerror or e}") from None
        self.label = self.args.label or _label_of(path)
        shown = os.path.splitext(os.path.basename(path))[0]
        self.term.note(f"resumed {shown}: {_how_many(len(history), 'message', 'messages')}")
        for line in _recap(history):
            self.term.line(line, dim=True)
        return history

    def batch(self) -> int:
        """Every task of --batch, on --workers threads; resumed from --out."""
        tasks, numbers = _read_tasks(self.args.batch)
        term, args = self.term, self.args
        # A task in a folder of its own is told that folder, and its AGENTS.md (quietly: a
        # note per task would bury the progress line). A root that is no folder fails its task.
        prompts = {}  # a folder's, made once however many tasks work there

        def prompt_in(root):
            real = os.path.realpath(root)
            if real not in prompts:
                prompts[real] = self._system_prompt(real, told=False)
            return prompts[real]

        tasks = [{**task, "system_prompt": prompt_in(task["root"])}
                 if isinstance(task, dict) and isinstance(task.get("root"), str)
                 and os.path.isdir(task["root"]) and "system_prompt" not in task else task
                 for task in tasks]
        if args.out is not None and not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):
            raise _UsageError(f"--out: the folder of {args.out} does not exist")
        signal = self.signal = threading.Event()
        started, counts = time.monotonic(), {"done": 0, "failed": 0, "budget": 0, "retries": 0}
        total = len(tasks)
        done_before = 0 if args.out is None or args.redo else _done_in(args.out, tasks)
        begun = []  # a task's id as it begins (appended by the worker threads)
        counting = threading.Lock()  # retries are counted and shown from the worker threads

        def show(retried=""):
            elapsed = time.monotonic() - started
            rate = counts["done"] / elapsed if elapsed > 0 else 0.0
            done = done_before + counts["done"]
            left = total - done
            eta = f" · ETA {max(1, round(left / rate))} s" if rate and left else ""  # never "0 s"
            budget = f" · {counts['budget']} out of turns" if counts["budget"] else ""  # exit 3
            term.status(f"{done}/{total} done · {counts['failed']} failed{budget} · "
                        f"{len(begun) - counts['done']} running · {elapsed:.0f} s · "
                        f"{rate:.1f}/s{eta}{retried}")

        def on_result(result):
            counts["done"] += 1
            counts["failed"] += result.stopped_reason is None or result.stopped_reason == "aborted"
            counts["budget"] += result.stopped_reason == "budget"
            if args.out is None:
                term.json_line(asdict(result))
            show()

        def on_retry(error, delay):  # a batch whose requests fail and wait looked hung
            with counting:
                counts["retries"] += 1
                show(f" · {_how_many(counts['retries'], 'retry', 'retries')} (the last: "
                     f"{error.kind}, waiting {_seconds(delay)} s)")

        self.batch_retried = on_retry

        def tools(task):  # made as the task begins: it runs until its result comes
            begun.append(task["id"])
            return self._tools(task.get("root") or self.root)

        def work():
            return run_batch(tasks, chat=self.chat, tools=tools,
                workers=args.workers or _DEFAULT_WORKERS,
                session_dir=self.batch_session_dir, out=args.out, redo=args.redo, signal=signal,
                on_result=on_result, max_turns=args.max_turns,
                trace=self.otel.get_tracer("lich", __version__) if self.otel is not None else False,
                system_prompt=self.system_prompt, temperature=args.temperature,
                max_tokens=args.max_tokens,
                context_budget_tokens=args.context_budget or None, output_schema=self.schema)

        try:
            results = _run_interruptibly(work, signal, self)
        except (TypeError, ValueError) as e:  # a bad task: run_batch checks them before any runs
            bad = _bad_task(e, numbers, args.batch)
            if bad is None:
                raise
            raise bad from None
        except OSError as e:  # --out cannot be opened, or another batch holds it
            if e.filename != args.out:
                raise
            term.error(f"--out {args.out}: {e.strerror}")
            return _EXIT_ERROR
        term.end_status()
        if total and done_before == total:
            term.note(f"lich: {_how_many(total, 'task was', 'tasks were')} done before, in {args.out}; "
                      f"--redo runs them again")
        if signal.is_set():
            return self.interrupts.exit_code
        if any(not r.ok and r.stopped_reason != "budget" for r in results):
            return _EXIT_ERROR
        return _EXIT_BUDGET if any(r.stopped_reason == "budget" for r in results) else _EXIT_OK


def _read_tasks(path):
    """A --batch file's tasks, JSON lines or else one prompt per line, and the number of the
    line each came from. Only a newline ends a line: a JSON string may hold U+2028."""
    try:
        with open(path, encoding="utf-8-sig") as f:  # a byte order mark is not the first task's
            lines = [(number, line) for number, line in enumerate(f.read().split("\n"), 1)
                     if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise _UsageError(f"--batch: cannot read {path}: {getattr(e, 'strerror', None) or e}") \
            from None
    numbers = [number for number, _ in lines]
    if not lines:
        raise _UsageError(f"--batch: {path} holds no task")
    if not lines[0][1].lstrip().startswith("{"):
        return [line for _, line in lines], numbers
    tasks = []
    for number, line in lines:
        try:
            tasks.append(json.loads(line))
        except (ValueError, RecursionError) as e:
            raise _UsageError(f"--batch: line {number} of {path} is not JSON: {e}") from None
    return tasks, numbers


def _done_in(out, tasks) -> int:
    """How many of ``tasks`` have an ok result in the --out file: run_batch does not run
    them again."""
    ids = [task.get("id", str(position)) if isinstance(task, dict) else str(position)
           for position, task in enumerate(tasks)]
    ids = {task_id for task_id in ids if isinstance(task_id, str)}  # run_batch refuses the rest
    done = set()
    if not os.path.isfile(out):  # none yet, or a pipe or a device, which run_batch does not read
        return 0
    try:
        with open(out, "rb") as f:
            for line in f:
                try:
                    result = BatchResult(**json.loads(line))
                except (ValueError, TypeError, RecursionError):
                    continue  # a line cut by a kill, or not a result
                if result.ok is True and isinstance(result.id, str) and result.id in ids:
                    done.add(result.id)  # a finished task's line, as run_batch reads it
    except OSError:  # none yet; any other trouble, run_batch says
        return 0
    return len(done)


def _bad_task(error, numbers, path):
    """run_batch's complaint about the task at a position, as a usage error naming its line
    of the --batch file; None for any other error."""
    found = re.match(r"task (\d+)\b", str(error))
    if found is None or int(found[1]) >= len(numbers):
        return None
    return _UsageError(f"--batch: line {numbers[int(found[1])]} of {path}"
                       f"{str(error)[found.end():]}")


def _unreadable_folder(folder):
    """"cannot read the session folder F: why" when ``folder``, which is there, cannot be
    listed (a sessions folder a ``sudo lich`` made root's); None when it can be, or is not
    there: list_sessions reads such a folder as one without sessions."""
    try:
        with os.scandir(folder):
            return None
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"cannot read the session folder {folder}: {e.strerror or e}"


def _print_sessions(session_dir, term, *, as_json, in_chat=False) -> int:
    """--list-sessions on stdout, or the chat's /sessions on stderr, with /help and /cost."""
    show = term.line if in_chat else term.answer
    paths = list_sessions(session_dir)
    unreadable = _unreadable_folder(session_dir) if not paths else None
    if unreadable:
        term.error(unreadable)
        return _EXIT_ERROR
    if not paths:
        term.note("no sessions yet")
    rows = []
    for path in paths if as_json else paths[:_LIST_SESSIONS_LIMIT]:
        try:
            summary = _session_summary(path)
        except FileNotFoundError:  # removed meanwhile
            continue
        except OSError as e:
            summary = {"id": os.path.splitext(os.path.basename(path))[0], "path": path,
                       "error": f"cannot read it: {e.strerror or e}"}
        if as_json:
            term.json_line(summary)
            continue
        if "error" in summary:
            rows.append([_one_line(summary["id"]), "-", "-", "-", "", f"({summary['error']})"])
            continue
        count = summary["messages"]
        rows.append([_one_line(text) for text in (  # piped too
            summary["id"], summary["when"][:16].replace("T", " "),  # UTC, as the ids
            summary["folder"] or "-", summary["model"] or "-",
            f"{count:>4} {'message' if count == 1 else 'messages'}",
            summary["prompt"][:_TOOL_SUMMARY_CHARS])])
    widths = [max((len(row[i]) for row in rows), default=0) for i in range(5)]
    for row in rows:  # the columns line up; the prompt, last, is left as long as it is
        show("  ".join([*(text.ljust(width) for text, width in zip(row, widths)), row[5]]))
    if not as_json and len(paths) > _LIST_SESSIONS_LIMIT:
        term.note(f"... {len(paths) - _LIST_SESSIONS_LIMIT} older sessions")
    return _EXIT_OK


class _LogHandler:
    """Shows lich's log records on stderr through the terminal (made a logging.Handler
    when logging is imported)."""

    def __new__(cls, term, level):
        import logging

        class Handler(logging.Handler):
            def emit(self, record):
                try:
                    text = record.getMessage()
                    if self.level <= logging.DEBUG and (record.exc_text or record.exc_info):
                        text += "\n" + (record.exc_text or logging.Formatter().formatException(
                            record.exc_info))
                    kind = "warning: " if record.levelno >= logging.WARNING else "debug: "
                    term.line("lich: " + kind + text)
                except Exception:
                    self.handleError(record)

        return Handler(level)


def _set_dumpable(dumpable):
    """Linux: whether other processes of this user (the tools) may read this one's memory and
    /proc entries, its environment among them; returns what it was (None elsewhere)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
        was = prctl(3, 0, 0, 0, 0)  # PR_GET_DUMPABLE
        prctl(4, int(dumpable), 0, 0, 0)  # PR_SET_DUMPABLE
    except (OSError, AttributeError):
        return None
    return was == 1


def main(argv=None) -> int:
    """Run the lich command line; returns the process exit code.

    ``lich PROMPT`` runs one agent turn and prints the answer on stdout; with no PROMPT
    and a terminal on stdin it starts an interactive chat. Exit codes: 0 a final
    answer, 1 a provider or runtime error, 2 a usage error or an unknown session,
    3 the turn budget ran out, 130 interrupted, 128 + N ended by signal N. Call it as
    ``sys.exit(main())`` (a zipapp made with ``-m lich:main`` drops the code).
    """
    import signal as signals

    main_thread = threading.current_thread() is threading.main_thread()
    if (main_thread and _SIGINT_KILLS_AS_IT_LOADS
            and signals.getsignal(signals.SIGINT) is signals.SIG_DFL):  # the script's own
        signals.signal(signals.SIGINT, signals.default_int_handler)
    try:
        return _main(argv, main_thread)
    except KeyboardInterrupt:  # a Ctrl-C before lich's own handling began, or as it ends
        return _EXIT_INTERRUPTED


def _main(argv, main_thread) -> int:
    try:
        args = _build_parser().parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a usage error argparse has shown
        return exc.code if isinstance(exc.code, int) else _EXIT_USAGE
    for option in ("prompt", "system", "schema"):  # text to pass on, read as stdin is read
        if getattr(args, option) is not None:
            setattr(args, option, _argument_text(getattr(args, option)))
    import logging
    import signal as signals

    term = _Terminal(quiet=args.quiet, json_lines=args.json)
    logger = logging.getLogger("lich")
    handler = _LogHandler(term, logging.DEBUG if args.verbose else logging.WARNING)
    previous_level = logger.level
    logger.addHandler(handler)
    # the OpenTelemetry SDK's warnings (a collector down) as lich's: one line, no traceback
    otel_logger = logging.getLogger("opentelemetry") if args.otel else None
    if otel_logger is not None:
        otel_logger.addHandler(handler)
    if args.verbose:
        logger.setLevel(logging.DEBUG)
    interrupts = _Interrupts()
    handlers = {}  # each signal's handler before lich's, given back at the end
    undumpable = bool(args.mcp) or "shell" in args.allow or args.yolo
    was_dumpable = cli = None
    shells_modes = []  # the terminal's modes as a SIGTERM or SIGHUP in the background found them

    def terminated(signum, frame):
        # kill %1 of a lich stopped in the background: readline's cleanup as it leaves the
        # prompt sets the terminal's modes, which would stop it again there (SIGTTOU); the
        # shell's, as they are now, are given back as lich leaves
        stop = getattr(signals, "SIGTTOU", None)
        if stop is not None and stop not in handlers and _in_the_background(0):
            handlers[stop] = signals.signal(stop, signals.SIG_IGN)
            shells_modes.append(_terminal_modes(0))
        if interrupts.terminate(signum):
            interrupts.arrived()

    def interrupted(signum, frame):
        interrupts.arrived()

    # Within the try, so that a signal as they are set ends lich with its own code (a SIGTERM
    # there ended it as a Ctrl-C, 130) and the finally gives everything back.
    try:
        # A tool cannot read the keys from /proc/<lich>/environ; main() gives back what it found.
        was_dumpable = _set_dumpable(False) if undumpable else None
        if main_thread:
            if signals.getsignal(signals.SIGINT) is signals.default_int_handler:  # not a SIG_IGN
                handlers[signals.SIGINT] = signals.default_int_handler
                signals.signal(signals.SIGINT, interrupted)
            for name in ("SIGTERM", "SIGHUP"):
                number = getattr(signals, name, None)
                # one ignored stays so (nohup, a shell's trap '' HUP): its user asked for that
                previous = signals.getsignal(number) if number is not None else signals.SIG_IGN
                if previous is not signals.SIG_IGN:
                    handlers[number] = previous
                    signals.signal(number, terminated)
        _check_modes(args)
        if args.list_sessions:
            code = _print_sessions(_sessions_home(args.session_dir, os.environ), term,
                                   as_json=args.json)
        else:
            cli = _Cli(args, os.environ, term, interrupts)
            code = _run_cli(cli)
    except _Quit as quit:
        if isinstance(quit, _StdoutFailed):
            term.error(quit.args[1])
        if isinstance(quit, (_StdoutClosed, _StdoutFailed)):
            _quiet_stdout()
        code = quit.args[0]
    except (_UsageError, SessionNotFound) as exc:
        term.error(str(exc))
        code = _EXIT_USAGE
    except KeyboardInterrupt:
        code = interrupts.exit_code
    except Exception as exc:
        refusal = _schema_refusal(exc)
        if refusal is not None:  # a batch's: refused before any call
            term.error(str(refusal))
            code = _EXIT_USAGE
        else:
            logger.debug("the run failed", exc_info=True)
            term.error(_describe_error(exc))
            code = _EXIT_ERROR
    finally:
        interrupts.noting = True  # leaving: a signal now only sets the code (SIGTERM, SIGHUP)
        if cli is not None:
            cli.close()
        term.stop_spinner()
        if shells_modes and shells_modes[0] is not None and _in_the_background(0):
            _set_terminal_modes(0, shells_modes[0])  # over readline's, set as it left the prompt
        for number, previous in handlers.items():  # None: a handler Python did not install
            signals.signal(number, previous if previous is not None else signals.SIG_DFL)
        if was_dumpable:
            _set_dumpable(True)
        logger.removeHandler(handler)
        logger.setLevel(previous_level)
        if otel_logger is not None:
            otel_logger.removeHandler(handler)
    # a SIGTERM or SIGHUP while lich closed what it started (after a Ctrl-C, say) is its end
    return interrupts.exit_code if interrupts.terminating else code


def _quiet_stdout():
    """After a closed stdout: send what is left to /dev/null, so that nothing complains at exit."""
    try:
        fd = sys.stdout.fileno()
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, fd)
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass


def _check_modes(args):
    """Options that another of them contradicts, or that nothing given would use."""
    if args.batch is not None and (args.prompt is not None or args.interactive or args.resume
                                   or args.continue_):
        raise _UsageError("--batch runs the tasks of its file: it takes no PROMPT, -i, --resume "
                          "or -c")
    if args.batch is None and (args.out is not None or args.redo or args.workers is not None):
        raise _UsageError("--out, --redo and --workers go with --batch")
    if args.batch is not None and (args.json or args.label is not None):
        raise _UsageError("--batch writes JSON lines and names each task's session by its id: "
                          "it takes no --json or --label")
    if args.out is not None and os.path.isdir(args.out):
        raise _UsageError(f"--out is a folder: {args.out}")
    if args.list_sessions and (args.prompt is not None or args.interactive or args.resume
                               or args.continue_ or args.batch is not None):
        raise _UsageError("--list-sessions lists the sessions: it takes no PROMPT, -i, --resume, "
                          "-c or --batch")
    if args.resume is not None and args.continue_:
        raise _UsageError("--resume and -c both choose the session to go on with: give one")
    if args.label is not None and (args.no_session or args.list_sessions):
        raise _UsageError("--label names the session a run records: --no-session and "
                          "--list-sessions record none")
    if args.interactive and not _isatty(sys.stdin):
        raise _UsageError("-i is a chat, which reads a terminal: stdin is not one (leave -i out "
                          "to answer once)")
    if (args.json and args.prompt is None and _isatty(sys.stdin) and args.batch is None
            and not args.list_sessions):
        raise _UsageError("--json needs a PROMPT or piped stdin")


def _run_cli(cli) -> int:
    args = cli.args
    if args.batch is not None:
        return cli.batch()
    history = []
    if args.resume is not None or args.continue_:
        history = cli.load_session("latest" if args.resume is None else args.resume,
                                   folder=args.resume is None)
    if cli.interactive:
        return cli.repl(history, first=args.prompt)
    piped = None
    if not _isatty(sys.stdin):  # a stdin that never ends (ssh without -n) is said to be waited for
        piped = _read_piped(functools.partial(cli.term.note, _STDIN_WAIT_NOTE)
                            if _isatty(sys.stderr) else None)
    return cli.one_shot(_prompt_with_stdin(args.prompt, piped), history)


if __name__ == "__main__":
    _exit_code = main()
    import signal as _signals

    _ENDING = [getattr(_signals, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(_signals, name)]
    if _exit_code in {128 + number for number in _ENDING[1:]}:
        # After SIGTERM or SIGHUP, whose code lich leaves with, another (a closing terminal
        # sends two) or a Ctrl-C changes nothing as Python shuts down
        for _number in _ENDING:
            _signals.signal(_number, _signals.SIG_IGN)
    elif _SIGINT_KILLS_AS_IT_LOADS:  # and as it ends: Python's shutdown has no word for one either
        _signals.signal(_signals.SIGINT, _signals.SIG_DFL)
    sys.exit(_exit_code)
