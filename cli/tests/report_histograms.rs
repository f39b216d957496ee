//! `lossy report` on the histograms of statistics files: a burst-length histogram that no run
//! can write (a burst of 0 packets, bursts on a collective that lost nothing, bursts holding
//! more lost packets than the connection lost) is refused naming the file, the cell and the
//! values, as the counters' cells are, instead of printing a mean burst of 1.8e19.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::{fresh_dir, lossy_exe, output_within_10s};

/// A real run's statistics files: `lossy demo` (two ranks, 1 MiB collectives under the
/// embedded default, 1 % uniform loss, so every collective loses packets).
fn demo_run(name: &str) -> PathBuf {
    let dir = fresh_dir(name);
    let out = output_within_10s(
        Command::new(lossy_exe()).args([
            "demo",
            "--ranks",
            "2",
            "--sizes",
            "1M",
            "--stats-dir",
            dir.to_str().expect("utf-8"),
        ]),
        "lossy demo",
    );
    assert!(out.status.success(), "{out:?}");
    dir
}

fn report(dir: &Path) -> std::process::Output {
    output_within_10s(
        Command::new(lossy_exe()).args(["report", "--json", dir.to_str().expect("utf-8")]),
        "lossy report",
    )
}

/// The first statistics file of `dir`, parsed.
fn first_file(dir: &Path) -> (PathBuf, serde_json::Value) {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .expect("list run")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    files.sort();
    let path = files.first().expect("a statistics file").clone();
    let doc = serde_json::from_str(&std::fs::read_to_string(&path).expect("read")).expect("JSON");
    (path, doc)
}

/// The (connection, histogram) of the first histogram with bursts in `doc`.
fn first_bursts(doc: &serde_json::Value) -> (usize, usize) {
    for (i, conn) in doc["connections"]
        .as_array()
        .expect("connections")
        .iter()
        .enumerate()
    {
        for (j, h) in conn["histograms"]
            .as_array()
            .expect("histograms")
            .iter()
            .enumerate()
        {
            if h["burst_lengths"].as_array().is_some_and(|b| !b.is_empty()) {
                return (i, j);
            }
        }
    }
    panic!("no bursts in {doc}");
}

#[test]
fn histograms_no_run_can_write_are_refused_naming_the_file_cell_and_values() {
    let dir = demo_run("report-histograms");
    // The run's own files are read as they are.
    let out = report(&dir);
    assert!(out.status.success(), "{out:?}");
    let (path, good) = first_file(&dir);
    let name = path
        .file_name()
        .expect("name")
        .to_string_lossy()
        .into_owned();
    let (i, j) = first_bursts(&good);
    let op = good["connections"][i]["histograms"][j]["op"]
        .as_str()
        .expect("op")
        .to_string();
    let bursts: u64 = good["connections"][i]["histograms"][j]["burst_lengths"]
        .as_array()
        .expect("bins")
        .iter()
        .map(|bin| bin[1].as_u64().expect("count"))
        .sum();
    let connection_lost = good["connections"][i]["total"]["lost_packets"]
        .as_u64()
        .expect("lost");
    let cell = format!("connections.{i}.histograms.{j} ({op})");

    type Edit = Box<dyn Fn(&mut serde_json::Value)>;
    let cases: Vec<(Edit, String)> = vec![
        // A burst of 0 packets: no run records one (a burst is at least one lost packet).
        (
            Box::new(move |v| {
                v["connections"][i]["histograms"][j]["burst_lengths"][0][0] = 0.into()
            }),
            format!("{cell}: burst_lengths holds a burst of length 0"),
        ),
        // Bursts on a collective that lost no packet on this connection.
        (
            Box::new({
                let op = op.clone();
                move |v| {
                    for cell in v["connections"][i]["by_op"].as_array_mut().expect("by_op") {
                        if cell["op"] == op.as_str() {
                            cell["lost_packets"] = 0.into();
                            cell["loss_events"] = 0.into();
                        }
                    }
                }
            }),
            format!("{cell}: {bursts} bursts, but {op} lost 0 packets on this connection"),
        ),
        // One burst longer than everything the connection lost: the mean burst printed was
        // 1.8e19 packets.
        (
            Box::new(move |v| {
                v["connections"][i]["histograms"][j]["burst_lengths"][0][0] = u64::MAX.into()
            }),
            format!("lost {connection_lost} packets"),
        ),
    ];
    for (edit, want) in cases {
        let mut doc = good.clone();
        edit(&mut doc);
        std::fs::write(&path, doc.to_string()).expect("write");
        let out = report(&dir);
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{want}: {stdout}{stderr}");
        assert!(
            stderr.contains(&name) && stderr.contains(&want),
            "want {want:?} naming {name}: {stderr}"
        );
    }
}
