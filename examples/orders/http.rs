//! The service over HTTP (axum).
//!
//! | method and path | headers | answers |
//! |---|---|---|
//! | `POST /orders` `{"request_id","id","amount"}` | | 201 order, `ETag`; 200 when the request id already made it (the order as it is now); 422 when it made another (other id or amount) |
//! | `GET /orders/{id}` | | 200 order, `ETag` |
//! | `PATCH /orders/{id}` `{"note","on_conflict":"compensate"\|"fail"}` | `If-Match` required | 200 `{"edit":"applied"\|"compensating"\|"lost"}` |
//! | `POST /callbacks/payment` `{"order","amount"}` | `Idempotency-Key` = the provider's transaction id | 200 `{"order","outcome":"paid"\|"already_paid"}` |
//!
//! Errors are problem+json; a callback's replay carries
//! `Idempotent-Replayed: true`. A repeated create is not a replay (the order
//! may have changed since): it answers 200 instead of 201, with the order now.

use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use idem::http::{problem_type, IdempotencyKey, IfMatch, Problem, WithETag};
use idem::idempotency::ReplayCache;
use idem::{Creation, Pool};
use serde::Deserialize;
use serde_json::json;

use idem::Versioned as _;

use crate::service::{self, Callback, NewOrder, Order, OrderError, TENANT};

#[derive(Clone)]
pub struct AppState {
    pub pool: Pool,
    pub cache: Option<ReplayCache>,
    /// The compensation ladder's first step: how long a queued edit waits.
    pub first_step: Duration,
}

pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/orders", post(create_order))
        .route("/orders/{id}", get(get_order).patch(edit_order))
        .route("/callbacks/payment", post(payment_callback))
        .with_state(state)
}

async fn create_order(
    State(app): State<AppState>,
    Json(req): Json<NewOrder>,
) -> Result<Response, OrderError> {
    let (status, order) = match service::create_order(&app.pool, &req).await? {
        Creation::Created(order) => (StatusCode::CREATED, order),
        Creation::Existing(order) => (StatusCode::OK, order),
    };
    Ok(WithETag(order.version, (status, Json(order))).into_response())
}

async fn get_order(
    State(app): State<AppState>,
    Path(id): Path<i64>,
) -> Result<WithETag<Json<Order>>, OrderError> {
    let mut conn = app.pool.get().await.map_err(idem::Error::from)?;
    let order = Order::find(id).tenant(TENANT).load(&mut conn).await?;
    Ok(WithETag(order.version, Json(order)))
}

#[derive(Deserialize)]
#[serde(rename_all = "snake_case")]
enum OnConflict {
    Compensate,
    Fail,
}

#[derive(Deserialize)]
struct Edit {
    note: String,
    on_conflict: OnConflict,
}

async fn edit_order(
    State(app): State<AppState>,
    Path(id): Path<i64>,
    if_match: IfMatch,
    Json(edit): Json<Edit>,
) -> Result<Response, OrderError> {
    let Some(seen) = if_match.version() else {
        return Ok(Problem::new(
            StatusCode::PRECONDITION_REQUIRED,
            problem_type::PRECONDITION_REQUIRED,
            "If-Match required",
            "an edit names the version it was computed from",
        )
        .into_response());
    };
    let compensate = match edit.on_conflict {
        OnConflict::Compensate => Some(app.first_step),
        OnConflict::Fail => None,
    };
    let edited = service::operator_edit(&app.pool, id, seen, &edit.note, compensate).await?;
    Ok(Json(json!({ "edit": edited })).into_response())
}

#[derive(Deserialize)]
struct PaymentBody {
    order: i64,
    amount: i64,
}

async fn payment_callback(
    State(app): State<AppState>,
    key: IdempotencyKey,
    Json(body): Json<PaymentBody>,
) -> Result<Response, OrderError> {
    let cb = Callback {
        txn: key.into_string(),
        order: body.order,
        amount: body.amount,
    };
    {
        let mut conn = app.pool.get().await.map_err(idem::Error::from)?;
        service::log_arrival(&mut conn, &cb.txn, "http").await?;
    }
    let paid = service::payment_callback(&app.pool, app.cache.as_ref(), &cb).await?;
    Ok(replayed(
        paid.replayed,
        Json(json!({ "order": cb.order, "outcome": paid.value })),
    ))
}

/// `response` with `Idempotent-Replayed: true` when it is a replay.
fn replayed(replayed: bool, response: impl IntoResponse) -> Response {
    let mut response = response.into_response();
    if replayed {
        response.headers_mut().insert(
            "idempotent-replayed",
            axum::http::HeaderValue::from_static("true"),
        );
    }
    response
}

impl IntoResponse for OrderError {
    fn into_response(self) -> Response {
        match self {
            OrderError::Declined(reason) => Problem::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "https://example.com/problems/payment-declined",
                "Payment declined",
                format!("{reason:?}"),
            )
            .into_response(),
            OrderError::Idem(e) => Problem::from(&e).into_response(),
            OrderError::Versioned(e) => Problem::from(&e).into_response(),
            OrderError::Once(e) => Problem::from(&e).into_response(),
            OrderError::Enqueue(e) => internal(&e),
            OrderError::Db(e) => internal(&e),
        }
    }
}

fn internal(e: &dyn std::error::Error) -> Response {
    tracing::error!(error = %e, "answered with 500");
    Problem::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        problem_type::INTERNAL,
        "Internal error",
        "the server failed to handle the request; the details are in its log",
    )
    .into_response()
}
