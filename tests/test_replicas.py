"""docs/server.md's replica recipe for real on loopback: two `gmlx serve`
replicas behind nginx (OS package), a rolling restart of each replica under
steady bounded traffic, and not one failed request.

nginx retries a replica's 503 (draining, loading, overloaded) and a refused
connection on the other replica (`proxy_next_upstream ... http_503
non_idempotent`); replicas drain on SIGTERM (`server.drain_grace_s`) and say
when they are ready (`/health/ready`, after `server.preload`)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

import tiny_gguf  # noqa: E402
from server_harness import free_port, gmlx_command, noul_body  # noqa: E402

NGINX = shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if os.path.exists(p)), None)

pytestmark = pytest.mark.skipif(NGINX is None, reason="nginx is not installed (apt-get install nginx)")

NGINX_CONF = """
worker_processes 1;
pid {d}/nginx.pid;
error_log {d}/nginx-error.log warn;
events {{ worker_connections 256; }}
http {{
    log_format combined_up '$request_uri $status upstream=$upstream_addr upstream_status=$upstream_status';
    access_log {d}/nginx-access.log combined_up;
    client_body_temp_path {d}/body; proxy_temp_path {d}/proxy; fastcgi_temp_path {d}/fcgi;
    uwsgi_temp_path {d}/uwsgi; scgi_temp_path {d}/scgi;
    map $http_x_gmlx_cache_key $gmlx_sticky {{ "" $request_id; default $http_x_gmlx_cache_key; }}
    upstream gmlx {{
        hash $gmlx_sticky consistent;
        server 127.0.0.1:{a} max_fails=0;
        server 127.0.0.1:{b} max_fails=0;
        keepalive 16;
    }}
    server {{
        listen 127.0.0.1:{port};
        client_max_body_size 2m;
        location / {{
            proxy_pass http://gmlx;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_next_upstream error timeout http_502 http_503 non_idempotent;
            proxy_next_upstream_tries 4;
            proxy_connect_timeout 2s;
            proxy_read_timeout 300s;
        }}
    }}
}}
"""


class Replica:
    def __init__(self, d: Path, port: int, gguf: Path, name: str):
        self.d, self.port, self.name = d, port, name
        self.cfg = d / f"{name}.yaml"
        self.cfg.write_text(yaml.safe_dump({
            "models": {"tiny": {"path": str(gguf), "n_ctx": 1024, "parallel": 1}},
            "server": {"max_queue": 8, "drain_grace_s": 30, "preload": ["tiny"]},
        }))
        self.proc = None
        self.starts = 0

    def start(self) -> None:
        self.starts += 1
        log = open(self.d / f"{self.name}-{self.starts}.log", "wb")
        self.proc = subprocess.Popen(gmlx_command() + ["serve", "--config", str(self.cfg), "--port", str(self.port)],
                                     stdout=log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout=60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"{self.name} exited {self.proc.returncode}"
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"{self.name} not ready in {timeout} s")

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(60)


@pytest.fixture
def cluster(tmp_path):
    gguf = tiny_gguf.build_qwen3(tmp_path / "tiny.gguf")
    a, b = Replica(tmp_path, free_port(), gguf, "a"), Replica(tmp_path, free_port(), gguf, "b")
    for r in (a, b):
        r.start()
    for r in (a, b):
        r.wait_ready()
    port = free_port()
    (tmp_path / "nginx.conf").write_text(NGINX_CONF.format(d=tmp_path, a=a.port, b=b.port, port=port))
    ngx = subprocess.Popen([NGINX, "-p", str(tmp_path), "-c", str(tmp_path / "nginx.conf"), "-g", "daemon off;"],
                           stdout=subprocess.DEVNULL, stderr=open(tmp_path / "nginx-stderr.log", "wb"))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 10
    while True:
        try:
            httpx.get(url + "/health", timeout=1)
            break
        except httpx.HTTPError:
            assert time.monotonic() < deadline and ngx.poll() is None, (tmp_path / "nginx-stderr.log").read_text()
            time.sleep(0.1)
    yield url, a, b, tmp_path
    ngx.send_signal(signal.SIGQUIT)
    try:
        ngx.wait(10)
    except subprocess.TimeoutExpired:
        ngx.kill()
    for r in (a, b):
        if r.proc.poll() is None:
            r.proc.kill()
            r.proc.wait()


def test_rolling_restart_behind_nginx_loses_no_request(cluster):
    url, a, b, d = cluster
    results: list[tuple[int, str]] = []
    stop = threading.Event()

    def client(k: int):
        with httpx.Client(timeout=120) as c:
            i = 0
            while not stop.is_set():
                i += 1
                body = noul_body(state=f"Client {k}, message {i}: hello, I love your product!")
                try:
                    r = c.post(url + "/v1/systemone", json=body,
                               headers={"X-Gmlx-Cache-Key": f"client-{k}"} if k == 0 else {})
                    results.append((r.status_code, r.text[:200]))
                except httpx.HTTPError as err:
                    results.append((-1, repr(err)))
                time.sleep(0.02)  # steady, bounded: two clients, one request in flight each

    clients = [threading.Thread(target=client, args=(k,)) for k in range(2)]
    for t in clients:
        t.start()
    time.sleep(2)
    restarted = []
    for r in (a, b):  # rolling: one replica at a time
        n0 = len(results)
        assert r.stop() == 0, f"replica {r.name} did not exit 0 after draining"
        r.start()
        r.wait_ready()
        time.sleep(1.5)
        restarted.append(len(results) - n0)
    stop.set()
    for t in clients:
        t.join(60)
    failed = [x for x in results if x[0] != 200]
    assert len(results) >= 20 and all(n > 0 for n in restarted), (len(results), restarted)
    assert failed == [], failed[:5]
    # The balancer did retry somewhere: a 503 or refused connection answered by the other replica.
    log = (d / "nginx-access.log").read_text()
    assert "upstream_status=" in log
