"""Tests for lich.py; the sections follow lich.py's banners, fixtures and helpers first."""

import json
import os
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
                          capture_output=True, text=True, timeout=timeout, cwd=cwd)


# ============================================================================
# Errors
# ============================================================================


# ============================================================================
# Data
# ============================================================================


# ============================================================================
# Events
# ============================================================================


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

KEY = "sk-test-0123456789abcdefSECRET"

WEATHER_SPEC = {"name": "weather", "description": "Current weather in a city.",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                               "required": ["city"]}}
CLOCK_SPEC = {"name": "clock", "description": "The time.",
              "parameters": {"type": "object", "properties": {}}}
TOOL_ERROR = '{"ok": false, "output": "", "error": "unknown city"}'

# Every message kind: two system messages, a tool batch with valid, invalid and empty
# arguments, a failed tool result, and a user message right after the tool results.
HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "system", "content": "Use metric units."},
    {"role": "user", "content": "Weather in Paris and Rome, and the time?"},
    assistant("Checking.", ("c1", "weather", '{"city": "Paris"}'),
              ("c2", "weather", '{"city": Rome'), ("c3", "clock", "")),
    {"role": "tool", "tool_call_id": "c1", "name": "weather", "content": "18C", "is_error": False},
    {"role": "tool", "tool_call_id": "c2", "name": "weather", "content": TOOL_ERROR,
     "is_error": True},
    {"role": "tool", "tool_call_id": "c3", "name": "clock", "content": "12:00", "is_error": False},
    {"role": "user", "content": "Also, hurry."},
    {"role": "assistant", "content": "Paris: 18C. It is noon."},
    {"role": "user", "content": "Thanks"},
]
USER = [{"role": "user", "content": "Hi"}]


def openai_at(server, **options):
    options.setdefault("timeout", 5)
    return lich.OpenAIChat("gpt-test", base_url=server.url + "/v1", **options)


def anthropic_at(server, **options):
    options.setdefault("timeout", 5)
    return lich.AnthropicChat("claude-test", base_url=server.url, **options)


def openai_reply(content="Hello.", *calls, finish="stop", usage=(7, 3), model="gpt-test-1"):
    """A Chat Completions response body; each call is (id, name, arguments)."""
    message = {"role": "assistant", "content": content, "refusal": None}
    if calls:
        message["tool_calls"] = [{"id": i, "type": "function",
                                  "function": {"name": n, "arguments": a}} for i, n, a in calls]
    return {"id": "chatcmpl-1", "object": "chat.completion", "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": {"prompt_tokens": usage[0], "completion_tokens": usage[1],
                      "total_tokens": sum(usage)}}


def anthropic_reply(*blocks, stop="end_turn", usage=(7, 3), model="claude-test-1"):
    """A Messages API response body with the given content blocks."""
    return {"id": "msg_1", "type": "message", "role": "assistant", "model": model,
            "content": list(blocks), "stop_reason": stop, "stop_sequence": None,
            "usage": {"input_tokens": usage[0], "output_tokens": usage[1]}}


def text_block(text):
    return {"type": "text", "text": text}


def tool_use_block(id, name, input):
    return {"type": "tool_use", "id": id, "name": name, "input": input}


def delta_chunk(index=0, finish=None, **delta):
    """An OpenAI streaming chunk carrying ``delta`` for choice ``index``."""
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "gpt-test-1",
            "choices": [{"index": index, "delta": delta, "finish_reason": finish}]}


def call_delta(index, arguments, id=None, name=None):
    call = {"index": index, "function": {"arguments": arguments}}
    if id:
        call.update(id=id, type="function")
        call["function"]["name"] = name
    return call


def openai_sse(*chunks, done=True):
    return sse(*[(None, c) for c in chunks], *([(None, "[DONE]")] if done else []))


def pieces(text, size):
    """``text`` cut into pieces of ``size`` bytes, to cross SSE line boundaries."""
    data = _as_bytes(text)
    return [data[i:i + size] for i in range(0, len(data), size)]


def result(content="", *calls, usage=(0, 0), model=None, stop=None):
    return lich.ChatResult(message=assistant(content, *calls),
                           usage={"input_tokens": usage[0], "output_tokens": usage[1]},
                           model=model, stop_reason=stop)


class RecordingSignal(threading.Event):
    """A signal that records how long each wait asked for, without waiting."""

    def __init__(self):
        super().__init__()
        self.waits = []

    def wait(self, timeout=None):
        self.waits.append(timeout)
        return self.is_set()


def failing(*errors, then="ok"):
    """A function that raises ``errors`` one per call, then returns ``then``; counts calls."""
    queue = list(errors)

    def fn():
        fn.calls += 1
        if queue:
            raise queue.pop(0)
        return then

    fn.calls = 0
    return fn


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- OpenAI: the wire -------------------------------------------------------------------


def test_openai_request_carries_every_message_kind_and_tool_specs(server):
    server.reply(200, openai_reply())
    openai_at(server, api_key=KEY)(HISTORY, tools=[WEATHER_SPEC, CLOCK_SPEC], temperature=0.2,
                                   max_tokens=50)
    request = server.requests[0]
    assert (request["method"], request["path"]) == ("POST", "/v1/chat/completions")
    assert request["headers"]["authorization"] == f"Bearer {KEY}"
    assert request["headers"]["content-type"] == "application/json"
    assert request["json"] == {
        "model": "gpt-test",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "system", "content": "Use metric units."},
            {"role": "user", "content": "Weather in Paris and Rome, and the time?"},
            {"role": "assistant", "content": "Checking.", "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "weather", "arguments": '{"city": "Paris"}'}},
                {"id": "c2", "type": "function",
                 "function": {"name": "weather", "arguments": '{"city": Rome'}},
                {"id": "c3", "type": "function",
                 "function": {"name": "clock", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "18C"},
            {"role": "tool", "tool_call_id": "c2", "content": TOOL_ERROR},
            {"role": "tool", "tool_call_id": "c3", "content": "12:00"},
            {"role": "user", "content": "Also, hurry."},
            {"role": "assistant", "content": "Paris: 18C. It is noon."},
            {"role": "user", "content": "Thanks"},
        ],
        "tools": [
            {"type": "function", "function": {
                "name": "weather", "description": "Current weather in a city.",
                "parameters": WEATHER_SPEC["parameters"]}},
            {"type": "function", "function": {
                "name": "clock", "description": "The time.",
                "parameters": CLOCK_SPEC["parameters"]}},
        ],
        "temperature": 0.2,
        "max_tokens": 50,
    }


