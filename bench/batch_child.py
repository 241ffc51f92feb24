"""One ``lich.run_batch`` in a process of its own, for the batch rows of bench_lich.py.

    python bench/batch_child.py --base-url http://127.0.0.1:PORT --tasks N [--workers W]
        [--executor threads|processes|dask] [--limiter N] [--out PATH] [--session-dir DIR]

The tasks are ``batch_tasks(N)``: task ``tI`` asks for I % 2 tool calls, so it takes 1 or 2
turns, against bench/loopback_server.py, whose final answer names the task. The chat is
the spec string ``openai:bench@BASE/v1`` (so each worker builds its own, as ``lich --batch``
does) and the tools are a ``lich.Tools`` holding http_clients.lookup. ``--executor``:
lich's own threads (``workers`` of them), a spawned 2-process ``ProcessPoolExecutor``, or a
Dask ``LocalCluster`` of 2 worker processes of 1 thread each on 127.0.0.1.

Prints ``started`` on a line of its own as run_batch is called (the kill row times its
SIGKILL from there), then, when the batch returns, one JSON line: ``setup_s`` (starting the
pool or cluster), ``batch_s`` (run_batch's wall time) and ``results`` (every BatchResult as
a dict).
"""

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import http_clients as clients

import lich


def batch_tasks(n, calls=None):
    """Task ``tI``: ``calls`` chat calls (default: I % 2 tool calls, so 1 or 2 turns); its
    final answer ends " [tI]"."""
    return [{"id": f"t{i}", "prompt": f"Task t{i}. {clients.user_text(calls or 1 + i % 2)}"}
            for i in range(n)]


def requests_of(n, calls=None):
    """The chat requests of a whole batch of ``batch_tasks(n, calls)``."""
    return sum(calls or 1 + i % 2 for i in range(n))


def lookup_tools():
    tools = lich.Tools()
    tools.register(clients.lookup)
    return tools


def run(args, executor=None):
    tasks = batch_tasks(args.tasks)
    limiter = lich.Limiter(max_concurrent=args.limiter) if args.limiter else None
    print("started", flush=True)
    start = time.perf_counter()
    results = lich.run_batch(tasks, chat=f"openai:bench@{args.base_url}/v1", tools=lookup_tools(),
                             workers=args.workers, executor=executor, out=args.out,
                             session_dir=args.session_dir, limiter=limiter, max_turns=5,
                             system_prompt=clients.SYSTEM_PROMPT)
    return time.perf_counter() - start, results


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--tasks", type=int, required=True)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--executor", choices=["threads", "processes", "dask"], default="threads")
    parser.add_argument("--limiter", type=int, default=None, help="Limiter(max_concurrent=N)")
    parser.add_argument("--out")
    parser.add_argument("--session-dir")
    args = parser.parse_args()
    start = time.perf_counter()
    if args.executor == "threads":
        setup = time.perf_counter() - start
        took, results = run(args)
    elif args.executor == "processes":
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
            list(pool.map(int, range(4)))  # both processes up
            setup = time.perf_counter() - start
            took, results = run(args, pool)
    else:
        import logging

        from dask.distributed import Client, LocalCluster

        with tempfile.TemporaryDirectory(prefix="lich-bench-dask-") as scratch, \
                LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                             dashboard_address="127.0.0.1:0", silence_logs=logging.CRITICAL,
                             local_directory=scratch) as cluster, Client(cluster) as client:
            workers = client.scheduler_info()["workers"]
            assert all(a.startswith("tcp://127.0.0.1:") for a in workers), workers
            setup = time.perf_counter() - start
            took, results = run(args, client.get_executor())
    print(json.dumps({"setup_s": setup, "batch_s": took,
                      "results": [asdict(r) for r in results]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
