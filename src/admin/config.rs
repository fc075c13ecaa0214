//! What an admin router may do and to whom it answers.

use std::fmt;
use std::sync::Arc;

use axum::http::request::Parts;

/// The application's check of a request: `true` lets it through, `false`
/// answers 403. Called for every request, pages and actions alike, after
/// the loopback check.
pub type Authorize = Arc<dyn Fn(&Parts) -> bool + Send + Sync>;

/// The largest page an admin router lists, whatever the config says.
pub const MAX_PAGE_SIZE: i64 = 500;

/// How an admin router ([`router`](super::router)) behaves. The default is
/// the safe one: read-only, payloads and stored responses hidden, loopback
/// peers only, no `authorize` hook, 50 rows a page.
///
/// ```
/// use std::sync::Arc;
/// use idem::admin::AdminConfig;
///
/// let config = AdminConfig::new()
///     .actions(true)
///     .authorize(Arc::new(|parts: &axum::http::request::Parts| {
///         parts.headers.get("x-operator").is_some()
///     }))
///     .page_size(100);
/// assert!(config.allows_actions());
/// ```
#[derive(Clone)]
pub struct AdminConfig {
    pub(crate) actions: bool,
    pub(crate) show_payloads: bool,
    pub(crate) allow_remote: bool,
    pub(crate) authorize: Option<Authorize>,
    pub(crate) page_size: i64,
}

impl Default for AdminConfig {
    fn default() -> Self {
        AdminConfig {
            actions: false,
            show_payloads: false,
            allow_remote: false,
            authorize: None,
            page_size: 50,
        }
    }
}

impl fmt::Debug for AdminConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AdminConfig")
            .field("actions", &self.actions)
            .field("show_payloads", &self.show_payloads)
            .field("allow_remote", &self.allow_remote)
            .field("authorize", &self.authorize.as_ref().map(|_| ".."))
            .field("page_size", &self.page_size)
            .finish()
    }
}

impl AdminConfig {
    /// The defaults: see [`AdminConfig`].
    pub fn new() -> Self {
        AdminConfig::default()
    }

    /// Whether the pages offer requeue and discard (POST, with a CSRF
    /// token). Default `false`: every POST is refused with 403.
    pub fn actions(mut self, allowed: bool) -> Self {
        self.actions = allowed;
        self
    }

    /// Whether dead jobs' payloads and stored responses are shown. They may
    /// hold personal data. Default `false`: only their size is.
    pub fn show_payloads(mut self, shown: bool) -> Self {
        self.show_payloads = shown;
        self
    }

    /// Whether peers other than loopback addresses are answered. Default
    /// `false`: any other peer, and any request without a peer address
    /// (the server not started with
    /// `into_make_service_with_connect_info::<SocketAddr>()`), gets 403.
    pub fn allow_remote(mut self, allowed: bool) -> Self {
        self.allow_remote = allowed;
        self
    }

    /// The application's check of every request (its session, a header
    /// its proxy sets, ...): `false` answers 403. Default: none.
    pub fn authorize(mut self, check: Authorize) -> Self {
        self.authorize = Some(check);
        self
    }

    /// Rows per page of the lists, and the most one action touches.
    /// Clamped to 1..=[`MAX_PAGE_SIZE`]. Default 50.
    pub fn page_size(mut self, rows: i64) -> Self {
        self.page_size = rows.clamp(1, MAX_PAGE_SIZE);
        self
    }

    /// Whether actions are enabled.
    pub fn allows_actions(&self) -> bool {
        self.actions
    }
}
