"""lich's own cost, as ratios against baselines measured in the same run.

    python bench/bench_lich.py [--quick] [--only ROW [ROW ...]] [--old-rev REV]

Rows: loop, http, startup, sessions, threads, search, writes, search_small, batch, kill,
executors, mcp, caching, tracing (one function each, registered with @row; see
bench/RESULTS.md for what each measures and the figures of one machine). Every figure is a ratio against a baseline measured in the same run,
the two alternated round by round (the order turned every round), with medians (whole
process start-ups: the best of each). Prints a table, writes bench/results.json, exits 1
when a target is missed. Uses lich's public names only.

Needs lich, requests, grep, git (for the previous lich.py of the start-up row) and,
for the ripgrep rows, ``rg`` on PATH; the executors row needs dask[distributed] (and its
psutil), the MCP row mcp-server-time on PATH (or beside this Python) and, for
server-everything, ``node`` and the package's dist/index.js (BENCH_SERVER_EVERYTHING, else
the path of this machine), the tracing row opentelemetry-sdk; a row whose package is
missing says so and is not counted. Child processes run without
PYTHONDONTWRITEBYTECODE, as an installed package has its bytecode cache.
"""

import argparse
import gc
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import tracemalloc
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

import batch_child
import http_clients as clients
import mcp_bare

import lich

LICH_PY = os.path.join(ROOT, "lich.py")
ROWS = {}


def row(name):
    """Register a row: ``fn(args) -> dict`` whose "table" lists (label, result, target, ok);
    ok is None for a figure reported without a target."""
    def register(fn):
        ROWS[name] = fn
        return fn
    return register


# ---------------------------------------------------------------------------- helpers

def median(values):
    return statistics.median(values)


def alternate(fns, rounds, clock=time.perf_counter):
    """{name: [seconds, one per round]}: every fn once per round, the order turned each round."""
    names = list(fns)
    times = {name: [] for name in names}
    for r in range(rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            gc.collect()
            start = clock()
            fns[name]()
            times[name].append(clock() - start)
    return times


class LoopbackServer:
    """bench/loopback_server.py in its own process."""

    def __init__(self, latency=0.0, *options):
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "loopback_server.py"), "--latency", str(latency),
             *map(str, options)], stdout=subprocess.PIPE, text=True)
        self.url = f"http://127.0.0.1:{int(self.proc.stdout.readline())}"

    def _get(self, path):
        with urllib.request.urlopen(self.url + path, timeout=10) as response:
            return json.loads(response.read())

    def arrivals(self):
        """The monotonic times of the POSTs since the last call."""
        return self._get("/arrivals")

    def stats(self):
        """The server's counters since the last stats() or reset(), which start them again:
        posts, rejected_429, peak_in_flight (and with --cache-sim the token sums)."""
        return self._get("/stats")

    def reset(self):
        """As stats(), and the simulated prompt cache forgets everything."""
        return self._get("/reset")

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.proc.terminate()
        self.proc.wait()


def lookup_tools():
    tools = lich.Tools()
    tools.register(clients.lookup)
    return tools


def first_user(turns, lead=""):
    return {"role": "user", "content": lead + clients.user_text(turns)}


# ---------------------------------------------------------------------------- 1. loop

class ScriptedChat:
    """A ChatFn that asks for the lookup tool on every turn, as the loopback server does."""

    def __init__(self):
        self.turn = 0

    def __call__(self, messages, *, tools=None, temperature=None, max_tokens=None, signal=None,
                 response_format=None):
        self.turn += 1
        k = self.turn
        call = {"id": f"call_{k}", "name": "lookup",
                "arguments": json.dumps({"path": f"src/pkg/module_{k}.py", "line": 10 * k})}
        return lich.ChatResult({"role": "assistant", "content": f"Reading module_{k}.py next.",
                                "tool_calls": [call]},
                               {"input_tokens": 50, "output_tokens": 10}, "bench", "tool_calls")


@row("loop")
def bench_loop(args):
    tools = lookup_tools()

    def run(turns):
        emitter = lich.AgentEmitter()
        emitter.on_any(lambda event: None)
        outcome = lich.run_conversation(ScriptedChat(), tools, [first_user(turns)],
                                        system_prompt=clients.SYSTEM_PROMPT, max_turns=turns,
                                        context_budget_tokens=10**12, emitter=emitter)
        assert outcome.stopped_reason == "budget" and outcome.turns_used == turns

    run(100)
    times = alternate({1000: lambda: run(1000), 2000: lambda: run(2000)},
                      3 if args.quick else 7)
    t1, t2 = median(times[1000]), median(times[2000])
    ratio = t2 / t1
    return {"us_per_turn_1000": t1 / 1000 * 1e6, "us_per_turn_2000": t2 / 2000 * 1e6,
            "ratio_2000_vs_1000": ratio, "runs_each": len(times[1000]),
            "table": [("1 loop: 2000 vs 1000 turns",
                       f"{ratio:.2f}x ({t1 / 1000 * 1e6:.1f} / {t2 / 2000 * 1e6:.1f} us per turn)",
                       "<= 2.2x", ratio <= 2.2)]}


# ---------------------------------------------------------------------------- 2. HTTP

HTTP_VARIANTS = [("openai", False), ("openai", True), ("anthropic", False), ("anthropic", True)]
LONG, SHORT = 200, 20


def fresh_client_cpu(server, client, dialect, stream, turns):
    """CPU seconds of one conversation in a fresh client process."""
    argv = [sys.executable, os.path.join(HERE, "http_clients.py"), "--client", client,
            "--dialect", dialect, "--turns", str(turns), "--base-url", server.url]
    if stream:
        argv.append("--stream")
    done = subprocess.run(argv, capture_output=True, text=True, check=True)
    report = json.loads(done.stdout)
    assert report["turns"] == turns, report
    return report["cpu_s"]


def http_variant(server, dialect, stream, args):
    # Slope: CPU(200 turns) - CPU(20 turns), over 180, each in a fresh process; a pair is
    # one such slope of lich and one of requests, the pair's order turned each time.
    slopes = {"lich": [], "requests": []}
    pairs = 2 if args.quick else 7
    for p in range(pairs):
        order = ["lich", "requests"] if p % 2 == 0 else ["requests", "lich"]
        cpu = {}
        for turns in (LONG, SHORT):
            for client in order:
                cpu[client, turns] = fresh_client_cpu(server, client, dialect, stream, turns)
        for client in order:
            slopes[client].append((cpu[client, LONG] - cpu[client, SHORT]) / (LONG - SHORT))
    pair_ratios = [a / b for a, b in zip(slopes["lich"], slopes["requests"])]

    # In one process: whole conversations alternated, CPU per turn.
    sides = {"lich": clients.LichClient(dialect, stream, server.url),
             "requests": clients.RequestsClient(dialect, stream, server.url)}
    for side in sides.values():
        side.conversation(SHORT)  # connection, caches, lazy imports
    in_process = {}
    for turns in (LONG, SHORT):
        times = alternate({name: (lambda s=side, t=turns: s.conversation(t))
                           for name, side in sides.items()},
                          3 if args.quick else 7, clock=time.process_time)
        in_process[turns] = {name: median(t) / turns for name, t in times.items()}
    return {
        "slope_lich_us": median(slopes["lich"]) * 1e6,
        "slope_requests_us": median(slopes["requests"]) * 1e6,
        "slope_ratio": median(pair_ratios), "pair_ratios": pair_ratios,
        "in_process_us_per_turn": {str(t): {k: v * 1e6 for k, v in d.items()}
                                   for t, d in in_process.items()},
        "in_process_ratio": {str(t): d["lich"] / d["requests"] for t, d in in_process.items()},
    }


