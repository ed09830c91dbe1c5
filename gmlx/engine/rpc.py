"""llama.cpp's RPC backend (ggml-rpc) through ctypes.

llama-cpp-python 0.3.36 does not wrap the ggml RPC functions, so they are
declared here on the libraries the binding loaded, when that build has the RPC
backend (`-DGGML_RPC=on`; `llama_supports_rpc()` is true):

- a client (`rpc_servers` on a model): `ggml_backend_rpc_add_server(endpoint)`
  returns a backend registry whose devices are the worker's devices; they go,
  with the local GPUs, into `llama_model_params.devices` (a NULL-terminated
  `ggml_backend_dev_t` array), so llama.cpp places layers on them. The RPC
  registry is not registered globally: another model in the same process keeps
  its own placement.
- a worker (`gmlx rpc-worker`): `ggml_backend_rpc_start_server(endpoint,
  cache_dir, n_threads, n_devices, devices)` serves this machine's devices
  until the process ends.

The functions are found the way llama.cpp's own tools find them: the "RPC"
backend registry's `get_proc_address`, then the symbols of libggml-rpc next to
libllama. The RPC protocol has no authentication: bind workers to loopback or a
private network only.
"""

from __future__ import annotations

import ctypes
import threading

import llama_cpp

from .devices import DEV_CPU, DEV_GPU, DEV_IGPU, _open, declare, library_dir

RPC_BUILD = 'CMAKE_ARGS="-DGGML_RPC=on" pip install --force-reinstall --no-cache-dir llama-cpp-python'

class RPCUnavailable(Exception):
    """This llama.cpp build has no RPC backend; the message says how to get one."""


class _RPC:
    """The ggml functions gmlx needs, declared once per process."""

    def __init__(self) -> None:
        ggml = _open("ggml")
        if ggml is None:
            raise RPCUnavailable(f"libggml not found next to {llama_cpp.llama_cpp._lib._name}")
        self.ggml = ggml
        declare(ggml)
        vp, sz, cp = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p
        self.reg = ggml.ggml_backend_reg_by_name(b"RPC")
        add = self._proc("ggml_backend_rpc_add_server")
        start = self._proc("ggml_backend_rpc_start_server")
        if add is None or start is None:
            raise RPCUnavailable("this llama.cpp build has no RPC backend")
        self.add_server = ctypes.CFUNCTYPE(vp, cp)(add)
        # void ggml_backend_rpc_start_server(const char * endpoint, const char * cache_dir,
        #                                    size_t n_threads, size_t n_devices, ggml_backend_dev_t * devices)
        self.start_server = ctypes.CFUNCTYPE(None, cp, cp, sz, sz, ctypes.POINTER(vp))(start)

    def _proc(self, name: str) -> int | None:
        if self.reg:
            addr = self.ggml.ggml_backend_reg_get_proc_address(self.reg, name.encode())
            if addr:
                return addr
        lib = _open("ggml-rpc")
        if lib is not None:
            try:
                return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
            except AttributeError:
                return None
        return None

    def devices(self) -> list[int]:
        return [self.ggml.ggml_backend_dev_get(i) for i in range(self.ggml.ggml_backend_dev_count())]

    def dev_name(self, dev: int) -> str:
        return (self.ggml.ggml_backend_dev_name(dev) or b"").decode("utf-8", "replace")

    def dev_type(self, dev: int) -> int:
        return self.ggml.ggml_backend_dev_type(dev)

    def is_rpc(self, dev: int) -> bool:
        reg = self.ggml.ggml_backend_dev_backend_reg(dev)
        return bool(reg) and (self.ggml.ggml_backend_reg_name(reg) or b"") == b"RPC"


_lock = threading.Lock()
_api: _RPC | None = None
_servers: dict[str, list[int]] = {}


