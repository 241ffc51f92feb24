"""lich's own cost, as ratios against baselines measured in the same run.

    python bench/bench_lich.py [--quick]

Prints a table and writes bench/results.json. Needs only the standard library, lich
and requests (which lich uses). See bench/RESULTS.md for the figures of one machine.
"""

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

import lich

USER = {"role": "user", "content": "Run the noop tool until you are told to stop."}


# ---------------------------------------------------------------------------- helpers

def best_of(repeat, fn):
    """The smallest wall time of ``repeat`` calls of fn."""
    best = float("inf")
    for _ in range(repeat):
        gc.collect()
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def noop_tools():
    tools = lich.Tools()

    @tools.tool
    def noop(n: int) -> str:
        """Do nothing."""
        return "ok"

    return tools


class ScriptedChat:
    """A ChatFn that asks for the noop tool on every turn."""

    def __init__(self):
        self.turn = 0

    def __call__(self, messages, *, tools=None, temperature=None, max_tokens=None, signal=None):
        self.turn += 1
        call = {"id": f"call_{self.turn}", "name": "noop", "arguments": f'{{"n": {self.turn}}}'}
        return lich.ChatResult({"role": "assistant", "content": "working on it", "tool_calls": [call]},
                               {"input_tokens": 50, "output_tokens": 10}, "bench", "tool_calls")


class LoopbackServer:
    """bench/loopback_server.py in its own process."""

    def __init__(self, latency=0.0):
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "loopback_server.py"), "--latency", str(latency)],
            stdout=subprocess.PIPE, text=True)
        port = int(self.proc.stdout.readline())
        self.base_url = f"http://127.0.0.1:{port}/v1"

    def close(self):
        self.proc.terminate()
        self.proc.wait()


# ---------------------------------------------------------------------------- 1. loop

def bench_loop(quick):
    def run(turns):
        emitter = lich.AgentEmitter()
        seen = []
        emitter.on_any(lambda e: seen.append(e["type"]))
        outcome = lich.run_conversation(ScriptedChat(), noop_tools(), [USER], max_turns=turns,
                                        context_budget_tokens=10**12, emitter=emitter)
        assert outcome.stopped_reason == "budget" and outcome.turns_used == turns

    repeat = 3 if quick else 7
    t1 = best_of(repeat, lambda: run(1000))
    t2 = best_of(repeat, lambda: run(2000))
    return {"us_per_turn_1000": t1 / 1000 * 1e6, "us_per_turn_2000": t2 / 2000 * 1e6,
            "ratio_2000_vs_1000": t2 / t1, "target": "<= 2.2"}


# ---------------------------------------------------------------------------- 2. HTTP

NOOP_SPEC = [{"type": "function", "function": {
    "name": "noop", "description": "Do nothing.",
    "parameters": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}}]


def raw_conversation(session, url, stream):
    """The minimal hand-written client: same requests, same protocol, nothing else."""
    messages = [USER]
    turns = 0
    while True:
        turns += 1
        body = {"model": "bench", "messages": messages, "tools": NOOP_SPEC}
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
            content, calls = "", {}
            with session.post(url, json=body, stream=True, timeout=(10, 60)) as response:
                response.raise_for_status()
                for line in response.iter_lines():
                    if not line.startswith(b"data: "):
                        continue
                    data = line[6:]
                    if data == b"[DONE]":
                        break
                    chunk = json.loads(data)
                    for choice in chunk["choices"]:
                        delta = choice["delta"]
                        content += delta.get("content") or ""
                        for part in delta.get("tool_calls") or ():
                            call = calls.setdefault(part["index"], {"id": "", "name": "", "arguments": ""})
                            call["id"] = part.get("id") or call["id"]
                            function = part.get("function") or {}
                            call["name"] = function.get("name") or call["name"]
                            call["arguments"] += function.get("arguments") or ""
            message = {"role": "assistant", "content": content or None}
            if calls:
                message["tool_calls"] = [{"id": c["id"], "type": "function",
                                          "function": {"name": c["name"], "arguments": c["arguments"]}}
                                         for c in calls.values()]
        else:
            response = session.post(url, json=body, timeout=(10, 60))
            response.raise_for_status()
            message = response.json()["choices"][0]["message"]
        messages.append(message)
        if not message.get("tool_calls"):
            return turns
        for call in message["tool_calls"]:
            json.loads(call["function"]["arguments"])
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": "ok"})


