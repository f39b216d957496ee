//! Recorded drop patterns: parsing the two trace file formats and replaying them as runs.
//!
//! Formats (chosen per model with `format`):
//! - `indices`: one lost packet index (0-based, decimal) per line, in any order; duplicates
//!   are merged. The trace is `length` packets long (default: the largest index + 1).
//! - `bitmap`: one character per packet, `1` lost and `0` received, in order; line breaks
//!   and other whitespace are ignored. The trace is as long as the number of `0`/`1`s.
//!
//! In both, `#` starts a comment that runs to the end of the line, and blank lines are ignored.

use std::sync::Arc;

use crate::error::echo;
use crate::loss::rng::NEVER;

/// How the file lists the drops.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TraceFormat {
    /// One lost packet index per line.
    #[default]
    Indices,
    /// `0`/`1` per packet.
    Bitmap,
}

/// What happens after the trace's last packet.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TraceEnd {
    /// Start over from packet 0 (a periodic pattern).
    #[default]
    Wrap,
    /// Lose nothing more once the stream has replayed one whole pass: `length` packets from
    /// where it started (from a random start, to the trace's end and on from its beginning).
    Stop,
}

/// Where each stream starts in the trace.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TraceStart {
    /// At an offset drawn from the stream's own generator, so two connections replaying the
    /// same trace do not lose the same packets at the same time.
    #[default]
    Random,
    /// At packet 0 on every stream (an exact replay).
    Beginning,
}

/// A loaded trace: its lost packets as sorted, disjoint, non-adjacent runs `(start, len)`.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct TraceData {
    /// Lost runs, sorted; adjacent indices are merged into one run. Shared by the traces of
    /// one file that differ in `length` only.
    pub runs: Arc<Vec<(u64, u64)>>,
    /// Length of the trace in packets (every run ends at or before it).
    pub length: u64,
}

/// Largest trace we accept, in packets: far beyond any recording, small enough for `u64` sums.
const MAX_TRACE_PACKETS: u64 = 1 << 48;

/// Largest trace file we read, in bytes. Memory while loading is at most the text plus 8 bytes
/// per listed index of the indices format (each index takes at least 2 bytes of text, so
/// under 4x the file: 64 MiB) plus 16 bytes per lost run (a run takes at least 2 bytes of
/// text in either format, so under 8x the file: 128 MiB); what stays for the run is the runs,
/// one copy per file and process shared by every connection and rule, and a profile's traces
/// together keep at most [`crate::loss::model::MAX_LOADED_TRACE_BYTES`].
/// docs/loss-models.md says the same.
pub const MAX_TRACE_BYTES: u64 = 16 << 20;

impl TraceData {
    /// Parses trace text; `name` labels errors.
    pub fn parse(
        text: &str,
        format: TraceFormat,
        length: Option<u64>,
        name: &str,
    ) -> Result<TraceData, String> {
        TraceData::parse_runs(text, format, name)?.with_length(format, length, name)
    }

    /// Parses trace text into its runs, the trace as long as the text makes it (the largest
    /// index + 1, or the number of `0`/`1`s; 0 for none): [`TraceData::with_length`] then
    /// applies a profile's `length` and refuses a trace of no packets.
    pub fn parse_runs(text: &str, format: TraceFormat, name: &str) -> Result<TraceData, String> {
        // A byte-order mark, which some editors write first, is not part of the trace.
        let text = text.strip_prefix('\u{feff}').unwrap_or(text);
        let mut lost: Vec<u64> = Vec::new();
        let mut runs: Vec<(u64, u64)> = Vec::new();
        let mut packets = 0u64;
        match format {
            TraceFormat::Indices => {
                for (i, line) in text.lines().enumerate() {
                    let body = strip_comment(line);
                    if body.is_empty() {
                        continue;
                    }
                    let too_large = || {
                        format!(
                            "{name}:{}: packet index {} is too large (at most {})",
                            i + 1,
                            echo(body, str::to_string),
                            MAX_TRACE_PACKETS - 1
                        )
                    };
                    let index: u64 = match body.parse() {
                        Ok(index) if index < MAX_TRACE_PACKETS => index,
                        Ok(_) => return Err(too_large()),
                        // Digits only, yet no u64: a number too large, not something else.
                        Err(_) if body.bytes().all(|b| b.is_ascii_digit()) => {
                            return Err(too_large())
                        }
                        Err(_) => {
                            // Escaped: a CR or a NUL printed raw hides what is wrong.
                            return Err(format!(
                                "{name}:{}: {} is not a packet index (a non-negative \
                                 integer)",
                                i + 1,
                                echo(body, |b| format!("{b:?}"))
                            ));
                        }
                    };
                    lost.push(index);
                }
                lost.sort_unstable();
                lost.dedup();
                packets = lost.last().map_or(0, |&last| last + 1);
            }
            TraceFormat::Bitmap => {
                for (i, line) in text.lines().enumerate() {
                    for c in strip_comment(line).chars() {
                        match c {
                            '0' => packets += 1,
                            '1' => {
                                // Straight into the runs: a list of every lost packet
                                // would take 8 bytes per `1` on top.
                                push_lost(&mut runs, packets);
                                packets += 1;
                            }
                            c if c.is_whitespace() => {}
                            c => {
                                return Err(format!(
                                    "{name}:{}: {c:?} is not allowed in a bitmap trace (only 0, 1, whitespace and # comments)",
                                    i + 1
                                ))
                            }
                        }
                    }
                }
            }
        }
        for index in lost {
            push_lost(&mut runs, index);
        }
        // What stays is what the runs hold: not up to twice that, as the vector grew.
        runs.shrink_to_fit();
        Ok(TraceData {
            runs: Arc::new(runs),
            length: packets,
        })
    }

