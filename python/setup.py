"""Installs the libddp Python package: the NumPy API (pure Python over ctypes), libddp.so copied
into the package, and - when torch is importable - the torch.distributed backend compiled here
against the installed torch. The C library is built first with CMake when it is not built yet.

    python3 -m pip install --no-build-isolation ./python

(--no-build-isolation: use the installed setuptools and torch instead of downloading them.)
LIBDDP_SOURCE_DIR (default: this file's parent directory) and LIBDDP_BUILD_DIR (default:
<source>/build) say where the checkout and its CMake build are."""
import os
import shutil
import subprocess

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.abspath(os.environ.get("LIBDDP_SOURCE_DIR", os.path.join(HERE, "..")))
BUILD = os.path.abspath(os.environ.get("LIBDDP_BUILD_DIR", os.path.join(SOURCE, "build")))


def libddp_so():
    path = os.path.join(BUILD, "libddp.so.0")
    if not os.path.exists(path):
        if not os.path.exists(os.path.join(SOURCE, "CMakeLists.txt")):
            raise SystemExit("libddp: no CMakeLists.txt in %s; set LIBDDP_SOURCE_DIR to the libddp "
                             "checkout" % SOURCE)
        subprocess.check_call(["cmake", "-S", SOURCE, "-B", BUILD, "-DCMAKE_BUILD_TYPE=Release",
                               "-DDDP_BUILD_TESTS=OFF", "-DDDP_TORCH=OFF"])
        subprocess.check_call(["cmake", "--build", BUILD, "--target", "ddp", "-j2"])
    return path


class BuildPyWithLibrary(build_py):
    """Puts libddp.so.0 next to the package's modules, where libddp/__init__.py and the
    extension's $ORIGIN rpath find it, and records which torch the extension is built for
    (libddp.torch refuses to load it under another torch)."""

    def run(self):
        super().run()
        target = os.path.join(self.build_lib, "libddp")
        os.makedirs(target, exist_ok=True)
        shutil.copy2(libddp_so(), os.path.join(target, "libddp.so.0"))
        with open(os.path.join(target, "_build_info.py"), "w") as f:
            f.write("# Written by setup.py: the torch the backend extension was built against.\n")
            f.write("TORCH_VERSION = %r\n" % (TORCH_VERSION,))


cmdclass = {"build_py": BuildPyWithLibrary}
ext_modules = []
TORCH_VERSION = None
entry_points = {}
try:
    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension
except ImportError:
    print("libddp: torch is not importable; installing without the torch backend")
else:
    TORCH_VERSION = torch.__version__
    # torch >= 2.5 runs the "torch.backends" entry points at the end of `import torch`: "ddp" is
    # then registered without `import libddp.torch` (libddp/_autoload.py).
    entry_points = {"torch.backends": ["libddp = libddp._autoload:register"]}
    libddp_so()  # the extension links against it
    ext_modules.append(CppExtension(
        "libddp._ddp_torch", ["libddp/csrc/process_group_ddp.cpp"],
        include_dirs=[os.path.join(SOURCE, "include")], library_dirs=[BUILD],
        libraries=["ddp"], extra_compile_args=["-O2"],
        extra_link_args=["-Wl,-rpath,$ORIGIN"]))
    cmdclass["build_ext"] = BuildExtension

setup(
    name="libddp",
    version="0.1.0",
    description="libddp: data-parallel collectives for NumPy and a torch.distributed backend",
    packages=["libddp"],
    package_data={"libddp": ["csrc/*.cpp"]},
    python_requires=">=3.8",
    install_requires=["numpy"],
    ext_modules=ext_modules,
    entry_points=entry_points,
    cmdclass=cmdclass,
)
