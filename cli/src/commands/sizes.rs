//! Message sizes as `lossy bench` and `lossy demo` take them (`--sizes`, `--chunk`): `4096`,
//! `64K`, `1M`, lists and presets; and as their tables print them.

/// Largest size `--sizes` and `--chunk` take, in bytes: 4 times the largest sweep (256 MiB).
/// Each rank allocates a few buffers of the size (input, output, staging), so a larger one
/// would exhaust memory or abort the ranks rather than measure anything.
pub const MAX_SIZE: usize = 1 << 30;

/// Parses `4096`, `4K`, `1M`, `64MiB`, `1G` into bytes, at most [`MAX_SIZE`].
pub fn parse_size(text: &str) -> std::result::Result<usize, String> {
    let t = text.trim();
    let t = t
        .strip_suffix("iB")
        .or_else(|| t.strip_suffix('B'))
        .unwrap_or(t);
    let (num, shift) = match t.chars().last() {
        Some('K' | 'k') => (&t[..t.len() - 1], 10),
        Some('M' | 'm') => (&t[..t.len() - 1], 20),
        Some('G' | 'g') => (&t[..t.len() - 1], 30),
        _ => (t, 0),
    };
    let too_large = || {
        format!(
            "bad size `{text}`: at most {} ({MAX_SIZE} bytes)",
            fmt_bytes(MAX_SIZE)
        )
    };
    let digits = num.trim();
    if !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()) {
        // Only digits, yet not a usize times the unit: too large, not malformed.
        let bytes = digits
            .parse::<usize>()
            .ok()
            .and_then(|n| n.checked_mul(1usize << shift))
            .ok_or_else(too_large)?;
        return if bytes > MAX_SIZE {
            Err(too_large())
        } else {
            Ok(bytes)
        };
    }
    Err(format!("bad size `{text}` (e.g. 4096, 64K, 1M, 1G)"))
}

/// Sizes from `from` to `to` bytes, doubling (nccl-tests' `-b from -e to -f 2`).
fn doubling(from: usize, to: usize) -> Vec<usize> {
    std::iter::successors(Some(from), |&b| b.checked_mul(2))
        .take_while(|&b| b <= to)
        .collect()
}

/// Parses a size list or preset (`lossy demo`'s: `small` is 4 KiB, 64 KiB and 1 MiB).
pub fn parse_sizes(text: &str) -> std::result::Result<Vec<usize>, String> {
    match text {
        "small" => Ok(vec![4 << 10, 64 << 10, 1 << 20]),
        "large" => Ok(vec![1 << 20, 4 << 20, 16 << 20, 64 << 20, 128 << 20]),
        list => list.split(',').map(parse_size).collect(),
    }
}

/// Parses `lossy bench`'s sizes: the sweeps `small` (8 B to 1 MiB) and `all` (8 B to
/// 256 MiB), doubling as nccl-tests' `-f 2` does, else as [`parse_sizes`].
pub fn parse_bench_sizes(text: &str) -> std::result::Result<Vec<usize>, String> {
    match text {
        "small" => Ok(doubling(8, 1 << 20)),
        "all" => Ok(doubling(8, 256 << 20)),
        other => parse_sizes(other),
    }
}

/// Human-readable bytes (`64 MiB`).
pub fn fmt_bytes(bytes: usize) -> String {
    match bytes {
        b if b >= 1 << 30 && b % (1 << 30) == 0 => format!("{} GiB", b >> 30),
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{} MiB", b >> 20),
        b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{} KiB", b >> 10),
        b => format!("{b} B"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_units_and_presets() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("64K"), Ok(64 << 10));
        assert_eq!(parse_size("1MiB"), Ok(1 << 20));
        assert_eq!(parse_size("1G"), Ok(1 << 30));
        for big in [
            "2G",
            "1073741825",
            "18446744073709551615",
            "99999999999999999999",
        ] {
            let e = parse_size(big).unwrap_err();
            assert!(e.contains("at most 1 GiB (1073741824 bytes)"), "{big}: {e}");
        }
        assert!(parse_size("lots").is_err());
        assert_eq!(parse_sizes("small").map(|v| v.len()), Ok(3));
        assert_eq!(parse_bench_sizes("small").map(|v| v.len()), Ok(18));
        assert_eq!(
            parse_bench_sizes("all").map(|v| (v[0], v.len())),
            Ok((8, 26))
        );
        assert_eq!(parse_sizes("1K,2K"), Ok(vec![1024, 2048]));
        assert_eq!(fmt_bytes(64 << 20), "64 MiB");
        assert_eq!(fmt_bytes(1027), "1027 B");
    }
}
