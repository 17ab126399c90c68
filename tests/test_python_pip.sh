#!/usr/bin/env bash
# `pip install ./python` works: into a fresh virtual environment (seeing the system's torch and
# numpy), from a copy of python/ outside the checkout; then the installed package - not the
# source tree - runs a 2-rank allreduce through the NumPy API and through torch's backend "ddp".
# Usage: test_python_pip.sh PYTHON SOURCE_DIR BUILD_DIR
set -euo pipefail
python=$1 source=$2 build=$3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp -r "$source/python" "$work/src"
rm -rf "$work/src/build" "$work/src"/*.egg-info
"$python" -m venv --system-site-packages "$work/venv"
LIBDDP_SOURCE_DIR=$source LIBDDP_BUILD_DIR=$build \
  nice "$work/venv/bin/python" -m pip install -q --no-build-isolation --no-deps "$work/src"

cat > "$work/check.py" <<'PY'
import os, socket, sys
import numpy as np, torch, torch.distributed as dist, torch.multiprocessing as mp

def rank_main(rank, port, store_path):
    import libddp, libddp.torch
    site = os.path.dirname(libddp.__file__)
    assert "site-packages" in site, site
    assert libddp.library_path().startswith(site), libddp.library_path()
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
