"""libddp's NumPy API (python/libddp/__init__.py) with real processes: every collective against
a float64 reference computed in one process, bitwise identical results on every rank, the
in-place and TypeError rules, LibddpError carrying libddp's status and text, and init() under
ddprun. World sizes 1-4."""
import multiprocessing
import os
import subprocess
import sys
import traceback
import zlib

import numpy as np
import pytest

import libddp

CTX = multiprocessing.get_context("fork")


def _rank_main(fn, path, rank, world, queue):
    try:
        with libddp.create_with_file_store(path, rank, world, timeout_ms=20000) as g:
            queue.put((rank, "ok", fn(g)))
    except BaseException as e:  # the parent reports it
        queue.put((rank, "error", "%r\n%s" % (e, traceback.format_exc())))


def run_ranks(world, fn, tmp_path, timeout=60):
    """Runs fn(group) on `world` forked processes; returns their results by rank."""
    queue = CTX.Queue()
    path = str(tmp_path / "store")
    procs = [CTX.Process(target=_rank_main, args=(fn, path, r, world, queue))
             for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in range(world):
            rank, kind, value = queue.get(timeout=timeout)
            if kind == "error":
                raise AssertionError("rank %d failed: %s" % (rank, value))
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world)]


def inputs(rank, n, dtype, salt=0):
    rng = np.random.default_rng(1000 * rank + salt)
    if np.issubdtype(dtype, np.integer):
        lo, hi = (0, 4) if dtype == np.uint8 else (-50, 50)
        return rng.integers(lo, hi, n).astype(dtype)
    return rng.standard_normal(n).astype(dtype)


def salt_of(op, dt):
    """A seed per (op, dtype), the same in every process."""
    return zlib.crc32((op + np.dtype(dt).str).encode()) % 1000


REDUCE = {"sum": lambda xs: np.sum(xs, axis=0), "prod": lambda xs: np.prod(xs, axis=0),
          "min": lambda xs: np.min(xs, axis=0), "max": lambda xs: np.max(xs, axis=0)}
DTYPES = [np.float32, np.float64, np.float16, np.int32, np.int64, np.uint8]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_allreduce_every_dtype_and_op(world, tmp_path):
    n = 37  # odd, not a multiple of any world size

    def body(g):
        out = {}
        for dt in DTYPES:
            for op in ("sum", "prod", "min", "max", "avg"):
                x = inputs(g.rank, n, dt, salt=salt_of(op, dt))
                before = x.ctypes.data
                got = g.allreduce(x, op=op)
                assert got is x and x.ctypes.data == before  # in place
                out[(np.dtype(dt).str, op)] = x.tobytes()
        return out

    res = run_ranks(world, body, tmp_path)
    for key in res[0]:
        assert all(r[key] == res[0][key] for r in res), "ranks differ for %s" % (key,)
    for dt in DTYPES:
        for op in ("sum", "prod", "min", "max", "avg"):
            xs = np.stack([inputs(r, n, dt, salt=salt_of(op, dt))
                           for r in range(world)])
            got = np.frombuffer(res[0][(np.dtype(dt).str, op)], dtype=dt)
            ref64 = xs.astype(np.float64)
            if op == "avg":
                ref = REDUCE["sum"](ref64) / world
                if np.issubdtype(dt, np.integer):
                    ref = np.trunc(REDUCE["sum"](xs.astype(np.int64)) / world)
            else:
                ref = REDUCE[op](ref64)
            if np.issubdtype(dt, np.integer):
                np.testing.assert_array_equal(got, ref.astype(np.int64).astype(dt),
                                              err_msg="%s %s" % (dt, op))
            else:
                tol = {np.float16: 2e-2, np.float32: 1e-5, np.float64: 1e-12}[dt]
                np.testing.assert_allclose(got.astype(np.float64), ref, rtol=tol, atol=tol,
                                           err_msg="%s %s" % (dt, op))


