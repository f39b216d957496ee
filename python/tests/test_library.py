import os
from pathlib import Path

import pytest

import nccl_lossy
from nccl_lossy._library import mapped_library_paths, nccl_plugin_candidates
from conftest import clean_env, run_python


def test_packaged_library_is_the_plugin(lib_path):
    assert lib_path.is_absolute() and lib_path.is_file()
    # Installed packages carry it under the name NCCL looks for with NCCL_NET_PLUGIN=lossy.
    if "site-packages" in lib_path.parts:
        assert lib_path.name == "libnccl-net-lossy.so"
        assert lib_path.parent == Path(nccl_lossy.__file__).resolve().parent / "lib"
    with open(lib_path, "rb") as fh:
        assert fh.read(4) == b"\x7fELF"


def test_library_env_var_wins(monkeypatch, tmp_path, lib_path):
    copy = tmp_path / "libnccl_net_lossy.so"
    copy.write_bytes(lib_path.read_bytes())
    monkeypatch.setenv("NCCL_LOSSY_LIBRARY", str(copy))
    assert nccl_lossy.library_path() == copy.resolve()
    monkeypatch.setenv("NCCL_LOSSY_LIBRARY", str(tmp_path / "missing.so"))
    with pytest.raises(nccl_lossy.LibraryNotFoundError, match="missing.so"):
        nccl_lossy.library_path()


def test_nccl_plugin_name_resolution_matches_nccl():
    assert nccl_plugin_candidates("lossy") == ["lossy", "libnccl-net-lossy.so"]
    assert nccl_plugin_candidates("/opt/x/libnccl-net-lossy.so") == ["/opt/x/libnccl-net-lossy.so"]
    assert nccl_plugin_candidates("libnccl-net-lossy.so") == ["libnccl-net-lossy.so"]
    assert nccl_plugin_candidates("none") == []
    assert nccl_plugin_candidates(None) == []


def test_mapped_library_is_found_in_proc_maps(lib_path):
    code = (
        "import ctypes, sys\n"
        "from nccl_lossy._library import mapped_library_paths\n"
        "assert mapped_library_paths() == [], mapped_library_paths()\n"
        "ctypes.CDLL(sys.argv[1])\n"
        "print(mapped_library_paths())\n"
    )
    proc = run_python(code, args=(str(lib_path),))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == repr([os.path.realpath(lib_path)])
