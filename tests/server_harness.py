"""Helpers for the server tests: run a real `gmlx serve` process on a free
loopback port with a config written to a tmp dir, and talk to it over HTTP."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import yaml


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gmlx_command() -> list[str]:
    script = Path(sys.executable).parent / "gmlx"
    if script.exists():
        return [str(script)]
    found = shutil.which("gmlx")
    return [found] if found else [sys.executable, "-m", "gmlx.cli"]


class Server:
    def __init__(self, workdir: Path, config: dict[str, Any], preload: bool = False, env: dict | None = None,
                 request_timeout: float = 120):
        self.request_timeout = request_timeout  # the default of post() and ok()
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.config_path = self.workdir / "decisions.yaml"
        self.config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        self.log_path = self.workdir / "server.log"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = gmlx_command() + ["serve", "--config", str(self.config_path), "--port", str(self.port)]
        if preload:
            args.append("--preload")
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            args, stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
            cwd=str(self.workdir),
        )

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gmlx serve exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"gmlx serve did not answer /health in {timeout} s:\n{self.log()}")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def log_line(self, pattern: str, timeout: float = 10.0) -> str:
        """The first log line that regex `pattern` matches, waited for: a
        decision's line is written just after its response is sent."""
        deadline = time.monotonic() + timeout
        while True:
            for line in self.log().splitlines():
                if re.search(pattern, line):
                    return line
            if time.monotonic() > deadline:
                raise AssertionError(f"no log line matches {pattern!r}:\n{self.log()[-2000:]}")
            time.sleep(0.02)

    def health(self) -> dict:
        r = httpx.get(self.url + "/health", timeout=10)
        assert r.status_code == 200, r.text
        return r.json()

    def post(self, body: Any = None, path: str = "/v1/systemone", timeout: float | None = None, **kw) -> httpx.Response:
        if body is not None:
            kw["json"] = body
        return httpx.post(self.url + path, timeout=timeout or self.request_timeout, **kw)

    def ok(self, body: Any, path: str = "/v1/systemone") -> dict:
        """POST a body that must succeed: its JSON response."""
        r = self.post(body, path)
        assert r.status_code == 200, r.text
        return r.json()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()


def start(workdir: Path, config: dict[str, Any], **kw) -> Server:
    server = Server(workdir, config, **kw)
    try:
        server.wait_ready()
    except Exception:
        server.stop()
        raise
    return server


def assert_error(r: httpx.Response, status: int, type_: str, param: str | None = "__any__") -> dict:
    """The SPEC 5 envelope with this status and type."""
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["type"] == type_, err
    assert err["code"] == status, err
    assert isinstance(err["message"], str) and err["message"], err
    if param != "__any__":
        assert err["param"] == param, err
    assert r.headers.get("x-request-id"), dict(r.headers)
    assert r.headers.get("x-typesafe-request-id") == r.headers.get("x-request-id")
    return err


def noul_body(**top) -> dict:
    """A one-question decision: one read."""
    body = {
        "state": "The customer says: hello, I love your product!",
        "questions": {"happy": {"type": "noul", "instructions": "Is the customer happy?"}},
        "samples": 1,
    }
    body.update(top)
    return body


def long_body(n: int = 8, samples: int = 8, **top) -> dict:
    """A decision that runs for many seconds (n choice questions, `samples` reads)."""
    questions = {
        f"q{i}": {
            "type": "choice",
            "instructions": f"Which option fits aspect {i} of the message?",
            "criteria": {"alpha": "the first", "beta": "the second", "gamma": "the third", "delta": "the fourth"},
        }
        for i in range(n)
    }
    body = {"state": "A customer writes about a billing problem with their March invoice.", "questions": questions,
            "samples": samples}
    body.update(top)
    return body


def dumps(body: Any) -> bytes:
    return json.dumps(body).encode()
