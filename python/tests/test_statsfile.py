"""Reading statistics files: one file or a run directory, and files that are not ours."""

import json
import sys

import pytest

import nccl_lossy
from nccl_lossy.statsfile import STEP_FORMAT_VERSION, StatsFormatError, step_op_rows_from_doc

PLUGIN_DOC = {"format_version": 1, "rank": 0, "host": "h", "pid": 1, "connections": [], "by_step": []}
STEPS_DOC = {"format_version": STEP_FORMAT_VERSION, "rank": 0, "host": "h", "pid": 1,
             "steps": [{"step": 3, "op": "AllReduce", "phase": "forward", "messages": 1,
                        "bytes": 8, "packets": 1, "lost_packets": 0, "loss_events": 0}]}


def test_one_file_gives_its_own_tables_and_none_of_the_others(tmp_path):
    # A path naming one file was taken as a file of every table: read_all() on the plugin's
    # file parsed it as a per-step file and failed.
    stats = tmp_path / "lossy-stats-rank0-h-1.json"
    stats.write_text(json.dumps(PLUGIN_DOC))
    steps = tmp_path / "lossy-steps-rank0-h-1.json"
    steps.write_text(json.dumps(STEPS_DOC))
    tables = nccl_lossy.read_all(stats)
    assert tables["ops"] == [] and tables["steps"] == [] and tables["step_ops"] == []
    tables = nccl_lossy.read_all(steps)
    assert [r["step"] for r in tables["step_ops"]] == [3] and tables["ops"] == []
    assert nccl_lossy.read_stats(steps) == []
    # a file under a name of the user's own is read as the table asked for, as before
    mine = tmp_path / "rank0.json"
    mine.write_text(json.dumps(PLUGIN_DOC))
    assert nccl_lossy.read_stats(mine, table="steps") == []
    with pytest.raises(StatsFormatError, match="rank0.json is not a nccl-lossy per-step file"):
        nccl_lossy.read_stats(mine, table="step_ops")


def test_a_file_that_is_not_text_is_a_format_error_naming_it(tmp_path):
    for name in ("lossy-stats-rank0-h-1.json", "lossy-steps-rank0-h-1.json"):
        bad = tmp_path / name
        bad.write_bytes(b"\xff\xfe\x00garbage")
        with pytest.raises(StatsFormatError, match=name):
            nccl_lossy.read_all(bad)


def test_a_newer_per_step_file_is_read_with_a_warning(tmp_path):
    steps = tmp_path / "lossy-steps-rank0-h-1.json"
    steps.write_text(json.dumps({**STEPS_DOC, "format_version": STEP_FORMAT_VERSION + 1}))
    # said where it is seen (Python's warnings): this package's logger has no handler unless
    # the application adds one
    with pytest.warns(UserWarning, match=rf"{steps.name}.*newer"):
        rows = nccl_lossy.read_stats(tmp_path, table="step_ops")
    assert [r["step"] for r in rows] == [3]
    steps.write_text(json.dumps({**STEPS_DOC, "format_version": 0}))
    with pytest.raises(StatsFormatError, match="format_version 0"):
        nccl_lossy.read_stats(tmp_path, table="step_ops")


@pytest.mark.parametrize("table", ["ops", "steps", "bursts", "latency"])
def test_a_newer_statistics_file_is_warned_about_once(tmp_path, table, caplog):
    # Warned by load_stats_files and again by rows_from_stats: twice per file per read (and
    # once more for each table read_all reads).
    for rank in (0, 1):
        (tmp_path / f"lossy-stats-rank{rank}-h-1.json").write_text(
            json.dumps({**PLUGIN_DOC, "rank": rank, "format_version": 2}))
    for read in (lambda: nccl_lossy.read_stats(tmp_path, table=table), lambda: nccl_lossy.read_all(tmp_path)):
        caplog.clear()
        with pytest.warns(UserWarning) as seen:
            read()
        newer = [str(w.message) for w in seen if "newer" in str(w.message)]
        assert sorted(newer) == sorted(
            f"{tmp_path / f'lossy-stats-rank{rank}-h-1.json'} has format 2, newer than this package's 1: "
            "reading the fields it knows (install matching versions)" for rank in (0, 1)), newer
        assert len([r for r in caplog.records if "newer" in r.getMessage()]) == 2, caplog.records


