"""Tests for lich.py; the sections follow lich.py's banners, fixtures and helpers first."""

import json
import os
import re
import socket
import struct
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

import lich

HERE = Path(__file__).resolve().parent
LICH_PY = HERE / "lich.py"
FIXTURES = HERE.parent / "shared" / "fixtures" / "providers"
needs_fixtures = pytest.mark.skipif(
    not FIXTURES.is_dir(), reason="../shared/fixtures/providers is absent")


# ============================================================================
# Fixtures and helpers
# ============================================================================

_ENV_TO_CLEAR = (
    "OPENAI_API_KEY", "OPENAI_BASE_URL", "ANTHROPIC_API_KEY", "ANTHROPIC_BASE_URL",
    "LICH_MODEL", "LICH_SESSION_DIR", "XDG_STATE_HOME", "NO_COLOR",
    "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy",
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    """No provider keys or proxies from the developer's shell; sessions go under tmp_path."""
    for name in _ENV_TO_CLEAR:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("LICH_SESSION_DIR", str(tmp_path / "sessions"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))


class Reply:
    """One queued answer of the loopback server.

    ``body`` is bytes, str, or a JSON-ready value (sent as application/json). With
    ``chunks``, the body is sent in chunked encoding piece by piece, ``delay`` seconds
    apart; ``reset_after`` chunks have gone out, the connection is reset instead of
    finished (``reset_after=0``: before any header).
    """

    def __init__(self, status=200, body=b"", *, headers=None, chunks=None, delay=0.0,
                 reset_after=None, content_type=None):
        self.status = status
        self.headers = dict(headers or {})
        self.chunks = None if chunks is None else [_as_bytes(c) for c in chunks]
        self.delay = delay
        self.reset_after = reset_after
        if isinstance(body, (bytes, str)):
            self.body = _as_bytes(body)
            self.content_type = content_type or "text/plain"
        else:
            self.body = json.dumps(body).encode()
            self.content_type = content_type or "application/json"
        if chunks is not None and content_type is None:
            self.content_type = "text/event-stream"


def _as_bytes(value):
    return value.encode() if isinstance(value, str) else value


def sse(*events):
    """SSE text from (event_name or None, data) pairs; data that is not a str is JSON-encoded."""
    out = []
    for name, data in events:
        if name:
            out.append(f"event: {name}\n")
        out.append(f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n")
    return "".join(out)


class LoopbackServer:
    """A real HTTP server on 127.0.0.1 in a daemon thread.

    Tests queue replies with ``reply(...)`` (or set ``responder`` to a function of the
    request returning a Reply) and read back ``requests``: dicts with method, path,
    headers (lower-cased names), body bytes and json (or None).
    """

    def __init__(self):
        self.replies = []
        self.requests = []
        self.responder = None
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_POST(self):
                server._handle(self)

            do_GET = do_POST

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def reply(self, *args, **kwargs):
        """Queue one reply (the arguments of Reply)."""
        with self.lock:
            self.replies.append(Reply(*args, **kwargs))

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()

    def _handle(self, handler):
        length = int(handler.headers.get("Content-Length") or 0)
        raw = handler.rfile.read(length) if length else b""
        try:
            parsed = json.loads(raw) if raw else None
        except ValueError:
            parsed = None
        request = {"method": handler.command, "path": handler.path,
                   "headers": {k.lower(): v for k, v in handler.headers.items()},
                   "body": raw, "json": parsed}
        with self.lock:
            self.requests.append(request)
            if self.responder is not None:
                reply = self.responder(request)
            elif self.replies:
                reply = self.replies.pop(0)
            else:
                reply = Reply(500, "no reply queued")
        if reply.reset_after == 0:
            _reset(handler)
            return
        handler.send_response(reply.status)
        handler.send_header("Content-Type", reply.content_type)
        for name, value in reply.headers.items():
            handler.send_header(name, value)
        if reply.chunks is None:
            handler.send_header("Content-Length", str(len(reply.body)))
            handler.end_headers()
            handler.wfile.write(reply.body)
            handler.wfile.flush()
            return
        handler.send_header("Transfer-Encoding", "chunked")
        handler.end_headers()
        handler.wfile.flush()
        try:
            for i, chunk in enumerate(reply.chunks):
                if reply.reset_after is not None and i >= reply.reset_after:
                    _reset(handler)
                    return
                if reply.delay:
                    time.sleep(reply.delay)
                if chunk:
                    handler.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    handler.wfile.flush()
            if reply.reset_after is not None:
                _reset(handler)
                return
            handler.wfile.write(b"0\r\n\r\n")
            handler.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            handler.close_connection = True


def _reset(handler):
    """Drop the connection with a TCP reset."""
    handler.wfile.flush()
    handler.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    handler.close_connection = True
    handler.connection.close()


@pytest.fixture
def server():
    srv = LoopbackServer()
    yield srv
    srv.close()


class ScriptedChat:
    """A real ChatFn that answers from a script and records what it was asked.

    Each script entry is an assistant message dict, a ChatResult, an exception (raised),
    or a callable taking the messages and returning one of those.
    """

    def __init__(self, *script):
        self.script = list(script)
        self.calls = []

    def __call__(self, messages, *, tools=None, temperature=None, max_tokens=None, signal=None):
        self.calls.append({"messages": [dict(m) for m in messages], "tools": tools,
                           "temperature": temperature, "max_tokens": max_tokens,
                           "signal": signal})
        if not self.script:
            raise AssertionError("ScriptedChat ran out of replies")
        step = self.script.pop(0)
        if callable(step) and not isinstance(step, type):
            step = step(messages)
        if isinstance(step, BaseException):
            raise step
        if isinstance(step, lich.ChatResult):
            return step
        return lich.ChatResult(message=step, usage={"input_tokens": 10, "output_tokens": 2},
                               model="scripted", stop_reason="tool_calls" if step.get("tool_calls") else "stop")


def assistant(content="", *calls):
    """An assistant message; each call is (id, name, arguments)."""
    msg = {"role": "assistant", "content": content}
    if calls:
        msg["tool_calls"] = [{"id": i, "name": n, "arguments": a} for i, n, a in calls]
    return msg


def run_lich(*args, input=None, env=None, timeout=60, cwd=None):
    """Run ``python lich.py ARGS`` as a subprocess; returns the CompletedProcess (text)."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run([sys.executable, str(LICH_PY), *args], input=input, env=full_env,
                          capture_output=True, text=True, timeout=timeout, cwd=cwd, check=False)


# ============================================================================
# Errors
# ============================================================================


@pytest.mark.parametrize("kind, retryable", [
    ("auth", False), ("bad_request", False), ("not_found", False), ("overflow", False),
    ("invalid_response", False), ("rate_limit", True), ("overloaded", True), ("server", True),
    ("timeout", True), ("network", True),
])
def test_provider_error_retryable_by_kind(kind, retryable):
    err = lich.ProviderError("boom", kind, status=500, provider="openai")
    assert (str(err), err.kind, err.status, err.provider, err.retryable, err.retry_after) == (
        "boom", kind, 500, "openai", retryable, None)


def test_provider_error_explicit_retryable_wins():
    err = lich.ProviderError("quota", "rate_limit", retryable=False, retry_after=2.5)
    assert (err.retryable, err.retry_after) == (False, 2.5)


def test_session_not_found_is_a_lookup_error():
    assert issubclass(lich.SessionNotFound, LookupError)
    assert str(lich.SessionNotFound("session not found: x")) == "session not found: x"


# ============================================================================
# Data
# ============================================================================


def test_chat_result_defaults_are_independent():
    a, b = lich.ChatResult({"role": "assistant", "content": ""}), lich.ChatResult({})
    a.usage["input_tokens"] = 5
    assert (b.usage, b.model, b.stop_reason) == ({"input_tokens": 0, "output_tokens": 0}, None, None)


def test_tool_result_and_loop_outcome_fields():
    assert lich.ToolResult(ok=True) == lich.ToolResult(True, "", None)
    outcome = lich.LoopOutcome([], None, None, 0, "aborted")
    assert [f for f in vars(outcome)] == ["messages", "final", "result", "turns_used",
                                          "stopped_reason"]


class EchoTools:
    """A minimal ToolRunner: echoes arguments, fails on the tool named "fail"."""

    def __init__(self, raise_on=None):
        self.raise_on = raise_on
        self.calls = []

    def specs(self):
        return [{"name": "echo", "description": "Echo.", "parameters": {"type": "object"}}]

    def run(self, call, signal=None):
        self.calls.append(call)
        if call["name"] == self.raise_on:
            raise RuntimeError("runner broke")
        if call["name"] == "fail":
            return lich.ToolResult(ok=False, output="partial", error="it failed")
        return lich.ToolResult(ok=True, output="echo:" + call["arguments"])


def test_tool_runner_protocol_is_structural():
    assert isinstance(EchoTools(), lich.ToolRunner)
    assert not isinstance(object(), lich.ToolRunner)


# ============================================================================
# Events
# ============================================================================


def test_emitter_delivers_by_type_and_to_any_in_subscription_order():
    emitter, seen = lich.AgentEmitter(), []
    emitter.on("turn_start", lambda e: seen.append(("typed", e["turn"])))
    emitter.on_any(lambda e: seen.append(("any", e["type"])))
    emitter.emit({"type": "turn_start", "turn": 1})
    emitter.emit({"type": "turn_end", "turn": 1})
    assert seen == [("typed", 1), ("any", "turn_start"), ("any", "turn_end")]


def test_emitter_unsubscribe_is_idempotent():
    emitter, seen = lich.AgentEmitter(), []
    unsubscribe = emitter.on_any(seen.append)
    unsubscribe()
    unsubscribe()
    emitter.emit({"type": "x"})
    assert seen == []


def test_emitter_iterates_a_snapshot():
    emitter, seen = lich.AgentEmitter(), []
    unsubscribers = {}

    def first(event):
        seen.append("first")
        unsubscribers["first"]()
        unsubscribers["second"]()

    unsubscribers["first"] = emitter.on_any(first)
    unsubscribers["second"] = emitter.on_any(lambda e: seen.append("second"))
    emitter.emit({"type": "x"})
    emitter.emit({"type": "x"})
    assert seen == ["first", "second"]


def test_emitter_logs_and_swallows_a_raising_handler(caplog):
    emitter, seen = lich.AgentEmitter(), []

    def broken(event):
        raise ValueError("handler bug")

    emitter.on_any(broken)
    emitter.on_any(seen.append)
    with caplog.at_level("ERROR", logger="lich"):
        emitter.emit({"type": "turn_start", "turn": 1})
    assert seen == [{"type": "turn_start", "turn": 1}]
    [record] = caplog.records
    assert (record.name, record.levelname, record.exc_info[0]) == ("lich", "ERROR", ValueError)


# ============================================================================
# Tokens and compression
# ============================================================================


@pytest.mark.parametrize("text, tokens", [
    ("", 0), ("a", 1), ("abcd", 1), ("abcde", 2), ("x" * 8, 2), ("x" * 9, 3), ("é" * 4, 1),
], ids=["empty", "1", "4", "5", "8", "9", "non-ascii"])
def test_estimate_text_tokens(text, tokens):
    assert lich.estimate_text_tokens(text) == tokens


_CALLS = [{"id": "c1", "name": "read", "arguments": "{\"p\": \"é\"}"}]


@pytest.mark.parametrize("message, tokens", [
    ({"role": "user", "content": "12345"}, 2),
    ({"role": "system", "content": "1234"}, 1),
    ({"role": "assistant", "content": "1234"}, 1),
    ({"role": "assistant", "content": "1234", "tool_calls": []}, 1),
    ({"role": "assistant", "content": "", "tool_calls": _CALLS},
     lich.estimate_text_tokens('[{"id":"c1","name":"read","arguments":"{\\"p\\": \\"é\\"}"}]')),
    ({"role": "tool", "tool_call_id": "c1", "name": "read", "content": "12345", "is_error": False},
     2 + 8),
    ({"role": "tool", "tool_call_id": "c1", "name": "read", "content": "", "is_error": True}, 8),
], ids=["user", "system", "assistant", "assistant-empty-calls", "assistant-calls", "tool",
        "tool-empty"])
def test_estimate_messages_tokens_per_message(message, tokens):
    assert lich.estimate_messages_tokens([message]) == tokens


def test_estimate_of_tool_calls_is_compact_unescaped_json():
    text = json.dumps(_CALLS, separators=(",", ":"), ensure_ascii=False)
    assert text == '[{"id":"c1","name":"read","arguments":"{\\"p\\": \\"é\\"}"}]'
    assert lich.estimate_messages_tokens([{"role": "assistant", "content": "", "tool_calls": _CALLS}]) == 14


def test_estimate_of_a_history_is_the_sum():
    history = [{"role": "user", "content": "x" * 10},
               {"role": "tool", "tool_call_id": "a", "name": "n", "content": "y", "is_error": False}]
    assert lich.estimate_messages_tokens(history) == 3 + 9


def test_working_history_estimate_stays_exact_through_changes():
    history = lich._History([{"role": "user", "content": "x" * 10}])
    assert history.estimated_tokens() == 3
    history.append({"role": "assistant", "content": "", "tool_calls": _CALLS})
    history.extend([{"role": "tool", "tool_call_id": "c1", "name": "read", "content": "ok",
                     "is_error": False}])
    assert lich.estimate_messages_tokens(history) == lich.estimate_messages_tokens(list(history))
    history[:] = [{"role": "user", "content": "abc"}]
    assert lich.estimate_messages_tokens(history) == 1
    del history[0]
    history.insert(0, {"role": "user", "content": "x" * 40})
    assert lich.estimate_messages_tokens(history) == 10


@pytest.mark.parametrize("budget, threshold, expected", [
    (10, 0.8, True), (11, 0.8, False), (8, 1.0, True), (9, 1.0, False),
], ids=["at-threshold", "below", "threshold-1-at", "threshold-1-below"])
def test_should_compress_at_budget_times_threshold(budget, threshold, expected):
    history = [{"role": "user", "content": "x" * 32}]  # 8 tokens
    assert lich.should_compress(history, budget, threshold) is expected


def test_compression_constants():
    assert (lich.KEEP_RECENT_TURNS, lich.TRANSCRIPT_MAX_CHARS) == (8, 24_000)
    assert lich.COMPRESSION_SYSTEM_PROMPT == (
        "You compress agent conversation history into terse factual summaries. Preserve: goals, "
        "decisions, file paths, commands run, errors, open questions. Output plain text only.")


def user(text):
    return {"role": "user", "content": text}


def tool_msg(call_id, content="ok", name="echo", is_error=False):
    return {"role": "tool", "tool_call_id": call_id, "name": name, "content": content,
            "is_error": is_error}


def long_history(n, size=40):
    """A system message then ``n`` alternating user / assistant messages of ``size`` chars."""
    msgs = [{"role": "system", "content": "sys"}]
    for i in range(n):
        msgs.append(user(f"u{i}".ljust(size, ".")) if i % 2 == 0 else assistant(f"a{i}".ljust(size, ".")))
    return msgs


def test_compress_messages_partitions_and_summarises():
    history = long_history(12)
    chat = ScriptedChat(assistant("the summary"))
    new, chars = lich.compress_messages(chat, history)
    assert (new, chars) == ([history[0], user("[context summary of earlier turns]\nthe summary\n[end summary]"),
                             *history[5:]], len("the summary"))
    [call] = chat.calls
    transcript = "\n".join(f"[{m['role']}] {m['content']}" for m in history[1:5])
    assert call["messages"] == [{"role": "system", "content": lich.COMPRESSION_SYSTEM_PROMPT},
                                {"role": "user", "content": transcript}]
    assert call["tools"] is None


def test_compress_keeps_system_messages_wherever_they_are():
    history = long_history(10)
    history.insert(3, {"role": "system", "content": "late system"})
    new, _ = lich.compress_messages(ScriptedChat(assistant("s")), history)
    assert [m["content"] for m in new[:2]] == ["sys", "late system"]
    assert new[3:] == [m for m in history if m["role"] != "system"][-8:]


def test_compress_never_splits_a_tool_call_from_its_results():
    calls = [("c1", "echo", "{}"), ("c2", "echo", "{}"), ("c3", "echo", "{}")]
    history = [{"role": "system", "content": "sys"}, user("u0"), assistant("a1"), user("u2"),
               assistant("", *calls), tool_msg("c1"), tool_msg("c2"), tool_msg("c3"),
               assistant("a8"), user("u9"), assistant("a10"), user("u11"), assistant("a12")]
    chat = ScriptedChat(assistant("sum"))
    new, _ = lich.compress_messages(chat, history)
    # the last 8 non-system messages start at tool c2: the slice reaches back to its assistant
    assert new[2:] == history[4:]
    assert chat.calls[0]["messages"][1]["content"] == "[user] u0\n[assistant] a1\n[user] u2"


def test_compress_transcript_shows_tool_calls():
    chat = ScriptedChat(assistant("s"))
    lich.compress_messages(chat, [user("first"), assistant("", ("c1", "read", '{"p":1}')),
                                  tool_msg("c1", "out"), *long_history(8)[1:]])
    assert chat.calls[0]["messages"][1]["content"] == (
        '[user] first\n[assistant]  tool_calls=[{"id":"c1","name":"read","arguments":"{\\"p\\":1}"}]'
        "\n[tool] out")


def test_compress_transcript_is_cut_at_24000_chars():
    chat = ScriptedChat(assistant("s"))
    lich.compress_messages(chat, [user("x" * 30_000), *long_history(8)[1:]])
    transcript = chat.calls[0]["messages"][1]["content"]
    assert transcript == "[user] " + "x" * 23_993


@pytest.mark.parametrize("failure", [lich.ProviderError("down", "server"), RuntimeError("bug"),
                                     assistant("   ")], ids=["provider-error", "bug", "empty-summary"])
def test_compress_falls_back_to_the_original_messages(failure, caplog):
    history = long_history(12)
    with caplog.at_level("WARNING", logger="lich"):
        new, chars = lich.compress_messages(ScriptedChat(failure), history)
    assert (new, chars) == (history, 0)
    assert [r.levelname for r in caplog.records] == ["WARNING"]


def recorder_emitter():
    emitter, events = lich.AgentEmitter(), []
    emitter.on_any(events.append)
    return emitter, events


@pytest.mark.parametrize("budget, messages, attempted", [
    (None, long_history(20), False),
    (10_000, long_history(20), False),
    (1, long_history(8), False),
    (1, long_history(9), True),
], ids=["no-budget", "below-threshold", "8-non-system", "9-non-system"])
def test_compress_if_needed_gates(budget, messages, attempted):
    chat, (emitter, events) = ScriptedChat(assistant("sum")), recorder_emitter()
    history = list(messages)
    chars = lich.compress_if_needed(chat, history, context_budget_tokens=budget, emitter=emitter)
    if attempted:
        estimate = lich.estimate_messages_tokens(messages)
        assert chars == 3
        assert events == [{"type": "compress_start", "estimated_tokens": estimate},
                          {"type": "compress_end", "summary_chars": 3}]
        assert history == [messages[0], user("[context summary of earlier turns]\nsum\n[end summary]"),
                           *messages[2:]]
    else:
        assert (chars, events, chat.calls, history) == (None, [], [], messages)


def test_compress_if_needed_skips_when_only_a_tool_batch_is_left():
    calls = [(f"c{i}", "echo", "{}") for i in range(9)]
    batch = [assistant("", *calls), *[tool_msg(f"c{i}") for i in range(9)]]
    history = [{"role": "system", "content": "s"}, *batch]
    assert lich.compress_if_needed(ScriptedChat(), history, context_budget_tokens=1) is None
    history = [user("u0"), assistant("a1"), *batch]
    assert lich.compress_if_needed(ScriptedChat(assistant("s")), history, context_budget_tokens=1) == 1
    assert [m["role"] for m in history[:2]] == ["user", "assistant"]
    assert history[0]["content"] == "[context summary of earlier turns]\ns\n[end summary]"


def test_compress_if_needed_fallback_emits_zero():
    emitter, events = recorder_emitter()
    history = long_history(12)
    before = list(history)
    chars = lich.compress_if_needed(ScriptedChat(RuntimeError("x")), history, context_budget_tokens=1,
                                    compress_threshold=0.5, emitter=emitter)
    assert (chars, history) == (0, before)
    assert [e["type"] for e in events] == ["compress_start", "compress_end"]
    assert events[1] == {"type": "compress_end", "summary_chars": 0}


# ============================================================================
# The loop
# ============================================================================


def run_loop(*script, tools=None, messages=None, **params):
    """Run the loop over a ScriptedChat; returns (outcome, events, chat)."""
    chat, (emitter, events) = ScriptedChat(*script), recorder_emitter()
    params.setdefault("max_turns", 10)
    outcome = lich.run_conversation(chat, tools, messages if messages is not None else [user("hi")],
                                    emitter=emitter, **params)
    return outcome, events, chat


def types(events):
    return [e["type"] for e in events]


def test_scenario_a_tool_then_final():
    tools = EchoTools()
    outcome, events, chat = run_loop(assistant("", ("c1", "echo", '{"x":1}')), assistant("done"),
                                     tools=tools)
    call = {"id": "c1", "name": "echo", "arguments": '{"x":1}'}
    final_result = outcome.result
    assert types(events) == ["turn_start", "llm_start", "llm_end", "tool_call_start",
                             "tool_call_end", "turn_start", "llm_start", "llm_end", "final",
                             "turn_end"]
    tool_result = lich.ToolResult(ok=True, output='echo:{"x":1}')
    assert events[3:5] == [{"type": "tool_call_start", "turn": 1, "call": call},
                           {"type": "tool_call_end", "turn": 1, "call": call, "result": tool_result,
                            "cancelled": False}]
    assert events[0] == {"type": "turn_start", "turn": 1}
    assert events[2]["result"].message == assistant("", ("c1", "echo", '{"x":1}'))
    assert events[5:8:2] == [{"type": "turn_start", "turn": 2},
                             {"type": "llm_end", "turn": 2, "result": final_result}]
    assert events[8:] == [{"type": "final", "message": assistant("done"), "result": final_result},
                          {"type": "turn_end", "turn": 2}]
    assert outcome == lich.LoopOutcome(
        messages=[user("hi"), assistant("", ("c1", "echo", '{"x":1}')),
                  tool_msg("c1", 'echo:{"x":1}'), assistant("done")],
        final=assistant("done"), result=outcome.result, turns_used=2, stopped_reason="final")
    assert outcome.result.message == assistant("done")
    assert tools.calls == [call]
    assert chat.calls[0]["tools"] == tools.specs()


def test_final_on_turn_one():
    outcome, events, _ = run_loop(assistant("hello"), max_turns=1)
    assert types(events) == ["turn_start", "llm_start", "llm_end", "final", "turn_end"]
    assert (outcome.stopped_reason, outcome.turns_used, outcome.final) == ("final", 1, assistant("hello"))


def test_empty_tool_calls_list_is_final():
    message = {"role": "assistant", "content": "answer", "tool_calls": []}
    outcome, events, _ = run_loop(message)
    assert (outcome.stopped_reason, outcome.final, types(events)[-2:]) == (
        "final", message, ["final", "turn_end"])


def test_budget_path_cancels_calls_on_the_last_turn():
    tools = EchoTools()
    script = [assistant("", ("c1", "echo", "{}")), assistant("more", ("c2", "echo", "{}"), ("c3", "echo", "{}"))]
    outcome, events, _ = run_loop(*script, tools=tools, max_turns=2)
    assert types(events) == ["turn_start", "llm_start", "llm_end", "tool_call_start", "tool_call_end",
                             "turn_start", "llm_start", "llm_end", "tool_call_end", "tool_call_end",
                             "budget_exhausted", "turn_end"]
    skipped = lich.ToolResult(ok=False, error="turn_budget_exhausted")
    call2 = {"id": "c2", "name": "echo", "arguments": "{}"}
    assert events[8] == {"type": "tool_call_end", "turn": 2, "call": call2, "result": skipped,
                         "cancelled": True}
    assert events[10:] == [{"type": "budget_exhausted", "turns_used": 2}, {"type": "turn_end", "turn": 2}]
    content = '{"ok": false, "output": "", "error": "turn_budget_exhausted"}'
    assert outcome.messages[-2:] == [tool_msg("c2", content, is_error=True),
                                     tool_msg("c3", content, is_error=True)]
    assert (outcome.stopped_reason, outcome.turns_used, outcome.final) == ("budget", 2, None)
    assert outcome.result.message == script[1]
    assert [c["id"] for c in tools.calls] == ["c1"]


def test_budget_of_one_turn_runs_no_tool():
    tools = EchoTools()
    outcome, events, _ = run_loop(assistant("", ("c1", "echo", "{}")), tools=tools, max_turns=1)
    assert types(events) == ["turn_start", "llm_start", "llm_end", "tool_call_end",
                             "budget_exhausted", "turn_end"]
    assert (tools.calls, outcome.turns_used, outcome.stopped_reason) == ([], 1, "budget")


def test_abort_before_the_first_turn():
    signal = threading.Event()
    signal.set()
    outcome, events, chat = run_loop(signal=signal)
    assert types(events) == ["turn_start", "error"]
    error = events[1]["error"]
    assert (type(error), str(error)) == (lich.AbortError, "agent loop aborted")
    assert outcome == lich.LoopOutcome([user("hi")], None, None, 0, "aborted")
    assert chat.calls == []


class SignallingTools(EchoTools):
    """Sets the signal while running the call named "stop"."""

    def __init__(self, signal):
        super().__init__()
        self.signal = signal

    def run(self, call, signal=None):
        if call["name"] == "stop":
            self.signal.set()
        return super().run(call, signal)


def test_abort_mid_batch_skips_unstarted_calls_then_stops_at_the_next_turn():
    signal = threading.Event()
    tools = SignallingTools(signal)
    outcome, events, chat = run_loop(
        assistant("", ("c1", "stop", "{}"), ("c2", "echo", "{}")), tools=tools, signal=signal)
    assert types(events) == ["turn_start", "llm_start", "llm_end", "tool_call_start", "tool_call_end",
                             "tool_call_end", "turn_start", "error"]
    assert events[4]["cancelled"] is False
    assert events[5] == {"type": "tool_call_end", "turn": 1, "call": {"id": "c2", "name": "echo", "arguments": "{}"},
                         "result": lich.ToolResult(ok=False, error="aborted"), "cancelled": True}
    assert outcome.messages[-1] == tool_msg("c2", '{"ok": false, "output": "", "error": "aborted"}',
                                            is_error=True)
    assert (outcome.stopped_reason, outcome.turns_used, outcome.result, outcome.final) == (
        "aborted", 1, None, None)
    assert [c["id"] for c in tools.calls] == ["c1"] and len(chat.calls) == 1


def test_budget_path_wins_over_the_signal_on_the_last_turn():
    signal = threading.Event()
    tools = SignallingTools(signal)

    def chat_sets_signal(messages):
        signal.set()
        return assistant("", ("c1", "echo", "{}"))

    outcome, events, _ = run_loop(chat_sets_signal, tools=tools, signal=signal, max_turns=1)
    assert types(events)[-3:] == ["tool_call_end", "budget_exhausted", "turn_end"]
    assert events[-3]["result"] == lich.ToolResult(ok=False, error="turn_budget_exhausted")
    assert (outcome.stopped_reason, tools.calls) == ("budget", [])


def test_chat_failure_emits_error_and_reraises_the_same_object(caplog):
    failure = lich.ProviderError("down", "server")
    chat, (emitter, events) = ScriptedChat(failure), recorder_emitter()
    with caplog.at_level("DEBUG", logger="lich"), pytest.raises(lich.ProviderError) as info:
        lich.run_conversation(chat, None, [user("hi")], max_turns=3, emitter=emitter)
    assert info.value is failure
    assert events == [{"type": "turn_start", "turn": 1}, {"type": "llm_start", "turn": 1},
                      {"type": "error", "error": failure}]
    assert [(r.levelname, r.exc_info[1]) for r in caplog.records] == [("DEBUG", failure)]


def test_a_raising_tool_runner_becomes_a_failed_result():
    outcome, events, _ = run_loop(assistant("", ("c1", "boom", "{}")), assistant("ok"),
                                  tools=EchoTools(raise_on="boom"))
    assert events[4]["result"] == lich.ToolResult(ok=False, error="RuntimeError: runner broke")
    assert outcome.messages[2] == tool_msg(
        "c1", '{"ok": false, "output": "", "error": "RuntimeError: runner broke"}', name="boom",
        is_error=True)
    assert outcome.stopped_reason == "final"


def test_tool_failures_are_data_for_the_model():
    outcome, _, chat = run_loop(assistant("", ("c1", "fail", "{}")), assistant("recovered"),
                                tools=EchoTools())
    expected = tool_msg("c1", '{"ok": false, "output": "partial", "error": "it failed"}',
                        name="fail", is_error=True)
    assert chat.calls[1]["messages"][-1] == expected
    assert outcome.final == assistant("recovered")


def test_no_tools_means_tools_none_and_calls_fail_as_data():
    outcome, _, chat = run_loop(assistant("", ("c1", "ghost", "{}")), assistant("ok"))
    assert [c["tools"] for c in chat.calls] == [None, None]
    assert outcome.messages[2]["is_error"] is True
    assert json.loads(outcome.messages[2]["content"])["error"] == (
        "no tools are available; answer without calling tools")


def test_empty_specs_are_offered_as_none():
    class NoSpecs(EchoTools):
        def specs(self):
            return []

    _, _, chat = run_loop(assistant("ok"), tools=NoSpecs())
    assert chat.calls[0]["tools"] is None


def test_tool_runner_returning_a_non_result_is_a_failure():
    class Wrong(EchoTools):
        def run(self, call, signal=None):
            return "text"

    outcome, _, _ = run_loop(assistant("", ("c1", "echo", "{}")), assistant("ok"), tools=Wrong())
    assert json.loads(outcome.messages[2]["content"])["error"] == (
        "TypeError: the tool runner returned str, not a ToolResult")


def test_temperature_max_tokens_and_signal_reach_the_chat():
    signal = threading.Event()
    _, _, chat = run_loop(assistant("ok"), temperature=0.2, max_tokens=99, signal=signal)
    assert (chat.calls[0]["temperature"], chat.calls[0]["max_tokens"], chat.calls[0]["signal"]) == (
        0.2, 99, signal)


def test_tool_runner_receives_the_signal():
    seen = []

    class Spy(EchoTools):
        def run(self, call, signal=None):
            seen.append(signal)
            return super().run(call, signal)

    signal = threading.Event()
    run_loop(assistant("", ("c1", "echo", "{}")), assistant("ok"), tools=Spy(), signal=signal)
    assert seen == [signal]


@pytest.mark.parametrize("max_turns, error", [
    (0, ValueError), (-1, ValueError), (1.5, TypeError), ("3", TypeError), (True, TypeError),
    (None, TypeError),
], ids=["zero", "negative", "float", "str", "bool", "none"])
def test_max_turns_must_be_a_positive_int(max_turns, error):
    chat = ScriptedChat(assistant("never"))
    with pytest.raises(error, match="max_turns must be an int >= 1"):
        lich.run_conversation(chat, None, [user("hi")], max_turns=max_turns)
    assert chat.calls == []


@pytest.mark.parametrize("messages, expected", [
    ([user("hi")], [{"role": "system", "content": "S"}, user("hi")]),
    ([{"role": "system", "content": "S"}, user("hi")], [{"role": "system", "content": "S"}, user("hi")]),
    ([user("a"), {"role": "system", "content": "old"}, user("hi")],
     [user("a"), {"role": "system", "content": "S"}, user("hi")]),
], ids=["prepend", "identical", "replace-in-place"])
def test_seed_system_prompt_rules(messages, expected):
    before = json.loads(json.dumps(messages))
    seeded = lich.seed_system_prompt(messages, "S")
    assert seeded == expected and seeded is not messages
    assert messages == before


def test_seed_system_prompt_none_copies():
    messages = [user("hi")]
    seeded = lich.seed_system_prompt(messages, None)
    assert seeded == messages and seeded is not messages


def test_the_callers_messages_are_never_mutated():
    messages = [{"role": "system", "content": "old"}, user("hi")]
    before = json.loads(json.dumps(messages))
    outcome, _, chat = run_loop(assistant("", ("c1", "echo", "{}")), assistant("done"), tools=EchoTools(),
                                messages=messages, system_prompt="new")
    assert messages == before
    assert chat.calls[0]["messages"] == [{"role": "system", "content": "new"}, user("hi")]
    assert outcome.messages[0] == {"role": "system", "content": "new"} and len(outcome.messages) == 5


def test_compression_runs_between_turn_start_and_llm_start():
    history = long_history(12)
    outcome, events, chat = run_loop(assistant("sum"), assistant("final"), messages=history,
                                     context_budget_tokens=50)
    assert types(events) == ["turn_start", "compress_start", "compress_end", "llm_start", "llm_end",
                             "final", "turn_end"]
    assert events[2] == {"type": "compress_end", "summary_chars": 3}
    summary = user("[context summary of earlier turns]\nsum\n[end summary]")
    assert chat.calls[1]["messages"] == [history[0], summary, *history[5:]]
    assert outcome.messages == [history[0], summary, *history[5:], assistant("final")]


def test_format_tool_result_content():
    assert lich.format_tool_result_content(lich.ToolResult(ok=True, output="raw ✓")) == "raw ✓"
    failed = lich.ToolResult(ok=False, output="é", error="bad")
    assert lich.format_tool_result_content(failed) == '{"ok": false, "output": "é", "error": "bad"}'


def test_tool_message_from_result():
    call = {"id": "c9", "name": "read_file", "arguments": "{}"}
    assert lich.tool_message_from_result(call, lich.ToolResult(ok=True, output="x")) == {
        "role": "tool", "tool_call_id": "c9", "name": "read_file", "content": "x", "is_error": False}


def test_call_chat_and_run_tool_calls_as_helpers():
    emitter, events = recorder_emitter()
    history = [user("hi")]
    result = lich.call_chat(ScriptedChat(assistant("x")), history, turn=3, emitter=emitter)
    calls = [{"id": "a", "name": "echo", "arguments": "1"}]
    lich.run_tool_calls(EchoTools(), calls, history, turn=3, emitter=emitter)
    assert events == [{"type": "llm_start", "turn": 3}, {"type": "llm_end", "turn": 3, "result": result},
                      {"type": "tool_call_start", "turn": 3, "call": calls[0]},
                      {"type": "tool_call_end", "turn": 3, "call": calls[0],
                       "result": lich.ToolResult(ok=True, output="echo:1"), "cancelled": False}]
    assert history == [user("hi"), tool_msg("a", "echo:1")]


# ============================================================================
# Sessions
# ============================================================================


TS = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z")


def records(path):
    """The records of a session file, each line checked whole, with "ts" checked and removed."""
    data = Path(path).read_bytes()
    assert data.endswith(b"\n")
    out = []
    for line in data.decode().split("\n")[:-1]:
        record = json.loads(line)
        assert TS.fullmatch(record.pop("ts")), line
        out.append(record)
    return out


def meta(**fields):
    return {"kind": "meta", "meta": fields}


def msg(message):
    return {"kind": "message", "message": message}


NAME = re.compile(r"(\d{8}T\d{6}Z)-(\d+)(-[A-Za-z0-9_.-]+)?\.jsonl")


def test_open_session_creates_a_private_directory_and_a_named_file(tmp_path):
    session_dir = tmp_path / "a" / "sessions"
    with lich.open_session(session_dir) as handle:
        match = NAME.fullmatch(os.path.basename(handle.path))
        assert match and match.group(2) == "1" and match.group(3) is None
        assert handle.id == os.path.basename(handle.path)[:-6]
        assert os.path.dirname(handle.path) == str(session_dir)
        assert repr(handle) == f"SessionHandle(id={handle.id!r})"
    assert (session_dir.stat().st_mode & 0o777, Path(handle.path).stat().st_mode & 0o777) == (0o700, 0o600)
    assert Path(handle.path).read_bytes() == b""


def test_session_counter_moves_on_across_labels(tmp_path):
    now = time.time()
    for t in (now, now + 1):
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(t))
        (tmp_path / f"{stamp}-1-other.jsonl").touch()
        (tmp_path / f"{stamp}-2.jsonl").touch()
    with lich.open_session(tmp_path, label="mine") as handle:
        assert NAME.fullmatch(os.path.basename(handle.path)).group(2, 3) == ("3", "-mine")


def test_two_sessions_in_one_second_never_share_a_file(tmp_path):
    handles = [lich.open_session(tmp_path) for _ in range(5)]
    assert len({h.path for h in handles}) == 5
    for h in handles:
        h.close()


def test_concurrent_sessions_with_different_labels_get_different_counters(tmp_path):
    paths = []

    def opener(label):
        for _ in range(40):
            with lich.open_session(tmp_path, label=label) as handle:
                paths.append(handle.path)

    threads = [threading.Thread(target=opener, args=(f"l{n}",)) for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stems = [NAME.fullmatch(os.path.basename(p)).group(1, 2) for p in paths]
    assert len(paths) == 240 and len(set(stems)) == 240
    assert sorted(os.listdir(tmp_path)) == sorted(os.path.basename(p) for p in paths)


@pytest.mark.parametrize("label, suffix", [
    ("fix bug #12", "-fix-bug-12"), ("../../etc", "-etc"), ("a..b", "-a.b"), ("ok_1.2-x", "-ok_1.2-x"),
    ("///", ""), ("", ""), ("é" * 3 + "x", "-x"), ("y" * 100, "-" + "y" * 64),
], ids=["spaces", "traversal", "dots", "clean", "only-bad", "empty", "non-ascii", "long"])
def test_session_labels_are_cleaned(tmp_path, label, suffix):
    with lich.open_session(tmp_path, label=label) as handle:
        assert NAME.fullmatch(os.path.basename(handle.path)).group(3) == (suffix or None)
        assert os.path.dirname(handle.path) == str(tmp_path)


def test_session_records_are_whole_lines(tmp_path):
    with lich.open_session(tmp_path) as handle:
        handle.append_meta({"event": "run_start", "input_chars": 2, "history_size": 0})
        handle.append_message({"role": "user", "content": "line\nbreak é \u2028"})
        handle.append_message({"role": "user", "content": "lone \ud800 surrogate"})
    lines = Path(handle.path).read_bytes().split(b"\n")
    assert len(lines) == 4 and lines[3] == b""
    assert records(handle.path) == [
        meta(event="run_start", input_chars=2, history_size=0),
        msg({"role": "user", "content": "line\nbreak é \u2028"}),
        msg({"role": "user", "content": "lone \ud800 surrogate"})]
    assert lines[1].startswith(b'{"ts":"') and b'"kind":"message","message":{' in lines[1]
    assert "é".encode() in lines[1]


def test_session_handle_refuses_appends_after_close(tmp_path):
    handle = lich.open_session(tmp_path)
    handle.close()
    handle.close()
    with pytest.raises(ValueError, match="is closed"):
        handle.append_meta({})


def test_session_handle_is_thread_safe(tmp_path):
    handle = lich.open_session(tmp_path)
    payload = "x" * 5000

    def writer(n):
        for i in range(200):
            handle.append_message({"role": "user", "content": f"{n}:{i}:{payload}"})

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    handle.close()
    contents = [r["message"]["content"] for r in records(handle.path)]
    assert sorted(contents) == sorted(f"{n}:{i}:{payload}" for n in range(8) for i in range(200))
    for n in range(8):
        mine = [c for c in contents if c.startswith(f"{n}:")]
        assert mine == [f"{n}:{i}:{payload}" for i in range(200)]


USAGE = {"input_tokens": 10, "output_tokens": 2}


def test_run_agent_records_a_whole_run(tmp_path):
    script = [assistant("", ("c1", "echo", "{}")), assistant("done")]
    run = lich.run_agent("hi", chat=ScriptedChat(*script), tools=EchoTools(), max_turns=5,
                         system_prompt="sys", session_dir=tmp_path, label="t")
    assert records(run.session_path) == [
        meta(event="run_start", input_chars=2, history_size=0),
        msg({"role": "system", "content": "sys"}), msg(user("hi")),
        msg(script[0]), msg(tool_msg("c1", "echo:{}")), msg(script[1]),
        meta(event="run_end", stopped_reason="final", usage={"input_tokens": 20, "output_tokens": 4})]
    assert run.session_path.endswith("-t.jsonl")
    assert (run.usage_total, run.final, run.turns_used, run.stopped_reason) == (
        {"input_tokens": 20, "output_tokens": 4}, script[1], 2, "final")
    assert run.messages == [{"role": "system", "content": "sys"}, user("hi"), script[0],
                            tool_msg("c1", "echo:{}"), script[1]]
    assert isinstance(run, lich.LoopOutcome)


def test_run_agent_records_history_and_the_budget_path(tmp_path):
    history = [user("earlier"), assistant("answer")]
    run = lich.run_agent("go", chat=ScriptedChat(assistant("", ("c1", "echo", "{}"))), tools=EchoTools(),
                         history=history, max_turns=1, session_dir=tmp_path)
    cancelled = tool_msg("c1", '{"ok": false, "output": "", "error": "turn_budget_exhausted"}',
                         is_error=True)
    assert records(run.session_path) == [
        meta(event="run_start", input_chars=2, history_size=2),
        msg(user("earlier")), msg(assistant("answer")), msg(user("go")),
        msg(assistant("", ("c1", "echo", "{}"))), msg(cancelled),
        meta(event="budget_exhausted", turns_used=1),
        meta(event="run_end", stopped_reason="budget", usage=USAGE)]
    assert history == [user("earlier"), assistant("answer")]


def test_run_agent_records_compression(tmp_path):
    history = long_history(12)[1:]
    run = lich.run_agent("go", chat=ScriptedChat(assistant("sum"), assistant("ok")), history=history,
                         max_turns=2, context_budget_tokens=50, session_dir=tmp_path)
    recs = records(run.session_path)
    assert recs[-3:] == [meta(event="compress", summary_chars=3), msg(assistant("ok")),
                         meta(event="run_end", stopped_reason="final", usage=USAGE)]
    assert run.usage_total == USAGE


def test_run_agent_records_run_error_and_reraises(tmp_path):
    failure = lich.ProviderError("quota exceeded", "rate_limit")
    with pytest.raises(lich.ProviderError) as info:
        lich.run_agent("hi", chat=ScriptedChat(failure), max_turns=2, session_dir=tmp_path)
    assert info.value is failure
    [path] = tmp_path.iterdir()
    assert records(path) == [meta(event="run_start", input_chars=2, history_size=0), msg(user("hi")),
                             meta(event="run_error", error="ProviderError: quota exceeded")]


def test_run_agent_records_an_aborted_run(tmp_path):
    signal = threading.Event()
    signal.set()
    run = lich.run_agent("hi", chat=ScriptedChat(), max_turns=2, session_dir=tmp_path, signal=signal)
    assert records(run.session_path)[-1] == meta(event="run_end", stopped_reason="aborted",
                                                 usage={"input_tokens": 0, "output_tokens": 0})
    assert (run.stopped_reason, run.turns_used, run.result) == ("aborted", 0, None)


def test_a_reused_handle_records_only_what_seeding_added(tmp_path):
    handle = lich.open_session(tmp_path)
    first = lich.run_agent("one", chat=ScriptedChat(assistant("1")), max_turns=2, session=handle,
                           system_prompt="sys")
    second = lich.run_agent("two", chat=ScriptedChat(assistant("2")), max_turns=2, session=handle,
                            history=first.messages, system_prompt="sys")
    third = lich.run_agent("three", chat=ScriptedChat(assistant("3")), max_turns=2, session=handle,
                           history=second.messages, system_prompt="new sys")
    handle.close()
    end = meta(event="run_end", stopped_reason="final", usage=USAGE)
    assert records(handle.path) == [
        meta(event="run_start", input_chars=3, history_size=0),
        msg({"role": "system", "content": "sys"}), msg(user("one")), msg(assistant("1")), end,
        meta(event="run_start", input_chars=3, history_size=3),
        msg(user("two")), msg(assistant("2")), end,
        meta(event="run_start", input_chars=5, history_size=5),
        msg({"role": "system", "content": "new sys"}), msg(user("three")), msg(assistant("3")), end]
    assert first.session_path == second.session_path == third.session_path == handle.path
    assert lich.read_session_messages(handle.path)[-2:] == [user("three"), assistant("3")]


def test_a_handle_new_to_run_agent_gets_the_whole_history(tmp_path):
    handle = lich.open_session(tmp_path)
    handle.append_meta({"event": "mine"})
    lich.run_agent("q", chat=ScriptedChat(assistant("a")), max_turns=1, session=handle,
                   history=[user("old"), assistant("older")])
    assert records(handle.path)[:5] == [meta(event="mine"), meta(event="run_start", input_chars=1, history_size=2),
                                        msg(user("old")), msg(assistant("older")), msg(user("q"))]
    handle.append_meta({"event": "still open"})
    handle.close()


def test_run_agent_without_a_session_records_nothing(tmp_path):
    run = lich.run_agent("hi", chat=ScriptedChat(assistant("a")), max_turns=1)
    assert (run.session_path, run.usage_total, list(tmp_path.iterdir())) == (None, USAGE, [])


def test_run_agent_shares_the_callers_emitter_and_unsubscribes(tmp_path):
    emitter, events = recorder_emitter()
    lich.run_agent("hi", chat=ScriptedChat(assistant("a")), max_turns=1, emitter=emitter,
                   session_dir=tmp_path)
    assert types(events) == ["turn_start", "llm_start", "llm_end", "final", "turn_end"]
    assert len(emitter._handlers) == 1


def test_run_agent_requires_max_turns():
    with pytest.raises(TypeError, match="max_turns"):
        lich.run_agent("hi", chat=ScriptedChat())
    with pytest.raises(ValueError, match="max_turns"):
        lich.run_agent("hi", chat=ScriptedChat(), max_turns=0)


def test_run_agent_goes_on_when_the_session_cannot_be_created(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with caplog.at_level("WARNING", logger="lich"):
        run = lich.run_agent("hi", chat=ScriptedChat(assistant("a")), max_turns=1,
                             session_dir=blocker / "sessions")
    assert (run.stopped_reason, run.session_path) == ("final", None)
    [record] = caplog.records
    assert record.getMessage().startswith("session recording is off: cannot create a session file:")


def test_a_failing_session_write_warns_once_and_the_run_goes_on(tmp_path, caplog):
    handle = lich.open_session(tmp_path)
    handle.close()
    with caplog.at_level("WARNING", logger="lich"):
        run = lich.run_agent("hi", chat=ScriptedChat(assistant("", ("c", "echo", "{}")), assistant("a")),
                             tools=EchoTools(), max_turns=3, session=handle)
    assert (run.stopped_reason, run.session_path) == ("final", handle.path)
    assert [r.getMessage() for r in caplog.records] == [
        f"session recording stopped: {handle.id}: ValueError: session {handle.id} is closed"]


def write_records(path, *lines):
    """A session file from records (dicts, written as JSON) and raw lines (bytes or str)."""
    with open(path, "wb") as f:
        for line in lines:
            if isinstance(line, dict):
                line = json.dumps(line)
            f.write(line if isinstance(line, bytes) else line.encode())
            if not (line.endswith(b"\n") if isinstance(line, bytes) else line.endswith("\n")):
                f.write(b"\n")
    return path


def test_read_session_messages_is_lenient(tmp_path):
    path = write_records(
        tmp_path / "s.jsonl",
        meta(event="run_start"), msg(user("hi")), "not json", b"\xff\xfe invalid utf-8",
        "[1, 2]", "42", "", msg({"role": "robot", "content": "x"}), {"kind": "other", "message": user("x")},
        msg("a string"), msg({"role": "user", "content": ["blocks"]}),
        "[" * 100_000 + "]" * 100_000, msg(assistant("answer")),
        json.dumps(msg(user("crlf"))) + "\r\n", msg(assistant("second")),
        msg({"role": "assistant", "content": None}),
        b'{"ts": "x", "kind": "message", "message": {"role": "user", "con')
    assert lich.read_session_messages(path) == [user("hi"), assistant("answer"), user("crlf"),
                                               assistant("second"), assistant("")]


def test_read_session_messages_drops_every_trailing_user_message(tmp_path):
    path = write_records(tmp_path / "s.jsonl", msg(user("q")), msg(assistant("a")),
                         msg(user("retry 1")), meta(event="run_error", error="x"), msg(user("retry 2")))
    assert lich.read_session_messages(path) == [user("q"), assistant("a")]


def test_read_session_messages_of_a_missing_file():
    with pytest.raises(FileNotFoundError):
        lich.read_session_messages("/nonexistent/lich/session.jsonl")


INTERRUPTED = '{"ok": false, "output": "", "error": "interrupted"}'


def test_read_session_messages_closes_interrupted_tool_calls(tmp_path):
    calls = [("c1", "echo", "{}"), ("c2", "read", "{}"), ("c3", "echo", "{}")]
    path = write_records(tmp_path / "s.jsonl", msg(user("q")), msg(assistant("", *calls)),
                         msg(tool_msg("c1", "one")), msg(tool_msg("c3", "three")))
    history = lich.read_session_messages(path)
    assert history == [user("q"), assistant("", *calls), tool_msg("c1", "one"), tool_msg("c3", "three"),
                       tool_msg("c2", INTERRUPTED, name="read", is_error=True)]
    again = write_records(tmp_path / "again.jsonl", *[msg(m) for m in history])
    assert lich.read_session_messages(again) == history


def test_read_session_messages_repairs_before_the_next_message_and_drops_orphans(tmp_path):
    path = write_records(
        tmp_path / "s.jsonl", msg(tool_msg("orphan")), msg(user("q")),
        msg(assistant("", ("c1", "echo", "{}"), ("c1", "echo", "{}"))), msg(tool_msg("c1", "first")),
        msg(tool_msg("c1", "second")), msg(tool_msg("c1", "third")), msg(user("next")),
        msg(tool_msg("late")), msg(assistant("", ("d1", "echo", "{}"))), msg(assistant("end")),
        msg(assistant("", ("e1", "echo", "{}"))), msg(user("trailing")))
    history = lich.read_session_messages(path)
    interrupted = tool_msg("d1", INTERRUPTED, is_error=True)
    assert history == [user("q"), assistant("", ("c1", "echo", "{}"), ("c1", "echo", "{}")),
                       tool_msg("c1", "first"), tool_msg("c1", "second"), user("next"),
                       assistant("", ("d1", "echo", "{}")), interrupted, assistant("end"),
                       assistant("", ("e1", "echo", "{}")),
                       tool_msg("e1", INTERRUPTED, is_error=True)]
    again = write_records(tmp_path / "again.jsonl", *[msg(m) for m in history])
    assert lich.read_session_messages(again) == history


def make_sessions(session_dir, *names):
    session_dir.mkdir(parents=True, exist_ok=True)
    for i, name in enumerate(names):
        path = session_dir / f"{name}.jsonl"
        path.write_text("")
        os.utime(path, (1_700_000_000 + i, 1_700_000_000 + i))
    return session_dir


def test_resolve_session_latest_exact_and_prefix(tmp_path):
    d = make_sessions(tmp_path / "s", "20260101T000000Z-1", "20260101T000000Z-10-x", "20260102T000000Z-1")
    os.utime(d / "20260101T000000Z-1.jsonl", (1_800_000_000, 1_800_000_000))
    (d / "notes.txt").write_text("")
    assert lich.resolve_session(d, "latest") == str(d / "20260101T000000Z-1.jsonl")
    assert lich.resolve_session(d, "20260101T000000Z-1") == str(d / "20260101T000000Z-1.jsonl")
    assert lich.resolve_session(d, "20260101T000000Z-10") == str(d / "20260101T000000Z-10-x.jsonl")
    assert lich.resolve_session(d, "20260102") == str(d / "20260102T000000Z-1.jsonl")
    assert lich.resolve_session(str(d), "20260102T000000Z-1.jsonl") == os.path.join(str(d), "20260102T000000Z-1.jsonl")


@pytest.mark.parametrize("ref, message", [
    ("2026", "ambiguous session id: 2026"),
    ("2027", "session not found: 2027"),
    ("", "session not found: "),
    ("../s/20260102T000000Z-1", "session not found: ../s/20260102T000000Z-1"),
    ("..", "session not found: .."),
    ("sub/x", "session not found: sub/x"),
    ("a\0b", "session not found: a\0b"),
    ("x" * 10_000, "session not found: " + "x" * 10_000),
], ids=["ambiguous", "none", "empty", "traversal", "dotdot", "separator", "nul", "long"])
def test_resolve_session_refusals(tmp_path, ref, message):
    d = make_sessions(tmp_path / "s", "20260101T000000Z-1", "20260102T000000Z-1")
    with pytest.raises(lich.SessionNotFound) as info:
        lich.resolve_session(d, ref)
    assert str(info.value) == message


def test_resolve_session_refuses_an_absolute_path(tmp_path):
    d = make_sessions(tmp_path / "s", "20260101T000000Z-1")
    ref = str(d / "20260101T000000Z-1")
    with pytest.raises(lich.SessionNotFound) as info:
        lich.resolve_session(d, ref)
    assert str(info.value) == f"session not found: {ref}"


def test_resolve_session_latest_of_nothing(tmp_path):
    for d in (tmp_path / "missing", make_sessions(tmp_path / "empty")):
        with pytest.raises(lich.SessionNotFound, match="^session not found: latest$"):
            lich.resolve_session(d, "latest")


def test_a_recorded_run_resumes(tmp_path):
    run = lich.run_agent("hi", chat=ScriptedChat(assistant("", ("c1", "echo", "{}")), assistant("done")),
                         tools=EchoTools(), max_turns=3, system_prompt="sys", session_dir=tmp_path)
    ref = os.path.basename(run.session_path)[:-6]
    assert lich.read_session_messages(lich.resolve_session(tmp_path, ref)) == run.messages


# ============================================================================
# Providers
# ============================================================================


# ============================================================================
# Tools
# ============================================================================


# ============================================================================
# Command line
# ============================================================================


def test_version_subprocess():
    proc = run_lich("--version")
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, f"lich {lich.__version__}\n", "")


def test_import_does_not_import_requests():
    code = "import sys, lich; print('requests' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=HERE, timeout=60, check=False)
    assert proc.stdout == "False\n", proc.stderr


# ============================================================================
# Hardening
# ============================================================================


def check_event_order(events, max_turns, outcome=None, error=None):
    """Assert every ordering guarantee of the spec's event table on one run's events."""
    i, n = 0, len(events)
    llm_ends = 0
    expected_turn = 1
    ended = None
    while i < n:
        assert events[i] == {"type": "turn_start", "turn": expected_turn}, (i, events[i])
        turn = expected_turn
        i += 1
        if events[i]["type"] == "error":
            assert isinstance(events[i]["error"], lich.AbortError) and i == n - 1
            ended = ("aborted", turn - 1)
            break
        if events[i]["type"] == "compress_start":
            assert events[i + 1]["type"] == "compress_end"
            i += 2
        assert events[i] == {"type": "llm_start", "turn": turn}
        i += 1
        if events[i]["type"] == "error":
            assert i == n - 1 and events[i]["error"] is error
            ended = ("raised", None)
            break
        assert events[i]["type"] == "llm_end" and events[i]["turn"] == turn
        llm_ends += 1
        calls = events[i]["result"].message.get("tool_calls") or []
        i += 1
        for call in calls:
            if events[i]["type"] == "tool_call_start":
                assert events[i] == {"type": "tool_call_start", "turn": turn, "call": call}
                assert events[i + 1]["type"] == "tool_call_end" and events[i + 1]["call"] is call
                assert events[i + 1]["cancelled"] is False
                i += 2
            else:
                assert events[i]["type"] == "tool_call_end" and events[i]["call"] is call
                assert events[i]["cancelled"] is True
                i += 1
        if not calls:
            assert events[i]["type"] == "final" and events[i + 1] == {"type": "turn_end", "turn": turn}
            assert i + 2 == n
            ended = ("final", turn)
            break
        if turn == max_turns:
            assert events[i:] == [{"type": "budget_exhausted", "turns_used": max_turns},
                                  {"type": "turn_end", "turn": turn}]
            ended = ("budget", max_turns)
            break
        expected_turn += 1
    assert sum(e["type"] == "final" for e in events) <= 1
    assert sum(e["type"] == "llm_start" for e in events) == llm_ends + (ended[0] == "raised")
    if outcome is not None:
        assert (outcome.stopped_reason, outcome.turns_used) == ended
        assert_history_is_paired(outcome.messages)
    return ended


def assert_history_is_paired(messages):
    """Every tool message follows its assistant call; every call has exactly one tool message."""
    pending = None
    for message in messages:
        if message["role"] == "tool":
            assert pending, f"tool message without its call: {message}"
            assert message["tool_call_id"] == pending.pop(0)
            continue
        assert not pending, f"unanswered tool calls before {message}"
        pending = [c["id"] for c in message.get("tool_calls") or []]
    assert not pending


def random_run(rng):
    """A scripted run of random shape; returns (events, max_turns, outcome, error)."""
    signal = threading.Event()
    max_turns = rng.randint(1, 6)
    error = lich.ProviderError("random failure", "server")
    counter = iter(range(10**6))

    def chat(messages, *, tools=None, temperature=None, max_tokens=None, signal=None):
        roll = rng.random()
        if messages and messages[0].get("content") == lich.COMPRESSION_SYSTEM_PROMPT:
            if roll < 0.3:
                raise RuntimeError("summarizer down")
            return lich.ChatResult(assistant("summary"))
        if roll < 0.07:
            raise error
        if roll < 0.12:
            signal_holder.set()
        if roll < 0.3:
            return lich.ChatResult(assistant("final " + "x" * rng.randint(0, 400)))
        calls = [(f"c{next(counter)}", rng.choice(["echo", "fail", "boom", "stop"]), "{}")
                 for _ in range(rng.randint(1, 3))]
        return lich.ChatResult(assistant("y" * rng.randint(0, 400), *calls))

    signal_holder = signal
    tools = SignallingTools(signal)
    tools.raise_on = "boom"
    emitter, events = recorder_emitter()
    messages = long_history(rng.randint(0, 14)) if rng.random() < 0.5 else [user("go")]
    budget = rng.choice([None, 50, 200, 10_000])
    if rng.random() < 0.05:
        signal.set()
    try:
        outcome = lich.run_conversation(chat, tools, messages, max_turns=max_turns,
                                        context_budget_tokens=budget, signal=signal, emitter=emitter)
    except lich.ProviderError as exc:
        assert exc is error
        return events, max_turns, None, error
    return events, max_turns, outcome, None


def test_event_ordering_holds_for_random_runs():
    import random

    rng = random.Random(20261130)
    seen = set()
    for _ in range(400):
        events, max_turns, outcome, error = random_run(rng)
        seen.add(check_event_order(events, max_turns, outcome, error)[0])
        seen.update(e["type"] for e in events if e["type"].startswith("compress"))
        seen.update("cancelled" for e in events if e.get("cancelled"))
    assert seen == {"final", "budget", "aborted", "raised", "compress_start", "compress_end",
                    "cancelled"}
