//! The shape of idemgate's own error answers on a route (`errors = ..`):
//! RFC 9457 problem details (the default), the same with Stripe's `error`
//! member (so Stripe-shaped SDKs raise instead of returning a "result"), or
//! an operator's template for an API whose SDKs expect a shape of their own.
//!
//! A template is text with `{{name}}` placeholders, checked when the config
//! loads: an unknown name, an unclosed `{{` or (for a JSON content type) a
//! rendering that is not JSON is a config error, never a broken answer at
//! request time.

use crate::idempotency::canonical_json;
use std::fmt;
use std::sync::Arc;

/// Longest template accepted: an error body, not a page.
pub const MAX_TEMPLATE_BYTES: usize = 8 * 1024;

/// How a route's error answers are written.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum ErrorShape {
    /// `errors = "problem"`: `application/problem+json` (RFC 9457).
    #[default]
    Problem,
    /// `errors = "stripe"`: the problem members plus
    /// `"error": { "type", "code", "message" }`.
    Stripe,
    /// `errors = { template = "..", content_type = ".." }`.
    Template(Arc<ErrorTemplate>),
}

impl fmt::Display for ErrorShape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ErrorShape::Problem => f.write_str("problem"),
            ErrorShape::Stripe => f.write_str("stripe"),
            ErrorShape::Template(t) => write!(f, "template ({})", t.content_type),
        }
    }
}

/// What a template may name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Field {
    /// The HTTP status code, as a number.
    Status,
    /// idemgate's stable code for the problem (`key-missing`, `in-flight`, ..).
    Code,
    /// The problem's `type` URI.
    Type,
    Title,
    Detail,
    /// The short non-reversible key id (empty when the request had none).
    KeyId,
    /// This occurrence (`urn:idemgate:request:<id>`; empty when unknown).
    Instance,
}

