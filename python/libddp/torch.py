"""libddp as a torch.distributed backend. Importing this module registers backend "ddp"::

    import libddp.torch
    torch.distributed.init_process_group("ddp")          # env://, tcp://, file:// as usual
    model = torch.nn.parallel.DistributedDataParallel(model)

The backend is a C++ extension (``_ddp_torch-torch<major.minor>.so`` in a build tree, one per
torch found; ``_ddp_torch*.so`` in an installed package) built against the installed torch by
``make`` (CMake, python/python.cmake) or by ``pip install ./python`` (setup.py); it is never
compiled at import. Rendezvous goes through the store torch hands the backend, so any
init_method works. See docs/pytorch.md for the ops, what each maps to, and the ones missing.
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from . import _candidate_dirs

__all__ = ["BACKEND", "backend", "extension_path", "ProcessGroupDDP", "transport"]

BACKEND = "ddp"


def _torch_minor() -> str:
    """The running torch's major.minor ("2.13"), as the extension's build names it."""
    return ".".join(torch.__version__.split("+")[0].split(".")[:2])


def extension_path() -> str:
    """The path of the compiled backend ($LIBDDP_TORCH_EXTENSION wins). A build tree holds one
    per torch version (_ddp_torch-torch2.13.so, _ddp_torch-torch1.13.so); an installed package
    holds the one it was built with."""
    explicit = os.environ.get("LIBDDP_TORCH_EXTENSION")
    if explicit:
        return explicit
    tried = []
    built_for = []
    for d in _candidate_dirs():
        for sub in (".", os.path.join("python", "libddp")):
            base = os.path.normpath(os.path.join(d, sub))
            p = os.path.join(base, "_ddp_torch-torch%s.so" % _torch_minor())
            if os.path.exists(p):
                return p
            for suffix in [".so"] + importlib.machinery.EXTENSION_SUFFIXES:
                p = os.path.join(base, "_ddp_torch" + suffix)
                if os.path.exists(p):
                    return p
            if os.path.isdir(base):
                built_for += [f[len("_ddp_torch-torch"):-3] for f in sorted(os.listdir(base))
                              if f.startswith("_ddp_torch-torch") and f.endswith(".so")]
            tried.append(base)
    others = (" (built there for torch %s only)" % ", ".join(sorted(set(built_for)))
              if built_for else "")
    raise ImportError(
        "libddp.torch: the backend extension is not built for torch %s (looked in %s)%s. Build "
        "it with `make` in the libddp checkout under this interpreter's torch (needs a C++ "
        "compiler and Python.h) or install the package with `pip install --no-build-isolation "
        "./python`" % (torch.__version__, ", ".join(tried), others))


def _check_built_for(path: str) -> None:
    """Refuses, before loading it, an extension built for another torch: torch's C++ ABI changes
    between minor versions, and loading a mismatched one can crash instead of failing."""
    name = os.path.basename(path)
    if name.startswith("_ddp_torch-torch"):
        built = name[len("_ddp_torch-torch"):-3]
    else:
        try:
            from ._build_info import TORCH_VERSION as built_full  # written by setup.py
        except ImportError:
            return
        built = ".".join(built_full.split("+")[0].split(".")[:2])
    if built != _torch_minor():
        raise ImportError(
            "libddp.torch: %s was built for torch %s, but this interpreter runs torch %s; "
            "rebuild libddp's backend for it (`pip install --no-build-isolation ./python` or "
            "`make`)" % (path, built, torch.__version__))


def _load() -> Any:
    # torch's own types (ProcessGroup, Backend, Store) must be registered before the extension's.
    import torch._C._distributed_c10d  # noqa: F401
    path = extension_path()
    _check_built_for(path)
    spec = importlib.util.spec_from_file_location("libddp._ddp_torch", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_ext = _load()
ProcessGroupDDP = _ext.ProcessGroupDDP


def _create(store: Any, rank: int, size: int, timeout: timedelta) -> Any:
    return _ext.create_process_group(store, rank, size, timeout)


def backend(group: Any = None) -> Any:
    """The ProcessGroupDDP under a "ddp" process group (default: the default group); ValueError
    for a group of another backend."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    if not isinstance(pg, ProcessGroupDDP) and hasattr(pg, "_get_backend"):
        # torch >= 2: a ProcessGroup dispatches to one backend per device.
        try:
            pg = pg._get_backend(torch.device("cpu"))
        except RuntimeError:
            pass
    if not isinstance(pg, ProcessGroupDDP):
        raise ValueError("not a libddp process group: %r" % (pg,))
    return pg


def transport(group: Any = None) -> str:
    """The libddp transport under a "ddp" process group (default: the default group)."""
    return backend(group).transport


def _ordered_batches(original: Any) -> Any:
    """torch 1.x's batch_isend_irecv, issuing a batch on a "ddp" group in one order every rank
    agrees on. torch 2.x tells the backend where a batch starts and ends (startCoalescing,
    endCoalescing) and the backend orders it; torch 1.x does that for NCCL only and issues each
    op at once, so [send to 1, recv from 1] on both ranks of a pair would meet as two sends
    (libddp matches a pair's messages in issue order). The order is the backend's: by peer,
    ascending, and with each peer the lower rank's sends before its recvs, the higher rank's recvs
    first, each kind in the order given. The works come back in the caller's order; batches on
    other backends pass through unchanged."""

    def batch_isend_irecv(p2p_op_list):  # type: ignore[no-untyped-def]
        ops = list(p2p_op_list)
        if not ops or dist.get_backend(ops[0].group) != BACKEND:
            return original(p2p_op_list)
        me = dist.get_rank()

        def key(i: int) -> Any:
            sending = ops[i].op in (dist.isend, dist.send)
            return (ops[i].peer, 0 if sending == (me < ops[i].peer) else 1, i)

        order = sorted(range(len(ops)), key=key)
        works = original([ops[i] for i in order])
        if len(works) != len(ops):
            return works
        out = [None] * len(ops)
        for i, w in zip(order, works):
            out[i] = w
        return out

    batch_isend_irecv.__doc__ = original.__doc__
    batch_isend_irecv._libddp_ordered = True  # type: ignore[attr-defined]
    return batch_isend_irecv


