"""Canvas decisions on the tiny diffusion models, against bare llama_decode.

For 4 and 16 questions over a ~200-character state, on tiny random-weight
LLaDA and Dream GGUFs (tiny 829-token vocabulary, and Gemma's 262k vocabulary)
built into a temporary folder, it prints:

  tokens    - tokens of the decision's forwards (prompt + canvas + alignment)
  decision  - what a request costs the engine: admit() and decide() with a
              cold template cache (slot finding, prompts, its forwards, label
              log-probabilities, answers); one sample, one step
  in decode - of the decision's time, what its llama_decode calls took
  bare      - one llama_decode of the same token count (one sequence, no
              gmlx work): the floor for the same amount of model work
  ratio     - decision / bare

and, per model, the cost of 4 samples read one after another versus packed
as sequences of one llama_decode (CanvasReader.read_many). Medians of
--repeat runs.

DiffusionGemma rows (when ../shared/llama-dg/lib exists, llama.cpp with PR
#24423; run in a child process with LLAMA_CPP_LIB_PATH set): the tiny
diffusion-gemma GGUF (canvas_length 64; tiny vocabulary, and Gemma's), the
same decision vs bare columns (bare: one llama_decode of the same token count,
self-conditioning off as on a first step), then the cost of `steps` 1 / 4 / 8
on the 4-question decision (forwards run, ms, ms per forward; later steps feed
the previous step's logits back through self-conditioning).

    python bench/canvas.py [--repeat 3] [--threads 1] [--no-gemma] [--dg-only | --no-dg]
"""

from __future__ import annotations

import argparse
import copy
import os
import subprocess
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import tiny_gguf  # noqa: E402

from gmlx.config import LOAD_DEFAULTS  # noqa: E402
from gmlx.decisions.parse import parse_decision  # noqa: E402
from gmlx.decisions.decide import admit, decide  # noqa: E402
from gmlx.decisions.types import DecisionSettings, Read  # noqa: E402
from gmlx.engine.canvas import CanvasReader  # noqa: E402
from gmlx.engine.context import Entry  # noqa: E402
from gmlx.engine.model import load_model  # noqa: E402

STATE = (
    "Ticket 88213: I was charged twice for my March invoice, once on the 3rd and again on the 5th. "
    "Please refund the duplicate charge; the export page also shows a spinner forever."
)
KINDS = [
    {"type": "noul", "instructions": "Does the customer ask for a refund?"},
    {"type": "choice", "instructions": "Which team should handle the ticket?",
     "criteria": {"billing": "invoices, charges, refunds", "infra": "outages, errors, latency",
                  "product": "features, UI bugs"}},
    {"type": "score", "instructions": "How severe is the problem for the customer?",
     "criteria": ["low", "medium", "high"]},
    {"type": "noul", "instructions": "Does the customer need a reply within the hour?"},
]
SETTINGS = DecisionSettings()


def body(n: int, steps: int = 1) -> dict:
    questions = {f"q{i + 1}": copy.deepcopy(KINDS[i % len(KINDS)]) for i in range(n)}
    return {"state": STATE, "questions": questions, "samples": 1, "steps": steps}


def median_ms(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000.0)
    return statistics.median(times)


def bare_decode(reader: CanvasReader, n: int) -> None:
    toks = np.random.default_rng(0).integers(10, min(reader.n_vocab, 800), n)
    reader.ctx.decode([Entry(int(t), i, 0) for i, t in enumerate(toks)])