def test_openai_minimal_request_and_empty_assistant_content(server):
    server.reply(200, openai_reply())
    openai_at(server)([*USER, assistant("", ("c1", "clock", "{}")),
                       {"role": "tool", "tool_call_id": "c1", "name": "clock", "content": "",
                        "is_error": False}])
    assert server.requests[0]["json"] == {"model": "gpt-test", "messages": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "clock", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": ""}]}


def test_openai_without_key_sends_no_authorization_to_a_local_server(server):
    server.reply(200, openai_reply())
    openai_at(server)(USER)
    assert "authorization" not in server.requests[0]["headers"]


def test_openai_key_and_base_url_come_from_the_environment(server, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    monkeypatch.setenv("OPENAI_BASE_URL", server.url + "/v1/")
    server.reply(200, openai_reply())
    chat = lich.OpenAIChat("gpt-test", timeout=5)
    chat(USER)
    assert chat.base_url == server.url + "/v1"
    assert server.requests[0]["headers"]["authorization"] == f"Bearer {KEY}"


def test_openai_public_url_without_key_is_an_auth_error_before_sending():
    chat = lich.OpenAIChat("gpt-4.1-mini")
    with pytest.raises(lich.ProviderError) as info:
        chat(USER)
    err = info.value
    assert (err.kind, err.retryable, err.status, err.provider) == ("auth", False, None, "openai")
    assert str(err) == ("openai: no API key for https://api.openai.com/v1: set OPENAI_API_KEY "
                        "(or pass api_key=...)")


def test_a_base_url_that_is_not_http_is_refused():
    with pytest.raises(ValueError, match="base_url must be an http"):
        lich.OpenAIChat("m", base_url="localhost:11434/v1")


# -- OpenAI: answers ------------------------------------------------------------------


@pytest.mark.parametrize("body, expected", [
    pytest.param(openai_reply("Hello there.", usage=(12, 5)),
                 result("Hello there.", usage=(12, 5), model="gpt-test-1", stop="stop"),
                 id="text"),
    pytest.param(openai_reply(None, ("call_1", "weather", '{"city":"Paris"}'),
                              finish="tool_calls"),
                 result("", ("call_1", "weather", '{"city":"Paris"}'), usage=(7, 3),
                        model="gpt-test-1", stop="tool_calls"),
                 id="one-tool-call-null-content"),
    pytest.param(openai_reply("Both.", ("a", "weather", '{"city":"Paris"}'),
                              ("b", "weather", '{"city":"Rome"}'), finish="tool_calls"),
                 result("Both.", ("a", "weather", '{"city":"Paris"}'),
                        ("b", "weather", '{"city":"Rome"}'), usage=(7, 3), model="gpt-test-1",
                        stop="tool_calls"),
                 id="parallel-tool-calls"),
    pytest.param(openai_reply(None, finish="length"),
                 result("", usage=(7, 3), model="gpt-test-1", stop="length"),
                 id="null-content-no-calls"),
    pytest.param({"choices": [{"message": {"content": "Hi"}}]},
                 result("Hi", model="gpt-test"), id="bare-minimum-body"),
    pytest.param({"choices": [{"message": {"content": [{"type": "text", "text": "a"},
                                                       {"type": "text", "text": "b"}]},
                               "finish_reason": "stop"}]},
                 result("ab", model="gpt-test", stop="stop"), id="content-parts"),
    pytest.param({"choices": [{"message": {"content": None, "tool_calls": [
                     {"function": {"name": "clock", "arguments": None}},
                     {"function": {"name": "weather", "arguments": {"city": "Oslo"}}}]}}]},
                 result("", ("call_0", "clock", "{}"), ("call_1", "weather", '{"city": "Oslo"}'),
                        model="gpt-test"),
                 id="calls-without-ids-and-object-arguments"),
])
def test_openai_answer_becomes_a_chat_result(server, body, expected):
    server.reply(200, body)
    assert openai_at(server)(USER) == expected


def test_openai_refusal_with_null_content_is_the_answer_text(server):
    body = openai_reply(None)
    body["choices"][0]["message"]["refusal"] = "I can't help with that."
    server.reply(200, body)
    assert openai_at(server)(USER) == result("I can't help with that.", usage=(7, 3),
                                             model="gpt-test-1", stop="stop")


def test_openai_finish_reason_function_call_is_normalised(server):
    server.reply(200, openai_reply("x", finish="function_call"))
    assert openai_at(server)(USER).stop_reason == "tool_calls"


# -- OpenAI: streaming ----------------------------------------------------------------


def test_openai_stream_text_deltas_usage_and_request_flags(server):
    body = openai_sse(delta_chunk(role="assistant", content=""), delta_chunk(content="Hel"),
                      delta_chunk(content="lo"), delta_chunk(finish="stop"),
                      {"id": "chatcmpl-1", "choices": [],
                       "usage": {"prompt_tokens": 9, "completion_tokens": 2}})
    server.reply(200, chunks=pieces(body, 40))
    deltas = []
    chat = openai_at(server, stream=True, on_delta=deltas.append)
    assert chat(USER, max_tokens=20) == result("Hello", usage=(9, 2), model="gpt-test-1",
                                               stop="stop")
    assert deltas == ["Hel", "lo"]
    assert server.requests[0]["json"] == {
        "model": "gpt-test", "messages": USER, "max_tokens": 20, "stream": True,
        "stream_options": {"include_usage": True}}


def test_openai_stream_assembles_split_parallel_tool_calls(server):
    body = openai_sse(
        delta_chunk(role="assistant", content=None,
                    tool_calls=[call_delta(0, "", id="call_a", name="weather")]),
        delta_chunk(tool_calls=[call_delta(0, '{"ci')]),
        delta_chunk(tool_calls=[call_delta(0, 'ty": "Paris"}')]),
        delta_chunk(tool_calls=[call_delta(1, '{"city"', id="call_b", name="weather")]),
        delta_chunk(tool_calls=[call_delta(1, ': "Rome"}')]),
        delta_chunk(tool_calls=[call_delta(2, "", id="call_c", name="clock")]),
        delta_chunk(finish="tool_calls"),
        {"choices": [], "usage": {"prompt_tokens": 30, "completion_tokens": 12}})
    server.reply(200, chunks=pieces(body, 7))
    deltas = []
    got = openai_at(server, stream=True, on_delta=deltas.append)(USER, tools=[WEATHER_SPEC])
    assert got == result("", ("call_a", "weather", '{"city": "Paris"}'),
                         ("call_b", "weather", '{"city": "Rome"}'), ("call_c", "clock", "{}"),
                         usage=(30, 12), model="gpt-test-1", stop="tool_calls")
    assert deltas == []


def test_openai_stream_follows_sse_framing_rules(server):
    second = json.dumps(delta_chunk(content="lo")).replace('"delta":', '\ndata: "delta":')
    body = (": keep-alive\r\n\r\n"
            f"data: {json.dumps(delta_chunk(content='Hel'))}\r\n\r\n"
            f"data: {second}\r\n\r\n"                         # data split over two lines
            f"data: {json.dumps(delta_chunk(index=1, content='other choice'))}\n\n"
            "id: 7\nretry: 100\nevent: message\n"
            f"data: {json.dumps(delta_chunk(finish='stop'))}\n\n"
            "data: [DONE]")                                    # no trailing newline
    server.reply(200, chunks=pieces(body, 5))
    deltas = []
    got = openai_at(server, stream=True, on_delta=deltas.append)(USER)
    assert (got, deltas) == (result("Hello", model="gpt-test-1", stop="stop"), ["Hel", "lo"])


def test_openai_stream_to_a_server_that_answers_json_gives_one_delta(server):
    server.reply(200, openai_reply("Whole answer."))
    deltas = []
    got = openai_at(server, stream=True, on_delta=deltas.append)(USER)
    assert (got, deltas) == (result("Whole answer.", usage=(7, 3), model="gpt-test-1",
                                    stop="stop"), ["Whole answer."])


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streaming"])
def test_calls_from_one_thread_reuse_one_connection(server, stream):
    handlers = []  # the server runs one handler thread per connection

    def responder(request):
        handlers.append(threading.current_thread())
        if stream:
            return Reply(200, chunks=[openai_sse(delta_chunk(content="x"),
                                                 delta_chunk(finish="stop"))])
        return Reply(200, openai_reply("x"))

    server.responder = responder
    chat = openai_at(server, stream=stream)
    for _ in range(3):
        assert chat(USER).message == {"role": "assistant", "content": "x"}
    assert len(handlers) == 3 and handlers[0] is handlers[1] is handlers[2]


def test_a_finished_stream_does_not_wait_for_the_end_of_the_body(server):
    # The server sleeps before each chunk; the empty one only delays the chunked terminator.
    body = openai_sse(delta_chunk(content="x"), delta_chunk(finish="stop"))
    server.reply(200, chunks=[body, ""], delay=0.3)
    started = time.monotonic()
    assert openai_at(server, stream=True)(USER).message == {"role": "assistant", "content": "x"}
    assert time.monotonic() - started < 0.55


@pytest.mark.skipif(not hasattr(socket, "TCP_QUICKACK"), reason="TCP_QUICKACK is Linux-only")
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streaming"])
def test_reused_connections_do_not_wait_for_a_delayed_ack(server, stream):
    # The loopback server writes headers and body separately with Nagle's algorithm on:
    # without an immediate ACK each call on a reused connection would stall ~40 ms.
    def responder(request):
        if stream:
            return Reply(200, chunks=[openai_sse(delta_chunk(content="x"),
                                                 delta_chunk(finish="stop"))])
        return Reply(200, openai_reply("x"))

    server.responder = responder
    chat = openai_at(server, stream=stream)
    chat(USER)
    started = time.monotonic()
    for _ in range(10):
        chat(USER)
    assert time.monotonic() - started < 0.25


# -- Anthropic: the wire ----------------------------------------------------------------


def test_anthropic_request_carries_every_message_kind_and_tool_specs(server):
    server.reply(200, anthropic_reply(text_block("ok")))
    anthropic_at(server, api_key=KEY)(HISTORY, tools=[WEATHER_SPEC, CLOCK_SPEC],
                                      temperature=0.2)
    request = server.requests[0]
    assert (request["method"], request["path"]) == ("POST", "/v1/messages")
    headers = request["headers"]
    assert (headers["x-api-key"], headers["anthropic-version"], headers["content-type"]) == (
        KEY, "2023-06-01", "application/json")
    assert "authorization" not in headers
    assert request["json"] == {
        "model": "claude-test",
        "max_tokens": 4096,
        "system": "Be brief.\n\nUse metric units.",
        "messages": [
            {"role": "user", "content": "Weather in Paris and Rome, and the time?"},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "c1", "name": "weather", "input": {"city": "Paris"}},
                {"type": "tool_use", "id": "c2", "name": "weather",
                 "input": {"_raw_arguments": '{"city": Rome'}},
                {"type": "tool_use", "id": "c3", "name": "clock", "input": {}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "c1", "content": "18C",
                 "is_error": False},
                {"type": "tool_result", "tool_use_id": "c2", "content": TOOL_ERROR,
                 "is_error": True},
                {"type": "tool_result", "tool_use_id": "c3", "content": "12:00",
                 "is_error": False},
                {"type": "text", "text": "Also, hurry."}]},
            {"role": "assistant", "content": "Paris: 18C. It is noon."},
            {"role": "user", "content": "Thanks"},
        ],
        "tools": [
            {"name": "weather", "description": "Current weather in a city.",
             "input_schema": WEATHER_SPEC["parameters"]},
            {"name": "clock", "description": "The time.", "input_schema": CLOCK_SPEC["parameters"]},
        ],
        "temperature": 0.2,
    }


