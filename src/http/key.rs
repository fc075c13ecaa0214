use std::fmt;

use axum::extract::{FromRequestParts, OptionalFromRequestParts};
use axum::http::request::Parts;
use axum::http::HeaderMap;

use super::{Problem, IDEMPOTENCY_KEY};
use idem_runtime::idempotency::{validate_key, KeyInput};

/// The `Idempotency-Key` request header, as an axum extractor.
///
/// The header follows the IETF httpapi draft: an RFC 8941 sf-string,
/// `Idempotency-Key: "8e03978e-40d5-43e8-bc93-6894a57f9324"` (`\"` and `\\`
/// escapes allowed). A bare value without quotes is accepted too
/// (`Idempotency-Key: 8e03978e-...`), as many clients send it: visible ASCII
/// without spaces, quotes, backslashes, commas or semicolons. The key is then
/// checked like every idem key: 1 to 255 bytes; and a quoted key of spaces
/// only (`"  "`), which no client means to send (an empty value padded), is
/// refused as blank.
///
/// As an extractor, `IdempotencyKey` rejects with a 400 [`Problem`] when the
/// header is missing ([`problem_type::IDEMPOTENCY_KEY_MISSING`]), malformed,
/// invalid or sent more than once ([`problem_type::IDEMPOTENCY_KEY_INVALID`]);
/// `Option<IdempotencyKey>` is `None` when it is missing and still rejects a
/// malformed one. Either runs before the body is read, so a refused request
/// writes nothing.
///
/// It implements idem's key input, so it can be handed to
/// `#[idempotent(key = ..)]` as it is.
///
/// [`problem_type::IDEMPOTENCY_KEY_MISSING`]: super::problem_type::IDEMPOTENCY_KEY_MISSING
/// [`problem_type::IDEMPOTENCY_KEY_INVALID`]: super::problem_type::IDEMPOTENCY_KEY_INVALID
///
/// ```
/// use axum::{routing::post, Router};
/// use idem::http::IdempotencyKey;
///
/// async fn required(key: IdempotencyKey) -> String {
///     format!("key {key}")
/// }
/// async fn optional(key: Option<IdempotencyKey>) -> String {
///     format!("key {:?}", key.as_deref())
/// }
/// let app: Router = Router::new()
///     .route("/transfers", post(required))
///     .route("/accounts", post(optional));
/// ```
///
/// ```
/// use idem::http::IdempotencyKey;
///
/// assert_eq!(IdempotencyKey::parse(r#""abc-1""#).unwrap().as_str(), "abc-1");
/// assert_eq!(IdempotencyKey::parse(r#""say \"hi\"""#).unwrap().as_str(), r#"say "hi""#);
/// assert_eq!(IdempotencyKey::parse("8e03978e-40d5").unwrap().as_str(), "8e03978e-40d5");
/// assert_eq!(IdempotencyKey::parse(r#""""#).unwrap_err().status().as_u16(), 400);
/// assert!(IdempotencyKey::parse(r#""abc"; x=1"#).is_err());
/// assert!(IdempotencyKey::parse(r#""   ""#).unwrap_err().detail().contains("blank"));
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKey(String);

impl IdempotencyKey {
    /// Parse one header value (sf-string or bare token) and validate the key.
    ///
    /// # Errors
    ///
    /// A 400 [`Problem`] saying what is wrong and what to send instead.
    ///
    /// ```
    /// let err = idem::http::IdempotencyKey::parse("\"unterminated").unwrap_err();
    /// assert!(err.detail().contains("closing quote"));
    /// ```
    pub fn parse(value: &str) -> Result<IdempotencyKey, Problem> {
        let value = value.trim_matches([' ', '\t']);
        let key = if let Some(rest) = value.strip_prefix('"') {
            parse_sf_string(rest)?
        } else {
            parse_bare(value)?
        };
        // A bare value is trimmed above, so only a quoted one gets here.
        if !key.is_empty() && key.bytes().all(|b| b == b' ') {
            return Err(Problem::key_invalid(
                "the Idempotency-Key is blank (spaces only); send a value unique to the request, such as a UUID",
            ));
        }
        validate_key(&key).map_err(Problem::from)?;
        Ok(IdempotencyKey(key))
    }

    /// The key from the `Idempotency-Key` header of `headers`: `Ok(None)` when
    /// there is none.
    ///
    /// # Errors
    ///
    /// A 400 [`Problem`] when the header is sent more than once, is not text,
    /// or does not [parse](IdempotencyKey::parse).
    ///
    /// ```
    /// use axum::http::HeaderMap;
    /// use idem::http::{IdempotencyKey, IDEMPOTENCY_KEY};
    ///
    /// let mut headers = HeaderMap::new();
    /// assert_eq!(IdempotencyKey::from_headers(&headers).unwrap(), None);
    /// headers.insert(IDEMPOTENCY_KEY, "\"k1\"".parse().unwrap());
    /// assert_eq!(IdempotencyKey::from_headers(&headers).unwrap().unwrap().as_str(), "k1");
    /// ```
    pub fn from_headers(headers: &HeaderMap) -> Result<Option<IdempotencyKey>, Problem> {
        let mut values = headers.get_all(IDEMPOTENCY_KEY).iter();
        let Some(value) = values.next() else {
            return Ok(None);
        };
        if values.next().is_some() {
            return Err(Problem::key_invalid(
                "the Idempotency-Key header was sent more than once",
            ));
        }
        let value = value.to_str().map_err(|_| {
            Problem::key_invalid("the Idempotency-Key header holds bytes outside visible ASCII")
        })?;
        IdempotencyKey::parse(value).map(Some)
    }

