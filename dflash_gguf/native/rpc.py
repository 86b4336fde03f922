"""A model's layers on other hosts: llama.cpp's RPC backend (``rpc-server`` processes).

llama-cpp-python 0.3.x no longer passes ``rpc_servers`` to llama.cpp (the field left
``llama_model_params``; devices now go in ``llama_model_params.devices``). Here each endpoint is
first probed with a plain socket (bounded connect and read time, the protocol's HELLO and
DEVICE_COUNT), because ggml's own client aborts the process on a refused connection or a
version mismatch; then it is handed to ggml (``ggml_backend_rpc_add_server``) and its devices go,
NULL-terminated, into the model's parameters. The local CPU holds what is not offloaded, as
upstream's ``--rpc`` does. The devices are *not* registered globally, so a drafter (or any other
model) loaded without ``draft_rpc_servers`` stays local.

After every decode of a model on RPC devices :meth:`RpcDevices.check` asks each server for its
device memory: a barrier behind the decode's queued commands, and the way a lost server shows
(patch 0019 turns ggml-rpc's abort on a lost connection into a failed state in which the device
reports no memory and its graph computes fail). The request then fails with
:class:`~dflash_gguf.errors.RpcLostError` before any token of the broken decode is used.

Security: rpc-server has no authentication and executes whatever graph a client sends; bind it to
loopback or a trusted network only (README "Scaling out").
"""
from __future__ import annotations

import atexit
import ctypes
import logging
import socket
import struct
import weakref
from pathlib import Path
from typing import Sequence

from dflash_gguf.errors import (InvalidArgumentError, RpcConnectError, RpcLostError, RpcProtocolError,
                                UnsupportedError)

log = logging.getLogger("dflash_gguf.native.rpc")

CONNECT_TIMEOUT_S = 5.0   # connect, HELLO and DEVICE_COUNT together, per server
PROTO_MAJOR, PROTO_MINOR = 7, 0   # ggml-rpc.h RPC_PROTO_{MAJOR,MINOR}_VERSION of the pinned tree
_CMD_HELLO, _CMD_DEVICE_COUNT = 14, 15
_CAPS = 24                # RPC_CONN_CAPS_SIZE (transport.h)


def parse_servers(servers: str | Sequence[str] | None) -> list[str]:
    """``"host:port,host:port"`` or a list of ``"host:port"`` -> the endpoints, checked."""
    if servers is None:
        return []
    items = servers.split(",") if isinstance(servers, str) else list(servers)
    out = []
    for item in items:
        ep = str(item).strip()
        host, sep, port = ep.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise InvalidArgumentError(f"RPC server {ep!r} is not host:port (e.g. 127.0.0.1:50052)")
        if ":" in host:
            raise InvalidArgumentError(f"RPC server {ep!r}: ggml's RPC client takes a host name or an IPv4 "
                                       "address (no IPv6 literal)")
        out.append(ep)
    if len(set(out)) != len(out):
        raise InvalidArgumentError(f"RPC servers listed twice: {out}")
    return out


def _recv_exact(sock: socket.socket, n: int, ep: str) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise RpcProtocolError(f"{ep} closed the connection during the RPC handshake: not an rpc-server, "
                                   "or one of another protocol version")
        buf += chunk
    return buf