def test_concurrent_writes_of_the_per_step_file_never_fail_or_show_a_half_file(tmp_path):
    # A training thread's write_stats() and disable() may write the per-step file while another
    # writes it: one shared temporary name made one writer's rename fail (its temporary was
    # renamed away) and let a reader see a file cut short.
    import threading

    from nccl_lossy.steps import StepRecorder

    sent = [0]  # one 8-byte all-reduce a step, as the plugin's live counters would say
    recorder = StepRecorder(lambda: {"connections": [{"by_op": [
        {"op": "AllReduce", "phase": "any", "messages": sent[0], "bytes": 8 * sent[0],
         "packets": sent[0]}]}]})
    recorder.start()
    for step in range(2000):
        sent[0] += 1
        recorder.end_step(step)
    assert len(recorder.rows) == 2000
    errors, bad_reads, done = [], [], threading.Event()

    def write():
        try:
            for _ in range(150):
                recorder.write(tmp_path)
        except OSError as err:
            errors.append(err)

    def read():
        while not done.is_set():
            for f in tmp_path.glob("lossy-steps-rank*.json"):
                try:
                    json.loads(f.read_text())
                except (ValueError, FileNotFoundError) as err:
                    bad_reads.append(err)

    writers = [threading.Thread(target=write) for _ in range(3)]
    reader = threading.Thread(target=read)
    reader.start()
    for w in writers:
        w.start()
    for w in writers:
        w.join()
    done.set()
    reader.join()
    assert errors == [] and bad_reads == [], (errors[:3], bad_reads[:3])
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def _plugin_doc(cell=None, by_step=None, histograms=None, connections=None):
    conn = {"comm_id": "c1", "index": 0, "by_op": [cell or {}], "histograms": histograms or []}
    return {**PLUGIN_DOC, "connections": [conn] if connections is None else connections,
            "by_step": by_step or []}


GOOD_CELL = {"op": "AllReduce", "phase": "any", "messages": 1, "bytes": 4096, "packets": 10,
             "lost_packets": 2, "loss_events": 1, "retransmit_delay_ns": 0,
             "packets_injection_off": 0}


@pytest.mark.parametrize(
    "doc, table, named",
    [
        # counters that are no count: read as another number, or failing without the file
        (_plugin_doc({**GOOD_CELL, "packets": 10.9}), "ops", "packets = 10.9"),
        (_plugin_doc({**GOOD_CELL, "lost_packets": "2"}), "ops", "lost_packets = '2'"),
        (_plugin_doc({**GOOD_CELL, "bytes": -4096}), "ops", "bytes = -4096"),
        (_plugin_doc({**GOOD_CELL, "messages": True}), "ops", "messages = True"),
        (_plugin_doc({**GOOD_CELL, "loss_events": None}), "ops", "loss_events = None"),
        (_plugin_doc({**GOOD_CELL, "lost_packets": 11}), "ops", "lost_packets = 11 is more than packets = 10"),
        (_plugin_doc(by_step=[{"packets": 5, "lost_packets": 1}]), "steps", "by_step.0: no step"),
        (_plugin_doc(by_step=[{"step": 1.5, "packets": 5}]), "steps", "step = 1.5"),
        (_plugin_doc(by_step=[{"step": 1, "packets": 5, "lost_packets": 6}]), "steps",
         "lost_packets = 6 is more than packets = 5"),
        (_plugin_doc(histograms=[{"op": "AllReduce", "burst_lengths": [[2]]}]), "bursts",
         "burst_lengths"),
        (_plugin_doc(histograms=[{"op": "AllReduce", "burst_lengths": [[2, 0.5]]}]), "bursts",
         "0.5"),
        # the layout itself: a mapping or a number where a list of objects belongs
        (_plugin_doc(connections={"c1": {}}), "ops", "connections"),
        (_plugin_doc(connections=[7]), "ops", "connections.0"),
        ({**_plugin_doc(), "by_step": {"1": 5}}, "steps", "by_step"),
    ],
)
def test_a_value_that_is_no_count_is_refused_naming_the_file_key_and_value(tmp_path, doc, table, named):
    # Floats were truncated (10.9 packets read as 10), text read as numbers ("2" as 2), negative
    # counts and lost > packets (a loss rate above 1) taken as they were; a malformed layout
    # failed with a bare KeyError / AttributeError that named no file.
    name = "lossy-stats-rank0-h-1.json"
    (tmp_path / name).write_text(json.dumps(doc))
    with pytest.raises(StatsFormatError) as err:
        nccl_lossy.read_stats(tmp_path, table=table)
    assert name in str(err.value) and named in str(err.value), str(err.value)


