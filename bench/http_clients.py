"""The two clients the HTTP benchmark compares, over the same script and the same sizes.

- ``LichClient``: ``lich.OpenAIChat`` or ``lich.AnthropicChat`` driven by
  ``lich.run_conversation``, with a ``lich.Tools`` holding one trivial tool.
- ``RequestsClient``: a minimal hand-written ``requests`` loop speaking the same protocol;
  it keeps the history in the wire format and re-encodes all of it every turn
  (``session.post(url, json=body)``), as hand-written loops do.

Each turn the history grows by an assistant message (a short text and one tool call) and
a tool result of about 500 characters, under a system prompt of about 2,000 characters.
The server (bench/loopback_server.py) reads the number of turns from the first user message.

Run as a script it is one fresh client process:

    python bench/http_clients.py --client lich|requests --dialect openai|anthropic
        [--stream] --turns N --base-url http://127.0.0.1:PORT

and prints {"cpu_s": ..., "turns": ...}: the process's CPU time (time.process_time) of
building the client and running one conversation of N turns.
"""

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import lich

SYSTEM_PROMPT = (
    "You are a careful coding assistant working in a Python repository. Read before you "
    "write; keep changes small and explain them briefly. Rules: "
    + " ".join(f"({i}) Prefer the project's existing helpers and naming; run the tests after "
               f"each change; never touch files outside the workspace." for i in range(1, 20))
)[:2000]
TOOL_DESCRIPTION = "Show the lines of a file of the workspace around a line number."
SNIPPET = "".join(f"    {i:4}  value = compute(items[{i}], scale=2.5)  # keep\n"
                  for i in range(1, 10))


def user_text(turns):
    """The first user message of a conversation of ``turns`` turns (the server reads N)."""
    return f"Call the lookup tool {turns - 1} times, then answer."


def lookup(path: str, line: int) -> str:
    """Show the lines of a file of the workspace around a line number.

    Args:
        path: the file
        line: the line number
    """
    return f"{path}, lines {line}-{line + 8}:\n{SNIPPET}"


assert 450 <= len(lookup("src/pkg/module_100.py", 1000)) <= 560
assert 1900 <= len(SYSTEM_PROMPT) <= 2000


# ---------------------------------------------------------------------------- lich

class LichClient:
    """One lich chat (and so one HTTP connection) reused across conversations."""

    def __init__(self, dialect, stream, base_url):
        on_delta = (lambda text: None) if stream else None
        if dialect == "openai":
            self.chat = lich.OpenAIChat("bench", base_url=base_url + "/v1", stream=stream,
                                        on_delta=on_delta)
        else:
            self.chat = lich.AnthropicChat("bench", api_key="x", base_url=base_url,
                                           stream=stream, on_delta=on_delta, cache=False)
        self.tools = lich.Tools()
        self.tools.register(lookup)

    def conversation(self, turns):
        outcome = lich.run_conversation(self.chat, self.tools,
                                        [{"role": "user", "content": user_text(turns)}],
                                        system_prompt=SYSTEM_PROMPT, max_turns=turns + 5)
        assert outcome.stopped_reason == "final", outcome.stopped_reason
        assert outcome.turns_used == turns, outcome.turns_used
        return outcome.turns_used


# ---------------------------------------------------------------------------- requests

SCHEMA = {"type": "object", "properties": {"path": {"type": "string", "description": "the file"},
                                           "line": {"type": "integer",
                                                    "description": "the line number"}},
          "required": ["path", "line"]}
OPENAI_TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": TOOL_DESCRIPTION, "parameters": SCHEMA}}]
ANTHROPIC_TOOLS = [{"name": "lookup", "description": TOOL_DESCRIPTION, "input_schema": SCHEMA}]


def run_tool(name, arguments):
    if name != "lookup":
        return f"unknown tool {name}", True
    try:
        return lookup(**arguments), False
    except TypeError as e:
        return str(e), True