def compare_http(server, stream, conversations):
    """CPU per turn of lich and of the minimal client, alternating conversations."""
    import requests

    chat = lich.OpenAIChat("bench", base_url=server.base_url, api_key="bench-key",
                           stream=stream, on_delta=(lambda text: None) if stream else None)
    tools = noop_tools()
    session = requests.Session()
    url = server.base_url + "/chat/completions"

    def lich_conversation():
        outcome = lich.run_conversation(chat, tools, [USER], max_turns=30)
        assert outcome.stopped_reason == "final", outcome.stopped_reason
        return outcome.turns_used

    sides = {"raw": lambda: raw_conversation(session, url, stream), "lich": lich_conversation}
    for fn in sides.values():
        fn()  # warm the connection and caches
    cpu = dict.fromkeys(sides, 0.0)
    turns = dict.fromkeys(sides, 0)
    for _ in range(conversations):
        for side, fn in sides.items():
            start = time.process_time()
            turns[side] += fn()
            cpu[side] += time.process_time() - start
    raw = cpu["raw"] / turns["raw"] * 1e6
    mine = cpu["lich"] / turns["lich"] * 1e6
    return {"raw_cpu_us_per_turn": raw, "lich_cpu_us_per_turn": mine, "ratio": mine / raw,
            "turns_per_conversation": turns["lich"] // conversations, "target": "<= 1.15"}


def bench_http(quick):
    server = LoopbackServer()
    try:
        conversations = 5 if quick else 25
        return {"plain": compare_http(server, False, conversations),
                "stream": compare_http(server, True, conversations)}
    finally:
        server.close()


# ---------------------------------------------------------------------------- 3. startup

def bench_startup(quick):
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # measure as installed: with cached bytecode
    lich_py = os.path.join(ROOT, "lich.py")

    def run(*args):
        return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, check=True,
                              stdout=subprocess.DEVNULL)

    run("-c", "import lich")  # writes the bytecode cache
    repeat = 10 if quick else 40
    base = best_of(repeat, lambda: run("-c", "pass"))
    imp = best_of(repeat, lambda: run("-c", "import lich"))
    version = best_of(repeat, lambda: run(lich_py, "--version"))
    return {"bare_python_ms": base * 1e3, "import_lich_extra_ms": (imp - base) * 1e3,
            "version_extra_ms": (version - base) * 1e3,
            "target": "import <= 15 ms, --version <= 40 ms above bare python"}


# ---------------------------------------------------------------------------- 4. sessions

def deep_size(messages):
    size = sys.getsizeof(messages)
    for message in messages:
        size += sys.getsizeof(message)
        for value in message.values():
            size += sys.getsizeof(value)
            if isinstance(value, list):
                for item in value:
                    size += sys.getsizeof(item) + sum(sys.getsizeof(v) for v in item.values())
    return size