@pytest.mark.parametrize(
    "cell, named",
    [
        ({"step": 1, "op": "AllReduce", "phase": "any", "packets": 4, "lost_packets": 2.5}, "lost_packets = 2.5"),
        ({"step": "1", "op": "AllReduce", "phase": "any", "packets": 4}, "step = '1'"),
        ({"step": 1, "phase": "any", "packets": 4}, "steps.0: no op"),
        ({"step": 1, "op": "AllReduce", "phase": "any", "packets": 4, "lost_packets": 5},
         "lost_packets = 5 is more than packets = 4"),
    ],
)
def test_a_per_step_cell_that_is_no_count_is_refused_naming_the_file_and_cell(tmp_path, cell, named):
    name = "lossy-steps-rank0-h-1.json"
    (tmp_path / name).write_text(json.dumps({**STEPS_DOC, "steps": [cell]}))
    with pytest.raises(StatsFormatError) as err:
        nccl_lossy.read_stats(tmp_path, table="step_ops")
    assert name in str(err.value) and named in str(err.value), str(err.value)


def test_the_plugins_own_file_is_read_as_it_was_written(tmp_path):
    name = "lossy-stats-rank0-h-1.json"
    # 7 packets lost in 4 bursts: three of one packet and one of four (as a run writes them)
    hist = [{"op": "AllReduce", "burst_lengths": [[1, 3], [4, 1]], "latency_ns": [[1000, 2]]}]
    cell = {**GOOD_CELL, "lost_packets": 7, "loss_events": 4}
    doc = _plugin_doc(cell, by_step=[{"step": 2, "packets": 10, "lost_packets": 7}], histograms=hist)
    (tmp_path / name).write_text(json.dumps(doc))
    [row] = nccl_lossy.read_stats(tmp_path)
    assert (row["packets"], row["lost_packets"], row["loss_rate"]) == (10, 7, 0.7)
    [step] = nccl_lossy.read_stats(tmp_path, table="steps")
    assert (step["step"], step["packets_injection_off"]) == (2, 0)
    bursts = nccl_lossy.read_stats(tmp_path, table="bursts")
    assert [(b["burst_length"], b["count"]) for b in bursts] == [(1, 3), (4, 1)]


def test_steps_the_plugin_does_not_break_down_are_named_not_dropped(tmp_path):
    # The plugin keeps 65,536 steps one by one and sums the traffic of later ones in
    # steps_beyond; the steps table ended at step 65,535 without a word.
    name = "lossy-stats-rank0-h-1.json"
    doc = _plugin_doc(GOOD_CELL, by_step=[{"step": 2, "packets": 10, "lost_packets": 2}])
    doc["steps_beyond"] = {"step": 65536, "packets": 40, "lost_packets": 3, "packets_injection_off": 0}
    (tmp_path / name).write_text(json.dumps(doc))
    with pytest.warns(UserWarning, match=r"40 packets \(3 lost\) at steps from 65536 on"):
        rows = nccl_lossy.read_stats(tmp_path, table="steps")
    assert [r["step"] for r in rows] == [2]
    # None there (or none counted): nothing to say.
    doc["steps_beyond"]["packets"] = 0
    doc["steps_beyond"]["lost_packets"] = 0
    (tmp_path / name).write_text(json.dumps(doc))
    import warnings as w
    with w.catch_warnings():
        w.simplefilter("error")
        nccl_lossy.read_stats(tmp_path, table="steps")


