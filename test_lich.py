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
