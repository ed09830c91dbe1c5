"""The `gmlx` command: serve, systemone, models."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import typer

from .config import Config, ConfigError, load_config, package_installed

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Structured decisions from GGUF models.")

DEFAULT_CONFIG = "decisions.yaml"


def _fail(message: str, code: int) -> None:
    typer.echo(message, err=True)
    raise typer.Exit(code)


def _config(path: str) -> Config:
    try:
        return load_config(path)
    except ConfigError as err:
        _fail(f"gmlx: {err}", 2)
    raise AssertionError  # unreachable


@app.command()
def serve(
    config: str = typer.Option(DEFAULT_CONFIG, "--config", "-c", help="decisions.yaml to serve"),
    host: Optional[str] = typer.Option(None, help="bind address (default: server.host)"),
    port: Optional[int] = typer.Option(None, help="port (default: server.port)"),
    preload: bool = typer.Option(False, "--preload", help="load every model before accepting requests"),
    log_level: str = typer.Option("info", "--log-level", help="debug, info, warning"),
) -> None:
    """Serve decisions over HTTP."""
    cfg = _config(config)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from .server.app import create_app, run

    application = create_app(cfg, preload=preload)
    run(application, host=host or cfg.server.host, port=cfg.server.port if port is None else port,
        log_level=log_level.lower())


@app.command()
def systemone(
    request: Optional[str] = typer.Argument(None, help="request file (JSON); not with --batch"),
    url: Optional[str] = typer.Option(None, help="server base URL, e.g. http://127.0.0.1:8080"),
    host: Optional[str] = typer.Option(None, help="server host (default: the config's, or 127.0.0.1)"),
    port: Optional[int] = typer.Option(None, help="server port (default: the config's, or 8080)"),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="GMLX_API_KEY", help="bearer key"),
    seed: Optional[int] = typer.Option(None, help="override the request's seed"),
    as_json: bool = typer.Option(False, "--json", help="print the whole response body"),
    model: Optional[str] = typer.Option(None, "--model", help="answer offline with this model id or GGUF file"),
    config: Optional[str] = typer.Option(None, "--config", "-c", help="decisions.yaml (models, server address)"),
    batch: Optional[str] = typer.Option(None, "--batch", help="JSONL file: one request body per line (bulk mode)"),
    out: Optional[str] = typer.Option(None, "--out", help="bulk mode: JSONL answers, appended to (resumable)"),
    concurrency: int = typer.Option(4, "--concurrency", min=1, max=256, help="bulk mode through a server: requests in flight"),
    retries: int = typer.Option(5, "--retries", min=0, max=100, help="bulk mode: retries of a 503 or a lost connection per line"),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="bulk mode: progress on stderr"),
    summary_json: Optional[str] = typer.Option(None, "--summary-json", help="bulk mode: write the run's summary here (JSON)"),
) -> None:
    """Answer a request file (or with --batch a JSONL of them): through a running server, or offline with --model."""
    import json

    from .systemone import HTTPFailure, RequestFileError, format_answers, post, read_request, run_offline

    if model and (url or host or port is not None):
        typer.echo("gmlx: --model answers offline; it cannot be combined with --url, --host or --port", err=True)
        raise typer.Exit(2)
    if batch is not None or out is not None:
        if request is not None or batch is None or out is None:
            _fail("gmlx: bulk mode takes --batch REQUESTS.jsonl and --out ANSWERS.jsonl, and no request file", 2)
        if as_json:
            _fail("gmlx: --json does not apply to --batch (the answers file holds whole responses)", 2)
        url = None if model else _server_url(url, host, port, config)
        _bulk(batch, out, model, config, url, api_key, seed, concurrency, retries, progress, summary_json)
        return
    if request is None:
        _fail("gmlx: give a request file, or --batch REQUESTS.jsonl --out ANSWERS.jsonl", 2)
    try:
        body = read_request(request)
    except RequestFileError as err:
        _fail(f"gmlx: {err}", 1)
    if seed is not None:
        body["seed"] = seed
    if model:
        logging.basicConfig(level=logging.WARNING)
        response = _offline(run_offline, body, model, config)
    else:
        url = _server_url(url, host, port, config)
        try:
            response = post(url, body, api_key)
        except ConnectionError:
            _fail(f"gmlx: no server at {url}; start one with `gmlx serve --config decisions.yaml`, "
                  "or answer offline with --model", 1)
        except HTTPFailure as err:
            _fail(f"gmlx: {err}", 1)
    if as_json:
        typer.echo(json.dumps(response, indent=2, ensure_ascii=False))
    else:
        for line in format_answers(body, response):
            typer.echo(line)


def _server_url(url: Optional[str], host: Optional[str], port: Optional[int], config: Optional[str]) -> str:
    if url is not None:
        return url
    cfg_host, cfg_port = "127.0.0.1", 8080
    if config:
        cfg = _config(config)
        cfg_host, cfg_port = cfg.server.host, cfg.server.port
    if cfg_host in ("0.0.0.0", "::", ""):
        cfg_host = "127.0.0.1"
    return f"http://{host or cfg_host}:{port if port is not None else cfg_port}"


def _offline(fn, *args):
    """Run an offline load (and decision): a config error exits 2, anything
    else 1, each as one line rather than a traceback."""
    from .errors import GmlxError

    try:
        return fn(*args)
    except ConfigError as err:
        _fail(f"gmlx: {err}", 2)
    except GmlxError as err:
        _fail(f"gmlx: {err.status} {err.type}: {err.message}", 1)
    except Exception as err:  # a load failure: one line, not a traceback
        _fail(f"gmlx: {err}", 1)


def _bulk(batch, out, model, config, url, api_key, seed, concurrency, retries, progress, summary_json) -> None:
    """`gmlx systemone --batch`: gmlx/bulk.py does the work; exit 1 when any line failed."""
    import json
    import sys

    from . import bulk

    if not Path(batch).is_file():
        _fail(f"gmlx: {batch}: no such file", 1)
    if model:
        logging.basicConfig(level=logging.WARNING)
        engine = _offline(bulk.OfflineEngine, model, config)
        workers = 1  # one reader owns one llama.cpp context
    else:
        engine = bulk.ServerEngine(url, api_key, retries=retries, concurrency=concurrency)
        workers = concurrency
    try:
        summary = bulk.run_batch(batch, out, engine, concurrency=workers, seed=seed, progress=progress,
                                 load_seconds=engine.load_seconds)
    except OSError as err:
        _fail(f"gmlx: {err}", 1)
    finally:
        engine.close()
    typer.echo(summary.text(), err=True)
    if summary_json:
        Path(summary_json).write_text(json.dumps(summary.as_dict(), indent=2) + "\n")
    sys.stderr.flush()
    if summary.interrupted:
        raise typer.Exit(130)
    if summary.failed:
        raise typer.Exit(1)


def _human_size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def backend_line() -> str:
    """The llama.cpp build and the devices it can compute on."""
    import llama_cpp

    from .engine.devices import backend_name, devices
    from .engine.model import init_backend

    init_backend()
    devs = ", ".join(f"{d.name} ({d.description})" if d.description else d.name for d in devices()) or "unknown"
    return f"llama-cpp-python {llama_cpp.__version__}: backend {backend_name()}; devices: {devs}"


def model_rows(cfg: Config) -> list[dict]:
    """One row per configured model, from the GGUF header only."""
    from .engine.chat import ARCH_BUILTIN
    from .engine.gguf_info import llama_supports_arch, read_info, unsupported_note
    from .engine.model import configured_strategy

    rows = []
    for mid, m in cfg.models.items():
        row = {
            "id": mid,
            "aliases": [a for a, t in cfg.aliases.items() if t == mid],
            "source": m.source,
            "present": False,
            "size": None,
            "architecture": None,
            "strategy": None,
            "loadable": False,
            "note": "",
        }
        try:
            if m.package and not package_installed(m.package):
                raise FileNotFoundError(f"package {m.package} not installed")
            path = cfg.model_path(mid)
            if not path.is_file():
                raise FileNotFoundError(f"{path} not found")
            info = read_info(path)
        except FileNotFoundError as err:
            row["note"] = str(err)
            rows.append(row)
            continue
        except ValueError as err:
            row.update(present=True, note=str(err))
            rows.append(row)
            continue
        has_template = bool(m.chat_template) or info.has_chat_template or info.architecture in ARCH_BUILTIN
        supported = llama_supports_arch(info.architecture)
        row.update(
            present=True,
            size=info.size,
            architecture=info.architecture,
            strategy=configured_strategy(getattr(m, "read_strategy", None), info.architecture, has_template),
            loadable=supported,
            note="" if supported else unsupported_note(info.architecture),
        )
        rows.append(row)
    return rows


@app.command()
def models(
    config: str = typer.Option(DEFAULT_CONFIG, "--config", "-c", help="decisions.yaml to read"),
) -> None:
    """List configured models: source, file, architecture, strategy, loadable."""
    cfg = _config(config)
    rows = model_rows(cfg)
    typer.echo(backend_line())
    headers = ["id", "aliases", "architecture", "strategy", "loadable", "present", "size", "source"]
    table = [
        [
            r["id"],
            ",".join(r["aliases"]) or "-",
            r["architecture"] or "-",
            r["strategy"] or "none",
            "yes" if r["loadable"] else "no",
            "yes" if r["present"] else "no",
            _human_size(r["size"]) if r["size"] is not None else "-",
            r["source"],
        ]
        for r in rows
    ]
    widths = [max(len(h), *(len(row[i]) for row in table)) if table else len(h) for i, h in enumerate(headers)]
    typer.echo("  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip())
    for row, r in zip(table, rows):
        typer.echo("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
        if r["note"]:
            typer.echo(f"    note: {r['note']}")




_LOOPBACK = ("127.0.0.1", "localhost", "::1")


@app.command("rpc-worker")
def rpc_worker(
    host: str = typer.Option("127.0.0.1", help="bind address; the RPC protocol has no authentication: keep it on loopback or a private network"),
    port: int = typer.Option(50052, help="port"),
    threads: Optional[int] = typer.Option(None, "--threads", "-t", help="CPU threads (default: all cores)"),
    device: Optional[str] = typer.Option(None, "--device", "-d", help="comma-separated device names (default: the GPUs, else the CPU)"),
    cache: Optional[str] = typer.Option(None, "--cache", help="folder where the worker caches tensors it was sent"),
) -> None:
    """Serve this machine's llama.cpp devices to `rpc_servers` over ggml RPC (no authentication)."""
    import os
    import signal
    import threading

    from .engine import rpc
    from .engine.model import init_backend

    if not 0 < port < 65536:
        _fail(f"gmlx: --port {port} is not a port", 2)
    try:
        init_backend()
        devices = rpc.worker_devices([d.strip() for d in device.split(",") if d.strip()] if device else None)
    except rpc.RPCUnavailable as err:
        _fail(f"gmlx: {err}", 2)
    except ValueError as err:
        _fail(f"gmlx: {err}", 2)
    if host not in _LOOPBACK:
        typer.echo(f"gmlx: WARNING: binding RPC to {host}: the RPC protocol has no authentication; anyone who can "
                   "reach this port can run work on this machine and read what it holds", err=True)
    n_threads = threads or os.cpu_count() or 1
    typer.echo(f"gmlx rpc-worker: serving {rpc.describe(devices)} on {host}:{port} with {n_threads} threads", err=True)
    done = threading.Event()

    def run() -> None:
        try:
            rpc.serve(host, port, n_threads, cache, [d.strip() for d in device.split(",") if d.strip()] if device else None)
        finally:
            done.set()

    # The server call blocks in C and never returns while it serves: run it on a
    # thread, and let the main thread take SIGINT/SIGTERM and end the process.
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    threading.Thread(target=run, name="ggml-rpc", daemon=True).start()
    try:
        while not done.wait(0.5):
            pass
    except KeyboardInterrupt:
        os._exit(0)
    typer.echo(f"gmlx rpc-worker: the RPC server on {host}:{port} stopped (is the port in use?)", err=True)
    raise typer.Exit(1)