def bench_sessions(quick):
    n = 10_000 if quick else 100_000
    target_mb = 10 if quick else 100
    message = {"role": "assistant", "content": "I looked at the file and it is fine. " * 3,
               "tool_calls": [{"id": "call_1", "name": "read_file", "arguments": '{"path": "a.py"}'}]}
    with tempfile.TemporaryDirectory() as tmp:
        def raw_append():
            with open(os.path.join(tmp, "raw.jsonl"), "w") as f:
                for _ in range(n):
                    f.write(json.dumps({"ts": "2026-01-01T00:00:00.000Z", "kind": "message",
                                        "message": message}) + "\n")
                    f.flush()

        def lich_append():
            with lich.open_session(tmp) as handle:
                for _ in range(n):
                    handle.append_message(message)

        raw_t = best_of(3, raw_append)
        lich_t = best_of(3, lich_append)

        big = os.path.join(tmp, "big.jsonl")
        with lich.open_session(tmp) as handle:
            os.replace(handle.path, big)
            handle.path = big
            line_count = 0
            while os.fstat(handle._fd).st_size < target_mb * 1_000_000:
                call_id = f"call_{line_count}"  # unique, as the loop records them
                handle.append_message({"role": "user", "content": f"question {line_count} " * 8})
                handle.append_message({**message, "tool_calls": [{**message["tool_calls"][0],
                                                                  "id": call_id}]})
                handle.append_message({"role": "tool", "tool_call_id": call_id, "name": "read_file",
                                       "content": "print('hello')\n" * 20, "is_error": False})
                line_count += 3

        def raw_read():
            out = []
            with open(big, "rb") as f:
                for line in f:
                    out.append(json.loads(line)["message"])
            return out

        raw_r = best_of(3, raw_read)
        lich_r = best_of(3, lambda: lich.read_session_messages(big))
        tracemalloc.start()
        result = lich.read_session_messages(big)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        size = deep_size(result)
        assert len(result) == line_count
        return {
            "append": {"records": n, "raw_per_s": n / raw_t, "lich_per_s": n / lich_t,
                       "ratio": raw_t / lich_t, "target": ">= 0.7"},
            "read": {"file_mb": os.path.getsize(big) / 1e6, "raw_s": raw_r, "lich_s": lich_r,
                     "ratio": raw_r / lich_r, "target": ">= 0.8",
                     "peak_mb": peak / 1e6, "result_mb": size / 1e6, "peak_vs_result": peak / size,
                     "memory_target": "<= 2.0"},
        }


# ---------------------------------------------------------------------------- 5. concurrency

def bench_concurrency(quick):
    threads_n, turns = (16, 10) if quick else (32, 10)
    latency = 0.02
    server = LoopbackServer(latency=latency)
    try:
        chat = lich.OpenAIChat("bench", base_url=server.base_url, api_key="bench-key")
        tools = noop_tools()

        def conversation(i):
            messages = [{"role": "user", "content": f"thread {i}"}]
            # the server answers a final text once 19 tool messages are in: start with 10 done
            messages += [m for k in range(19 - (turns - 1)) for m in (
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": f"pre{k}", "name": "noop", "arguments": '{"n": 0}'}]},
                {"role": "tool", "tool_call_id": f"pre{k}", "name": "noop", "content": "ok",
                 "is_error": False})]
            outcome = lich.run_conversation(chat, tools, messages, max_turns=turns + 5)
            assert outcome.stopped_reason == "final" and outcome.turns_used == turns
            assert outcome.messages[0]["content"] == f"thread {i}"
            return outcome

        conversation(-1)
        start = time.perf_counter()
        for i in range(threads_n):
            conversation(i)
        sequential = time.perf_counter() - start

        errors, outcomes = [], {}

        def worker(i):
            try:
                outcomes[i] = conversation(i)
            except BaseException as exc:
                errors.append(exc)

        workers = [threading.Thread(target=worker, args=(i,)) for i in range(threads_n)]
        start = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        parallel = time.perf_counter() - start
        intact = all(outcomes[i].messages[0]["content"] == f"thread {i}" for i in outcomes)
        return {"threads": threads_n, "turns_each": turns, "server_latency_s": latency,
                "sequential_s": sequential, "threaded_s": parallel, "speedup": sequential / parallel,
                "errors": len(errors), "histories_intact": intact and len(outcomes) == threads_n,
                "target": ">= 8x"}
    finally:
        server.close()


# ---------------------------------------------------------------------------- 6. compression

def bench_compression(quick):
    outcome = lich.run_conversation(ScriptedChat(), noop_tools(), [USER], max_turns=5000,
                                    context_budget_tokens=10**12)
    # the loop's working history: the list kind run_conversation hands compress_if_needed
    # every turn, which keeps its estimate as messages are appended
    history = lich._History(outcome.messages)
    assert len(history) == 10_001
    lich.compress_if_needed(None, history, context_budget_tokens=10**12)
    calls = 2000 if quick else 20_000

    def decide():
        for _ in range(calls):
            lich.compress_if_needed(None, history, context_budget_tokens=10**12)

    per_call = best_of(3, decide) / calls
    plain = outcome.messages  # a plain list: every decision re-reads it
    full = best_of(3, lambda: lich.compress_if_needed(None, plain, context_budget_tokens=10**12))
    return {"messages": len(history), "decision_us": per_call * 1e6,
            "full_rescan_us": full * 1e6, "target": "<= 50 us"}


