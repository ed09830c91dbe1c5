"""Property and fuzz tests of the decision routes against a real `gmlx serve`.

SPEC 5: "No input, however malformed, produces a 500 or kills the server."
Every generated request here must be answered 200 or a documented 4xx in the
SPEC 5 envelope, and the server process must stay alive.

- schemathesis, driven by the server's own `/openapi.json` (the decision
  routes document their bodies: gmlx/server/schema.py), generates bodies that
  fit the schema (positive) and bodies that break it (negative) for
  `/v1/systemone`, `/systemone` and `/v1/decisions`. Each generated body is
  sent twice, as plain JSON and compressed (gzip or zstd, alternating): the
  two must get the same status, and for a 200 the same answers (a decision is
  deterministic, SPEC 4.5). schemathesis also checks every response against
  the documented status codes, content types and response schemas.
- hypothesis strategies of our own mutate valid bodies (a value replaced,
  a field dropped, junk added) and send raw bytes with assorted headers.
- In-process properties of the body decoders: any bytes -> bytes or a
  SPEC 5 error, never another exception.

The bulk runs against a tiny random Qwen3 GGUF (next-token, fast), a smaller
number against the embedded Gemma 3 270M. `max_questions: 8`,
`max_samples: 2` and `n_ctx: 512` keep every decision short; the server's
own counters (/health) confirm the request count and that no 500 happened.
"""

from __future__ import annotations

import collections
import gzip
import json
import math
import sys
import zlib
from pathlib import Path
from typing import Any

import httpx
import pytest
import zstandard
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parent))

import tiny_gguf  # noqa: E402
from server_harness import start  # noqa: E402

from fake_reader import ticket_body  # noqa: E402
from gmlx.errors import GmlxError  # noqa: E402
from gmlx.server import body as bodies  # noqa: E402

schemathesis = pytest.importorskip("schemathesis")
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import load_all_checks  # noqa: E402

LIMIT = 262144
MAX_QUESTIONS = 8

# SPEC 5: the error types each documented 4xx may carry.
TYPES = {
    400: {"invalid_request_error", "unknown_profile", "no_model_specified"},
    404: {"model_not_found", "model_file_missing"},
    413: {"request_too_large"},
    415: {"unsupported_media_type"},
    422: {"validation_error"},
}
ALLOWED = {200, *TYPES}

# Requests sent by this module, by route (compared with the server's own count);
# RAW: those sent over a bare socket with a lying Content-Length.
SENT: collections.Counter[str] = collections.Counter()
RAW: collections.Counter[str] = collections.Counter()
STATUSES: collections.Counter[tuple[str, int]] = collections.Counter()
FUZZ_TESTS = {"schemathesis", "schemathesis_gemma", "mutations", "raw_bytes"}
RAN: set[str] = set()
MIN_REQUESTS = 2000

FUZZ = settings(
    deadline=None,
    database=None,
    phases=[Phase.explicit, Phase.generate, Phase.shrink],
    suppress_health_check=list(HealthCheck),
    print_blob=True,
)


@pytest.fixture(scope="module")
def server(tmp_path_factory, gemma_path):
    d = tmp_path_factory.mktemp("fuzz")
    tiny = tiny_gguf.build_qwen3(d / "qwen3-tiny.gguf")
    config = {
        "models": {
            "tiny": {"path": str(tiny), "n_ctx": 512},
            "gemma": {"path": str(gemma_path), "n_ctx": 512},
        },
        "profiles": {"fast": {"n_ctx": 256}},
        "server": {
            "systemone": {"model": "tiny", "max_questions": MAX_QUESTIONS, "max_samples": 2},
            "max_queue": 8,
            "max_body_bytes": LIMIT,
            "token_queue_timeout_s": 60,
        },
    }
    s = start(d, config, preload=True)
    s.client = httpx.Client(base_url=s.url, timeout=60)
    yield s
    s.client.close()
    s.stop()


@pytest.fixture(scope="module")
def api_schema(server):
    """The server's own OpenAPI schema, as schemathesis loads it."""
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    load_all_checks()
    return schema


# -- checks ------------------------------------------------------------------------------

def alive(server) -> None:
    assert server.proc.poll() is None, f"gmlx serve died ({server.proc.returncode}):\n{server.log()[-3000:]}"