UNREADABLE = r"""
import os, sys
import nccl_lossy
if os.geteuid() == 0:  # root reads any directory: look at it as an ordinary user does
    try:
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)
        os.stat(sys.argv[1])  # the way to it is open to that user (TMPDIR may be private)
    except OSError as err:
        print("unprivileged: unavailable:", err)
        sys.exit(0)
try:
    rows = nccl_lossy.read_stats(sys.argv[1])
except OSError as err:
    print("error:", type(err).__name__, err)
else:
    print("rows:", len(rows))
"""


def test_a_directory_that_cannot_be_listed_is_an_error_not_an_empty_run():
    # Path.glob swallows the permission error: read_stats() of a directory the user may not
    # list returned [] as if the run had no traffic.
    import errno
    import os
    import tempfile

    from conftest import run_python

    top = tempfile.mkdtemp(prefix="lossy-unreadable-")
    try:
        os.chmod(top, 0o755)  # reachable by the user the child becomes
        run = os.path.join(top, "run")
        os.mkdir(run)
        with open(os.path.join(run, "lossy-stats-rank0-h-1.json"), "w") as f:
            json.dump(PLUGIN_DOC, f)
        os.chmod(run, 0o311)  # can be entered, not listed
        proc = run_python(UNREADABLE, args=(run,), timeout=60)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out = proc.stdout.strip()
        if out.startswith("unprivileged: unavailable"):
            # Root that cannot become another user (no CAP_SETUID), or whose temporary
            # directory that user cannot reach: the listing's own error, as Linux gives it.
            def refuse(path):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))

            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(os, "listdir", refuse)
                with pytest.raises(PermissionError) as err:
                    nccl_lossy.read_stats(run)
            out = f"error: PermissionError {err.value}"
        assert out.startswith("error: PermissionError") and run in out and "cannot list" in out, out
    finally:
        os.chmod(os.path.join(top, "run"), 0o755)
        import shutil

        shutil.rmtree(top)


