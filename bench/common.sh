# Sourced by the bench/ scripts that compare with PyTorch (trainer_vs_pytorch.sh,
# gpt_vs_pytorch.sh).
# bench_have_torch PYTHON: prints 1 when PYTHON imports torch.distributed, installing Debian's
# python3-torch first when it is missing and we are root; 0 otherwise (the caller then skips its
# PyTorch columns).
# bench_ddp_extension PYTHON BUILD: succeeds when BUILD has the torch backend built for PYTHON's
# torch (build/python/libddp/_ddp_torch-torch<major.minor>.so, python/python.cmake).
bench_ddp_extension() {
    v=$("$1" -c "import torch; print('.'.join(torch.__version__.split('+')[0].split('.')[:2]))" 2>/dev/null) &&
        [ -f "$2/python/libddp/_ddp_torch-torch$v.so" ]
}

bench_have_torch() {
    if "$1" -c 'import torch.distributed' 2>/dev/null; then
        echo 1
    elif [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "bench: installing python3-torch (Debian)" >&2
        apt-get install -y python3-torch >/dev/null 2>&1
        if "$1" -c 'import torch.distributed' 2>/dev/null; then echo 1; else echo 0; fi
    else
        echo 0
    fi
}