@row("http")
def bench_http(args):
    results, table = {}, []
    with LoopbackServer() as server:
        for dialect, stream in HTTP_VARIANTS:
            name = f"{dialect} {'stream' if stream else 'plain'}"
            r = results[name] = http_variant(server, dialect, stream, args)
            inp = r["in_process_us_per_turn"]
            table.append((f"2 HTTP CPU/turn {name}: slope", (
                f"{r['slope_ratio']:.2f}x ({r['slope_lich_us']:.0f} vs "
                f"{r['slope_requests_us']:.0f} us, turns 21-200)"),
                "<= 0.75x", r["slope_ratio"] <= 0.75))
            ratio_long, ratio_short = r["in_process_ratio"][str(LONG)], r["in_process_ratio"][str(SHORT)]
            table.append((f"2 HTTP CPU/turn {name}: in-proc", (
                f"N=200 {ratio_long:.2f}x ({inp[str(LONG)]['lich']:.0f} vs "
                f"{inp[str(LONG)]['requests']:.0f} us); N=20 {ratio_short:.2f}x"),
                "<= 0.75x", ratio_long <= 0.75))
    results["table"] = table
    return results


# ---------------------------------------------------------------------------- 3. startup

def old_lich(rev):
    """The lich.py of ``rev`` (git show, which changes nothing), in a folder of its own."""
    folder = os.path.join(tempfile.gettempdir(), "lich_old")
    path = os.path.join(folder, "lich.py")
    wanted = subprocess.run(["git", "-C", ROOT, "show", f"{rev}:lich.py"], check=True,
                            capture_output=True).stdout
    os.makedirs(folder, exist_ok=True)
    if os.path.exists(path):
        with open(path, "rb") as f:
            if f.read() == wanted:
                return path
    with open(path, "wb") as f:
        f.write(wanted)
    return path


def child_env():
    env = {k: v for k, v in os.environ.items()
           if k not in ("OPENAI_API_KEY", "ANTHROPIC_API_KEY", "OPENAI_BASE_URL",
                        "ANTHROPIC_BASE_URL") and not k.startswith("LICH_")}
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # as installed: with cached bytecode
    return env


@row("startup")
def bench_startup(args):
    with tempfile.TemporaryDirectory(prefix="lich-bench-cwd-") as cwd:
        return startup_figures(args, cwd)