class RequestsClient:
    """The minimal hand-written loop: one requests.Session reused across conversations."""

    def __init__(self, dialect, stream, base_url):
        import requests

        self.session = requests.Session()
        self.dialect = dialect
        self.stream = stream
        self.on_delta = lambda text: None
        if dialect == "openai":
            self.url = base_url + "/v1/chat/completions"
            self.headers = {}
        else:
            self.url = base_url + "/v1/messages"
            self.headers = {"x-api-key": "x", "anthropic-version": "2023-06-01"}

    def conversation(self, turns):
        if self.dialect == "openai":
            return self._openai(turns)
        return self._anthropic(turns)

    def _post(self, body):
        response = self.session.post(self.url, json=body, headers=self.headers,
                                     stream=self.stream, timeout=(10, 60))
        response.raise_for_status()
        return response

    def _events(self, response):
        """(event name or None, parsed data) per SSE event."""
        event = None
        for line in response.iter_lines():
            if line.startswith(b"event:"):
                event = line[6:].strip().decode()
            elif line.startswith(b"data:"):
                data = line[5:].strip()
                if data == b"[DONE]":
                    return
                yield event, json.loads(data)
                event = None

    def _openai(self, turns):
        messages = [{"role": "system", "content": SYSTEM_PROMPT},
                    {"role": "user", "content": user_text(turns)}]
        for turn in range(1, turns + 6):
            body = {"model": "bench", "messages": messages, "tools": OPENAI_TOOLS}
            if self.stream:
                body["stream"] = True
                body["stream_options"] = {"include_usage": True}
                content, calls = [], {}
                with self._post(body) as response:
                    for _, chunk in self._events(response):
                        for choice in chunk["choices"]:
                            delta = choice["delta"]
                            if delta.get("content"):
                                content.append(delta["content"])
                                self.on_delta(delta["content"])
                            for part in delta.get("tool_calls") or ():
                                call = calls.setdefault(part["index"],
                                                        {"id": "", "name": "", "arguments": ""})
                                call["id"] = part.get("id") or call["id"]
                                function = part.get("function") or {}
                                call["name"] = function.get("name") or call["name"]
                                call["arguments"] += function.get("arguments") or ""
                message = {"role": "assistant", "content": "".join(content) or None}
                if calls:
                    message["tool_calls"] = [
                        {"id": c["id"], "type": "function",
                         "function": {"name": c["name"], "arguments": c["arguments"]}}
                        for c in calls.values()]
            else:
                message = self._post(body).json()["choices"][0]["message"]
            messages.append(message)
            if not message.get("tool_calls"):
                return turn
            for call in message["tool_calls"]:
                output, _ = run_tool(call["function"]["name"],
                                     json.loads(call["function"]["arguments"]))
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": output})
        raise AssertionError("no final answer")

    def _anthropic(self, turns):
        messages = [{"role": "user", "content": user_text(turns)}]
        for turn in range(1, turns + 6):
            body = {"model": "bench", "max_tokens": 4096, "system": SYSTEM_PROMPT,
                    "messages": messages, "tools": ANTHROPIC_TOOLS}
            if self.stream:
                body["stream"] = True
                blocks = {}
                with self._post(body) as response:
                    for _, event in self._events(response):
                        kind = event["type"]
                        if kind == "content_block_start":
                            blocks[event["index"]] = dict(event["content_block"], partial=[])
                        elif kind == "content_block_delta":
                            block, delta = blocks[event["index"]], event["delta"]
                            if delta["type"] == "text_delta":
                                block["text"] += delta["text"]
                                self.on_delta(delta["text"])
                            elif delta["type"] == "input_json_delta":
                                block["partial"].append(delta["partial_json"])
                        elif kind == "message_stop":
                            break
                content = []
                for block in blocks.values():
                    partial = block.pop("partial")
                    if block["type"] == "tool_use" and partial:
                        block["input"] = json.loads("".join(partial))
                    content.append(block)
            else:
                content = self._post(body).json()["content"]
            messages.append({"role": "assistant", "content": content})
            uses = [b for b in content if b["type"] == "tool_use"]
            if not uses:
                return turn
            results = []
            for use in uses:
                output, failed = run_tool(use["name"], use["input"])
                results.append({"type": "tool_result", "tool_use_id": use["id"],
                                "content": output, "is_error": failed})
            messages.append({"role": "user", "content": results})
        raise AssertionError("no final answer")


CLIENTS = {"lich": LichClient, "requests": RequestsClient}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--client", choices=sorted(CLIENTS), required=True)
    parser.add_argument("--dialect", choices=["openai", "anthropic"], required=True)
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--turns", type=int, required=True)
    parser.add_argument("--base-url", required=True)
    args = parser.parse_args()
    import requests  # noqa: F401  (both clients use it: its import is not what is measured)

    start = time.process_time()
    client = CLIENTS[args.client](args.dialect, args.stream, args.base_url)
    turns = client.conversation(args.turns)
    cpu = time.process_time() - start
    print(json.dumps({"cpu_s": cpu, "turns": turns}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
