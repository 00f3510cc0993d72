//! JSON for fingerprints and natural keys: a small strict parser, the
//! RFC 8785 canonical form (JCS), and RFC 6901 JSON pointers. Pure.
//!
//! The canonical form (RFC 8785 §3.2):
//! - no insignificant whitespace;
//! - object members sorted by their names as UTF-16 code units (§3.2.3);
//! - numbers parsed as IEEE 754 doubles and written as ECMAScript's
//!   `Number.prototype.toString` writes them (§3.2.2.3): `1e+21`, `1e-7`,
//!   `0.000001`, `-0` as `0`; one exception: a number whose decimal value
//!   is not the double's (shortest round-trip digits) keeps its value's
//!   digits, laid out as ECMAScript would lay them out: a 64-bit id such as
//!   `9007199254740993`, an amount such as `10.000000000000001`
//!   (payment code parses amounts as decimals). JCS would round both to
//!   the nearest double, so two bodies differing only there would share a
//!   fingerprint and the second be served the first's response. Numbers a
//!   double does hold keep JCS's form however they are written (`1.0`,
//!   `1e0` and `1` are `1`);
//! - strings with only `\"`, `\\`, `\b`, `\f`, `\n`, `\r`, `\t` and
//!   `\u00xx` (lower-case hex, other controls) escaped; everything else as
//!   UTF-8 (§3.2.2.2).
//!
//! The parser is stricter than most, as JCS requires its input to be I-JSON
//! (RFC 7493): a document with a duplicate member name, a lone surrogate, a
//! number out of the double range, or nesting deeper than [`MAX_DEPTH`] is
//! refused ([`JsonError`]). Callers decide what a refusal means: the
//! fingerprint falls back to the raw bytes, a key read from the body is a
//! 400. Recursion is bounded by [`MAX_DEPTH`], so no body can overflow the
//! stack.

use std::cmp::Ordering;
use std::fmt;

/// Nesting deeper than this is refused: it bounds the parser's, the
/// writer's and the destructor's recursion. Real webhook payloads nest a
/// handful of levels; serde_json's default limit is also 128.
pub const MAX_DEPTH: usize = 128;

/// Values (scalars, arrays, objects and members) at most in one document:
/// the parsed tree takes tens of bytes per value, so this bounds it (a few
/// MiB) whatever the body size. Webhook payloads have hundreds.
pub const MAX_VALUES: usize = 65_536;

/// A parsed JSON value. Object members keep their order as sent (the
/// writer sorts); a number keeps the text it was written as, for keys.
#[derive(Clone, Debug, PartialEq)]
pub enum Json {
    Null,
    Bool(bool),
    Number { value: f64, text: Box<str> },
    String(String),
    Array(Vec<Json>),
    Object(Vec<(String, Json)>),
}

/// Why a body is not (canonicalizable) JSON.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum JsonError {
    #[error("the body is not JSON (at byte {0})")]
    Syntax(usize),
    #[error("the body nests deeper than {MAX_DEPTH} levels")]
    TooDeep,
    #[error("the body has the member {0:?} twice in one object")]
    DuplicateKey(String),
    #[error("the body has a number outside the range of a double")]
    NumberOutOfRange,
    #[error("the body has a string with a lone surrogate")]
    LoneSurrogate,
    #[error("the body has more than {MAX_VALUES} values")]
    TooManyValues,
}

/// Parses a whole document (surrounding whitespace allowed, nothing else).
pub fn parse(bytes: &[u8]) -> Result<Json, JsonError> {
    let mut p = Parser {
        bytes,
        pos: 0,
        values: 0,
    };
    p.ws();
    let value = p.value(0)?;
    p.ws();
    if p.pos != bytes.len() {
        return Err(JsonError::Syntax(p.pos));
    }
    Ok(value)
}

/// The RFC 8785 form of `bytes`, if they are a JSON document it accepts.
pub fn canonicalize(bytes: &[u8]) -> Result<Vec<u8>, JsonError> {
    let value = parse(bytes)?;
    let mut out = Vec::with_capacity(bytes.len());
    write(&value, &mut out);
    Ok(out)
}

