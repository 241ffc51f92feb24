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

from __future__ import annotations

import json
import logging
import os
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, TypedDict, runtime_checkable

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
    tool_calls: list[ToolCall]
    tool_call_id: str
    name: str
    is_error: bool


class ToolSpec(TypedDict):
    """A tool offered to the model; ``parameters`` is a JSON Schema object."""

    name: str
    description: str
    parameters: dict[str, Any]


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

KEEP_RECENT_TURNS = 8
TRANSCRIPT_MAX_CHARS = 24_000
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


def _tool_calls_json(tool_calls) -> str:
    return json.dumps(tool_calls, separators=(",", ":"), ensure_ascii=False)


def _estimate_message_tokens(message) -> int:
    tokens = estimate_text_tokens(message.get("content") or "")
    role = message.get("role")
    if role == "assistant":
        tool_calls = message.get("tool_calls")
        if tool_calls:
            tokens += estimate_text_tokens(_tool_calls_json(tool_calls))
    elif role == "tool":
        tokens += _TOOL_MESSAGE_OVERHEAD_TOKENS
    return tokens


def estimate_messages_tokens(messages) -> int:
    """The estimate of a whole history: contents, assistant tool calls, 8 per tool message."""
    if isinstance(messages, _History):
        return messages.estimated_tokens()
    return sum(map(_estimate_message_tokens, messages))


class _History(list):
    """The loop's working history: a list that keeps its token estimate up to date.

    The loop only appends to it or rewrites it wholesale (compression), so appends add
    to a running total and any other change drops the total until it is next needed.
    Messages are values: a message changed in place after it was added is not re-counted.
    """

    __slots__ = ("_tokens",)

    def __init__(self, messages=()):
        super().__init__(messages)
        self._tokens = None

    def estimated_tokens(self) -> int:
        if self._tokens is None:
            self._tokens = sum(map(_estimate_message_tokens, self))
        return self._tokens

    def append(self, message):
        super().append(message)
        if self._tokens is not None:
            self._tokens += _estimate_message_tokens(message)

    def extend(self, messages):
        messages = list(messages)
        super().extend(messages)
        if self._tokens is not None:
            self._tokens += sum(map(_estimate_message_tokens, messages))

    def _changed(name):
        method = getattr(list, name)

        def changed(self, *args):
            self._tokens = None
            return method(self, *args)

        changed.__name__ = name
        return changed

    for _name in ("__setitem__", "__delitem__", "__iadd__", "__imul__", "insert", "pop",
                  "remove", "clear", "sort", "reverse"):
        locals()[_name] = _changed(_name)
    del _name, _changed

    def __reduce__(self):
        return (list, (list(self),))


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


def _transcript(messages) -> str:
    lines = []
    for message in messages:
        line = f"[{message.get('role')}] {message.get('content') or ''}"
        if message.get("tool_calls"):
            line += " tool_calls=" + _tool_calls_json(message["tool_calls"])
        lines.append(line)
    return "\n".join(lines)[:TRANSCRIPT_MAX_CHARS]


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
        summary = chat(request, tools=None, signal=signal).message.get("content") or ""
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
    compressed, summary_chars = compress_messages(chat, history, signal=signal)
    if compressed is not history:
        history[:] = compressed
    _emit(emitter, {"type": "compress_end", "summary_chars": summary_chars})
    return summary_chars


def _emit(emitter, event):
    if emitter is not None:
        emitter.emit(event)


# ============================================================================
# The loop
# ============================================================================

_ABORT_MESSAGE = "agent loop aborted"
_NO_TOOLS_ERROR = "no tools are available; answer without calling tools"


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


def call_chat(chat, history, *, turn, tools=None, temperature=None, max_tokens=None,
              signal=None, emitter=None) -> ChatResult:
    """One chat call framed by ``llm_start`` and ``llm_end``; a failure emits ``error`` and re-raises."""
    _emit(emitter, {"type": "llm_start", "turn": turn})
    try:
        result = chat(history, tools=tools, temperature=temperature, max_tokens=max_tokens,
                      signal=signal)
    except Exception as exc:
        _log.debug("chat call failed on turn %d", turn, exc_info=True)
        _emit(emitter, {"type": "error", "error": exc})
        raise
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
        result = tools.run(call, signal)
    except Exception as exc:
        _log.debug("tool runner raised on %r", call.get("name"), exc_info=True)
        return ToolResult(ok=False, error=f"{type(exc).__name__}: {exc}")
    if not isinstance(result, ToolResult):
        return ToolResult(ok=False, error=f"TypeError: the tool runner returned "
                                          f"{type(result).__name__}, not a ToolResult")
    return result


