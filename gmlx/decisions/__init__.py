"""The decision core: pure Python, no llama.cpp.

request.parse_decision validates a body into a Decision; run.admit checks it
against a Reader before queueing; run.decide answers it.
"""
