"""A loopback chat server for the benchmarks, run as its own process.

    python bench/loopback_server.py [--latency SECONDS] [--max-in-flight N
                                    [--retry-after-ms MS]] [--cache-sim]

prints its port on the first line of stdout, then serves until killed. It speaks two
dialects, each plain (one JSON body) or streamed (Server-Sent Events, chunked):

- POST /v1/chat/completions: OpenAI Chat Completions;
- POST /v1/messages: Anthropic Messages (message_start, content_block_start,
  content_block_delta with text_delta and input_json_delta, content_block_stop,
  message_delta, message_stop).

Every answer follows one script. When the first user message says "... N times ..."
(bench/http_clients.py writes "Call the lookup tool N times, then answer."), the server
answers a short text and one call of the tool "lookup" while the request holds fewer
than N tool results, and a final text after that: a conversation of N + 1 turns. Any
other first message (the command line's "hi") gets the final text at once. When the
first user message starts with "Task ID." (the batch rows), the final text ends with
" [ID]", so that a result can be checked to be its own task's.

--max-in-flight N admits at most N POSTs at once (counted from arrival until the answer
is about to be written, the latency included) and answers any beyond them at once with
429, an OpenAI-style error body and a ``retry-after-ms`` header (--retry-after-ms, default
the latency). --cache-sim makes Anthropic answers report usage as Anthropic does with
prompt caching (``input_tokens``, ``cache_creation_input_tokens``,
``cache_read_input_tokens``), honouring the request's ``cache_control`` breakpoints: see
``CacheSim``.

GET /arrivals answers the monotonic clock times (``time.monotonic()``, one clock for
every process of the machine) at which the POSTs since the last GET arrived, and
forgets them: the startup benchmark times a process up to its first request with it.
GET /stats answers and resets the counters: POSTs, 429s, the most POSTs in flight at once,
and the cache simulation's token sums. GET /reset also forgets the simulated cache.
"""

import argparse
import hashlib
import json
import re
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

FINAL_TEXT = "All done: every step finished."
TIMES = re.compile(r"\b(\d+) times\b")
TASK = re.compile(r"Task ([A-Za-z0-9_.-]+)\.")
ARRIVALS = []
ARRIVALS_LOCK = threading.Lock()
STATS_LOCK = threading.Lock()
STATS = {"posts": 0, "rejected_429": 0, "peak_in_flight": 0, "in_flight": 0}


# ---------------------------------------------------------------------------- the script

def _text_of(content):
    if isinstance(content, str):
        return content
    return "".join(b.get("text") or "" for b in content or () if isinstance(b, dict))


def step(first_user_text, results_so_far):
    """(text, call or None): what the assistant says next; a call is (index, arguments JSON)."""
    found = TIMES.search(first_user_text or "")
    wanted = int(found.group(1)) if found else 0
    if results_so_far >= wanted:
        task = TASK.match(first_user_text or "")
        return (FINAL_TEXT + f" [{task.group(1)}]" if task else FINAL_TEXT), None
    k = results_so_far + 1
    arguments = json.dumps({"path": f"src/pkg/module_{k}.py", "line": 10 * k})
    return f"Reading module_{k}.py next.", (k, arguments)


def openai_step(request):
    messages = request.get("messages") or []
    first = next((m.get("content") for m in messages if m.get("role") == "user"), "")
    done = sum(1 for m in messages if m.get("role") == "tool")
    return step(_text_of(first), done)


def anthropic_step(request):
    messages = request.get("messages") or []
    first = next((m.get("content") for m in messages if m.get("role") == "user"), "")
    done = sum(1 for m in messages if m.get("role") == "user" and isinstance(m.get("content"), list)
               for b in m["content"] if isinstance(b, dict) and b.get("type") == "tool_result")
    return step(_text_of(first), done)


