#!/bin/sh
# Runs a pytest file that needs a package beyond torch (Lightning, DeepSpeed), or skips it for
# ctest (exit 77, SKIP_RETURN_CODE) naming what is missing and how to install it, never fails
# for want of it. tools/test_setup.sh installs the packages when it can (root, online).
# Usage: run_if_importable.sh PYTHON MODULE PIP_REQUIREMENT TEST_FILE [pytest args...]
set -u
py=$1 module=$2 requirement=$3 file=$4
shift 4
# A sanitized build (tests/python.cmake) hands the runtime the interpreter must preload as
# DDP_TEST_PRELOAD: this shell must not load it (TSan's runtime crashes sh).
if [ -n "${DDP_TEST_PRELOAD:-}" ]; then
    LD_PRELOAD=$DDP_TEST_PRELOAD
    export LD_PRELOAD
fi
if ! err=$("$py" -c "import $module" 2>&1); then
    echo "SKIP: $py cannot import $module ($(printf '%s\n' "$err" | tail -n 1)); install it with:"
    echo "  $py -m pip install torch==2.13.0 $requirement   (torch pinned in the same command)"
    exit 77
fi
exec "$py" -m pytest -q -p no:cacheprovider -p no:warnings "$file" "$@"
