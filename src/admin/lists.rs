//! The two dead lists, jobs and events: what sets one apart from the other
//! (its names, its rows' HTML, its operator calls). One list page
//! ([`handlers::dead_list`](super::handlers::dead_list)) and one action
//! ([`actions::dead_action`](super::actions::dead_action)) serve both
//! through [`DeadList`].

use std::future::Future;
use std::str::FromStr;

use idem_runtime::operate::{self, DeadEvent, DeadJobRow, OperateError, Page};

use super::pages;
use crate::Pool;

/// One dead list: what it is called, how its rows are shown, where they
/// come from, and what an action does to one of them.
pub(super) trait DeadList {
    /// Its title, path and filter.
    const NAMES: Names;
    /// A row of the list.
    type Row;
    /// A row's id, as the requeue and discard calls take it and a form
    /// spells it (a form's id that does not parse names nothing).
    type Id: FromStr;

    /// The list as HTML: the page's body above its pager.
    fn render(list: &Listing<'_>, rows: &[Self::Row]) -> String;

    /// One page of the list, of `filter` when given.
    fn rows(
        pool: &Pool,
        filter: Option<&str>,
        page: Page,
    ) -> impl Future<Output = Rows<Self::Row>> + Send;

    /// A row's id.
    fn id(row: Self::Row) -> Self::Id;

    /// Requeue or discard (`verb`) one row: the result page's line for it,
    /// or the error the whole action fails with.
    fn act(
        pool: &Pool,
        verb: &'static str,
        id: Self::Id,
    ) -> impl Future<Output = Result<String, OperateError>> + Send;
}

/// What an operator call that lists returns.
pub(super) type Rows<R> = Result<Vec<R>, OperateError>;

/// What a dead list is called, and where.
pub(super) struct Names {
    /// The title of its page and of its actions' result page.
    pub(super) title: &'static str,
    /// Its path under the router; its actions are at `{path}/action`.
    pub(super) path: &'static str,
    /// The query and form field that filters it.
    pub(super) filter: &'static str,
}

impl Names {
    /// The names: see the fields.
    const fn new(title: &'static str, path: &'static str, filter: &'static str) -> Names {
        Names {
            title,
            path,
            filter,
        }
    }
}

/// What a list's page shows besides its rows.
pub(super) struct Listing<'a> {
    /// Where the router is mounted.
    pub(super) base: &'a str,
    /// The filter as the query gave it (trimmed; empty for none).
    pub(super) filter: &'a str,
    /// The token of the action forms; none when read-only.
    pub(super) csrf: Option<&'a str>,
    /// Whether payloads are shown.
    pub(super) show_payloads: bool,
    /// Rows a page, the most a bulk action touches.
    pub(super) limit: i64,
}

/// A filter as the operator calls take it: an empty one filters nothing.
pub(super) fn given(filter: &str) -> Option<&str> {
    Some(filter).filter(|f| !f.is_empty())
}

/// The dead jobs, by kind.
pub(super) struct Jobs;

/// The dead outbox events, by key.
pub(super) struct Events;

impl DeadList for Jobs {
    const NAMES: Names = Names::new("Dead jobs", "/jobs", "kind");
    type Row = DeadJobRow;
    type Id = i64;

    fn render(list: &Listing<'_>, rows: &[DeadJobRow]) -> String {
        pages::dead_jobs(
            list.base,
            list.filter,
            rows,
            list.csrf,
            list.show_payloads,
            list.limit,
        )
    }

    async fn rows(pool: &Pool, kind: Option<&str>, page: Page) -> Rows<DeadJobRow> {
        operate::dead_jobs(pool, kind, page).await
    }

    fn id(row: DeadJobRow) -> i64 {
        row.id
    }

    async fn act(pool: &Pool, verb: &'static str, id: i64) -> Result<String, OperateError> {
        Ok(if verb == "requeue" {
            let requeued = operate::requeue_job(pool, id).await?;
            format!(
                "job {id}: {}",
                serde_json::to_value(requeued)
                    .map(|v| v.as_str().unwrap_or("").to_owned())
                    .unwrap_or_default()
            )
        } else if operate::discard_job(pool, id).await? {
            format!("job {id}: discarded")
        } else {
            format!("job {id}: not dead, left as it is")
        })
    }
}

impl DeadList for Events {
    const NAMES: Names = Names::new("Dead events", "/events", "key");
    type Row = DeadEvent;
    // Any text: the operator calls judge it (a UUID), so that a bad id is
    // said on its own line of the result.
    type Id = String;

    fn render(list: &Listing<'_>, rows: &[DeadEvent]) -> String {
        pages::dead_events(list.base, list.filter, rows, list.csrf, list.limit)
    }

    async fn rows(pool: &Pool, key: Option<&str>, page: Page) -> Rows<DeadEvent> {
        operate::dead_events(pool, key, page).await
    }

    fn id(row: DeadEvent) -> String {
        row.id
    }

    async fn act(pool: &Pool, verb: &'static str, id: String) -> Result<String, OperateError> {
        let done = if verb == "requeue" {
            operate::requeue_event(pool, &id).await
        } else {
            operate::discard_event(pool, &id).await
        };
        match done {
            Ok(true) => Ok(format!(
                "event {id}: {}",
                if verb == "requeue" {
                    "requeued"
                } else {
                    "discarded"
                }
            )),
            Ok(false) => Ok(format!("event {id}: not dead, left as it is")),
            // An id that is no UUID spoils only its own line, not the action.
            Err(OperateError::Invalid(why)) => Ok(why),
            Err(e) => Err(e),
        }
    }
}