def probe(endpoint: str, timeout: float | None = None) -> tuple[str, int]:
    """Connect to ``endpoint``, say HELLO and count its devices, within ``timeout`` seconds.

    Returns (the server's protocol version, its device count). Raises RpcConnectError when nothing
    answers in time, RpcProtocolError when the answer is not an rpc-server's of a compatible version.
    The connection is closed again: an rpc-server serves one client at a time.
    """
    timeout = CONNECT_TIMEOUT_S if timeout is None else timeout
    host, _, port = endpoint.rpartition(":")
    try:
        sock = socket.create_connection((host, int(port)), timeout=timeout)
    except (socket.timeout, TimeoutError) as e:
        raise RpcConnectError(f"rpc-server {endpoint}: no connection within {timeout:g} s ({e})") from e
    except OSError as e:
        raise RpcConnectError(f"rpc-server {endpoint} is unreachable ({e.strerror or e}); start it there with "
                              f"`rpc-server -H HOST -p {port}`") from e
    try:
        sock.settimeout(timeout)
        sock.sendall(bytes([_CMD_HELLO]) + struct.pack("<Q", _CAPS) + bytes(_CAPS))
        size, = struct.unpack("<Q", _recv_exact(sock, 8, endpoint))
        if size != 4 + _CAPS:
            raise RpcProtocolError(f"{endpoint} answered the RPC HELLO with a {size}-byte message (an rpc-server "
                                   f"sends {4 + _CAPS}): not an rpc-server, or of another protocol version")
        major, minor, patch = _recv_exact(sock, size, endpoint)[:3]
        version = f"{major}.{minor}.{patch}"
        if major != PROTO_MAJOR or minor > PROTO_MINOR:
            raise RpcProtocolError(f"rpc-server {endpoint} speaks RPC protocol {version}; this build speaks "
                                   f"{PROTO_MAJOR}.{PROTO_MINOR}.x: run the rpc-server of the same llama.cpp "
                                   "(python -m dflash_gguf.build --with-tools builds it)")
        sock.sendall(bytes([_CMD_DEVICE_COUNT]) + struct.pack("<Q", 0))
        size, = struct.unpack("<Q", _recv_exact(sock, 8, endpoint))
        if size != 4:
            raise RpcProtocolError(f"rpc-server {endpoint} answered DEVICE_COUNT with {size} bytes")
        n_dev, = struct.unpack("<I", _recv_exact(sock, 4, endpoint))
    except (socket.timeout, TimeoutError) as e:
        raise RpcProtocolError(f"{endpoint} accepted the connection but did not answer the RPC handshake within "
                               f"{timeout:g} s: not an rpc-server, or one busy with another client") from e
    except OSError as e:
        if isinstance(e, (RpcProtocolError, RpcConnectError)):
            raise
        raise RpcProtocolError(f"{endpoint}: the RPC handshake failed ({e})") from e
    finally:
        sock.close()
    if n_dev == 0:
        raise RpcProtocolError(f"rpc-server {endpoint} offers no device")
    return version, n_dev


def server_binary(folder: Path | None = None) -> Path | None:
    """Upstream's rpc-server in ``folder`` (default: the build's reference tools): ``ggml-rpc-server``
    (the pinned tree's CMake target) or ``rpc-server`` (its older name); None if neither is there."""
    if folder is None:
        from dflash_gguf import paths

        folder = paths.tools_dir()
    for name in ("ggml-rpc-server", "rpc-server"):
        if folder is not None and (folder / name).is_file():
            return folder / name
    return None


class _Ggml:
    """The two ggml libraries beside libllama: the RPC backend and ggml-base (device queries)."""

    def __init__(self):
        from dflash_gguf.native.llama import llama_cpp

        from dflash_gguf.native import _bindings as B

        if not llama_cpp.llama_supports_rpc():
            raise UnsupportedError("this llama.cpp build has no RPC backend: rebuild with "
                                   "`python -m dflash_gguf.build` (it enables GGML_RPC)")
        here = Path(B.LIBRARY_PATH)
        suffix = here.suffix or ".so"
        try:
            self.rpc = ctypes.CDLL(str(here.with_name(f"libggml-rpc{suffix}")))
            self.base = ctypes.CDLL(str(here.with_name(f"libggml-base{suffix}")))
        except OSError as e:
            raise UnsupportedError(f"ggml's RPC backend library is missing beside {here} ({e}); rebuild with "
                                   "`python -m dflash_gguf.build`") from e
        vp, sz = ctypes.c_void_p, ctypes.c_size_t
        self.rpc.ggml_backend_rpc_add_server.argtypes, self.rpc.ggml_backend_rpc_add_server.restype = [ctypes.c_char_p], vp
        self.rpc.ggml_backend_rpc_get_device_memory.argtypes = [ctypes.c_char_p, ctypes.c_uint32,
                                                                ctypes.POINTER(sz), ctypes.POINTER(sz)]
        self.rpc.ggml_backend_rpc_get_device_memory.restype = None
        self.base.ggml_backend_reg_dev_count.argtypes, self.base.ggml_backend_reg_dev_count.restype = [vp], sz
        self.base.ggml_backend_reg_dev_get.argtypes, self.base.ggml_backend_reg_dev_get.restype = [vp, sz], vp
        for fn in ("ggml_backend_dev_name", "ggml_backend_dev_description"):
            getattr(self.base, fn).argtypes, getattr(self.base, fn).restype = [vp], ctypes.c_char_p

    def memory(self, endpoint: str, device: int) -> tuple[int, int]:
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        self.rpc.ggml_backend_rpc_get_device_memory(endpoint.encode(), device, ctypes.byref(free), ctypes.byref(total))
        return free.value, total.value