/// Appends the canonical form of `value` to `out`.
pub fn write(value: &Json, out: &mut Vec<u8>) {
    match value {
        Json::Null => out.extend_from_slice(b"null"),
        Json::Bool(true) => out.extend_from_slice(b"true"),
        Json::Bool(false) => out.extend_from_slice(b"false"),
        Json::Number { value, text } => out.extend_from_slice(number_form(*value, text).as_bytes()),
        Json::String(s) => write_string(s, out),
        Json::Array(items) => {
            out.push(b'[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write(item, out);
            }
            out.push(b']');
        }
        Json::Object(members) => {
            let mut sorted: Vec<&(String, Json)> = members.iter().collect();
            sorted.sort_by(|a, b| utf16_cmp(&a.0, &b.0));
            out.push(b'{');
            for (i, (name, item)) in sorted.into_iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_string(name, out);
                out.push(b':');
                write(item, out);
            }
            out.push(b'}');
        }
    }
}

/// §3.2.3: names compare as arrays of UTF-16 code units, so U+1F600
/// (D83D DE00) sorts before U+FB33.
fn utf16_cmp(a: &str, b: &str) -> Ordering {
    a.encode_utf16().cmp(b.encode_utf16())
}

/// §3.2.2.2: the escapes JCS (ECMAScript `JSON.stringify`) uses.
fn write_string(s: &str, out: &mut Vec<u8>) {
    out.push(b'"');
    for c in s.chars() {
        match c {
            '"' => out.extend_from_slice(b"\\\""),
            '\\' => out.extend_from_slice(b"\\\\"),
            '\u{8}' => out.extend_from_slice(b"\\b"),
            '\u{c}' => out.extend_from_slice(b"\\f"),
            '\n' => out.extend_from_slice(b"\\n"),
            '\r' => out.extend_from_slice(b"\\r"),
            '\t' => out.extend_from_slice(b"\\t"),
            c if (c as u32) < 0x20 => {
                out.extend_from_slice(format!("\\u{:04x}", c as u32).as_bytes());
            }
            c => {
                let mut buf = [0; 4];
                out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
            }
        }
    }
    out.push(b'"');
}

/// The canonical text of a parsed number: ECMAScript's form of the double,
/// unless the decimal value written is not the double's, which keeps its
/// own digits (see the module docs).
fn number_form(value: f64, text: &str) -> String {
    let written = decimal(text);
    if written == decimal(&format!("{:e}", value.abs())) {
        return es_number(value);
    }
    let (digits, last) = written;
    // Not zero: zero is every double's `("", 0)` and every zero's too.
    let sign = if text.starts_with('-') { "-" } else { "" };
    let n = last.saturating_add(digits.len() as i64);
    format!("{sign}{}", es_layout(&digits, n))
}

/// A decimal's significant digits (no leading or trailing zeros) and the
/// power of ten of its last digit; zero is `("", 0)`. Sign ignored. An
/// exponent past `i64` saturates (such a number is zero or infinite as a
/// double, and only another as absurd one could share its form).
fn decimal(text: &str) -> (String, i64) {
    let text = text.trim_start_matches('-');
    let (mantissa, exp) = match text.find(['e', 'E']) {
        Some(i) => (&text[..i], exponent(&text[i + 1..])),
        None => (text, 0),
    };
    let (int, frac) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    let all = format!("{int}{frac}");
    let digits = all.trim_start_matches('0').trim_end_matches('0');
    if digits.is_empty() {
        return (String::new(), 0);
    }
    let trailing = (all.len() - all.trim_end_matches('0').len()) as i64;
    let last = exp
        .saturating_sub(frac.len() as i64)
        .saturating_add(trailing);
    (digits.to_string(), last)
}

/// An exponent's digits (sign allowed), saturating at `i64`'s range.
fn exponent(text: &str) -> i64 {
    text.parse::<i64>().unwrap_or(if text.starts_with('-') {
        i64::MIN
    } else {
        i64::MAX
    })
}

