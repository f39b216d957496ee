"""Build hook: puts the plugin library into the package as ``nccl_lossy/lib/libnccl-net-lossy.so``.

Where the library comes from, first match wins:

1. ``NCCL_LOSSY_LIBRARY``: the path of an already built library;
2. ``<target>/release/libnccl_net_lossy.so``, the output of ``cargo build --release``, where
   ``<target>`` is ``CARGO_TARGET_DIR`` when set (relative to the repository root) and
   ``<repository>/target`` otherwise;
3. otherwise, when this directory sits in the repository and ``cargo`` is on ``PATH``, the hook
   runs ``cargo build --release --lib`` in the repository root and uses its output (found as
   in 2, or where ``cargo metadata`` says the target directory is, e.g. a ``build.target-dir``
   in a Cargo configuration file).

If none of these gives a library the build stops with a message saying how to provide one.
"""

import json
import os
import shutil
import subprocess
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
CARGO_NAME = "libnccl_net_lossy.so"
PACKAGED_NAME = "libnccl-net-lossy.so"


def find_library():
    explicit = os.environ.get("NCCL_LOSSY_LIBRARY")
    if explicit:
        path = Path(explicit).expanduser().resolve()
        if not path.is_file():
            raise SystemExit(f"NCCL_LOSSY_LIBRARY={explicit} does not name a file")
        return path
    built = target_dir() / "release" / CARGO_NAME
    if built.is_file():
        return built
    if (REPO / "Cargo.toml").is_file() and shutil.which("cargo"):
        print(f"nccl-lossy: no release build of the plugin at {built}; running cargo build --release --lib")
        subprocess.run(["cargo", "build", "--release", "--lib"], cwd=REPO, check=True)
        if built.is_file():
            return built
        meta = subprocess.run(
            ["cargo", "metadata", "--format-version", "1", "--no-deps"],
            cwd=REPO, check=True, capture_output=True, text=True,
        )
        built = Path(json.loads(meta.stdout)["target_directory"]) / "release" / CARGO_NAME
        if built.is_file():
            return built
    raise SystemExit(
        f"nccl-lossy: the plugin library is not built (looked for {built}). Run `cargo build "
        "--release --lib` in the repository root (needs a Rust toolchain and libclang), or set "
        "NCCL_LOSSY_LIBRARY to the path of a built libnccl_net_lossy.so, then install again."
    )


def target_dir():
    """Cargo's target directory: CARGO_TARGET_DIR (relative to the repository root, where
    cargo runs) when set, else <repository>/target."""
    given = os.environ.get("CARGO_TARGET_DIR", "").strip()
    return REPO / Path(given).expanduser() if given else REPO / "target"


class BuildPyWithLibrary(build_py):
    def run(self):
        super().run()
        source = find_library()
        target = Path(self.build_lib) / "nccl_lossy" / "lib" / PACKAGED_NAME
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target)
        print(f"nccl-lossy: packaged {source} as {target}")


cmdclass = {"build_py": BuildPyWithLibrary}

try:  # The wheel carries a native library: tag it for this platform, not as pure Python.
    try:
        from setuptools.command.bdist_wheel import bdist_wheel
    except ImportError:
        from wheel.bdist_wheel import bdist_wheel

    class PlatformWheel(bdist_wheel):
        def finalize_options(self):
            super().finalize_options()
            self.root_is_pure = False

        def get_tag(self):
            _, _, plat = super().get_tag()
            return "py3", "none", plat

    cmdclass["bdist_wheel"] = PlatformWheel
except ImportError:
    pass

setup(cmdclass=cmdclass)