def bench_model(label: str, path: Path, threads: int, repeat: int, n_ctx: int) -> list[str]:
    settings = dict(LOAD_DEFAULTS)
    settings.update(n_gpu_layers=0, n_ctx=n_ctx, n_threads=threads)
    lm = load_model(label, path, settings)
    reader = CanvasReader(lm, settings)
    lines = []
    dg = lm.architecture == "diffusion-gemma"
    try:
        for n in (4, 16):
            decision = parse_decision(body(n), SETTINGS)
            admit(decision, reader, SETTINGS)
            sizes: list[int] = []
            real = reader.ctx.decode

            def spy(entries, real=real, sizes=sizes):
                sizes.append(len(entries))
                return real(entries)

            reader.ctx.decode = spy
            decide(parse_decision(body(n), SETTINGS), reader, SETTINGS, label)  # warm-up, counts tokens
            del reader.ctx.decode
            tokens = sum(sizes)

            in_decode: list[float] = []

            def timed(entries, real=real):
                t0 = time.perf_counter()
                try:
                    return real(entries)
                finally:
                    in_decode.append((time.perf_counter() - t0) * 1000.0)

            def request(n=n):
                reader._cache.clear()  # a new request's templates are found again
                d = parse_decision(body(n), SETTINGS)
                admit(d, reader, SETTINGS)
                decide(d, reader, SETTINGS, label)

            runs = []
            reader.ctx.decode = timed
            for _ in range(repeat):
                in_decode.clear()
                t0 = time.perf_counter()
                request()
                runs.append(((time.perf_counter() - t0) * 1000.0, sum(in_decode)))
            del reader.ctx.decode
            decision_ms, decode_ms = sorted(runs)[len(runs) // 2]
            if dg:
                # One forward per read: the bare floor is one decode of each read's tokens.
                reader._sc_call(None)
                bare_ms = median_ms(lambda: [bare_decode(reader, k) for k in sizes], repeat)
            else:
                bare_ms = median_ms(lambda: bare_decode(reader, tokens), repeat)
            lines.append(
                f"{label:<22} {n:>3} {len(sizes):>8} {tokens:>7} {decision_ms:>11.1f} {decode_ms:>10.1f} "
                f"{bare_ms:>9.1f} {decision_ms / bare_ms:>6.2f}"
            )
        if dg:
            for steps in (1, 4, 8):
                f0 = reader.forwards
                decide(parse_decision(body(4, steps), SETTINGS), reader, SETTINGS, label)
                forwards = reader.forwards - f0
                ms = median_ms(lambda: decide(parse_decision(body(4, steps), SETTINGS), reader, SETTINGS, label), repeat)
                lines.append(f"{label:<22} steps {steps}: {forwards} forwards, {ms:.1f} ms, "
                             f"{ms / max(1, forwards):.1f} ms per forward")
            return lines
        # 4 samples of the 4-question read: one after another vs one decode.
        decision = parse_decision(body(4), SETTINGS)
        reads = [
            Read(state=decision.state, instructions=None, questions=decision.questions, listed=decision.questions,
                 answered=(), sample=k, seed=100 + k)
            for k in range(4)
        ]
        seq_ms = median_ms(lambda: [reader.read(r) for r in reads], repeat)
        packed_ms = median_ms(lambda: reader.read_many(reads), repeat)
        lines.append(f"{label:<22} 4 samples: one by one {seq_ms:.1f} ms, packed in one decode {packed_ms:.1f} ms")
    finally:
        reader.close()
        lm.close()
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-gemma", action="store_true", help="skip the Gemma-vocabulary models (slower)")
    ap.add_argument("--dg-only", action="store_true", help="only the DiffusionGemma rows")
    ap.add_argument("--no-dg", action="store_true", help="skip the DiffusionGemma rows")
    ap.add_argument("--dg-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.dg_child:
        return dg_child(args)
    if not args.dg_only:
        main_rows(args)
    if not args.no_dg:
        lib = tiny_gguf.dg_lib_dir()
        if lib is None:
            print("DiffusionGemma: no ../shared/llama-dg/lib, rows skipped")
            return
        cmd = [sys.executable, __file__, "--dg-child", "--repeat", str(args.repeat), "--threads", str(args.threads)]
        if args.no_gemma:
            cmd.append("--no-gemma")
        sys.stdout.flush()
        subprocess.run(cmd, check=True, env={**os.environ, "LLAMA_CPP_LIB_PATH": str(lib)})


def dg_child(args) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        models = [("dgemma tiny-vocab c64", tiny_gguf.build_diffusion_gemma(d / "dg.gguf"), 2048)]
        if not args.no_gemma:
            gemma = tiny_gguf.embedded_gemma_path()
            models.append(("dgemma gemma-vocab c64", tiny_gguf.build_diffusion_gemma(d / "dg-g.gguf", vocab=gemma),
                           1024))
        print(f"DiffusionGemma (../shared/llama-dg/lib), threads {args.threads}, median of {args.repeat}")
        print(f"{'model':<22} {'q':>3} {'forwards':>8} {'tokens':>7} {'decision ms':>11} {'in decode':>10} "
              f"{'bare ms':>9} {'ratio':>6}")
        for label, path, n_ctx in models:
            for line in bench_model(label, path, args.threads, args.repeat, n_ctx):
                print(line, flush=True)


def main_rows(args) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        models = [
            ("llada tiny-vocab", tiny_gguf.build_llada(d / "llada.gguf"), 2048),
            ("dream tiny-vocab", tiny_gguf.build_dream(d / "dream.gguf"), 2048),
        ]
        if not args.no_gemma:
            gemma = tiny_gguf.embedded_gemma_path()
            models += [
                ("llada gemma-vocab", tiny_gguf.build_llada(d / "llada-g.gguf", vocab=gemma), 1024),
                ("dream gemma-vocab", tiny_gguf.build_dream(d / "dream-g.gguf", vocab=gemma), 1024),
            ]
        print(f"threads {args.threads}, median of {args.repeat}; one sample, one step per read")
        print(f"{'model':<22} {'q':>3} {'forwards':>8} {'tokens':>7} {'decision ms':>11} {'in decode':>10} "
              f"{'bare ms':>9} {'ratio':>6}")
        extra = []
        for label, path, n_ctx in models:
            lines = bench_model(label, path, args.threads, args.repeat, n_ctx)
            for line in lines:
                if "samples" in line:
                    extra.append(line)
                else:
                    print(line, flush=True)
        for line in extra:
            print(line)


if __name__ == "__main__":
    main()