def usage(request):
    # a rough count of what came in, as a real server reports it
    return max(1, len(json.dumps(request.get("messages"))) // 4), 20


# ---------------------------------------------------------------------------- prompt cache

MIN_CACHEABLE_TOKENS = 1024  # Anthropic's shortest cacheable prefix (Sonnet and Opus models)
LOOKBACK_BLOCKS = 20         # how far before a breakpoint Anthropic looks for a cached prefix


def prompt_blocks(request):
    """(tokens, JSON without cache_control, has a breakpoint) per block, in the order
    Anthropic caches: the tools, the system prompt, then every block of every message."""
    def entry(where, block):
        plain = {k: v for k, v in block.items() if k != "cache_control"}
        encoded = json.dumps([where, plain], sort_keys=True).encode()
        return max(1, len(encoded) // 4), encoded, "cache_control" in block

    for tool in request.get("tools") or ():
        yield entry("tool", tool)
    system = request.get("system")
    for block in [{"type": "text", "text": system}] if isinstance(system, str) else system or ():
        yield entry("system", block)
    for message in request.get("messages") or ():
        content = message.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content or ()
        for block in blocks:
            yield entry(message.get("role"), block)


class CacheSim:
    """Anthropic's prompt cache, simulated: a request writes the prefix ending at each of its
    ``cache_control`` breakpoints (at least MIN_CACHEABLE_TOKENS long) to the cache; a later
    request reads the longest cached prefix ending within LOOKBACK_BLOCKS blocks before one
    of its breakpoints. Tokens are the bytes of each block's JSON over 4. Reported as
    Anthropic does: ``cache_read_input_tokens`` (the prefix found), ``cache_creation_input_tokens``
    (from there to the last breakpoint, when that is cacheable) and ``input_tokens`` (the rest,
    at full price)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.entries = set()

    def reset(self):
        with self.lock:
            self.entries.clear()

    def usage(self, request):
        running = hashlib.sha256()
        prefixes, sums, breakpoints, total = [], [], [], 0
        for i, (tokens, encoded, breakpoint) in enumerate(prompt_blocks(request)):
            running.update(encoded)
            prefixes.append(running.copy().digest())
            total += tokens
            sums.append(total)
            if breakpoint:
                breakpoints.append(i)
        with self.lock:
            found = -1
            for b in breakpoints:
                for i in range(b, max(-1, b - LOOKBACK_BLOCKS), -1):
                    if prefixes[i] in self.entries:
                        found = max(found, i)
                        break
            read = sums[found] if found >= 0 else 0
            created = 0
            if breakpoints and breakpoints[-1] > found and sums[breakpoints[-1]] >= MIN_CACHEABLE_TOKENS:
                created = sums[breakpoints[-1]] - read
            for b in breakpoints:
                if sums[b] >= MIN_CACHEABLE_TOKENS:
                    self.entries.add(prefixes[b])
        with STATS_LOCK:
            for key, value in (("input_tokens", total - read - created),
                               ("cache_creation_input_tokens", created),
                               ("cache_read_input_tokens", read)):
                STATS[key] = STATS.get(key, 0) + value
        return {"input_tokens": total - read - created, "cache_creation_input_tokens": created,
                "cache_read_input_tokens": read}


CACHE = None  # a CacheSim with --cache-sim


def anthropic_usage(request):
    """The input side of an Anthropic usage object."""
    if CACHE is not None:
        return CACHE.usage(request)
    return {"input_tokens": usage(request)[0]}


# ---------------------------------------------------------------------------- OpenAI

def openai_whole(request):
    text, call = openai_step(request)
    message = {"role": "assistant", "content": text}
    if call:
        message["tool_calls"] = [{"id": f"call_{call[0]}", "type": "function",
                                  "function": {"name": "lookup", "arguments": call[1]}}]
    prompt, completion = usage(request)
    return {"id": "chatcmpl-bench", "object": "chat.completion", "created": 0,
            "model": request.get("model", "bench"),
            "choices": [{"index": 0, "message": message,
                         "finish_reason": "tool_calls" if call else "stop"}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                      "total_tokens": prompt + completion}}


def openai_events(request):
    """(event name or None, data) per SSE event."""
    text, call = openai_step(request)
    base = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 0,
            "model": request.get("model", "bench")}

    def chunk(delta, finish=None):
        return None, {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

    yield chunk({"role": "assistant", "content": ""})
    for word in text.split(" "):
        yield chunk({"content": word + " "})
    if call:
        yield chunk({"tool_calls": [{"index": 0, "id": f"call_{call[0]}", "type": "function",
                                     "function": {"name": "lookup", "arguments": ""}}]})
        for i in range(0, len(call[1]), 8):
            yield chunk({"tool_calls": [{"index": 0, "function": {"arguments": call[1][i:i + 8]}}]})
        yield chunk({}, "tool_calls")
    else:
        yield chunk({}, "stop")
    prompt, completion = usage(request)
    yield None, {**base, "choices": [], "usage": {"prompt_tokens": prompt,
                                                  "completion_tokens": completion,
                                                  "total_tokens": prompt + completion}}
    yield None, "[DONE]"


# ---------------------------------------------------------------------------- Anthropic

def anthropic_whole(request):
    text, call = anthropic_step(request)
    content = [{"type": "text", "text": text}]
    if call:
        content.append({"type": "tool_use", "id": f"toolu_{call[0]}", "name": "lookup",
                        "input": json.loads(call[1])})
    return {"id": "msg_bench", "type": "message", "role": "assistant",
            "model": request.get("model", "bench"), "content": content,
            "stop_reason": "tool_use" if call else "end_turn", "stop_sequence": None,
            "usage": {**anthropic_usage(request), "output_tokens": 20}}


def anthropic_events(request):
    text, call = anthropic_step(request)
    completion = 20
    yield "message_start", {"type": "message_start", "message": {
        "id": "msg_bench", "type": "message", "role": "assistant", "content": [],
        "model": request.get("model", "bench"), "stop_reason": None, "stop_sequence": None,
        "usage": {**anthropic_usage(request), "output_tokens": 1}}}
    yield "content_block_start", {"type": "content_block_start", "index": 0,
                                  "content_block": {"type": "text", "text": ""}}
    yield "ping", {"type": "ping"}
    for word in text.split(" "):
        yield "content_block_delta", {"type": "content_block_delta", "index": 0,
                                      "delta": {"type": "text_delta", "text": word + " "}}
    yield "content_block_stop", {"type": "content_block_stop", "index": 0}
    if call:
        yield "content_block_start", {"type": "content_block_start", "index": 1, "content_block": {
            "type": "tool_use", "id": f"toolu_{call[0]}", "name": "lookup", "input": {}}}
        for i in range(0, len(call[1]), 8):
            yield "content_block_delta", {"type": "content_block_delta", "index": 1, "delta": {
                "type": "input_json_delta", "partial_json": call[1][i:i + 8]}}
        yield "content_block_stop", {"type": "content_block_stop", "index": 1}
    yield "message_delta", {"type": "message_delta",
                            "delta": {"stop_reason": "tool_use" if call else "end_turn",
                                      "stop_sequence": None},
                            "usage": {"output_tokens": completion}}
    yield "message_stop", {"type": "message_stop"}


# ---------------------------------------------------------------------------- HTTP

DIALECTS = {"/v1/chat/completions": (openai_whole, openai_events),
            "/v1/messages": (anthropic_whole, anthropic_events)}


RATE_LIMITED = json.dumps({"error": {
    "message": "Rate limit reached: too many requests in flight", "type": "requests",
    "code": "rate_limit_exceeded"}}).encode()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # as real servers do: no delayed-ACK stalls for either client
    latency = 0.0
    max_in_flight = None
    retry_after_ms = 0

    def log_message(self, *args):
        pass

    def do_GET(self):
        if self.path == "/arrivals":
            with ARRIVALS_LOCK:
                body = json.dumps(ARRIVALS).encode()
                ARRIVALS.clear()
        elif self.path in ("/stats", "/reset"):
            with STATS_LOCK:
                body = json.dumps({k: v for k, v in STATS.items() if k != "in_flight"}).encode()
                for key in STATS:
                    if key != "in_flight":
                        STATS[key] = 0
            if self.path == "/reset" and CACHE is not None:
                CACHE.reset()
        else:
            self.send_error(404)
            return
        self._send_json(200, body)

    def do_POST(self):
        arrived = time.monotonic()
        with ARRIVALS_LOCK:
            ARRIVALS.append(arrived)
        size = int(self.headers["Content-Length"])
        body = self.rfile.read(size)
        if len(body) < size:  # a client killed mid-request (the kill row): nobody to answer
            self.close_connection = True
            return
        request = json.loads(body)
        dialect = DIALECTS.get(self.path)
        if dialect is None:
            self._send_json(404, b'{"error": {"message": "not found"}}')
            return
        with STATS_LOCK:
            STATS["posts"] += 1
            admitted = self.max_in_flight is None or STATS["in_flight"] < self.max_in_flight
            if admitted:
                STATS["in_flight"] += 1
                STATS["peak_in_flight"] = max(STATS["peak_in_flight"], STATS["in_flight"])
            else:
                STATS["rejected_429"] += 1
        if not admitted:
            self._send_json(429, RATE_LIMITED, {"retry-after-ms": str(self.retry_after_ms)})
            return
        try:
            whole, events = dialect
            if self.latency:
                time.sleep(self.latency)
            answer = None if request.get("stream") else json.dumps(whole(request)).encode()
        finally:
            # before the answer is written: a client that has it may send its next at once
            with STATS_LOCK:
                STATS["in_flight"] -= 1
        if answer is not None:
            self._send_json(200, answer)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for name, data in events(request):
            encoded = data.encode() if isinstance(data, str) else json.dumps(data).encode()
            event = (b"event: " + name.encode() + b"\n" if name else b"") + b"data: " + encoded + b"\n\n"
            self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
        self.wfile.write(b"0\r\n\r\n")

    def _send_json(self, status, body, headers=()):
        self.send_response(status)
        for name, value in dict(headers).items():
            self.send_header(name, value)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128

    def handle_error(self, request, client_address):
        if not isinstance(sys.exc_info()[1], ConnectionError):  # a client that went away
            super().handle_error(request, client_address)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--latency", type=float, default=0.0,
                        help="seconds to wait before each answer (a model's latency)")
    parser.add_argument("--max-in-flight", type=int, default=None,
                        help="admit at most N POSTs at once; 429 with retry-after-ms beyond")
    parser.add_argument("--retry-after-ms", type=int, default=None,
                        help="the retry-after-ms of a 429 (default: the latency)")
    parser.add_argument("--cache-sim", action="store_true",
                        help="Anthropic usage with a simulated prompt cache")
    args = parser.parse_args()
    global CACHE
    Handler.latency = args.latency
    Handler.max_in_flight = args.max_in_flight
    Handler.retry_after_ms = (args.retry_after_ms if args.retry_after_ms is not None
                              else round(args.latency * 1000))
    if args.cache_sim:
        CACHE = CacheSim()
    server = Server(("127.0.0.1", 0), Handler)
    print(server.server_address[1], flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
