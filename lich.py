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

import sys

__version__ = "0.1.0"

if __name__ == "__main__" and sys.argv[1:] == ["--version"]:
    # Answered before the imports below: `python lich.py` has no bytecode cache, so every
    # millisecond of module set-up shows in this command.
    sys.stdout.write(f"lich {__version__}\n")
    sys.exit(0)

import functools
import json
import os
import re
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional, Protocol, TypedDict, runtime_checkable

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
    "read_session_messages", "list_sessions", "resolve_session",
    # providers
    "OpenAIChat", "AnthropicChat", "run_with_retries", "Router", "chat_from_spec",
    # tools
    "Tools", "coding_tools", "DEFAULT_MAX_OUTPUT_CHARS",
    # command line
    "main",
]



class _LazyLogger:
    """``logging.getLogger("lich")``, looked up on first use: importing logging costs ~4 ms."""

    def __getattr__(self, name):
        import logging

        attribute = getattr(logging.getLogger("lich"), name)
        if callable(attribute):
            setattr(self, name, attribute)  # bound methods of a logger that lives forever
        return attribute


_log = _LazyLogger()


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


def _call_ids(messages) -> set:
    """The ids of the tool calls of the assistant messages in ``messages``."""
    return {call.get("id") for m in messages if isinstance(m, dict) and m.get("role") == "assistant"
            for call in m.get("tool_calls") or ()
            if isinstance(call, dict) and isinstance(call.get("id"), str)}


class _History(list):
    """The loop's working history: a list that keeps what it derives from its messages current.

    The loop only appends to it or rewrites it wholesale (compression), so appends update
    the token estimate and the set of tool call ids, and any other change drops both until
    they are next needed. Messages are values: one changed in place after it was added is
    not read again.
    """

    __slots__ = ("_call_ids", "_tokens", "id_counters")

    def __init__(self, messages=()):
        super().__init__(messages)
        self._tokens = None
        self._call_ids = None
        self.id_counters = {}  # for _unique_call_ids: the next suffix to try, per repeated id

    def estimated_tokens(self) -> int:
        if self._tokens is None:
            self._tokens = sum(map(_estimate_message_tokens, self))
        return self._tokens

    def call_ids(self) -> set:
        """The tool call ids in the history (the set itself: read it, do not change it)."""
        if self._call_ids is None:
            self._call_ids = _call_ids(self)
        return self._call_ids

    def append(self, message):
        super().append(message)
        if self._tokens is not None:
            self._tokens += _estimate_message_tokens(message)
        if self._call_ids is not None and message.get("tool_calls"):
            self._call_ids |= _call_ids((message,))

    def extend(self, messages):
        for message in messages:
            self.append(message)

    def _changed(name):
        method = getattr(list, name)

        def changed(self, *args):
            self._tokens = self._call_ids = None
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


