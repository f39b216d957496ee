//! The profile as a tree that remembers where each value came from: parsed from TOML with
//! each value's line (from the parser's spans), then `NCCL_LOSSY_SET` overrides written in.

use toml::de::{DeTable, DeValue};
use toml::Spanned;

use crate::error::{echo, Error, Result};
use crate::profile::check::TOP_KEYS;
use crate::profile::MAX_KEY_SEGMENTS;

/// Where a value came from: a line of the profile, or a layer of overrides (by number).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum At {
    Line(usize),
    Set(usize),
}

#[derive(Clone, Debug, PartialEq)]
pub(super) enum Val {
    Table(Vec<(String, Node)>),
    Array(Vec<Node>),
    Str(String),
    Int(i64),
    /// An integer literal too large for 64 bits (as written; about `f64` in value): out of
    /// every integer key's range, which its key's check names.
    BigInt(String, f64),
    Float(f64),
    Bool(bool),
    /// Dates and times: valid TOML, never valid here.
    Other,
}

#[derive(Clone, Debug, PartialEq)]
pub(super) struct Node {
    pub(super) val: Val,
    pub(super) at: At,
}

impl Node {
    fn table(at: At) -> Node {
        Node {
            val: Val::Table(Vec::new()),
            at,
        }
    }

    pub(super) fn get(&self, key: &str) -> Option<&Node> {
        match &self.val {
            Val::Table(entries) => entries.iter().find(|(k, _)| k == key).map(|(_, n)| n),
            _ => None,
        }
    }

    pub(super) fn entries(&self) -> &[(String, Node)] {
        match &self.val {
            Val::Table(entries) => entries,
            _ => &[],
        }
    }

    /// The value as written in errors (a long string or literal cut, [`echo`]).
    pub(super) fn show(&self) -> String {
        match &self.val {
            Val::Table(_) => "{…}".into(),
            Val::Array(_) => "[…]".into(),
            Val::Str(s) => echo(s, |s| format!("{s:?}")),
            Val::Int(i) => i.to_string(),
            Val::BigInt(literal, _) => echo(literal, str::to_string),
            // Shown as a float: `mtu = 64.0` must not read "mtu = 64: must be an integer".
            Val::Float(f) if f.is_finite() && f.fract() == 0.0 => {
                format!("{f}.0")
            }
            Val::Float(f) => f.to_string(),
            Val::Bool(b) => b.to_string(),
            Val::Other => "(date/time)".into(),
        }
    }
}

/// Line numbers of byte offsets in the profile text.
struct Lines {
    starts: Vec<usize>,
}

impl Lines {
    fn new(text: &str) -> Lines {
        let mut starts = vec![0];
        starts.extend(text.match_indices('\n').map(|(i, _)| i + 1));
        Lines { starts }
    }

    fn line(&self, offset: usize) -> usize {
        self.starts.partition_point(|&s| s <= offset).max(1)
    }
}

/// Converts the parser's values; `lines` is `None` for override values of layer `layer`.
/// `text` is what the spans point into (the profile, or the override's value), so an
/// invalid value is shown as written.
struct Convert<'a> {
    lines: Option<&'a Lines>,
    layer: usize,
    text: &'a str,
}

/// A value the tree cannot hold (a number beyond 64 bits): where, its key, and why.
struct Invalid {
    offset: usize,
    /// The key's segments, innermost first (filled in on the way out).
    key: Vec<String>,
    literal: String,
    message: &'static str,
}

impl Invalid {
    /// `key = literal: why`, the key under `outer` (an override's key; empty in a file).
    fn describe(&self, outer: &str) -> String {
        let inner = self.key.iter().rev().map(String::as_str);
        let key: Vec<&str> = std::iter::once(outer)
            .filter(|k| !k.is_empty())
            .chain(inner)
            .collect();
        format!(
            "{} = {}: {}",
            echo(&key.join("."), str::to_string),
            echo(&self.literal, str::to_string),
            self.message
        )
    }
}

