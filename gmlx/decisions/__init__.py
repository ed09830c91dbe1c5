"""The decision core: pure Python, no llama.cpp.

request.parse_decision validates a body into a Decision; run.admit checks it
against a Reader before queueing; run.decide answers it. openai.parse_openai maps a body of OpenAI's
Decisions API (POST /v1/decisions) onto the same Decision, and its answers back.
"""