_GGML: _Ggml | None = None


def _ggml() -> _Ggml:
    global _GGML
    if _GGML is None:
        _GGML = _Ggml()
    return _GGML


_LIVE: "weakref.WeakSet[RpcDevices]" = weakref.WeakSet()
_OPEN: weakref.WeakSet = weakref.WeakSet()   # models on rpc-servers, closed at exit (see _close_at_exit)


@atexit.register
def _close_at_exit() -> None:
    """Free models on rpc-servers before the interpreter finalizes: freeing sends commands that ggml's
    dispatcher thread completes, and a thread that logs through a Python callback (llama_cpp's, or
    dflash_gguf.native.logs') during finalization is ended by Python, leaving the free waiting forever."""
    for obj in list(_OPEN):
        try:
            obj.close()
        except Exception:   # exit: nothing left to report to
            pass


class RpcDevices:
    """The ggml devices of some rpc-servers, as a NULL-terminated ``ggml_backend_dev_t`` array."""

    def __init__(self, endpoints: Sequence[str], timeout: float | None = None):
        self.endpoints = parse_servers(endpoints)
        if not self.endpoints:
            raise InvalidArgumentError("no RPC server given")
        g = _ggml()
        # an rpc-server serves one client at a time, and ggml keeps one connection per endpoint for the
        # whole process: an endpoint a live model of this process may hold is not probed again
        held = {ep for devs in list(_LIVE) for ep in devs.endpoints}
        for ep in self.endpoints:
            if ep in held:
                log.debug("rpc-server %s: in use by this process, not probed", ep)
                continue
            version, n = probe(ep, timeout)
            log.info("rpc-server %s: protocol %s, %d device(s)", ep, version, n)
        ptrs, self.names, self.counts = [], [], []
        for ep in self.endpoints:
            reg = g.rpc.ggml_backend_rpc_add_server(ep.encode())
            n = g.base.ggml_backend_reg_dev_count(reg) if reg else 0
            if not n:
                raise RpcProtocolError(f"rpc-server {ep} offers no device")
            self.counts.append(n)
            for i in range(n):
                dev = g.base.ggml_backend_reg_dev_get(reg, i)
                ptrs.append(dev)
                name = g.base.ggml_backend_dev_name(dev).decode()
                self.names.append(name)
                free, total = g.memory(ep, i)
                log.info("%s on %s: %s, %.0f of %.0f MiB free", name, ep,
                         g.base.ggml_backend_dev_description(dev).decode(), free / 2**20, total / 2**20)
        self.pointers = ptrs
        self._array = (ctypes.c_void_p * (len(ptrs) + 1))(*ptrs, None)
        _LIVE.add(self)

    @property
    def address(self) -> int:
        """``llama_model_params.devices``: valid while this object lives."""
        return ctypes.addressof(self._array)

    def __len__(self) -> int:
        return len(self._array) - 1

    def check(self) -> None:
        """Raise RpcLostError if a server has gone (waits for the commands queued to it first)."""
        g = _ggml()
        for ep in self.endpoints:
            if g.memory(ep, 0)[1] == 0:
                raise RpcLostError(f"the connection to rpc-server {ep} was lost: this request fails; the model's "
                                   f"layers there are gone, load the model again once the server is back")