def _unique_call_ids(calls, used, counters) -> list:
    """``calls`` with every id that is empty, not a string, in ``used`` or earlier in ``calls``
    replaced by a fresh one (in a copy). ``used`` is only read; ``counters`` holds the next
    suffix to try per id, so that many repeats cost linear time.

    Providers refuse a history whose tool call ids repeat (Anthropic: "tool_use ids must be
    unique"), and some models and servers repeat them or leave them out.
    """
    seen = set()  # ids of ``calls`` kept or given so far
    for call in calls:  # the common case: nothing to change
        call_id = call.get("id") if type(call) is dict else None
        if not call_id or type(call_id) is not str or call_id in used or call_id in seen:
            break
        seen.add(call_id)
    else:
        return calls
    fixed = None
    seen.clear()
    taken = None  # the ids of ``calls`` as given: a fresh id must not take one of them
    for i, call in enumerate(calls):
        if not isinstance(call, dict):
            continue
        call_id = call.get("id")
        if isinstance(call_id, str) and call_id and call_id not in used and call_id not in seen:
            seen.add(call_id)
            continue
        if taken is None:
            taken = {c.get("id") for c in calls if isinstance(c, dict) and isinstance(c.get("id"), str)}
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
              signal=None, emitter=None) -> ChatResult:
    """One chat call framed by ``llm_start`` and ``llm_end``; a failure emits ``error`` and re-raises.

    A tool call id that is empty or repeats one of the answer or of ``history`` is replaced
    by a fresh one before ``llm_end``, so the history stays one a provider accepts.
    """
    _emit(emitter, {"type": "llm_start", "turn": turn})
    try:
        result = chat(history, tools=tools, temperature=temperature, max_tokens=max_tokens,
                      signal=signal)
    except Exception as exc:
        _log.debug("chat call failed on turn %d", turn, exc_info=True)
        _emit(emitter, {"type": "error", "error": exc})
        raise
    message = getattr(result, "message", None)
    calls = message.get("tool_calls") if isinstance(message, dict) else None
    if calls and isinstance(calls, list):
        if isinstance(history, _History):
            unique = _unique_call_ids(calls, history.call_ids(), history.id_counters)
        else:
            unique = _unique_call_ids(calls, _call_ids(history), {})
        if unique is not calls:
            result = replace(result, message={**message, "tool_calls": unique})
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
    if result.output is None:
        result = ToolResult(ok=result.ok, output="", error=result.error)
    for value in (result.output, result.error):
        if value is not None and not isinstance(value, str):  # no session or provider takes it
            return ToolResult(ok=False, error=f"TypeError: the tool runner returned a ToolResult "
                                              f"holding {type(value).__name__}, not str")
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

    ``messages`` is not changed; the outcome's ``messages`` is (a plain-list copy of) the
    working history, after compression when ``context_budget_tokens`` is set.
    """
    _check_max_turns(max_turns)
    history = _History(seed_system_prompt(messages, system_prompt))
    specs = (tools.specs() or None) if tools is not None else None
    result = None
    for turn in range(1, max_turns + 1):
        _emit(emitter, {"type": "turn_start", "turn": turn})
        if signal is not None and signal.is_set():
            _emit(emitter, {"type": "error", "error": AbortError(_ABORT_MESSAGE)})
            return LoopOutcome(list(history), None, None, turn - 1, "aborted")
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
            return LoopOutcome(list(history), message, result, turn, "final")
        if turn == max_turns:
            for call in calls:
                _skip_tool_call(call, history, turn=turn, error="turn_budget_exhausted",
                                emitter=emitter)
            break
        run_tool_calls(tools, calls, history, turn=turn, signal=signal, emitter=emitter)
    _emit(emitter, {"type": "budget_exhausted", "turns_used": max_turns})
    _emit(emitter, {"type": "turn_end", "turn": max_turns})
    return LoopOutcome(list(history), None, result, max_turns, "budget")


# ============================================================================
# Sessions
# ============================================================================

_SESSION_SUFFIX = ".jsonl"
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
        self.id = os.path.basename(path)[:-len(_SESSION_SUFFIX)]
        self._fd = fd
        self._size = os.fstat(fd).st_size
        self._torn = False  # a failed write could not be cut back: start the next on a new line
        self._lock = threading.Lock()
        self._history_recorded = False  # run_agent has written a seeded history here
        import weakref

        self._close_fd = weakref.finalize(self, os.close, fd)  # a handle nobody closed

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
                self._close_fd()
                self._fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()

    def __repr__(self):
        return f"SessionHandle(id={self.id!r})"

    def _claim_history(self) -> bool:
        """True for the first run_agent to record into this handle: it writes the whole history."""
        with self._lock:
            first, self._history_recorded = not self._history_recorded, True
            return first

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
    pattern = re.compile(re.escape(stamp) + r"-(\d+)(?:-[^/]*)?" + re.escape(_SESSION_SUFFIX))
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
    suffix = (f"-{label}" if label else "") + _SESSION_SUFFIX
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
            fresh = handle._claim_history() or owned
            for message in seeded if fresh else _seeding_additions(previous, seeded):
                recorder.message(message)
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
    if type(message) is not dict:
        return None
    role = message.get("role")
    if role not in _MESSAGE_ROLES:
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
        if calls is not None:
            if type(calls) is not list:
                return None
            for call in calls:
                if not _is_tool_call(call):
                    return None
    return message


def _is_tool_call(call) -> bool:
    return (type(call) is dict and type(call.get("id")) is str
            and type(call.get("name")) is str and type(call.get("arguments")) is str)


def _interrupted_tool_message(call: dict) -> dict:
    return tool_message_from_result(call, ToolResult(ok=False, error="interrupted"))


def _repair_history(messages) -> list:
    """Pair every tool call with exactly one tool message and drop trailing user messages.

    A tool message is kept only when it follows (with only tool messages between) the
    assistant message that asked for it; a call left unanswered gets an "interrupted"
    tool message after the answers that were recorded. A call id that is empty or used
    before is renamed (see ``_unique_call_ids``), in its tool message too.
    """
    from collections import deque

    repaired = []
    pending = []  # [call, answered] of the last assistant's calls, while tool messages follow
    waiting = {}  # the id recorded in the file -> its unanswered entries of ``pending``, in order
    used, counters = set(), {}
    for message in messages:
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
        repaired.append(message)
    repaired.extend(_interrupted_tool_message(call) for call, answered in pending if not answered)
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
    with open(path, "rb") as lines:
        return _repair_history(_recorded_messages(lines))


def _recorded_messages(lines):
    """The messages of the message records among ``lines``, in order; other lines skipped."""
    for line in lines:
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if type(record) is dict and record.get("kind") == "message":
            message = _clean_message(record.get("message"))
            if message is not None:
                yield message


def list_sessions(session_dir) -> list:
    """The paths of the session files in ``session_dir``, newest (by modification time) first."""
    session_dir = os.fspath(session_dir)
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
    found.sort(reverse=True)
    return [os.path.join(session_dir, name) for _, name in found]


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
_BODY_MAX_BYTES = 64 << 20         # a whole (non-streamed) answer; a longer one is not an answer
_ERROR_BODY_MAX_BYTES = 1 << 20    # an error body: only its start is read
_BODY_READ_BYTES = 64 << 10        # read size for whole bodies
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
# Regular expressions are kept as text and compiled (and cached) by ``re`` on first use:
# compiling them all at import would cost milliseconds of every ``import lich``.
_OVERFLOW_TEXT = (
    r"(?i)context[ _-]?(?:length|window|size)|prompt (?:is )?too long|input (?:is )?too long"
    r"|maximum (?:context|prompt) length|too many (?:input |prompt )?tokens"
    r"|exceeds? the (?:maximum|max) (?:number of )?(?:input )?tokens"
    r"|reduce the length of the (?:messages|prompt|input)")
_ERRNO_TEXT = r"\[Errno -?\d+\] [^'\")]+"
_HTTP_URL = r"(?i)https?://[^/?#\s]"
_HEADER_TOKEN = r"[!-~]+\Z"  # printable ASCII without spaces: what an API key can be
_SPEC = r"(?s)\s*([A-Za-z][\w.-]*)\s*:\s*(.*?)(?:@(https?://\S+))?\s*\Z"


_json_decode = json.JSONDecoder().decode  # for str: json.loads minus its per-call checks


def _requests():
    """The requests module, imported on first use so that ``import lich`` stays light."""
    import requests
    return requests


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
    except (ValueError, RecursionError):
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
            or re.search(_OVERFLOW_TEXT, text) is not None
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
    except (ValueError, RecursionError):
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
                else:  # a bytearray grows in place: many data lines cost linear time
                    if type(data) is bytes:
                        data = bytearray(data)
                    data += b"\n"
                    data += value
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


def _read_body(response, limit):
    """At most ``limit`` bytes of the body (all of it when shorter)."""
    parts, size = [], 0
    for chunk in response.iter_content(_BODY_READ_BYTES):
        parts.append(chunk)
        size += len(chunk)
        if size >= limit:
            break
    return b"".join(parts)[:limit]


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


def _wire_json(body) -> bytes:
    """``body`` as UTF-8 JSON, each lone surrogate (a file name that is not UTF-8, say) made
    U+FFFD: providers refuse a request that escapes one ("no low surrogate in string")."""
    text = json.dumps(body, ensure_ascii=False)
    try:
        return text.encode()
    except UnicodeEncodeError:
        return re.sub("[\ud800-\udfff]", "\ufffd", text).encode()


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
        if not re.match(_HTTP_URL, self.base_url):
            raise ValueError(f"base_url must be an http:// or https:// URL, not {self.base_url!r}")
        self.timeout = timeout
        self.stream = stream
        self.on_delta = on_delta
        # Surrounding whitespace is a copy-paste accident (a CRLF .env file): dropped. A key
        # still holding a space, control or non-ASCII character cannot go into a header: it
        # is refused before requests sees it, whose error would quote the header, key and all.
        self._api_key = (api_key or os.environ.get(self._key_env) or "").strip() or None
        self._key_unsendable = self._api_key is not None and not re.match(_HEADER_TOKEN,
                                                                          self._api_key)
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
        if self._key_unsendable:
            raise self._error(f"the API key holds a space, a control or a non-ASCII character, "
                              f"which an HTTP header cannot carry: check {self._key_env} (or "
                              f"api_key=...) for stray characters", "auth")
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
                self._url, data=_wire_json(body),
                headers=self._headers, timeout=self._timeouts, stream=True)
        except requests.RequestException as e:
            raise self._transport_error(e, streaming=False) from e
        _ack_now(response)
        status = response.status_code
        if 200 <= status < 300:
            return response
        try:
            content = _read_body(response, _ERROR_BODY_MAX_BYTES)
        except requests.RequestException:
            content = b""
        finally:
            response.close()
        if self._api_key:  # some servers echo the key back: remove it before any cut
            content = self._redact(content.decode("utf-8", "replace")).encode()
        message, kind, retryable, retry_after = _classify_http_error(
            status, content, response.headers)
        raise self._error(message, kind, status=status, retryable=retryable,
                          retry_after=retry_after)

    def _result(self, response):
        try:
            content = _read_body(response, _BODY_MAX_BYTES + 1)
        except _requests().RequestException as e:
            raise self._transport_error(e, streaming=False) from e
        if len(content) > _BODY_MAX_BYTES:
            raise self._invalid(f"body larger than {_BODY_MAX_BYTES} bytes", content[:100])
        try:
            data = json.loads(content)
        except (ValueError, RecursionError):  # nested too deeply: a hostile body
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
            if signal is not None and signal.is_set():
                raise AbortError("chat stream aborted")
            if result.message["content"] and self.on_delta is not None:
                self.on_delta(result.message["content"])
            return result
        size = None if getattr(response.raw, "chunked", False) else _STREAM_READ_BYTES
        chunks = response.iter_content(size)
        shown = False

        def on_delta(text):
            nonlocal shown
            shown = True
            self.on_delta(text)

        try:
            try:
                result = self._from_wire_stream(_sse_events(chunks, signal),
                                                on_delta if self.on_delta is not None else None)
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
        except ProviderError as e:
            if shown:  # another try would show that text twice: see run_with_retries, Router
                e.retryable = False
                e._after_output = True
            raise
        return result

    # -- errors -------------------------------------------------------------------------

    def _error(self, message, kind, **fields):
        return ProviderError(self._redact(f"{self._provider}: {message}"), kind,
                             provider=self._provider, **fields)

    def _redact(self, text):
        """``text`` without the API key, as is or escaped; before any cut, so no piece is left."""
        key = self._api_key
        if key:
            for form in (key, repr(key)[1:-1]):
                text = text.replace(form, "[redacted]")
        return text

    def _invalid(self, reason, body):
        text = body.decode("utf-8", "replace") if isinstance(body, (bytes, bytearray)) else str(body)
        return self._error(f"invalid response: {reason}: {_snippet(self._redact(text))!r}",
                           "invalid_response")

    def _transport_error(self, e, *, streaming):
        requests = _requests()
        from urllib3.exceptions import ReadTimeoutError
        cause = e.args[0] if e.args else None
        if isinstance(e, requests.Timeout) or isinstance(cause, ReadTimeoutError):
            return self._error(f"timed out ({self._timeouts[0]}s connect, {self._timeouts[1]}s "
                               f"read) on {self._url}", "timeout")
        text = self._redact(str(e))
        found = re.search(_ERRNO_TEXT, text)
        reason = found.group(0) if found else _snippet(text)
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
            except (ValueError, RecursionError):
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
        return True  # Anthropic's API always wants one (API.md), local proxies included

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
            except (ValueError, RecursionError):
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
    import random

    cap = min(max_delay, base_delay * (2 ** attempt))
    return cap * (0.5 + random.random() / 2)


def _after_output(error) -> bool:
    """Whether ``error`` broke off a stream that had already shown text."""
    return getattr(error, "_after_output", False)


def run_with_retries(fn, *, retries=4, base_delay=1.0, max_delay=30.0,
                     max_retry_after=_MAX_RETRY_AFTER, signal=None):
    """Call ``fn()``, retrying retryable ProviderErrors with backoff; waits end on ``signal``.

    (A stream that broke off after it had shown text through ``on_delta`` raises a
    ProviderError that is not retryable: a new answer would repeat that text.)
    """
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
    next provider would refuse too) or a stream that broke off after showing text (the
    next answer would repeat it), stops at once when the signal is set, and raises the
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
                if e.kind in self._FINAL_KINDS or _after_output(e):
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
        found = re.match(_SPEC, part)
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

DEFAULT_MAX_OUTPUT_CHARS = 50_000
_TOOL_NAME_RE = r"[A-Za-z0-9_-]{1,64}\Z"
_ECHO_MAX_CHARS = 80  # how much of a rejected value an error message quotes
_ARGS_HEADERS = ("args:", "arguments:", "parameters:", "params:", "keyword args:",
                 "keyword arguments:")
_DOC_SECTIONS = _ARGS_HEADERS + ("returns:", "return:", "yields:", "raises:", "example:",
                                 "examples:", "note:", "notes:", "see also:")
_ARG_DOC_RE = r"\*{0,2}([A-Za-z_]\w*)\s*(?:\([^)]*\))?\s*:\s*(.*)\Z"


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
            match = re.match(_ARG_DOC_RE, stripped) if indent <= entry_indent else None
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
        if not isinstance(name, str) or not re.match(_TOOL_NAME_RE, name):
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
_FILE_READ_BYTES = 65_536       # one read of the rest of a line too long to keep
_LIST_MAX_FILES = 500           # list_files names at most this many files
_SEARCH_MAX_MATCHES = 200       # search shows at most this many matching lines
_SEARCH_LINE_CHARS = 500        # search cuts the lines it shows to this
_WALK_MAX_ENTRIES = 100_000     # list_files and search stop scanning after this many entries
_EDIT_MAX_BYTES = 10_000_000    # edit_file refuses bigger files
_SHELL_KEEP_BYTES = 20_000      # bash keeps this much of the head and of the tail of its output
_SHELL_READ_BYTES = 65_536      # one read from the shell's pipe
_SHELL_HIDDEN_ENV = frozenset({OpenAIChat._key_env, AnthropicChat._key_env})  # not for bash
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
            chunk = f.readline(_FILE_READ_BYTES)
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
    # the provider keys stay out of reach: `env` would put them in the model's context
    env = {k: v for k, v in os.environ.items() if k not in _SHELL_HIDDEN_ENV}
    proc = subprocess.Popen(["/bin/sh", "-c", command], cwd=cwd, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True, env=env)
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


_DEFAULT_MAX_TURNS = 30
_DEFAULT_CONTEXT_BUDGET = 100_000
_DEFAULT_OPENAI_MODEL = "openai:gpt-4.1-mini"
_DEFAULT_ANTHROPIC_MODEL = "anthropic:claude-sonnet-4-5"
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
    add("--max-turns", type=_positive_int, default=_DEFAULT_MAX_TURNS, metavar="N",
        help=f"model calls per run (default {_DEFAULT_MAX_TURNS})")
    add("--context-budget", type=_non_negative_int, default=_DEFAULT_CONTEXT_BUDGET,
        metavar="TOKENS", help=f"compress history above this estimate (default "
        f"{_DEFAULT_CONTEXT_BUDGET}; 0 turns compression off)")
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
    return _int_at_least(text, 1)


def _non_negative_int(text):
    return _int_at_least(text, 0)


def _int_at_least(text, low):
    import argparse

    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < low:
        raise argparse.ArgumentTypeError(f"expected a whole number >= {low}, got {text!r}")
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
        return _DEFAULT_OPENAI_MODEL
    if environ.get("ANTHROPIC_API_KEY"):
        return _DEFAULT_ANTHROPIC_MODEL
    raise _UsageError(_NO_MODEL_HELP)


def _read_piped() -> str:
    """Piped stdin as text; bytes that are not UTF-8 are replaced, as in the shell tool's output."""
    raw = getattr(sys.stdin, "buffer", None)
    return raw.read().decode("utf-8", "replace") if raw is not None else sys.stdin.read()


