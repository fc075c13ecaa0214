//! Row versions as HTTP entity-tags, and `If-Match` parsing
//! ([RFC 9110 §8.8.3](https://www.rfc-editor.org/rfc/rfc9110#section-8.8.3) and
//! [§13.1.1](https://www.rfc-editor.org/rfc/rfc9110#section-13.1.1)).
//!
//! # Tag format
//!
//! A row at version `n` (an `i64`, starting at 0, bumped on every update) has the
//! strong entity-tag `"v<n>"`: the letter `v` followed by `n` in canonical
//! decimal — no sign, no leading zeros. `"v0"`, `"v7"` and `"v9223372036854775807"`
//! are ours; `"v07"`, `"v+7"` and `"v-1"` are not, because strong comparison is
//! byte-for-byte and we never issue them, so they can never match.
//!
//! ```
//! use idem::http::etag::{etag_for_version, IfMatch};
//!
//! let tag = etag_for_version(7);            // sent in the `ETag` response header
//! assert_eq!(tag, "\"v7\"");
//! let precondition = IfMatch::parse(&tag).unwrap(); // echoed back in `If-Match`
//! assert_eq!(precondition.expected_version(), Ok(Some(7)));
//! ```

use std::fmt;

/// Renders the strong entity-tag for a row `version`, quotes included, ready
/// for an `ETag` header. The format is `"v<version>"` (see the module docs).
///
/// Versions are never negative; a negative input still yields a tag, but one
/// that [`version_from_etag`] and [`IfMatch::expected_version`] reject, so a
/// corrupted version fails closed instead of satisfying a precondition.
///
/// ```
/// use idem::http::etag::etag_for_version;
/// assert_eq!(etag_for_version(0), "\"v0\"");
/// ```
///
/// ```
/// use idem::http::etag::{etag_for_version, version_from_etag};
/// let tag = etag_for_version(i64::MAX);
/// assert_eq!(version_from_etag(&tag), Ok(i64::MAX));
/// ```
#[must_use]
pub fn etag_for_version(version: i64) -> String {
    format!("\"v{version}\"")
}

/// Parses one entity-tag in header form (quotes included, surrounding spaces or
/// tabs allowed) and returns the row version it names.
///
/// # Errors
///
/// [`EtagError::Weak`] for `W/"..."`, [`EtagError::Foreign`] for a
/// well-formed tag we did not issue, [`EtagError::VersionOutOfRange`] for a
/// negative or overflowing version, and [`EtagError::Malformed`] for bad syntax.
///
/// ```
/// use idem::http::etag::version_from_etag;
/// assert_eq!(version_from_etag("\"v42\""), Ok(42));
/// ```
///
/// ```
/// use idem::http::etag::{version_from_etag, EtagError};
/// assert!(matches!(version_from_etag("W/\"v42\""), Err(EtagError::Weak { .. })));
/// assert!(matches!(version_from_etag("v42"), Err(EtagError::Malformed { offset: 0, .. })));
/// ```
pub fn version_from_etag(tag: &str) -> Result<i64, EtagError> {
    let b = tag.as_bytes();
    let start = skip_ows(b, 0);
    if start == b.len() {
        return Err(EtagError::Empty);
    }
    let (etag, end) = parse_tag(tag, start)?;
    let end = skip_ows(b, end);
    if end != b.len() {
        return Err(malformed(end, "unexpected characters after the entity-tag"));
    }
    own_version(&etag)
}

/// One entity-tag: `"opaque"` (strong) or `W/"opaque"` (weak).
///
/// `Display` renders the header form.
///
/// ```
/// use idem::http::etag::EntityTag;
/// let tag = EntityTag { weak: false, opaque: "v3".into() };
/// assert_eq!(tag.to_string(), "\"v3\"");
/// ```
///
/// ```
/// use idem::http::etag::EntityTag;
/// let tag = EntityTag { weak: true, opaque: "abc".into() };
/// assert_eq!(tag.to_string(), "W/\"abc\"");
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct EntityTag {
    /// `true` for a weak tag (`W/` prefix).
    pub weak: bool,
    /// The characters between the quotes, without the quotes.
    pub opaque: String,
}

impl fmt::Display for EntityTag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let prefix = if self.weak { "W/" } else { "" };
        write!(f, "{prefix}\"{}\"", self.opaque)
    }
}

/// A parsed `If-Match` header: `*` or a list of entity-tags.
///
/// ```
/// use idem::http::etag::IfMatch;
/// assert_eq!(IfMatch::parse("*"), Ok(IfMatch::Any));
/// ```
///
/// ```
/// use idem::http::etag::{EntityTag, IfMatch};
/// let parsed = IfMatch::parse(r#""v1", W/"v1""#).unwrap();
/// assert_eq!(parsed, IfMatch::Tags(vec![
///     EntityTag { weak: false, opaque: "v1".into() },
///     EntityTag { weak: true, opaque: "v1".into() },
/// ]));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IfMatch {
    /// `*`: the request applies to any current representation.
    Any,
    /// One or more entity-tags, in header order (never empty when from [`IfMatch::parse`]).
    Tags(Vec<EntityTag>),
}