/// ECMAScript's Number::toString(10) for a finite double (ECMA-262
/// §6.1.6.1.20), from the shortest round-trip digits Rust's `{:e}` gives.
pub fn es_number(v: f64) -> String {
    if v == 0.0 {
        return "0".into();
    }
    if v < 0.0 {
        return format!("-{}", es_number(-v));
    }
    let sci = format!("{v:e}");
    let (mantissa, exp) = sci.split_once('e').expect("{:e} always has an exponent");
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    let n = exp.parse::<i64>().expect("{:e} writes an integer exponent") + 1;
    es_layout(&digits, n)
}

/// ECMAScript's layout of the positive number `0.digits × 10^n` (`digits`
/// without leading or trailing zeros): plain up to 21 integer digits, then
/// `d.ddde+N`; plain down to `0.000001`, then `d.ddde-N`.
fn es_layout(digits: &str, n: i64) -> String {
    let k = digits.len() as i64;
    if k <= n && n <= 21 {
        format!("{digits}{}", "0".repeat((n - k) as usize))
    } else if 0 < n && n <= 21 {
        let (int, frac) = digits.split_at(n as usize);
        format!("{int}.{frac}")
    } else if -6 < n && n <= 0 {
        format!("0.{}{digits}", "0".repeat((-n) as usize))
    } else {
        let e = n.saturating_sub(1);
        let sign = if e < 0 { '-' } else { '+' };
        match digits.split_at(1) {
            (first, "") => format!("{first}e{sign}{}", e.unsigned_abs()),
            (first, rest) => format!("{first}.{rest}e{sign}{}", e.unsigned_abs()),
        }
    }
}

// ===== JSON pointers (RFC 6901) =====

/// A validated RFC 6901 pointer: `""` (the whole document) or `/`-separated
/// reference tokens with `~1` for `/` and `~0` for `~`.
#[derive(Clone, PartialEq, Eq)]
pub struct Pointer {
    source: String,
    tokens: Vec<String>,
}

impl Pointer {
    pub fn parse(source: &str) -> Result<Self, String> {
        if source.is_empty() {
            return Ok(Self {
                source: String::new(),
                tokens: Vec::new(),
            });
        }
        let Some(rest) = source.strip_prefix('/') else {
            return Err(format!(
                "JSON pointer {source:?} must start with '/' (RFC 6901), e.g. \"/message/messageId\""
            ));
        };
        let mut tokens = Vec::new();
        for raw in rest.split('/') {
            let mut token = String::with_capacity(raw.len());
            let mut chars = raw.chars();
            while let Some(c) = chars.next() {
                token.push(match c {
                    '~' => match chars.next() {
                        Some('0') => '~',
                        Some('1') => '/',
                        _ => {
                            return Err(format!(
                            "JSON pointer {source:?}: '~' must be followed by 0 or 1 (RFC 6901 §3)"
                        ))
                        }
                    },
                    c => c,
                });
            }
            tokens.push(token);
        }
        Ok(Self {
            source: source.to_string(),
            tokens,
        })
    }

    pub fn as_str(&self) -> &str {
        &self.source
    }

    /// The value the pointer refers to in `doc` (§4: an array index is
    /// digits without leading zeros; `-` never refers to an element).
    pub fn find<'a>(&self, doc: &'a Json) -> Option<&'a Json> {
        self.tokens.iter().try_fold(doc, |at, token| match at {
            Json::Object(members) => Some(&members.iter().find(|(name, _)| name == token)?.1),
            Json::Array(items) => items.get(array_index(token)?),
            _ => None,
        })
    }

    /// Removes what the pointer refers to; `false` if there is nothing.
    /// The whole document (`""`) cannot be removed.
    pub fn remove(&self, doc: &mut Json) -> bool {
        let Some((last, parents)) = self.tokens.split_last() else {
            return false;
        };
        let parent = parents.iter().try_fold(doc, |at, token| match at {
            Json::Object(members) => {
                Some(&mut members.iter_mut().find(|(name, _)| name == token)?.1)
            }
            Json::Array(items) => items.get_mut(array_index(token)?),
            _ => None,
        });
        match parent {
            Some(Json::Object(members)) => {
                let before = members.len();
                members.retain(|(name, _)| name != last);
                members.len() != before
            }
            Some(Json::Array(items)) => match array_index(last).filter(|i| *i < items.len()) {
                Some(i) => {
                    items.remove(i);
                    true
                }
                None => false,
            },
            _ => false,
        }
    }
}

