"""DiffusionGemma canvas reads on llama.cpp's real diffusion-gemma graph (PR #24423).

The llama.cpp bundled with llama-cpp-python 0.3.36 lacks the architecture;
../shared/llama-dg/lib has it. The binding reads LLAMA_CPP_LIB_PATH once, at
import, so the checks run in a child process (this file run as a script, with
the variable set) that writes its measurements as JSON; the tests below assert
on them. They run, not skip, whenever ../shared/llama-dg/lib exists.

Models: tiny random-weight diffusion-gemma GGUFs from tests/tiny_gguf.py
(canvas_length 64), one with the `diffusion.eb_*` keys and one without.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import tiny_gguf  # noqa: E402

CANVAS = 64
needs_dg = pytest.mark.skipif(tiny_gguf.dg_lib_source() is None, reason="no ../shared/llama-dg/lib")


# ---------------------------------------------------------------------------------------
# The child process


def _child(eb_path: str, noeb_path: str) -> dict:
    import numpy as np

    from gmlx.config import LOAD_DEFAULTS
    from fake_reader import ticket_body
    from gmlx.decisions.parse import parse_decision
    from gmlx.decisions.decide import decide
    from gmlx.decisions.types import DecisionSettings, Read
    from gmlx.engine import canvas as canvas_mod
    from gmlx.engine import open_reader
    from gmlx.engine.canvas import CanvasReader
    from gmlx.engine.gguf_info import llama_supports_arch
    from gmlx.engine.model import load_model
    from gmlx.errors import GmlxError

    settings_ = DecisionSettings()
    out: dict = {}

    def cfg(**over):
        s = dict(LOAD_DEFAULTS)
        s.update(n_gpu_layers=0, n_ctx=1024, n_threads=1)
        s.update(over)
        return s

    def decision(body):
        return parse_decision(body, settings_)

    def one_q(seed=7, steps=1, **top):
        body = {
            "state": "The customer says: hello, I love your product!",
            "questions": {"happy": {"type": "noul", "instructions": "Is the customer happy?"},
                          "team": {"type": "choice", "instructions": "Which team?",
                                   "criteria": {"billing": "money", "infra": "servers", "product": "UI"}}},
            "samples": 1, "seed": seed, "steps": steps,
        }
        body.update(top)
        return body

    def a_read(reader, body) -> Read:
        """The first read the decision core would make for `body`."""
        reads: list[Read] = []
        real = reader.read_many

        def spy(rs):
            reads.extend(rs)
            return real(rs)

        reader.read_many = spy
        reader.read = lambda r: spy([r])[0]
        try:
            decide(decision(body), reader, settings_, "dg")
        finally:
            del reader.read_many
            del reader.read
        return reads[0]

    def logprobs(result):
        return {k: list(v.logprobs) for k, v in result.slots.items()}

    out["supports_arch"] = llama_supports_arch("diffusion-gemma")
    lm = load_model("dg", Path(eb_path), cfg())
    out["describe"] = {k: lm.describe()[k] for k in ("architecture", "strategy", "canvas_length")}
    out["shift_logits"] = lm.shift_logits
    reader = open_reader(lm, cfg(), canvas=64)
    out["reader"] = {"type": type(reader).__name__, "fixed_width": reader.fixed_width, "parallel": reader.parallel,
                     "schedule": reader.schedule.__dict__, "diagnostics": reader.diagnostics(),
                     "can_think": reader.can_think}

    # Every batch handed to llama_decode, recorded.
    batches: list[list] = []
    real_decode = reader.ctx.decode

    def rec(entries):
        batches.append([(e.token, e.pos, e.seq) for e in entries])
        return real_decode(entries)

    reader.ctx.decode = rec

    # -- placement: one forward, prompt then exactly canvas_length canvas tokens --------
    read = a_read(reader, one_q())
    prompt, template = reader.layout(read)
    batches.clear()
    f0 = reader.forwards
    res = reader.read(read)
    fed = batches[-1]
    out["placement"] = {
        "forwards": reader.forwards - f0,
        "batch_len": len(fed),
        "prompt_len": len(prompt),
        "seqs": sorted({s for _, _, s in fed}),
        "positions_ok": [p for _, p, _ in fed] == list(range(len(fed))),
        "canvas_is_tail": [t for t, _, _ in fed][len(prompt):] == reader.last_trace[0][0],
        "template_at_canvas_start": reader.last_trace[0][0][: template.rows] == [
            t if i not in {s.pos for s in template.slots} else reader.last_trace[0][0][i]
            for i, t in enumerate(template.tokens)],
        "slot_pos": [s.pos for s in template.slots],
        "rows": template.rows,
        "sums": {k: float(np.exp(v).sum()) for k, v in logprobs(res).items()},
    }
    # The graph's own split: prompt rows are causal and never see the canvas; canvas rows
    # see everything. Changing one slot token must leave every prompt row as it was and
    # move the canvas rows before the slot (non-causal within the canvas).
    toks = [t for t, _, _ in fed]
    rows_a = reader.ctx.logits_rows(0, len(toks)).copy()
    slot = len(prompt) + template.slots[0].pos
    alt = list(toks)
    alt[slot] = next(i for i in template.slots[0].label_ids if i != toks[slot])
    reader._forward([alt])
    rows_b = reader.ctx.logits_rows(0, len(toks)).copy()
    out["graph_split"] = {
        "prompt_rows_equal": bool(np.array_equal(rows_a[: len(prompt)], rows_b[: len(prompt)])),
        "canvas_first_row_moved": float(np.abs(rows_a[len(prompt)] - rows_b[len(prompt)]).max()),
        "last_row_moved": float(np.abs(rows_a[-1] - rows_b[-1]).max()),
    }
    # The first step as llama.cpp's driver runs it (self-conditioning graph on, gate 0, a
    # zero buffer) gives the numbers of gmlx's first step (block left out), bitwise.
    import ctypes

    from gmlx.engine.context import Entry

    zero = np.zeros((CANVAS, lm.n_vocab), dtype=np.float32)
    reader._forward([toks])
    rows_off = reader.ctx.logits_rows(0, len(toks)).copy()
    reader._set_sc(lm.model, zero.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 0.0, 1.0, True)
    real_decode([Entry(int(t), j, 0) for j, t in enumerate(toks)])
    rows_gate0 = reader.ctx.logits_rows(0, len(toks)).copy()
    # ... and a gate of 1 with the same (zero) logits is a different graph input.
    reader._set_sc(lm.model, zero.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1.0, 1.0, True)
    real_decode([Entry(int(t), j, 0) for j, t in enumerate(toks)])
    rows_gate1 = reader.ctx.logits_rows(0, len(toks)).copy()
    out["graph_split"]["driver_first_step_equal"] = bool(np.array_equal(rows_off, rows_gate0))
    out["graph_split"]["gate1_moves_canvas"] = float(np.abs(rows_off[len(prompt):] - rows_gate1[len(prompt):]).max())
    out["graph_split"]["gate1_keeps_prompt"] = bool(np.array_equal(rows_off[: len(prompt)], rows_gate1[: len(prompt)]))
    # A prompt token moved only changes rows from its position on.
    alt2 = list(toks)
    alt2[len(prompt) - 3] = toks[len(prompt) - 2]
    reader._forward([alt2])
    rows_c = reader.ctx.logits_rows(0, len(toks)).copy()
    out["graph_split"]["rows_before_prompt_change_equal"] = bool(
        np.array_equal(rows_a[: len(prompt) - 3], rows_c[: len(prompt) - 3]))
    out["graph_split"]["canvas_moved_by_prompt"] = float(np.abs(rows_a[len(prompt):] - rows_c[len(prompt):]).max())

    # -- determinism and seeds ------------------------------------------------------------
    again = reader.read(read)
    out["determinism"] = {"same": logprobs(res) == logprobs(again)}
    other = reader.read(a_read(reader, one_q(seed=8)))
    out["determinism"]["seed_moves"] = logprobs(res) != logprobs(other)
    out["determinism"]["slot_tokens_seed_1_vs_2"] = [
        reader._job(a_read(reader, one_q(seed=s))).canvas[:template.rows] for s in (1, 2)]

    # -- one forward per read in a whole decision ----------------------------------------
    f0, n0 = reader.forwards, len(batches)
    resp = decide(decision(ticket_body(seed=5, samples=2)), reader, settings_, "dg")
    out["decision"] = {
        "forwards": reader.forwards - f0,
        "reads": resp["diagnostics"]["timing"]["reads"],
        "batch_lens_minus_prompt": sorted({len(b) for b in batches[n0:]}),
        "answers": {k: (v and v["probabilities"]) for k, v in resp["answers"].items()},
        "strategy": resp["diagnostics"]["strategy"],
    }
    out["decision"]["max_batch"] = max(len(b) for b in batches[n0:])

    # -- steps > 1 with the GGUF's entropy-bound parameters ---------------------------------
    read4 = a_read(reader, one_q(steps=4))
    f0 = reader.forwards
    r4 = reader.read(read4)
    out["steps_eb"] = {"forwards": reader.forwards - f0, "trace_len": len(reader.last_trace[0]),
                       "sc_forwards": reader.sc_forwards,
                       "finite": all(np.isfinite(v).all() for v in logprobs(r4).values()),
                       "sums": [float(np.exp(v).sum()) for v in logprobs(r4).values()]}
    r4b = reader.read(read4)
    out["steps_eb"]["same"] = logprobs(r4) == logprobs(r4b)

    # -- self-conditioning: first step equal, second step differs -------------------------
    nosc = CanvasReader(lm, cfg(), canvas=64, self_conditioning=False)
    out["sc"] = {"diag_on": reader.diagnostics(), "diag_turned_off": nosc.diagnostics()}
    r1_sc, r1_no = reader.read(read), nosc.read(read)
    out["sc"]["step1_equal"] = logprobs(r1_sc) == logprobs(r1_no)
    read2 = a_read(reader, one_q(steps=2, seed=11))
    r2_sc = reader.read(read2)
    trace_sc = reader.last_trace[0]
    r2_no = nosc.read(read2)
    trace_no = nosc.last_trace[0]
    out["sc"]["step2_same_canvas"] = trace_sc == trace_no and len(trace_sc) == 2
    out["sc"]["step2_differs"] = logprobs(r2_sc) != logprobs(r2_no)
    out["sc"]["step2_max_diff"] = max(
        abs(a - b) for k in logprobs(r2_sc) for a, b in zip(logprobs(r2_sc)[k], logprobs(r2_no)[k]))
    r2_sc_again = reader.read(read2)
    out["sc"]["step2_sc_deterministic"] = logprobs(r2_sc) == logprobs(r2_sc_again)
    nosc.close()
    # A library without llama_diffusion_set_sc: self-conditioning off, and said so.
    saved = canvas_mod.diffusion_set_sc
    saved(lm)(lm.model, None, 0.0, 1.0, False)  # the model as such a library leaves it
    canvas_mod.diffusion_set_sc = lambda lm_: None
    try:
        lacking = CanvasReader(lm, cfg(), canvas=64)
        out["sc"]["diag_missing"] = lacking.diagnostics()
        out["sc"]["missing_step2_equals_off"] = logprobs(lacking.read(read2)) == logprobs(r2_no)
        lacking.close()
    finally:
        canvas_mod.diffusion_set_sc = saved

    # -- thought then read ----------------------------------------------------------------
    f0 = reader.forwards
    body = one_q(seed=3, think=8)
    resp = decide(decision(body), reader, settings_, "dg")
    th = resp["diagnostics"]["thought"]
    out["think"] = {"thought": th and {k: th[k] for k in ("tokens", "closed")}, "forwards": reader.forwards - f0,
                    "answers": sorted(resp["answers"]),
                    "sums": [sum(v["probabilities"].values()) for v in resp["answers"].values() if v]}

    # -- guards: clear 400s, never an abort -----------------------------------------------
    def status_of(fn):
        try:
            fn()
        except GmlxError as err:
            return {"status": err.status, "message": str(err)}
        return {"status": 200}

    small_ub = CanvasReader(lm, cfg(n_ubatch=48), canvas=64)
    out["guard_ubatch"] = status_of(lambda: small_ub.check(decision(one_q())))
    small_ub.close()
    small_ctx = CanvasReader(lm, cfg(n_ctx=256), canvas=64)
    long_state = "The customer writes a long message about many things. " * 40
    out["guard_ctx"] = status_of(lambda: small_ctx.check(decision(one_q(state=long_state))))
    out["guard_ctx_think"] = status_of(lambda: small_ctx.check(decision(one_q(think=200))))
    big = CanvasReader(lm, cfg(n_ctx=4096), canvas=64)
    long_read = a_read(big, one_q(state=long_state))
    big.close()
    out["guard_ctx_read"] = status_of(lambda: small_ctx.read(long_read))
    small_ctx.close()
    out["alive_after_guards"] = logprobs(reader.read(read)) == logprobs(res)
    reader.close()
    lm.close()

    # -- the GGUF without diffusion.eb_*: the sampler's defaults ----------------------------
    from gmlx.engine.denoise import Schedule

    lm2 = load_model("dg-noeb", Path(noeb_path), cfg())
    r2 = CanvasReader(lm2, cfg(), canvas=64)
    rd = a_read(r2, one_q(steps=4))
    f0 = r2.forwards
    res4 = r2.read(rd)
    out["steps_default"] = {"schedule": r2.schedule.__dict__, "is_default": r2.schedule == Schedule(),
                            "forwards": r2.forwards - f0,
                            "finite": all(np.isfinite(v).all() for v in logprobs(res4).values())}
    r2.close()
    lm2.close()
    return out


# ---------------------------------------------------------------------------------------
# The tests


@pytest.fixture(scope="module")
def dg(tmp_path_factory):
    d = tmp_path_factory.mktemp("dg")
    eb = tiny_gguf.build_diffusion_gemma(d / "dg-eb.gguf", canvas_length=CANVAS)
    noeb = tiny_gguf.build_diffusion_gemma(d / "dg-noeb.gguf", canvas_length=CANVAS, eb_keys=False)
    r = subprocess.run([sys.executable, __file__, str(eb), str(noeb)], capture_output=True, text=True,
                       timeout=600, env=tiny_gguf.dg_env(), cwd=str(HERE.parent))
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_builder_writes_both_variants(tmp_path):
    from gmlx.engine.gguf_info import read_info

    a = tiny_gguf.build_diffusion_gemma(tmp_path / "a.gguf")
    b = tiny_gguf.build_diffusion_gemma(tmp_path / "b.gguf")
    c = tiny_gguf.build_diffusion_gemma(tmp_path / "c.gguf", eb_keys=False)
    assert a.read_bytes() == b.read_bytes()
    info = read_info(a)
    assert (info.architecture, info.canvas_length) == ("diffusion-gemma", 64)
    meta = tiny_gguf.read_gguf_metadata(a, prefix="diffusion.")
    assert meta["diffusion.eb_max_steps"] == 6 and set(tiny_gguf.DG_EB_KEYS) <= set(meta)
    assert not [k for k in tiny_gguf.read_gguf_metadata(c, prefix="diffusion.") if k.startswith("diffusion.eb_")]
    toks = tiny_gguf.read_gguf_metadata(a, prefix="tokenizer.ggml.tokens")["tokenizer.ggml.tokens"]
    for piece in (b"<start_of_turn>", b"<end_of_turn>", b"<|channel>", b"<channel|>", b"<mask>"):
        assert piece in toks


@needs_dg
def test_load_architecture_and_strategy(dg):
    assert dg["supports_arch"] is True
    assert dg["describe"] == {"architecture": "diffusion-gemma", "strategy": "canvas", "canvas_length": CANVAS}
    assert dg["shift_logits"] is False
    r = dg["reader"]
    assert r["type"] == "CanvasReader" and r["fixed_width"] == CANVAS and r["parallel"] == 1
    assert r["can_think"] is True
    assert r["diagnostics"] == {"self_conditioning": "on"}


@needs_dg
def test_canvas_is_the_last_canvas_length_tokens_of_one_forward(dg):
    p = dg["placement"]
    assert p["forwards"] == 1
    assert p["batch_len"] == p["prompt_len"] + CANVAS  # no filler, no alignment padding
    assert p["seqs"] == [0] and p["positions_ok"]
    assert p["canvas_is_tail"] and p["template_at_canvas_start"]
    assert all(0 <= s < p["rows"] for s in p["slot_pos"])
    for total in p["sums"].values():
        assert total < 1.0 + 1e-6  # label probabilities over the full vocabulary


@needs_dg
def test_graph_split_matches_the_placement(dg):
    g = dg["graph_split"]
    assert g["prompt_rows_equal"]  # the prompt never sees the canvas
    assert g["canvas_first_row_moved"] > 0  # canvas rows see later canvas tokens
    assert g["last_row_moved"] > 0
    assert g["rows_before_prompt_change_equal"]  # the prompt is causal
    assert g["canvas_moved_by_prompt"] > 0
    # Self-conditioning acts on the canvas embeddings only; gated off it adds exactly 0.
    assert g["driver_first_step_equal"] is True
    assert g["gate1_moves_canvas"] > 0 and g["gate1_keeps_prompt"] is True


@needs_dg
def test_determinism_and_seed(dg):
    d = dg["determinism"]
    assert d["same"] is True
    assert d["seed_moves"] is True
    a, b = d["slot_tokens_seed_1_vs_2"]
    assert len(a) == len(b) and a != b


@needs_dg
def test_one_forward_per_read_in_a_decision(dg):
    d = dg["decision"]
    assert d["strategy"] == "canvas"
    assert d["forwards"] == d["reads"] >= 2
    assert d["max_batch"] <= 1024
    for probs in d["answers"].values():
        if probs is not None:
            assert abs(sum(probs.values()) - 1) < 1e-6


@needs_dg
def test_steps_with_the_ggufs_entropy_bound_parameters(dg):
    sched = dg["reader"]["schedule"]
    assert sched == {"t_min": 0.3, "t_max": 0.9, "entropy_bound": 0.5, "stability": 2, "confidence": 0.01,
                     "max_steps": 6}
    s = dg["steps_eb"]
    assert 1 <= s["forwards"] <= 4 and s["trace_len"] == s["forwards"]
    assert s["finite"] and s["same"]
    assert s["sc_forwards"] >= s["forwards"] - 1


@needs_dg
def test_steps_with_the_default_parameters(dg):
    s = dg["steps_default"]
    assert s["is_default"] is True
    assert s["schedule"]["max_steps"] == 48 and s["schedule"]["t_max"] == 0.8
    assert 1 <= s["forwards"] <= 4 and s["finite"]


@needs_dg
def test_self_conditioning_changes_step_two_only(dg):
    s = dg["sc"]
    assert s["diag_on"] == {"self_conditioning": "on"}
    assert s["diag_turned_off"]["self_conditioning"].startswith("off")
    assert s["step1_equal"] is True  # gated off on the first step
    assert s["step2_same_canvas"] is True  # the same canvases were fed ...
    assert s["step2_differs"] is True and s["step2_max_diff"] > 1e-4  # ... and SC moved the logits
    assert s["step2_sc_deterministic"] is True


@needs_dg
def test_a_library_without_set_sc_runs_with_it_off_and_says_so(dg):
    s = dg["sc"]
    assert s["diag_missing"] == {"self_conditioning": "off (this llama.cpp has no llama_diffusion_set_sc)"}
    assert s["missing_step2_equals_off"] is True


@needs_dg
def test_thought_then_read(dg):
    t = dg["think"]
    assert t["thought"] is not None and 0 <= t["thought"]["tokens"] <= 8
    assert t["forwards"] >= 2  # the thought's denoise forwards, then the reads
    assert t["answers"] == ["happy", "team"]
    assert all(abs(x - 1) < 1e-6 for x in t["sums"])


@needs_dg
def test_guards_are_clear_400s(dg):
    ub = dg["guard_ubatch"]
    assert ub["status"] == 400 and "canvas_length 64" in ub["message"] and "n_ubatch" in ub["message"]
    for key in ("guard_ctx", "guard_ctx_think", "guard_ctx_read"):
        assert dg[key]["status"] == 400, (key, dg[key])
        assert "n_ctx" in dg[key]["message"]
    assert dg["alive_after_guards"] is True


if __name__ == "__main__":
    import logging

    logging.disable(logging.CRITICAL)
    os.environ.setdefault("GGML_NO_BACKTRACE", "1")
    result = _child(sys.argv[1], sys.argv[2])
    print(json.dumps(result))
