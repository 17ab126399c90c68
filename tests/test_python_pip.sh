#!/usr/bin/env bash
# `pip install ./python` works: into a fresh virtual environment (seeing the interpreter's torch
# and numpy), from a copy of python/ outside the checkout; then the installed package - not the
# source tree - runs a 2-rank allreduce through the NumPy API and through torch's backend "ddp".
# On torch >= 2.5 the second rank does not import libddp.torch: the package's "torch.backends"
# entry point registers "ddp" at `import torch`. Last, the installed extension claimed for
# another torch (its _build_info.py edited) is refused at import with both versions named.
# Usage: test_python_pip.sh PYTHON SOURCE_DIR BUILD_DIR
set -euo pipefail
python=$1 source=$2 build=$3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp -r "$source/python" "$work/src"
rm -rf "$work/src/build" "$work/src"/*.egg-info
# --without-pip: the venv uses the interpreter's own pip and setuptools (a venv's seeded
# setuptools 65 cannot build a wheel without the `wheel` package, and nothing may be downloaded
# here); what pip installs still goes into the venv.
"$python" -m venv --system-site-packages --without-pip "$work/venv"
LIBDDP_SOURCE_DIR=$source LIBDDP_BUILD_DIR=$build \
  nice "$work/venv/bin/python" -m pip install -q --no-build-isolation --no-deps "$work/src"

cat > "$work/check.py" <<'PY'
import os, socket, sys
import numpy as np, torch, torch.distributed as dist, torch.multiprocessing as mp

def autoloads():
    major, minor = (int(v) for v in torch.__version__.split(".")[:2])
    return (major, minor) >= (2, 5)

def rank_main(rank, port, store_path):
    import libddp
    if rank == 1 and autoloads():
        # Registered by the entry point, before any import of libddp.torch.
        assert "DDP" in dist.Backend._plugins, dist.Backend._plugins
    else:
        import libddp.torch
    site = os.path.dirname(libddp.__file__)
    assert "site-packages" in site, site
    assert libddp.library_path().startswith(site), libddp.library_path()
    if rank == 0 or not autoloads():
        assert libddp.torch.extension_path().startswith(site), libddp.torch.extension_path()
    with libddp.create_with_file_store(store_path, rank, 2) as g:
        x = np.array([rank + 1.0]); g.allreduce(x); assert x[0] == 3.0, x
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("ddp", rank=rank, world_size=2)
    t = torch.full((3,), rank + 1.0); dist.all_reduce(t)
    assert t.tolist() == [3.0] * 3, t
    dist.destroy_process_group()

if __name__ == "__main__":
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    mp.spawn(rank_main, args=(port, sys.argv[1]), nprocs=2)
    print("installed package: ok")
PY
cd "$work"
env -u PYTHONPATH -u LIBDDP_BUILD_DIR -u LIBDDP_LIBRARY "$work/venv/bin/python" check.py "$work/store"

# Another torch's build: refused before loading, naming both versions.
info=$("$work/venv/bin/python" -c "import libddp, os; print(os.path.join(os.path.dirname(libddp.__file__), '_build_info.py'))")
echo "TORCH_VERSION = '0.99.0'" >"$info"
if out=$(env -u PYTHONPATH -u LIBDDP_BUILD_DIR "$work/venv/bin/python" -c "import libddp.torch" 2>&1); then
    echo "libddp.torch imported although built for torch 0.99"; exit 1
fi
echo "$out" | grep -q "was built for torch 0.99, but this interpreter runs torch" ||
    { echo "mismatch not named: $out"; exit 1; }
echo "mismatched build refused: ok"
