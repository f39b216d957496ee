"""Reading statistics files: one file or a run directory, and files that are not ours."""

import json
import logging

import pytest

import nccl_lossy
from nccl_lossy.statsfile import STEP_FORMAT_VERSION, StatsFormatError

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


def test_a_newer_per_step_file_is_read_with_a_warning(tmp_path, caplog):
    steps = tmp_path / "lossy-steps-rank0-h-1.json"
    steps.write_text(json.dumps({**STEPS_DOC, "format_version": STEP_FORMAT_VERSION + 1}))
    with caplog.at_level(logging.WARNING, logger="nccl_lossy"):
        rows = nccl_lossy.read_stats(tmp_path, table="step_ops")
    assert [r["step"] for r in rows] == [3]
    assert any("newer" in r.getMessage() and steps.name in r.getMessage() for r in caplog.records)
    steps.write_text(json.dumps({**STEPS_DOC, "format_version": 0}))
    with pytest.raises(StatsFormatError, match="format_version 0"):
        nccl_lossy.read_stats(tmp_path, table="step_ops")


def test_concurrent_writes_of_the_per_step_file_never_fail_or_show_a_half_file(tmp_path):
    # A training thread's write_stats() and disable() may write the per-step file while another
    # writes it: one shared temporary name made one writer's rename fail (its temporary was
    # renamed away) and let a reader see a file cut short.
    import threading

    from nccl_lossy.steps import StepRecorder

    recorder = StepRecorder(lambda: {"connections": []})
    recorder.rows = [{"step": s, "op": "AllReduce", "phase": "any", "messages": 1, "bytes": 8,
                      "packets": 1, "lost_packets": 0, "loss_events": 0} for s in range(2000)]
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