class RpcTarget:
    """Mixin for :class:`dflash_gguf.Llama`: ``rpc_servers`` for the target, ``draft_rpc_servers`` for
    the drafter. llama_cpp builds ``self.model_params`` inside its constructor and loads the model
    right after; this property sets ``devices`` on it as it is assigned."""

    _rpc: RpcDevices | None = None
    _draft_rpc: RpcDevices | None = None
    rpc_servers: list[str] | None = None
    draft_rpc_servers: list[str] | None = None

    @property
    def model_params(self):
        return self.__dict__.get("_model_params")

    @model_params.setter
    def model_params(self, params) -> None:
        if self._rpc is not None:
            params.devices = self._rpc.address
        self.__dict__["_model_params"] = params

    def _rpc_setup(self, rpc_servers, draft_rpc_servers, kwargs: dict) -> None:
        """Probe and open the servers before anything loads; all target layers go to them unless
        ``n_gpu_layers`` says fewer (llama.cpp puts the rest on the local CPU)."""
        self.rpc_servers = parse_servers(rpc_servers) or None
        self.draft_rpc_servers = parse_servers(draft_rpc_servers) or None
        if self.rpc_servers:
            self._rpc = RpcDevices(self.rpc_servers)
            kwargs.setdefault("n_gpu_layers", -1)
            split = kwargs.get("tensor_split")
            if split is not None and len(split) > len(self._rpc):
                raise InvalidArgumentError(f"tensor_split has {len(split)} entries for {len(self._rpc)} RPC "
                                           f"devices ({', '.join(self._rpc.names)})")
        elif kwargs.get("tensor_split") is not None:
            log.info("tensor_split without rpc_servers: it applies to the local GPUs, if any")
        if self.draft_rpc_servers:
            self._draft_rpc = RpcDevices(self.draft_rpc_servers)
        if self._rpc is not None or self._draft_rpc is not None:
            _OPEN.add(self)

    def _rpc_check(self) -> None:
        """After a decode of the target (or drafter) on RPC devices: raise if a server was lost."""
        for devs in (self._rpc, self._draft_rpc):
            if devs is not None:
                devs.check()

    @property
    def _rpc_hook(self):
        """A model's ``rpc_check`` (None without RPC devices): both checks, since a drafter shares the
        target's output tensors."""
        return self._rpc_check if (self._rpc or self._draft_rpc) else None

    def _draft_devices(self) -> dict:
        """The drafter's load arguments besides its path. Its devices: its own rpc-servers' and the
        target's, since it borrows the target's embeddings and LM head, which stay on the target's
        devices (a context without those devices cannot schedule the ops on them: ggml aborts). Its
        layers: ``draft_n_gpu_layers``; by default all offloaded with draft_rpc_servers (shared out over
        every device listed), else none (local, as without RPC: the target's n_gpu_layers)."""
        ngl = self.draft_n_gpu_layers
        devs = [d for d in (self._draft_rpc, self._rpc) if d is not None]
        if not devs:
            return dict(n_gpu_layers=self.model_params.n_gpu_layers if ngl is None else ngl)
        ptrs = list(dict.fromkeys(p for d in devs for p in d.pointers))   # the drafter's own first
        self._draft_array = (ctypes.c_void_p * (len(ptrs) + 1))(*ptrs, None)
        if ngl is None:
            ngl = -1 if self._draft_rpc is not None else 0
        return dict(n_gpu_layers=ngl, devices=ctypes.addressof(self._draft_array), rpc_check=self._rpc_hook)

    def __getstate__(self):
        state = super().__getstate__()
        state.update(rpc_servers=self.rpc_servers, draft_rpc_servers=self.draft_rpc_servers)
        return state
