import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import nccl_lossy
from nccl_lossy._library import mapped_library_paths, nccl_plugin_candidates
from conftest import TESTS, clean_env, run_python

PYTHON_DIR = TESTS.parent


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


def test_a_plugin_name_with_spaces_is_read_as_nccl_reads_it(lib_path):
    # NCCL splits NCCL_NET_PLUGIN at commas with strtok_r (empty entries skipped) and opens each
    # entry as it is, spaces included (src/plugin/net.cc, src/plugin/plugin_open.cc):
    # " lossy" opens no library. It was taken as "lossy", so apply() kept a value with which
    # NCCL then found no lossy network at init.
    from nccl_lossy import LossyConfigError
    from nccl_lossy.network import names_this_plugin

    assert nccl_plugin_candidates(" lossy") == [" lossy", "libnccl-net- lossy.so"]
    assert nccl_plugin_candidates(",lossy,") == ["lossy", "libnccl-net-lossy.so"]
    assert nccl_plugin_candidates("NONE") == []
    assert not names_this_plugin(" lossy") and not names_this_plugin(f"{lib_path} ")
    assert names_this_plugin(",lossy") and names_this_plugin("lossy, other")
    with pytest.raises(LossyConfigError, match=r"NCCL_NET_PLUGIN= lossy \(in the environment\) names another"):
        nccl_lossy.LossyNetwork().resolved(base={"NCCL_NET_PLUGIN": " lossy"})


def test_this_plugin_anywhere_in_a_plugin_list_is_the_one_nccl_uses(lib_path):
    # NCCL loads every entry of NCCL_NET_PLUGIN in order and gives the communicator the first
    # whose network is named NCCL_NET (src/plugin/net.cc, ncclNetInit), so with NCCL_NET=lossy
    # "other,lossy" (a cluster's plugin set by its modules, this one after it) runs this
    # plugin. Only the first entry was read: apply() refused what NCCL accepts.
    from nccl_lossy.network import names_this_plugin

    assert names_this_plugin("other,lossy") and names_this_plugin(f"libnccl-net-ofi.so,{lib_path}")
    assert not names_this_plugin("other,libnccl-net-ofi.so")
    resolved = nccl_lossy.LossyNetwork().resolved(base={"NCCL_NET_PLUGIN": f"other,{lib_path}"})
    assert resolved.library == lib_path.resolve()
    nccl_lossy.LossyNetwork(library=lib_path).resolved(base={"NCCL_NET_PLUGIN": f"other,{lib_path}"})


def test_nccl_net_plugin_none_is_refused_as_no_plugin_not_as_another_library():
    # NCCL reads NCCL_NET_PLUGIN=none (any case) as "load no external plugin"
    # (src/plugin/net.cc): refused, but the error said it "names another library" NCCL "would
    # load", sending the user to look for a library that does not exist.
    for value in ("none", "NONE"):
        with pytest.raises(nccl_lossy.LossyConfigError) as err:
            nccl_lossy.LossyNetwork().resolved(base={"NCCL_NET_PLUGIN": value})
        said = str(err.value)
        assert "no external plugin" in said and "another library" not in said, said


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


def _source_tree(tmp_path):
    """A source checkout's shape: <repo>/Cargo.toml and <repo>/python/{setup.py,src,...}."""
    repo = tmp_path / "repo"
    shutil.copytree(PYTHON_DIR / "src" / "nccl_lossy", repo / "python" / "src" / "nccl_lossy",
                    ignore=shutil.ignore_patterns("__pycache__", "lib"))
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy2(PYTHON_DIR / name, repo / "python" / name)
    (repo / "Cargo.toml").write_text("")
    return repo


def _build_in(target_dir, lib_path):
    """A library as Cargo leaves it in ``target_dir``; a trailing marker tells it from others."""
    built = target_dir / "release" / "libnccl_net_lossy.so"
    built.parent.mkdir(parents=True)
    built.write_bytes(lib_path.read_bytes() + b"\0cargo-target-dir")
    return built


def test_a_source_checkout_finds_the_library_under_cargo_target_dir(tmp_path, lib_path):
    repo = _source_tree(tmp_path)
    built = _build_in(tmp_path / "elsewhere", lib_path)
    env = clean_env(PYTHONPATH=repo / "python" / "src", CARGO_TARGET_DIR=tmp_path / "elsewhere")
    env.pop("NCCL_LOSSY_LIBRARY", None)
    proc = run_python("import nccl_lossy; print(nccl_lossy.library_path())", env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == str(built)


def test_setup_packages_the_library_under_cargo_target_dir(tmp_path, lib_path):
    repo = _source_tree(tmp_path)
    built = _build_in(tmp_path / "elsewhere", lib_path)
    env = clean_env(CARGO_TARGET_DIR=tmp_path / "elsewhere")
    env.pop("NCCL_LOSSY_LIBRARY", None)
    out = tmp_path / "build"
    proc = subprocess.run(
        [sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(out)],
        cwd=repo / "python", env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    packaged = out / "nccl_lossy" / "lib" / "libnccl-net-lossy.so"
    assert packaged.read_bytes() == built.read_bytes()
