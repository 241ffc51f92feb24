"""A loopback OpenAI-compatible server for the benchmarks, run as its own process.

    python bench/loopback_server.py [--latency SECONDS]

prints its port on the first line of stdout, then serves until killed. Every
POST to /v1/chat/completions answers a scripted tool conversation: while the request
holds fewer than ``tool_turns`` tool messages (the "tool_turns" key of the request
body, default 19), the answer is one call of the tool "noop"; after that, a final text.
With "stream": true the answer is sent as Server-Sent Events, as OpenAI does.
"""

import argparse
import json
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

USAGE = {"prompt_tokens": 50, "completion_tokens": 10, "total_tokens": 60}


def answer(request):
    done = sum(1 for m in request.get("messages", []) if m.get("role") == "tool")
    if done < request.get("tool_turns", 19):
        return None, [{"id": f"call_{done}", "type": "function",
                       "function": {"name": "noop", "arguments": json.dumps({"n": done})}}]
    return "All done: every step finished.", None


def completion(request):
    content, calls = answer(request)
    message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    return {"id": "chatcmpl-bench", "object": "chat.completion", "created": 0,
            "model": request.get("model", "bench"),
            "choices": [{"index": 0, "message": message,
                         "finish_reason": "tool_calls" if calls else "stop"}],
            "usage": USAGE}


def stream_events(request):
    content, calls = answer(request)
    base = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 0,
            "model": request.get("model", "bench")}

    def chunk(delta, finish=None):
        return {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

    yield chunk({"role": "assistant", "content": ""})
    if calls:
        call = calls[0]
        args = call["function"]["arguments"]
        yield chunk({"tool_calls": [{"index": 0, "id": call["id"], "type": "function",
                                     "function": {"name": "noop", "arguments": ""}}]})
        for i in range(0, len(args), 4):
            yield chunk({"tool_calls": [{"index": 0, "function": {"arguments": args[i:i + 4]}}]})
        yield chunk({}, "tool_calls")
    else:
        for word in content.split(" "):
            yield chunk({"content": word + " "})
        yield chunk({}, "stop")
    yield {**base, "choices": [], "usage": USAGE}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # as real servers do: no delayed-ACK stalls for either client
    latency = 0.0

    def log_message(self, *args):
        pass

    def do_POST(self):
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.latency:
            time.sleep(self.latency)
        if not request.get("stream"):
            body = json.dumps(completion(request)).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for event in stream_events(request):
            data = b"data: " + json.dumps(event).encode() + b"\n\n"
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        done = b"data: [DONE]\n\n"
        self.wfile.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--latency", type=float, default=0.0)
    args = parser.parse_args()
    Handler.latency = args.latency
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    server.request_queue_size = 128
    print(server.server_address[1], flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    sys.exit(main())
