"""libddp from Python: a process group over NumPy arrays, and (``libddp.torch``) a
torch.distributed backend.

NumPy use, under a launcher (``ddprun -n 4 python3 train.py``, torchrun-style variables, or
mpirun)::

    import numpy as np, libddp
    group = libddp.init()                  # reads the launcher's environment
    grads = np.ones(1000, np.float32)
    group.allreduce(grads, op="avg")       # in place, through the C library, no copy

Arrays are used in place: they must be C-contiguous, writeable where written, and of a dtype
libddp moves (float32, float64, float16, int32, int64, uint8); anything else is a TypeError.
Every libddp failure is a :class:`LibddpError` carrying the status and the library's message.
The calls here block until the collective completes (the GIL is released meanwhile).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
from typing import Iterable, Optional, Sequence

import numpy as np

__all__ = ["LibddpError", "Group", "init", "create_with_file_store", "library_path"]
__version__ = "0.1.0"

_HERE = os.path.dirname(os.path.abspath(__file__))


def _candidate_dirs() -> list:
    """Where libddp.so and the torch extension are looked for, in order: next to this file (an
    installed package), $LIBDDP_BUILD_DIR, then the build/ of the source checkout this file is
    in (python/libddp -> ../../build)."""
    dirs = [_HERE]
    if os.environ.get("LIBDDP_BUILD_DIR"):
        dirs.append(os.environ["LIBDDP_BUILD_DIR"])
    dirs.append(os.path.normpath(os.path.join(_HERE, "..", "..", "build")))
    return dirs


def library_path() -> str:
    """The path of the libddp shared library this package loads ($LIBDDP_LIBRARY wins)."""
    explicit = os.environ.get("LIBDDP_LIBRARY")
    if explicit:
        return explicit
    for d in _candidate_dirs():
        for name in ("libddp.so.0", "libddp.so"):
            p = os.path.join(d, name)
            if os.path.exists(p):
                return p
    found = ctypes.util.find_library("ddp")
    if found:
        return found
    raise ImportError(
        "libddp: cannot find libddp.so (looked in %s and the system library path); build it with "
        "`make` or set LIBDDP_LIBRARY or LIBDDP_BUILD_DIR" % ", ".join(_candidate_dirs()))


_lib = ctypes.CDLL(library_path())

_c_status = ctypes.c_int
_group_p = ctypes.c_void_p


class _GroupOptions(ctypes.Structure):
    _fields_ = [("timeout_ms", ctypes.c_int), ("transport", ctypes.c_char_p),
                ("name", ctypes.c_char_p)]


def _declare(name: str, restype, *argtypes) -> None:
    f = getattr(_lib, name)
    f.restype = restype
    f.argtypes = list(argtypes)


_declare("ddp_status_string", ctypes.c_char_p, _c_status)
_declare("ddp_last_error", ctypes.c_char_p)
_declare("ddp_group_create_from_env", _c_status, ctypes.POINTER(_GroupOptions),
         ctypes.POINTER(_group_p))
_declare("ddp_group_create", _c_status, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
         ctypes.POINTER(_GroupOptions), ctypes.POINTER(_group_p))
_declare("ddp_group_split", _c_status, _group_p, ctypes.POINTER(ctypes.c_int), ctypes.c_int,
         ctypes.POINTER(_GroupOptions), ctypes.POINTER(_group_p))
_declare("ddp_group_destroy", None, _group_p)
_declare("ddp_group_rank", ctypes.c_int, _group_p)
_declare("ddp_group_size", ctypes.c_int, _group_p)
_declare("ddp_group_timeout_ms", ctypes.c_int, _group_p)
_declare("ddp_group_transport", ctypes.c_char_p, _group_p)
_declare("ddp_group_allreduce", _c_status, _group_p, ctypes.c_void_p, ctypes.c_void_p,
         ctypes.c_size_t, ctypes.c_int, ctypes.c_int)
_declare("ddp_group_broadcast", _c_status, _group_p, ctypes.c_void_p, ctypes.c_size_t,
         ctypes.c_int, ctypes.c_int)
_declare("ddp_group_reduce_scatter", _c_status, _group_p, ctypes.c_void_p, ctypes.c_void_p,
         ctypes.c_size_t, ctypes.c_int, ctypes.c_int)
_declare("ddp_group_allgather", _c_status, _group_p, ctypes.c_void_p, ctypes.c_void_p,
         ctypes.c_size_t, ctypes.c_int)
_declare("ddp_group_barrier", _c_status, _group_p)
_declare("ddp_store_file_create", _c_status, ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p))
_declare("ddp_store_destroy", None, ctypes.c_void_p)

# ddp_dtype_t and ddp_reduce_op_t (include/ddp/types.h).
_DTYPES = {np.dtype(np.float32): 0, np.dtype(np.float64): 1, np.dtype(np.float16): 2,
           np.dtype(np.int32): 4, np.dtype(np.int64): 5, np.dtype(np.uint8): 6}
_OPS = {"sum": 0, "avg": 1, "min": 2, "max": 3, "prod": 4}
_U8 = 6


class LibddpError(RuntimeError):
    """A libddp call failed.

    Attributes:
        status: the ddp_status_t value (negative).
        status_name: its constant name, e.g. ``"DDP_ERR_TIMEOUT"``.
        message: libddp's text: which argument, rank, key or operation, and what happened.
    """

    def __init__(self, status: int, message: str, call: str) -> None:
        self.status = status
        self.status_name = _lib.ddp_status_string(status).decode()
        self.message = message
        super().__init__("%s failed: %s: %s" % (call, self.status_name, message))


def _check(status: int, call: str) -> None:
    if status != 0:
        raise LibddpError(status, (_lib.ddp_last_error() or b"").decode(errors="replace"), call)


def _options(timeout_ms: int, transport: Optional[str], name: Optional[str]) -> _GroupOptions:
    if timeout_ms < 0:
        raise ValueError("timeout_ms must be >= 0 (0: DDP_TIMEOUT), got %d" % timeout_ms)
    return _GroupOptions(timeout_ms, transport.encode() if transport else None,
                         name.encode() if name else None)


def _array(a, what: str, writeable: bool) -> np.ndarray:
    if not isinstance(a, np.ndarray):
        raise TypeError("%s must be a numpy.ndarray (used in place), got %s" %
                        (what, type(a).__name__))
    if not a.flags.c_contiguous:
        raise TypeError("%s must be C-contiguous (libddp works in place, without a copy); "
                        "pass np.ascontiguousarray(x) and read the result from it" % what)
    if writeable and not a.flags.writeable:
        raise TypeError("%s is read-only but the collective writes into it" % what)
    return a


def _dtype(a: np.ndarray, what: str, reduce: bool) -> int:
    code = _DTYPES.get(a.dtype)
    if code is None:
        if not reduce:
            return _U8  # data movement only: any dtype travels as its bytes
        raise TypeError("%s has dtype %s; libddp reduces float32, float64, float16, int32, int64 "
                        "and uint8" % (what, a.dtype))
    return code


def _op(op: str) -> int:
    code = _OPS.get(op.lower()) if isinstance(op, str) else None
    if code is None:
        raise ValueError("op must be one of %s, got %r" % (", ".join(_OPS), op))
    return code


def _ptr(a: np.ndarray) -> ctypes.c_void_p:
    return ctypes.c_void_p(a.ctypes.data)


class Group:
    """A libddp process group. Create with :func:`init` (from a launcher's environment) or
    :func:`create_with_file_store`; every rank must call the same collectives in the same order.
    Close with :meth:`close` or a ``with`` block."""

    def __init__(self, handle: int, store: Optional[int] = None) -> None:
        self._h = _group_p(handle)
        self._store = store

    # ---- properties -----------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """This process's rank in the group."""
        return _lib.ddp_group_rank(self._handle())

    @property
    def size(self) -> int:
        """The number of ranks in the group."""
        return _lib.ddp_group_size(self._handle())

    @property
    def transport(self) -> str:
        """The transport the group runs on: "shm", "tcp", "mpi", "hierarchical" or "self"."""
        return _lib.ddp_group_transport(self._handle()).decode()

    @property
    def timeout_ms(self) -> int:
        """The bound on every wait of this group, in milliseconds."""
        return _lib.ddp_group_timeout_ms(self._handle())

    def _handle(self) -> _group_p:
        if not self._h:
            raise ValueError("this libddp group is closed")
        return self._h

    # ---- collectives ------------------------------------------------------------------------
    def allreduce(self, array: np.ndarray, op: str = "sum") -> np.ndarray:
        """Reduces ``array`` over every rank with ``op`` ("sum", "avg", "min", "max", "prod"),
        in place; returns ``array``. Results are bitwise identical on every rank."""
        a = _array(array, "array", True)
        _check(_lib.ddp_group_allreduce(self._handle(), _ptr(a), _ptr(a), a.size,
                                        _dtype(a, "array", True), _op(op)), "allreduce")
        return a

    def broadcast(self, array: np.ndarray, root: int = 0) -> np.ndarray:
        """Copies ``array`` of rank ``root`` into ``array`` on every rank, in place; returns it.
        Any dtype (it moves bytes); every rank passes the same shape."""
        a = _array(array, "array", True)
        _check(_lib.ddp_group_broadcast(self._handle(), _ptr(a), a.nbytes, _U8, int(root)),
               "broadcast")
        return a

    def allgather(self, send: np.ndarray, recv: Optional[np.ndarray] = None) -> np.ndarray:
        """Concatenates every rank's ``send`` in rank order into ``recv`` (allocated, shape
        ``(size, *send.shape)``, when not given; else size x send.size elements of send's dtype).
        Returns ``recv``."""
        s = _array(send, "send", False)
        if recv is None:
            recv = np.empty((self.size,) + s.shape, dtype=s.dtype)
        r = _array(recv, "recv", True)
        if r.dtype != s.dtype or r.size != s.size * self.size:
            raise ValueError("recv must hold %d x %d elements of %s, got %d of %s" %
                             (self.size, s.size, s.dtype, r.size, r.dtype))
        _check(_lib.ddp_group_allgather(self._handle(), _ptr(s), _ptr(r), s.nbytes, _U8),
               "allgather")
        return r

    def reduce_scatter(self, send: np.ndarray, recv: Optional[np.ndarray] = None,
                       op: str = "sum") -> np.ndarray:
        """``send`` holds ``size`` equal blocks; rank r receives ``op`` over ranks of block r in
        ``recv`` (allocated, ``send.size // size`` elements, when not given). Returns ``recv``."""
        s = _array(send, "send", False)
        n = self.size
        if s.size % n:
            raise ValueError("send has %d elements, not a multiple of the group size %d" %
                             (s.size, n))
        if recv is None:
            recv = np.empty(s.size // n, dtype=s.dtype)
        r = _array(recv, "recv", True)
        if r.dtype != s.dtype or r.size * n != s.size:
            raise ValueError("recv must hold %d elements of %s, got %d of %s" %
                             (s.size // n, s.dtype, r.size, r.dtype))
        _check(_lib.ddp_group_reduce_scatter(self._handle(), _ptr(s), _ptr(r), r.size,
                                             _dtype(s, "send", True), _op(op)), "reduce_scatter")
        return r

    def barrier(self) -> None:
        """Returns once every rank has called barrier."""
        _check(_lib.ddp_group_barrier(self._handle()), "barrier")

    def split(self, ranks: Sequence[int], name: Optional[str] = None) -> Optional["Group"]:
        """Collective over every rank (like torch's new_group): the listed ranks form a new
        group, ordered as listed; returns None on the ranks not listed."""
        arr = (ctypes.c_int * len(ranks))(*[int(r) for r in ranks])
        out = _group_p()
        opts = _options(0, None, name)
        _check(_lib.ddp_group_split(self._handle(), arr, len(ranks), ctypes.byref(opts),
                                    ctypes.byref(out)), "split")
        return Group(out.value) if out.value else None

    # ---- life cycle ---------------------------------------------------------------------------
    def close(self) -> None:
        """Waits for queued work and frees the group (and the store it was created with)."""
        if self._h:
            _lib.ddp_group_destroy(self._h)
            self._h = _group_p()
        if self._store:
            _lib.ddp_store_destroy(self._store)
            self._store = None

    def __enter__(self) -> "Group":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        if not self._h:
            return "<libddp.Group closed>"
        return "<libddp.Group rank %d of %d on %s>" % (self.rank, self.size, self.transport)


def init(timeout_ms: int = 0, transport: Optional[str] = None,
         name: Optional[str] = None) -> Group:
    """Creates the group of this job from the launcher's environment (ddprun, torchrun-style
    RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT, or mpirun). Collective: every rank calls it.

    Args:
        timeout_ms: bound on every wait; 0 uses DDP_TIMEOUT (default 300 s).
        transport: None/"auto", or a transport's name ("shm", "tcp", ...).
        name: distinguishes several groups created on one store.
    """
    opts = _options(timeout_ms, transport, name)
    out = _group_p()
    _check(_lib.ddp_group_create_from_env(ctypes.byref(opts), ctypes.byref(out)),
           "init (ddp_group_create_from_env)")
    return Group(out.value)


def create_with_file_store(path: str, rank: int, size: int, timeout_ms: int = 0,
                           transport: Optional[str] = None) -> Group:
    """Creates a group whose ranks meet through a file store at ``path`` (processes on one
    machine or a shared filesystem), without a launcher. Collective over ``size`` ranks."""
    store = ctypes.c_void_p()
    _check(_lib.ddp_store_file_create(os.fsencode(path), ctypes.byref(store)),
           "create_with_file_store (ddp_store_file_create)")
    opts = _options(timeout_ms, transport, None)
    out = _group_p()
    try:
        _check(_lib.ddp_group_create(store, int(rank), int(size), ctypes.byref(opts),
                                     ctypes.byref(out)), "create_with_file_store")
    except LibddpError:
        _lib.ddp_store_destroy(store)
        raise
    return Group(out.value, store.value)