def test_anthropic_merges_same_role_turns_and_drops_empty_ones(server):
    server.reply(200, anthropic_reply(text_block("ok")))
    anthropic_at(server, max_tokens=300)([
        {"role": "user", "content": "a"}, {"role": "assistant", "content": ""},
        {"role": "user", "content": "b"}, {"role": "system", "content": ""},
        {"role": "assistant", "content": "c"}, {"role": "assistant", "content": "d"},
        {"role": "user", "content": "e"},
        {"role": "tool", "tool_call_id": "t1", "name": "x", "content": "late", "is_error": False},
    ], max_tokens=77)
    assert server.requests[0]["json"] == {"model": "claude-test", "max_tokens": 77, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "c"},
                                          {"type": "text", "text": "d"}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": "late", "is_error": False},
            {"type": "text", "text": "e"}]},
    ]}


def test_anthropic_default_output_cap_comes_from_the_constructor(server):
    server.reply(200, anthropic_reply(text_block("ok")))
    anthropic_at(server, max_tokens=300)(USER)
    assert server.requests[0]["json"] == {"model": "claude-test", "max_tokens": 300,
                                          "messages": [{"role": "user", "content": "Hi"}]}


def test_anthropic_on_loopback_needs_no_key(server):
    server.reply(200, anthropic_reply(text_block("ok")))
    anthropic_at(server)(USER)
    assert "x-api-key" not in server.requests[0]["headers"]


def test_anthropic_without_key_elsewhere_is_an_auth_error_before_sending(monkeypatch):
    monkeypatch.setenv("ANTHROPIC_BASE_URL", "https://anthropic.example.invalid")
    with pytest.raises(lich.ProviderError) as info:
        lich.AnthropicChat("claude-sonnet-4-5")(USER)
    assert (info.value.kind, str(info.value)) == (
        "auth", ("anthropic: no API key for https://anthropic.example.invalid: set "
                 "ANTHROPIC_API_KEY (or pass api_key=...)"))


def test_anthropic_key_comes_from_the_environment(server, monkeypatch):
    monkeypatch.setenv("ANTHROPIC_API_KEY", KEY)
    monkeypatch.setenv("ANTHROPIC_BASE_URL", server.url)
    server.reply(200, anthropic_reply(text_block("ok")))
    lich.AnthropicChat("claude-test", timeout=5)(USER)
    assert server.requests[0]["headers"]["x-api-key"] == KEY


# -- Anthropic: answers ---------------------------------------------------------------


@pytest.mark.parametrize("body, expected", [
    pytest.param(anthropic_reply(text_block("Hello "), text_block("there."), usage=(12, 5)),
                 result("Hello there.", usage=(12, 5), model="claude-test-1", stop="stop"),
                 id="text"),
    pytest.param(anthropic_reply(text_block("Let me look."),
                                 tool_use_block("toolu_1", "weather", {"city": "Paris"}),
                                 stop="tool_use"),
                 result("Let me look.", ("toolu_1", "weather", '{"city": "Paris"}'),
                        usage=(7, 3), model="claude-test-1", stop="tool_calls"),
                 id="one-tool-call"),
    pytest.param(anthropic_reply(tool_use_block("a", "weather", {"city": "Paris"}),
                                 tool_use_block("b", "clock", {}), stop="tool_use"),
                 result("", ("a", "weather", '{"city": "Paris"}'), ("b", "clock", "{}"),
                        usage=(7, 3), model="claude-test-1", stop="tool_calls"),
                 id="parallel-tool-calls-no-text"),
    pytest.param(anthropic_reply({"type": "thinking", "thinking": "hmm", "signature": "s"},
                                 {"type": "redacted_thinking", "data": "opaque"},
                                 text_block("4"), stop="max_tokens"),
                 result("4", usage=(7, 3), model="claude-test-1", stop="length"),
                 id="thinking-is-not-answer-text"),
    pytest.param({"content": [], "usage": {"input_tokens": 5, "cache_creation_input_tokens": 100,
                                           "cache_read_input_tokens": 1000, "output_tokens": 2},
                  "stop_reason": "stop_sequence"},
                 result("", usage=(1105, 2), model="claude-test", stop="stop"),
                 id="cached-input-counts"),
])
def test_anthropic_answer_becomes_a_chat_result(server, body, expected):
    server.reply(200, body)
    assert anthropic_at(server)(USER) == expected


# -- Anthropic: streaming ---------------------------------------------------------------


def anthropic_sse(*events):
    return sse(*[(e["type"], e) for e in events])