# ---------------------------------------------------------------------------- report

def verdicts(r):
    loop, http, start, sess, conc, comp = (r["loop"], r["http"], r["startup"], r["sessions"],
                                            r["concurrency"], r["compression"])
    return [
        ("1 loop: 2000 vs 1000 turns", (f"{loop['ratio_2000_vs_1000']:.2f}x "
         f"({loop['us_per_turn_1000']:.1f} / {loop['us_per_turn_2000']:.1f} us per turn)"),
         "<= 2.2x", loop["ratio_2000_vs_1000"] <= 2.2),
        ("2 HTTP CPU per turn, plain", (f"{http['plain']['ratio']:.2f}x "
         f"({http['plain']['lich_cpu_us_per_turn']:.0f} vs {http['plain']['raw_cpu_us_per_turn']:.0f} us)"),
         "<= 1.15x", http["plain"]["ratio"] <= 1.15),
        ("2 HTTP CPU per turn, stream", (f"{http['stream']['ratio']:.2f}x "
         f"({http['stream']['lich_cpu_us_per_turn']:.0f} vs {http['stream']['raw_cpu_us_per_turn']:.0f} us)"),
         "<= 1.15x", http["stream"]["ratio"] <= 1.15),
        ("3 import lich", f"+{start['import_lich_extra_ms']:.1f} ms", "<= +15 ms",
         start["import_lich_extra_ms"] <= 15),
        ("3 lich.py --version", f"+{start['version_extra_ms']:.1f} ms", "<= +40 ms",
         start["version_extra_ms"] <= 40),
        ("4 session appends", f"{sess['append']['ratio']:.2f}x raw", ">= 0.7x",
         sess["append"]["ratio"] >= 0.7),
        ("4 session read", f"{sess['read']['ratio']:.2f}x raw ({sess['read']['file_mb']:.0f} MB)",
         ">= 0.8x", sess["read"]["ratio"] >= 0.8),
        ("4 session read memory", f"{sess['read']['peak_vs_result']:.2f}x the result", "<= 2x",
         sess["read"]["peak_vs_result"] <= 2.0),
        ("5 threads vs sequential", f"{conc['speedup']:.1f}x, {conc['errors']} errors",
         ">= 8x", conc["speedup"] >= 8 and not conc["errors"] and conc["histories_intact"]),
        ("6 compress decision", f"{comp['decision_us']:.2f} us ({comp['messages']} messages)",
         "<= 50 us", comp["decision_us"] <= 50),
    ]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short run")
    parser.add_argument("--only", nargs="*", help="run only these parts")
    args = parser.parse_args()
    parts = {"loop": bench_loop, "http": bench_http, "startup": bench_startup,
             "sessions": bench_sessions, "concurrency": bench_concurrency,
             "compression": bench_compression}
    results = {"date": time.strftime("%Y-%m-%d"), "python": platform.python_version(),
               "machine": platform.machine(), "quick": args.quick}
    for name, fn in parts.items():
        if args.only and name not in args.only:
            continue
        print(f"running {name} ...", file=sys.stderr, flush=True)
        results[name] = fn(args.quick)
    with open(os.path.join(HERE, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    if args.only:
        print(json.dumps(results, indent=2))
        return 0
    rows = verdicts(results)
    width = max(len(r[0]) for r in rows)
    print(f"lich {lich.__version__}, Python {results['python']}, {results['date']}"
          f"{' (quick)' if args.quick else ''}")
    print(f"{'measure'.ljust(width)}  {'result':44}  {'target':10}  ok")
    for name, value, target, ok in rows:
        print(f"{name.ljust(width)}  {value:44}  {target:10}  {'yes' if ok else 'NO'}")
    return 0 if all(r[3] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