impl Convert<'_> {
    /// The source text of `span`, or `fallback` when the span does not lie in it.
    fn written<'t>(&'t self, span: &std::ops::Range<usize>, fallback: &'t str) -> &'t str {
        match self.text.get(span.clone()) {
            Some(written) if !written.trim().is_empty() => written.trim(),
            _ => fallback,
        }
    }

    fn at(&self, span: std::ops::Range<usize>) -> At {
        match self.lines {
            Some(lines) => At::Line(lines.line(span.start)),
            None => At::Set(self.layer),
        }
    }

    fn table_entries(
        &self,
        table: &DeTable<'_>,
    ) -> std::result::Result<Vec<(String, Node)>, Invalid> {
        table
            .iter()
            .map(|(key, value)| {
                let node = self.value(value, self.at(key.span())).map_err(|mut e| {
                    e.key.push(key.get_ref().to_string());
                    e
                })?;
                Ok((key.get_ref().to_string(), node))
            })
            .collect()
    }

    /// The node of `value`, placed on its own line (implicit tables: `fallback`, their key's).
    fn value(
        &self,
        value: &Spanned<DeValue<'_>>,
        fallback: At,
    ) -> std::result::Result<Node, Invalid> {
        let span = value.span();
        let at = if span.is_empty() {
            fallback
        } else {
            self.at(span.clone())
        };
        let invalid = |literal: &str, message| Invalid {
            offset: span.start,
            key: Vec::new(),
            literal: literal.to_string(),
            message,
        };
        let val = match value.get_ref() {
            DeValue::String(s) => Val::Str(s.to_string()),
            DeValue::Integer(i) => {
                let written = self.written(&span, i.as_str());
                match integer_value(i.as_str(), i.radix(), written) {
                    Some(val) => val,
                    // The parser recovers from a malformed literal (`0x`, `0b2`) with no
                    // digits or stray ones: that is no number at all, not one too large.
                    None => {
                        return Err(invalid(
                            written,
                            "not a valid integer: decimal digits, or 0x, 0o or 0b followed by \
                             digits of that base",
                        ))
                    }
                }
            }
            DeValue::Float(f) => {
                // A finite literal too large for f64 is out of range, not infinity.
                let literal = f.as_str();
                if literal.parse::<f64>().is_err() {
                    // `1e`, `1.`: recovered from by the parser, but no number.
                    return Err(invalid(
                        self.written(&span, literal),
                        "not a valid number (like 0.01, 1e-3, 5, inf or nan)",
                    ));
                }
                // A literal with a non-zero digit that comes out 0 underflowed.
                let mantissa = literal.split(['e', 'E']).next().unwrap_or("");
                let nonzero = mantissa.bytes().any(|b| (b'1'..=b'9').contains(&b));
                match literal.parse::<f64>() {
                    Ok(x) if x == 0.0 && nonzero => {
                        return Err(invalid(
                            literal,
                            "float underflows to 0: the smallest is about 4.9e-324 (64-bit \
                             float); write 0 for none",
                        ))
                    }
                    Ok(x) if !x.is_infinite() || literal.contains("inf") => Val::Float(x),
                    _ => {
                        return Err(invalid(
                            literal,
                            "float out of range: at most about 1.8e308 (64-bit float)",
                        ))
                    }
                }
            }
            DeValue::Boolean(b) => Val::Bool(*b),
            DeValue::Datetime(_) => Val::Other,
            DeValue::Array(items) => Val::Array(
                items
                    .iter()
                    .enumerate()
                    .map(|(i, x)| {
                        self.value(x, at).map_err(|mut e| {
                            e.key.push(i.to_string());
                            e
                        })
                    })
                    .collect::<std::result::Result<_, _>>()?,
            ),
            DeValue::Table(table) => Val::Table(self.table_entries(table)?),
        };
        Ok(Node { val, at })
    }
}

/// The tree of profile `text`; errors say `origin:line: not valid TOML: why`, or for a number
/// beyond 64 bits `origin:line: key = value: why`.
pub(super) fn parse(text: &str, origin: &str) -> Result<Node> {
    let lines = Lines::new(text);
    let located = |offset: usize, message: &str| {
        Error::invalid_argument(format!("{origin}:{}: {message}", lines.line(offset)))
    };
    // The parser reports errors in no particular order, and values too large for 64 bits only
    // show when converted: the first in the text is the one to fix first.
    let (doc, errors) = DeTable::parse_recoverable(text);
    let convert = Convert {
        lines: Some(&lines),
        layer: 0,
        text,
    };
    let entries = convert.table_entries(doc.get_ref());
    let syntax = errors.iter().map(|err| {
        let offset = err.span().map_or(0, |s| s.start);
        let message = err.message().trim_end();
        let named = match err.span().and_then(|span| text.get(span)) {
            Some(written) if message == "duplicate key" => duplicate(doc.get_ref(), written),
            _ => String::new(),
        };
        (offset, format!("not valid TOML: {message}{named}"))
    });
    let value = entries.as_ref().err().map(|e| (e.offset, e.describe("")));
    if let Some((offset, message)) = syntax.chain(value).min_by_key(|(offset, _)| *offset) {
        return Err(located(offset, &message));
    }
    let entries = entries.map_err(|e| located(e.offset, &e.describe("")))?;
    Ok(Node {
        val: Val::Table(entries),
        at: At::Line(1),
    })
}