def check(r: httpx.Response, route: str) -> Any:
    """200 with a well-formed decision, or a documented 4xx in the SPEC 5 envelope."""
    assert r.status_code in ALLOWED, (r.status_code, r.text[:2000])
    assert r.headers.get("x-request-id"), dict(r.headers)
    assert r.headers["content-type"].startswith("application/json"), r.headers
    body = r.json()
    if r.status_code != 200:
        assert set(body) == {"error"}, body
        err = body["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
        assert isinstance(err["message"], str) and err["message"], err
        assert err["type"] in TYPES[r.status_code], err
        assert err["param"] is None or isinstance(err["param"], str), err
        # /v1/decisions' own 400s carry OpenAI's string codes, everything else the status.
        if not (route == "decisions" and r.status_code == 400 and isinstance(err["code"], str)):
            assert err["code"] == r.status_code, err
        return body
    if route == "decisions":
        assert set(body) == {"model", "answers", "usage"}, body
        assert all(isinstance(v, int) for k, v in body["usage"].items() if k.endswith("tokens")), body["usage"]
        for a in body["answers"]:
            assert a["type"] in ("predicate", "choice", "score"), a
            if a["type"] == "predicate":
                assert 0.0 <= a["probability"] <= 1.0, a
            else:
                assert math.isclose(sum(p["probability"] for p in a["probabilities"]), 1.0, abs_tol=1e-6), a
        return body
    assert body["object"] == "structured_decision", body
    assert r.headers["x-request-id"] == body["id"]
    assert all(isinstance(v, int) for v in body["usage"].values()), body["usage"]
    for a in body["answers"].values():
        if a is None:
            continue
        assert a["type"] in ("noul", "choice", "score"), a
        if "probabilities" in a:
            assert math.isclose(sum(a["probabilities"].values()), 1.0, abs_tol=1e-6), a
        if a["type"] == "noul":
            assert 0.0 <= a["noul"] <= 1.0, a
    return body


def route_of(path: str) -> str:
    return "decisions" if path == "/v1/decisions" else "systemone"


def encode(body: Any) -> bytes:
    if isinstance(body, (bytes, bytearray)):
        return bytes(body)
    if type(body).__name__ == "NotSet":  # schemathesis: no body at all
        return b""
    return json.dumps(body, ensure_ascii=False).encode("utf-8", "surrogatepass")


def compress(data: bytes, coding: str) -> bytes:
    return gzip.compress(data) if coding == "gzip" else zstandard.ZstdCompressor().compress(data)


def post(server, path: str, data: bytes, headers: dict[str, str] | None = None) -> httpx.Response:
    SENT[path] += 1
    r = server.client.post(path, content=data, headers={"Content-Type": "application/json", **(headers or {})})
    alive(server)
    STATUSES[path, r.status_code] += 1
    return r


def send_case(server, case, coding: str) -> None:
    """One generated body, plain and compressed: the same status (and answers)."""
    path = case.operation.path
    route = route_of(path)
    data = encode(case.body)
    plain = post(server, path, data)
    first = check(plain, route)
    # schemathesis' own checks: documented status, content type and response schema.
    case.validate_response(plain, checks=CHECKS)
    packed = post(server, path, compress(data, coding), {"Content-Encoding": coding})
    second = check(packed, route)
    assert packed.status_code == plain.status_code, (plain.text[:500], packed.text[:500])
    if plain.status_code == 200:
        assert second["answers"] == first["answers"]
    else:
        assert second["error"]["type"] == first["error"]["type"]


def _checks():
    from schemathesis.specs.openapi import checks as oc

    return [oc.status_code_conformance, oc.content_type_conformance, oc.response_schema_conformance]


CHECKS = _checks()


# -- schemathesis --------------------------------------------------------------------------

# (path, mode, examples): about two thirds of the budget fits the schema, so
# that most bodies reach the model; the negative ones break it on purpose.
PLAN = [
    ("/v1/systemone", "positive", 260),
    ("/v1/systemone", "negative", 140),
    ("/systemone", "positive", 40),
    ("/v1/decisions", "positive", 220),
    ("/v1/decisions", "negative", 110),
]


@pytest.mark.parametrize(("path", "mode", "examples"), PLAN, ids=[f"{p}-{m}" for p, m, _ in PLAN])
def test_schemathesis(server, api_schema, path, mode, examples):
    op = api_schema[path]["POST"]
    codings = iter(["gzip", "zstd"] * examples)

    @settings(FUZZ, max_examples=examples)
    @given(case=op.as_strategy(GenerationMode(mode)))
    def run(case):
        send_case(server, case, next(codings, "gzip"))

    run()
    RAN.add("schemathesis")


@pytest.mark.parametrize("path", ["/v1/systemone", "/v1/decisions"])
def test_schemathesis_gemma(server, api_schema, path):
    """Fewer bodies on the embedded Gemma: every positive body names it."""
    op = api_schema[path]["POST"]

    @settings(FUZZ, max_examples=20)
    @given(case=op.as_strategy(GenerationMode.POSITIVE))
    def run(case):
        if isinstance(case.body, dict):
            case.body["model"] = "gemma"
        r = post(server, path, encode(case.body))
        body = check(r, route_of(path))
        if r.status_code == 200:
            assert body["model"] == "gemma"
        case.validate_response(r, checks=CHECKS)

    run()
    RAN.add("schemathesis_gemma")


# -- our own strategies: mutations of valid bodies ---------------------------------------

json_leaf = (
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12) | st.sampled_from(["auto", "", "yes", "q0", "../../etc/passwd", "gemma", "fast"])
    # Lone UTF-16 surrogates: JSON can escape them ("\ud800"), UTF-8 cannot carry them.
    | st.text(st.characters(codec=None, categories=["Cs", "Ll"]), min_size=1, max_size=4)
)
json_value = st.recursive(json_leaf, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3),
                          max_leaves=8)

