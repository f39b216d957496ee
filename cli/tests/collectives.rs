//! Ring collectives across worker processes, through the built plugin library and real
//! sockets, checked bit-exact.

mod common;

use common::{assert_all_exact, every, run_ranks};
use lossy_cli::harness::collectives::DataType;

const SMALL: [usize; 5] = [0, 1, 7, 4096, (1 << 20) + 3];

#[test]
fn two_ranks_every_size_both_types() {
    let runs = every(&SMALL, &[DataType::F32, DataType::U8]);
    let n = runs.len();
    let reports = run_ranks(2, 12, runs);
    assert_all_exact(&reports, n);
    assert!(reports.iter().all(|r| r.plugin == "lossy"));
}

#[test]
fn four_ranks_every_size() {
    let runs = every(&SMALL, &[DataType::F32, DataType::U8]);
    let n = runs.len();
    assert_all_exact(&run_ranks(4, 12, runs), n);
}

#[test]
fn eight_ranks_every_size() {
    let runs = every(&SMALL, &[DataType::F32]);
    let n = runs.len();
    assert_all_exact(&run_ranks(8, 12, runs), n);
}

#[test]
fn two_ranks_64_mib() {
    let runs = every(&[64 << 20], &[DataType::F32]);
    let n = runs.len();
    let reports = run_ranks(2, 12, runs);
    assert_all_exact(&reports, n);
    for r in &reports[0].results {
        eprintln!("{} {} bytes: {:.3} s", r.collective, r.bytes, r.seconds);
    }
}

#[test]
fn every_abi_version_runs_all_three_collectives() {
    for version in 8..=12 {
        eprintln!("version {version}");
        let runs = every(&[7, 100_003], &[DataType::F32]);
        let n = runs.len();
        let reports = run_ranks(3, version, runs);
        assert_all_exact(&reports, n);
        assert!(reports.iter().all(|r| r.version == version));
    }
}
