"""The decision core: pure Python, no llama.cpp.

A decision flows one way through five steps, one file each; `decide.py` holds
the two entry points (`admit`, `decide`) and runs the steps in order:

1. **parse** - `parse.parse_decision` (and `openai.parse_openai` for OpenAI's
   Decisions API) validates a body into a `types.Decision`; `questions.py`,
   `labels.py` and `fields.py` check its parts.
2. **plan** - `plan.make_plan` orders the questions into stages (`ask_if`,
   dependencies) and `plan.chunk_stage` splits a stage into canvas chunks;
   `decide.admit` runs every check that can be done before queueing.
3. **read** - `read.run_pass` walks the plan stage by stage; for each chunk
   `sampling.read_chunk` asks the `Reader` (the engine, behind the protocol in
   `types.py`) for one distinct read per sample, each question listed in its
   balanced order (`orders.py`), and `calibration.py` reads the content-free
   priors. `seeds.py` derives every seed.
4. **aggregate** - `sampling.py` maps each read back to option names (and
   divides by the prior); `aggregate.py` averages the distinct reads into
   answers and diagnostics, with the label math in `stats.py`. Each chunk is
   aggregated as soon as it is read: a later stage depends on its answers.
5. **respond** - `respond.respond` builds the response body from the passes
   (two for think "auto"): answers, usage, diagnostics.

Prompt text lives in `prompts.py` (next-token) and `canvas_text.py` (canvas);
`literal.py` marks the caller's text so it is tokenized as plain text.
"""