impl IfMatch {
    /// Parses an `If-Match` header value: `*`, or a comma-separated list of
    /// entity-tags with optional spaces/tabs around the commas. Empty list
    /// elements (`"a", , "b"`) are ignored, as RFC 9110 §5.6.1 requires; a value
    /// with no tag at all is [`EtagError::Empty`]. Weak tags are kept, marked weak.
    ///
    /// # Errors
    ///
    /// [`EtagError::Empty`], or [`EtagError::Malformed`] with the byte offset into `header_value`.
    ///
    /// ```
    /// use idem::http::etag::IfMatch;
    /// let parsed = IfMatch::parse(" \"v2\" ,\"v2\" ").unwrap();
    /// assert!(matches!(parsed, IfMatch::Tags(ref t) if t.len() == 2));
    /// ```
    ///
    /// ```
    /// use idem::http::etag::{EtagError, IfMatch};
    /// // Unterminated quote: the offset points at the opening quote.
    /// assert!(matches!(IfMatch::parse("\"v1\", \"v2"), Err(EtagError::Malformed { offset: 6, .. })));
    /// assert_eq!(IfMatch::parse("  "), Err(EtagError::Empty));
    /// ```
    pub fn parse(header_value: &str) -> Result<IfMatch, EtagError> {
        let b = header_value.as_bytes();
        let start = skip_ows(b, 0);
        if start == b.len() {
            return Err(EtagError::Empty);
        }
        if b[start] == b'*' && skip_ows(b, start + 1) == b.len() {
            return Ok(IfMatch::Any);
        }
        let mut tags = Vec::new();
        let mut i = start;
        loop {
            i = skip_ows(b, i);
            match b.get(i) {
                None => break,
                Some(b',') => i += 1, // separator, or an empty element
                Some(b'*') => return Err(malformed(i, "`*` must be the entire If-Match value")),
                Some(_) => {
                    let (tag, end) = parse_tag(header_value, i)?;
                    tags.push(tag);
                    i = skip_ows(b, end);
                    if i < b.len() && b[i] != b',' {
                        return Err(malformed(i, "expected `,` between entity-tags"));
                    }
                }
            }
        }
        if tags.is_empty() {
            return Err(EtagError::Empty);
        }
        Ok(IfMatch::Tags(tags))
    }

