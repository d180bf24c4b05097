"""Layers on other machines through llama.cpp's RPC backend (ggml-rpc): endpoint checks, devices, the server.

A model is split across machines by running ``pyllama-dspark rpc-server`` (upstream's ``rpc-server``, built from
the patched tree) on each and passing their ``host:port`` endpoints to ``Model(..., rpc_servers=[...])``. Only
builds made with ``-DGGML_RPC=ON`` have the backend (``available()``).

What this module adds to the native backend, whose failures would abort the process:

- ``hello(endpoint)`` speaks the protocol's first message from Python with a timeout, so an unreachable server,
  something else on that port or a server of another protocol version is an ``RpcError`` before any native code
  connects. Its reply also says whether the server has pyllama-dspark's consistent-numerics command (patch
  0020); an upstream server does not, and a context that needs the mode on it is refused.
- Devices are handed to one model (``llama_model_params.devices``), never registered process-wide, so other
  models in the process stay local.

An rpc-server serves one client connection at a time; the models and contexts of one process share one
connection per endpoint.

The protocol has no authentication: never bind a server to an address other machines can reach on an open
network (docs/building.md, "Past one machine").
"""

from __future__ import annotations

import os
import socket
import struct
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from . import resources
from ._lib import ffi, lib
from .errors import RpcError

HELLO_COMMAND = 14          # RPC_CMD_HELLO, fixed by upstream across protocol versions
CONN_CAPS_SIZE = 24         # RPC_CONN_CAPS_SIZE (ggml-rpc/transport.h): transport capabilities, all zero = TCP
FEATURE_CONSISTENT = 1      # patch 0020: bit of the HELLO reply's padding byte
DEFAULT_PORT = 50052        # upstream rpc-server's default
HELLO_TIMEOUT = 5.0

SERVER_BINARY = "ggml-rpc-server"


@dataclass(frozen=True)
class ServerInfo:
    """What an rpc-server said in its HELLO reply."""

    endpoint: str
    version: tuple[int, int, int]
    consistent_numerics: bool  # it accepts pyllama-dspark's consistent-numerics command


def available() -> bool:
    """True when this build has the RPC backend (built with -DGGML_RPC=ON)."""
    return _registry() is not None


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """``"host:port"`` -> (host, port). Raises TypeError / ValueError for anything else."""
    if not isinstance(endpoint, str):
        raise TypeError(f"an RPC endpoint is a 'host:port' string, got {type(endpoint).__name__}")
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"RPC endpoint {endpoint!r}: expected host:port with a port in 1..65535")
    return host, int(port)


def check_endpoints(endpoints: Iterable[str]) -> tuple[str, ...]:
    """Validated, de-duplicated (order kept) endpoints; a bare string is refused (it would split into letters)."""
    if isinstance(endpoints, (str, bytes)):
        raise TypeError("rpc_servers is a list of 'host:port' strings, not one string")
    out: list[str] = []
    for endpoint in endpoints:
        parse_endpoint(endpoint)
        if endpoint in out:
            raise ValueError(f"RPC endpoint {endpoint!r} is listed twice")
        out.append(endpoint)
    return tuple(out)


def hello(endpoint: str, timeout: float = HELLO_TIMEOUT) -> ServerInfo:
    """Connect, send HELLO, read the reply, disconnect.

    Raises:
        RpcError: nothing listens there, no reply within ``timeout`` seconds (the server is serving another
            client, or it is not an rpc-server), or a protocol version this build cannot talk to.
    """
    host, port = parse_endpoint(endpoint)
    request = bytes([HELLO_COMMAND]) + struct.pack("<Q", CONN_CAPS_SIZE) + bytes(CONN_CAPS_SIZE)
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.sendall(request)
            (size,) = struct.unpack("<Q", _recv_exact(sock, 8, endpoint))
            if size != 4 + CONN_CAPS_SIZE:
                raise RpcError(f"RPC server {endpoint}: unexpected HELLO reply of {size} bytes (not an rpc-server of "
                               f"protocol v{lib.RPC_PROTO_MAJOR_VERSION}?)", op="rpc_hello")
            reply = _recv_exact(sock, size, endpoint)
    except socket.timeout:
        raise RpcError(f"RPC server {endpoint}: no reply within {timeout:g} s (an rpc-server serves one client at "
                       "a time: is another process connected to it?)", op="rpc_hello") from None
    except OSError as exc:
        raise RpcError(f"RPC server {endpoint}: cannot connect ({exc.strerror or exc})", op="rpc_hello") from None
    major, minor, patch, features = reply[0], reply[1], reply[2], reply[3]
    if major != lib.RPC_PROTO_MAJOR_VERSION or minor > lib.RPC_PROTO_MINOR_VERSION:
        raise RpcError(f"RPC server {endpoint} speaks protocol {major}.{minor}.{patch}; this build speaks "
                       f"{lib.RPC_PROTO_MAJOR_VERSION}.{lib.RPC_PROTO_MINOR_VERSION}.x", op="rpc_hello")
    return ServerInfo(endpoint, (major, minor, patch), bool(features & FEATURE_CONSISTENT))


