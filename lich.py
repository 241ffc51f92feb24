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
    # tools
    "Tools", "coding_tools", "DEFAULT_MAX_OUTPUT_CHARS",
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

DEFAULT_MAX_OUTPUT_CHARS = 50_000
_TOOL_NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,64}\Z")
_ECHO_MAX_CHARS = 80  # how much of a rejected value an error message quotes
_ARGS_HEADERS = ("args:", "arguments:", "parameters:", "params:", "keyword args:",
                 "keyword arguments:")
_DOC_SECTIONS = _ARGS_HEADERS + ("returns:", "return:", "yields:", "raises:", "example:",
                                 "examples:", "note:", "notes:", "see also:")
_ARG_DOC_RE = re.compile(r"\*{0,2}([A-Za-z_]\w*)\s*(?:\([^)]*\))?\s*:\s*(.*)\Z")


class _ToolFailure(Exception):
    """A refusal of a tool: its message is the ``error`` the model sees."""


class _ArgError(Exception):
    """An argument value that does not fit its parameter's type."""

    def __init__(self, expected, got):
        super().__init__(expected)
        self.expected = expected
        self.got = got
        self.path = []  # "[2]", '["key"]' ... from the argument down to the bad value


def _json_kind(value):
    """The JSON type of a decoded value, as a phrase for error messages."""
    if isinstance(value, str):
        return "a string"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    if value is None:
        return "null"
    return f"a {type(value).__name__}"


def _echo(value):
    """A value as JSON, cut to ``_ECHO_MAX_CHARS``, to quote in an error message."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError):
        text = repr(value)
    return text if len(text) <= _ECHO_MAX_CHARS else text[:_ECHO_MAX_CHARS] + "..."


def _accept_any(value):
    return value


def _to_str(value):
    if isinstance(value, str):
        return value
    raise _ArgError("a string", _json_kind(value))


def _to_int(value):
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise _ArgError("an integer", _json_kind(value))


def _to_float(value):
    if isinstance(value, float):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    raise _ArgError("a number", _json_kind(value))


def _to_bool(value):
    if isinstance(value, bool):
        return value
    raise _ArgError("a boolean", _json_kind(value))


def _list_of(item):
    """A converter for a JSON array whose items go through ``item``."""
    def convert(value):
        if not isinstance(value, list):
            raise _ArgError("an array", _json_kind(value))
        if item is _accept_any:
            return value
        out = []
        for i, each in enumerate(value):
            try:
                out.append(item(each))
            except _ArgError as e:
                e.path.insert(0, f"[{i}]")
                raise
        return out
    return convert


def _dict_of(item):
    """A converter for a JSON object whose values go through ``item``."""
    def convert(value):
        if not isinstance(value, dict):
            raise _ArgError("an object", _json_kind(value))
        if item is _accept_any:
            return value
        out = {}
        for key, each in value.items():
            try:
                out[key] = item(each)
            except _ArgError as e:
                e.path.insert(0, f"[{json.dumps(key, ensure_ascii=False)}]")
                raise
        return out
    return convert


def _one_of(values):
    """A converter accepting exactly the ``Literal`` values (``True`` is not ``1``)."""
    expected = "one of " + ", ".join(json.dumps(v) for v in values)

    def convert(value):
        for allowed in values:
            if value == allowed and type(value) is type(allowed):
                return value
        raise _ArgError(expected, _echo(value))
    return convert


def _nullable(inner):
    """A converter accepting ``null`` or what ``inner`` accepts."""
    def convert(value):
        if value is None:
            return None
        try:
            return inner(value)
        except _ArgError as e:
            if not e.path:
                e.expected += " or null"
            raise
    return convert


def _nullable_schema(schema):
    """``schema`` widened to admit ``null``."""
    if not schema:
        return schema
    out = dict(schema)
    kind = out.get("type")
    if isinstance(kind, str):
        out["type"] = [kind, "null"]
    elif isinstance(kind, list) and "null" not in kind:
        out["type"] = kind + ["null"]
    if "enum" in out and None not in out["enum"]:
        out["enum"] = out["enum"] + [None]
    return out


_SIMPLE_HINTS = {str: ("string", _to_str), int: ("integer", _to_int),
                 float: ("number", _to_float), bool: ("boolean", _to_bool)}
_LITERAL_KINDS = {str: "string", int: "integer", bool: "boolean", type(None): "null"}
_NO_HINT = object()


def _hint_schema(hint):
    """(JSON Schema, converter) for a type hint, or None when JSON Schema cannot express it."""
    import types
    import typing
    if hint is _NO_HINT or hint is Any:
        return {}, _accept_any
    try:
        simple = _SIMPLE_HINTS.get(hint)
    except TypeError:  # an unhashable hint
        simple = None
    if simple is not None:
        return {"type": simple[0]}, simple[1]
    origin = typing.get_origin(hint) or hint
    args = typing.get_args(hint)
    if origin is list:
        item = _hint_schema(args[0]) if args else ({}, _accept_any)
        if item is None:
            return None
        schema = {"type": "array"}
        if item[0]:
            schema["items"] = item[0]
        return schema, _list_of(item[1])
    if origin is dict:
        if args and args[0] is not str:
            return None  # JSON object keys are strings
        value = _hint_schema(args[1]) if args else ({}, _accept_any)
        if value is None:
            return None
        schema = {"type": "object"}
        if value[0]:
            schema["additionalProperties"] = value[0]
        return schema, _dict_of(value[1])
    if origin is typing.Union or origin is getattr(types, "UnionType", None):
        rest = [a for a in args if a is not type(None)]
        if len(rest) != 1 or len(args) != 2:
            return None  # only Optional[X]: a model cannot tell other unions apart reliably
        inner = _hint_schema(rest[0])
        if inner is None:
            return None
        return _nullable_schema(inner[0]), _nullable(inner[1])
    if origin is typing.Literal:
        kinds = []
        for value in args:
            kind = _LITERAL_KINDS.get(type(value))
            if kind is None:
                return None
            if kind not in kinds:
                kinds.append(kind)
        schema = {"type": kinds[0] if len(kinds) == 1 else kinds, "enum": list(args)}
        return schema, _one_of(args)
    return None


def _admits_null(schema):
    """Whether a schema made by ``_hint_schema`` accepts ``null``."""
    kind = schema.get("type")
    return not schema or kind == "null" or (isinstance(kind, list) and "null" in kind)


def _is_event_hint(hint):
    """Whether ``hint`` is ``threading.Event`` or ``Optional[threading.Event]``."""
    import typing
    if typing.get_origin(hint) is not None:
        rest = [a for a in typing.get_args(hint) if a is not type(None)]
        return len(rest) == 1 and _is_event_hint(rest[0])
    return isinstance(hint, type) and issubclass(hint, threading.Event)


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
        if stripped.lower() in _DOC_SECTIONS:
            break
        paragraph.append(stripped)
    described = {}
    start = next((i for i, line in enumerate(lines) if line.strip().lower() in _ARGS_HEADERS),
                 None)
    if start is not None:
        header_indent = len(lines[start]) - len(lines[start].lstrip())
        entry_indent = None
        current = None
        for line in lines[start + 1:]:
            stripped = line.strip()
            if not stripped:
                continue
            indent = len(line) - len(line.lstrip())
            if indent <= header_indent:
                break  # the next section
            if entry_indent is None:
                entry_indent = indent
            match = _ARG_DOC_RE.match(stripped) if indent <= entry_indent else None
            if match:
                current = described[match.group(1)] = [match.group(2)] if match.group(2) else []
            elif current is not None:
                current.append(stripped)
    return " ".join(paragraph), {name: " ".join(words) for name, words in described.items()}


def _type_hints(fn, fn_name):
    """The resolved type hints of ``fn``; a hint that cannot be resolved is a TypeError."""
    import inspect
    import typing
    if inspect.isfunction(fn) or inspect.ismethod(fn):
        target = fn
    elif inspect.isclass(fn):
        target = fn.__init__
    else:
        target = type(fn).__call__
    try:
        return typing.get_type_hints(target)
    except NameError as e:
        raise TypeError(f"cannot register {fn_name}: a type hint cannot be resolved: {e}") from e
    except TypeError:
        return {}  # not a plain function (a functools.partial...): the signature's hints stand


def _truncate(text, limit):
    """``text`` cut to its head and tail, ``limit`` characters in all, around a marker."""
    if len(text) <= limit:
        return text
    tail = limit // 2
    head = limit - tail
    omitted = len(text) - limit
    return f"{text[:head]}\n[... {omitted} characters omitted ...]\n{text[len(text) - tail:]}"


class _Tool:
    """One registered function, with what ``run`` needs precomputed."""

    __slots__ = ("call_param", "converters", "fn", "name", "required", "signal_param", "spec")

    def __init__(self, name, fn, spec, converters, required, signal_param, call_param):
        self.name = name
        self.fn = fn
        self.spec = spec
        self.converters = converters
        self.required = required
        self.signal_param = signal_param
        self.call_param = call_param

    def arguments(self, raw):
        """The keyword arguments of a call from the model's raw JSON text; _ToolFailure if unfit."""
        if isinstance(raw, str):
            if raw.strip():
                try:
                    args = json.loads(raw)
                except (ValueError, RecursionError) as e:
                    raise _ToolFailure(f"the arguments of {self.name} are not valid JSON ({e}); "
                                       f"send one JSON object") from None
            else:
                args = {}
        elif raw is None:
            args = {}
        else:
            args = raw
        if not isinstance(args, dict):
            raise _ToolFailure(f"the arguments of {self.name} must be a JSON object, "
                               f"not {_json_kind(args)}")
        converters = self.converters
        kwargs = {}
        unknown = []
        problems = []
        for key, value in args.items():
            convert = converters.get(key)
            if convert is None:
                unknown.append(key)
                continue
            try:
                kwargs[key] = convert(value)
            except _ArgError as e:
                problems.append(f"argument '{key}{''.join(e.path)}' must be {e.expected}, "
                                f"not {e.got}")
        missing = [name for name in self.required if name not in args]
        if not (unknown or missing or problems):
            return kwargs
        found = []
        if unknown:
            takes = ", ".join(converters) if converters else "no arguments"
            found.append(f"unknown {_plural('argument', unknown)} ({self.name} takes {takes})")
        if missing:
            found.append(f"missing required {_plural('argument', missing)}")
        raise _ToolFailure(f"invalid arguments for {self.name}: " + "; ".join(found + problems))


