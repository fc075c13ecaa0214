//! The HTTP API.
//!
//! | method and path | headers | answers |
//! |---|---|---|
//! | `POST /accounts` `{"currency","metadata"?}` | `Idempotency-Key` optional | 201 account, `ETag` |
//! | `GET /accounts/{id}` | | 200 account, `ETag` |
//! | `PATCH /accounts/{id}` `{"metadata"}` | `If-Match` required | 200 account, `ETag`; 412 stale; 428 missing |
//! | `POST /accounts/{id}/top-ups` `{"amount","currency"}` | `Idempotency-Key` required | 201 movement |
//! | `POST /transfers` `{"from_account","to_account","amount","currency"}` | `Idempotency-Key` required | 201 movement |
//!
//! `/admin` is idem's admin page (`idem::admin`, see [`router_with_admin`]):
//! HTML, loopback peers only, read-only unless the server was started with
//! `--admin-actions`.
//!
//! Every request acts in the tenant of its `X-Tenant-Id` header (default 1).
//! Errors are `application/problem+json`, unknown paths and wrong methods
//! included (see `guard`); a replay answers the first status and body with
//! `Idempotent-Replayed: true`. Input limits: `limits`.

use axum::extract::rejection::JsonRejection;
use axum::extract::{FromRequest, FromRequestParts, Path, Request, State};
use axum::http::request::Parts;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use idem::admin::{self, AdminConfig};
use idem::http::{problem_type, IdempotencyKey, IdempotentResponse, IfMatch, Problem, WithETag};
use idem::Pool;
use serde::de::DeserializeOwned;
use serde::Deserialize;

use super::guard::harden;
use super::limits::{echo, elide};
use super::ops::{self, LedgerError, Movement, NewAccountRequest, TopUpRequest, TransferRequest};
use super::schema::Account;

/// What every handler shares.
#[derive(Clone)]
pub struct AppState {
    pub pool: Pool,
}

/// The ledger's routes over `pool`, behind `guard`.
pub fn router(pool: Pool) -> Router {
    harden(
        Router::new()
            .route("/accounts", post(open_account))
            .route("/accounts/{id}", get(get_account).patch(patch_account))
            .route("/accounts/{id}/top-ups", post(top_up))
            .route("/transfers", post(transfer))
            .with_state(AppState { pool }),
    )
}

/// [`router`] with idem's admin page nested at `/admin`, read-only unless
/// `admin_actions` (requeue and discard of dead jobs and events, behind a
/// CSRF token). It is nested after `guard`, so its pages and refusals stay
/// its own HTML rather than problems; it answers loopback peers only, and
/// only when served with `into_make_service_with_connect_info::<SocketAddr>()`.
pub fn router_with_admin(pool: Pool, admin_actions: bool) -> Router {
    router(pool.clone()).nest(
        "/admin",
        admin::router(pool, AdminConfig::new().actions(admin_actions)),
    )
}

async fn open_account(
    State(app): State<AppState>,
    Tenant(tenant): Tenant,
    key: Option<IdempotencyKey>,
    Body(req): Body<NewAccountRequest>,
) -> Result<Response, LedgerError> {
    let created = match key {
        Some(key) => ops::open_account_once(&app.pool, tenant, &key, &req).await?,
        None => idem::Idempotent {
            value: ops::open_account(&app.pool, tenant, &req).await?,
            replayed: false,
        },
    };
    let version = created.value.body.version;
    Ok(WithETag(version, IdempotentResponse::from(created)).into_response())
}

async fn get_account(
    State(app): State<AppState>,
    Tenant(tenant): Tenant,
    AccountId(id): AccountId,
) -> Result<WithETag<Json<Account>>, LedgerError> {
    let mut conn = app.pool.get().await.map_err(idem::Error::from)?;
    let account = ops::account(&mut conn, tenant, id).await?;
    Ok(WithETag(account.version, Json(account)))
}

#[derive(Deserialize)]
struct PatchAccount {
    metadata: serde_json::Map<String, serde_json::Value>,
}

async fn patch_account(
    State(app): State<AppState>,
    Tenant(tenant): Tenant,
    AccountId(id): AccountId,
    if_match: IfMatch,
    Body(patch): Body<PatchAccount>,
) -> Result<WithETag<Json<Account>>, LedgerError> {
    let metadata = serde_json::Value::Object(patch.metadata);
    let account = ops::set_metadata(&app.pool, tenant, id, if_match.version(), &metadata).await?;
    Ok(WithETag(account.version, Json(account)))
}

async fn top_up(
    State(app): State<AppState>,
    Tenant(tenant): Tenant,
    AccountId(id): AccountId,
    key: IdempotencyKey,
    Body(req): Body<TopUpRequest>,
) -> Result<IdempotentResponse<idem::http::StoredResponse<Movement>>, LedgerError> {
    Ok(ops::top_up(&app.pool, tenant, &key, id, &req).await?.into())
}