def _monitored_barriers(original: Any) -> Any:
    """torch.distributed.monitored_barrier for "ddp" groups too. torch's Python refuses every
    backend but gloo before it calls the backend ("monitored_barrier is only implemented for GLOO
    backend"), while its C++ dispatches to the backend's monitoredBarrier, which "ddp" implements
    (rank 0 names the ranks that did not arrive; over torch's store, so the group stays usable).
    This passes "ddp" groups to it with torch's own argument handling; every other group goes to
    torch's function unchanged."""
    c10d = dist.distributed_c10d

    def monitored_barrier(group=dist.GroupMember.WORLD, timeout=None,  # type: ignore[no-untyped-def]
                          wait_all_ranks=False):
        if c10d._rank_not_in_group(group) or dist.get_backend(group) != BACKEND:
            return original(group, timeout, wait_all_ranks)
        if timeout is None:
            if hasattr(c10d, "_get_default_timeout"):
                timeout = c10d._get_default_timeout(BACKEND)
            else:
                timeout = c10d.default_pg_timeout
        elif isinstance(timeout, (int, float)):
            timeout = timedelta(seconds=timeout)
        pg = c10d._get_default_group() if group is None else group
        return pg.monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)

    monitored_barrier.__doc__ = original.__doc__
    monitored_barrier._libddp = True  # type: ignore[attr-defined]
    return monitored_barrier


# torch < 2.7's blocking collective functions: each asks the backend for an async Work and waits
# for it at once, and nothing in the call tells the backend so (torch >= 2.7 sets asyncOp).
_BLOCKING = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
             "_all_gather_base", "reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base",
             "all_to_all_single", "all_to_all", "gather", "scatter", "barrier",
             "all_reduce_coalesced", "all_gather_coalesced")


def _waited(original: Any, position: int) -> Any:
    """torch < 2.7's `original` (one of _BLOCKING), telling the backend when the caller waits: with
    async_op=False the call marks this thread (the extension's set_caller_waits) while torch runs
    it, and the backend then runs the collective on this thread, as it does for torch >= 2.7's
    asyncOp = false, instead of handing it to libddp's progress thread and waiting for that thread
    (two thread switches per call: 1.3-1.7x the direct call at 32 KiB-2 MiB, docs/benchmarks.md).
    The mark is this thread's only, restored when the call returns or raises, and read only by
    "ddp" groups: other backends and async_op=True calls are unchanged. `position`: where
    async_op stands among original's parameters."""
    import functools

    mark = _ext.set_caller_waits

    @functools.wraps(original)
    def blocking(*args, **kwargs):  # type: ignore[no-untyped-def]
        async_op = args[position] if len(args) > position else kwargs.get("async_op", False)
        if async_op:
            return original(*args, **kwargs)
        was = mark(True)
        try:
            return original(*args, **kwargs)
        finally:
            mark(was)

    blocking._libddp_waited = True  # type: ignore[attr-defined]
    return blocking


def _mark_blocking_calls() -> None:
    """Wraps torch.distributed's blocking collectives with _waited, where torch's options cannot
    say that the caller waits (torch < 2.7). LIBDDP_TORCH_MARK_BLOCKING=0 leaves torch untouched
    (every call then crosses to libddp's progress thread above 64 KiB, as before)."""
    if _ext.options_have_async_op or os.environ.get("LIBDDP_TORCH_MARK_BLOCKING", "1") == "0":
        return
    import inspect

    c10d = dist.distributed_c10d
    for name in _BLOCKING:
        original = getattr(c10d, name, None)
        if original is None or getattr(original, "_libddp_waited", False):
            continue
        try:
            parameters = list(inspect.signature(original).parameters)
        except (TypeError, ValueError):
            continue
        if "async_op" not in parameters:
            continue
        wrapped = _waited(original, parameters.index("async_op"))
        setattr(c10d, name, wrapped)
        if getattr(dist, name, None) is original:
            setattr(dist, name, wrapped)


def _register() -> None:
    # "ddp" may be registered already by the entry point (libddp._autoload), which imports this
    # module when the first "ddp" group is created: the patches below are applied either way.
    if BACKEND.upper() not in dist.Backend._plugins:
        if int(torch.__version__.split(".")[0]) >= 2:
            # A list: some 2.x releases split a bare string into characters.
            dist.Backend.register_backend(BACKEND, _create, devices=["cpu"])
        else:
            dist.Backend.register_backend(BACKEND, _create)
    if int(torch.__version__.split(".")[0]) < 2 and not getattr(dist.batch_isend_irecv,
                                                                  "_libddp_ordered", False):
        ordered = _ordered_batches(dist.batch_isend_irecv)
        dist.batch_isend_irecv = ordered
        dist.distributed_c10d.batch_isend_irecv = ordered
    if not getattr(dist.monitored_barrier, "_libddp", False):
        monitored = _monitored_barriers(dist.monitored_barrier)
        dist.monitored_barrier = monitored
        dist.distributed_c10d.monitored_barrier = monitored
    _mark_blocking_calls()

_register()