OPENAI_VALID = {
    "input": [{"role": "user", "content": [{"type": "input_text", "text": "My parcel arrived broken."}]}],
    "questions": [
        {"type": "predicate", "name": "damaged", "instructions": "Is the item damaged?"},
        {"type": "choice", "instructions": "Which desk?", "choices": [{"value": "returns"}, {"value": True}]},
        {"type": "score", "instructions": "How bad?", "levels": [{"label": "low"}, {"label": "high"}]},
    ],
}
SYSTEMONE_VALID = ticket_body(samples=1)


def _paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, prefix + (i,))
    return out


@st.composite
def mutated(draw) -> tuple[str, Any]:
    """A valid body of either route with 1..3 mutations at random places."""
    path = draw(st.sampled_from(["/v1/systemone", "/v1/decisions"]))
    body = json.loads(json.dumps(SYSTEMONE_VALID if path == "/v1/systemone" else OPENAI_VALID))
    for _ in range(draw(st.integers(1, 3))):
        where = draw(st.sampled_from(_paths(body)))
        if not where:
            continue
        *parent_path, key = where
        parent = body
        for p in parent_path:
            parent = parent[p]
        action = draw(st.sampled_from(["replace", "drop", "add", "duplicate", "text"]))
        if action == "text" and isinstance(parent[key], str):
            # Odd characters inside a string the server reads: a lone surrogate, NUL, RTL marks, emoji.
            odd = draw(st.text(st.characters(codec=None, categories=["Cs", "Cc", "Cf", "So"]), min_size=1, max_size=3))
            at = draw(st.integers(0, len(parent[key])))
            parent[key] = parent[key][:at] + odd + parent[key][at:]
        elif action == "text" or action == "replace":
            parent[key] = draw(json_value)
        elif action == "drop":
            del parent[key]
        elif action == "add" and isinstance(parent, dict):
            parent[draw(st.text(max_size=8))] = draw(json_value)
        elif action == "add":
            parent.append(draw(json_value))
        elif isinstance(parent, list):
            parent.append(json.loads(json.dumps(parent[key])))
        else:
            parent[f"{key}2" if isinstance(key, str) else key] = json.loads(json.dumps(parent[key]))
    return path, body