/// What a "duplicate key" error adds, for the key `written` at its span: the key's dotted
/// path when one key of the document (`doc`, which holds its first setting) has that name, the
/// key as written when several do, and the rule that makes it an error.
fn duplicate(doc: &DeTable<'_>, written: &str) -> String {
    let name = written.trim();
    let name = name
        .strip_prefix(['"', '\''])
        .and_then(|n| n.strip_suffix(['"', '\'']))
        .unwrap_or(name);
    let mut paths = Vec::new();
    dotted_paths(doc, "", name, &mut paths);
    let key = match paths.as_slice() {
        [path] => path.as_str(),
        _ => name,
    };
    format!(
        " {}: a key or table is set once in a profile (to change a value for one run, use \
         NCCL_LOSSY_SET)",
        echo(key, |k| format!("`{k}`"))
    )
}

/// Appends the dotted path of every key under `table` (at `prefix`) named `name`.
fn dotted_paths(table: &DeTable<'_>, prefix: &str, name: &str, out: &mut Vec<String>) {
    for (key, value) in table.iter() {
        let path = if prefix.is_empty() {
            key.get_ref().to_string()
        } else {
            format!("{prefix}.{}", key.get_ref())
        };
        if key.get_ref() == name {
            out.push(path.clone());
        }
        dotted_value_paths(value.get_ref(), &path, name, out);
    }
}

/// The value of an integer literal's `digits` in `radix` (`written`: the literal as written):
/// `Int`, or `BigInt` when it is too large for 64 bits, which is out of every integer key's
/// range and so left for the key's check to name (`mtu = 99999999999999999999` is no more an
/// mtu than `mtu = 1`); `None` when the digits are malformed.
fn integer_value(digits: &str, radix: u32, written: &str) -> Option<Val> {
    use std::num::IntErrorKind::{NegOverflow, PosOverflow};
    let e = match i64::from_str_radix(digits, radix) {
        Ok(v) => return Some(Val::Int(v)),
        Err(e) => e,
    };
    let sign = match e.kind() {
        PosOverflow => 1.0,
        NegOverflow => -1.0,
        _ => return None,
    };
    let magnitude = u128::from_str_radix(digits.trim_start_matches(['+', '-']), radix)
        .map_or(f64::INFINITY, |v| v as f64);
    Some(Val::BigInt(written.to_string(), sign * magnitude))
}

fn dotted_value_paths(value: &DeValue<'_>, prefix: &str, name: &str, out: &mut Vec<String>) {
    match value {
        DeValue::Table(table) => dotted_paths(table, prefix, name, out),
        DeValue::Array(items) => {
            for (i, item) in items.iter().enumerate() {
                dotted_value_paths(item.get_ref(), &format!("{prefix}.{i}"), name, out);
            }
        }
        _ => {}
    }
}

/// Writes `overrides` (`a.b=v;c=w`), layer number `layer` from `source` (`NCCL_LOSSY_SET`,
/// `--set`), into the tree.
pub(super) fn apply_overrides(
    root: &mut Node,
    overrides: &str,
    layer: usize,
    source: &str,
) -> Result<()> {
    for item in split_overrides(overrides, source)? {
        let item = item.trim();
        if item.is_empty() {
            continue;
        }
        let Some((key, raw)) = item.split_once('=') else {
            return Err(Error::invalid_argument(format!(
                "{source}: {}: expected key=value, e.g. model.rate=0.01",
                echo(item, |i| format!("`{i}`"))
            )));
        };
        let key = key.trim();
        let shown_key = echo(key, str::to_string);
        // Checked before the key is split: a key of thousands of segments would nest the
        // tree (and `set_path`'s recursion) as deep.
        let segments = key.split('.').count();
        if segments > MAX_KEY_SEGMENTS {
            return Err(Error::invalid_argument(format!(
                "{source}: {}: a key has at most {MAX_KEY_SEGMENTS} segments (like \
                 rules.0.model.rate), this one has {segments}",
                echo(key, |k| format!("`{k}`"))
            )));
        }
        let path: Vec<&str> = key.split('.').map(str::trim).collect();
        if path.iter().any(|p| p.is_empty()) {
            return Err(Error::invalid_argument(format!(
                "{source}: {}: not a dotted key (like model.rate or rules.0.effect)",
                echo(key, |k| format!("`{k}`"))
            )));
        }
        let raw = raw.trim();
        // A bare word that is not TOML (effect=zero) is taken as a string; a number beyond
        // 64 bits is an error, as in the file.
        let value = match DeValue::parse(raw) {
            Ok(v) => Some(
                Convert {
                    lines: None,
                    layer,
                    text: raw,
                }
                .value(&v, At::Set(layer))
                .map_err(|e| Error::invalid_argument(format!("{source}: {}", e.describe(key))))?,
            ),
            // A value that opens a list or a table is meant as TOML: taken as a string, a
            // missing bracket would be blamed on the value's content ("unknown model kind").
            Err(e) if raw.starts_with(['[', '{']) => {
                let why = e.message().trim_end();
                let hint = if why.contains("must be quoted") {
                    " (strings inside a list or table need quotes: [\"AllReduce\", \"Send\"])"
                } else {
                    ""
                };
                return Err(Error::invalid_argument(format!(
                    "{source}: {shown_key} = {}: not valid TOML: {why}{hint}",
                    echo(raw, |r| format!("`{r}`"))
                )));
            }
            // A bare word holding another override (`description=sweep model.rate=0.5`): a
            // `;` left out, which would turn the second override into part of a string.
            Err(_) => match swallowed_override(raw) {
                Some(inner) => {
                    return Err(Error::invalid_argument(format!(
                        "{source}: {shown_key} = {}: holds {}, another override: separate \
                         overrides with `;` (key=value;key=value), or quote a string that holds \
                         `=`",
                        echo(raw, |r| format!("`{r}`")),
                        echo(inner, |i| format!("`{i}`"))
                    )))
                }
                None => None,
            },
        };
        let value = value.unwrap_or_else(|| Node {
            val: Val::Str(raw.to_string()),
            at: At::Set(layer),
        });
        set_path(root, &path, 0, value)
            .map_err(|msg| Error::invalid_argument(format!("{source}: {shown_key}: {msg}")))?;
    }
    Ok(())
}

