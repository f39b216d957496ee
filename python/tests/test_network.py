import os
import textwrap

import pytest

import nccl_lossy
from nccl_lossy import LossyConfigError, LossyNetwork
from nccl_lossy.network import (
    allowed_protocols,
    check_profile,
    format_overrides,
    parse_overrides,
    same_overrides,
)
from conftest import clean_env, run_harness, run_python


INTRA_NODE = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_NVLS_ENABLE": "0"}


def profile(tmp_path, text, name="p.toml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_env_contents(tmp_path, lib_path):
    prof = profile(tmp_path, 'seed = 3\neffect = "retransmit"\n[model]\nkind = "uniform"\nrate = 0.01\n')
    net = LossyNetwork(profile=prof, set={"model.rate": 0.05, "seed": 7}, stats_dir=tmp_path / "run")
    env = net.env(base={})
    assert env == {
        "NCCL_NET_PLUGIN": str(lib_path),
        "NCCL_NET": "lossy",
        "NCCL_LOSSY_PROFILE": str(prof.resolve()),
        "NCCL_LOSSY_SET": "model.rate=0.05;seed=7",
        "NCCL_LOSSY_STATS": str((tmp_path / "run").resolve()),
        **INTRA_NODE,
    }
    assert os.path.isabs(env["NCCL_NET_PLUGIN"]) and os.path.isfile(env["NCCL_NET_PLUGIN"])


def test_default_profile_needs_no_guard():
    assert LossyNetwork(intra_node="native").env(base={}) == {
        "NCCL_NET_PLUGIN": str(nccl_lossy.library_path()),
        "NCCL_NET": "lossy",
    }



def test_traffic_between_gpus_of_one_node_goes_through_the_plugin_unless_told_not_to():
    # NCCL never sends the traffic between GPUs of one node through a net plugin (P2P, shared
    # memory, NVLS): a torchrun job on one node met no loss at all, as `lossy run` now says.
    env = LossyNetwork().env(base={})
    assert {k: env.get(k) for k in INTRA_NODE} == INTRA_NODE
    # the list is the plugin library's, the one `lossy run` sets
    assert LossyNetwork().check()["intra_node_through_net"] == INTRA_NODE
    assert not set(INTRA_NODE) & set(LossyNetwork(intra_node="native").env(base={}))
    # A value the user chose stands.
    with pytest.warns(UserWarning, match="NCCL_P2P_DISABLE=0 is kept"):
        env = LossyNetwork().env(base={"NCCL_P2P_DISABLE": "0"})
    assert "NCCL_P2P_DISABLE" not in env and env["NCCL_SHM_DISABLE"] == "1"
    with pytest.raises(LossyConfigError, match=r"intra_node='nvlink'.*allowed: 'net', 'native'"):
        LossyNetwork(intra_node="nvlink")


UNIFORM = 'model = { kind = "uniform", rate = 0.01 }\n'


@pytest.mark.parametrize(
    "text",
    [
        'effect = "zero"\n' + UNIFORM,
        'effect = "retransmit"\n' + UNIFORM + '[[rules]]\ncollective = "AllReduce"\neffect = "stale"\n',
        'model = { kind = "none" }\n[[rules]]\nphase = "backward"\neffect = "bitflip"\n'
        'model = { kind = "gilbert_elliott", rate = 0.01, mean_burst = 4 }\n',
    ],
)
def test_corrupting_profiles_force_simple(tmp_path, text):
    env = LossyNetwork(profile=profile(tmp_path, text)).env(base={})
    assert env["NCCL_PROTO"] == "Simple"


@pytest.mark.parametrize(
    "text",
    [
        "seed = 1\n",  # no model: lossless (and the engine's default effect is retransmit)
        'effect = "zero"\nmodel = { kind = "none" }\n',  # a corrupting effect that never fires
        UNIFORM,  # loses packets, but the default effect (retransmit) never corrupts data
    ],
)
def test_profiles_that_cannot_corrupt_leave_the_protocol_alone(tmp_path, text):
    assert "NCCL_PROTO" not in LossyNetwork(profile=profile(tmp_path, text)).env(base={})


def test_overrides_decide_the_guard_too(tmp_path):
    assert LossyNetwork(set="effect=bitflip").env(base={})["NCCL_PROTO"] == "Simple"
    zero = profile(tmp_path, 'effect = "zero"\n' + UNIFORM)
    assert "NCCL_PROTO" not in LossyNetwork(zero, set={"effect": "retransmit"}).env(base={})
    answer = check_profile(zero, "effect=stale;model.rate=0.02")
    assert answer["corrupts_data"] and answer["profile"]["defaults"]["effect"] == "stale"
    assert "expected loss 2%" in answer["summary"]


def test_the_embedded_default_is_read_from_the_library():
    answer = check_profile(None)
    assert answer["origin"] == "embedded default"
    assert (answer["corrupts_data"], answer["lossless"]) == (False, False)
    assert "uniform(rate=0.01), effect retransmit" in answer["summary"]


def test_user_nccl_proto_is_respected_or_refused(tmp_path):
    net = LossyNetwork(profile=profile(tmp_path, 'effect = "zero"\n' + UNIFORM))
    assert "NCCL_PROTO" not in net.env(base={"NCCL_PROTO": "Simple"})
    assert "NCCL_PROTO" not in net.env(base={"NCCL_PROTO": "^LL,LL128"})
    with pytest.raises(LossyConfigError, match="NCCL_PROTO=LL128,Simple allows it"):
        net.env(base={"NCCL_PROTO": "LL128,Simple"})
    assert allowed_protocols("^LL") == {"LL128", "SIMPLE"}
    # NCCL 2.24+ reads `list;func:list;...`: a collective's own list counts too, and a value
    # without a first list leaves the collectives it does not name at NCCL's default (all).
    assert allowed_protocols("Simple;allreduce:LL") == {"LL", "SIMPLE"}
    assert allowed_protocols("Simple;allreduce:^LL,LL128") == {"SIMPLE"}
    assert allowed_protocols("allreduce:Simple") == {"LL", "LL128", "SIMPLE"}
    with pytest.raises(LossyConfigError, match="allows it"):
        net.env(base={"NCCL_PROTO": "Simple;allreduce:LL"})
    assert "NCCL_PROTO" not in net.env(base={"NCCL_PROTO": "Simple;AllReduce:^LL,LL128"})


def test_overrides_are_formatted_as_the_plugin_reads_them():
    assert format_overrides({"model.rate": 0.05, "rules.0.enabled": True}) == "model.rate=0.05;rules.0.enabled=true"
    assert format_overrides([("seed", 7)]) == "seed=7"
    assert format_overrides(" seed=7; ") == "seed=7"


def test_a_quoted_semicolon_is_one_override_as_the_plugin_reads_it(tmp_path):
    # docs/loss-models.md: a `;` inside a quoted value does not split the list. The plugin
    # reads `description="a; b"` as one override; the helper must not refuse it as two.
    net = LossyNetwork(set='description="a; b";seed=7', loss_rate=0.02)
    assert net.check()["profile"]["description"] == "a; b"
    assert net.check()["profile"]["seed"] == 7
    assert parse_overrides('description="a; b";seed=7') == [("description", "a; b"), ("seed", "7")]
    assert parse_overrides("description='x;y'") == [("description", "x;y")]
    # the environment's value, compared with the helper's own, is split the same way
    theirs = 'seed=7;description="a; b"'
    assert same_overrides(theirs, 'description="a; b";seed=7')
    assert not same_overrides(theirs, 'description="a; c";seed=7')
    with pytest.raises(LossyConfigError, match="unterminated"):
        parse_overrides('description="a; b')


def test_bad_profiles_are_reported_with_their_path(tmp_path):
    with pytest.raises(LossyConfigError, match="does not exist"):
        LossyNetwork(profile=tmp_path / "nope.toml")
    broken = profile(tmp_path, "effect = \n", "broken.toml")
    with pytest.raises(LossyConfigError, match="broken.toml:1: not valid TOML"):
        LossyNetwork(profile=broken).env(base={})
    wrong = profile(tmp_path, 'effect = "drop"\n' + UNIFORM, "wrong.toml")
    with pytest.raises(LossyConfigError, match='wrong.toml:1: effect = "drop": unknown effect; allowed: "zero"'):
        LossyNetwork(profile=wrong).env(base={})
    with pytest.raises(LossyConfigError, match="model.rat"):
        LossyNetwork(set={"model.rat": 0.1}).env(base={})
    with pytest.raises(LossyConfigError):
        LossyNetwork(set={"a;b": 1})


def test_a_base_environment_that_is_no_mapping_is_refused_naming_it():
    # env(base=[...]) failed with AttributeError ('list' object has no attribute 'get').
    net = nccl_lossy.LossyNetwork()
    for call in (net.env, net.resolved):
        for bad in ([1], "PATH=/bin", 3):
            with pytest.raises(nccl_lossy.LossyConfigError) as err:
                call(base=bad)
            assert "base=" in str(err.value) and "mapping" in str(err.value), err.value


def test_a_nul_byte_in_a_value_is_refused_naming_the_keyword():
    # A NUL byte (no environment variable or path can hold one) gave a bare "ValueError:
    # embedded null byte" from deep inside subprocess or realpath, naming no keyword.
    cases = [
        ({"set": {"effect": "ze\x00ro"}}, "effect"),
        ({"set": "description=a\x00b"}, "description"),
        ({"profile": "a\x00b.toml"}, "profile"),
        ({"stats_dir": "st\x00ats"}, "stats_dir"),
        ({"library": "lib\x00.so"}, "library"),
    ]
    for kwargs, name in cases:
        with pytest.raises(nccl_lossy.LossyConfigError) as err:
            nccl_lossy.LossyNetwork(**kwargs).env(base={})
        said = str(err.value)
        assert name in said and "NUL" in said, (kwargs, said)


def test_a_value_that_is_not_utf8_is_refused_naming_the_keyword(tmp_path):
    # The plugin reads its variables as UTF-8 and refuses any other value at init ("... is not
    # valid UTF-8"). A profile in a directory whose name is not UTF-8 failed with a Python
    # traceback of the child that asks the plugin (UnicodeEncodeError); a stats_dir or
    # overrides there passed env() and would have failed every rank's init.
    folder = os.path.join(os.fsencode(tmp_path), b"run\xff")
    os.mkdir(folder)
    profile = os.path.join(folder, b"p.toml")
    with open(profile, "w") as out:
        out.write("seed = 3\n")
    cases = [
        ({"profile": os.fsdecode(profile)}, "profile", "NCCL_LOSSY_PROFILE"),
        ({"stats_dir": os.fsdecode(os.path.join(folder, b"stats"))}, "stats_dir", "NCCL_LOSSY_STATS"),
        ({"set": {"description": "r\udcffn"}}, "set", "NCCL_LOSSY_SET"),
    ]
    for kwargs, name, variable in cases:
        with pytest.raises(nccl_lossy.LossyConfigError) as err:
            nccl_lossy.LossyNetwork(**kwargs).env(base={})
        said = str(err.value)
        assert f"{name}=" in said and "not valid UTF-8" in said and variable in said, (kwargs, said)
        assert "Traceback" not in said, said


def test_a_profile_that_is_no_file_says_what_it_is_instead_of_that_it_does_not_exist(tmp_path, monkeypatch):
    # A directory (the runs' folder passed as profile=) or an empty string (a config field left
    # empty, which Path reads as the working directory) exists: "does not exist" sends the
    # user looking for a typo that is not there.
    with pytest.raises(LossyConfigError, match=rf"profile={str(tmp_path)!r}: {tmp_path} is a directory, "
                       r"not a file; allowed: the path of a TOML profile, or None for the plugin's embedded default"):
        LossyNetwork(profile=str(tmp_path))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(LossyConfigError, match=r"profile='': names no file; allowed: the path of a TOML profile, "
                       r"or None"):
        LossyNetwork(profile="")
    with pytest.raises(LossyConfigError, match=rf"profile='nope.toml': {tmp_path / 'nope.toml'} does not exist"):
        LossyNetwork(profile="nope.toml")


def test_a_library_that_is_not_this_plugin_is_named_with_what_it_is(tmp_path):
    # library= (or NCCL_LOSSY_LIBRARY) naming a directory, a file that is no shared library, or
    # another library (libc): the answer was a child interpreter's traceback, or "predates
    # ncclLossyCheckProfile: install matching versions" for a library that is no build of
    # this plugin at all.
    libc = next(line.split()[-1] for line in open("/proc/self/maps") if "/libc.so" in line)
    text = tmp_path / "libnccl-net-lossy.so"
    text.write_text("not a shared library\n")
    cases = [
        (tmp_path, r"cannot be loaded: .*Is a directory"),
        (text, r"cannot be loaded: .*(file too short|invalid ELF header)"),
        (libc, r"is not this plugin: it has no control API \(ncclLossyControlVersion\)"),
    ]
    for library, reason in cases:
        with pytest.raises(LossyConfigError) as info:
            LossyNetwork(library=library)
        message = str(info.value)
        assert f"library {library}" in message and "Traceback" not in message, message
        assert "predates" not in message, message
        assert __import__("re").search(reason, message), message
    # through the environment, as a launcher sets it
    proc = run_python("import nccl_lossy; nccl_lossy.LossyNetwork()",
                      env=clean_env(NCCL_LOSSY_LIBRARY=libc))
    assert proc.returncode != 0 and "is not this plugin" in proc.stderr, proc.stderr[-2000:]


def test_apply_sets_what_is_missing_and_keeps_inherited_variables(tmp_path):
    inherited = profile(tmp_path, "seed = 2\n", "inherited.toml")
    code = (
        "import logging, os, nccl_lossy\n"
        "logging.basicConfig(level=logging.INFO)\n"
        "env = nccl_lossy.LossyNetwork(set={'seed': 9}).apply()\n"
        "assert os.environ['NCCL_LOSSY_SET'] == 'seed=9'\n"
        "assert all(os.environ[k] == v for k, v in env.items())\n"
        "print(os.environ['NCCL_LOSSY_PROFILE'])\n"
    )
    proc = run_python(code, env=clean_env(NCCL_LOSSY_PROFILE=inherited))
    assert proc.returncode == 0, proc.stderr
    # the object leaves the profile at its default: the inherited one stays in force
    assert proc.stdout.strip() == str(inherited)
    assert "lossy network environment: NCCL_NET_PLUGIN=" in proc.stderr
    assert "(kept from the environment: NCCL_LOSSY_PROFILE)" in proc.stderr
    # an inherited profile that does not exist is named, not silently dropped
    proc = run_python(code, env=clean_env(NCCL_LOSSY_PROFILE=tmp_path / "old.toml"))
    assert proc.returncode != 0
    assert f"NCCL_LOSSY_PROFILE={tmp_path / 'old.toml'} (in the environment) does not name a file" in proc.stderr


def test_apply_refuses_once_the_plugin_is_loaded(lib_path):
    code = (
        "import ctypes, sys, nccl_lossy\n"
        "ctypes.CDLL(sys.argv[1])  # what NCCL does when it initialises\n"
        "try:\n"
        "    nccl_lossy.LossyNetwork().apply()\n"
        "except nccl_lossy.NcclAlreadyInitializedError as err:\n"
        "    print(err)\n"
    )
    proc = run_python(code, args=(str(lib_path),))
    assert proc.returncode == 0, proc.stderr
    assert "already loaded in this process" in proc.stdout
    assert "before torch.distributed.init_process_group" in proc.stdout


def test_apply_refuses_after_torch_distributed_started_nccl(tmp_path):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch cannot create an NCCL process group without a CUDA device")
    code = (
        "import torch.distributed as dist, nccl_lossy\n"
        "dist.init_process_group('cpu:gloo,cuda:nccl', init_method='file://' + __import__('sys').argv[1], rank=0, world_size=1)\n"
        "try:\n"
        "    nccl_lossy.LossyNetwork().apply()\n"
        "except nccl_lossy.NcclAlreadyInitializedError as err:\n"
        "    print(err)\n"
        "dist.destroy_process_group()\n"
    )
    proc = run_python(code, args=(str(tmp_path / "store"),))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "torch.distributed is initialised with the cpu:gloo,cuda:nccl backend" in proc.stdout


def test_apply_is_allowed_with_a_gloo_only_group(tmp_path):
    pytest.importorskip("torch")
    code = (
        "import os, torch.distributed as dist, nccl_lossy\n"
        "dist.init_process_group('gloo', init_method='file://' + __import__('sys').argv[1], rank=0, world_size=1)\n"
        "nccl_lossy.LossyNetwork().apply()\n"
        "print(os.environ['NCCL_NET'])\n"
        "dist.destroy_process_group()\n"
    )
    proc = run_python(code, args=(str(tmp_path / "store"),))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "lossy"


def test_env_makes_the_harness_load_our_plugin_and_stats_are_readable(tmp_path):
    stats_dir = tmp_path / "run"
    net = LossyNetwork(set={"seed": 7}, stats_dir=stats_dir)
    out = run_harness(clean_env(RANK=1, **net.env(base={})), nbytes=256 * 1024)
    assert out["loaded"] == str(nccl_lossy.library_path())
    assert out["plugin_name"] == "lossy" and out["devices"] >= 1
    assert out["intact"] == [True, True, True]  # the default profile never corrupts data
    rows = nccl_lossy.read_stats(stats_dir)
    files = {r["file"] for r in rows}
    assert len(files) == 1 and "lossy-stats-rank1-" in files.pop()
    assert {r["phase"]: (r["messages"], r["bytes"]) for r in rows} == {
        "forward": (1, 256 * 1024),
        "backward": (1, 256 * 1024),
        "any": (1, 256 * 1024),
    }
    assert all(r["rank"] == 1 and r["connection"] == 0 and r["packets"] > 0 for r in rows)
    total = nccl_lossy.summarize(rows, by=("rank",))
    assert total[0]["messages"] == 3 and total[0]["bytes"] == 3 * 256 * 1024


def test_check_profile_takes_a_library_named_by_a_bare_file_name_in_the_current_directory(tmp_path):
    # check_profile(library="libnccl_net_lossy.so") went to ctypes as typed, and a name without
    # a slash is looked up on the loader's search path, not in the current directory where the
    # user found it: "cannot open shared object file" beside the file.
    import shutil

    from nccl_lossy import library_path

    shutil.copy(library_path(), tmp_path / "libnccl_net_lossy.so")
    code = ("import os, sys\n"
            "os.chdir(sys.argv[1])\n"
            "from nccl_lossy.network import check_profile\n"
            "print(check_profile(None, library='libnccl_net_lossy.so')['origin'])\n")
    env = clean_env()
    env.pop("LD_LIBRARY_PATH", None)
    proc = run_python(code, env=env, args=(str(tmp_path),))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "embedded default" in proc.stdout, proc.stdout


def test_summarize_groups_a_dataframes_missing_values_as_one(tmp_path):
    # A process started without a launcher rank (a helper run with plain `python`, a launcher
    # that sets none of RANK & co.) writes rank null next to the ranked files. In a DataFrame
    # the rank column is then float with NaN, and NaN is not equal to itself:
    # summarize(frame, by="rank") made one group per rank-less row instead of one, unlike
    # summarize(rows, by="rank") on the same data.
    pd = pytest.importorskip("pandas")
    stats_dir = tmp_path / "run"
    net = LossyNetwork(stats_dir=stats_dir)
    for rank in (0, None, None):
        extra = {} if rank is None else {"RANK": rank}
        run_harness(clean_env(**extra, **net.env(base={})), nbytes=64 * 1024)
    rows = nccl_lossy.read_stats(stats_dir)
    assert len(rows) == 9 and sum(r["rank"] is None for r in rows) == 6
    frame = nccl_lossy.read_stats(stats_dir, dataframe=True)
    assert isinstance(frame, pd.DataFrame)
    for by in ("rank", ("rank", "phase")):
        from_rows = nccl_lossy.summarize(rows, by=by)
        from_frame = nccl_lossy.summarize(frame, by=by)
        assert len(from_frame) == len(from_rows) == (2 if by == "rank" else 6)
        def key(g):
            return (g["rank"] is None, g.get("phase", ""))
        for a, b in zip(sorted(from_frame, key=key), sorted(from_rows, key=key)):
            assert {k: v for k, v in a.items() if k != "rank"} == {k: v for k, v in b.items() if k != "rank"}
            assert (a["rank"] is None) == (b["rank"] is None)


def test_reading_a_directory_two_runs_wrote_into_says_so(tmp_path):
    # A directory reused for a second run (a sweep run again, the same stats_dir in two
    # scripts) holds two files per rank. read_stats summed them as one run without a word:
    # twice the packets per rank and per step. `lossy report` warns about exactly this (a rank
    # written by several processes, files of different profiles); the Python reader now does too.
    stats_dir = tmp_path / "run"
    for seed in (7, 8):
        net = LossyNetwork(set={"seed": seed}, stats_dir=stats_dir)
        run_harness(clean_env(RANK=0, **net.env(base={})), nbytes=64 * 1024)
    with pytest.warns(UserWarning) as caught:
        rows = nccl_lossy.read_stats(stats_dir)
    text = " ".join(str(w.message) for w in caught)
    assert len({r["file"] for r in rows}) == 2
    assert "rank 0 is in 2 files" in text, text
    assert "2 different profiles" in text and "seed 7" in text and "seed 8" in text, text
    # one run per directory: no warning
    single = tmp_path / "single"
    net = LossyNetwork(set={"seed": 7}, stats_dir=single)
    run_harness(clean_env(RANK=0, **net.env(base={})), nbytes=64 * 1024)
    run_harness(clean_env(RANK=1, **net.env(base={})), nbytes=64 * 1024)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(nccl_lossy.read_stats(single, table="steps")) == 0
        assert len({r["rank"] for r in nccl_lossy.read_stats(single)}) == 2


def test_wrap_mode_without_a_plugin_to_wrap_is_refused_as_the_plugin_and_lossy_run_refuse(tmp_path):
    # transport = "wrap" with no `inner` and no NCCL_LOSSY_INNER: every rank's plugin fails at
    # init and `lossy run` refuses it, but env() and apply() gave the environment without a word;
    # so they did for NCCL_LOSSY_INNER under transport = "socket".
    wrap = profile(tmp_path, 'transport = "wrap"\nmodel = "none"\n', "wrap.toml")
    with pytest.raises(LossyConfigError, match=r'transport = "wrap" but names no plugin to wrap.*NCCL_LOSSY_INNER'):
        LossyNetwork(profile=wrap).env(base={})
    with pytest.raises(LossyConfigError, match="wrap.toml"):
        LossyNetwork(profile=wrap).env(base={"NCCL_LOSSY_INNER": " "})
    assert LossyNetwork(profile=wrap).env(base={"NCCL_LOSSY_INNER": "ofi"})["NCCL_LOSSY_PROFILE"] == str(wrap.resolve())
    assert LossyNetwork(profile=wrap, set={"inner": "ofi"}).env(base={})["NCCL_LOSSY_SET"] == "inner=ofi"
    socket = profile(tmp_path, 'transport = "socket"\nmodel = "none"\n', "socket.toml")
    with pytest.raises(LossyConfigError, match=r'NCCL_LOSSY_INNER=ofi .*transport = "socket"'):
        LossyNetwork(profile=socket).env(base={"NCCL_LOSSY_INNER": "ofi"})
    assert "NCCL_LOSSY_PROFILE" in LossyNetwork(profile=socket).env(base={})


def test_a_kept_setting_that_leaves_traffic_of_one_node_outside_the_loss_is_a_warning():
    # An inherited NCCL_SHM_DISABLE=0 was kept without a word: a one-node job's traffic went
    # over shared memory, which the loss never touches (`lossy run` notes it the same way).
    with pytest.warns(UserWarning, match=r"NCCL_SHM_DISABLE=0 is kept.*shared memory") as caught:
        env = LossyNetwork().env(base={"NCCL_SHM_DISABLE": "0", "NCCL_P2P_DISABLE": "1"})
    assert "NCCL_SHM_DISABLE" not in env and env["NCCL_NVLS_ENABLE"] == "0"
    assert len([w for w in caught if " is kept" in str(w.message)]) == 1
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        LossyNetwork(intra_node="native").env(base={"NCCL_SHM_DISABLE": "0"})
        LossyNetwork().env(base={"NCCL_SHM_DISABLE": "1"})


def test_a_statistics_directory_that_cannot_be_written_is_refused_before_the_launch(tmp_path):
    # `lossy run --stats DIR` refuses a directory that cannot be created or written before
    # anything starts; env() handed it to every rank, whose plugin then failed at init.
    blocker = tmp_path / "a-file"
    blocker.write_text("in the way")
    with pytest.raises(LossyConfigError, match=r"stats_dir=.*a-file.*not a directory"):
        LossyNetwork(stats_dir=blocker).env(base={})
    with pytest.raises(LossyConfigError, match=r"stats_dir=.*a-file/run"):
        LossyNetwork(stats_dir=blocker / "run").env(base={})
    # A directory that can be made is made, as `lossy run` makes it, and nothing is left in it.
    fine = tmp_path / "runs" / "one"
    assert LossyNetwork(stats_dir=fine).env(base={})["NCCL_LOSSY_STATS"] == str(fine.resolve())
    assert fine.is_dir() and not list(fine.iterdir())


def test_trace_settings_the_plugin_refuses_at_init_are_refused_before_the_launch(tmp_path):
    # The plugin's init refuses a trace directory it cannot write (NCCL_LOSSY_TRACE, or the
    # profile's `trace`) and a ring size out of range, as `lossy run` does before the launch;
    # env() handed them to every rank, whose plugin then failed at init.
    blocker = tmp_path / "a-file"
    blocker.write_text("in the way")
    traced = profile(tmp_path, f'trace = "{blocker}/trace"\nmodel = {{ kind = "none" }}\n', "t.toml")
    with pytest.raises(LossyConfigError, match=r"trace \(profile .*t\.toml\)=.*a-file/trace.*[Nn]ot a directory"):
        LossyNetwork(profile=traced).env(base={})
    with pytest.raises(LossyConfigError, match=r"NCCL_LOSSY_TRACE=.*a-file/t2.*[Nn]ot a directory"):
        LossyNetwork().env(base={"NCCL_LOSSY_TRACE": str(blocker / "t2")})
    for events in ("0", "many", "--5", "1_000", str((1 << 24) + 1)):
        with pytest.raises(LossyConfigError, match=rf"NCCL_LOSSY_TRACE_EVENTS={events}: .*\[1, 16777216\]"):
            LossyNetwork().env(base={"NCCL_LOSSY_TRACE_EVENTS": events})
    # The environment's directory wins over the profile's, as in the plugin; one that can be
    # made is made.
    fine = tmp_path / "traces"
    LossyNetwork(profile=traced).env(base={"NCCL_LOSSY_TRACE": str(fine), "NCCL_LOSSY_TRACE_EVENTS": "1000"})
    assert fine.is_dir() and not list(fine.iterdir())


def test_a_statistics_directory_holding_an_earlier_runs_files_is_said(tmp_path):
    # A second run into the directory of a first adds its files beside the first run's, and
    # read_stats() / lossy report sum both: it was said only when reading, after the run.
    stats = tmp_path / "stats"
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        LossyNetwork(stats_dir=stats).env(base={})  # new, then empty: nothing to say
        LossyNetwork(stats_dir=stats).env(base={})
    # This process's own file (the plugin wrote it, apply() runs again): no earlier run.
    (stats / f"lossy-stats-rank0-h-{os.getpid()}.json").write_text("{}")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        LossyNetwork(stats_dir=stats).env(base={})
    (stats / "lossy-stats-rank0-h-1.json").write_text("{}")
    with pytest.warns(UserWarning, match=r"stats.* already holds 1 statistics file"):
        LossyNetwork(stats_dir=stats).env(base={})


BURSTY = 'model = { kind = "gilbert_elliott", rate = 0.01, mean_burst = 8 }\n'


def test_a_loss_rate_without_a_burst_length_over_a_bursty_profile_says_the_bursts_are_gone(tmp_path):
    # loss_rate alone makes the default model uniform (documented), which over a profile whose
    # default model loses packets in bursts silently ran another condition than the file's.
    bursty = profile(tmp_path, BURSTY)
    with pytest.warns(UserWarning, match=r"gilbert_elliott.*uniform.*burst_length"):
        net = LossyNetwork(profile=bursty, loss_rate=0.02)
    assert net.check()["profile"]["defaults"]["model"]["kind"] == "uniform"
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        LossyNetwork(profile=bursty, loss_rate=0.02, burst_length=8)  # bursts kept: no word
        LossyNetwork(profile=profile(tmp_path, UNIFORM, "u.toml"), loss_rate=0.02)
        LossyNetwork(profile=bursty, loss_rate=0.0)  # none: no bursts to lose