impl Field {
    const ALL: [(&'static str, Field); 7] = [
        ("status", Field::Status),
        ("code", Field::Code),
        ("type", Field::Type),
        ("title", Field::Title),
        ("detail", Field::Detail),
        ("key_id", Field::KeyId),
        ("instance", Field::Instance),
    ];

    fn named(name: &str) -> Option<Field> {
        Self::ALL.iter().find(|(n, _)| *n == name).map(|(_, f)| *f)
    }

    fn names() -> String {
        Self::ALL
            .iter()
            .map(|(n, _)| format!("{{{{{n}}}}}"))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// The values one error answer fills a template with.
#[derive(Clone, Copy, Debug)]
pub struct ErrorFields<'a> {
    pub status: u16,
    pub code: &'a str,
    pub type_uri: &'a str,
    pub title: &'a str,
    pub detail: &'a str,
    pub key_id: Option<&'a str>,
    pub instance: Option<&'a str>,
}

impl ErrorFields<'_> {
    fn text(&self, field: Field) -> &str {
        match field {
            Field::Status => "",
            Field::Code => self.code,
            Field::Type => self.type_uri,
            Field::Title => self.title,
            Field::Detail => self.detail,
            Field::KeyId => self.key_id.unwrap_or(""),
            Field::Instance => self.instance.unwrap_or(""),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Part {
    Text(String),
    Field(Field),
}

/// A parsed, checked template.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ErrorTemplate {
    parts: Vec<Part>,
    content_type: String,
    /// `application/json` or a `+json` type: values are written as JSON
    /// string contents (escaped), so a detail with a quote stays JSON.
    json: bool,
}

impl ErrorTemplate {
    /// Parses and checks `template`, to be sent as `content_type`.
    pub fn parse(template: &str, content_type: &str) -> Result<Self, String> {
        if template.len() > MAX_TEMPLATE_BYTES {
            return Err(format!(
                "errors.template is {} bytes; at most {MAX_TEMPLATE_BYTES}",
                template.len()
            ));
        }
        let content_type = content_type.trim();
        let essence = content_type
            .split(';')
            .next()
            .unwrap_or("")
            .trim()
            .to_ascii_lowercase();
        let valid_type = essence
            .split_once('/')
            .is_some_and(|(t, s)| !t.is_empty() && !s.is_empty() && !s.contains('/'))
            && content_type.len() <= 255
            && content_type.bytes().all(|b| (b' '..=b'~').contains(&b));
        if !valid_type {
            return Err(format!(
                "errors.content_type {content_type:?} is not a media type (e.g. \"application/json\")"
            ));
        }
        let json = essence == "application/json" || essence.ends_with("+json");
        let parts = parse_parts(template)?;
        let t = ErrorTemplate {
            parts,
            content_type: content_type.to_string(),
            json,
        };
        if json {
            // Values that need escaping, so a template that puts a value
            // outside quotes (or forgets them) fails here, not in a client.
            let sample = ErrorFields {
                status: 409,
                code: "in-flight",
                type_uri: "https://example/#p",
                title: "a \"quoted\" title",
                detail: "line\nbreak \\ and \"quotes\"",
                key_id: Some("k1"),
                instance: None,
            };
            if let Err(e) = canonical_json::parse(t.render(&sample).as_bytes()) {
                return Err(format!(
                    "errors.template is not JSON once filled in ({e}); a value goes inside quotes (\"{{{{detail}}}}\"), except {{{{status}}}}, a number"
                ));
            }
        }
        Ok(t)
    }

    pub fn content_type(&self) -> &str {
        &self.content_type
    }

    /// The body for one error answer.
    pub fn render(&self, fields: &ErrorFields<'_>) -> String {
        let mut out = String::new();
        for part in &self.parts {
            match part {
                Part::Text(t) => out.push_str(t),
                Part::Field(Field::Status) => out.push_str(&fields.status.to_string()),
                Part::Field(f) if self.json => json_escape_into(fields.text(*f), &mut out),
                Part::Field(f) => out.push_str(fields.text(*f)),
            }
        }
        out
    }
}

/// Text and `{{name}}` placeholders. There is no escape for a literal
/// `{{`: no error shape needs one.
fn parse_parts(template: &str) -> Result<Vec<Part>, String> {
    let mut parts = Vec::new();
    let mut rest = template;
    while let Some(open) = rest.find("{{") {
        if open > 0 {
            parts.push(Part::Text(rest[..open].to_string()));
        }
        let after = &rest[open + 2..];
        let close = after.find("}}").ok_or_else(|| {
            format!(
                "errors.template: `{{{{` at byte {} is never closed with `}}}}`",
                template.len() - rest.len() + open
            )
        })?;
        let name = after[..close].trim();
        let field = Field::named(name).ok_or_else(|| {
            format!(
                "errors.template: unknown placeholder {{{{{name}}}}}; known: {}",
                Field::names()
            )
        })?;
        parts.push(Part::Field(field));
        rest = &after[close + 2..];
    }
    if !rest.is_empty() {
        parts.push(Part::Text(rest.to_string()));
    }
    Ok(parts)
}

/// `value` as the contents of a JSON string (RFC 8259 §7).
fn json_escape_into(value: &str, out: &mut String) {
    for c in value.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields() -> ErrorFields<'static> {
        ErrorFields {
            status: 422,
            code: "key-reused",
            type_uri: "https://x/#problem-key-reused",
            title: "Idempotency-Key reused",
            detail: "said \"no\"\n",
            key_id: Some("ab12"),
            instance: None,
        }
    }

    #[test]
    fn templates_fill_in_every_field_escaped_for_json_and_raw_otherwise() {
        let cases: &[(&str, &str, &str)] = &[
            (
                r#"{"errors":[{"status":{{status}},"code":"{{code}}","detail":"{{detail}}","key":"{{ key_id }}","at":"{{instance}}"}]}"#,
                "application/json",
                r#"{"errors":[{"status":422,"code":"key-reused","detail":"said \"no\"\n","key":"ab12","at":""}]}"#,
            ),
            (
                r#"{"t":"{{type}}","m":"{{title}}"}"#,
                "application/vnd.api+json; charset=utf-8",
                r#"{"t":"https://x/#problem-key-reused","m":"Idempotency-Key reused"}"#,
            ),
            (
                "{{status}} {{code}}: {{detail}}",
                "text/plain",
                "422 key-reused: said \"no\"\n",
            ),
            ("no placeholders", "text/plain", "no placeholders"),
        ];
        for (template, content_type, want) in cases {
            let t = ErrorTemplate::parse(template, content_type).unwrap();
            assert_eq!(t.render(&fields()), *want, "{template}");
            assert_eq!(t.content_type(), content_type.trim());
        }
    }

    #[test]
    fn bad_templates_are_refused_with_the_reason() {
        let cases: &[(&str, &str, &str)] = &[
            (
                "{{nope}}",
                "text/plain",
                "unknown placeholder {{nope}}; known: {{status}}",
            ),
            ("x {{detail", "text/plain", "at byte 2 is never closed"),
            (
                r#"{"m": {{detail}}}"#,
                "application/json",
                "not JSON once filled in",
            ),
            (r#"{"m": "{{detail}}""#, "application/json", "not JSON"),
            ("{}", "json", "not a media type"),
            ("{}", "application/json/x", "not a media type"),
            ("{}", "", "not a media type"),
        ];
        for (template, content_type, needle) in cases {
            let e = ErrorTemplate::parse(template, content_type).unwrap_err();
            assert!(e.contains(needle), "{template:?} {content_type:?}: {e}");
        }
        let long = "x".repeat(MAX_TEMPLATE_BYTES + 1);
        assert!(ErrorTemplate::parse(&long, "text/plain")
            .unwrap_err()
            .contains("at most"));
    }

    #[test]
    fn control_characters_are_escaped_for_json() {
        let mut out = String::new();
        json_escape_into("a\u{1}b\tc", &mut out);
        assert_eq!(out, "a\\u0001b\\tc");
    }
}