async fn transfer(
    State(app): State<AppState>,
    Tenant(tenant): Tenant,
    key: IdempotencyKey,
    Body(req): Body<TransferRequest>,
) -> Result<IdempotentResponse<idem::http::StoredResponse<Movement>>, LedgerError> {
    Ok(ops::transfer(&app.pool, tenant, &key, &req).await?.into())
}

impl IntoResponse for LedgerError {
    fn into_response(self) -> Response {
        match self {
            LedgerError::Declined { reason, replayed } => IdempotentResponse {
                response: reason.problem(),
                replayed,
            }
            .into_response(),
            LedgerError::Precondition(e) | LedgerError::Versioned(e) => {
                Problem::from(e).into_response()
            }
            LedgerError::Idem(e) => {
                let problem = Problem::from(&e);
                if problem.status().is_server_error() {
                    tracing::error!(
                        error = %causes(&e),
                        debug = ?e,
                        "an idem error answered with {}",
                        problem.status()
                    );
                }
                problem.into_response()
            }
            LedgerError::Db(e) => {
                // PostgreSQL's own fields say which row and rule: the cause.
                let info = match &e {
                    diesel::result::Error::DatabaseError(_, info) => Some(info),
                    _ => None,
                };
                tracing::error!(
                    error = %causes(&e),
                    debug = ?e,
                    table = info.and_then(|i| i.table_name()),
                    constraint = info.and_then(|i| i.constraint_name()),
                    details = info.and_then(|i| i.details()),
                    hint = info.and_then(|i| i.hint()),
                    "a database error answered with 500"
                );
                Problem::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    problem_type::INTERNAL,
                    "Internal error",
                    "the server failed to handle the request; the details are in its log",
                )
                .into_response()
            }
        }
    }
}

/// `e` and its sources, outermost first: what the log says of a 500.
fn causes(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// An account id from the path. One that is not an integer (or not one
/// that fits i64) names no account: 404, like an id that does not exist.
pub struct AccountId(pub i64);

impl<S: Send + Sync> FromRequestParts<S> for AccountId {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Problem> {
        match Path::<i64>::from_request_parts(parts, state).await {
            Ok(Path(id)) => Ok(AccountId(id)),
            Err(_) => Err(Problem::new(
                StatusCode::NOT_FOUND,
                problem_type::NOT_FOUND,
                "Not found",
                format!(
                    "there is nothing at \"{}\": account ids are integers",
                    echo(parts.uri.path())
                ),
            )),
        }
    }
}

/// The tenant a request acts in: the `X-Tenant-Id` header, 1 when absent.
/// (A real service takes it from the authenticated caller.)
pub struct Tenant(pub i64);

impl<S: Send + Sync> FromRequestParts<S> for Tenant {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Problem> {
        let Some(value) = parts.headers.get("x-tenant-id") else {
            return Ok(Tenant(1));
        };
        value
            .to_str()
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .map(Tenant)
            .ok_or_else(|| {
                Problem::new(
                    StatusCode::BAD_REQUEST,
                    "urn:ledger:problem:invalid-tenant",
                    "Invalid tenant",
                    "X-Tenant-Id must be an integer",
                )
            })
    }
}

/// A JSON body whose rejections are problems too.
pub struct Body<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for Body<T> {
    type Rejection = Problem;

    async fn from_request(req: Request, state: &S) -> Result<Self, Problem> {
        match Json::<T>::from_request(req, state).await {
            Ok(Json(value)) => Ok(Body(value)),
            Err(rejection) => Err(invalid_body(&rejection)),
        }
    }
}

/// 415 for a body that is not declared JSON, 400 for one that does not
/// parse, 422 for JSON of the wrong shape; serde's message is kept, but
/// shortened: it quotes the input.
fn invalid_body(rejection: &JsonRejection) -> Problem {
    if let JsonRejection::MissingJsonContentType(_) = rejection {
        return Problem::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "urn:ledger:problem:unsupported-media-type",
            "Unsupported media type",
            "send the body as JSON, with Content-Type: application/json",
        );
    }
    let text = rejection.body_text();
    // axum's prefixes say what the status already says.
    let message = [
        "Failed to parse the request body as JSON: ",
        "Failed to deserialize the JSON body into the target type: ",
    ]
    .iter()
    .find_map(|prefix| text.strip_prefix(prefix))
    .unwrap_or(&text);
    let what = match rejection.status() {
        StatusCode::BAD_REQUEST => "the body is not valid JSON",
        StatusCode::UNPROCESSABLE_ENTITY => "the body is not what this endpoint takes",
        _ => "the body could not be read",
    };
    Problem::new(
        rejection.status(),
        "urn:ledger:problem:invalid-body",
        "Invalid request body",
        format!("{what}: {}", elide(message, 64, 48)),
    )
}