def _prompt_with_stdin(prompt, piped) -> str:
    """The prompt, with piped text before it as context in a fenced block."""
    if piped is None or not piped.strip():
        if prompt is None:
            raise _UsageError("no prompt: pass PROMPT or pipe text on stdin")
        return prompt
    if prompt is None:
        return piped
    longest = max(map(len, re.findall("`+", piped)), default=0)  # one pass: stdin can be huge
    fence = "`" * max(3, longest + 1)
    return f"{fence}\n{piped.rstrip(chr(10))}\n{fence}\n\n{prompt}"


def _tool_summary(call) -> str:
    """A few words saying what a tool call does: its first string argument."""
    try:
        args = json.loads(call.get("arguments") or "{}")
    except (ValueError, RecursionError):
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
    """Everything the CLI shows: the answer on stdout; progress, notes and errors on stderr."""

    def __init__(self, *, quiet=False, json_lines=False, color=False):
        self.quiet = quiet
        self.json_lines = json_lines
        self.color = color  # a terminal that shows colour, so also a spinner
        self._tool_line_open = False  # "→ tool args" written, its mark not yet
        self._answer_open = False  # streamed text not yet ended by a newline
        self._spinner_stop = None
        self._spinner_thread = None
        self._lock = threading.Lock()

    # -- stdout: the answer ------------------------------------------------------------

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

    # -- stderr: everything else -------------------------------------------------------

    def note(self, text: str) -> None:
        if not self.quiet:
            self.line(text)

    def line(self, text: str) -> None:
        self.stop_spinner()
        self._stderr(text + "\n")

    def ask(self, question: str) -> None:
        """Show ``question`` on a line of its own, the cursor after it."""
        self.stop_spinner()
        self._stderr(question)

    def error(self, text: str) -> None:
        self.end_answer()
        self.line(f"lich: {text}")

    def tool_start(self, call) -> None:
        if self.quiet or self.json_lines:
            return
        self.stop_spinner()
        self.end_answer()
        self._stderr(self._paint("→ " + _tool_summary(call), "2"), leave_open=True)

    def tool_end(self, call, result) -> None:
        if self.quiet or self.json_lines:
            return
        mark = self._paint("✓", "32") if result.ok else self._paint("✗ " + _short_reason(result), "31")
        if self._tool_line_open:
            self._stderr(" " + mark + "\n", continues=True)
        else:  # a skipped call, or its line was ended by a question
            self._stderr(self._paint("→ " + _tool_summary(call), "2") + " " + mark + "\n")

    def start_spinner(self) -> None:
        if not self.color or self.quiet or self.json_lines or self._spinner_stop is not None:
            return
        stop = self._spinner_stop = threading.Event()

        def spin():
            frame = 0
            while not stop.wait(_SPINNER_INTERVAL):
                self._stderr(f"\r{_SPINNER_FRAMES[frame % len(_SPINNER_FRAMES)]} thinking")
                frame += 1
            self._stderr("\r\033[K")

        self._spinner_thread = threading.Thread(target=spin, daemon=True)
        self._spinner_thread.start()

    def stop_spinner(self) -> None:
        stop, self._spinner_stop = self._spinner_stop, None
        if stop is not None:
            stop.set()
            self._spinner_thread.join()

    def _stderr(self, text, *, continues=False, leave_open=False):
        """Write ``text``; an open tool line is ended first unless ``text`` continues it."""
        with self._lock:
            if self._tool_line_open and not continues:
                sys.stderr.write("\n")
            sys.stderr.write(text)
            sys.stderr.flush()
            self._tool_line_open = leave_open

    def _paint(self, text, code):
        return f"\033[{code}m{text}\033[0m" if self.color else text