    /// This trace (from [`TraceData::parse_runs`]) with a profile's `length` applied, sharing
    /// its runs; refuses a trace of no packets.
    pub fn with_length(
        &self,
        format: TraceFormat,
        length: Option<u64>,
        name: &str,
    ) -> Result<TraceData, String> {
        let mut packets = self.length;
        match (format, length) {
            (_, None) => {}
            (TraceFormat::Bitmap, Some(_)) => {
                return Err(format!(
                    "{name}: length applies to the indices format only; a bitmap's length is its number of 0/1 characters"
                ))
            }
            (TraceFormat::Indices, Some(len)) => {
                if len > MAX_TRACE_PACKETS {
                    return Err(format!(
                        "{name}: length = {len} is too long (at most {MAX_TRACE_PACKETS} packets)"
                    ));
                }
                if len < packets {
                    return Err(format!(
                        "{name}: length = {len} but the trace loses packet {}: length must be larger than every index",
                        packets - 1
                    ));
                }
                packets = len;
            }
        }
        if packets == 0 {
            return Err(format!(
                "{name}: no packets: the file lists no lost packet index and no length is set \
                 (indices), or holds no 0 or 1 (bitmap); a trace must describe at least one \
                 packet (for a trace of no loss, set length with format = \"indices\")"
            ));
        }
        Ok(TraceData {
            runs: Arc::clone(&self.runs),
            length: packets,
        })
    }

    /// Bytes this trace's runs keep in memory (16 a run, as allocated).
    pub fn kept_bytes(&self) -> u64 {
        (self.runs.capacity() * std::mem::size_of::<(u64, u64)>()) as u64
    }

    /// Lost packets in one pass.
    pub fn lost_packets(&self) -> u64 {
        self.runs.iter().map(|r| r.1).sum()
    }

    /// Fraction of the trace's packets that are lost (0 for an empty trace).
    pub fn loss_rate(&self) -> f64 {
        if self.length == 0 {
            0.0
        } else {
            self.lost_packets() as f64 / self.length as f64
        }
    }

    /// Mean loss burst in one pass; when wrapping, a run at the end joins one at the start,
    /// and a trace that loses every packet is one endless burst (infinite).
    pub fn mean_burst(&self, end: TraceEnd) -> f64 {
        let lost = self.lost_packets();
        if end == TraceEnd::Wrap && lost > 0 && lost == self.length {
            return f64::INFINITY;
        }
        let mut bursts = self.runs.len() as u64;
        if end == TraceEnd::Wrap && bursts > 1 {
            let first = self.runs[0];
            let last = self.runs[self.runs.len() - 1];
            if first.0 == 0 && last.0 + last.1 == self.length {
                bursts -= 1;
            }
        }
        if bursts == 0 {
            0.0
        } else {
            lost as f64 / bursts as f64
        }
    }
}

/// Adds lost packet `index`, at or after every packet in `runs`, to the runs.
fn push_lost(runs: &mut Vec<(u64, u64)>, index: u64) {
    match runs.last_mut() {
        Some((start, len)) if *start + *len == index => *len += 1,
        _ => runs.push((index, 1)),
    }
}

/// A line without its `#` comment and surrounding whitespace.
fn strip_comment(line: &str) -> &str {
    line.split('#').next().unwrap_or_default().trim()
}

/// A stream's position in a trace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TraceCursor {
    /// Next run that has not been passed.
    run: usize,
    /// Packet position in the trace.
    pos: u64,
    /// Packets of the stream's one pass not yet replayed (what `stop` replays).
    left: u64,
}

