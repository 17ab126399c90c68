"""libddp as a torch.distributed backend. Importing this module registers backend "ddp"::

    import libddp.torch
    torch.distributed.init_process_group("ddp")          # env://, tcp://, file:// as usual
    model = torch.nn.parallel.DistributedDataParallel(model)

The backend is a C++ extension (``_ddp_torch.so``) built against the installed torch by
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

__all__ = ["BACKEND", "extension_path", "ProcessGroupDDP", "transport"]

BACKEND = "ddp"


def extension_path() -> str:
    """The path of the compiled backend ($LIBDDP_TORCH_EXTENSION wins)."""
    explicit = os.environ.get("LIBDDP_TORCH_EXTENSION")
    if explicit:
        return explicit
    tried = []
    for d in _candidate_dirs():
        for sub in (".", os.path.join("python", "libddp")):
            base = os.path.normpath(os.path.join(d, sub))
            for suffix in [".so"] + importlib.machinery.EXTENSION_SUFFIXES:
                p = os.path.join(base, "_ddp_torch" + suffix)
                if os.path.exists(p):
                    return p
            tried.append(base)
    raise ImportError(
        "libddp.torch: the backend extension _ddp_torch is not built (looked in %s). Build it "
        "with `make` in the libddp checkout (needs python3-dev, libtorch-dev and pybind11-dev) "
        "or install the package with `pip install ./python`" % ", ".join(tried))


def _load() -> Any:
    # torch's own types (ProcessGroup, Store) must be registered before the extension's.
    import torch._C._distributed_c10d  # noqa: F401
    path = extension_path()
    spec = importlib.util.spec_from_file_location("libddp._ddp_torch", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_ext = _load()
ProcessGroupDDP = _ext.ProcessGroupDDP


def _create(store: Any, rank: int, size: int, timeout: timedelta) -> Any:
    return _ext.create_process_group(store, rank, size, timeout)


def transport(group: Any = None) -> str:
    """The libddp transport under a "ddp" process group (default: the default group)."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    if not isinstance(pg, ProcessGroupDDP):
        raise ValueError("not a libddp process group: %r" % (pg,))
    return pg.transport


if BACKEND.upper() not in dist.Backend._plugins:
    dist.Backend.register_backend(BACKEND, _create)
