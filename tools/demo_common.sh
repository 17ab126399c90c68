# Sourced by tools/demo.sh and tools/demo_gpt.sh: install what a demo needs (Debian/Ubuntu) when it
# is missing, then build and check that the demo's programs exist.
# demo_prepare TAG "PACKAGES" "WHAT THE BUILD NEEDS" PROGRAM...   (uses $BUILD)
demo_prepare() {
    tag=$1 need=$2 needs_text=$3
    shift 3
    missing=""
    if command -v dpkg-query >/dev/null 2>&1; then
        for p in $need; do
            if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
                missing="$missing $p"
            fi
        done
    else
        echo "$tag: not a Debian-like system (no dpkg-query); make sure these are installed: $need" >&2
    fi
    if [ -n "$missing" ]; then
        if [ "$(id -u)" = 0 ]; then
            echo "$tag: installing$missing"
            apt-get update
            DEBIAN_FRONTEND=noninteractive apt-get install -y $missing
        else
            echo "$tag: missing packages:$missing" >&2
            echo "$tag: install them with:" >&2
            echo "    sudo apt-get update && sudo apt-get install -y$missing" >&2
            exit 1
        fi
    fi

    echo "$tag: building into $BUILD/"
    make BUILD="$BUILD" >/dev/null || make BUILD="$BUILD"
    for f in "$@"; do
        if [ ! -x "$BUILD/$f" ]; then
            echo "$tag: $BUILD/$f was not built; see the cmake messages above ($needs_text)" >&2
            exit 1
        fi
    done
}