class _Progress:
    """Shows one run's events on the terminal, and sums its usage as it goes."""

    def __init__(self, term: _Terminal):
        self.term = term
        self.usage = {"input_tokens": 0, "output_tokens": 0}
        self.muted = False  # the run was given up on (Ctrl-C) but its thread goes on
        self.compressing = False  # the chat's streamed words are a summary, not the answer
        self.thread = None  # the thread the run works in

    def __call__(self, event):
        if self.muted:
            return
        term, kind = self.term, event["type"]
        if kind == "llm_end":
            for key in self.usage:
                self.usage[key] += event["result"].usage.get(key, 0)
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
            term.tool_end(event["call"], event["result"])
        elif kind == "compress_start":
            self.compressing = True
        elif kind == "compress_end":
            self.compressing = False
            term.note(f"(history compressed: {event['summary_chars']} characters of summary)")
        elif kind == "error":
            term.stop_spinner()


def _log_to_stderr(term, level):
    """A logging handler that shows lich's log records on stderr through ``term``."""
    import logging

    class LogToStderr(logging.Handler):
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

    handler = LogToStderr(level)
    handler.term = term
    return handler


def _run_interruptibly(work, signal, term):
    """Run ``work()`` in a worker thread; Ctrl-C sets ``signal`` and gives it a moment.

    Returns work's result or raises its exception. A second Ctrl-C, or a worker still
    busy after the grace period (a blocking HTTP read), raises KeyboardInterrupt.
    """
    outcome = {}
    done = threading.Event()  # not Thread.join: a join cut by Ctrl-C can misreport is_alive

    def target():
        try:
            outcome["value"] = work()
        except BaseException as exc:
            outcome["error"] = exc
        finally:
            done.set()

    threading.Thread(target=target, name="lich-run", daemon=True).start()
    try:
        while not done.wait(0.1):
            pass
    except KeyboardInterrupt:
        signal.set()
        term.stop_spinner()
        term.end_answer()
        term.note("interrupted; stopping (Ctrl-C again to quit at once)")
        if not done.wait(_ABORT_GRACE_SECONDS):
            raise KeyboardInterrupt from None
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def _ask_approval(term: _Terminal, current_signal, always: set):
    """The ``approve`` function of interactive chat: y / n / a (always allow this tool)."""
    import select

    def approve(call) -> bool:
        name = call.get("name")
        if name in always:
            return True
        signal = current_signal()  # the signal of the run that asks
        term.ask("  allow? [y]es / [n]o / [a]lways ")
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
    paths = list_sessions(session_dir)
    if not paths:
        term.note("no sessions yet")
    for path in paths[:_LIST_SESSIONS_LIMIT]:
        try:
            messages = read_session_messages(path)
            when = time.strftime("%Y-%m-%d %H:%M", time.localtime(os.path.getmtime(path)))
        except OSError:  # removed meanwhile
            continue
        first = next((m["content"] for m in messages if m["role"] == "user"), "")
        first = " ".join(first.split())[:_TOOL_SUMMARY_CHARS]
        session_id = os.path.splitext(os.path.basename(path))[0]
        sys.stdout.write(f"{session_id}  {when}  {len(messages):>4} messages  {first}\n")
    if len(paths) > _LIST_SESSIONS_LIMIT:
        term.note(f"... {len(paths) - _LIST_SESSIONS_LIMIT} older sessions")
    return _EXIT_OK