def _skip_tool_call(call, history, *, turn, error, emitter):
    result = ToolResult(ok=False, error=error)
    history.append(tool_message_from_result(call, result))
    _emit(emitter, {"type": "tool_call_end", "turn": turn, "call": call, "result": result,
                    "cancelled": True})


def run_tool_calls(tools, calls, history, *, turn, signal=None, emitter=None) -> None:
    """Run ``calls`` one after another, appending one tool message per call to ``history``.

    A call not yet started when ``signal`` is set is skipped: its tool message says
    "aborted" and its ``tool_call_end`` is ``cancelled`` with no ``tool_call_start``.
    """
    for call in calls:
        if signal is not None and signal.is_set():
            _skip_tool_call(call, history, turn=turn, error="aborted", emitter=emitter)
            continue
        _emit(emitter, {"type": "tool_call_start", "turn": turn, "call": call})
        result = _run_one_tool(tools, call, signal)
        history.append(tool_message_from_result(call, result))
        _emit(emitter, {"type": "tool_call_end", "turn": turn, "call": call, "result": result,
                        "cancelled": False})


def _check_max_turns(max_turns):
    if isinstance(max_turns, bool) or not isinstance(max_turns, int):
        raise TypeError(f"max_turns must be an int >= 1, not {type(max_turns).__name__}")
    if max_turns < 1:
        raise ValueError(f"max_turns must be an int >= 1, not {max_turns}")


def run_conversation(chat, tools, messages, *, max_turns, system_prompt=None, temperature=None,
                     max_tokens=None, context_budget_tokens=None, compress_threshold=0.8,
                     signal=None, emitter=None) -> LoopOutcome:
    """Drive ``chat`` and ``tools`` until the model answers without tool calls.

    Each turn makes exactly one chat call: ``max_turns`` is a budget of chat calls, not
    of tools. A turn whose assistant message has no tool calls is the final answer
    (``stopped_reason="final"``). A signal set before a turn stops the run
    (``"aborted"``, after an ``error`` event carrying AbortError). Tool calls asked for
    on the last allowed turn are not run (``"budget"``). A chat failure emits ``error``
    and propagates; a tool failure is a tool message the model reads.

    ``messages`` is not changed; the outcome's ``messages`` is the working history,
    after compression when ``context_budget_tokens`` is set.
    """
    _check_max_turns(max_turns)
    history = _History(seed_system_prompt(messages, system_prompt))
    specs = (tools.specs() or None) if tools is not None else None
    result = None
    for turn in range(1, max_turns + 1):
        _emit(emitter, {"type": "turn_start", "turn": turn})
        if signal is not None and signal.is_set():
            _emit(emitter, {"type": "error", "error": AbortError(_ABORT_MESSAGE)})
            return LoopOutcome(history, None, None, turn - 1, "aborted")
        compress_if_needed(chat, history, context_budget_tokens=context_budget_tokens,
                           compress_threshold=compress_threshold, signal=signal, emitter=emitter)
        result = call_chat(chat, history, turn=turn, tools=specs, temperature=temperature,
                           max_tokens=max_tokens, signal=signal, emitter=emitter)
        message = result.message
        history.append(message)
        calls = message.get("tool_calls")
        if not calls:
            _emit(emitter, {"type": "final", "message": message, "result": result})
            _emit(emitter, {"type": "turn_end", "turn": turn})
            return LoopOutcome(history, message, result, turn, "final")
        if turn == max_turns:
            for call in calls:
                _skip_tool_call(call, history, turn=turn, error="turn_budget_exhausted",
                                emitter=emitter)
            break
        run_tool_calls(tools, calls, history, turn=turn, signal=signal, emitter=emitter)
    _emit(emitter, {"type": "budget_exhausted", "turns_used": max_turns})
    _emit(emitter, {"type": "turn_end", "turn": max_turns})
    return LoopOutcome(history, None, result, max_turns, "budget")


# ============================================================================
# Sessions
# ============================================================================

SESSION_SUFFIX = ".jsonl"
_MESSAGE_ROLES = frozenset({"system", "user", "assistant", "tool"})
_LABEL_MAX_CHARS = 64
_SESSION_NAME_ATTEMPTS = 1000
_last_second_stamp = (None, "")  # (whole second, its "YYYY-MM-DDTHH:MM:SS" text), shared by threads