def _plural(word, names):
    """``argument 'a'`` or ``arguments 'a', 'b'``."""
    quoted = ", ".join(f"'{name}'" for name in names)
    return f"{word} {quoted}" if len(names) == 1 else f"{word}s {quoted}"


class Tools:
    """A ToolRunner over plain Python functions.

    Register a function with ``@tools.tool`` (or ``tools.tool(name=..., description=...)``, or
    ``tools.register(fn)``): its JSON Schema comes from its type hints -- ``str``, ``int``,
    ``float``, ``bool``, ``list[X]``, ``dict`` / ``Dict[str, X]``, ``Optional[X]``,
    ``Literal[...]``; a parameter without a hint (or ``Any``) accepts any JSON value -- and
    its docstring: the first paragraph describes the tool, a Google-style ``Args:`` section
    the parameters. A parameter with a default is optional. A parameter annotated
    ``threading.Event`` is not offered to the model: it receives the loop's signal (a fresh,
    unset Event when the loop has none). ``run`` never raises: bad calls and exceptions
    become failed ToolResults, and output over ``max_output_chars`` keeps its head and tail.
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
        self._register(fn, name, description)
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
            kwargs = tool.arguments(call.get("arguments"))
            if tool.signal_param is not None:
                kwargs[tool.signal_param] = signal if signal is not None else threading.Event()
            if tool.call_param is not None:
                kwargs[tool.call_param] = call
            value = tool.fn(**kwargs)
            if isinstance(value, str):
                return ToolResult(ok=True, output=self._limit(value))
            if value is None:
                return ToolResult(ok=True)
            if isinstance(value, ToolResult):
                return self._passed(value)
            try:
                text = json.dumps(value, ensure_ascii=False)
            except (TypeError, ValueError, RecursionError):
                text = repr(value)
            return ToolResult(ok=True, output=self._limit(text))
        except _ToolFailure as e:
            return ToolResult(ok=False, error=self._limit(str(e)))
        except (Exception, SystemExit) as e:  # run never raises
            _log.debug("tool call %r raised", call, exc_info=True)
            return ToolResult(ok=False, error=self._limit(f"{type(e).__name__}: {e}"))

    def _register(self, fn, name, description, call_param=None):
        """Register ``fn``; ``call_param`` names a parameter that receives the call itself."""
        import inspect
        if not callable(fn):
            raise TypeError(f"a tool must be callable, not {fn!r}")
        if name is None:
            name = getattr(fn, "__name__", None)
        if not isinstance(name, str) or not _TOOL_NAME_RE.match(name):
            raise ValueError(f"invalid tool name {name!r}: use 1 to 64 letters, digits, '_' or '-'")
        if name in self._tools:
            raise ValueError(f"a tool named {name!r} is already registered")
        try:
            signature = inspect.signature(fn)
        except (TypeError, ValueError) as e:
            raise TypeError(f"cannot register {name}: {e}") from e
        hints = _type_hints(fn, name)
        doc_description, arg_docs = _parse_docstring(inspect.getdoc(fn))
        properties, converters, required = {}, {}, []
        signal_param = None
        for param in signature.parameters.values():
            if param.kind not in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY):
                raise TypeError(f"cannot register {name}: parameter {param.name!r} is "
                                f"{param.kind.description}; a tool takes keyword arguments")
            if param.name == call_param:
                continue
            hint = hints.get(param.name, param.annotation)
            if hint is param.empty:
                hint = _NO_HINT
            if _is_event_hint(hint):
                signal_param = param.name
                continue
            made = _hint_schema(hint)
            if made is None:
                raise TypeError(f"cannot register {name}: parameter {param.name!r} has the type "
                                f"hint {hint!r}, which JSON Schema cannot express; use str, int, "
                                f"float, bool, list, dict, Optional or Literal")
            schema, convert = made
            if param.default is None and not _admits_null(schema):
                # what Python < 3.11 does to such hints anyway: the same schema on every version
                schema, convert = _nullable_schema(schema), _nullable(convert)
            schema = dict(schema)
            if param.name in arg_docs:
                schema["description"] = arg_docs[param.name]
            if param.default is param.empty:
                required.append(param.name)
            elif _json_ready(param.default):
                schema["default"] = param.default
            properties[param.name] = schema
            converters[param.name] = convert
        parameters = {"type": "object", "properties": properties}
        if required:
            parameters["required"] = required
        parameters["additionalProperties"] = False
        spec = {"name": name,
                "description": doc_description if description is None else description,
                "parameters": parameters}
        self._tools[name] = _Tool(name, fn, spec, converters, tuple(required), signal_param,
                                  call_param)

    def _unknown(self, name):
        shown = _echo(name) if isinstance(name, str) else repr(name)
        if not self._tools:
            return f"unknown tool {shown}; no tools are available"
        return f"unknown tool {shown}; the available tools are: {', '.join(self._tools)}"

    def _limit(self, text):
        return _truncate(text, self.max_output_chars)

    def _passed(self, result):
        """A ToolResult a function returned, its texts cut to ``max_output_chars``."""
        output, error = result.output, result.error
        if (isinstance(output, str) and len(output) > self.max_output_chars) or (
                isinstance(error, str) and len(error) > self.max_output_chars):
            return ToolResult(ok=result.ok,
                              output=self._limit(output) if isinstance(output, str) else output,
                              error=self._limit(error) if isinstance(error, str) else error)
        return result


def _json_ready(value):
    """Whether ``value`` can go into a JSON Schema as a default."""
    try:
        json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        return False
    return True


# ---- coding_tools ------------------------------------------------------------

_READ_DEFAULT_LIMIT = 2000      # lines read_file returns unless asked for fewer or more
_LINE_MAX_CHARS = 2000          # read_file and search cut longer lines
_READ_MAX_CHARS = 40_000        # read_file stops here and says where to go on
_BINARY_SNIFF_BYTES = 8192      # a NUL byte in this much of a file makes it binary
_LIST_MAX_FILES = 500           # list_files names at most this many files
_SEARCH_MAX_MATCHES = 200       # search shows at most this many matching lines
_SEARCH_LINE_CHARS = 500        # search cuts the lines it shows to this
_WALK_MAX_ENTRIES = 100_000     # list_files and search stop scanning after this many entries
_EDIT_MAX_BYTES = 10_000_000    # edit_file refuses bigger files
_SHELL_KEEP_BYTES = 20_000      # bash keeps this much of the head and of the tail of its output
_SHELL_READ_BYTES = 65_536      # one read from the shell's pipe
_SHELL_POLL_SECONDS = 0.05      # how often bash looks at the signal and the clock
_SHELL_DRAIN_SECONDS = 0.2      # output still read after the shell exits, before the kill
_SKIP_DIRS = frozenset({".git", "node_modules", "__pycache__", ".venv", "venv"})
_UTF8_MAX_BYTES = 4


def _fs_failure(error, path):
    """An OSError on ``path`` (as the model gave it) as a _ToolFailure the model can act on."""
    import errno
    if isinstance(error, FileNotFoundError):
        return _ToolFailure(f"no such file or directory: {path}")
    if isinstance(error, PermissionError):
        return _ToolFailure(f"permission denied: {path}")
    if isinstance(error, NotADirectoryError):
        return _ToolFailure(f"a part of the path is not a directory: {path}")
    if error.errno == errno.ELOOP:
        return _ToolFailure(f"too many levels of symbolic links: {path}")
    return _ToolFailure(f"{error.strerror or error}: {path}")


def _read_lines(f, max_chars):
    """(text, cut) per line of the binary file ``f``: at most ``max_chars`` characters of the
    line (undecodable bytes replaced) and how many more it had; memory stays bounded."""
    import codecs
    cap = max_chars * _UTF8_MAX_BYTES + 2
    while True:
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
        more = 0
        while True:
            chunk = f.readline(_SHELL_READ_BYTES)
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


def _glob_regex(pattern):
    """A regular expression for a glob: ``**`` spans folders, ``*`` and ``?`` stay within one
    name, ``[...]`` is a class and ``{a,b}`` an alternative."""
    out = []
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
            continue
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
            continue
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[":
            j = i + 1
            if j < n and pattern[j] in "!^":
                j += 1
            if j < n and pattern[j] == "]":
                j += 1
            j = pattern.find("]", j)
            if j < 0:
                out.append(re.escape(c))
            else:
                body = pattern[i + 1:j].replace("\\", "\\\\")
                if body[:1] in ("!", "^"):
                    body = "^" + body[1:]
                out.append(f"[{body}]")
                i = j
        elif c == "{" and pattern.find("}", i) > i:
            j = pattern.find("}", i)
            choices = pattern[i + 1:j].split(",")
            out.append("(?:" + "|".join(_glob_regex(choice) for choice in choices) + ")")
            i = j
        else:
            out.append(re.escape(c))
        i += 1
    return "".join(out)


def _glob_matcher(pattern):
    """A test ``(path relative to the folder, file name) -> bool`` for a glob; a pattern
    without ``/`` tests the file name, at any depth."""
    while pattern.startswith("./"):
        pattern = pattern[2:]
    regex = re.compile(_glob_regex(pattern), re.DOTALL)
    if "/" in pattern:
        return lambda rel, name: regex.fullmatch(rel) is not None
    return lambda rel, name: regex.fullmatch(name) is not None


def _match_all(rel, name):
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
        """What was kept, decoded (undecodable bytes replaced), with a marker for the rest."""
        del self.tail[:-self.keep]
        omitted = self.total - len(self.head) - len(self.tail)
        if not omitted:
            return bytes(self.head + self.tail).decode("utf-8", "replace")
        return (self.head.decode("utf-8", "replace") + f"\n[... {omitted} bytes omitted ...]\n"
                + self.tail.decode("utf-8", "replace"))


def _with_newline(text):
    return text + "\n" if text and not text.endswith("\n") else text


def _kill_group(pgid):
    """SIGKILL every process of the group ``pgid``; whether there was any left to kill."""
    import signal as signals
    try:
        os.killpg(pgid, signals.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _run_shell(command, cwd, timeout, signal):
    """Run ``command`` with ``/bin/sh -c``: output streamed and capped, the process group
    killed on timeout, on the signal, and when the shell is done."""
    import selectors
    import subprocess
    if signal.is_set():
        return ToolResult(ok=False, error="the command was aborted before it started")
    proc = subprocess.Popen(["/bin/sh", "-c", command], cwd=cwd, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    sink = _HeadTail(_SHELL_KEEP_BYTES)
    stopped = None
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
                    break
                wait = min(_SHELL_POLL_SECONDS, deadline - now)
                if selector.select(wait):
                    chunk = os.read(fd, _SHELL_READ_BYTES)
                    if not chunk:
                        break
                    sink.write(chunk)
        while stopped is None and proc.poll() is None:  # the shell closed its output early
            now = time.monotonic()
            if now >= deadline:
                stopped = "timeout"
            elif signal.wait(min(_SHELL_POLL_SECONDS, deadline - now)):
                stopped = "aborted"
    finally:
        leftovers = _kill_group(proc.pid)
        proc.stdout.close()
        proc.wait()
    text = sink.text()
    if stopped == "timeout":
        return ToolResult(ok=False, output=text, error=f"the command timed out after {timeout:g} "
                                                       f"seconds and was killed")
    if stopped == "aborted":
        return ToolResult(ok=False, output=text, error="the command was aborted and killed")
    if leftovers:
        text = _with_newline(text) + "[background processes left running were killed]\n"
    code = proc.returncode
    text = _with_newline(text) + f"[exit code {code}]"
    if code == 0:
        return ToolResult(ok=True, output=text)
    if code < 0:
        return ToolResult(ok=False, output=text, error=f"the command was killed by signal {-code}")
    return ToolResult(ok=False, output=text, error=f"the command exited with code {code}")


class _Workspace:
    """The coding tools over one root folder; every path is confined to it."""

    def __init__(self, root, approve, shell_timeout):
        real = os.path.realpath(root)
        if not os.path.isdir(real):
            raise ValueError(f"root is not a directory: {root}")
        self.root = real
        self._prefix = real if real.endswith(os.sep) else real + os.sep
        self.approve = approve
        self.shell_timeout = shell_timeout

    def read_file(self, path: str, offset: int = 1, limit: int = _READ_DEFAULT_LIMIT) -> str:
        """Read a text file of the workspace: its lines, numbered from 1; long lines are cut.

        Args:
            path: The file, relative to the workspace root.
            offset: The number of the first line to read.
            limit: The most lines to read.
        """
        if offset < 1 or limit < 1:
            raise _ToolFailure("offset and limit must be 1 or more")
        real = self._resolve(path)
        lines = []
        size = 0
        number = 0
        go_on = None
        with self._open_file(real, path) as f:
            if _is_binary(f):
                raise _ToolFailure(f"path is a binary file, not text: {path}")
            for number, (text, cut) in enumerate(_read_lines(f, _LINE_MAX_CHARS), 1):
                if number < offset:
                    continue
                line = f"{number:6}\t{text}" + (f" [... {cut} more characters]" if cut else "")
                if number >= offset + limit or (lines and size + len(line) > _READ_MAX_CHARS):
                    go_on = number
                    break
                lines.append(line)
                size += len(line) + 1
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
        real = self._resolve(path)
        self._require_dir(real, path)
        found, complete = self._walk(real, _glob_matcher(pattern))
        found.sort()
        lines = found[:_LIST_MAX_FILES]
        if len(found) > _LIST_MAX_FILES:
            lines.append(f"... {len(found) - _LIST_MAX_FILES} more")
        if not complete:
            lines.append(_scan_note())
        return "\n".join(lines) if lines else f"no files match {pattern} under {path}"

    def search(self, pattern: str, path: str = ".",
               glob: Optional[str] = None,
               *, signal: threading.Event) -> str:
        """Search the text files of the workspace, line by line, for a regular expression;
        answers with "file:line: text" lines.

        Args:
            pattern: A Python regular expression (the re module's syntax).
            path: The folder or file to search, relative to the workspace root.
            glob: Only search the files matching this glob, such as "*.py" or "src/**/*.ts".
        """
        import stat
        try:
            regex = re.compile(pattern)
        except re.error as e:
            raise _ToolFailure(f"invalid regular expression: {e}") from None
        real = self._resolve(path)
        mode = self._stat(real, path).st_mode
        if stat.S_ISDIR(mode):
            files, complete = self._walk(real, _glob_matcher(glob) if glob else _match_all)
            files.sort()
        elif stat.S_ISREG(mode):
            files, complete = [self._relative(real)], True
        else:
            raise _ToolFailure(f"path is not a regular file or a directory: {path}")
        lines = []
        matches = 0
        for shown in files:
            if signal.is_set():
                raise _ToolFailure("the search was aborted")
            try:
                with self._open_file(os.path.join(self.root, shown), shown) as f:
                    if _is_binary(f):
                        continue
                    for number, (text, _) in enumerate(_read_lines(f, _LINE_MAX_CHARS), 1):
                        if regex.search(text):
                            matches += 1
                            if matches <= _SEARCH_MAX_MATCHES:
                                lines.append(f"{shown}:{number}: {text[:_SEARCH_LINE_CHARS]}")
            except (OSError, _ToolFailure):
                continue  # vanished or unreadable meanwhile
        if matches > _SEARCH_MAX_MATCHES:
            lines.append(f"... {matches - _SEARCH_MAX_MATCHES} more matches")
        if not complete:
            lines.append(_scan_note())
        return "\n".join(lines) if lines else "no matches"

    def write_file(self, path: str, content: str, call: dict) -> str:
        """Create or overwrite a text file of the workspace; missing folders are created.

        Args:
            path: The file, relative to the workspace root.
            content: The whole new text of the file.
        """
        import stat
        real = self._resolve(path)
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
        self._approve(call)
        try:
            os.makedirs(os.path.dirname(real), exist_ok=True)
            with open(real, "wb") as f:
                f.write(data)
        except OSError as e:
            raise _fs_failure(e, path) from None
        return f"wrote {len(content)} characters to {path}"

    def edit_file(self, path: str, old_text: str, new_text: str, call: dict) -> str:
        """Replace old_text, which must occur exactly once in the file, with new_text.

        Args:
            path: The file, relative to the workspace root.
            old_text: The text to replace, copied exactly (whitespace included), with enough
                of its surroundings to occur only once.
            new_text: The text to put in its place.
        """
        if not old_text:
            raise _ToolFailure("old_text is empty; copy the exact text to replace from the file")
        real = self._resolve(path)
        self._edited(real, path, old_text, new_text)
        self._approve(call)
        data = self._edited(real, path, old_text, new_text)  # the file may have changed meanwhile
        try:
            with open(real, "wb") as f:
                f.write(data)
        except OSError as e:
            raise _fs_failure(e, path) from None
        return f"replaced 1 occurrence of old_text in {path}"

    def bash(self, command: str, call: dict, signal: threading.Event) -> ToolResult:
        """Run a shell command.

        Args:
            command: The command, run by /bin/sh -c.
        """
        if not command.strip():
            raise _ToolFailure("command is empty")
        self._approve(call)
        return _run_shell(command, self.root, self.shell_timeout, signal)

    def _resolve(self, path):
        """The real path of ``path`` (relative to the root), which must lie inside the root."""
        if "\0" in path:
            raise _ToolFailure(f"path contains a NUL character: {path!r}")
        real = os.path.realpath(os.path.join(self.root, path))
        if not self._inside(real):
            raise _ToolFailure(f"path is outside the workspace: {path}")
        return real

    def _inside(self, real):
        return real == self.root or real.startswith(self._prefix)

    def _relative(self, real):
        return "." if real == self.root else real[len(self._prefix):]

    def _stat(self, real, path):
        try:
            return os.stat(real)
        except OSError as e:
            raise _fs_failure(e, path) from None

    def _require_dir(self, real, path):
        import stat
        if not stat.S_ISDIR(self._stat(real, path).st_mode):
            raise _ToolFailure(f"path is not a directory: {path}")

    def _open_file(self, real, path):
        """``real`` opened for binary reading, refused unless a regular file; never blocks."""
        import stat
        mode = self._stat(real, path).st_mode
        if stat.S_ISDIR(mode):
            raise _ToolFailure(f"path is a directory, not a file: {path}; list_files shows "
                               f"what it holds")
        if not stat.S_ISREG(mode):
            raise _ToolFailure(f"path is not a regular file: {path}")
        try:
            fd = os.open(real, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        except OSError as e:
            raise _fs_failure(e, path) from None
        f = os.fdopen(fd, "rb")
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # swapped since the stat
            f.close()
            raise _ToolFailure(f"path is not a regular file: {path}")
        return f

    def _walk(self, top, matches):
        """(paths from the root of the files under the real folder ``top`` that ``matches``,
        whether the scan was complete); symbolic links to folders are not followed."""
        base = self._relative(top)
        prefix = "" if base == "." else base + "/"
        found = []
        seen = 0
        pending = [""]
        while pending:
            folder = pending.pop()
            try:
                with os.scandir(os.path.join(top, folder)) as it:
                    entries = list(it)
            except OSError:
                continue
            for entry in entries:
                seen += 1
                if seen > _WALK_MAX_ENTRIES:
                    return found, False
                rel = folder + entry.name
                try:
                    if entry.is_symlink():
                        target = os.path.realpath(entry.path)
                        if not (self._inside(target) and os.path.isfile(target)):
                            continue
                    elif entry.is_dir(follow_symlinks=False):
                        if entry.name not in _SKIP_DIRS:
                            pending.append(rel + "/")
                        continue
                    elif not entry.is_file(follow_symlinks=False):
                        continue
                except OSError:
                    continue
                if matches(rel, entry.name):
                    found.append(prefix + rel)
        return found, True

    def _edited(self, real, path, old_text, new_text):
        """The bytes of the file with its one ``old_text`` replaced; _ToolFailure otherwise."""
        with self._open_file(real, path) as f:
            data = f.read(_EDIT_MAX_BYTES + 1)
        if len(data) > _EDIT_MAX_BYTES:
            raise _ToolFailure(f"{path} is too large to edit (over {_EDIT_MAX_BYTES} bytes); "
                               f"use write_file or bash")
        if b"\0" in data[:_BINARY_SNIFF_BYTES]:
            raise _ToolFailure(f"path is a binary file, not text: {path}")
        text = data.decode("utf-8", "surrogateescape")
        count = text.count(old_text)
        if count == 0:
            raise _ToolFailure(f"old_text was not found in {path}; read the file and copy the "
                               f"text exactly, whitespace included")
        if count > 1:
            raise _ToolFailure(f"old_text occurs {count} times in {path}; include more of the "
                               f"surrounding text so that it occurs exactly once")
        try:
            return text.replace(old_text, new_text, 1).encode("utf-8", "surrogateescape")
        except UnicodeEncodeError as e:
            raise _ToolFailure(f"new_text cannot be written as UTF-8: {e}") from None

    def _approve(self, call):
        if self.approve is not None and not self.approve(call):
            raise _ToolFailure("the user declined this call")


def _scan_note():
    return f"[... stopped after scanning {_WALK_MAX_ENTRIES} entries; narrow the path or pattern]"


def coding_tools(root=".", *, allow_write=False, allow_shell=False, approve=None,
                 shell_timeout=120) -> Tools:
    """The built-in tools of the command line, confined to the folder ``root``.

    ``read_file``, ``list_files`` and ``search`` always; ``write_file`` and ``edit_file`` with
    ``allow_write``; ``bash`` with ``allow_shell``. Every path is resolved, symbolic links
    included, and must lie inside ``root``. ``approve(call) -> bool``, when given, is asked
    before each write or shell call whose arguments are valid; ``False`` declines it.
    ``bash`` runs ``/bin/sh -c`` in ``root`` in a process group of its own, which is killed
    after ``shell_timeout`` seconds, when the signal is set, and when the shell exits
    (background processes do not outlive the call).
    """
    if approve is not None and not callable(approve):
        raise TypeError(f"approve must be callable or None, not {approve!r}")
    if isinstance(shell_timeout, bool) or not isinstance(shell_timeout, (int, float)):
        raise TypeError(f"shell_timeout must be a number, not {shell_timeout!r}")
    if not shell_timeout > 0:
        raise ValueError(f"shell_timeout must be above 0, not {shell_timeout}")
    workspace = _Workspace(root, approve, shell_timeout)
    tools = Tools()
    tools.register(workspace.read_file)
    tools.register(workspace.list_files)
    tools.register(workspace.search)
    if allow_write:
        tools._register(workspace.write_file, None, None, call_param="call")
        tools._register(workspace.edit_file, None, None, call_param="call")
    if allow_shell:
        tools._register(
            workspace.bash, None,
            f"Run a shell command with /bin/sh in the workspace root; answers with its output "
            f"(stdout and stderr together) and its exit code. Stdin is closed; the command is "
            f"killed after {shell_timeout:g} seconds; background processes do not outlive it.",
            call_param="call")
    return tools


# ============================================================================
# Command line
# ============================================================================


DEFAULT_MAX_TURNS = 30
DEFAULT_CONTEXT_BUDGET = 100_000
DEFAULT_OPENAI_MODEL = "openai:gpt-4.1-mini"
DEFAULT_ANTHROPIC_MODEL = "anthropic:claude-sonnet-4-5"
_LIST_SESSIONS_LIMIT = 20
_ABORT_GRACE_SECONDS = 1.0
_TOOL_SUMMARY_CHARS = 60
_SPINNER_FRAMES = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"
_SPINNER_INTERVAL = 0.1
_EXIT_OK, _EXIT_ERROR, _EXIT_USAGE, _EXIT_BUDGET, _EXIT_INTERRUPTED = 0, 1, 2, 3, 130
_NO_MODEL_HELP = (
    "no model configured: pass -m/--model or set LICH_MODEL (e.g. openai:gpt-4.1-mini or "
    "anthropic:claude-sonnet-4-5), or set OPENAI_API_KEY or ANTHROPIC_API_KEY; for a local "
    "OpenAI-compatible server such as Ollama set OPENAI_BASE_URL=http://localhost:11434/v1")
_DEFAULT_SYSTEM_PROMPT = (
    "You are lich, a careful coding agent working in the folder {root}. "
    "Your tools: {tools}. Paths are relative to that folder and must stay inside it. "
    "Look before you change anything, keep changes small, and say what you did. "
    "Answer concisely in plain text.")
_REPL_HELP = """commands:
  /resume [ID|latest]  continue a recorded session (latest by default)
  /sessions            list recent sessions
  /clear               start a new conversation and session file
  /help                this text
  /exit                leave (Ctrl-D too)"""


class _UsageError(Exception):
    """A command-line mistake: exit 2 with the message."""


def _build_parser():
    import argparse

    parser = argparse.ArgumentParser(
        prog="lich", description="A coding agent on the command line: one-shot with PROMPT, "
        "an interactive chat without. Piped stdin is added to the prompt as context.")
    add = parser.add_argument
    add("prompt", nargs="?", metavar="PROMPT", help="what to do; omit for interactive chat")
    add("-m", "--model", metavar="SPEC", help="provider:model[@base_url], comma-separated for "
        "failover (default: $LICH_MODEL, else by the API key that is set)")
    add("--base-url", metavar="URL", help="the provider's base URL")
    add("-s", "--system", metavar="TEXT", help="the system prompt")
    add("--max-turns", type=_positive_int, default=DEFAULT_MAX_TURNS, metavar="N",
        help=f"model calls per run (default {DEFAULT_MAX_TURNS})")
    add("--context-budget", type=_non_negative_int, default=DEFAULT_CONTEXT_BUDGET,
        metavar="TOKENS", help=f"compress history above this estimate (default "
        f"{DEFAULT_CONTEXT_BUDGET}; 0 turns compression off)")
    add("--temperature", type=float, metavar="T", help="sampling temperature")
    add("--session-dir", metavar="DIR", help="where sessions are recorded (default "
        "$LICH_SESSION_DIR, else $XDG_STATE_HOME/lich/sessions, else "
        "~/.local/state/lich/sessions)")
    add("--no-session", action="store_true", help="record nothing")
    add("--label", metavar="L", help="a label for the session file name")
    add("--resume", metavar="ID", help="continue a session: an id, a unique prefix or 'latest'")
    add("-c", "--continue", dest="resume", action="store_const", const="latest",
        help="continue the latest session (= --resume latest)")
    add("--list-sessions", action="store_true", help="list recent sessions, newest first")
    add("--allow", action="append", choices=("write", "shell"), default=[],
        help="offer the file-writing or shell tools (repeatable)")
    add("--yolo", action="store_true", help="offer write and shell tools, never ask")
    add("--root", default=".", metavar="DIR", help="the tools' workspace (default: .)")
    add("--json", action="store_true", help="print every loop event as a JSON line on stdout")
    add("--no-stream", action="store_true", help="print the answer when it is complete")
    add("-q", "--quiet", action="store_true", help="no tool lines, spinner or notes")
    add("-v", "--verbose", action="store_true", help="debug logs and tracebacks on stderr")
    add("--version", action="version", version=f"lich {__version__}")
    return parser


def _positive_int(text):
    value = int(text)
    if value < 1:
        raise ValueError(text)
    return value


def _non_negative_int(text):
    value = int(text)
    if value < 0:
        raise ValueError(text)
    return value


def _default_session_dir(environ) -> str:
    if environ.get("LICH_SESSION_DIR"):
        return environ["LICH_SESSION_DIR"]
    state = environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(state, "lich", "sessions")


def _default_model(environ) -> str:
    if environ.get("LICH_MODEL"):
        return environ["LICH_MODEL"]
    if environ.get("OPENAI_API_KEY") or environ.get("OPENAI_BASE_URL"):
        return DEFAULT_OPENAI_MODEL
    if environ.get("ANTHROPIC_API_KEY"):
        return DEFAULT_ANTHROPIC_MODEL
    raise _UsageError(_NO_MODEL_HELP)


def _prompt_with_stdin(prompt, piped) -> str:
    """The prompt, with piped text before it as context in a fenced block."""
    if piped is None or not piped.strip():
        if prompt is None:
            raise _UsageError("no prompt: pass PROMPT or pipe text on stdin")
        return prompt
    if prompt is None:
        return piped
    fence = "```"
    while fence in piped:
        fence += "`"
    return f"{fence}\n{piped.rstrip(chr(10))}\n{fence}\n\n{prompt}"


def _tool_summary(call) -> str:
    """A few words saying what a tool call does: its first string argument."""
    try:
        args = json.loads(call.get("arguments") or "{}")
    except ValueError:
        args = None
    text = ""
    if isinstance(args, dict):
        text = next((v for v in args.values() if isinstance(v, str)), "")
    text = " ".join(text.split())
    if len(text) > _TOOL_SUMMARY_CHARS:
        text = text[:_TOOL_SUMMARY_CHARS - 1] + "…"
    return f"{call.get('name')} {text}".rstrip()


def _short_reason(result) -> str:
    reason = " ".join(str(result.error or "failed").split())
    return reason if len(reason) <= _TOOL_SUMMARY_CHARS else reason[:_TOOL_SUMMARY_CHARS - 1] + "…"


def _plain(value):
    """A JSON-ready copy of an event value: dataclasses as dicts, exceptions described."""
    if isinstance(value, BaseException):
        described = {"type": type(value).__name__, "message": str(value)}
        for name in ("kind", "status", "retryable", "retry_after"):
            if hasattr(value, name):
                described[name] = getattr(value, name)
        return described
    if hasattr(value, "__dataclass_fields__"):
        from dataclasses import asdict

        return asdict(value)
    return value


class _Terminal:
    """Everything the CLI shows: the answer on stdout, progress and notes on stderr."""

    def __init__(self, *, quiet=False, json_lines=False, color=False, spinner=False):
        self.quiet = quiet
        self.json_lines = json_lines
        self.color = color
        self.spinner_enabled = spinner and not quiet and not json_lines
        self._tool_line_open = False
        self._answer_open = False  # streamed text not yet ended by a newline
        self._spinner_stop = None
        self._lock = threading.Lock()

    # stdout
    def delta(self, text: str) -> None:
        self.stop_spinner()
        if text:
            sys.stdout.write(text)
            sys.stdout.flush()
            self._answer_open = not text.endswith("\n")

    def end_answer(self) -> None:
        if self._answer_open:
            sys.stdout.write("\n")
            sys.stdout.flush()
            self._answer_open = False

    def answer(self, text: str) -> None:
        if text:
            sys.stdout.write(text if text.endswith("\n") else text + "\n")
            sys.stdout.flush()

    def json_line(self, value) -> None:
        sys.stdout.write(json.dumps(value, ensure_ascii=False, default=repr) + "\n")
        sys.stdout.flush()

    # stderr
    def note(self, text: str) -> None:
        if not self.quiet:
            self.line(text)

    def line(self, text: str) -> None:
        self.stop_spinner()
        with self._lock:
            if self._tool_line_open:
                sys.stderr.write("\n")
                self._tool_line_open = False
            sys.stderr.write(text + "\n")
            sys.stderr.flush()

    def error(self, text: str) -> None:
        self.end_answer()
        self.line(f"lich: {text}")

    def tool_start(self, call) -> None:
        if self.quiet or self.json_lines:
            return
        self.stop_spinner()
        self.end_answer()
        with self._lock:
            sys.stderr.write(self._paint("→ " + _tool_summary(call), "2"))
            sys.stderr.flush()
            self._tool_line_open = True

    def tool_end(self, call, result, cancelled) -> None:
        if self.quiet or self.json_lines:
            return
        mark = self._paint("✓", "32") if result.ok else self._paint("✗ " + _short_reason(result), "31")
        with self._lock:
            if self._tool_line_open:
                sys.stderr.write(" " + mark + "\n")
            else:
                sys.stderr.write(self._paint("→ " + _tool_summary(call), "2") + " " + mark + "\n")
            sys.stderr.flush()
            self._tool_line_open = False

    def start_spinner(self) -> None:
        if not self.spinner_enabled or self._spinner_stop is not None:
            return
        stop = threading.Event()
        self._spinner_stop = stop

        def spin():
            for i in range(10**9):
                if stop.wait(_SPINNER_INTERVAL):
                    break
                with self._lock:
                    sys.stderr.write(f"\r{_SPINNER_FRAMES[i % len(_SPINNER_FRAMES)]} thinking")
                    sys.stderr.flush()
            with self._lock:
                sys.stderr.write("\r\033[K")
                sys.stderr.flush()

        self._spinner_thread = threading.Thread(target=spin, daemon=True)
        self._spinner_thread.start()

    def stop_spinner(self) -> None:
        stop, self._spinner_stop = self._spinner_stop, None
        if stop is not None:
            stop.set()
            self._spinner_thread.join()

    def _paint(self, text, code):
        return f"\033[{code}m{text}\033[0m" if self.color else text


def _event_printer(term: _Terminal):
    """The emitter handler that shows the loop's progress."""

    def on_event(event):
        kind = event["type"]
        if term.json_lines:
            term.json_line({k: _plain(v) for k, v in event.items()})
        elif kind == "llm_start":
            term.start_spinner()
        elif kind == "llm_end":
            term.stop_spinner()
            if event["result"].message.get("tool_calls"):
                term.end_answer()
        elif kind == "tool_call_start":
            term.tool_start(event["call"])
        elif kind == "tool_call_end":
            term.tool_end(event["call"], event["result"], event["cancelled"])
        elif kind == "compress_end":
            term.note(f"(history compressed: {event['summary_chars']} characters of summary)")
        elif kind == "error":
            term.stop_spinner()

    return on_event


class _LogToStderr(logging.Handler):
    """Shows lich's log records on stderr through the terminal."""

    def __init__(self, term, level):
        super().__init__(level)
        self.term = term

    def emit(self, record):
        try:
            text = record.getMessage()
            if record.exc_info and self.level <= logging.DEBUG:
                import traceback

                text += "\n" + "".join(traceback.format_exception(*record.exc_info)).rstrip()
            prefix = "warning: " if record.levelno >= logging.WARNING else "debug: "
            self.term.line("lich: " + prefix + text)
        except Exception:
            self.handleError(record)


def _run_interruptibly(work, signal, term):
    """Run ``work()`` in a worker thread; Ctrl-C sets ``signal`` and gives it a moment.

    Returns work's result or raises its exception. A second Ctrl-C, or a worker still
    busy after the grace period (a blocking HTTP read), raises KeyboardInterrupt.
    """
    outcome = {}

    def target():
        try:
            outcome["value"] = work()
        except BaseException as exc:
            outcome["error"] = exc

    worker = threading.Thread(target=target, name="lich-run", daemon=True)
    worker.start()
    try:
        while worker.is_alive():
            worker.join(0.1)
    except KeyboardInterrupt:
        signal.set()
        term.stop_spinner()
        term.end_answer()
        term.note("interrupted; stopping (Ctrl-C again to quit at once)")
        deadline = time.monotonic() + _ABORT_GRACE_SECONDS
        while worker.is_alive() and time.monotonic() < deadline:
            worker.join(0.05)
        if worker.is_alive():
            raise KeyboardInterrupt from None
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def _ask_approval(term: _Terminal, signal: threading.Event, always: set):
    """The ``approve`` function of interactive chat: y / n / a(lways, for this tool)."""
    import select

    def approve(call) -> bool:
        name = call.get("name")
        if name in always:
            return True
        term.line(f"  {_tool_summary(call)}")
        sys.stderr.write("  allow? [y]es / [n]o / [a]lways ")
        sys.stderr.flush()
        while not signal.is_set():
            ready, _, _ = select.select([sys.stdin], [], [], 0.1)
            if ready:
                answer = sys.stdin.readline().strip().lower()
                if answer in ("a", "always"):
                    always.add(name)
                    return True
                return answer in ("y", "yes")
        return False

    return approve


def _list_sessions(session_dir, term: _Terminal) -> int:
    try:
        with os.scandir(session_dir) as entries:
            found = [e for e in entries if e.name.endswith(SESSION_SUFFIX) and e.is_file()]
    except OSError:
        found = []
    found.sort(key=lambda e: (e.stat().st_mtime_ns, e.name), reverse=True)
    if not found:
        term.note("no sessions yet")
    for entry in found[:_LIST_SESSIONS_LIMIT]:
        try:
            messages = read_session_messages(entry.path)
        except OSError:
            continue
        first = next((m["content"] for m in messages if m["role"] == "user"), "")
        first = " ".join(first.split())[:_TOOL_SUMMARY_CHARS]
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(entry.stat().st_mtime))
        sys.stdout.write(f"{entry.name[:-len(SESSION_SUFFIX)]}  {when}  {len(messages):>4} messages"
                         f"  {first}\n")
    if len(found) > _LIST_SESSIONS_LIMIT:
        term.note(f"... {len(found) - _LIST_SESSIONS_LIMIT} older sessions")
    return _EXIT_OK