    /// The key.
    ///
    /// ```
    /// let key = idem::http::IdempotencyKey::parse("\"k\"").unwrap();
    /// assert_eq!(key.as_str(), "k");
    /// ```
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The key, owned.
    ///
    /// ```
    /// let key = idem::http::IdempotencyKey::parse("\"k\"").unwrap();
    /// assert_eq!(key.into_string(), "k");
    /// ```
    pub fn into_string(self) -> String {
        self.0
    }
}

/// The characters of an sf-string after its opening quote (RFC 8941 §4.2.5).
fn parse_sf_string(rest: &str) -> Result<String, Problem> {
    let mut key = String::with_capacity(rest.len());
    let mut chars = rest.chars();
    loop {
        match chars.next() {
            None => {
                return Err(Problem::key_invalid(
                    "the Idempotency-Key string has no closing quote",
                ))
            }
            Some('"') => break,
            Some('\\') => match chars.next() {
                Some(c @ ('"' | '\\')) => key.push(c),
                _ => {
                    return Err(Problem::key_invalid(
                        "in an Idempotency-Key string, a backslash may only escape \" or \\",
                    ))
                }
            },
            Some(c @ ' '..='~') => key.push(c),
            Some(_) => {
                return Err(Problem::key_invalid(
                    "an Idempotency-Key string holds printable ASCII characters only",
                ))
            }
        }
    }
    if !chars.as_str().is_empty() {
        return Err(Problem::key_invalid(
            "unexpected characters after the closing quote of the Idempotency-Key (parameters are not supported)",
        ));
    }
    Ok(key)
}

/// A bare value: what clients that do not quote send (a UUID, a token).
fn parse_bare(value: &str) -> Result<String, Problem> {
    let bad = |c: char| !c.is_ascii_graphic() || matches!(c, '"' | '\\' | ',' | ';');
    if value.chars().any(bad) {
        return Err(Problem::key_invalid(
            "the Idempotency-Key is neither a quoted string nor a bare token (visible ASCII without spaces, quotes, backslashes, commas or semicolons)",
        ));
    }
    Ok(value.to_owned())
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::ops::Deref for IdempotencyKey {
    type Target = str;
    fn deref(&self) -> &str {
        &self.0
    }
}

impl AsRef<str> for IdempotencyKey {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl KeyInput for IdempotencyKey {
    fn key(&self) -> Option<&str> {
        Some(&self.0)
    }
}

impl<S: Send + Sync> FromRequestParts<S> for IdempotencyKey {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        IdempotencyKey::from_headers(&parts.headers)?.ok_or_else(Problem::key_missing)
    }
}

impl<S: Send + Sync> OptionalFromRequestParts<S> for IdempotencyKey {
    type Rejection = Problem;

    async fn from_request_parts(
        parts: &mut Parts,
        _state: &S,
    ) -> Result<Option<Self>, Self::Rejection> {
        IdempotencyKey::from_headers(&parts.headers)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sf_strings_and_tokens() {
        let ok = |s: &str| IdempotencyKey::parse(s).map(IdempotencyKey::into_string);
        assert_eq!(ok(" \"a b\" ").unwrap(), "a b");
        assert_eq!(ok(r#""a\\b""#).unwrap(), r"a\b");
        assert_eq!(ok("tok:en/1+2=").unwrap(), "tok:en/1+2=");
        for bad in [
            "", "\"\"", "\"a", r#""a\n""#, "\"a\"x", "a b", "a,b", "a;b", "\"é\"", "é",
        ] {
            let err = IdempotencyKey::parse(bad).unwrap_err();
            assert_eq!(err.status().as_u16(), 400, "{bad:?}: {err}");
        }
        assert!(IdempotencyKey::parse(&format!("\"{}\"", "k".repeat(255))).is_ok());
        assert!(IdempotencyKey::parse(&format!("\"{}\"", "k".repeat(256))).is_err());
    }

    #[test]
    fn one_header_only() {
        let mut headers = HeaderMap::new();
        headers.append(IDEMPOTENCY_KEY, "\"a\"".parse().unwrap());
        headers.append(IDEMPOTENCY_KEY, "\"b\"".parse().unwrap());
        assert!(IdempotencyKey::from_headers(&headers).is_err());
    }
}