def test_a_fifo_or_a_device_is_refused_at_once_saying_what_it_is(tmp_path):
    # A FIFO given as the path was reported as "no such statistics file or directory"; read it
    # in a child with a deadline, so that a reader that blocks on it fails instead of hanging.
    import os

    from conftest import run_python

    fifo = tmp_path / "lossy-stats-rank0-h-1.json"
    os.mkfifo(fifo)
    zero = tmp_path / "lossy-steps-rank0-h-1.json"
    zero.symlink_to("/dev/zero")
    code = ("import sys, nccl_lossy\n"
            "for path, table in ((sys.argv[1], 'ops'), (sys.argv[2], 'step_ops')):\n"
            "    try:\n"
            "        nccl_lossy.read_stats(path, table=table)\n"
            "    except (OSError, ValueError) as err:\n"
            "        print(type(err).__name__, err)\n")
    proc = run_python(code, args=(str(fifo), str(zero)), timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 2, proc.stdout
    assert str(fifo) in lines[0] and "a FIFO" in lines[0] and "regular file" in lines[0], lines[0]
    assert str(zero) in lines[1] and "a character device" in lines[1], lines[1]


def test_a_file_larger_than_any_statistics_file_is_refused_unread(tmp_path):
    # Read whole into memory before: a stray multi-gigabyte file named like a statistics file
    # took the reader's memory. The plugin's own reader stops at 256 MiB.
    big = tmp_path / "lossy-stats-rank0-h-1.json"
    with open(big, "wb") as f:
        f.truncate((256 << 20) + 1)  # sparse: no disk used
    with pytest.raises(StatsFormatError) as err:
        nccl_lossy.read_stats(tmp_path)
    assert str(big) in str(err.value) and "256 MiB" in str(err.value), str(err.value)


def test_summarize_groups_by_the_columns_named_and_refuses_one_no_row_has():
    # by="op" was read as the columns "o" and "p", a misspelt column as one the rows lack:
    # either way every row fell into one group whose keys were None, with no error.
    rows = step_op_rows_from_doc(STEPS_DOC, "f")
    rows.append({**rows[0], "op": "AllGather", "packets": 4, "lost_packets": 1})
    by_op = nccl_lossy.summarize(rows, by="op")
    assert sorted((g["op"], g["packets"], g["lost_packets"]) for g in by_op) == [
        ("AllGather", 4, 1), ("AllReduce", 1, 0)]
    assert all(set(g) >= {"op"} and "o" not in g for g in by_op)
    with pytest.raises(ValueError, match=r"'phse'.*allowed:.*\bphase\b"):
        nccl_lossy.summarize(rows, by=("op", "phse"))
    assert nccl_lossy.summarize([], by=("anything",)) == []


def test_a_directory_without_statistics_files_is_a_warning_not_an_empty_run(tmp_path, recwarn):
    # read_stats() on a directory the run never wrote to (a typo, another working directory,
    # NCCL_LOSSY_STATS not set) returned [] without a word, which summarize() turned into an
    # empty table, as if nothing had been sent; `lossy report` refuses such a directory.
    (tmp_path / "notes.txt").write_text("not a statistics file")
    for table in ("ops", "steps", "step_ops", "bursts", "latency"):
        with pytest.warns(UserWarning, match="holds no statistics files") as caught:
            assert nccl_lossy.read_stats(tmp_path, table=table) == []
        text = str(caught[0].message)
        assert str(tmp_path) in text and "lossy-stats-rank*.json" in text, text
        assert "lossy-steps-rank*.json" in text and "NCCL_LOSSY_STATS" in text, text
    # A run of the plugin's files only has no per-step rows, and says nothing about it.
    (tmp_path / "lossy-stats-rank0-h-1.json").write_text(json.dumps(PLUGIN_DOC))
    recwarn.clear()
    assert nccl_lossy.read_stats(tmp_path, table="step_ops") == []
    assert nccl_lossy.read_stats(tmp_path) == []
    assert not [w for w in recwarn if "holds no statistics files" in str(w.message)]


@pytest.mark.parametrize("field, value", [("rank", "3"), ("rank", -1), ("pid", 1.5), ("host", 7)])
def test_file_fields_of_the_wrong_kind_are_refused_naming_them(tmp_path, field, value):
    # The README: "a field of the wrong kind raises StatsFormatError naming the file, the key
    # and the value"; the file's own rank, pid and host were taken as they came.
    stats = tmp_path / "lossy-stats-rank0-h-1.json"
    stats.write_text(json.dumps({**PLUGIN_DOC, field: value}))
    with pytest.raises(StatsFormatError, match=rf"{stats.name}.*{field}"):
        nccl_lossy.read_stats(stats)


@pytest.mark.parametrize("bursts, what", [
    ([[0, 1]], "length 0"),       # a burst is at least one lost packet
    ([[1, 3]], "3 bursts"),       # three bursts, but AllReduce lost 2 packets here
    ([[2, 2]], "4 packets"),      # two bursts of 2 packets, but the connection lost 2
])
def test_burst_histograms_no_run_writes_are_refused_as_lossy_report_refuses_them(tmp_path, bursts, what):
    # `lossy report` refuses these (the plugin records a burst under the collective of the
    # message it ends in, which lost at least its last packet); read_stats summed them.
    cell = {"op": "AllReduce", "phase": "any", "messages": 1, "bytes": 8192, "packets": 2,
            "lost_packets": 2, "loss_events": 1}
    conn = {"comm_id": 1, "index": 0, "by_op": [cell],
            "histograms": [{"op": "AllReduce", "burst_lengths": bursts, "latency_ns": []}]}
    stats = tmp_path / "lossy-stats-rank0-h-1.json"
    stats.write_text(json.dumps({**PLUGIN_DOC, "connections": [conn]}))
    for table in ("ops", "bursts"):
        with pytest.raises(StatsFormatError, match=rf"{stats.name}.*{what}"):
            nccl_lossy.read_stats(stats, table=table)
    # the same connection with one burst of 2 packets is a run's
    conn["histograms"][0]["burst_lengths"] = [[2, 1]]
    stats.write_text(json.dumps({**PLUGIN_DOC, "connections": [conn]}))
    assert [r["burst_length"] for r in nccl_lossy.read_stats(stats, table="bursts")] == [2]


def test_step_ops_names_the_processes_of_the_run_without_a_per_step_file(tmp_path):
    # A process writes its per-step file at disable() / write_stats(), the plugin its
    # statistics file as it goes: a rank killed before the end leaves the second without the
    # first, and the step_ops table summed the other ranks' rows as the whole run, unsaid.
    for rank in (0, 1):
        doc = {**_plugin_doc(GOOD_CELL), "rank": rank, "pid": 100 + rank}
        (tmp_path / f"lossy-stats-rank{rank}-h-{100 + rank}.json").write_text(json.dumps(doc))
    steps = {**STEPS_DOC, "rank": 0, "pid": 100}
    (tmp_path / "lossy-steps-rank0-h-100.json").write_text(json.dumps(steps))
    with pytest.warns(UserWarning, match=r"no per-step file.*rank 1 \(h:101\)") as caught:
        rows = nccl_lossy.read_stats(tmp_path, table="step_ops")
    assert [r["rank"] for r in rows] == [0]
    assert "h:100" not in str(caught[0].message)
    # Every process with its per-step file (rank 1's host name read differently): nothing to say.
    (tmp_path / "lossy-steps-rank1-h-101.json").write_text(
        json.dumps({**steps, "rank": 1, "pid": 101, "host": "read-differently"}))
    import warnings as w
    with w.catch_warnings():
        w.simplefilter("error")
        nccl_lossy.read_stats(tmp_path, table="step_ops")


def test_ranks_of_the_run_without_a_statistics_file_are_named(tmp_path):
    # A rank stopped before its first write leaves no file: read_stats() returned the other
    # ranks' rows as the whole run, without a word.
    for rank in (0, 2):
        doc = {**_plugin_doc(GOOD_CELL), "rank": rank, "pid": 100 + rank, "world_size": 4}
        (tmp_path / f"lossy-stats-rank{rank}-h-{100 + rank}.json").write_text(json.dumps(doc))
    with pytest.warns(UserWarning, match=r"no statistics file from rank 1, 3 of the 4 ranks"):
        rows = nccl_lossy.read_stats(tmp_path)
    assert sorted(r["rank"] for r in rows) == [0, 2]
    # Files that do not say the world's size: the ranks below the highest one found.
    for rank in (0, 2):
        doc = {**_plugin_doc(GOOD_CELL), "rank": rank, "pid": 100 + rank}
        (tmp_path / f"lossy-stats-rank{rank}-h-{100 + rank}.json").write_text(json.dumps(doc))
    with pytest.warns(UserWarning, match=r"no statistics file from rank 1 below the highest rank found, 2"):
        nccl_lossy.read_stats(tmp_path)
    # One file asked for by name: the others were not.
    import warnings as w
    with w.catch_warnings():
        w.simplefilter("error")
        nccl_lossy.read_stats(tmp_path / "lossy-stats-rank2-h-102.json")


def test_a_directory_under_a_statistics_file_name_is_refused_naming_it(tmp_path):
    # It failed as IsADirectoryError "[Errno 21] Is a directory: 3": the descriptor's number,
    # neither the path nor what is allowed.
    for name, table in (("lossy-stats-rank0-h-1.json", "ops"), ("lossy-steps-rank0-h-1.json", "step_ops")):
        run = tmp_path / table
        (run / name).mkdir(parents=True)
        with pytest.raises(StatsFormatError) as err:
            nccl_lossy.read_stats(run, table=table)
        message = str(err.value)
        assert str(run / name) in message and "a directory" in message and "regular file" in message, message


@pytest.mark.parametrize("text, what", [
    ("[" * 100_000 + "]" * 100_000, "nested"),                            # RecursionError
    pytest.param('{"format_version": 1, "pid": ' + "9" * 5000 + "}", "digits",  # int() digit limit
                 marks=pytest.mark.skipif(not hasattr(sys, "get_int_max_str_digits"),
                                          reason="Python without a digit limit")),
])
def test_json_python_cannot_decode_is_a_format_error_naming_the_file(tmp_path, text, what):
    # Python's json raised RecursionError for deep nesting and a bare ValueError for an
    # integer of more than 4300 digits: neither named the file nor was a StatsFormatError.
    for name, table in (("lossy-stats-rank0-h-1.json", "ops"), ("lossy-steps-rank0-h-1.json", "step_ops")):
        (tmp_path / name).write_text(text)
        with pytest.raises(StatsFormatError) as err:
            nccl_lossy.read_stats(tmp_path, table=table)
        assert name in str(err.value) and what in str(err.value), str(err.value)
        (tmp_path / name).unlink()


@pytest.mark.parametrize("conn, named", [
    ({"by_op": [{**GOOD_CELL, "op": ["AllReduce"]}], "histograms": []}, "by_op.0: op = ['AllReduce']"),
    ({"by_op": [GOOD_CELL], "histograms": [{"op": {"a": 1}, "burst_lengths": [], "latency_ns": []}]},
     "histograms.0: op = {'a': 1}"),
])
def test_a_collective_name_that_is_no_text_is_refused_naming_it(tmp_path, conn, named):
    # It failed with a bare TypeError (unhashable type) naming no file.
    stats = tmp_path / "lossy-stats-rank0-h-1.json"
    stats.write_text(json.dumps({**PLUGIN_DOC, "connections": [{"comm_id": 1, "index": 0, **conn}]}))
    for table in ("ops", "bursts"):
        with pytest.raises(StatsFormatError) as err:
            nccl_lossy.read_stats(stats, table=table)
        assert stats.name in str(err.value) and named in str(err.value), str(err.value)


def test_a_socket_under_a_statistics_file_name_is_refused_saying_what_it_is(tmp_path, monkeypatch):
    # A socket cannot be opened (ENXIO): it failed as OSError "No such device or address",
    # which reads as if the file were missing, where `lossy report` says "a socket".
    import socket

    monkeypatch.chdir(tmp_path)  # bound by a relative name: a socket path has ~100 bytes at most
    name = "lossy-stats-rank0-h-1.json"
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(name)
        with pytest.raises(StatsFormatError) as err:
            nccl_lossy.read_stats(tmp_path)
    message = str(err.value)
    assert str(tmp_path / name) in message and "a socket" in message and "regular file" in message, message


def test_a_statistics_path_that_is_no_path_is_refused_naming_it(tmp_path, monkeypatch, recwarn):
    # read_stats(integ.stats_dir()) without a statistics directory passes None: that was a bare
    # TypeError "expected str, bytes or os.PathLike object, not NoneType", naming no argument;
    # an empty string (an unset variable read as "") read the working directory, with a
    # warning that named "" as the directory.
    (tmp_path / "lossy-stats-rank0-h-1.json").write_text(json.dumps(PLUGIN_DOC))
    monkeypatch.chdir(tmp_path)
    for read in (nccl_lossy.read_stats, nccl_lossy.read_all):
        with pytest.raises(TypeError, match=r"path=None: allowed: a statistics directory \(NCCL_LOSSY_STATS\) "
                           r"or one statistics file, as str or os.PathLike"):
            read(None)
        with pytest.raises(TypeError, match=r"path=3: allowed: a statistics directory"):
            read(3)
        with pytest.raises(ValueError, match=r"path='': names no directory or file; allowed: a statistics "
                           r"directory"):
            read("")
    assert not recwarn.list, [str(w.message) for w in recwarn.list]
    assert nccl_lossy.read_stats(".") == []  # the working directory, said as such, still reads


def test_summarize_refuses_a_grouping_that_is_no_column_name():
    rows = [{"op": "AllReduce", "packets": 4, "lost_packets": 1}]
    for by in (None, 3, ["op", 3]):
        with pytest.raises(TypeError, match=r"summarize: by=.*: allowed: a column name or a sequence of "
                           r"column names \(str\)"):
            nccl_lossy.summarize(rows, by=by)
    assert nccl_lossy.summarize(rows, by=["op"])[0]["packets"] == 4


@pytest.mark.parametrize("conn, named", [
    ({"comm_id": 1, "index": 0, "by_op": [{**GOOD_CELL, "phase": ["backward"]}]},
     "by_op.0: phase = ['backward']"),
    ({"comm_id": [1], "index": 0, "by_op": [GOOD_CELL]}, "connections.0: comm_id = [1]"),
    ({"comm_id": 1, "index": {"i": 0}, "by_op": [GOOD_CELL]}, "connections.0: index = {'i': 0}"),
])
def test_a_phase_or_connection_of_the_wrong_kind_is_refused_naming_it(tmp_path, conn, named):
    # The phase and the connection's comm_id and index went into the rows as they came:
    # summarize(rows, by=("op", "phase")) then failed with a bare TypeError (unhashable type)
    # naming no file.
    stats = tmp_path / "lossy-stats-rank0-h-1.json"
    stats.write_text(json.dumps({**PLUGIN_DOC, "connections": [{**conn, "histograms": []}]}))
    for table in ("ops", "bursts", "latency"):
        with pytest.raises(StatsFormatError) as err:
            nccl_lossy.read_stats(stats, table=table)
        assert stats.name in str(err.value) and named in str(err.value), str(err.value)


def test_a_table_name_that_is_no_text_or_a_path_given_to_load_stats_files_that_is_no_path_is_named(tmp_path):
    # table=["ops"] failed with a bare TypeError (unhashable type: 'list'); load_stats_files(None)
    # with "expected str, bytes or os.PathLike object, not NoneType", naming no argument.
    (tmp_path / "lossy-stats-rank0-h-1.json").write_text(json.dumps(PLUGIN_DOC))
    for table in (["ops"], {"ops": 1}):
        with pytest.raises(ValueError, match=r"table=.*: allowed: ops, steps, step_ops, bursts, latency"):
            nccl_lossy.read_stats(tmp_path, table=table)
    with pytest.raises(TypeError, match=r"path=None: allowed: a statistics directory"):
        nccl_lossy.load_stats_files(None)
    assert [d["rank"] for d in nccl_lossy.load_stats_files(tmp_path)] == [0]


@pytest.mark.parametrize("beyond, named", [
    ({"step": "later", "packets": 40, "lost_packets": 3}, "steps_beyond: step = 'later'"),
    ([40, 3], "steps_beyond = [40, 3]"),
])
def test_steps_beyond_of_the_wrong_kind_is_refused_naming_it(tmp_path, beyond, named):
    # A step that is no number went into the warning as it came ("at steps from later on"); a
    # steps_beyond that is no object was passed over without a word, its traffic unsaid.
    stats = tmp_path / "lossy-stats-rank0-h-1.json"
    stats.write_text(json.dumps({**_plugin_doc(GOOD_CELL), "steps_beyond": beyond}))
    with pytest.raises(StatsFormatError) as err:
        nccl_lossy.read_stats(stats, table="steps")
    assert stats.name in str(err.value) and named in str(err.value), str(err.value)


def test_the_errors_the_readers_raise_are_reachable_from_the_package(tmp_path):
    # The README names StatsFormatError for read_stats(); `except nccl_lossy.StatsFormatError`
    # was an AttributeError, raised from the handler itself.
    from nccl_lossy import profiler, statsfile

    assert nccl_lossy.StatsFormatError is statsfile.StatsFormatError
    assert nccl_lossy.TraceFormatError is profiler.TraceFormatError
    stats = tmp_path / "lossy-stats-rank0-h-1.json"
    stats.write_text("{")
    with pytest.raises(nccl_lossy.StatsFormatError):
        nccl_lossy.read_stats(stats)