def wait_for_server(endpoint: str, process=None, timeout: float = 30.0) -> ServerInfo:
    """Poll ``hello`` until the server answers (a server just started needs a moment to listen).

    Raises:
        RpcError: the last probe's error, once ``process`` (a ``subprocess.Popen``, if given) has exited or
            ``timeout`` seconds have passed.
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            return hello(endpoint, timeout=min(2.0, timeout))
        except RpcError:
            if (process is not None and process.poll() is not None) or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _recv_exact(sock: socket.socket, n: int, endpoint: str) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise RpcError(f"RPC server {endpoint} closed the connection during HELLO", op="rpc_hello")
        data += chunk
    return data


# Open models per endpoint: while one is open, the process holds the server's only connection, so a HELLO probe
# from here would wait behind it (and is not needed).
_USERS: "weakref.WeakSet" = weakref.WeakSet()


_INFOS: dict[str, ServerInfo] = {}  # the last HELLO reply per endpoint


def register_user(model) -> None:
    _USERS.add(model)


def connected(endpoint: str) -> bool:
    """True while an open model of this process uses the endpoint (its connection is live)."""
    return any(not model.closed and endpoint in model.rpc_servers for model in list(_USERS))


def model_devices(endpoints: Sequence[str], timeout: float = HELLO_TIMEOUT) -> tuple[list[ServerInfo], list]:
    """HELLO to each endpoint not already connected, then its devices (``ggml_backend_dev_t``), in order.

    Raises:
        RpcError: no RPC backend in this build, or an endpoint that fails HELLO or has no devices.
    """
    if not available():
        raise RpcError("this build has no RPC backend: reinstall with -C cmake.define.GGML_RPC=ON (docs/building.md: "
                       "\"Past one machine\")", op="rpc_add_server")
    infos = []
    for endpoint in endpoints:
        if not (connected(endpoint) and endpoint in _INFOS):  # a live connection: its reply is known
            _INFOS[endpoint] = hello(endpoint, timeout)
        infos.append(_INFOS[endpoint])
    add_server = _proc("ggml_backend_rpc_add_server", "ggml_backend_reg_t (*)(const char *)")
    devices = []
    for endpoint in endpoints:
        reg = add_server(endpoint.encode())
        if reg == ffi.NULL:
            raise RpcError(f"RPC server {endpoint}: no devices (or the connection failed)", op="rpc_add_server")
        devices += [lib.ggml_backend_reg_dev_get(reg, i) for i in range(lib.ggml_backend_reg_dev_count(reg))]
    return infos, devices


def graph_counts() -> tuple[int, int]:
    """(graphs sent whole, graphs recomputed from the server's stored copy) by this process so far."""
    if not available():
        return 0, 0
    counts = _proc("ggml_backend_rpc_dspark_graph_counts", "void (*)(uint64_t *, uint64_t *)")
    sent, recomputed = ffi.new("uint64_t *"), ffi.new("uint64_t *")
    counts(sent, recomputed)
    return int(sent[0]), int(recomputed[0])


def local_gpu_devices() -> list[str]:
    """Names of this process's GPU devices (RPC devices are never registered process-wide, so never listed)."""
    gpu = (lib.GGML_BACKEND_DEVICE_TYPE_GPU, lib.GGML_BACKEND_DEVICE_TYPE_IGPU)
    out = []
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        if lib.ggml_backend_dev_type(dev) in gpu:
            out.append(ffi.string(lib.ggml_backend_dev_name(dev)).decode())
    return out


def server_path() -> Path:
    """The bundled rpc-server (present in -DGGML_RPC=ON builds)."""
    path = resources.find_installed(f"bin/{SERVER_BINARY}")
    if path is None:
        raise RpcError(f"bin/{SERVER_BINARY} is not installed: this build has no RPC backend (reinstall with "
                       "-C cmake.define.GGML_RPC=ON)", op="rpc-server")
    return path


def server_command(*, host: str = "127.0.0.1", port: int = DEFAULT_PORT, n_threads: int | None = None,
                   cache: bool = False) -> tuple[list[str], dict[str, str]]:
    """The rpc-server command line and environment: the CPU device, consistent numerics on by default for every
    connection (GGML_CPU_CONSISTENT_NUMERICS=1, which also keeps repacked weights out of its buffers)."""
    cmd = [str(server_path()), "--host", host, "--port", str(int(port)), "--device", "CPU"]
    if n_threads is not None:
        cmd += ["--threads", str(int(n_threads))]
    if cache:
        cmd.append("--cache")
    env = dict(os.environ, GGML_CPU_CONSISTENT_NUMERICS="1")
    return cmd, env


def _registry():
    reg = lib.ggml_backend_reg_by_name(b"RPC")
    return None if reg == ffi.NULL else reg


def _proc(name: str, ctype: str):
    reg = _registry()
    address = ffi.NULL if reg is None else lib.ggml_backend_reg_get_proc_address(reg, name.encode())
    if address == ffi.NULL:
        raise RpcError(f"the RPC backend has no {name} (a build without pyllama-dspark's RPC patches?)", op=name)
    return ffi.cast(ctype, address)
