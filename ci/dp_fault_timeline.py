"""The fault timeline of a data-parallel server: SIGKILL one rank's engine core mid-stream.

Starts ``engine serve MODEL -dp 2 [EXTRA...]``, opens ``--streams`` long completions
streams, kills the engine core of ``--rank`` after ``--after`` seconds, and prints when each
stream ended (normally, with an OpenAI error event, or with a broken connection), whether
``/health`` still answers, and when the server process exited, all in seconds after the
kill. Usage::

    python ci/dp_fault_timeline.py /tmp/engine-bench-models/llama-tiny
    python ci/dp_fault_timeline.py /tmp/engine-bench-models/mixtral-small \\
        --extra "--enable-expert-parallel"
    python ci/dp_fault_timeline.py MODEL --extra "--data-parallel-on-rank-failure continue"
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import threading
import time

import httpx


def core_pids(server_pid: int) -> dict[int, int]:
    """DP rank -> pid of the server's engine-core processes (from their log prefix env)."""
    ranks = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"engine.core.core_proc" not in f.read():
                    continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
            with open(f"/proc/{pid}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
        tag = env.get(b"ENGINE_DP_RANK_TAG", b"").decode()
        if parent == server_pid and tag.startswith("_DP"):
            ranks[int(tag[3:])] = int(pid)
    return ranks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--extra", default="", help="more `engine serve` flags")
    parser.add_argument("--rank", type=int, default=1, help="the rank whose core is killed")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--after", type=float, default=3.0, help="seconds of streaming first")
    parser.add_argument("--port", type=int, default=8231)
    args = parser.parse_args()
    base = f"http://127.0.0.1:{args.port}"
    command = [sys.executable, "-m", "engine.cli", "serve", args.model, "--port",
               str(args.port), "-dp", "2", *shlex.split(args.extra)]
    log = open(f"/tmp/dp_fault_timeline_{args.port}.log", "w")  # noqa: SIM115 - the server's
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        for _ in range(600):
            try:
                httpx.get(f"{base}/v1/models", timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.2)
        name = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]
        events: dict[str, tuple[float, str]] = {}

        def stream(i: int) -> None:
            body = {"model": name, "prompt": [5] * 32, "max_tokens": 1000,
                    "ignore_eos": True, "stream": True}
            try:
                with httpx.stream("POST", f"{base}/v1/completions", json=body,
                                  timeout=120) as response:
                    for line in response.iter_lines():
                        if line.startswith("data:") and '"error"' in line:
                            events[f"stream {i}"] = (time.monotonic(), line[6:130])
                            return
                events[f"stream {i}"] = (time.monotonic(), "finished normally")
            except httpx.HTTPError as exc:
                events[f"stream {i}"] = (time.monotonic(), f"connection: {exc!r}"[:120])

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(args.streams)]
        for thread in threads:
            thread.start()
        time.sleep(args.after)
        victim = core_pids(server.pid)[args.rank]
        killed = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        time.sleep(0.5)
        try:
            health = httpx.get(f"{base}/health", timeout=2).status_code
        except httpx.HTTPError as exc:
            health = repr(exc)[:60]
        for thread in threads:
            thread.join(120)
        try:
            code = server.wait(30)
            exited = f"exited {code} at {time.monotonic() - killed:.2f} s"
        except subprocess.TimeoutExpired:
            exited = "still serving 30 s after the kill"
        print(f"killed rank {args.rank} (pid {victim}); /health 0.5 s later: {health}")
        for key, (when, what) in sorted(events.items()):
            print(f"{key}: {when - killed:+.3f} s  {what}")
        print(f"server {exited}")
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGINT)
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                server.kill()


if __name__ == "__main__":
    main()
