"""Writes quality_dev.jsonl and quality_heldout.jsonl from tickets.py: one
decision per line with its expected answers (python bench/data/make_sets.py)."""

import json
from pathlib import Path

from tickets import DEV, HELDOUT

QUESTIONS = {
    "team": {"type": "choice", "instructions": "Which team should handle this message?",
             "criteria": {"billing": "payments, invoices, prices, refunds",
                          "infra": "outages, errors, slowness, servers",
                          "product": "features, design, bugs in the app",
                          "account": "login, passwords, profile, security"}},
    "refund": {"type": "noul", "instructions": "Does the customer ask to get money back?"},
    "severity": {"type": "score", "instructions": "How serious is the problem for the customer?",
                 "criteria": ["low", "medium", "high"]},
}

here = Path(__file__).parent
for name, rows in (("quality_dev.jsonl", DEV), ("quality_heldout.jsonl", HELDOUT)):
    with open(here / name, "w") as f:
        for i, (state, team, refund, severity) in enumerate(rows):
            f.write(json.dumps({"id": f"{name.split('_')[1][:3]}{i:02d}", "state": state, "questions": QUESTIONS,
                                "expected": {"team": team, "refund": refund, "severity": severity}}) + "\n")