/// The first `key=value` inside a bare override value whose key names a key of the profile
/// (its first dotted segment is a top-level key): what a `;` left out between two overrides
/// makes of the second.
fn swallowed_override(raw: &str) -> Option<&str> {
    raw.split(|c: char| c.is_whitespace() || c == ',')
        .find(|token| {
            token.split_once('=').is_some_and(|(key, _)| {
                let first = key.split('.').next().unwrap_or_default();
                TOP_KEYS.contains(&first)
            })
        })
}

/// Splits `a=1;b="x;y"` at the `;` outside quotes: a quoted TOML string (basic `"..."` with
/// backslash escapes, or literal `'...'`) may contain `;`.
fn split_overrides<'a>(overrides: &'a str, source: &str) -> Result<Vec<&'a str>> {
    let mut items = Vec::new();
    let mut start = 0;
    let mut quote: Option<char> = None;
    let mut escaped = false;
    for (i, c) in overrides.char_indices() {
        match quote {
            Some('"') if escaped => escaped = false,
            Some('"') if c == '\\' => escaped = true,
            Some(q) if c == q => quote = None,
            Some(_) => {}
            None if c == '"' || c == '\'' => quote = Some(c),
            None if c == ';' => {
                items.push(&overrides[start..i]);
                start = i + 1;
            }
            None => {}
        }
    }
    if let Some(q) = quote {
        return Err(Error::invalid_argument(format!(
            "{source}: {}: unterminated {q} quote",
            echo(overrides[start..].trim(), |o| format!("`{o}`"))
        )));
    }
    items.push(&overrides[start..]);
    Ok(items)
}

fn set_path(
    node: &mut Node,
    path: &[&str],
    depth: usize,
    value: Node,
) -> std::result::Result<(), String> {
    let head = path[depth];
    let last = depth + 1 == path.len();
    let prefix = path[..=depth].join(".");
    match &mut node.val {
        Val::Table(entries) => {
            let pos = entries.iter().position(|(k, _)| k == head);
            if last {
                match pos {
                    Some(i) => entries[i].1 = value,
                    None => entries.push((head.to_string(), value)),
                }
                return Ok(());
            }
            let i = match pos {
                Some(i) => i,
                None => {
                    if path[depth + 1].parse::<usize>().is_ok() {
                        return Err(format!(
                            "{} is not in the profile, so it has no entry {}",
                            echo(&prefix, str::to_string),
                            echo(path[depth + 1], str::to_string)
                        ));
                    }
                    entries.push((head.to_string(), Node::table(value.at)));
                    entries.len() - 1
                }
            };
            set_path(&mut entries[i].1, path, depth + 1, value)
        }
        Val::Array(items) => {
            let parent = echo(&path[..depth].join("."), str::to_string);
            let index: usize = head.parse().map_err(|_| {
                format!("{parent} is a list: address its entries by number, like {parent}.0")
            })?;
            let len = items.len();
            let item = items
                .get_mut(index)
                .ok_or_else(|| format!("{parent} has no entry {index} (it has {len})"))?;
            if last {
                *item = value;
                Ok(())
            } else {
                set_path(item, path, depth + 1, value)
            }
        }
        _ => Err(format!(
            "{} is a value, not a table",
            echo(&path[..depth].join("."), str::to_string)
        )),
    }
}