def _record_timestamp() -> str:
    global _last_second_stamp
    now = time.time()
    second = int(now)
    cached_second, prefix = _last_second_stamp
    if cached_second != second:
        prefix = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        _last_second_stamp = (second, prefix)
    return f"{prefix}.{int((now - second) * 1000):03d}Z"


def _record_line(kind: str, value) -> bytes:
    record = {"ts": _record_timestamp(), "kind": kind, kind: value}
    try:
        return (json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n").encode()
    except UnicodeEncodeError:  # a lone surrogate: fall back to \\u escapes
        return (json.dumps(record, separators=(",", ":")) + "\n").encode()


class SessionHandle:
    """An open session file: JSONL records appended whole, one line per call, thread-safe.

    Each append is written with one ``os.write`` on an ``O_APPEND`` descriptor and is in
    the file when the call returns. A write that fails part-way is cut back, so the file
    holds whole lines only; the OSError goes to the caller.
    """

    def __init__(self, path: str, fd: int):
        self.path = path
        self.id = os.path.basename(path)[:-len(SESSION_SUFFIX)]
        self._fd = fd
        self._size = os.fstat(fd).st_size
        self._torn = False  # a failed write could not be cut back: start the next on a new line
        self._lock = threading.Lock()
        self._history_recorded = False  # run_agent has written a seeded history here

    def append_message(self, message: dict) -> None:
        """Append a ``{"kind": "message"}`` record."""
        self._append(_record_line("message", message))

    def append_meta(self, meta: dict) -> None:
        """Append a ``{"kind": "meta"}`` record."""
        self._append(_record_line("meta", meta))

    def close(self) -> None:
        """Close the file; appending afterwards raises ValueError."""
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()

    def __repr__(self):
        return f"SessionHandle(id={self.id!r})"

    def _append(self, line: bytes) -> None:
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
                if written:
                    try:
                        os.ftruncate(self._fd, self._size)
                    except OSError:
                        self._torn = True
                raise
            self._size += written
            self._torn = False


def _clean_label(label) -> str:
    cleaned = re.sub(r"[^A-Za-z0-9_.-]+", "-", str(label or ""))
    cleaned = re.sub(r"\.{2,}", ".", cleaned)
    return cleaned.strip("-.")[:_LABEL_MAX_CHARS].rstrip("-.")


def _session_stems(session_dir: str, stamp: str) -> list:
    """The ``<stamp>-<counter>`` parts of the session names that use ``stamp``."""
    pattern = re.compile(re.escape(stamp) + r"-(\d+)(?:-[^/]*)?" + re.escape(SESSION_SUFFIX))
    stems = []
    for name in os.listdir(session_dir):
        match = pattern.fullmatch(name)
        if match:
            stems.append(int(match.group(1)))
    return stems


def open_session(session_dir, label=None) -> SessionHandle:
    """Create ``<session_dir>/<UTC timestamp>-<counter>[-<label>].jsonl`` and open it.

    The directory is created with mode 0700; the file is created exclusively, so two
    processes never share one: the counter moves on instead, across labels too.
    """
    session_dir = os.fspath(session_dir)
    os.makedirs(session_dir, mode=0o700, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    label = _clean_label(label)
    suffix = (f"-{label}" if label else "") + SESSION_SUFFIX
    counter = max(_session_stems(session_dir, stamp), default=0) + 1
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | getattr(os, "O_CLOEXEC", 0)
    for _ in range(_SESSION_NAME_ATTEMPTS):
        path = os.path.join(session_dir, f"{stamp}-{counter}{suffix}")
        try:
            fd = os.open(path, flags, 0o600)
        except FileExistsError:
            counter += 1
            continue
        # Another process may have taken this counter under another label meanwhile:
        # whoever sees a second claim steps aside, so two never both keep one.
        if _session_stems(session_dir, stamp).count(counter) == 1:
            return SessionHandle(path, fd)
        os.close(fd)
        os.unlink(path)
        counter += 1
    raise FileExistsError(f"no free session name for {stamp} after {_SESSION_NAME_ATTEMPTS} tries")


@dataclass
class AgentRunResult(LoopOutcome):
    """A ``LoopOutcome`` plus where the run was recorded and what it cost."""

    session_path: Optional[str] = None
    usage_total: dict = field(default_factory=_zero_usage)


def _add_usage(total: dict, usage) -> None:
    for key, value in (usage or {}).items():
        if isinstance(value, int) and not isinstance(value, bool):
            total[key] = total.get(key, 0) + value


class _Recorder:
    """Turns one run's events into session records and sums its usage.

    Best effort: the first failing write logs one warning and stops the recording;
    the run goes on.
    """

    def __init__(self, handle: Optional[SessionHandle]):
        self.handle = handle
        self.usage = _zero_usage()

    def message(self, message: dict) -> None:
        self._write(SessionHandle.append_message, message)

    def meta(self, meta: dict) -> None:
        self._write(SessionHandle.append_meta, meta)

    def on_event(self, event: dict) -> None:
        kind = event["type"]
        if kind == "llm_end":
            result = event["result"]
            _add_usage(self.usage, result.usage)
            self.message(result.message)
        elif kind == "tool_call_end":
            self.message(tool_message_from_result(event["call"], event["result"]))
        elif kind == "budget_exhausted":
            self.meta({"event": "budget_exhausted", "turns_used": event["turns_used"]})
        elif kind == "compress_end":
            self.meta({"event": "compress", "summary_chars": event["summary_chars"]})

    def _write(self, append, record) -> None:
        if self.handle is None:
            return
        try:
            append(self.handle, record)
        except Exception as exc:
            _log.warning("session recording stopped: %s: %s: %s", self.handle.id,
                         type(exc).__name__, exc)
            self.handle = None


def _seeding_additions(previous: list, seeded: list) -> list:
    """What seeding added to ``previous``: the new user message and a new or changed system one."""
    added = [seeded[-1]]
    old_system = next((m for m in previous if m.get("role") == "system"), None)
    new_system = next((m for m in seeded if m.get("role") == "system"), None)
    if new_system is not None and new_system is not old_system:
        added.insert(0, new_system)
    return added


def run_agent(prompt, *, chat, tools=None, history=None, session=None, session_dir=None,
              label=None, emitter=None, **loop_params) -> AgentRunResult:
    """Run one user turn, ``history`` + ``prompt``, through ``run_conversation`` and record it.

    ``loop_params`` are ``run_conversation``'s (``max_turns`` is required). With
    ``session`` (a SessionHandle) the run is recorded there; else with ``session_dir``
    into a new session file; with neither, nowhere. A session file holds, in order:
    ``run_start``, the seeded messages, each assistant and tool message as it happens,
    ``budget_exhausted`` / ``compress`` markers, and ``run_end`` with the run's summed
    usage -- or ``run_error`` before the exception propagates. A handle that run_agent
    already wrote to in this process gets only what seeding added (pass the previous
    run's ``messages`` as ``history``). Recording never fails the run: the first write
    error logs a warning and recording stops.
    """
    if "max_turns" not in loop_params:
        raise TypeError("run_agent() missing required keyword argument: 'max_turns'")
    _check_max_turns(loop_params["max_turns"])
    previous = list(history or ())
    seeded = seed_system_prompt(previous + [{"role": "user", "content": prompt}],
                                loop_params.pop("system_prompt", None))
    handle, owned = session, False
    if handle is None and session_dir is not None:
        try:
            handle, owned = open_session(session_dir, label), True
        except OSError as exc:
            _log.warning("session recording is off: cannot create a session file: %s: %s",
                         type(exc).__name__, exc)
    recorder = _Recorder(handle)
    try:
        if handle is not None:
            recorder.meta({"event": "run_start", "input_chars": len(prompt),
                           "history_size": len(previous)})
            fresh = owned or not handle._history_recorded
            for message in seeded if fresh else _seeding_additions(previous, seeded):
                recorder.message(message)
            handle._history_recorded = True
        emitter = emitter if emitter is not None else AgentEmitter()
        unsubscribe = emitter.on_any(recorder.on_event)
        try:
            outcome = run_conversation(chat, tools, seeded, emitter=emitter, **loop_params)
        except BaseException as exc:
            recorder.meta({"event": "run_error", "error": f"{type(exc).__name__}: {exc}"})
            raise
        finally:
            unsubscribe()
        recorder.meta({"event": "run_end", "stopped_reason": outcome.stopped_reason,
                       "usage": recorder.usage})
    finally:
        if owned:
            handle.close()
    return AgentRunResult(outcome.messages, outcome.final, outcome.result, outcome.turns_used,
                          outcome.stopped_reason,
                          session_path=handle.path if handle is not None else None,
                          usage_total=recorder.usage)


def _clean_message(message) -> Optional[dict]:
    """``message`` if it has a shape a provider accepts (a None content becomes ""), else None."""
    if not isinstance(message, dict) or message.get("role") not in _MESSAGE_ROLES:
        return None
    content = message.get("content")
    if not isinstance(content, str):
        if content is not None:
            return None
        message = {**message, "content": ""}
    role = message["role"]
    if role == "tool":
        return message if isinstance(message.get("tool_call_id"), str) else None
    if role == "assistant" and message.get("tool_calls") is not None:
        calls = message["tool_calls"]
        if not isinstance(calls, list) or not all(_is_tool_call(c) for c in calls):
            return None
    return message


def _is_tool_call(call) -> bool:
    return (isinstance(call, dict) and isinstance(call.get("id"), str)
            and isinstance(call.get("name"), str) and isinstance(call.get("arguments"), str))


def _interrupted_tool_message(call: dict) -> dict:
    return tool_message_from_result(call, ToolResult(ok=False, error="interrupted"))


def _repair_history(messages: list) -> list:
    """Pair every tool call with exactly one tool message and drop trailing user messages.

    A tool message is kept only when it follows (with only tool messages between) the
    assistant message that asked for it; a call left unanswered gets an "interrupted"
    tool message after the answers that were recorded.
    """
    repaired = []
    pending = []  # [call, answered] of the last assistant's calls, while tool messages follow

    def close_pending():
        repaired.extend(_interrupted_tool_message(call) for call, answered in pending
                        if not answered)
        pending.clear()

    for message in messages:
        role = message["role"]
        if role == "tool":
            for entry in pending:
                if not entry[1] and entry[0]["id"] == message["tool_call_id"]:
                    entry[1] = True
                    repaired.append(message)
                    break
            continue
        close_pending()
        repaired.append(message)
        if role == "assistant" and message.get("tool_calls"):
            pending.extend([call, False] for call in message["tool_calls"])
    close_pending()
    while repaired and repaired[-1]["role"] == "user":
        repaired.pop()
    return repaired


def read_session_messages(path) -> list:
    """The conversation recorded in a session file, as a history a provider accepts.

    Lenient: lines that are not JSON, records of other kinds and messages of unknown
    roles or shapes are skipped. Trailing user messages (a run that failed before its
    answer) are dropped and interrupted tool calls are closed (see ``_repair_history``),
    so reading a file written from the result gives the same list. A missing file
    raises FileNotFoundError.
    """
    messages = []
    with open(path, "rb") as lines:
        for line in lines:
            try:
                record = json.loads(line)
            except (ValueError, RecursionError):
                continue
            if type(record) is dict and record.get("kind") == "message":
                message = _clean_message(record.get("message"))
                if message is not None:
                    messages.append(message)
    return _repair_history(messages)


def resolve_session(session_dir, ref) -> str:
    """The path of the session ``ref`` names: "latest", an exact id, or a unique id prefix.

    Raises SessionNotFound, whose message echoes ``ref`` but never the directory.
    """
    if (not isinstance(ref, str) or not ref or "/" in ref or os.sep in ref or "\\" in ref
            or ".." in ref or "\0" in ref):
        raise SessionNotFound(f"session not found: {ref}")
    session_dir = os.fspath(session_dir)
    try:
        with os.scandir(session_dir) as entries:
            sessions = [e for e in entries if e.name.endswith(SESSION_SUFFIX) and e.is_file()]
    except OSError:
        sessions = []
    if ref == "latest":
        if not sessions:
            raise SessionNotFound(f"session not found: {ref}")
        newest = max(sessions, key=lambda e: (e.stat().st_mtime_ns, e.name))
        return os.path.join(session_dir, newest.name)
    names = [e.name for e in sessions]
    if ref + SESSION_SUFFIX in names:
        return os.path.join(session_dir, ref + SESSION_SUFFIX)
    matches = [name for name in names if name.startswith(ref)]
    if len(matches) == 1:
        return os.path.join(session_dir, matches[0])
    if matches:
        raise SessionNotFound(f"ambiguous session id: {ref}")
    raise SessionNotFound(f"session not found: {ref}")


# ============================================================================
# Providers
# ============================================================================


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