@settings(FUZZ, max_examples=500)
@given(sample=mutated(), coding=st.sampled_from(["identity", "gzip", "zstd"]), ascii_only=st.booleans())
def _mutations(server, sample, coding, ascii_only):
    path, body = sample
    # ASCII-only JSON escapes everything (surrogates as \udXXX); otherwise raw
    # UTF-8, where a lone surrogate becomes bytes that are not UTF-8 at all.
    data = json.dumps(body, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")
    headers = {}
    if coding != "identity":
        data, headers = compress(data, coding), {"Content-Encoding": coding}
    check(post(server, path, data, headers), route_of(path))


def test_mutations(server):
    _mutations(server)
    RAN.add("mutations")


# -- raw bytes and headers -------------------------------------------------------------------

raw_body = st.one_of(
    st.binary(max_size=200),
    st.text(max_size=100).map(lambda t: t.encode("utf-8", "surrogatepass")),
    json_value.map(lambda v: json.dumps(v).encode()),
    # A valid body cut short, or with a byte flipped.
    st.tuples(st.integers(0, 400), st.integers(0, 255)).map(
        lambda t: bytearray(encode(SYSTEMONE_VALID))[: t[0]] + bytes([t[1]])
    ).map(bytes),
)
raw_headers = st.fixed_dictionaries({}, optional={
    "Content-Encoding": st.sampled_from(["gzip", "zstd", "x-gzip", "identity", "gzip, zstd", "br", "", "GZIP", "zstd, identity"]),
    "Content-Type": st.sampled_from(["application/json", "text/plain", "multipart/form-data; boundary=x",
                                     "application/x-www-form-urlencoded", ""]),
    "Content-Length": st.sampled_from(["0", "-1", "abc", "99999999999"]),
})


@settings(FUZZ, max_examples=150)
@given(data=raw_body, headers=raw_headers, path=st.sampled_from(["/v1/systemone", "/systemone", "/v1/decisions"]))
def _raw_bytes(server, data, headers, path):
    headers = dict(headers)
    if "Content-Length" in headers:
        # A lying Content-Length: sent raw on its own connection (httpx would fix it).
        RAW[path] += 1
        status = raw_request(server, path, data, headers)
        alive(server)
        assert status is None or status in ALLOWED, status
        return
    check(post(server, path, data, headers), route_of(path))


def raw_request(server, path: str, data: bytes, headers: dict[str, str]) -> int | None:
    """Send bytes as they are over a socket; the status line's code, or None
    when the server rightly closed the connection on a malformed request."""
    import socket

    lines = [f"POST {path} HTTP/1.1", f"Host: 127.0.0.1:{server.port}", "Connection: close"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + data)
        sock.shutdown(socket.SHUT_WR)
        reply = b""
        try:
            while chunk := sock.recv(65536):
                reply += chunk
        except (ConnectionResetError, TimeoutError):
            pass
    if not reply:
        return None
    # h11 refuses a malformed Content-Length itself (400, plain text) before gmlx sees it.
    return int(reply.split(b" ", 2)[1])


def test_raw_bytes(server):
    _raw_bytes(server)
    RAN.add("raw_bytes")


# -- in-process: the body decoders -------------------------------------------------------------

@settings(max_examples=300, deadline=None, database=None)
@given(data=st.binary(max_size=300), coding=st.sampled_from(["gzip", "zstd"]), limit=st.integers(1, 4096))
def test_decoders_return_bytes_or_a_spec_error(data, coding, limit):
    for blob in (data, compress(data, coding), compress(data, coding)[: len(data) // 2]):
        try:
            out = bodies.decode(blob, [coding], limit)
        except GmlxError as err:
            assert err.status in (400, 413), err
        else:
            assert isinstance(out, bytes) and len(out) <= limit
        try:
            value = bodies.parse_json_object(blob)
        except GmlxError as err:
            assert err.status == 400
        else:
            assert isinstance(value, dict)


@settings(max_examples=50, deadline=None, database=None)
@given(payload=st.binary(min_size=1, max_size=2000), limit=st.integers(1, 1000))
def test_decoding_stops_at_the_limit(payload, limit):
    # Whatever the compressed size, the decoded output never passes the limit.
    for packed in (gzip.compress(payload * 50), zlib.compress(payload), zstandard.ZstdCompressor().compress(payload * 50)):
        for coding in ("gzip", "zstd"):
            try:
                out = bodies.decode(packed, [coding], limit)
            except GmlxError as err:
                assert err.status in (400, 413)
            else:
                assert len(out) <= limit


# -- last: the totals ----------------------------------------------------------------------------

def test_totals_no_500_and_the_server_alive(server):
    alive(server)
    health = server.health()
    assert health["status"] == "ok"
    by_status = health["requests"]["by_status"]
    assert not [s for s in by_status if s.startswith("5")], by_status
    for mid in ("tiny", "gemma"):
        queue = health["models"][mid]["slots"]["default"]["queue"]
        assert queue["failed"] == 0 and queue["running"] is False and queue["waiting"] == 0, queue
    # Every request sent through httpx reached the decision handler and was counted.
    sent = sum(SENT.values())
    assert health["requests"]["decisions"] >= sent, (health["requests"], SENT)
    print("\nrequests:", dict(SENT), "raw:", dict(RAW), "statuses:", dict(STATUSES))
    if RAN >= FUZZ_TESTS:
        assert sent + sum(RAW.values()) >= MIN_REQUESTS, (SENT, RAW)
        assert SENT["/v1/systemone"] + SENT["/systemone"] >= 800 and SENT["/v1/decisions"] >= 600, SENT