def api() -> _RPC:
    """The declared functions, or RPCUnavailable saying how to get an RPC build."""
    global _api
    with _lock:
        if _api is None:
            supports = getattr(llama_cpp, "llama_supports_rpc", None)
            if supports is not None and not supports():
                raise RPCUnavailable(
                    f"this llama-cpp-python ({llama_cpp.__version__}, {library_dir()}) was built without "
                    f"llama.cpp's RPC backend; reinstall it with the backend switched on: {RPC_BUILD}"
                )
            try:
                _api = _RPC()
            except (RPCUnavailable, AttributeError, OSError) as err:
                raise RPCUnavailable(
                    f"the RPC functions cannot be found in {library_dir()} ({err}); reinstall "
                    f"llama-cpp-python with the RPC backend: {RPC_BUILD}"
                ) from None
        return _api


def check_endpoint(endpoint: str) -> tuple[str, int]:
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"RPC server {endpoint!r} is not host:port")
    return host.strip("[]"), int(port)


def _reachable(endpoint: str, timeout: float = 5.0) -> bool:
    import socket

    host, port = check_endpoint(endpoint)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def server_devices(endpoint: str) -> list[int]:
    """The devices an RPC worker brings (added once per process and endpoint)."""
    rpc = api()
    with _lock:
        if endpoint in _servers:
            return _servers[endpoint]
    # ggml-rpc aborts the process on some connection failures: check first.
    if not _reachable(endpoint):
        raise ConnectionError(f"RPC server {endpoint} does not answer (start one with `gmlx rpc-worker`)")
    reg = rpc.add_server(endpoint.encode())
    devs = [rpc.ggml.ggml_backend_reg_dev_get(reg, i) for i in range(rpc.ggml.ggml_backend_reg_dev_count(reg))] if reg else []
    if not devs:
        raise ConnectionError(f"RPC server {endpoint} offers no device")
    with _lock:
        _servers[endpoint] = devs
    return devs


def model_devices(endpoints: list[str]) -> list[int]:
    """What llama.cpp offloads to with `rpc_servers`: the RPC devices first (in
    the order given), then this machine's GPUs (integrated ones only when there
    is no discrete GPU), as llama.cpp does when it picks devices itself."""
    rpc = api()
    out: list[int] = []
    for ep in endpoints:
        out += server_devices(ep)
    local = [d for d in rpc.devices() if not rpc.is_rpc(d)]
    gpus = [d for d in local if rpc.dev_type(d) == DEV_GPU]
    out += gpus or [d for d in local if rpc.dev_type(d) == DEV_IGPU]
    return out


def device_array(devices: list[int]):
    """A NULL-terminated ggml_backend_dev_t array (keep it alive while loading)."""
    return (ctypes.c_void_p * (len(devices) + 1))(*devices, None)


def worker_devices(names: list[str] | None = None) -> list[int]:
    """The devices a worker serves: the named ones, else the local GPUs, else the CPU."""
    rpc = api()
    if names:
        out = []
        for n in names:
            dev = rpc.ggml.ggml_backend_dev_by_name(n.encode())
            if not dev:
                known = ", ".join(rpc.dev_name(d) for d in rpc.devices())
                raise ValueError(f"unknown device {n!r} (this build has: {known})")
            out.append(dev)
        return out
    local = [d for d in rpc.devices() if not rpc.is_rpc(d)]
    gpus = [d for d in local if rpc.dev_type(d) in (DEV_GPU, DEV_IGPU)]
    if gpus:
        return gpus
    cpu = rpc.ggml.ggml_backend_dev_by_type(DEV_CPU)
    if not cpu:
        raise RPCUnavailable("no CPU device in this llama.cpp build")
    return [cpu]


def serve(host: str, port: int, threads: int, cache_dir: str | None = None,
          device_names: list[str] | None = None) -> None:
    """Run a ggml RPC server in this process; blocks until the server returns
    (it normally never does: stop the process)."""
    rpc = api()
    devices = worker_devices(device_names)
    arr = (ctypes.c_void_p * len(devices))(*devices)
    endpoint = f"{host}:{port}".encode()
    rpc.start_server(endpoint, cache_dir.encode() if cache_dir else None, threads, len(devices), arr)


def describe(devices: list[int]) -> str:
    rpc = api()
    return ", ".join(f"{rpc.dev_name(d)} ({(rpc.ggml.ggml_backend_dev_description(d) or b'').decode()})"
                     for d in devices)