def startup_figures(args, cwd):
    env = child_env()
    old_py = old_lich(args.old_rev)
    py = sys.executable
    # as a console script runs it: imported, so with its bytecode cached
    shim = "import sys; sys.path.insert(0, sys.argv.pop(1)); import lich; sys.exit(lich.main())"
    with LoopbackServer() as server:
        spec = ["-m", f"openai:x@{server.url}/v1", "hi", "--no-session"]
        whole = {
            "python -c pass": [py, "-c", "pass"],
            "import lich": [py, "-c", "import lich"],
            "lich.py --version": [py, LICH_PY, "--version"],
            "new lich.py --help": [py, LICH_PY, "--help"],
            "old lich.py --help": [py, old_py, "--help"],
            "new --help, imported": [py, "-c", shim, ROOT, "--help"],
            "old --help, imported": [py, "-c", shim, os.path.dirname(old_py), "--help"],
        }
        installed = os.path.join(os.path.dirname(py), "lich")
        if os.path.exists(installed):
            whole["installed lich --help"] = [installed, "--help"]
        first = {
            "new lich.py first request": [py, LICH_PY, *spec],
            "old lich.py first request": [py, old_py, *spec],
            "new first request, imported": [py, "-c", shim, ROOT, *spec],
            "old first request, imported": [py, "-c", shim, os.path.dirname(old_py), *spec],
        }

        def run_whole(argv):
            subprocess.run(argv, cwd=cwd, env=env, check=True, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)

        def run_first(argv):
            server.arrivals()
            start = time.monotonic()
            subprocess.run(argv, cwd=cwd, env=env, check=True, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
            arrived = server.arrivals()
            assert len(arrived) == 1, arrived
            return arrived[0] - start

        for argv in list(whole.values()) + list(first.values()):
            run_whole(argv)  # writes the bytecode caches
        server.arrivals()
        best = {name: float("inf") for name in list(whole) + list(first)}
        rounds = 10 if args.quick else 40
        names = list(best)
        for r in range(rounds):
            shift = r % len(names)
            for name in names[shift:] + names[:shift]:
                if name in whole:
                    start = time.perf_counter()
                    run_whole(whole[name])
                    took = time.perf_counter() - start
                else:
                    took = run_first(first[name])
                best[name] = min(best[name], took)
    ms = {name: t * 1e3 for name, t in best.items()}
    base = ms["python -c pass"]
    imp, version = ms["import lich"] - base, ms["lich.py --version"] - base

    def versus(new, old):
        limit = ms[old] * 1.1 + 5
        return (f"{ms[new]:.1f} vs {ms[old]:.1f} ms (limit {limit:.1f})", "<= old*1.1+5ms",
                ms[new] <= limit)

    table = [
        ("3 import lich", f"+{imp:.1f} ms ({ms['import lich']:.1f} vs {base:.1f})", "<= +15 ms",
         imp <= 15),
        ("3 lich.py --version", f"+{version:.1f} ms ({ms['lich.py --version']:.1f} vs {base:.1f})",
         "<= +40 ms", version <= 40),
        ("3 lich.py --help, new vs old", *versus("new lich.py --help", "old lich.py --help")),
        ("3 first request sent, new vs old", *versus("new lich.py first request",
                                                    "old lich.py first request")),
        ("3 --help imported, new vs old", *versus("new --help, imported", "old --help, imported")),
        ("3 first request imported", *versus("new first request, imported",
                                             "old first request, imported")),
    ]
    if "installed lich --help" in ms:
        installed_ms = ms["installed lich --help"]
        table.append(("3 installed lich --help",
                      f"{installed_ms:.1f} ms (+{installed_ms - base:.1f} over python -c pass)",
                      "report", None))
    return {"best_ms": ms, "rounds": rounds, "old_rev": args.old_rev,
            "old_lich_bytes": os.path.getsize(old_py), "new_lich_bytes": os.path.getsize(LICH_PY),
            "table": table}


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


@row("sessions")
def bench_sessions(args):
    n = 10_000 if args.quick else 100_000
    target_bytes = (10 if args.quick else 100) * 1_000_000
    message = {"role": "assistant", "content": "Reading module_12.py next.",
               "tool_calls": [{"id": "call_12", "name": "lookup",
                               "arguments": '{"path": "src/pkg/module_12.py", "line": 120}'}]}
    with tempfile.TemporaryDirectory() as tmp:
        raw_path = os.path.join(tmp, "raw.jsonl")

        def raw_append():
            with open(raw_path, "w") as f:
                for _ in range(n):
                    f.write(json.dumps({"ts": "2026-01-01T00:00:00.000Z", "kind": "message",
                                        "message": message}) + "\n")
                    f.flush()

        def lich_append():
            with lich.open_session(os.path.join(tmp, "appends")) as handle:
                for _ in range(n):
                    handle.append_message(message)

        appends = alternate({"raw": raw_append, "lich": lich_append}, 3 if args.quick else 5)
        raw_t, lich_t = median(appends["raw"]), median(appends["lich"])

        # a big session, written through a handle: unique call ids, as the loop records them
        records = 0
        with lich.open_session(os.path.join(tmp, "big"), label="big") as handle:
            big = handle.path
            while os.path.getsize(big) < target_bytes:
                for _ in range(100):
                    k = records
                    call_id = f"call_{k}"
                    handle.append_message({"role": "user", "content": f"Look at module {k}."})
                    handle.append_message({**message, "tool_calls": [
                        {**message["tool_calls"][0], "id": call_id}]})
                    handle.append_message({"role": "tool", "tool_call_id": call_id,
                                           "name": "lookup", "is_error": False,
                                           "content": clients.lookup(f"src/pkg/module_{k}.py", k)})
                    records += 3

        def raw_read():
            out = []
            with open(big, "rb") as f:
                for line in f:
                    out.append(json.loads(line)["message"])
            return out

        reads = alternate({"raw": raw_read, "lich": lambda: lich.read_session_messages(big)},
                          2 if args.quick else 3)
        raw_r, lich_r = median(reads["raw"]), median(reads["lich"])
        gc.collect()
        tracemalloc.start()
        result = lich.read_session_messages(big)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        size = deep_size(result)
        assert len(result) == records, (len(result), records)
        file_mb = os.path.getsize(big) / 1e6
    append_ratio, read_ratio, memory = raw_t / lich_t, raw_r / lich_r, peak / size
    return {
        "append": {"records": n, "raw_per_s": n / raw_t, "lich_per_s": n / lich_t,
                   "ratio": append_ratio},
        "read": {"file_mb": file_mb, "records": records, "raw_s": raw_r, "lich_s": lich_r,
                 "ratio": read_ratio, "peak_mb": peak / 1e6, "result_mb": size / 1e6,
                 "peak_vs_result": memory},
        "table": [
            ("4 session appends",
             f"{append_ratio:.2f}x raw ({n / lich_t / 1e3:.0f}k vs {n / raw_t / 1e3:.0f}k records/s)",
             ">= 0.7x", append_ratio >= 0.7),
            ("4 session read",
             f"{read_ratio:.2f}x raw ({file_mb:.0f} MB: {lich_r:.2f} vs {raw_r:.2f} s)",
             ">= 0.8x", read_ratio >= 0.8),
            ("4 session read memory",
             f"{memory:.2f}x the result ({peak / 1e6:.0f} vs {size / 1e6:.0f} MB)",
             "<= 2x", memory <= 2.0),
        ],
    }


# ---------------------------------------------------------------------------- 5. threads

@row("threads")
def bench_threads(args):
    threads_n, turns, latency = (16 if args.quick else 32), 10, 0.02
    with LoopbackServer(latency=latency) as server:
        chat = lich.OpenAIChat("bench", base_url=server.url + "/v1")
        tools = lookup_tools()

        def conversation(i):
            outcome = lich.run_conversation(chat, tools, [first_user(turns, f"Thread {i}. ")],
                                            system_prompt=clients.SYSTEM_PROMPT,
                                            max_turns=turns + 5)
            assert outcome.stopped_reason == "final" and outcome.turns_used == turns
            return outcome

        def intact(i, outcome):
            results = [m["content"] for m in outcome.messages if m["role"] == "tool"]
            return (outcome.messages[1]["content"].startswith(f"Thread {i}. ")
                    and len(results) == turns - 1
                    and all(f"module_{k}.py" in text for k, text in enumerate(results, 1)))

        errors, broken = [], []

        def sequential():
            for i in range(threads_n):
                conversation(i)

        def threaded():
            outcomes = {}

            def worker(i):
                try:
                    outcomes[i] = conversation(i)
                except BaseException as exc:  # counted, and the row fails
                    errors.append(repr(exc))

            workers = [threading.Thread(target=worker, args=(i,)) for i in range(threads_n)]
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            broken.extend(i for i in range(threads_n) if i not in outcomes
                          or not intact(i, outcomes[i]))

        conversation(-1)
        times = alternate({"sequential": sequential, "threaded": threaded},
                          1 if args.quick else 3)
    speedup = median(times["sequential"]) / median(times["threaded"])
    ok = speedup >= 8 and not errors and not broken
    return {"threads": threads_n, "turns_each": turns, "server_latency_s": latency,
            "sequential_s": median(times["sequential"]), "threaded_s": median(times["threaded"]),
            "speedup": speedup, "errors": errors, "histories_broken": len(broken),
            "table": [("5 threads vs sequential",
                       (f"{speedup:.1f}x, {len(errors)} errors, {len(broken)} histories wrong "
                        f"({threads_n} x {turns} turns)"),
                       ">= 8x, 0 errors", ok)]}


# ---------------------------------------------------------------------------- 6. search

SKIPPED = (".git", "node_modules", "__pycache__", ".venv", "venv")
PATTERNS = {"rare literal": "frobnicate_xyz", "common words": "import os",
            "regex": r"def \w+_cache\("}


def search_tree(quick):
    """A copy of this Python's lib folder (about 50,000 files), made once under $TMPDIR;
    --quick copies its standard library without site-packages."""
    source = sysconfig.get_paths()["stdlib"]
    tree = os.path.join(tempfile.gettempdir(), "lich-bench-tree" + ("-quick" if quick else ""))
    done = tree + ".done"
    if not (os.path.isdir(tree) and os.path.exists(done)):
        shutil.rmtree(tree, ignore_errors=True)
        print(f"  copying {source} to {tree} ...", file=sys.stderr, flush=True)
        ignore = shutil.ignore_patterns("site-packages") if quick else None
        shutil.copytree(source, tree, symlinks=True, ignore=ignore)
        with open(done, "w") as f:
            f.write(source)
    files = searched = size = 0
    for folder, subfolders, names in os.walk(tree):
        inside = not any(part in SKIPPED for part in os.path.relpath(folder, tree).split(os.sep))
        for name in names:
            files += 1
            if inside:
                path = os.path.join(folder, name)
                if os.path.isfile(path) and not os.path.islink(path):
                    searched += 1
                    size += os.path.getsize(path)
    return tree, {"files": files, "files_searched": searched, "mb_searched": size / 1e6}


def without_rg():
    """PATH without the folders that hold an ``rg``."""
    return os.pathsep.join(d for d in os.environ.get("PATH", "").split(os.pathsep)
                           if d and not shutil.which("rg", path=d))


class Engine:
    """lich's search with PATH set for the call: with ripgrep, or without it (the worker)."""

    def __init__(self, tools, path):
        self.tools = tools
        self.path = path

    def __call__(self, pattern):
        saved = os.environ.get("PATH", "")
        os.environ["PATH"] = self.path
        try:
            result = self.tools.run({"id": "s", "name": "search",
                                     "arguments": json.dumps({"pattern": pattern})})
        finally:
            os.environ["PATH"] = saved
        assert result.ok, result.error
        return result.output


def lich_count(output):
    """(matches found, whether the search stopped at its time limit) from search's answer."""
    shown = more = 0
    stopped = False
    for line in output.splitlines():
        found = re.fullmatch(r"\.\.\. (\d+) more matches", line)
        if found:
            more = int(found.group(1))
        elif line.startswith("[... the search stopped"):
            stopped = True
        elif not line.startswith("[... ") and line != "no matches":
            shown += 1
    return shown + more, stopped


def grep_argv(pattern):
    # -E: the regex pattern is extended syntax (in basic syntax "\(" opens a group)
    return [shutil.which("grep"), "-rnIE", *(f"--exclude-dir={d}" for d in SKIPPED), "--",
            pattern, "."]


@row("search")
def bench_search(args):
    tree, shape = search_tree(args.quick)
    print(f"  tree {tree}: {shape['files']} files, {shape['files_searched']} searched "
          f"(outside {', '.join(SKIPPED)}), {shape['mb_searched']:.0f} MB",
          file=sys.stderr, flush=True)
    tools = lich.coding_tools(tree)
    engines = {"worker": Engine(tools, without_rg())}
    if shutil.which("rg"):
        engines = {"rg": Engine(tools, os.environ["PATH"]), **engines}
    grep_counts = {}

    def grep(pattern):
        done = subprocess.run(grep_argv(pattern), cwd=tree, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, check=False)
        assert done.returncode in (0, 1), done.returncode
        grep_counts[pattern] = done.stdout.count(b"\n")

    warm = {}  # (engine, pattern): (seconds, (matches, stopped)) of the first search
    for pattern in PATTERNS.values():  # warms the page cache, and the worker's bytecode
        grep(pattern)
        for name, engine in engines.items():
            start = time.perf_counter()
            output = engine(pattern)
            warm[name, pattern] = time.perf_counter() - start, lich_count(output)
    results, table = {"tree": shape}, []
    for label, pattern in PATTERNS.items():
        counts = {}
        # an engine that ran into the search's time limit once is not timed again (each
        # round would cost the whole limit): its first search is the figure
        timed = [e for e in engines if not warm[e, pattern][1][1]]

        def side(engine, pattern=pattern, counts=counts):
            def run():
                counts[engine] = lich_count(engines[engine](pattern))
            return run

        fns = {"grep": lambda p=pattern: grep(p), **{e: side(e) for e in timed}}
        times = alternate(fns, 2 if args.quick else 5)
        t = {name: median(v) for name, v in times.items()}
        for engine in engines:
            if engine not in timed:
                t[engine], counts[engine] = warm[engine, pattern]
        results[label] = {"pattern": pattern, "grep_s": t["grep"],
                          "grep_matches": grep_counts[pattern]}
        for engine in engines:
            ratio = t[engine] / t["grep"]
            found, stopped = counts[engine]
            results[label][engine] = {"s": t[engine], "ratio": ratio, "matches": found,
                                      "stopped_at_time_limit": stopped}
            table.append((f"6 search {label}, {engine}",
                          f"{ratio:.2f}x grep ({t[engine] * 1e3:.0f} vs {t['grep'] * 1e3:.0f} ms; "
                          f"{found} vs {grep_counts[pattern]} matches)"
                          + (", STOPPED at time limit" if stopped else ""),
                          "<= 1.5x", ratio <= 1.5 and not stopped))
    if "rg" not in engines:
        table.append(("6 search with rg", "rg is not on PATH: not measured", "<= 1.5x", None))
    results["table"] = table
    return results


# ---------------------------------------------------------------------------- 7. writes

def text_of(size):
    """About ``size`` characters of source-like text with one MARKER_A in the middle."""
    line = "    total = compute(items, scale=2.5)  # an ordinary line of code\n"
    body = line * (size // len(line) + 1)
    half = len(body) // 2
    return (body[:half] + "MARKER_A\n" + body[half:])[:size]


def write_figures(tools, root, size, calls, rounds):
    """{tool: figures} of write_file and edit_file on one file of ``size`` characters."""
    name = f"file_{size}.txt"
    path = os.path.join(root, name)
    text = text_of(size)
    data = text.encode()
    edited = {"A": data, "B": data.replace(b"MARKER_A", b"MARKER_B")}
    # the arguments as a model's call carries them: JSON text
    arguments = {"write_file": json.dumps({"path": name, "content": text}),
                 "B": json.dumps({"path": name, "old_text": "MARKER_A", "new_text": "MARKER_B"}),
                 "A": json.dumps({"path": name, "old_text": "MARKER_B", "new_text": "MARKER_A"})}

    def call(tool, args):
        result = tools.run({"id": "w", "name": tool, "arguments": args})
        assert result.ok, result.error

    def lich_write():
        for _ in range(calls):
            call("write_file", arguments["write_file"])

    def plain_write():
        for _ in range(calls):
            with open(path, "wb") as f:
                f.write(data)

    def lich_edit():  # A -> B -> A ...: one occurrence each time
        for i in range(calls):
            call("edit_file", arguments["B" if i % 2 == 0 else "A"])

    def plain_edit():  # the same bytes edit_file writes
        for i in range(calls):
            with open(path, "wb") as f:
                f.write(edited["B" if i % 2 == 0 else "A"])

    figures = {}
    for tool, mine, plain, args in (("write_file", lich_write, plain_write, "write_file"),
                                    ("edit_file", lich_edit, plain_edit, "A")):
        plain_write()  # the file as each side expects it: MARKER_A
        times = alternate({"lich": mine, "plain": plain}, rounds)
        lich_us = median(times["lich"]) / calls * 1e6
        plain_us = median(times["plain"]) / calls * 1e6
        start = time.perf_counter()
        for _ in range(calls):
            json.loads(arguments[args])
        figures[tool] = {"lich_us": lich_us, "plain_us": plain_us, "ratio": lich_us / plain_us,
                         "extra_us": lich_us - plain_us,
                         "allowed_us": max(plain_us + 100, 2 * plain_us),
                         "arguments_json_decode_us": (time.perf_counter() - start) / calls * 1e6}
    return figures


@row("writes")
def bench_writes(args):
    # short batches, many rounds: the disk is shared, and its pace drifts within seconds
    calls, rounds = (20, 8) if args.quick else (20, 60)
    results, table = {}, []
    with tempfile.TemporaryDirectory() as root:
        tools = lich.coding_tools(root, allow_write=True)
        for size in (1_000, 100_000):
            for tool, f in write_figures(tools, root, size, calls, rounds).items():
                results[f"{tool} {size}"] = f
                table.append((f"7 {tool} {size // 1000} KB",
                              (f"{f['ratio']:.2f}x, +{f['extra_us']:.0f} us ({f['lich_us']:.0f} vs "
                               f"{f['plain_us']:.0f} us; JSON args {f['arguments_json_decode_us']:.0f})"),
                              "+100us or 2x", f["lich_us"] <= f["allowed_us"]))
    results["table"] = table
    return results


# ---------------------------------------------------------------------------- 8. small search

def plain_search(root, regex):
    """The plain in-process loop: re over each text file's lines, the same folders skipped."""
    found = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = sorted(d for d in subfolders if d not in SKIPPED)
        for name in sorted(names):
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                data = f.read()
            if b"\0" in data[:8192]:
                continue
            for number, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
                if regex.search(line):
                    found.append((path, number, line))
    return found


@row("search_small")
def bench_search_small(args):
    source = sysconfig.get_paths()["stdlib"]
    pattern = "import os"
    regex = re.compile(pattern)
    with tempfile.TemporaryDirectory() as root:
        for name in sorted(n for n in os.listdir(source) if n.endswith(".py"))[:100]:
            shutil.copy(os.path.join(source, name), root)
        tools = lich.coding_tools(root)
        engines = {"worker": Engine(tools, without_rg())}
        if shutil.which("rg"):
            engines["rg"] = Engine(tools, os.environ["PATH"])
        start = time.perf_counter()
        first_worker = engines["worker"](pattern)  # the first call after lich.py last changed
        first_s = time.perf_counter() - start
        expected = len(plain_search(root, regex))
        assert lich_count(first_worker)[0] == expected, (lich_count(first_worker), expected)
        fns = {name: (lambda e=engine: e(pattern)) for name, engine in engines.items()}
        fns["plain loop"] = lambda: plain_search(root, regex)
        times = alternate(fns, 5 if args.quick else 20)
    ms = {name: median(t) * 1e3 for name, t in times.items()}
    table = [("8 search 100 files, worker", (
        f"{ms['worker']:.1f} ms per call (first {first_s * 1e3:.0f}); plain loop "
        f"{ms['plain loop']:.1f} ms"), "<= 20 ms", ms["worker"] <= 20)]
    if "rg" in ms:
        table.append(("8 search 100 files, rg", f"{ms['rg']:.1f} ms per call", "report", None))
    return {"files": 100, "pattern": pattern, "matches": expected, "median_ms": ms,
            "worker_first_call_ms": first_s * 1e3, "table": table}


# ---------------------------------------------------------------------------- 9. batch

class BareBatch:
    """The machine's floor for row 9: a hand-written requests loop (http_clients'
    RequestsClient, one per thread) running the same conversations on exactly as many
    threads as the server admits, so it never meets a 429."""

    def __init__(self, base_url, threads, turns):
        self.base_url, self.threads, self.turns = base_url, threads, turns

    def __call__(self):
        pending = list(reversed(self.turns))
        lock = threading.Lock()
        failures = []

        def worker():
            client = clients.RequestsClient("openai", False, self.base_url)
            while True:
                with lock:
                    if not pending:
                        return
                    turns = pending.pop()
                try:
                    client.conversation(turns)
                except BaseException as exc:  # counted, and the row fails
                    failures.append(repr(exc))

        threads = [threading.Thread(target=worker) for _ in range(self.threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not failures, failures[:3]


def batch_failures(results):
    """Results that are not ok, or not their own task's final answer."""
    return [r for r in results if not (r.ok and r.final and r.final.endswith(f"[{r.id}]"))]


@row("batch")
def bench_batch(args):
    # As issue 12 puts it: 1,000 conversations of 3 calls, 50 ms a call, 64 workers, a
    # server that admits 16 calls at once.
    n, cap, latency, workers, calls = (200 if args.quick else 1000), 16, 0.05, 64, 3
    tasks = batch_child.batch_tasks(n, calls)
    posts = batch_child.requests_of(n, calls)
    ideal = posts * latency / cap
    tools = batch_child.lookup_tools()
    figures = {"limiter": [], "no limiter": [], "bare": []}
    with LoopbackServer(latency, "--max-in-flight", cap) as server:
        spec = f"openai:bench@{server.url}/v1"

        def lich_side(name, limited):
            def run():
                server.stats()
                results = lich.run_batch(tasks, chat=spec, tools=tools, workers=workers,
                                         limiter=lich.Limiter(max_concurrent=cap) if limited
                                         else None, max_turns=5,
                                         system_prompt=clients.SYSTEM_PROMPT)
                figures[name].append({**server.stats(), "failed": len(batch_failures(results))})
            return run

        def bare():
            server.stats()
            BareBatch(server.url, cap, [calls] * n)()
            figures["bare"].append(server.stats())

        lich.run_batch(tasks[:40], chat=spec, tools=tools, workers=8, max_turns=5)  # warm up
        times = alternate({"limiter": lich_side("limiter", True),
                           "no limiter": lich_side("no limiter", False), "bare": bare},
                          1 if args.quick else 3)
    t = {name: median(v) for name, v in times.items()}
    sums = {name: {key: sum(f[key] for f in v) for key in v[0]} for name, v in figures.items()}
    ratio = t["limiter"] / ideal
    failed = sums["limiter"]["failed"]  # without the limiter, failures are a finding, reported
    rounds = len(times["bare"])
    table = [
        (f"9 batch {n} tasks, Limiter({cap})",
         (f"{ratio:.2f}x ideal ({t['limiter']:.2f} vs {ideal:.2f} s; {t['limiter'] / t['bare']:.2f}x "
          f"bare), {sums['limiter']['rejected_429']} 429s in {rounds} runs"),
         "<= 1.3x ideal", ratio <= 1.3 and not sums["limiter"]["failed"]),
        ("9 batch, no limiter",
         (f"{t['no limiter'] / ideal:.2f}x ideal ({t['no limiter']:.2f} s), "
          f"{sums['no limiter']['rejected_429']} 429s, {sums['no limiter']['failed']} failed"),
         "report", None),
        ("9 batch, bare requests x16",
         f"{t['bare'] / ideal:.2f}x ideal ({t['bare']:.2f} s; the machine's floor)", "report",
         None),
    ]
    if failed:
        table.append(("9 batch, Limiter: results", f"{failed} tasks failed or wrong", "0", False))
    return {"tasks": n, "requests": posts, "server_latency_s": latency, "max_in_flight": cap,
            "workers": workers, "ideal_s": ideal, "median_s": t, "rounds": rounds,
            "server_counts": figures, "limiter_vs_ideal": ratio, "table": table}


# ---------------------------------------------------------------------------- 10. kill -9

def out_lines(path):
    """(the parsed complete lines of a run_batch out file, whether its last line is torn)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return [], False
    parsed = []
    for line in data.split(b"\n"):
        try:
            parsed.append(json.loads(line))
        except ValueError:
            pass
    return parsed, bool(data) and not data.endswith(b"\n")


SESSION_LABEL = re.compile(r"-(t\d+)\.jsonl$")


def child_batch(server, n, out, session_dir):
    os.makedirs(os.path.dirname(out), exist_ok=True)
    return [sys.executable, os.path.join(HERE, "batch_child.py"), "--base-url", server.url,
            "--tasks", str(n), "--workers", "8", "--out", out, "--session-dir", session_dir]


def kill_point(server, n, folder, delay):
    """Kill a batch ``delay`` s after it started, resume it; the checks of one point."""
    out, sessions = os.path.join(folder, "out.jsonl"), os.path.join(folder, "sessions")
    argv = child_batch(server, n, out, sessions)
    server.stats()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "started"
    time.sleep(delay)
    proc.kill()  # SIGKILL
    proc.wait()
    proc.stdout.close()
    killed_posts = server.stats()["posts"]
    before, torn = out_lines(out)
    finished = {r["id"]: r for r in before if r.get("ok")}
    started_files = sorted(os.listdir(sessions)) if os.path.isdir(sessions) else []
    started = {m.group(1) for m in map(SESSION_LABEL.search, started_files) if m}
    problems = []
    for name in started_files:  # every session file, torn ones too, reads back
        try:
            lich.read_session_messages(os.path.join(sessions, name))
        except Exception as exc:
            problems.append(f"session {name} after the kill: {exc!r}")
    done = subprocess.run(argv, capture_output=True, text=True, check=True)
    resumed_posts = server.stats()["posts"]
    results = [lich.BatchResult(**r) for r in json.loads(done.stdout.splitlines()[-1])["results"]]
    after, _ = out_lines(out)
    ok_lines = {}
    for r in after:
        if r.get("ok"):
            ok_lines.setdefault(r["id"], []).append(r)
    lost = [i for i, r in finished.items() if ok_lines.get(i) != [r]]
    duplicated = [i for i, lines in ok_lines.items() if len(lines) > 1]
    wrong = batch_failures(results)
    for r in results:
        try:
            last = lich.read_session_messages(r.session_path)[-1]
            if last.get("content") != r.final:
                problems.append(f"session of {r.id} ends {last.get('content')!r}")
        except Exception as exc:
            problems.append(f"session of {r.id}: {exc!r}")
    if len(results) != n or set(ok_lines) != {r.id for r in results}:
        problems.append(f"{len(ok_lines)} ids with ok lines, {len(results)} results")
    return {"delay_s": delay, "finished_before": len(finished), "torn_line": torn,
            "runs_started_not_recorded": len(started - set(finished)),
            "extra_requests": killed_posts + resumed_posts - batch_child.requests_of(n),
            "lost": lost, "duplicated": duplicated, "wrong": [r.id for r in wrong],
            "problems": problems[:5],
            "ok": not (lost or duplicated or wrong or problems)}


@row("kill")
def bench_kill(args):
    n, points = (100, 5) if args.quick else (200, 20)
    with LoopbackServer(0.02) as server, tempfile.TemporaryDirectory(prefix="lich-bench-kill-") as tmp:
        spans = []
        for k in range(2):  # the batch's own length, from "started" to its end
            folder = os.path.join(tmp, f"whole{k}")
            proc = subprocess.Popen(child_batch(server, n, os.path.join(folder, "out.jsonl"),
                                                os.path.join(folder, "sessions")),
                                    stdout=subprocess.PIPE, text=True)
            assert proc.stdout.readline().strip() == "started"
            start = time.perf_counter()
            report = json.loads(proc.stdout.readline())
            spans.append(time.perf_counter() - start)
            proc.wait()
            proc.stdout.close()
            assert not batch_failures([lich.BatchResult(**r) for r in report["results"]])
        span = median(spans)
        checks = [kill_point(server, n, os.path.join(tmp, f"kill{i}"), span * (i + 0.5) / points)
                  for i in range(points)]
    good = sum(c["ok"] for c in checks)
    extra = [c["extra_requests"] for c in checks]
    redone = [c["runs_started_not_recorded"] for c in checks]
    return {"tasks": n, "batch_s": span, "points": checks,
            "table": [(f"10 kill -9 and resume ({points} points)",
                       (f"{good}/{points} resumed right; redone per kill: median {median(redone):g} "
                        f"runs, {median(extra):g} requests (max {max(extra)}) of {batch_child.requests_of(n)}"),
                       f"{points}/{points}", good == points)]}


# ---------------------------------------------------------------------------- 11. executors

class TreeRSS:
    """The peak of the summed RSS of a process and its descendants, sampled every 20 ms."""

    def __init__(self, pid):
        import psutil

        self.root = psutil.Process(pid)
        self.peak = 0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()

    def _sample(self):
        import psutil

        while not self.done.wait(0.02):
            total = 0
            try:
                for proc in [self.root, *self.root.children(recursive=True)]:
                    try:
                        total += proc.memory_info().rss
                    except psutil.Error:
                        pass
            except psutil.Error:
                return
            self.peak = max(self.peak, total)

    def stop(self):
        self.done.set()
        self.thread.join()
        return self.peak


@row("executors")
def bench_executors(args):
    n = 200 if args.quick else 1000
    figures = {"threads": [], "processes": [], "dask": []}
    try:
        import dask.distributed  # noqa: F401
        import psutil  # noqa: F401
    except ImportError as exc:
        return {"table": [("11 threads/processes/Dask", f"not measured: {exc}", "report", None)]}
    outputs = {}
    with LoopbackServer() as server:
        def side(name):
            def run():
                proc = subprocess.Popen(
                    [sys.executable, os.path.join(HERE, "batch_child.py"), "--base-url", server.url,
                     "--tasks", str(n), "--executor", name], stdout=subprocess.PIPE, text=True)
                rss = TreeRSS(proc.pid)
                out, _ = proc.communicate()
                peak = rss.stop()
                assert proc.returncode == 0, proc.returncode
                report = json.loads(out.splitlines()[-1])
                results = report["results"]
                for r in results:
                    r.pop("session_path")
                outputs.setdefault(name, []).append(results)
                figures[name].append({"setup_s": report["setup_s"], "batch_s": report["batch_s"],
                                      "peak_rss_mb": peak / 1e6})
            return run

        alternate({name: side(name) for name in figures}, 1 if args.quick else 2)
    every = [r for runs in outputs.values() for r in runs]
    identical = all(r == every[0] for r in every)
    wrong = len(batch_failures([lich.BatchResult(**r, session_path=None) for r in every[0]]))
    table = []
    med = {}
    for name, runs in figures.items():
        med[name] = {k: median(f[k] for f in runs) for k in runs[0]}
        m = med[name]
        table.append((f"11 batch {n} tasks: {name}",
                      (f"{m['batch_s']:.2f} s (setup {m['setup_s']:.2f} s), peak RSS "
                       f"{m['peak_rss_mb']:.0f} MB"), "report", None))
    table.append(("11 batch: the same results", (
        "identical" if identical else "DIFFERENT") + f" ({len(every)} runs, {wrong} wrong)",
        "identical", identical and not wrong))
    return {"tasks": n, "runs": figures, "median": med, "identical": identical, "table": table}


# ---------------------------------------------------------------------------- 12. MCP

EVERYTHING_JS = os.environ.get("BENCH_SERVER_EVERYTHING", "/work/probe/npm/node_modules/"
                               "@modelcontextprotocol/server-everything/dist/index.js")


def mcp_servers():
    """{name: (argv, tool, arguments)} of the real servers found on this machine."""
    servers = {}
    time_server = shutil.which("mcp-server-time") or shutil.which(
        "mcp-server-time", path=os.path.dirname(sys.executable))
    if time_server:
        servers["mcp-server-time"] = ([time_server, "--local-timezone", "UTC"],
                                      "get_current_time", {"timezone": "UTC"})
    if shutil.which("node") and os.path.exists(EVERYTHING_JS):
        servers["server-everything"] = (["node", EVERYTHING_JS, "stdio"], "echo",
                                        {"message": "hello"})
    return servers


def mcp_figures(argv, tool, arguments, args):
    # start-up: spawn to a usable tool list (lich) / to initialize and tools/list answered (bare)
    starts = {"lich": [], "bare init": [], "bare list": []}
    for r in range(2 if args.quick else 5):
        for side in (["lich", "bare"] if r % 2 == 0 else ["bare", "lich"]):
            start = time.perf_counter()
            if side == "lich":
                with lich.mcp_tools(argv, timeout=60) as tools:
                    assert any(s["name"] == tool for s in tools.specs())
                    starts["lich"].append(time.perf_counter() - start)
            else:
                bare = mcp_bare.BareMCP(argv)
                try:
                    bare.initialize()
                    starts["bare init"].append(time.perf_counter() - start)
                    bare.request("tools/list")
                    starts["bare list"].append(time.perf_counter() - start)
                finally:
                    bare.close()
    # per call: one server process for each client, blocks of 50 calls alternated
    calls, block = (100, 25) if args.quick else (500, 50)
    call = {"id": "bench", "name": tool, "arguments": json.dumps(arguments)}
    bare = mcp_bare.BareMCP(argv)
    try:
        bare.initialize()
        with lich.mcp_tools(argv, timeout=60) as tools:
            tools.specs()
            expected = bare.call(tool, arguments)

            def lich_block():
                for _ in range(block):
                    result = tools.run(call)
                    assert result.ok, result.error

            def bare_block():
                for _ in range(block):
                    bare.call(tool, arguments)

            assert tools.run(call).ok and expected
            times = alternate({"lich": lich_block, "bare": bare_block}, calls // block)
    finally:
        bare.close()
    per_call = {name: median(t) / block for name, t in times.items()}
    return {"startup_ms": {k: median(v) * 1e3 for k, v in starts.items()},
            "per_call_us": {k: v * 1e6 for k, v in per_call.items()},
            "ratio": per_call["lich"] / per_call["bare"], "calls_each": calls}


@row("mcp")
def bench_mcp(args):
    servers = mcp_servers()
    results, table = {}, []
    for name, (argv, tool, arguments) in servers.items():
        f = results[name] = mcp_figures(argv, tool, arguments, args)
        us, ms = f["per_call_us"], f["startup_ms"]
        table.append((f"12 MCP {name}: per call", (
            f"{f['ratio']:.2f}x bare ({us['lich']:.0f} vs {us['bare']:.0f} us, "
            f"{f['calls_each']} calls)"), "<= 1.2x", f["ratio"] <= 1.2))
        table.append((f"12 MCP {name}: start-up", (
            f"{ms['lich']:.0f} ms to a tool list; bare: initialize {ms['bare init']:.0f}, "
            f"list {ms['bare list']:.0f}"), "report", None))
    for name in ("mcp-server-time", "server-everything"):
        if name not in servers:
            table.append((f"12 MCP {name}", "not installed: not measured", "<= 1.2x", None))
    results["table"] = table
    return results


# ---------------------------------------------------------------------------- 13. caching

def cached_conversation(server, cache, stream, turns):
    """The summed usage of one ``turns``-turn tool conversation with a fresh server cache."""
    server.reset()
    chat = lich.AnthropicChat("bench", api_key="x", base_url=server.url, cache=cache,
                              stream=stream, on_delta=(lambda text: None) if stream else None)
    run = lich.run_agent(clients.user_text(turns), chat=chat, tools=lookup_tools(),
                         max_turns=turns + 5, system_prompt=clients.SYSTEM_PROMPT)
    assert run.stopped_reason == "final" and run.turns_used == turns, run.stopped_reason
    used = run.usage_total
    read, written = used.get("cache_read_tokens", 0), used.get("cache_write_tokens", 0)
    full = used["input_tokens"] - read - written
    server_side = server.stats()
    assert server_side["input_tokens"] == full, (server_side, used)
    return {"input_tokens": used["input_tokens"], "full_price": full, "cache_read": read,
            "cache_write": written, "cost_units": full + 1.25 * written + 0.1 * read}


@row("caching")
def bench_caching(args):
    turns = 50
    results, table = {}, []
    with LoopbackServer(0.0, "--cache-sim") as server:
        for stream in (False, True):
            on = cached_conversation(server, True, stream, turns)
            off = cached_conversation(server, False, stream, turns)
            ratio = on["full_price"] / off["full_price"]
            cost = on["cost_units"] / off["cost_units"]
            name = "stream" if stream else "plain"
            results[name] = {"cache on": on, "cache off": off, "full_price_ratio": ratio,
                             "cost_ratio": cost}
            table.append((f"13 Anthropic cache, {turns} turns, {name}", (
                f"{ratio:.3f}x full-price input ({on['full_price']} vs {off['full_price']} "
                f"tokens); cost {cost:.2f}x (read {on['cache_read']}, write {on['cache_write']})"),
                "<= 0.2x", ratio <= 0.2))
    results["table"] = table
    return results


# ---------------------------------------------------------------------------- 14. tracing

class FinalAfter(ScriptedChat):
    """ScriptedChat, with a final answer at turn ``turns``."""

    def __init__(self, turns):
        super().__init__()
        self.turns = turns

    def __call__(self, messages, **kwargs):
        if self.turn + 1 >= self.turns:
            self.turn += 1
            return lich.ChatResult({"role": "assistant", "content": "All done."},
                                   {"input_tokens": 50, "output_tokens": 10}, "bench", "stop")
        return super().__call__(messages, **kwargs)


@row("tracing")
def bench_tracing(args):
    try:
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
            InMemorySpanExporter,
        )
    except ImportError as exc:
        return {"table": [("14 tracing", f"not measured: {exc}", "report", None)]}
    turns, runs_per_sample = 200, 5
    tools = lookup_tools()
    exporter = InMemorySpanExporter()
    recording = TracerProvider()
    recording.add_span_processor(SimpleSpanProcessor(exporter))
    dropping = TracerProvider()  # no processor: spans are made, then dropped
    spans = []

    def run(emitter):
        outcome = lich.run_agent(clients.user_text(turns), chat=FinalAfter(turns), tools=tools,
                                 max_turns=turns, emitter=emitter,
                                 system_prompt=clients.SYSTEM_PROMPT)
        assert outcome.stopped_reason == "final" and outcome.turns_used == turns

    def plain():
        for _ in range(runs_per_sample):
            run(None)

    # tracing set up but off: an emitter that was traced, then unsubscribed (the setup is
    # not timed: the figure is the cost per turn that tracing leaves behind when off)
    off_emitter = lich.AgentEmitter()
    lich.trace_otel(off_emitter, tracer=recording.get_tracer("bench"))()

    def unsubscribed():
        for _ in range(runs_per_sample):
            run(off_emitter)

    def traced(provider, keep):
        def go():
            for _ in range(runs_per_sample):
                emitter = lich.AgentEmitter()
                lich.trace_otel(emitter, tracer=provider.get_tracer("bench"))
                run(emitter)
                if keep:
                    spans.append(len(exporter.get_finished_spans()))
                    exporter.clear()
        return go

    sides = {"plain": plain, "plain again": plain, "unsubscribed": unsubscribed,
             "traced, in-memory": traced(recording, True), "traced, no exporter": traced(dropping, False)}
    for fn in sides.values():
        fn()
    spans.clear()
    times = alternate(sides, 8 if args.quick else 40, clock=time.process_time)
    per_turn = {name: median(t) / runs_per_sample / turns * 1e6 for name, t in times.items()}
    base = per_turn["plain"]

    def paired(name):  # the median of the per-round ratios: the drift of the machine cancels
        return median(a / b for a, b in zip(times[name], times["plain"])) - 1

    noise, off = abs(paired("plain again")), paired("unsubscribed")
    allowed = max(2 * noise, 0.03)
    span_count = median(spans)
    per_span = {name: (per_turn[name] - base) * turns / span_count
                for name in ("traced, in-memory", "traced, no exporter")}
    return {"turns": turns, "us_per_turn": per_turn, "noise": noise, "off_vs_plain": off,
            "spans_per_run": span_count, "us_per_span": per_span,
            "table": [
                ("14 tracing off, per turn", (
                    f"{off:+.1%} ({per_turn['unsubscribed']:.1f} vs {base:.1f} us; noise "
                    f"{noise:.1%}: plain vs plain)"), f"within +-{allowed:.0%}", abs(off) <= allowed),
                ("14 tracing on, per span", (
                    f"{per_span['traced, in-memory']:.1f} us in-memory exporter, "
                    f"{per_span['traced, no exporter']:.1f} us none ({span_count:g} spans/run, "
                    f"{per_turn['traced, in-memory']:.0f} us/turn)"), "report", None),
            ]}


# ---------------------------------------------------------------------------- 15. redaction

@row("redaction")
def bench_redaction(args):
    """A server that makes a chat per request with its user's key holds many keys at once;
    every tool result is redacted of all of them. Per 50 KB tool result (a Python source
    text, one key in it), with 1 and with 500 chats alive. The first key holds every letter
    and digit, as 500 keys together do: the text's runs of key characters, whose windows are
    looked up, are then the same on both sides."""
    import random
    import string

    source = sysconfig.get_paths()["stdlib"]
    text = ""
    for name in ("json/decoder.py", "json/encoder.py", "json/scanner.py", "argparse.py"):
        with open(os.path.join(source, name)) as f:
            text += f.read()
    text = text[:50_000]
    tools = lich.Tools()
    tools.register(lambda: shown, name="show", description="The text.")
    rng = random.Random(7)
    chats, keys_made, figures, table = [], [], {}, []
    rounds = 10 if args.quick else 40
    alphabet = string.ascii_letters + string.digits
    for keys in (1, 500):
        while len(chats) < keys:
            key = "sk-" + ("".join(rng.sample(alphabet, len(alphabet))) if not chats else
                           "".join(rng.choice(alphabet) for _ in range(48)))
            chats.append(lich.OpenAIChat("m", api_key=key, base_url="http://127.0.0.1:9/v1"))
            keys_made.append(key)
        shown = f"token {keys_made[keys // 2]} here\n{text}"

        def run():
            history = []
            lich.run_tool_calls(tools, [{"id": "c1", "name": "show", "arguments": "{}"}], history, turn=1)
            assert "[redacted]" in history[0]["content"]

        figures[keys] = median(alternate({"run": run}, rounds)["run"]) * 1000
    ratio = figures[500] / figures[1]
    shown_ratio = f"{ratio:.2f}x ({figures[500]:.2f} vs {figures[1]:.2f} ms per 50 KB result)"
    table.append(("15 redaction, 500 keys vs 1", shown_ratio, "<= 1.5x", ratio <= 1.5))
    return {"ms_per_result": figures, "ratio": ratio, "table": table}


# ---------------------------------------------------------------------------- report

def lich_digest():
    """The SHA-256 of lich.py: a run whose lich.py changed meanwhile measured two versions."""
    import hashlib

    with open(LICH_PY, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def print_table(results, quick):
    lines = [line for name in ROWS if name in results for line in results[name]["table"]]
    print(f"lich {lich.__version__}, Python {platform.python_version()}, {time.strftime('%Y-%m-%d')}"
          f"{' (quick)' if quick else ''}")
    if not lines:
        return True
    w0 = max(len(line[0]) for line in lines)
    w1 = max(len(line[1]) for line in lines)
    w2 = max(len(line[2]) for line in lines)
    print(f"{'measure'.ljust(w0)}  {'result'.ljust(w1)}  {'target'.ljust(w2)}  ok")
    for label, value, target, ok in lines:
        mark = "-" if ok is None else "yes" if ok else "NO"
        print(f"{label.ljust(w0)}  {value.ljust(w1)}  {target.ljust(w2)}  {mark}")
    return all(line[3] is not False for line in lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds, smaller sizes")
    parser.add_argument("--only", nargs="+", choices=list(ROWS), metavar="ROW",
                        help=f"run only these rows: {', '.join(ROWS)}")
    parser.add_argument("--old-rev", default="33defc9",
                        help="the git revision of the previous lich.py (startup row)")
    args = parser.parse_args()
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)  # for every child process: as installed
    measured = lich_digest()
    results = {"date": time.strftime("%Y-%m-%d"), "lich": lich.__version__,
               "lich_py_sha256": measured, "python": platform.python_version(),
               "machine": platform.machine(), "cpus": os.cpu_count(), "quick": args.quick}
    for name, fn in ROWS.items():
        if args.only and name not in args.only:
            continue
        print(f"running {name} ...", file=sys.stderr, flush=True)
        start = time.perf_counter()
        results[name] = fn(args)
        results[name]["row_seconds"] = time.perf_counter() - start
    results["lich_py_changed_during_run"] = lich_digest() != measured
    with open(os.path.join(HERE, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    ok = print_table(results, args.quick)
    if results["lich_py_changed_during_run"]:
        print("WARNING: lich.py changed during the run: the figures mix two versions; run again")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
