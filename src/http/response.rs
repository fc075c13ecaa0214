use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::{Deserialize, Serialize};

use super::IDEMPOTENT_REPLAYED;
use crate::Idempotent;

/// The status and body of a response, as an `#[idempotent]` function returns
/// it: both are stored under the key, so a replay answers with the first
/// status as well as the first body.
///
/// Stored as `{ "status": 201, "body": <T as JSON> }`; answered as the status
/// with `T` as a JSON body.
///
/// ```
/// use axum::response::IntoResponse;
/// use idem::http::StoredResponse;
///
/// let stored = StoredResponse::created(serde_json::json!({ "id": 7 }));
/// assert_eq!(
///     serde_json::to_value(&stored).unwrap(),
///     serde_json::json!({ "status": 201, "body": { "id": 7 } })
/// );
/// assert_eq!(stored.into_response().status().as_u16(), 201);
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredResponse<T> {
    /// The HTTP status.
    pub status: u16,
    /// The JSON body.
    pub body: T,
}

impl<T> StoredResponse<T> {
    /// A response with this status.
    ///
    /// ```
    /// use axum::http::StatusCode;
    /// let r = idem::http::StoredResponse::new(StatusCode::ACCEPTED, "queued");
    /// assert_eq!(r.status_code(), StatusCode::ACCEPTED);
    /// ```
    pub fn new(status: StatusCode, body: T) -> StoredResponse<T> {
        StoredResponse {
            status: status.as_u16(),
            body,
        }
    }

    /// 200 OK.
    ///
    /// ```
    /// assert_eq!(idem::http::StoredResponse::ok(()).status, 200);
    /// ```
    pub fn ok(body: T) -> StoredResponse<T> {
        StoredResponse::new(StatusCode::OK, body)
    }

    /// 201 Created.
    ///
    /// ```
    /// assert_eq!(idem::http::StoredResponse::created(()).status, 201);
    /// ```
    pub fn created(body: T) -> StoredResponse<T> {
        StoredResponse::new(StatusCode::CREATED, body)
    }

    /// The status (500 if the stored number is not a valid status).
    ///
    /// ```
    /// let r = idem::http::StoredResponse { status: 1000, body: () };
    /// assert_eq!(r.status_code().as_u16(), 500);
    /// ```
    pub fn status_code(&self) -> StatusCode {
        StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
    }
}

impl<T: Serialize> IntoResponse for StoredResponse<T> {
    fn into_response(self) -> Response {
        (self.status_code(), Json(self.body)).into_response()
    }
}

/// A response that says whether it is a replay: `Idempotent-Replayed: true`
/// when it is the stored response of an earlier request with the same key.
///
/// Made from what an `#[idempotent]` function returns (`From<Idempotent<R>>`),
/// or by hand for a replayed final error.
///
/// ```
/// use axum::response::IntoResponse;
/// use idem::http::{IdempotentResponse, StoredResponse};
/// use idem::Idempotent;
///
/// let first: IdempotentResponse<_> =
///     Idempotent { value: StoredResponse::created("t-1"), replayed: false }.into();
/// let again: IdempotentResponse<_> =
///     Idempotent { value: StoredResponse::created("t-1"), replayed: true }.into();
/// let (first, again) = (first.into_response(), again.into_response());
/// assert_eq!((first.status().as_u16(), again.status().as_u16()), (201, 201));
/// assert!(first.headers().get("idempotent-replayed").is_none());
/// assert_eq!(again.headers()["idempotent-replayed"], "true");
/// ```
///
/// A final error is stored in its typed form and replayed through
/// [`IdempotentError::from_final`](crate::IdempotentError::from_final), which
/// idem calls for replays only; remember it there, and answer with the same
/// [`Problem`](super::Problem), marked:
///
/// ```
/// use axum::{http::StatusCode, response::{IntoResponse, Response}};
/// use idem::http::{IdempotentResponse, Problem};
/// use idem::{Error, IdempotentError};
///
/// #[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
/// enum Declined { InsufficientFunds { balance: i64 } }
///
/// enum AppError { Idem(Error), Declined { reason: Declined, replayed: bool } }
/// impl From<Error> for AppError {
///     fn from(e: Error) -> Self { AppError::Idem(e) }
/// }
/// impl IdempotentError for AppError {
///     type Final = Declined;
///     fn to_final(&self) -> Option<Declined> {
///         match self { AppError::Declined { reason, .. } => Some(reason.clone()), _ => None }
///     }
///     fn from_final(reason: Declined) -> Self { AppError::Declined { reason, replayed: true } }
/// }
/// impl IntoResponse for AppError {
///     fn into_response(self) -> Response {
///         match self {
///             AppError::Idem(e) => Problem::from(e).into_response(),
///             AppError::Declined { reason: Declined::InsufficientFunds { balance }, replayed } => {
///                 let problem = Problem::new(
///                     StatusCode::UNPROCESSABLE_ENTITY,
///                     "urn:example:insufficient-funds",
///                     "Insufficient funds",
///                     format!("the balance is {balance}"),
///                 );
///                 IdempotentResponse { response: problem, replayed }.into_response()
///             }
///         }
///     }
/// }
/// let replay = AppError::from_final(Declined::InsufficientFunds { balance: 5 }).into_response();
/// assert_eq!(replay.status().as_u16(), 422);
/// assert_eq!(replay.headers()["idempotent-replayed"], "true");
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdempotentResponse<R> {
    /// The response.
    pub response: R,
    /// True when it is the stored response of an earlier request.
    pub replayed: bool,
}

impl<R> From<Idempotent<R>> for IdempotentResponse<R> {
    fn from(outcome: Idempotent<R>) -> IdempotentResponse<R> {
        IdempotentResponse {
            response: outcome.value,
            replayed: outcome.replayed,
        }
    }
}

impl<R: IntoResponse> IntoResponse for IdempotentResponse<R> {
    fn into_response(self) -> Response {
        let mut response = self.response.into_response();
        if self.replayed {
            response
                .headers_mut()
                .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
        }
        response
    }
}
