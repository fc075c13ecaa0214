//! The two dead lists, jobs and events: what sets one apart from the other
//! (its names, its rows' HTML, its operator call). One list page
//! ([`handlers::dead_list`](super::handlers::dead_list)) serves both
//! through [`DeadList`].

use std::future::Future;

use idem_runtime::operate::{self, DeadEvent, DeadJobRow, OperateError, Page};

use super::pages;
use crate::Pool;

/// One dead list: what it is called, how its rows are shown, and where
/// they come from.
pub(super) trait DeadList {
    /// Its title, path and filter.
    const NAMES: Names;
    /// A row of the list.
    type Row;

    /// The list as HTML: the page's body above its pager.
    fn render(list: &Listing<'_>, rows: &[Self::Row]) -> String;

    /// One page of the list, of `filter` when given.
    fn rows(
        pool: &Pool,
        filter: Option<&str>,
        page: Page,
    ) -> impl Future<Output = Rows<Self::Row>> + Send;
}

/// What an operator call that lists returns.
pub(super) type Rows<R> = Result<Vec<R>, OperateError>;

/// What a dead list is called, and where.
pub(super) struct Names {
    /// The title of its page.
    pub(super) title: &'static str,
    /// Its path under the router.
    pub(super) path: &'static str,
    /// The query field that filters it.
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
}

impl DeadList for Events {
    const NAMES: Names = Names::new("Dead events", "/events", "key");
    type Row = DeadEvent;

    fn render(list: &Listing<'_>, rows: &[DeadEvent]) -> String {
        pages::dead_events(list.base, list.filter, rows, list.csrf, list.limit)
    }

    async fn rows(pool: &Pool, key: Option<&str>, page: Page) -> Rows<DeadEvent> {
        operate::dead_events(pool, key, page).await
    }
}