def _load_session(session_dir, ref) -> list:
    try:
        return read_session_messages(resolve_session(session_dir, ref))
    except FileNotFoundError:
        raise SessionNotFound(f"session not found: {ref}") from None


def _exit_code(run) -> int:
    return {"final": _EXIT_OK, "budget": _EXIT_BUDGET}.get(run.stopped_reason, _EXIT_INTERRUPTED)


class _Cli:
    """One invocation of the command line, its options resolved."""

    def __init__(self, args, environ):
        self.args = args
        self.interactive = args.prompt is None and sys.stdin.isatty()
        self.streaming = not (args.no_stream or args.json)
        color = sys.stderr.isatty() and not environ.get("NO_COLOR")
        self.term = _Terminal(quiet=args.quiet, json_lines=args.json, color=color, spinner=color)
        self.sessions_home = args.session_dir or _default_session_dir(environ)
        self.session_dir = None if args.no_session else self.sessions_home
        self.model = args.model or _default_model(environ)
        self.signal = threading.Event()
        self.always_allowed = set()
        allow = set(args.allow) | ({"write", "shell"} if args.yolo else set())
        approve = (_ask_approval(self.term, self.signal, self.always_allowed)
                   if self.interactive and not args.yolo else None)
        root = os.path.abspath(args.root)
        if not os.path.isdir(root):
            raise _UsageError(f"--root is not a folder: {args.root}")
        self.tools = coding_tools(root, allow_write="write" in allow, allow_shell="shell" in allow,
                                  approve=approve)
        names = ", ".join(spec["name"] for spec in self.tools.specs())
        self.system_prompt = (args.system if args.system is not None
                              else _DEFAULT_SYSTEM_PROMPT.format(root=root, tools=names))
        options = {"stream": self.streaming}
        if self.streaming:
            options["on_delta"] = self.term.delta
        if args.base_url:
            options["base_url"] = args.base_url
        try:
            self.chat = chat_from_spec(self.model, **options)
        except (ValueError, TypeError) as exc:
            raise _UsageError(str(exc)) from None
        self.emitter = AgentEmitter()
        self.emitter.on_any(_event_printer(self.term))

    def run(self, prompt, history, session=None):
        """One run_agent turn, interruptible; returns the AgentRunResult."""
        self.signal.clear()
        args = self.args
        budget = args.context_budget or None

        def work():
            return run_agent(prompt, chat=self.chat, tools=self.tools, history=history,
                             session=session, session_dir=None if session else self.session_dir,
                             label=args.label, emitter=self.emitter, max_turns=args.max_turns,
                             system_prompt=self.system_prompt, temperature=args.temperature,
                             context_budget_tokens=budget, signal=self.signal)

        return _run_interruptibly(work, self.signal, self.term)

    def finish(self, run) -> int:
        """Show a finished one-shot run; returns the exit code."""
        term = self.term
        if self.args.json:
            term.json_line({"type": "run_end", "stopped_reason": run.stopped_reason,
                            "usage": run.usage_total, "session_path": run.session_path})
        elif self.streaming:
            term.end_answer()
        else:
            last = run.final or (run.result.message if run.result else None)
            term.answer((last or {}).get("content") or "")
        if self.args.verbose:
            term.line(f"lich: usage: {run.usage_total['input_tokens']} input tokens, "
                      f"{run.usage_total['output_tokens']} output tokens")
        if run.stopped_reason == "budget":
            term.note(f"lich: stopped: the turn budget ({self.args.max_turns}) ran out before "
                      "a final answer; raise --max-turns or continue with -c")
        elif run.stopped_reason == "aborted":
            term.note("lich: stopped: interrupted")
        return _exit_code(run)

    def one_shot(self, prompt, history) -> int:
        try:
            run = self.run(prompt, history)
        except KeyboardInterrupt:
            self.term.end_answer()
            return _EXIT_INTERRUPTED
        except AbortError:
            self.term.end_answer()
            self.term.note("lich: stopped: interrupted")
            return _EXIT_INTERRUPTED
        return self.finish(run)

    def repl(self, history) -> int:
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
        term, session = self.term, None
        term.note(f"lich {__version__} · {self.model} · /help for commands, Ctrl-D to leave")
        try:
            while True:
                try:
                    line = input("› ").strip()
                except KeyboardInterrupt:
                    sys.stderr.write("\n")
                    continue
                except EOFError:
                    sys.stderr.write("\n")
                    return _EXIT_OK
                if not line:
                    continue
                if line.startswith("/"):
                    command, _, rest = line.partition(" ")
                    if command in ("/exit", "/quit"):
                        return _EXIT_OK
                    if command == "/help":
                        term.line(_REPL_HELP)
                    elif command == "/sessions":
                        _list_sessions(self.sessions_home, term)
                    elif command == "/clear":
                        _close(session)
                        history, session = [], None
                        term.note("new conversation")
                    elif command == "/resume":
                        ref = rest.strip() or "latest"
                        try:
                            history = _load_session(self.sessions_home, ref)
                        except SessionNotFound as exc:
                            term.error(str(exc))
                            continue
                        _close(session)
                        session = None
                        term.note(f"resumed {ref}: {len(history)} messages")
                    else:
                        term.error(f"unknown command {command}; /help lists them")
                    continue
                if session is None and self.session_dir is not None:
                    try:
                        session = open_session(self.session_dir, self.args.label)
                    except OSError as exc:
                        term.error(f"warning: session recording is off: {exc.strerror or exc}")
                        self.session_dir = None
                try:
                    run = self.run(line, history, session)
                except KeyboardInterrupt:
                    term.end_answer()
                    term.note("interrupted")
                    continue
                except ProviderError as exc:
                    term.error(f"error: {exc.kind}: {exc}")
                    continue
                except AbortError:
                    term.end_answer()
                    term.note("interrupted")
                    continue
                history = run.messages
                if self.streaming:
                    term.end_answer()
                else:
                    term.answer((run.final or {}).get("content") or "")
                if run.stopped_reason == "budget":
                    term.note(f"stopped: the turn budget ({self.args.max_turns}) ran out")
        finally:
            _close(session)


