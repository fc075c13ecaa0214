use axum::extract::{FromRequestParts, OptionalFromRequestParts};
use axum::http::header::{ETAG, IF_MATCH};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue};
use axum::response::{IntoResponse, Response};

use super::etag::{self, etag_for_version};
use super::Problem;

/// The `If-Match` request header as the row version a write must find, as an
/// axum extractor.
///
/// Send back the [`ETag`](WithETag) of your last read (`If-Match: "v3"`); the
/// handler writes with [`IfMatch::version`] as the expected version, so a row
/// that changed in between is refused with `VersionedError::Stale`, which is
/// a 412 [`Problem`]. `If-Match: *` asks for no particular version
/// ([`IfMatch::version`] is `None`).
///
/// As an extractor it rejects, before the body is read:
///
/// * a missing header with 428 Precondition Required
///   ([`problem_type::PRECONDITION_REQUIRED`]); `Option<IfMatch>` makes it optional;
/// * a malformed header, or one naming two versions, with 400
///   ([`problem_type::IF_MATCH_INVALID`]);
/// * tags that can never match (weak, not ours) with 412
///   ([`problem_type::PRECONDITION_FAILED`]).
///
/// Several `If-Match` header lines are one comma-separated list (RFC 9110 §5.3).
///
/// [`problem_type::PRECONDITION_REQUIRED`]: super::problem_type::PRECONDITION_REQUIRED
/// [`problem_type::IF_MATCH_INVALID`]: super::problem_type::IF_MATCH_INVALID
/// [`problem_type::PRECONDITION_FAILED`]: super::problem_type::PRECONDITION_FAILED
///
/// ```
/// use axum::{routing::patch, Router};
/// use idem::http::IfMatch;
///
/// async fn rename(if_match: IfMatch) -> String {
///     match if_match.version() {
///         Some(v) => format!("write if still at version {v}"),
///         None => "write whatever the version".to_owned(),
///     }
/// }
/// let app: Router = Router::new().route("/documents/{id}", patch(rename));
/// ```
///
/// ```
/// use axum::http::{header::IF_MATCH, HeaderMap};
/// use idem::http::IfMatch;
///
/// let mut headers = HeaderMap::new();
/// headers.insert(IF_MATCH, "\"v7\"".parse().unwrap());
/// assert_eq!(IfMatch::from_headers(&headers).unwrap().unwrap().version(), Some(7));
/// headers.insert(IF_MATCH, "W/\"v7\"".parse().unwrap());
/// assert_eq!(IfMatch::from_headers(&headers).unwrap_err().status().as_u16(), 412);
/// headers.insert(IF_MATCH, "v7".parse().unwrap());
/// assert_eq!(IfMatch::from_headers(&headers).unwrap_err().status().as_u16(), 400);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IfMatch {
    precondition: etag::IfMatch,
    version: Option<i64>,
}

impl IfMatch {
    /// The version the write must find: `Some(v)` for `If-Match: "v<v>"`,
    /// `None` for `If-Match: *`.
    ///
    /// ```
    /// use axum::http::{header::IF_MATCH, HeaderMap};
    /// let mut headers = HeaderMap::new();
    /// headers.insert(IF_MATCH, "*".parse().unwrap());
    /// let if_match = idem::http::IfMatch::from_headers(&headers).unwrap().unwrap();
    /// assert_eq!(if_match.version(), None);
    /// ```
    pub fn version(&self) -> Option<i64> {
        self.version
    }

    /// The header as parsed.
    ///
    /// ```
    /// use axum::http::{header::IF_MATCH, HeaderMap};
    /// let mut headers = HeaderMap::new();
    /// headers.insert(IF_MATCH, "*".parse().unwrap());
    /// let if_match = idem::http::IfMatch::from_headers(&headers).unwrap().unwrap();
    /// assert_eq!(if_match.precondition(), &idem::http::etag::IfMatch::Any);
    /// ```
    pub fn precondition(&self) -> &etag::IfMatch {
        &self.precondition
    }

    /// The precondition in `headers`: `Ok(None)` when there is no `If-Match`.
    ///
    /// # Errors
    ///
    /// A 400 [`Problem`] for a malformed or ambiguous header, 412 for tags that
    /// can never match.
    ///
    /// ```
    /// use axum::http::HeaderMap;
    /// assert_eq!(idem::http::IfMatch::from_headers(&HeaderMap::new()).unwrap(), None);
    /// ```
    pub fn from_headers(headers: &HeaderMap) -> Result<Option<IfMatch>, Problem> {
        let mut combined = String::new();
        for value in headers.get_all(IF_MATCH) {
            let value = value.to_str().map_err(|_| {
                Problem::from(etag::EtagError::Malformed {
                    offset: 0,
                    detail: "the header holds bytes outside visible ASCII",
                })
            })?;
            if !combined.is_empty() {
                combined.push_str(", ");
            }
            combined.push_str(value);
        }
        if headers.get(IF_MATCH).is_none() {
            return Ok(None);
        }
        let precondition = etag::IfMatch::parse(&combined).map_err(Problem::from)?;
        let version = precondition.expected_version().map_err(Problem::from)?;
        Ok(Some(IfMatch {
            precondition,
            version,
        }))
    }
}

impl<S: Send + Sync> FromRequestParts<S> for IfMatch {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        IfMatch::from_headers(&parts.headers)?.ok_or_else(Problem::precondition_required)
    }
}

impl<S: Send + Sync> OptionalFromRequestParts<S> for IfMatch {
    type Rejection = Problem;

    async fn from_request_parts(
        parts: &mut Parts,
        _state: &S,
    ) -> Result<Option<Self>, Self::Rejection> {
        IfMatch::from_headers(&parts.headers)
    }
}

/// A response with the strong `ETag` of a row version (`"v<version>"`, see
/// [`super::etag`]), for the client to send back in `If-Match`.
///
/// ```
/// use axum::{response::IntoResponse, Json};
/// use idem::http::WithETag;
///
/// let response = WithETag(7, Json(serde_json::json!({ "id": 1 }))).into_response();
/// assert_eq!(response.headers()["etag"], "\"v7\"");
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WithETag<R>(pub i64, pub R);

impl<R: IntoResponse> IntoResponse for WithETag<R> {
    fn into_response(self) -> Response {
        let mut response = self.1.into_response();
        if let Ok(tag) = HeaderValue::from_str(&etag_for_version(self.0)) {
            response.headers_mut().insert(ETAG, tag);
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_across_header_lines() {
        let mut headers = HeaderMap::new();
        headers.append(IF_MATCH, "\"other\"".parse().unwrap());
        headers.append(IF_MATCH, "\"v2\"".parse().unwrap());
        assert_eq!(
            IfMatch::from_headers(&headers).unwrap().unwrap().version(),
            Some(2)
        );
        headers.append(IF_MATCH, "\"v3\"".parse().unwrap());
        assert_eq!(
            IfMatch::from_headers(&headers)
                .unwrap_err()
                .status()
                .as_u16(),
            400
        );
    }

    #[test]
    fn empty_header_is_invalid() {
        let mut headers = HeaderMap::new();
        headers.insert(IF_MATCH, "".parse().unwrap());
        assert_eq!(
            IfMatch::from_headers(&headers)
                .unwrap_err()
                .status()
                .as_u16(),
            400
        );
    }
}