def message_start(input_tokens=25, output_tokens=1):
    return {"type": "message_start", "message": {
        "id": "msg_1", "type": "message", "role": "assistant", "model": "claude-test-1",
        "content": [], "stop_reason": None,
        "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens}}}


def block_start(index, block):
    return {"type": "content_block_start", "index": index, "content_block": block}


def block_delta(index, **delta):
    return {"type": "content_block_delta", "index": index, "delta": delta}


def message_delta(stop, output_tokens):
    return {"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": None},
            "usage": {"output_tokens": output_tokens}}


PING = {"type": "ping"}
MESSAGE_STOP = {"type": "message_stop"}


def test_anthropic_stream_text_tool_use_pings_and_usage(server):
    body = anthropic_sse(
        message_start(), block_start(0, {"type": "thinking", "thinking": "", "signature": ""}),
        block_delta(0, type="thinking_delta", thinking="Let me think."),
        block_delta(0, type="signature_delta", signature="sig"),
        {"type": "content_block_stop", "index": 0}, PING,
        block_start(1, text_block("")), block_delta(1, type="text_delta", text="Checking "),
        PING, block_delta(1, type="text_delta", text="both."),
        {"type": "content_block_stop", "index": 1},
        block_start(2, tool_use_block("toolu_a", "weather", {})),
        block_delta(2, type="input_json_delta", partial_json=""),
        block_delta(2, type="input_json_delta", partial_json='{"city": "Pa'),
        block_delta(2, type="input_json_delta", partial_json='ris"}'),
        {"type": "content_block_stop", "index": 2},
        block_start(3, tool_use_block("toolu_b", "clock", {})),
        block_delta(3, type="input_json_delta", partial_json=""),
        {"type": "content_block_stop", "index": 3},
        {"type": "some_future_event", "detail": 1},
        message_delta("tool_use", 40), MESSAGE_STOP)
    server.reply(200, chunks=pieces(body, 33))
    deltas = []
    chat = anthropic_at(server, stream=True, on_delta=deltas.append)
    assert chat(USER) == result("Checking both.", ("toolu_a", "weather", '{"city": "Paris"}'),
                                ("toolu_b", "clock", "{}"), usage=(25, 40),
                                model="claude-test-1", stop="tool_calls")
    assert deltas == ["Checking ", "both."]
    assert server.requests[0]["json"] == {"model": "claude-test", "max_tokens": 4096,
                                          "messages": USER, "stream": True}


def test_anthropic_stream_error_event_overloaded_is_retryable(server):
    body = anthropic_sse(message_start(), block_start(0, text_block("")),
                         block_delta(0, type="text_delta", text="Hi"),
                         {"type": "error", "error": {"type": "overloaded_error",
                                                     "message": "Overloaded"}})
    server.reply(200, chunks=[body])
    with pytest.raises(lich.ProviderError) as info:
        anthropic_at(server, stream=True)(USER)
    err = info.value
    assert (err.kind, err.retryable, err.provider, str(err)) == (
        "overloaded", True, "anthropic",
        "anthropic: error event in stream (overloaded_error): Overloaded")


# -- Errors ----------------------------------------------------------------------------


def openai_error(message, type="invalid_request_error", code=None):
    return {"error": {"message": message, "type": type, "param": None, "code": code}}


def anthropic_error(type, message):
    return {"type": "error", "error": {"type": type, "message": message}, "request_id": "req_1"}


# (provider, status, body, headers) -> (kind, retryable, retry_after)
ERROR_CASES = [
    ("openai-401", "openai", 401, openai_error("Incorrect API key", code="invalid_api_key"), {},
     "auth", False, None),
    ("openai-403", "openai", 403, openai_error("Country not supported"), {}, "auth", False, None),
    ("openai-404", "openai", 404, openai_error("no such model", code="model_not_found"), {},
     "not_found", False, None),
    ("408-text", "openai", 408, "request timeout", {}, "timeout", True, None),
    ("413", "anthropic", 413, anthropic_error("request_too_large", "Request exceeds the maximum "
                                              "allowed number of bytes."), {},
     "overflow", False, None),
    ("openai-context-code", "openai", 400,
     openai_error("Your input exceeds the context window", code="context_length_exceeded"), {},
     "overflow", False, None),
    ("vllm-context-text", "openai", 400,
     openai_error("This model's maximum context length is 8192 tokens. However, you requested "
                  "9000 tokens."), {}, "overflow", False, None),
    ("llamacpp-context-size", "openai", 400,
     {"error": {"code": 400, "message": "the request exceeds the available context size, try "
                "increasing it", "type": "exceed_context_size_error"}}, {},
     "overflow", False, None),
    ("anthropic-prompt-too-long", "anthropic", 400,
     anthropic_error("invalid_request_error", "prompt is too long: 210000 tokens > 200000 "
                     "maximum"), {}, "overflow", False, None),
    ("openai-400", "openai", 400, openai_error("Unsupported parameter: 'stop'",
                                               code="unsupported_parameter"), {},
     "bad_request", False, None),
    ("anthropic-400", "anthropic", 400,
     anthropic_error("invalid_request_error", "messages.0: Input does not match"), {},
     "bad_request", False, None),
    ("422-detail-list", "openai", 422, {"detail": [{"loc": ["body", "model"],
                                                    "msg": "field required"}]}, {},
     "bad_request", False, None),
    ("418-other-4xx", "openai", 418, "I'm a teapot", {}, "bad_request", False, None),
    ("429-retry-after-seconds", "openai", 429, openai_error("Slow down", code="rate_limit_exceeded"),
     {"Retry-After": "7"}, "rate_limit", True, 7.0),
    ("429-retry-after-ms", "openai", 429, openai_error("Slow down"),
     {"retry-after-ms": "1500", "Retry-After": "2"}, "rate_limit", True, 1.5),
    ("429-bad-retry-after", "openai", 429, openai_error("Slow down"),
     {"Retry-After": "soon"}, "rate_limit", True, None),
    ("429-insufficient-quota", "openai", 429,
     openai_error("You exceeded your current quota", type="insufficient_quota",
                  code="insufficient_quota"), {}, "rate_limit", False, None),
    ("anthropic-429", "anthropic", 429, anthropic_error("rate_limit_error", "Too many tokens"),
     {"retry-after": "41"}, "rate_limit", True, 41.0),
    ("500", "openai", 500, openai_error("The server had an error", type="server_error"), {},
     "server", True, None),
    ("502-html", "openai", 502, "<html><body>Bad gateway</body></html>", {},
     "server", True, None),
    ("503-text", "openai", 503, "upstream connect error", {"Retry-After": "3"},
     "overloaded", True, 3.0),
    ("anthropic-529", "anthropic", 529, anthropic_error("overloaded_error", "Overloaded"), {},
     "overloaded", True, None),
    ("overloaded-type-on-500", "anthropic", 500, anthropic_error("overloaded_error", "Overloaded"),
     {}, "overloaded", True, None),
    ("anthropic-500", "anthropic", 500, anthropic_error("api_error", "Internal server error"), {},
     "server", True, None),
    ("304-not-an-answer", "openai", 304, b"", {}, "invalid_response", False, None),
]


@pytest.mark.parametrize("provider, status, body, headers, kind, retryable, retry_after",
                         [pytest.param(*case[1:], id=case[0]) for case in ERROR_CASES])
def test_error_classification(server, provider, status, body, headers, kind, retryable,
                              retry_after):
    server.reply(status, body, headers=headers)
    chat = (openai_at if provider == "openai" else anthropic_at)(server, api_key=KEY)
    with pytest.raises(lich.ProviderError) as info:
        chat(USER)
    err = info.value
    assert (err.kind, err.retryable, err.retry_after, err.status, err.provider) == (
        kind, retryable, retry_after, status, provider)
    assert str(err).startswith(f"{provider}: HTTP {status}")


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streaming"])
def test_error_message_has_status_code_and_provider_text(server, stream):
    server.reply(401, openai_error("Incorrect API key provided.", code="invalid_api_key"))
    with pytest.raises(lich.ProviderError) as info:
        openai_at(server, api_key=KEY, stream=stream)(USER)
    assert str(info.value) == "openai: HTTP 401 (invalid_api_key): Incorrect API key provided."


def test_retry_after_as_an_http_date(server):
    import email.utils
    server.reply(429, "busy", headers={"Retry-After": email.utils.formatdate(time.time() + 30,
                                                                             usegmt=True)})
    with pytest.raises(lich.ProviderError) as info:
        openai_at(server)(USER)
    assert 25 <= info.value.retry_after <= 30


def test_api_key_appears_in_no_error_log_or_repr(server, caplog):
    caplog.set_level("DEBUG", logger="lich")
    echo = openai_error(f"Incorrect API key provided: {KEY}", code="invalid_api_key")
    server.reply(503, echo)
    server.reply(401, echo)
    chats = [openai_at(server, api_key=KEY), anthropic_at(server, api_key=KEY)]
    with pytest.raises(lich.ProviderError) as info:
        lich.run_with_retries(lambda: chats[0](USER), retries=1, base_delay=0.001)
    err = info.value
    assert (err.kind, err.status) == ("auth", 401)
    assert str(err) == ("openai: HTTP 401 (invalid_api_key): Incorrect API key provided: "
                        "[redacted]")
    for text in (str(err), repr(err), caplog.text, repr(chats), repr(lich.Router(chats))):
        assert KEY not in text
    assert len(server.requests) == 2 and caplog.text


# -- Transport failures ------------------------------------------------------------------


def test_connection_refused_is_a_network_error():
    port = free_port()
    with pytest.raises(lich.ProviderError) as info:
        lich.OpenAIChat("m", base_url=f"http://127.0.0.1:{port}/v1", timeout=5)(USER)
    err = info.value
    assert (err.kind, err.retryable, err.status) == ("network", True, None)
    assert str(err).startswith(f"openai: cannot reach http://127.0.0.1:{port}/v1/chat/completions:")


def test_connection_closed_before_headers_is_a_network_error(server):
    server.reply(reset_after=0)
    with pytest.raises(lich.ProviderError) as info:
        openai_at(server)(USER)
    assert (info.value.kind, info.value.retryable) == ("network", True)


def test_no_answer_within_the_read_timeout_is_a_timeout(server):
    def slow(request):
        time.sleep(0.5)
        return Reply(200, openai_reply())

    server.responder = slow
    with pytest.raises(lich.ProviderError) as info:
        openai_at(server, timeout=0.2)(USER)
    assert (info.value.kind, info.value.retryable) == ("timeout", True)


def test_a_body_that_stalls_is_a_timeout(server):
    server.reply(200, chunks=[json.dumps(openai_reply())], content_type="application/json",
                 delay=0.5)
    with pytest.raises(lich.ProviderError) as info:
        openai_at(server, timeout=0.2)(USER)
    assert info.value.kind == "timeout"


def test_a_slow_but_steady_stream_is_not_a_timeout(server):
    body = openai_sse(*[delta_chunk(content=c) for c in "abcde"], delta_chunk(finish="stop"))
    server.reply(200, chunks=pieces(body, len(body) // 5 + 1), delay=0.1)
    assert openai_at(server, stream=True, timeout=0.3)(USER).message["content"] == "abcde"


def test_a_body_cut_off_mid_way_is_a_network_error(server):
    server.reply(200, chunks=['{"choices": [', "]}"], content_type="application/json",
                 reset_after=1)
    with pytest.raises(lich.ProviderError) as info:
        openai_at(server)(USER)
    assert (info.value.kind, info.value.retryable) == ("network", True)


def test_a_stream_that_stalls_between_chunks_is_a_timeout(server):
    body = openai_sse(delta_chunk(content="a"), delta_chunk(finish="stop"))
    server.reply(200, chunks=["", *pieces(body, 60)], delay=0.4)
    with pytest.raises(lich.ProviderError) as info:
        openai_at(server, stream=True, timeout=0.15)(USER)
    assert info.value.kind == "timeout"


@pytest.mark.parametrize("at", ["openai", "anthropic"])
def test_a_stream_cut_off_mid_way_is_an_invalid_response(server, at):
    if at == "openai":
        body, chat = openai_sse(delta_chunk(content="Hel"), delta_chunk(content="lo")), openai_at
    else:
        body = anthropic_sse(message_start(), block_start(0, text_block("")),
                             block_delta(0, type="text_delta", text="Hel"), MESSAGE_STOP)
        chat = anthropic_at
    server.reply(200, chunks=pieces(body, 150), reset_after=1)
    deltas = []
    with pytest.raises(lich.ProviderError) as info:
        chat(server, stream=True, on_delta=deltas.append)(USER)
    assert (info.value.kind, info.value.retryable) == ("invalid_response", False)


# -- Bad input ------------------------------------------------------------------------------


@pytest.mark.parametrize("at, body, content_type", [
    pytest.param("openai", b"<html><body>Welcome to nginx</body></html>", "text/html",
                 id="openai-html"),
    pytest.param("openai", b"", "application/json", id="openai-empty-body"),
    pytest.param("openai", {}, None, id="openai-empty-object"),
    pytest.param("openai", [1, 2], None, id="openai-list"),
    pytest.param("openai", {"choices": []}, None, id="openai-no-choices"),
    pytest.param("openai", {"choices": ["text"]}, None, id="openai-choice-not-object"),
    pytest.param("openai", {"choices": [{"message": "hi"}]}, None, id="openai-message-str"),
    pytest.param("openai", {"choices": [{"message": {"content": 5}}]}, None,
                 id="openai-content-number"),
    pytest.param("openai", {"choices": [{"message": {"tool_calls": [{"function": {}}]}}]}, None,
                 id="openai-call-without-name"),
    pytest.param("openai", {"choices": [{"message": {"tool_calls": "x"}}]}, None,
                 id="openai-calls-not-list"),
    pytest.param("openai", {"error": {"message": "upstream failed", "code": 502}}, None,
                 id="openai-error-in-200"),
    pytest.param("anthropic", b"not json at all", "application/json", id="anthropic-text"),
    pytest.param("anthropic", {}, None, id="anthropic-empty-object"),
    pytest.param("anthropic", {"content": "hi"}, None, id="anthropic-content-str"),
    pytest.param("anthropic", {"content": [{"type": "tool_use"}]}, None,
                 id="anthropic-tool-use-without-fields"),
    pytest.param("anthropic", {"content": [{"type": "text", "text": None}]}, None,
                 id="anthropic-text-null"),
])
def test_a_2xx_body_that_is_not_the_expected_json_is_an_invalid_response(server, at, body,
                                                                         content_type):
    server.reply(200, body, content_type=content_type)
    chat = openai_at if at == "openai" else anthropic_at
    with pytest.raises(lich.ProviderError) as info:
        chat(server)(USER)
    err = info.value
    assert (err.kind, err.retryable, err.status, err.provider) == (
        "invalid_response", False, None, at)
    assert str(err).startswith(f"{at}: ")


def test_invalid_response_message_quotes_the_body(server):
    server.reply(200, b"<html>Welcome to nginx</html>", content_type="text/html")
    with pytest.raises(lich.ProviderError) as info:
        openai_at(server)(USER)
    assert str(info.value) == ("openai: invalid response: body is not JSON: "
                               "'<html>Welcome to nginx</html>'")


@pytest.mark.parametrize("at, body", [
    pytest.param("openai", openai_sse(delta_chunk(content="a"), done=False), id="openai-no-done"),
    pytest.param("openai", "data: {not json}\n\n", id="openai-data-not-json"),
    pytest.param("openai", "data: [1, 2]\n\ndata: [DONE]\n\n", id="openai-data-not-object"),
    pytest.param("openai", openai_sse(delta_chunk(tool_calls=[call_delta(3, '{"a": 1}')])),
                 id="openai-call-delta-for-unopened-index"),
    pytest.param("openai", openai_sse(delta_chunk(tool_calls=[call_delta(0, "{}", id="c")])),
                 id="openai-call-without-name"),
    pytest.param("openai", openai_sse({"choices": [{"delta": "text"}]}), id="openai-delta-str"),
    pytest.param("openai", openai_sse(delta_chunk(content=["x"])), id="openai-content-list"),
    pytest.param("openai", "<html>busy</html>", id="openai-html-stream"),
    pytest.param("openai", "", id="openai-empty-stream"),
    pytest.param("anthropic", anthropic_sse(message_start(), block_start(0, text_block(""))),
                 id="anthropic-no-message-stop"),
    pytest.param("anthropic", anthropic_sse(message_start(),
                                            block_delta(4, type="text_delta", text="x"),
                                            MESSAGE_STOP),
                 id="anthropic-delta-for-unstarted-block"),
    pytest.param("anthropic", "event: message_start\ndata: {oops\n\n",
                 id="anthropic-data-not-json"),
    pytest.param("anthropic", anthropic_sse({"type": "content_block_start", "index": 0},
                                            MESSAGE_STOP),
                 id="anthropic-block-start-without-block"),
    pytest.param("anthropic", anthropic_sse(
        message_start(), block_start(0, tool_use_block("t", "x", {})),
        block_delta(0, type="input_json_delta", partial_json=7), MESSAGE_STOP),
        id="anthropic-partial-json-number"),
    pytest.param("anthropic", anthropic_sse(
        {"type": "error", "error": {"type": "api_error", "message": "Internal"}}),
        id="anthropic-error-event"),
    pytest.param("openai", sse(("error", {"error": {"message": "boom", "code": "x"}})),
                 id="openai-error-event"),
])
def test_a_malformed_stream_is_an_invalid_response(server, at, body):
    server.reply(200, chunks=pieces(body, 10) or [""])
    chat = openai_at if at == "openai" else anthropic_at
    with pytest.raises(lich.ProviderError) as info:
        chat(server, stream=True)(USER)
    err = info.value
    assert (err.kind, err.retryable, err.provider) == ("invalid_response", False, at)


def test_an_endless_sse_line_is_an_invalid_response(server):
    megabyte = b"y" * (1 << 20)
    server.reply(200, chunks=[b"data: ", *[megabyte] * 40, b"\n\n"])
    with pytest.raises(lich.ProviderError) as info:
        openai_at(server, stream=True)(USER)
    assert (info.value.kind, str(info.value)) == (
        "invalid_response", "openai: invalid response: an SSE line exceeds 33554432 bytes")


def test_on_delta_exceptions_reach_the_caller_unchanged(server):
    server.reply(200, chunks=[openai_sse(delta_chunk(content="a"), delta_chunk(finish="stop"))])

    def broken(text):
        raise KeyError("from the callback")

    with pytest.raises(KeyError, match="from the callback"):
        openai_at(server, stream=True, on_delta=broken)(USER)


# -- Abort ----------------------------------------------------------------------------------


def test_a_set_signal_stops_before_sending(server):
    signal = threading.Event()
    signal.set()
    for chat in (openai_at(server), anthropic_at(server, stream=True)):
        with pytest.raises(lich.AbortError):
            chat(USER, signal=signal)
    assert server.requests == []


@pytest.mark.parametrize("at", ["openai", "anthropic"])
def test_a_signal_set_mid_stream_stops_reading(server, at):
    if at == "openai":
        events = [delta_chunk(content=t) for t in ("one ", "two ", "three ")]
        body, chat = openai_sse(*events, delta_chunk(finish="stop")), openai_at
    else:
        body = anthropic_sse(message_start(), block_start(0, text_block("")),
                             *[block_delta(0, type="text_delta", text=t)
                               for t in ("one ", "two ", "three ")],
                             message_delta("end_turn", 3), MESSAGE_STOP)
        chat = anthropic_at
    cut = body.index("two")
    server.reply(200, chunks=[body[:cut], body[cut:]], delay=0.05)
    signal = threading.Event()
    deltas = []

    def on_delta(text):
        deltas.append(text)
        signal.set()

    started = time.monotonic()
    with pytest.raises(lich.AbortError):
        chat(server, stream=True, on_delta=on_delta)(USER, signal=signal)
    assert deltas == ["one "] and time.monotonic() - started < 2


# -- run_with_retries -------------------------------------------------------------------------


def test_retries_retryable_errors_then_returns():
    signal = RecordingSignal()
    fn = failing(lich.ProviderError("busy", "overloaded"), lich.ProviderError("x", "network"),
                 lich.ProviderError("y", "timeout"), then="done")
    assert lich.run_with_retries(fn, retries=4, base_delay=0.01, signal=signal) == "done"
    assert fn.calls == 4 and len(signal.waits) == 3


@pytest.mark.parametrize("kind", ["auth", "bad_request", "not_found", "overflow",
                                  "invalid_response"])
def test_does_not_retry_errors_that_are_not_retryable(kind):
    err = lich.ProviderError("no", kind)
    fn = failing(err)
    with pytest.raises(lich.ProviderError) as info:
        lich.run_with_retries(fn, base_delay=0.001)
    assert (info.value, fn.calls) == (err, 1)


def test_an_explicitly_unretryable_rate_limit_is_not_retried():
    fn = failing(lich.ProviderError("quota", "rate_limit", retryable=False))
    with pytest.raises(lich.ProviderError):
        lich.run_with_retries(fn, base_delay=0.001)
    assert fn.calls == 1


def test_gives_up_after_the_retries_with_the_last_error():
    errors = [lich.ProviderError(f"e{i}", "server") for i in range(3)]
    fn = failing(*errors)
    with pytest.raises(lich.ProviderError) as info:
        lich.run_with_retries(fn, retries=2, base_delay=0.001)
    assert (info.value, fn.calls) == (errors[2], 3)


def test_backoff_is_exponential_with_jitter_and_capped():
    signal = RecordingSignal()
    for _ in range(20):
        fn = failing(*[lich.ProviderError("e", "server")] * 5)
        lich.run_with_retries(fn, retries=5, base_delay=0.1, max_delay=0.3, signal=signal)
    caps = [0.1, 0.2, 0.3, 0.3, 0.3]
    rows = [signal.waits[i:i + 5] for i in range(0, len(signal.waits), 5)]
    assert len(rows) == 20
    for row in rows:
        assert all(cap / 2 <= wait <= cap for wait, cap in zip(row, caps)), row
    assert len({row[0] for row in rows}) > 1  # jittered


def test_backoff_never_waits_less_than_retry_after():
    signal = RecordingSignal()
    fn = failing(lich.ProviderError("slow", "rate_limit", retry_after=5.0),
                 lich.ProviderError("slow", "rate_limit", retry_after=0.0))
    lich.run_with_retries(fn, base_delay=0.01, max_delay=1.0, signal=signal)
    assert signal.waits[0] == 5.0 and 0.005 <= signal.waits[1] <= 0.02


def test_a_retry_after_above_max_retry_after_is_raised_at_once():
    err = lich.ProviderError("come back tomorrow", "rate_limit", retry_after=3600.0)
    signal = RecordingSignal()
    fn = failing(err)
    with pytest.raises(lich.ProviderError) as info:
        lich.run_with_retries(fn, signal=signal)
    assert (info.value, fn.calls, signal.waits) == (err, 1, [])


def test_retries_over_http_respect_retry_after(server):
    server.reply(429, openai_error("slow down"), headers={"retry-after-ms": "150"})
    server.reply(500, "oops")
    server.reply(200, openai_reply("finally"))
    chat = openai_at(server)
    started = time.monotonic()
    got = lich.run_with_retries(lambda: chat(USER), retries=3, base_delay=0.001)
    assert got.message == {"role": "assistant", "content": "finally"}
    assert len(server.requests) == 3 and time.monotonic() - started >= 0.15


def test_a_signal_set_during_backoff_aborts_at_once():
    signal = threading.Event()
    fn = failing(lich.ProviderError("busy", "overloaded"))
    threading.Timer(0.05, signal.set).start()
    started = time.monotonic()
    with pytest.raises(lich.AbortError):
        lich.run_with_retries(fn, base_delay=10, max_delay=10, signal=signal)
    assert fn.calls == 1 and time.monotonic() - started < 2


def test_a_signal_set_before_the_first_call_aborts_without_calling():
    signal = threading.Event()
    signal.set()
    fn = failing()
    with pytest.raises(lich.AbortError):
        lich.run_with_retries(fn, signal=signal)
    assert fn.calls == 0


# -- Router ------------------------------------------------------------------------------------


def answer(text):
    return {"role": "assistant", "content": text}


@pytest.mark.parametrize("kind", ["auth", "not_found", "rate_limit", "overloaded", "server",
                                  "timeout", "network", "invalid_response"])
def test_router_fails_over(kind):
    first = ScriptedChat(*[lich.ProviderError("down", kind)] * 3)
    second = ScriptedChat(answer("from second"))
    got = lich.Router([first, second], retries=2, base_delay=0.001)(USER)
    retried = kind in lich.ProviderError.RETRYABLE_KINDS
    assert (got.message, len(first.calls), len(second.calls)) == (
        answer("from second"), 3 if retried else 1, 1)


@pytest.mark.parametrize("kind", ["bad_request", "overflow"])
def test_router_does_not_fail_over_on_errors_every_provider_would_give(kind):
    err = lich.ProviderError("refused", kind)
    second = ScriptedChat(answer("never"))
    with pytest.raises(lich.ProviderError) as info:
        lich.Router([ScriptedChat(err), second], base_delay=0.001)(USER)
    assert (info.value, second.calls) == (err, [])


def test_router_raises_the_last_error_when_every_provider_fails():
    last = lich.ProviderError("second is down too", "auth")
    router = lich.Router([ScriptedChat(lich.ProviderError("down", "not_found")),
                          ScriptedChat(last)])
    with pytest.raises(lich.ProviderError) as info:
        router(USER)
    assert info.value is last


def test_router_passes_the_call_through():
    chat = ScriptedChat(answer("ok"))
    signal = threading.Event()
    lich.Router([chat])(USER, tools=[WEATHER_SPEC], temperature=0.5, max_tokens=9, signal=signal)
    assert chat.calls == [{"messages": USER, "tools": [WEATHER_SPEC], "temperature": 0.5,
                           "max_tokens": 9, "signal": signal}]


def test_router_moves_on_instead_of_waiting_out_a_long_retry_after():
    first = ScriptedChat(lich.ProviderError("later", "rate_limit", retry_after=20.0))
    second = ScriptedChat(answer("now"))
    started = time.monotonic()
    got = lich.Router([first, second], max_delay=5.0)(USER)
    assert got.message == answer("now") and time.monotonic() - started < 2


def test_router_stops_walking_when_the_signal_is_set():
    signal = threading.Event()

    def fail_and_abort(messages):
        signal.set()
        return lich.ProviderError("down", "network")

    second = ScriptedChat(answer("never"))
    with pytest.raises(lich.AbortError):
        lich.Router([ScriptedChat(fail_and_abort), second], base_delay=0.001)(USER, signal=signal)
    assert second.calls == []


def test_router_fails_over_between_real_providers(server):
    def responder(request):
        if request["path"] == "/v1/chat/completions":
            return Reply(503, "upstream connect error")
        return Reply(200, anthropic_reply(text_block("from anthropic")))

    server.responder = responder
    router = lich.Router([openai_at(server), anthropic_at(server)], retries=1, base_delay=0.001)
    assert router(USER) == result("from anthropic", usage=(7, 3), model="claude-test-1",
                                  stop="stop")
    assert [r["path"] for r in server.requests] == ["/v1/chat/completions"] * 2 + ["/v1/messages"]


def test_router_needs_a_chat():
    with pytest.raises(ValueError):
        lich.Router([])


# -- chat_from_spec ------------------------------------------------------------------------


@pytest.mark.parametrize("spec, cls, model, base_url", [
    pytest.param("openai:gpt-4.1-mini", lich.OpenAIChat, "gpt-4.1-mini",
                 "https://api.openai.com/v1", id="openai"),
    pytest.param("anthropic:claude-sonnet-4-5", lich.AnthropicChat, "claude-sonnet-4-5",
                 "https://api.anthropic.com", id="anthropic"),
    pytest.param("openai:llama3.2@http://localhost:11434/v1", lich.OpenAIChat, "llama3.2",
                 "http://localhost:11434/v1", id="openai-with-base-url"),
    pytest.param(" Anthropic : claude@2025 ", lich.AnthropicChat, "claude@2025",
                 "https://api.anthropic.com", id="at-sign-in-model-name"),
])
def test_chat_from_spec_forms(spec, cls, model, base_url):
    chat = lich.chat_from_spec(spec)
    assert (type(chat), chat.model, chat.base_url) == (cls, model, base_url)


def test_chat_from_spec_passes_each_option_where_it_applies():
    deltas = []
    router = lich.chat_from_spec(
        "openai:a@http://127.0.0.1:9/v1, anthropic:b", api_key=KEY, timeout=7, stream=True,
        on_delta=deltas.append, max_tokens=123, retries=5, base_delay=0.5, max_delay=9.0)
    assert type(router) is lich.Router
    assert (router.retries, router.base_delay, router.max_delay) == (5, 0.5, 9.0)
    openai, anthropic = router.chats
    assert (type(openai), openai.model, openai.base_url, openai.timeout, openai.stream) == (
        lich.OpenAIChat, "a", "http://127.0.0.1:9/v1", 7, True)
    assert (type(anthropic), anthropic.model, anthropic.max_tokens, anthropic.on_delta) == (
        lich.AnthropicChat, "b", 123, deltas.append)


def test_chat_from_spec_talks_to_a_local_server_without_a_key(server):
    server.reply(200, openai_reply("local"))
    server.reply(200, anthropic_reply(text_block("local too")))
    assert lich.chat_from_spec(f"openai:llama@{server.url}/v1")(USER).message == answer("local")
    assert lich.chat_from_spec(f"anthropic:c@{server.url}")(USER).message == answer("local too")
    assert [("authorization" in r["headers"], "x-api-key" in r["headers"])
            for r in server.requests] == [(False, False), (False, False)]


@pytest.mark.parametrize("spec, variable", [("openai:gpt-4.1-mini", "OPENAI_API_KEY"),
                                            ("anthropic:claude-sonnet-4-5", "ANTHROPIC_API_KEY")])
def test_chat_from_spec_without_a_key_names_the_variable(spec, variable):
    with pytest.raises(lich.ProviderError) as info:
        lich.chat_from_spec(spec)(USER)
    assert info.value.kind == "auth" and f"set {variable}" in str(info.value)


def test_chat_from_spec_unknown_provider_names_the_known_ones():
    with pytest.raises(ValueError) as info:
        lich.chat_from_spec("gemini:pro")
    assert str(info.value) == ("unknown provider 'gemini' in 'gemini:pro'; known providers: "
                               "anthropic, openai")


@pytest.mark.parametrize("spec", ["", "gpt-4", "openai:", "openai:a,,anthropic:b", ":model"])
def test_chat_from_spec_refuses_malformed_specs(spec):
    with pytest.raises(ValueError, match="invalid model spec"):
        lich.chat_from_spec(spec)


def test_chat_from_spec_unknown_option_is_a_type_error():
    with pytest.raises(TypeError, match="'temperature'"):
        lich.chat_from_spec("openai:gpt-4.1-mini", temperature=0.5)


# -- Threads ---------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streaming"])
def test_one_chat_object_serves_32_threads(server, stream):
    def echo(request):
        said = request["json"]["messages"][-1]["content"]
        if stream:
            return Reply(200, chunks=[openai_sse(delta_chunk(content=said),
                                                 delta_chunk(finish="stop"))])
        return Reply(200, openai_reply(said))

    server.responder = echo
    chat = openai_at(server, stream=stream)
    # The loopback server's listen backlog is 5: connections open a few at a time, then
    # all 32 threads call at once over their kept-alive connections.
    opening = threading.BoundedSemaphore(4)
    barrier = threading.Barrier(32, timeout=20)
    answers = {}
    failures = []

    def call(n, turn):
        said = f"thread {n} turn {turn}"
        answers[said] = chat([{"role": "user", "content": said}]).message["content"]

    def worker(n):
        try:
            with opening:
                call(n, 0)
            barrier.wait()
            for turn in (1, 2):
                call(n, turn)
        except (lich.ProviderError, lich.AbortError, threading.BrokenBarrierError) as e:
            failures.append(e)
            barrier.abort()

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert failures == []
    assert len(answers) == 96 and all(said == got for said, got in answers.items())


# -- Recorded provider responses -------------------------------------------------------------


def _fixture_text(name):
    data = json.loads((FIXTURES / name).read_text())
    return data["choices"][0]["message"]["content"]


# fixture -> (content, tool calls as (id, name, arguments), (input, output) usage, model, stop)
RECORDED = {
    "openai/text_basic.json": (
        "This is a test.", [], (12, 5), "gpt-4o-mini-2024-07-18", "stop"),
    "openai/text_cached_tokens.json": (
        "Ah, breakfast!", [], (3702, 257), "gpt-4o-2024-08-06", "stop"),
    "openai/text_n2_choices.json": (
        "This is a test. How can I assist you further?", [], (12, 24),
        "gpt-4o-mini-2024-07-18", "stop"),
    "openai/tool_call_single.json": (
        "", [("call_TTY8UFNo7rNCaOBUNtlRSvMG", "lookup_population", '{"country":"Crumpet"}')],
        (92, 17), "gpt-4o-mini-2024-07-18", "tool_calls"),
    "openai/tool_calls_parallel_2.json": (
        "", [("call_eqbDFUdPqay2WjsSzZEiAn0U", "get_current_weather",
              '{"location": "Seattle, WA"}'),
             ("call_tn3sgasg6GaftTdancBYJNJN", "get_current_weather",
              '{"location": "San Francisco, CA"}')],
        (75, 51), "gpt-4o-mini-2024-07-18", "tool_calls"),
    "openai/tool_calls_parallel_3_reasoning.json": (
        "", [("call_Putc2jV5GhiIZMwx8mDcI61Q", "parallel_local_search_one",
              '{"query": "latest OpenAI model release notes"}'),
             ("call_iyjwcvkL3PdoOddxsqkHCT9T", "parallel_local_search_two",
              '{"query": "latest Anthropic model release notes"}'),
             ("call_G728RseEU7SbGk5YTiyyp9IH", "parallel_local_search_three",
              '{"query": "latest Gemini model release notes"}')],
        (378, 1497), "gpt-5-nano-2025-08-07", "tool_calls"),
    "openai/refusal_content_null.json": (
        "I'm very sorry, but I can't assist with that request.", [], (64, 13),
        "gpt-4o-2024-08-06", "stop"),
    "openai/length_empty_content_reasoning.json": (
        "", [], (13, 50), "gpt-5-mini-2025-08-07", "length"),
    "openai/stream_text_with_usage.sse": (
        '"This is a test."', [], (12, 5), "gpt-4-0613", "stop"),
    "openai/stream_text_no_usage.sse": (
        "Four plus five is nine.", [], (0, 0), "gpt-4.1-2025-04-14", "stop"),
    "openai/stream_tool_call_single_with_usage.sse": (
        "", [("call_1EYWDzueHEp8OsB8jJSEp7WB", "multiply", '{"a":1231,"b":2331}')],
        (54, 20), "gpt-4o-mini-2024-07-18", "tool_calls"),
    "openai/stream_tool_calls_parallel_with_usage.sse": (
        "", [("call_j7L00WV19wwQCvKOIVZewXZm", "get_current_weather",
              '{"location": "Seattle, WA"}'),
             ("call_sAIOI3dvcd1YMsEqD8DI3l8B", "get_current_weather",
              '{"location": "San Francisco, CA"}')],
        (75, 51), "gpt-4o-mini-2024-07-18", "tool_calls"),
    "openai/stream_tool_calls_parallel_no_usage.sse": (
        "", [("call_cCPjAyfwTzboEKjVlqFrArNF", "get_current_weather",
              '{"location": "San Francisco"}'),
             ("call_Zi4He1Ns0mozwT6f85nW1BOW", "get_current_weather",
              '{"location": "Boston"}')],
        (0, 0), "gpt-3.5-turbo-0125", "tool_calls"),
    "anthropic/text_basic.json": (
        "4200 + 42 = 4242", [], (17, 15), "claude-sonnet-4-20250514", "stop"),
    "anthropic/tool_use_single.json": (
        "I'll help you calculate 15 * 8 using the calculator tool.",
        [("toolu_012QnA8xTpf27BLo6rkdvpoe", "calculator", '{"expression": "15 * 8"}')],
        (430, 73), "claude-3-5-haiku-20241022", "tool_calls"),
    "anthropic/tool_use_parallel_2.json": (
        "I'll retrieve the secrets for both passwords you provided.",
        [("toolu_01BUvqBj8Yb34pNAbCJJY1oc", "secret_retrieval_tool", '{"password": "mellon"}'),
         ("toolu_01VPuQJ1LonDBYXrr8pqPkqQ", "secret_retrieval_tool",
          '{"password": "radiance"}')],
        (416, 109), "claude-sonnet-4-20250514", "tool_calls"),
    "anthropic/thinking_text.json": (
        "2 + 2 = 4", [], (43, 36), "claude-sonnet-4-5-20250929", "stop"),
    "anthropic/max_tokens.json": (
        "# The Last Song of Vaelthys", [], (16, 10), "claude-sonnet-4-20250514", "length"),
    "anthropic/stream_text.sse": (
        "Hello", [], (10, 4), "claude-haiku-4-5-20251001", "stop"),
    "anthropic/stream_text_and_tool_use_x2.sse": (
        "I'll retrieve the secrets for both passwords you provided.",
        [("toolu_015cUijgET79LXjgeYQerN2h", "secret_retrieval_tool", '{"password": "mellon"}'),
         ("toolu_01XZTimPexA7h3EVKesnKt5T", "secret_retrieval_tool",
          '{"password": "radiance"}')],
        (416, 109), "claude-sonnet-4-20250514", "tool_calls"),
    "anthropic/stream_thinking_text.sse": (
        ('1. **Pouch** - references their iconic bill pouch\n2. **Pelé** - playful take on '
         '"pelican"'), [], (46, 133), "claude-haiku-4-5-20251001", "stop"),
    "anthropic/stream_thinking_tool_use.sse": (
        "", [("toolu_01825dXWLSoJwCst1qTsiWdb", "fixed_version", "{}")], (598, 92),
        "claude-haiku-4-5-20251001", "tool_calls"),
    "anthropic/stream_redacted_thinking.sse": (
        ("I notice that you've sent what appears to be some kind of test string or command. "
         "I don't have any special \"magic string\" triggers or backdoor commands that would "
         "expose internal systems or change my behavior.\n\nI'm Claude, an AI assistant "
         "created by Anthropic to be helpful, harmless, and honest. How can I assist you today "
         "with a legitimate task or question?"), [], (92, 189), "claude-sonnet-4-5-20250929",
        "stop"),
    "openai-compatible/ollama_tool_calls_3_reasoning.json": (
        "", [("call_2qwy5kxj", "dice_roll", "{}"), ("call_bpkrefyu", "dice_roll", "{}"),
             ("call_7t3hvz5k", "dice_roll", "{}")], (152, 134), "qwen3", "tool_calls"),
    "openai-compatible/vllm_text.json": (
        ('Why did the OpenTelemetry metric go to therapy?\n\nBecause it was feeling a little '
         '"trapped" in its logging function, and wanted to "release" its stress.'), [],
        (43, 36), "meta-llama/Llama-3.2-1B-Instruct", "stop"),
    "openai-compatible/openrouter_text_leading_whitespace.json": (
        "Hello!", [], (12, 2), "openai/gpt-4o", "stop"),
    "openai-compatible/together_tool_call.json": (
        "", [("call_3xdm9hr8hghhxh9xjmclmt8s", "get_current_weather", '{"city":"Paris"}')],
        (198, 24), "meta-llama/Llama-3.3-70B-Instruct-Turbo", "tool_calls"),
    "openai-compatible/deepseek_stream_reasoning_content.sse": (
        "The product of 17 and 23 is 391.", [], (17, 47), "deepseek-v4-pro", "stop"),
    "openai-compatible/mistral_stream_tool_call_no_index.sse": (
        "", [("EscTeQY62", "get_weather", '{"city": "San Francisco"}')], (96, 23),
        "mistral-small-latest", "tool_calls"),
}


def _serve_recording(server, name):
    """Queue the recorded body; returns the chat that speaks its protocol."""
    raw = (FIXTURES / name).read_bytes()
    stream = name.endswith(".sse")
    if stream:
        server.reply(200, chunks=pieces(raw, 61))
    else:
        server.reply(200, raw, content_type="application/json")
    at = anthropic_at if name.startswith("anthropic/") else openai_at
    return at(server, stream=stream)


@needs_fixtures
@pytest.mark.parametrize("name", sorted(RECORDED))
def test_recorded_success(server, name):
    content, calls, usage, model, stop = RECORDED[name]
    if name == "openai/text_cached_tokens.json":
        content = _fixture_text(name)  # a long text: the recording is its own reference
        assert content.startswith("Ah, breakfast!") and len(content) > 900
    deltas = []
    chat = _serve_recording(server, name)
    chat.on_delta = deltas.append
    assert chat(USER) == result(content, *calls, usage=usage, model=model, stop=stop)
    if name.endswith(".sse"):
        assert "".join(deltas) == content and "" not in deltas


def test_every_recording_has_a_case():
    if not FIXTURES.is_dir():
        pytest.skip("../shared/fixtures/providers is absent")
    names = {str(p.relative_to(FIXTURES)) for p in FIXTURES.glob("*/*")
             if p.suffix in (".json", ".sse") and not p.name.endswith(".request.json")
             and p.parent.name != "errors"}
    assert names - set(RECORDED) == set(STREAM_ERRORS)


# fixture -> (kind, retryable, text the message must carry)
STREAM_ERRORS = {
    "openai-compatible/groq_stream_midstream_error_event.sse": (
        "invalid_response", False,
        "openai: error event in stream (tool_use_failed): Tool call validation failed"),
    "openai-compatible/openrouter_stream_comments_midstream_error.sse": (
        "invalid_response", False, "openai: error event in stream (400): Token limit reached"),
}


@needs_fixtures
@pytest.mark.parametrize("name", sorted(STREAM_ERRORS))
def test_recorded_stream_error(server, name):
    kind, retryable, text = STREAM_ERRORS[name]
    with pytest.raises(lich.ProviderError) as info:
        _serve_recording(server, name)(USER)
    assert (info.value.kind, info.value.retryable) == (kind, retryable)
    assert str(info.value).startswith(text)


# error fixture -> (kind, retryable, retry_after, text the message must carry)
RECORDED_ERRORS = {
    "anthropic-400-invalid_request_error.json": (
        "bad_request", False, None,
        "HTTP 400 (invalid_request_error): messages.0: Input does not match the expected shape."),
    "anthropic-400-prompt_too_long.json": (
        "overflow", False, None,
        "HTTP 400 (invalid_request_error): prompt is too long: 3333404 tokens > 200000 maximum"),
    "anthropic-401-authentication_error.json": (
        "auth", False, None, "HTTP 401 (authentication_error): invalid x-api-key"),
    "anthropic-404-not_found_error.json": (
        "not_found", False, None,
        "HTTP 404 (not_found_error): model: this-model-does-not-exist-12345"),
    "anthropic-429-rate_limit_error.json": (
        "rate_limit", True, 41.0, "HTTP 429 (rate_limit_error): This request would exceed"),
    "anthropic-503-upstream_connect_error.txt": (
        "overloaded", True, None, "HTTP 503: upstream connect error or disconnect/reset"),
    "azure-429-RateLimitReached.json": (
        "rate_limit", True, 0.0, "HTTP 429 (RateLimitReached): Your requests to grok-4-1"),
    "deepseek-400-context_length.json": (
        "overflow", False, None,
        "HTTP 400 (invalid_request_error): This model's maximum context length is 1048565"),
    "groq-400-tool_use_failed.json": (
        "bad_request", False, None, "HTTP 400 (tool_use_failed): Tool call validation failed"),
    "mistral-401-detail.json": ("auth", False, None, "HTTP 401: Invalid API Key"),
    "ollama-400-prompt_too_long.json": (
        "overflow", False, None, "HTTP 400 (invalid_request_error): prompt too long; exceeded"),
    "openai-400-context_length_exceeded.json": (
        "overflow", False, None,
        "HTTP 400 (context_length_exceeded): Your input exceeds the context window"),
    "openai-400-unsupported_parameter.json": (
        "bad_request", False, None,
        "HTTP 400 (unsupported_parameter): Unsupported parameter: 'stop' is not supported"),
    "openai-401-invalid_api_key.json": (
        "auth", False, None, "HTTP 401 (invalid_api_key): Incorrect API key provided"),
    "openai-404-model_not_found.json": (
        "not_found", False, None, "HTTP 404 (model_not_found): The model `this-model-does-not"),
    "openai-429-rate_limit_exceeded.json": (
        "rate_limit", True, None, "HTTP 429 (rate_limit_exceeded): Request too large"),
    "openai-503-upstream_connect_error.txt": (
        "overloaded", True, None, "HTTP 503: upstream connect error or disconnect/reset"),
    "openrouter-429-provider_rate_limited.json": (
        "rate_limit", True, None, "HTTP 429 (429): Provider returned error: google/gemini"),
}


@needs_fixtures
@pytest.mark.parametrize("name", sorted(RECORDED_ERRORS))
def test_recorded_error(server, name):
    kind, retryable, retry_after, text = RECORDED_ERRORS[name]
    sidecar = json.loads((FIXTURES / "errors" / (name.rsplit(".", 1)[0] + ".headers.json"))
                         .read_text())
    headers = {k: v for k, v in sidecar["headers"].items() if k != "content-type"}
    server.reply(sidecar["status"], (FIXTURES / "errors" / name).read_bytes(), headers=headers,
                 content_type=sidecar["headers"]["content-type"])
    provider = "anthropic" if name.startswith("anthropic") else "openai"
    chat = (anthropic_at if provider == "anthropic" else openai_at)(server, api_key=KEY)
    with pytest.raises(lich.ProviderError) as info:
        chat(USER)
    err = info.value
    assert (err.kind, err.retryable, err.retry_after, err.status, err.provider) == (
        kind, retryable, retry_after, sidecar["status"], provider)
    assert str(err).startswith(f"{provider}: {text}")


def test_every_recorded_error_has_a_case():
    if not FIXTURES.is_dir():
        pytest.skip("../shared/fixtures/providers is absent")
    names = {p.name for p in (FIXTURES / "errors").iterdir()
             if not p.name.endswith(".headers.json")}
    assert names == set(RECORDED_ERRORS)


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
                          cwd=HERE, timeout=60)
    assert proc.stdout == "False\n", proc.stderr