def _close(session):
    if session is not None:
        session.close()


def main(argv=None) -> int:
    """Run the lich command line; returns the process exit code.

    ``lich PROMPT`` runs one agent turn and prints the answer on stdout; with no PROMPT
    and a terminal on stdin it starts an interactive chat. Exit codes: 0 a final
    answer, 1 a provider or runtime error, 2 a usage error or an unknown session,
    3 the turn budget ran out, 130 interrupted.
    """
    if argv is None:
        argv = sys.argv[1:]
    if list(argv) == ["--version"]:  # the quick path: no parser to build
        sys.stdout.write(f"lich {__version__}\n")
        return _EXIT_OK
    try:
        args = _build_parser().parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a usage error argparse has shown
        return exc.code if isinstance(exc.code, int) else _EXIT_USAGE
    environ = os.environ
    term = _Terminal(quiet=args.quiet)
    logger_handler = _LogToStderr(term, logging.DEBUG if args.verbose else logging.WARNING)
    _log.addHandler(logger_handler)
    previous_level = _log.level
    if args.verbose:
        _log.setLevel(logging.DEBUG)
    try:
        return _main(args, environ, logger_handler)
    except _UsageError as exc:
        term.error(str(exc))
        return _EXIT_USAGE
    except SessionNotFound as exc:
        term.error(str(exc))
        return _EXIT_USAGE
    except KeyboardInterrupt:
        return _EXIT_INTERRUPTED
    except ProviderError as exc:
        if args.verbose:
            _log.debug("provider error", exc_info=True)
        term.error(f"error: {exc.kind}: {exc}")
        return _EXIT_ERROR
    except Exception as exc:
        if args.verbose:
            _log.debug("runtime error", exc_info=True)
        term.error(f"error: {type(exc).__name__}: {exc}")
        return _EXIT_ERROR
    finally:
        _log.removeHandler(logger_handler)
        _log.setLevel(previous_level)


def _main(args, environ, logger_handler) -> int:
    if args.list_sessions:
        return _list_sessions(args.session_dir or _default_session_dir(environ), _Terminal())
    cli = _Cli(args, environ)
    logger_handler.term = cli.term
    history = _load_session(cli.sessions_home, args.resume) if args.resume else []
    if cli.interactive:
        return cli.repl(history)
    piped = None if sys.stdin.isatty() else sys.stdin.read()
    prompt = _prompt_with_stdin(args.prompt, piped)
    try:
        return cli.one_shot(prompt, history)
    except ProviderError:
        cli.term.end_answer()
        raise


if __name__ == "__main__":
    sys.exit(main())