@pytest.mark.parametrize("world", [1, 3, 4])
def test_broadcast_allgather_reduce_scatter_barrier(world, tmp_path):
    def body(g):
        r = g.rank
        b = np.full((5, 3), r, dtype=np.complex64)  # any dtype moves as bytes
        g.broadcast(b, root=world - 1)
        ag = g.allgather(np.arange(4, dtype=np.int64) + 100 * r)
        send = (np.arange(world * 6, dtype=np.float64) + r).reshape(world, 6)
        rs = g.reduce_scatter(send, op="max")
        rs_sum = g.reduce_scatter(send.copy(), op="sum")
        g.barrier()
        return b, ag, rs, rs_sum, g.size, g.transport

    res = run_ranks(world, body, tmp_path)
    for r, (b, ag, rs, rs_sum, size, transport) in enumerate(res):
        assert size == world
        assert transport == ("self" if world == 1 else "shm")
        np.testing.assert_array_equal(b, np.full((5, 3), world - 1, dtype=np.complex64))
        assert ag.shape == (world, 4)
        np.testing.assert_array_equal(ag, [np.arange(4) + 100 * j for j in range(world)])
        np.testing.assert_array_equal(rs, np.arange(6) + 6 * r + (world - 1))
        np.testing.assert_array_equal(rs_sum, world * (np.arange(6) + 6 * r)
                                      + sum(range(world)))


def test_split_forms_subgroups(tmp_path):
    def body(g):
        sub = g.split([2, 0])  # ordered as listed: world rank 2 is sub-rank 0
        if sub is None:
            return None
        x = np.array([g.rank], dtype=np.int32)
        sub.allreduce(x)
        out = (sub.rank, sub.size, int(x[0]))
        sub.close()
        return out

    res = run_ranks(3, body, tmp_path)
    assert res[1] is None
    assert res[0] == (1, 2, 2) and res[2] == (0, 2, 2)


def test_bad_arrays_are_type_errors(tmp_path):
    def body(g):
        errors = []
        x = np.zeros((4, 4), np.float32)
        for bad, what in ((x[:, 1], "C-contiguous"), ([1.0, 2.0], "numpy.ndarray"),
                          (np.zeros(3, np.int16), "dtype int16")):
            try:
                g.allreduce(bad)
            except TypeError as e:
                errors.append(what in str(e))
        ro = np.zeros(3, np.float32)
        ro.flags.writeable = False
        try:
            g.allreduce(ro)
        except TypeError as e:
            errors.append("read-only" in str(e))
        try:
            g.allreduce(np.zeros(3, np.float32), op="bxor")
        except ValueError as e:
            errors.append("bxor" in str(e))
        return errors

    (errors,) = run_ranks(1, body, tmp_path)
    assert errors == [True] * 5


def test_mismatch_is_libddp_error_with_status_and_text(tmp_path):
    def body(g):
        x = np.zeros(10 + g.rank, np.float32)  # ranks disagree on the count
        try:
            g.allreduce(x)
        except libddp.LibddpError as e:
            return e.status, e.status_name, e.message
        return None

    res = run_ranks(2, body, tmp_path)
    for status, name, message in res:
        assert name == "DDP_ERR_MISMATCH" and status == -4
        assert "10" in message and "11" in message, message


def test_init_under_ddprun(tmp_path):
    build = os.environ.get("LIBDDP_BUILD_DIR")
    if not build or not os.path.exists(os.path.join(build, "ddprun")):
        pytest.skip("ddprun not built (set LIBDDP_BUILD_DIR)")
    script = tmp_path / "w.py"
    script.write_text(
        "import numpy as np, libddp\n"
        "g = libddp.init(timeout_ms=20000)\n"
        "x = np.array([g.rank + 1.0])\n"
        "g.allreduce(x)\n"
        "print('rank', g.rank, 'of', g.size, 'sum', x[0], flush=True)\n"
        "g.close()\n")
    out = subprocess.run([os.path.join(build, "ddprun"), "-n", "3", "--timeout", "60",
                          sys.executable, str(script)], capture_output=True, text=True,
                         timeout=90, env=dict(os.environ))
    assert out.returncode == 0, out.stderr
    for r in range(3):
        assert "rank %d of 3 sum 6.0" % r in out.stdout, out.stdout