    /// The row version this precondition requires: `Ok(None)` for `*` (any
    /// current version), `Ok(Some(v))` when the list names version `v`.
    ///
    /// `If-Match` uses strong comparison and succeeds if *any* listed tag
    /// matches, so tags that can never match (weak, foreign, out of range) are
    /// skipped when the list also names one of our versions; repeating that
    /// version is fine.
    ///
    /// # Errors
    ///
    /// If no tag can match, the error for the first one (412). Two different
    /// versions are [`EtagError::Ambiguous`] (400).
    ///
    /// ```
    /// use idem::http::etag::IfMatch;
    /// assert_eq!(IfMatch::Any.expected_version(), Ok(None));
    /// let list = IfMatch::parse(r#"W/"v5", "v5", "other""#).unwrap();
    /// assert_eq!(list.expected_version(), Ok(Some(5)));
    /// ```
    ///
    /// ```
    /// use idem::http::etag::{EtagError, IfMatch};
    /// let weak = IfMatch::parse(r#"W/"v5""#).unwrap();
    /// assert!(matches!(weak.expected_version(), Err(EtagError::Weak { .. })));
    /// let two = IfMatch::parse(r#""v5", "v6""#).unwrap();
    /// assert_eq!(two.expected_version(), Err(EtagError::Ambiguous { first: 5, second: 6 }));
    /// ```
    pub fn expected_version(&self) -> Result<Option<i64>, EtagError> {
        let IfMatch::Tags(tags) = self else {
            return Ok(None);
        };
        let mut found = None;
        let mut first_err = None;
        for tag in tags {
            match own_version(tag) {
                Ok(v) => match found {
                    Some(first) if first != v => {
                        return Err(EtagError::Ambiguous { first, second: v })
                    }
                    _ => found = Some(v),
                },
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        match found {
            Some(v) => Ok(Some(v)),
            None => Err(first_err.unwrap_or(EtagError::Empty)),
        }
    }
}

/// Why an `ETag`/`If-Match` value was rejected. Messages are written for the API client.
///
/// ```
/// use idem::http::{etag::{version_from_etag, EtagError}, HttpStatus};
/// let err = version_from_etag("\"abc\"").unwrap_err();
/// assert_eq!(err, EtagError::Foreign { tag: "\"abc\"".into() });
/// assert_eq!(err.http_status(), 412);
/// ```
///
/// ```
/// use idem::http::etag::{IfMatch, EtagError};
/// let err = IfMatch::parse("\"v1\" junk").unwrap_err();
/// assert!(err.to_string().contains("byte 5"));
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EtagError {
    /// The header value contains no entity-tag.
    #[error("the If-Match header is empty: send `*` or the ETag from your last read, e.g. \"v3\"")]
    Empty,
    /// Not valid entity-tag / list syntax; `offset` is a byte index into the header value.
    #[error("malformed entity-tag at byte {offset}: {detail}; an entity-tag looks like \"v3\" (double quotes included)")]
    Malformed {
        /// Byte offset of the problem in the header value.
        offset: usize,
        /// What was wrong there.
        detail: &'static str,
    },
    /// A weak tag (`W/"..."`): If-Match uses strong comparison, so it never matches.
    #[error("weak entity-tag {tag} can never satisfy If-Match, which uses strong comparison; send the ETag from your last read without the W/ prefix")]
    Weak {
        /// The tag in header form.
        tag: String,
    },
    /// A well-formed tag this server never issues, so it never matches.
    #[error("entity-tag {tag} was not issued by this server and can never match; read the resource again to get its current ETag")]
    Foreign {
        /// The tag in header form.
        tag: String,
    },
    /// A tag of our format whose version is negative or does not fit in an `i64`.
    #[error("entity-tag {tag} names a version that cannot exist (negative or too large) and can never match; read the resource again to get its current ETag")]
    VersionOutOfRange {
        /// The tag in header form.
        tag: String,
    },
    /// The list names two different versions; only one expected version is supported.
    #[error("If-Match names both version {first} and version {second}; send only the ETag of the version you last read")]
    Ambiguous {
        /// The first version named.
        first: i64,
        /// A different version named later in the list.
        second: i64,
    },
}

impl EtagError {
    /// 400 for unusable requests (empty, malformed, ambiguous), 412
    /// Precondition Failed for well-formed tags that can never match; read
    /// through [`HttpStatus`](super::HttpStatus), the one status table.
    #[must_use]
    pub(crate) fn status(&self) -> u16 {
        match self {
            EtagError::Empty | EtagError::Malformed { .. } | EtagError::Ambiguous { .. } => 400,
            EtagError::Weak { .. }
            | EtagError::Foreign { .. }
            | EtagError::VersionOutOfRange { .. } => 412,
        }
    }
}

fn malformed(offset: usize, detail: &'static str) -> EtagError {
    EtagError::Malformed { offset, detail }
}

/// Skips optional whitespace (SP / HTAB) from `i`.
fn skip_ows(b: &[u8], mut i: usize) -> usize {
    while matches!(b.get(i), Some(b' ' | b'\t')) {
        i += 1;
    }
    i
}

/// Parses `[ W/ ] DQUOTE *etagc DQUOTE` at byte `i`; returns the tag and the index after it.
fn parse_tag(s: &str, i: usize) -> Result<(EntityTag, usize), EtagError> {
    let b = s.as_bytes();
    let weak = b[i..].starts_with(b"W/");
    let open = if weak { i + 2 } else { i };
    if b.get(open) != Some(&b'"') {
        return Err(malformed(open, "expected `\"` to open an entity-tag"));
    }
    let mut j = open + 1;
    loop {
        match b.get(j) {
            None => return Err(malformed(open, "entity-tag opened here is never closed")),
            Some(b'"') => break,
            // etagc = %x21 / %x23-7E / obs-text
            Some(&c) if c == 0x21 || (0x23..=0x7E).contains(&c) || c >= 0x80 => j += 1,
            Some(_) => {
                return Err(malformed(
                    j,
                    "spaces and control characters are not allowed inside an entity-tag",
                ))
            }
        }
    }
    // `open` and `j` index ASCII quotes, so both are char boundaries.
    let opaque = s[open + 1..j].to_owned();
    Ok((EntityTag { weak, opaque }, j + 1))
}

/// The version named by one of our strong tags, or why `tag` can never match.
fn own_version(tag: &EntityTag) -> Result<i64, EtagError> {
    if tag.weak {
        return Err(EtagError::Weak {
            tag: tag.to_string(),
        });
    }
    let foreign = || EtagError::Foreign {
        tag: tag.to_string(),
    };
    let rest = tag.opaque.strip_prefix('v').ok_or_else(foreign)?;
    let (negative, digits) = match rest.strip_prefix('-') {
        Some(d) => (true, d),
        None => (false, rest),
    };
    let canonical = !digits.is_empty()
        && digits.bytes().all(|c| c.is_ascii_digit())
        && (digits == "0" || !digits.starts_with('0'));
    if !canonical {
        return Err(foreign());
    }
    let out_of_range = || EtagError::VersionOutOfRange {
        tag: tag.to_string(),
    };
    if negative {
        return Err(out_of_range());
    }
    digits.parse().map_err(|_| out_of_range())
}

#[cfg(test)]
mod tests;