fn array_index(token: &str) -> Option<usize> {
    let valid = token == "0"
        || (!token.is_empty()
            && !token.starts_with('0')
            && token.bytes().all(|b| b.is_ascii_digit()));
    valid.then(|| token.parse().ok()).flatten()
}

impl fmt::Debug for Pointer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Pointer({:?})", self.source)
    }
}

impl fmt::Display for Pointer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.source)
    }
}

// ===== the parser =====

struct Parser<'a> {
    bytes: &'a [u8],
    pos: usize,
    /// Values parsed so far, against [`MAX_VALUES`].
    values: usize,
}

impl Parser<'_> {
    fn ws(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.bytes.get(self.pos) {
            self.pos += 1;
        }
    }

    fn syntax(&self) -> JsonError {
        JsonError::Syntax(self.pos)
    }

    fn eat(&mut self, b: u8) -> Result<(), JsonError> {
        self.literal(&[b], ())
    }

    /// `value` if `word` comes next (and is consumed).
    fn literal<T>(&mut self, word: &[u8], value: T) -> Result<T, JsonError> {
        if self.bytes[self.pos..].starts_with(word) {
            self.pos += word.len();
            Ok(value)
        } else {
            Err(self.syntax())
        }
    }

    /// One value at nesting `depth` (the document is at 0).
    fn value(&mut self, depth: usize) -> Result<Json, JsonError> {
        self.values += 1;
        if self.values > MAX_VALUES {
            return Err(JsonError::TooManyValues);
        }
        match self.bytes.get(self.pos) {
            Some(b'n') => self.literal(b"null", Json::Null),
            Some(b't') => self.literal(b"true", Json::Bool(true)),
            Some(b'f') => self.literal(b"false", Json::Bool(false)),
            Some(b'"') => self.string().map(Json::String),
            Some(b'-' | b'0'..=b'9') => self.number(),
            Some(b'[' | b'{') if depth >= MAX_DEPTH => Err(JsonError::TooDeep),
            Some(b'[') => {
                self.pos += 1;
                let mut items = Vec::new();
                self.ws();
                if self.eat(b']').is_ok() {
                    return Ok(Json::Array(items));
                }
                loop {
                    self.ws();
                    items.push(self.value(depth + 1)?);
                    self.ws();
                    if self.eat(b',').is_err() {
                        break;
                    }
                }
                self.eat(b']')?;
                Ok(Json::Array(items))
            }
            Some(b'{') => {
                self.pos += 1;
                let mut members: Vec<(String, Json)> = Vec::new();
                self.ws();
                if self.eat(b'}').is_ok() {
                    return Ok(Json::Object(members));
                }
                loop {
                    self.ws();
                    let name = self.string()?;
                    self.ws();
                    self.eat(b':')?;
                    self.ws();
                    let value = self.value(depth + 1)?;
                    members.push((name, value));
                    self.ws();
                    if self.eat(b',').is_err() {
                        break;
                    }
                }
                self.eat(b'}')?;
                // Sorted copy of the names: O(n log n), not a quadratic scan.
                let mut names: Vec<&str> = members.iter().map(|(n, _)| n.as_str()).collect();
                names.sort_unstable();
                if let Some(w) = names.windows(2).find(|w| w[0] == w[1]) {
                    return Err(JsonError::DuplicateKey(w[0].to_string()));
                }
                Ok(Json::Object(members))
            }
            _ => Err(self.syntax()),
        }
    }

    /// RFC 8259 §6 grammar; the value as Rust parses it (correctly rounded).
    fn number(&mut self) -> Result<Json, JsonError> {
        let start = self.pos;
        let digits = |p: &mut Self| {
            let from = p.pos;
            while p.bytes.get(p.pos).is_some_and(u8::is_ascii_digit) {
                p.pos += 1;
            }
            p.pos - from
        };
        if self.bytes.get(self.pos) == Some(&b'-') {
            self.pos += 1;
        }
        match self.bytes.get(self.pos) {
            Some(b'0') => self.pos += 1,
            Some(b'1'..=b'9') => {
                digits(self);
            }
            _ => return Err(self.syntax()),
        }
        if self.bytes.get(self.pos) == Some(&b'.') {
            self.pos += 1;
            if digits(self) == 0 {
                return Err(self.syntax());
            }
        }
        if let Some(b'e' | b'E') = self.bytes.get(self.pos) {
            self.pos += 1;
            if let Some(b'+' | b'-') = self.bytes.get(self.pos) {
                self.pos += 1;
            }
            if digits(self) == 0 {
                return Err(self.syntax());
            }
        }
        let text = std::str::from_utf8(&self.bytes[start..self.pos]).expect("ASCII");
        let value: f64 = text.parse().map_err(|_| JsonError::Syntax(start))?;
        if !value.is_finite() {
            return Err(JsonError::NumberOutOfRange);
        }
        Ok(Json::Number {
            value,
            text: text.into(),
        })
    }

    fn hex4(&mut self) -> Result<u32, JsonError> {
        let hex = self
            .bytes
            .get(self.pos..self.pos + 4)
            .ok_or_else(|| self.syntax())?;
        let s = std::str::from_utf8(hex).map_err(|_| self.syntax())?;
        if !s.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(self.syntax());
        }
        self.pos += 4;
        Ok(u32::from_str_radix(s, 16).expect("checked hex"))
    }

    fn string(&mut self) -> Result<String, JsonError> {
        self.eat(b'"')?;
        let mut out = Vec::new();
        loop {
            let Some(&b) = self.bytes.get(self.pos) else {
                return Err(self.syntax());
            };
            self.pos += 1;
            match b {
                b'"' => break,
                b'\\' => {
                    let Some(&e) = self.bytes.get(self.pos) else {
                        return Err(self.syntax());
                    };
                    self.pos += 1;
                    let c = match e {
                        b'"' => '"',
                        b'\\' => '\\',
                        b'/' => '/',
                        b'b' => '\u{8}',
                        b'f' => '\u{c}',
                        b'n' => '\n',
                        b'r' => '\r',
                        b't' => '\t',
                        b'u' => {
                            let hi = self.hex4()?;
                            let code = match hi {
                                0xd800..=0xdbff => {
                                    if !self.bytes[self.pos..].starts_with(b"\\u") {
                                        return Err(JsonError::LoneSurrogate);
                                    }
                                    self.pos += 2;
                                    let lo = self.hex4()?;
                                    if !(0xdc00..=0xdfff).contains(&lo) {
                                        return Err(JsonError::LoneSurrogate);
                                    }
                                    0x10000 + ((hi - 0xd800) << 10) + (lo - 0xdc00)
                                }
                                0xdc00..=0xdfff => return Err(JsonError::LoneSurrogate),
                                c => c,
                            };
                            char::from_u32(code).ok_or(JsonError::LoneSurrogate)?
                        }
                        _ => return Err(self.syntax()),
                    };
                    let mut buf = [0; 4];
                    out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
                }
                0x00..=0x1f => return Err(JsonError::Syntax(self.pos - 1)),
                _ => out.push(b),
            }
        }
        String::from_utf8(out).map_err(|_| self.syntax())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn canon(s: &str) -> String {
        String::from_utf8(canonicalize(s.as_bytes()).unwrap()).unwrap()
    }

    /// RFC 8785 §3.2.2.3 and Appendix B: ECMAScript number serialization.
    /// Regressions: numbers a double rounds were written as the rounded
    /// double, so bodies differing only in a 64-bit id, or in an amount's
    /// 17th digit, shared a fingerprint and a reused key replayed the other
    /// body's response instead of a 422.
    #[test]
    fn numbers_a_double_cannot_hold_keep_their_exact_value() {
        for (a, b) in [
            ("[9007199254740993]", "[9007199254740992]"),
            ("[10.000000000000001]", "[10.000000000000002]"),
            ("[10.000000000000001]", "[10]"),
            ("[0.30000000000000001]", "[0.3]"),
            ("[1e-400]", "[0]"),
            ("[1e-400]", "[2e-400]"),
        ] {
            assert_ne!(canon(a), canon(b), "{a} vs {b}");
        }
        for (text, want) in [
            ("[9007199254740993]", "[9007199254740993]"),
            ("[-18446744073709551615]", "[-18446744073709551615]"),
            (
                "[12345678901234567890001]",
                "[1.2345678901234567890001e+22]",
            ),
            ("[10.000000000000001]", "[10.000000000000001]"),
            ("[-10.0000000000000010]", "[-10.000000000000001]"),
            ("[1000000000000000.1e-1]", "[100000000000000.01]"),
            ("[333333333.33333329]", "[333333333.33333329]"),
            (
                "[0.0000000000000000000000000010000000000000001]",
                "[1.0000000000000001e-27]",
            ),
            ("[1e-400]", "[1e-400]"),
            ("[1e-99999999999999999999999]", "[1e-9223372036854775808]"),
        ] {
            assert_eq!(canon(text), want, "{text}");
            assert_eq!(canon(want), want, "{want} is stable");
        }
        // Numbers a double holds keep JCS's form, however they were written.
        for (text, want) in [
            ("[100]", "[100]"),
            ("[1e2]", "[100]"),
            ("[1.0]", "[1]"),
            ("[10.00]", "[10]"),
            ("[0.1]", "[0.1]"),
            ("[0.10]", "[0.1]"),
            ("[-0]", "[0]"),
            ("[-0.0e5]", "[0]"),
            ("[1e21]", "[1e+21]"),
            ("[1E30]", "[1e+30]"),
            ("[9007199254740992]", "[9007199254740992]"),
            ("[4.50]", "[4.5]"),
        ] {
            assert_eq!(canon(text), want, "{text}");
        }
    }

    #[test]
    // The RFC's own spellings, more digits than a double keeps.
    #[allow(clippy::excessive_precision)]
    fn numbers_follow_ecmascript() {
        let cases: &[(f64, &str)] = &[
            (0.0, "0"),
            (-0.0, "0"),
            (1.0, "1"),
            (-1.5, "-1.5"),
            (0.1, "0.1"),
            (4.50, "4.5"),
            (2e-3, "0.002"),
            (0.000001, "0.000001"),
            (1e-7, "1e-7"),
            (1e20, "100000000000000000000"),
            (1e21, "1e+21"),
            (1e30, "1e+30"),
            (1e-27, "1e-27"),
            (333333333.33333329, "333333333.3333333"),
            (123456789012345680000.0, "123456789012345680000"),
            (9007199254740992.0, "9007199254740992"),
            (5e-324, "5e-324"),
            (1.7976931348623157e308, "1.7976931348623157e+308"),
            (-1e-7, "-1e-7"),
            (1.5e-7, "1.5e-7"),
            (295147905179352830000.0, "295147905179352830000"),
        ];
        for (v, want) in cases {
            assert_eq!(es_number(*v), *want, "{v:e}");
        }
    }

    /// RFC 8785 §3.2.2 example, input and output as printed there but for
    /// `333333333.33333329`, a value no double holds, which keeps its
    /// digits (the module docs' one exception).
    #[test]
    fn the_rfc_8785_example() {
        let input = r#"{
  "numbers": [333333333.33333329, 1E30, 4.50, 2e-3, 0.000000000000000000000000001],
  "string": "\u20ac$\u000F\u000aA'\u0042\u0022\u005c\\\"\/",
  "literals": [null, true, false]
}"#;
        let want = "{\"literals\":[null,true,false],\"numbers\":[333333333.33333329,1e+30,4.5,0.002,1e-27],\"string\":\"€$\\u000f\\nA'B\\\"\\\\\\\\\\\"/\"}";
        assert_eq!(canon(input), want);
    }

    /// RFC 8785 §3.2.3: sorting by UTF-16 code units.
    #[test]
    fn members_sort_by_utf16_code_units() {
        let input = r#"{
  "\u20ac": "Euro Sign",
  "\r": "Carriage Return",
  "\ufb33": "Hebrew Letter Dalet With Dagesh",
  "1": "One",
  "\ud83d\ude00": "Emoji: Grinning Face",
  "\u0080": "Control",
  "\u00f6": "Latin Small Letter O With Diaeresis"
}"#;
        let out = canonicalize(input.as_bytes()).unwrap();
        let Json::Object(members) = parse(&out).unwrap() else {
            panic!("an object");
        };
        let names: Vec<String> = members.into_iter().map(|(n, _)| n).collect();
        assert_eq!(
            names,
            [
                "\r",
                "1",
                "\u{80}",
                "\u{f6}",
                "\u{20ac}",
                "\u{1f600}",
                "\u{fb33}"
            ]
        );
    }

    #[test]
    fn equivalences_and_differences() {
        let same = [
            (
                r#"{"b":1,"a":[1,2]}"#,
                r#"  { "a" : [ 1 , 2 ] , "b" : 1.0 }  "#,
            ),
            (r#"{"a":"\u00e9"}"#, r#"{"a":"é"}"#),
            (r#"{"a":"\/"}"#, r#"{"a":"/"}"#),
            (r#"[1e2]"#, r#"[100]"#),
            (r#"[-0]"#, r#"[0]"#),
            (r#"{"a":{"d":1,"c":2}}"#, r#"{"a":{"c":2,"d":1}}"#),
        ];
        for (a, b) in same {
            assert_eq!(canon(a), canon(b), "{a} vs {b}");
        }
        let different = [
            (r#"{"a":1}"#, r#"{"a":"1"}"#),
            (r#"[1,2]"#, r#"[2,1]"#),
            (r#"{"a":null}"#, r#"{}"#),
            (r#"{"a":1}"#, r#"{"A":1}"#),
            (r#"{"a":"x "}"#, r#"{"a":"x"}"#),
        ];
        for (a, b) in different {
            assert_ne!(canon(a), canon(b), "{a} vs {b}");
        }
    }

    #[test]
    fn refusals() {
        let deep_ok = format!("{}{}", "[".repeat(MAX_DEPTH), "]".repeat(MAX_DEPTH));
        assert!(parse(deep_ok.as_bytes()).is_ok());
        // The array itself is a value too.
        let wide_ok = format!("[{}0]", "0,".repeat(MAX_VALUES - 2));
        assert!(parse(wide_ok.as_bytes()).is_ok());
        let cases: Vec<(Vec<u8>, JsonError)> = vec![
            (
                format!("{}{}", "[".repeat(MAX_DEPTH + 1), "]".repeat(MAX_DEPTH + 1)).into(),
                JsonError::TooDeep,
            ),
            // Far deeper than any stack would take: refused, not overflowed.
            ("[".repeat(1_000_000).into(), JsonError::TooDeep),
            ("{\"a\":".repeat(1_000_000).into(), JsonError::TooDeep),
            (
                br#"{"a":1,"b":2,"a":3}"#.to_vec(),
                JsonError::DuplicateKey("a".into()),
            ),
            (b"[1e400]".to_vec(), JsonError::NumberOutOfRange),
            (
                format!("[{}0]", "0,".repeat(MAX_VALUES)).into(),
                JsonError::TooManyValues,
            ),
            (br#"["\ud800"]"#.to_vec(), JsonError::LoneSurrogate),
            (br#"["\udc00x"]"#.to_vec(), JsonError::LoneSurrogate),
            (b"".to_vec(), JsonError::Syntax(0)),
            (b"{} {}".to_vec(), JsonError::Syntax(3)),
            (b"[01]".to_vec(), JsonError::Syntax(2)),
            (b"[1.]".to_vec(), JsonError::Syntax(3)),
            (b"[.5]".to_vec(), JsonError::Syntax(1)),
            (b"[+1]".to_vec(), JsonError::Syntax(1)),
            (b"[NaN]".to_vec(), JsonError::Syntax(1)),
            (b"[1,]".to_vec(), JsonError::Syntax(3)),
            (b"{\"a\":1,}".to_vec(), JsonError::Syntax(7)),
            (b"[\"a\nb\"]".to_vec(), JsonError::Syntax(3)),
            (b"[\"\xff\"]".to_vec(), JsonError::Syntax(4)),
            (b"\xef\xbb\xbf{}".to_vec(), JsonError::Syntax(0)),
            (b"{'a':1}".to_vec(), JsonError::Syntax(1)),
        ];
        for (input, want) in cases {
            let shown = String::from_utf8_lossy(&input[..input.len().min(20)]).into_owned();
            assert_eq!(parse(&input), Err(want), "{shown}");
        }
    }

    #[test]
    fn control_characters_are_escaped_as_jcs_does() {
        assert_eq!(
            canon(r#"["\u0000\u0008\u0009\u000a\u000c\u000d\u001f\u007f\u2028"]"#),
            "[\"\\u0000\\b\\t\\n\\f\\r\\u001f\u{7f}\u{2028}\"]"
        );
    }

    #[test]
    fn pointers_find_and_remove() {
        let doc =
            parse(br#"{"message":{"messageId":"123","a/b":1,"m~n":2},"list":[10,20],"":{"x":3}}"#)
                .unwrap();
        let find = |p: &str| Pointer::parse(p).unwrap().find(&doc).cloned();
        assert_eq!(find("/message/messageId"), Some(Json::String("123".into())));
        assert_eq!(
            find("/message/a~1b"),
            Some(Json::Number {
                value: 1.0,
                text: "1".into()
            })
        );
        assert!(find("/message/m~0n").is_some());
        assert!(find("/list/1").is_some());
        assert_eq!(find("/list/2"), None);
        assert_eq!(find("/list/01"), None);
        assert_eq!(find("/list/-"), None);
        assert!(find("//x").is_some());
        assert_eq!(find("/missing"), None);
        assert_eq!(find("/list/0/deeper"), None);
        assert_eq!(find(""), Some(doc.clone()));
        for bad in ["message", "/a~2", "/a~"] {
            assert!(Pointer::parse(bad).is_err(), "{bad}");
        }
        let mut d = doc.clone();
        assert!(Pointer::parse("/list/0").unwrap().remove(&mut d));
        assert!(Pointer::parse("/message/messageId").unwrap().remove(&mut d));
        assert!(!Pointer::parse("/message/messageId").unwrap().remove(&mut d));
        assert!(!Pointer::parse("").unwrap().remove(&mut d));
        let mut out = Vec::new();
        write(&d, &mut out);
        assert_eq!(
            String::from_utf8(out).unwrap(),
            r#"{"":{"x":3},"list":[20],"message":{"a/b":1,"m~n":2}}"#
        );
    }

    mod props {
        use super::super::*;
        use proptest::prelude::*;

        fn json() -> impl Strategy<Value = Json> {
            let leaf = prop_oneof![
                Just(Json::Null),
                any::<bool>().prop_map(Json::Bool),
                any::<f64>()
                    .prop_filter("finite", |f| f.is_finite())
                    .prop_map(|value| Json::Number {
                        value,
                        text: format!("{value:e}").into()
                    }),
                any::<String>().prop_map(Json::String),
            ];
            leaf.prop_recursive(4, 32, 6, |inner| {
                prop_oneof![
                    prop::collection::vec(inner.clone(), 0..6).prop_map(Json::Array),
                    prop::collection::btree_map(any::<String>(), inner, 0..6)
                        .prop_map(|m| Json::Object(m.into_iter().collect())),
                ]
            })
        }

        fn reversed(v: &Json) -> Json {
            match v {
                Json::Object(m) => Json::Object(
                    m.iter()
                        .rev()
                        .map(|(k, v)| (k.clone(), reversed(v)))
                        .collect(),
                ),
                Json::Array(items) => Json::Array(items.iter().map(reversed).collect()),
                other => other.clone(),
            }
        }

        proptest! {
            #[test]
            fn canonicalizing_twice_is_once_and_member_order_does_not_matter(doc in json()) {
                let mut once = Vec::new();
                write(&doc, &mut once);
                let twice = canonicalize(&once).expect("canonical output parses");
                prop_assert_eq!(&once, &twice);
                let mut other = Vec::new();
                write(&reversed(&doc), &mut other);
                prop_assert_eq!(once, other);
            }

            #[test]
            fn numbers_round_trip(v in any::<f64>().prop_filter("finite", |f| f.is_finite())) {
                let text = es_number(v);
                let back: f64 = text.parse().unwrap();
                prop_assert!(back == v || (v == 0.0 && back == 0.0), "{} -> {}", v, text);
            }

            #[test]
            fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..64)) {
                let _ = canonicalize(&bytes);
            }
        }
    }
}