def _load_session(session_dir, ref) -> list:
    try:
        return read_session_messages(resolve_session(session_dir, ref))
    except FileNotFoundError:
        raise SessionNotFound(f"session not found: {ref}") from None


def _describe_error(exc) -> str:
    """The one line a user sees for a failed run: the error's kind (or type) and message."""
    if isinstance(exc, ProviderError):
        return f"error: {exc.kind}: {exc}"
    return f"error: {type(exc).__name__}: {exc}"


class _Cli:
    """One invocation of the command line, its options resolved into a chat, tools and a terminal."""

    def __init__(self, args, environ, term: _Terminal):
        self.args = args
        self.term = term
        self.interactive = args.prompt is None and sys.stdin.isatty()
        self.streaming = not (args.no_stream or args.json)
        self.sessions_home = args.session_dir or _default_session_dir(environ)
        self.session_dir = None if args.no_session else self.sessions_home
        self.model = args.model or _default_model(environ)
        self.signal = threading.Event()  # the current run's: every run gets a fresh one
        self.progress = None  # the current run's _Progress
        allow = set(args.allow) | ({"write", "shell"} if args.yolo else set())
        approve = (_ask_approval(term, lambda: self.signal, set())
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
            options["on_delta"] = self._delta
        if args.base_url:
            options["base_url"] = args.base_url
        try:
            chat = chat_from_spec(self.model, **options)
        except (ValueError, TypeError) as exc:
            raise _UsageError(str(exc)) from None
        # retries live below the loop: a single provider gets them through a Router too
        self.chat = chat if isinstance(chat, Router) else Router([chat])

    def run(self, prompt, history, session):
        """One run_agent turn that Ctrl-C can stop; returns the AgentRunResult.

        Each run has its own signal and progress view: a run given up on (a second
        Ctrl-C, or one it did not honour in time) keeps its signal set and shows nothing
        more, even while its thread finishes the request it was blocked in.
        """
        signal = self.signal = threading.Event()
        progress = self.progress = _Progress(self.term)
        emitter = AgentEmitter()
        emitter.on_any(progress)
        args = self.args

        def work():
            progress.thread = threading.current_thread()
            return run_agent(prompt, chat=self.chat, tools=self.tools, history=history,
                             session=session, emitter=emitter, max_turns=args.max_turns,
                             system_prompt=self.system_prompt, temperature=args.temperature,
                             context_budget_tokens=args.context_budget or None, signal=signal)

        try:
            return _run_interruptibly(work, signal, self.term)
        except KeyboardInterrupt:
            progress.muted = True
            raise

    def _delta(self, text):
        """Streamed text, shown when it is the answer of the current run."""
        progress = self.progress
        if (progress.thread is threading.current_thread() and not progress.compressing
                and not progress.muted):
            self.term.delta(text)

    def open_session(self):
        """A new session file for the next run, or None when recording is off or impossible."""
        if self.session_dir is None:
            return None
        try:
            return open_session(self.session_dir, self.args.label)
        except OSError as exc:
            self.term.error(f"warning: session recording is off: cannot create a session file: "
                            f"{exc.strerror or exc}")
            self.session_dir = None
            return None

    def one_shot(self, prompt, history) -> int:
        """Run ``prompt`` once and show the outcome; returns the exit code."""
        term, args = self.term, self.args
        session = self.open_session()
        path = session.path if session is not None else None
        try:
            run = self.run(prompt, history, session)
        except (KeyboardInterrupt, AbortError):  # a given-up run may still write: no close
            term.end_answer()
            self._json_run_end("aborted", path)
            term.note("lich: stopped: interrupted")
            return _EXIT_INTERRUPTED
        except Exception:
            self._json_run_end("error", path)
            _close(session)
            raise
        _close(session)
        if args.json:
            self._json_run_end(run.stopped_reason, path)
        elif self.streaming:
            term.end_answer()
        else:
            last = run.final or (run.result.message if run.result else None)
            term.answer((last or {}).get("content") or "")
        if args.verbose:
            term.line(f"lich: usage: {run.usage_total['input_tokens']} input tokens, "
                      f"{run.usage_total['output_tokens']} output tokens")
        if run.stopped_reason == "budget":
            term.note(f"lich: stopped: the turn budget ({args.max_turns}) ran out before "
                      "a final answer; raise --max-turns or continue with -c")
            return _EXIT_BUDGET
        if run.stopped_reason == "aborted":
            term.note("lich: stopped: interrupted")
            return _EXIT_INTERRUPTED
        return _EXIT_OK

    def _json_run_end(self, stopped_reason, session_path):
        if self.args.json:
            self.term.json_line({"type": "run_end", "stopped_reason": stopped_reason,
                                 "usage": self.progress.usage, "session_path": session_path})

    def repl(self, history) -> int:
        """The interactive chat: one session file shared by its turns (a new one after
        /clear, /resume, or a turn given up on while its thread still runs)."""
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
                except UnicodeDecodeError:  # a terminal whose bytes are not the locale's
                    term.error("that line is not valid text in this terminal's encoding")
                    continue
                if line in ("/exit", "/quit"):
                    return _EXIT_OK
                if line.startswith("/"):
                    history, session = self._command(line, history, session)
                    continue
                if line:
                    history, session = self._turn(line, history, session)
        finally:
            _close(session)

    def _command(self, line, history, session):
        """A REPL command; returns the (history, session) to go on with."""
        term = self.term
        command, _, rest = line.partition(" ")
        if command == "/help":
            term.line(_REPL_HELP)
        elif command == "/sessions":
            _list_sessions(self.sessions_home, term)
        elif command == "/clear":
            _close(session)
            term.note("new conversation")
            return [], None
        elif command == "/resume":
            ref = rest.strip() or "latest"
            try:
                resumed = _load_session(self.sessions_home, ref)
            except SessionNotFound as exc:
                term.error(str(exc))
                return history, session
            _close(session)
            term.note(f"resumed {ref}: {len(resumed)} messages")
            return resumed, None
        else:
            term.error(f"unknown command {command}; /help lists them")
        return history, session

    def _turn(self, prompt, history, session):
        """One chat turn of the REPL; returns the (history, session) to go on with."""
        term = self.term
        if session is None:
            session = self.open_session()
        try:
            run = self.run(prompt, history, session)
        except KeyboardInterrupt:  # given up on: its thread may still write to that session
            term.end_answer()
            term.note("interrupted")
            return history, None
        except AbortError:
            term.end_answer()
            term.note("interrupted")
            return history, session
        except Exception as exc:
            import logging

            logging.getLogger("lich").debug("the turn failed", exc_info=True)
            term.error(_describe_error(exc))
            return history, session
        if self.streaming:
            term.end_answer()
        else:
            term.answer((run.final or {}).get("content") or "")
        if run.stopped_reason == "budget":
            term.note(f"stopped: the turn budget ({self.args.max_turns}) ran out")
        return run.messages, session


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
    try:
        args = _build_parser().parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a usage error argparse has shown
        return exc.code if isinstance(exc.code, int) else _EXIT_USAGE
    import logging

    color = sys.stderr.isatty() and not os.environ.get("NO_COLOR")
    term = _Terminal(quiet=args.quiet, json_lines=args.json, color=color)
    handler = _log_to_stderr(term, logging.DEBUG if args.verbose else logging.WARNING)
    logger = logging.getLogger("lich")
    previous_level = logger.level
    logger.addHandler(handler)
    if args.verbose:
        logger.setLevel(logging.DEBUG)
    try:
        return _run_cli(args, os.environ, term)
    except (_UsageError, SessionNotFound) as exc:
        term.error(str(exc))
        return _EXIT_USAGE
    except KeyboardInterrupt:
        return _EXIT_INTERRUPTED
    except Exception as exc:
        logger.debug("the run failed", exc_info=True)
        term.error(_describe_error(exc))
        return _EXIT_ERROR
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous_level)


def _run_cli(args, environ, term) -> int:
    if args.list_sessions:
        return _list_sessions(args.session_dir or _default_session_dir(environ), term)
    cli = _Cli(args, environ, term)
    history = [] if args.resume is None else _load_session(cli.sessions_home, args.resume)
    if cli.interactive:
        return cli.repl(history)
    piped = None if sys.stdin.isatty() else _read_piped()
    return cli.one_shot(_prompt_with_stdin(args.prompt, piped), history)


if __name__ == "__main__":
    sys.exit(main())