impl TraceCursor {
    /// A cursor at packet `pos` (taken modulo the trace length).
    pub fn at(data: &TraceData, pos: u64) -> TraceCursor {
        let pos = if data.length == 0 {
            0
        } else {
            pos % data.length
        };
        let run = data.runs.partition_point(|r| r.0 + r.1 <= pos);
        TraceCursor {
            run,
            pos,
            left: data.length,
        }
    }

    /// The next segment of the replay: (packets, lost?). Segments of one kind may follow each
    /// other; the caller merges them.
    /// Under `stop` a stream replays one whole pass from where it started, wrapping past the
    /// trace's end when it started inside: stopping at the end itself would replay only what
    /// follows a random start, and a loss early in the trace would be missed by most streams.
    pub fn next_segment(&mut self, data: &TraceData, end: TraceEnd) -> (u64, bool) {
        if data.runs.is_empty() {
            return (NEVER, false);
        }
        match end {
            TraceEnd::Wrap => self.next_wrapping(data),
            TraceEnd::Stop if self.left == 0 => (NEVER, false),
            TraceEnd::Stop => {
                let (n, lost) = self.next_wrapping(data);
                let n = n.min(self.left);
                self.left -= n;
                (n, lost)
            }
        }
    }

    /// The next segment of the trace repeated without end.
    fn next_wrapping(&mut self, data: &TraceData) -> (u64, bool) {
        if let Some(&(start, len)) = data.runs.get(self.run) {
            if self.pos < start {
                let gap = start - self.pos;
                self.pos = start;
                return (gap, false);
            }
            let left = start + len - self.pos;
            self.pos = start + len;
            self.run += 1;
            return (left, true);
        }
        // Past the last run: the tail, then the trace again from packet 0.
        let tail = data.length - self.pos;
        self.pos = 0;
        self.run = 0;
        (tail, false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn indices_are_sorted_merged_and_commented() {
        let t = TraceData::parse(
            "# header\n5\n3\n\n4 # three in a row\n9\n5\n",
            TraceFormat::Indices,
            None,
            "t",
        )
        .unwrap();
        assert_eq!(*t.runs, vec![(3, 3), (9, 1)]);
        assert_eq!(t.length, 10);
        assert_eq!(t.lost_packets(), 4);
        assert!((t.loss_rate() - 0.4).abs() < 1e-12);
        assert!((t.mean_burst(TraceEnd::Stop) - 2.0).abs() < 1e-12);
        let t = TraceData::parse("1\n", TraceFormat::Indices, Some(100), "t").unwrap();
        assert_eq!(t.length, 100);
    }

    #[test]
    fn bitmap_parses_and_wrap_joins_edge_runs() {
        let t = TraceData::parse("1100\n0011 # c\n", TraceFormat::Bitmap, None, "t").unwrap();
        assert_eq!(*t.runs, vec![(0, 2), (6, 2)]);
        assert_eq!(t.length, 8);
        assert!((t.mean_burst(TraceEnd::Stop) - 2.0).abs() < 1e-12);
        // Wrapping, the run at the end continues into the run at the start: one burst of 4.
        assert!((t.mean_burst(TraceEnd::Wrap) - 4.0).abs() < 1e-12);
        // A trace that loses every packet, wrapped, is one burst that never ends (as uniform
        // with rate 1): not a burst of one pass's length.
        let all = TraceData::parse("111", TraceFormat::Bitmap, None, "t").unwrap();
        assert_eq!(all.mean_burst(TraceEnd::Wrap), f64::INFINITY);
        assert!((all.mean_burst(TraceEnd::Stop) - 3.0).abs() < 1e-12);
    }

    #[test]
    fn bad_traces_name_file_and_line() {
        let err = TraceData::parse("1\nx\n", TraceFormat::Indices, None, "drops.txt").unwrap_err();
        assert!(err.starts_with("drops.txt:2:"), "{err}");
        let err = TraceData::parse("99999999999999999999999\n", TraceFormat::Indices, None, "d")
            .unwrap_err();
        assert!(
            err.contains("packet index 99999999999999999999999 is too large"),
            "{err}"
        );
        let err = TraceData::parse("10\n12\n", TraceFormat::Indices, Some(5), "d").unwrap_err();
        assert!(err.contains("length = 5"), "{err}");
        // `length` is bounded as the indices are.
        let err =
            TraceData::parse("1\n", TraceFormat::Indices, Some(i64::MAX as u64), "d").unwrap_err();
        assert!(
            err.contains("length = 9223372036854775807") && err.contains("at most 281474976710656"),
            "{err}"
        );
        assert!(TraceData::parse("1\n", TraceFormat::Indices, Some(1 << 48), "d").is_ok());
        let err = TraceData::parse("01\n0a1\n", TraceFormat::Bitmap, None, "b").unwrap_err();
        assert!(err.starts_with("b:2:") && err.contains("'a'"), "{err}");
    }

    #[test]
    fn invisible_characters_are_shown_escaped_and_an_empty_trace_is_refused() {
        // A file with old Mac line ends (CR only), a NUL or a byte-order mark: the message
        // named the value with the characters raw, so it read `"13" is not a packet index`.
        let err = TraceData::parse("1\r3\r", TraceFormat::Indices, None, "d").unwrap_err();
        assert!(err.contains(r#""1\r3" is not a packet index"#), "{err}");
        let err = TraceData::parse("0\u{0}1", TraceFormat::Bitmap, None, "b").unwrap_err();
        assert!(err.contains(r"'\0' is not allowed"), "{err}");
        // A byte-order mark (what some editors put first) is not data.
        let t = TraceData::parse("\u{feff}5\n", TraceFormat::Indices, None, "d").unwrap();
        assert_eq!(*t.runs, vec![(5, 1)]);
        let t = TraceData::parse("\u{feff}01\n", TraceFormat::Bitmap, None, "b").unwrap();
        assert_eq!((t.runs.to_vec(), t.length), (vec![(1, 1)], 2));
        // A trace of no packets (an empty or comment-only file) replays nothing: the run it
        // was meant to make lossy would run lossless without a word.
        for (text, format) in [
            ("", TraceFormat::Indices),
            ("# nothing yet\n", TraceFormat::Indices),
            ("\n  \n", TraceFormat::Bitmap),
        ] {
            let err = TraceData::parse(text, format, None, "e").unwrap_err();
            assert!(err.starts_with("e: no packets"), "{text:?}: {err}");
        }
        // No loss listed over a stated length is a trace, of no loss.
        let t = TraceData::parse("", TraceFormat::Indices, Some(100), "d").unwrap();
        assert_eq!((t.runs.len(), t.length), (0, 100));
    }

    #[test]
    fn a_huge_line_is_cut_in_the_error() {
        // One line of 15 MiB gave an error of 15.7 MB through `lossy validate`, and a trace
        // of /proc/self/environ printed the whole environment.
        let whole = 15 << 20;
        for (text, what) in [
            ("x".repeat(whole), "is not a packet index"),
            ("9".repeat(whole), "is too large"),
        ] {
            let err = TraceData::parse(&format!("1\n{text}\n"), TraceFormat::Indices, None, "d")
                .unwrap_err();
            let head: String = err.chars().take(300).collect();
            assert!(err.len() < 300, "{} bytes: {head}", err.len());
            assert!(
                err.starts_with("d:2: ")
                    && err.contains(what)
                    && err.contains('…')
                    && err.contains(&format!("{whole} bytes in all")),
                "{head}"
            );
        }
    }

    fn replay(data: &TraceData, end: TraceEnd, start: u64, packets: u64) -> Vec<bool> {
        let mut c = TraceCursor::at(data, start);
        let mut out = Vec::new();
        while (out.len() as u64) < packets {
            let (n, lost) = c.next_segment(data, end);
            for _ in 0..n.min(packets - out.len() as u64) {
                out.push(lost);
            }
        }
        out
    }

    #[test]
    fn cursor_wraps_stops_and_starts_mid_run() {
        let t = TraceData::parse("0110", TraceFormat::Bitmap, None, "t").unwrap();
        let f = false;
        let l = true;
        assert_eq!(
            replay(&t, TraceEnd::Wrap, 0, 9),
            vec![f, l, l, f, f, l, l, f, f]
        );
        assert_eq!(replay(&t, TraceEnd::Stop, 0, 7), vec![f, l, l, f, f, f, f]);
        // Starting inside a run replays only its remainder.
        assert_eq!(replay(&t, TraceEnd::Wrap, 2, 5), vec![l, f, f, l, l]);
        assert_eq!(replay(&t, TraceEnd::Wrap, 6, 3), vec![l, f, f]);
        // Stopping after a start inside the trace: one whole pass (4 packets, to the end and
        // on from the beginning), then nothing; the pass keeps both lost packets.
        assert_eq!(
            replay(&t, TraceEnd::Stop, 2, 9),
            vec![l, f, f, l, f, f, f, f, f]
        );
        assert_eq!(replay(&t, TraceEnd::Stop, 3, 6), vec![f, f, l, l, f, f]);
        // A trace of no packets is refused when parsed; the cursor still copes with one.
        let empty = TraceData::default();
        assert_eq!(replay(&empty, TraceEnd::Wrap, 0, 3), vec![f, f, f]);
    }
}
