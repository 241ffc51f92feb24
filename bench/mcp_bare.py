"""A bare hand-written MCP client over stdio, the baseline of the MCP row of bench_lich.py.

A plain ``subprocess.Popen`` and JSON lines: it writes a request as one line and reads
lines until the answer with its id comes (it answers a request of the server's with an
error, and skips notifications). One caller at a time; no threads, no timeouts, no
cancellation: the least a client must do.
"""

import json
import subprocess


class BareMCP:
    def __init__(self, argv, env=None):
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, env=env)
        self.next_id = 0

    def _send(self, message):
        self.proc.stdin.write(json.dumps(message).encode() + b"\n")
        self.proc.stdin.flush()

    def request(self, method, params=None):
        """The result of one request; raises RuntimeError on a JSON-RPC error."""
        self.next_id += 1
        wanted = self.next_id
        message = {"jsonrpc": "2.0", "id": wanted, "method": method}
        if params is not None:
            message["params"] = params
        self._send(message)
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the server ended (rc {self.proc.poll()})")
            answer = json.loads(line)
            if "method" in answer:  # the server's own request or notification
                if "id" in answer:
                    self._send({"jsonrpc": "2.0", "id": answer["id"],
                                "error": {"code": -32601, "message": "Method not found"}})
                continue
            if answer.get("id") != wanted:
                continue
            if "error" in answer:
                raise RuntimeError(answer["error"])
            return answer["result"]

    def initialize(self):
        result = self.request("initialize", {"protocolVersion": "2025-11-25", "capabilities": {},
                                             "clientInfo": {"name": "bare", "version": "0"}})
        self._send({"jsonrpc": "2.0", "method": "notifications/initialized"})
        return result

    def call(self, name, arguments):
        """The text of a tool's answer (its text blocks joined by newlines)."""
        result = self.request("tools/call", {"name": name, "arguments": arguments})
        return "\n".join(b.get("text", "") for b in result.get("content") or ()
                         if b.get("type") == "text")

    def close(self):
        self.proc.stdin.close()
        try:
            self.proc.wait(2)
        except subprocess.TimeoutExpired:
            self.proc.terminate()
            try:
                self.proc.wait(2)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()
