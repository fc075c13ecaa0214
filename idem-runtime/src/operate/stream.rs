//! The NATS check of `idem doctor` (feature `nats`): the JetStream stream's
//! `duplicate_window` against the relay's republish horizon, as the NATS
//! publisher checks it when a relay starts.

use std::time::Duration;

use async_nats::jetstream::context::{GetStreamByNameErrorKind, GetStreamErrorKind};
use async_nats::jetstream::ErrorCode;

use super::doctor::{Check, CheckState};
use crate::outbox::{duplicate_window, Horizon, PrepareError, RelayTiming};

/// The check's name in [`Check::name`].
const NAME: &str = "nats stream";

/// How long the whole check may take: connecting, finding the stream and
/// reading its info.
const BOUND: Duration = Duration::from_secs(15);

/// Which JetStream stream [`check_stream`] reads.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum StreamChoice {
    /// The stream of this name: the one given to
    /// [`NatsPublisher::new`](crate::outbox::NatsPublisher::new).
    Named(String),
    /// The stream that captures this subject (as the relay publishes it,
    /// the publisher's prefix included): the one JetStream stores the
    /// relay's messages in.
    Capturing(String),
}

/// What [`check_stream`] needs: where NATS is, which stream, and the
/// relay's [`Horizon`].
///
/// ```
/// use std::time::Duration;
/// use idem_runtime::operate::{StreamCheck, StreamChoice};
/// use idem_runtime::outbox::RelayTiming;
///
/// // A relay built with `.lease(Duration::from_secs(30))`, the rest default.
/// let mut timing = RelayTiming::default();
/// timing.lease = Duration::from_secs(30);
/// let check = StreamCheck::new("nats://127.0.0.1:4222")
///     .stream(StreamChoice::Named("ORDERS".into()))
///     .horizon(timing.horizon());
/// assert_eq!(check.horizon.total(), Duration::from_millis(52_600));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct StreamCheck {
    /// The NATS server's URL (`nats://host:4222`, credentials included if
    /// it needs them); the check's output does not show it.
    pub nats_url: String,
    /// The stream; `None` makes the check a warning that names the option.
    pub stream: Option<StreamChoice>,
    /// The relay's horizon: that of [`RelayTiming::default`] (a relay with
    /// [`Relay::new`](crate::outbox::Relay::new)'s settings) unless set.
    pub horizon: Horizon,
}

impl StreamCheck {
    /// A check of the server at `nats_url`, no stream chosen yet, against
    /// the default relay's horizon.
    pub fn new(nats_url: impl Into<String>) -> Self {
        StreamCheck {
            nats_url: nats_url.into(),
            stream: None,
            horizon: RelayTiming::default().horizon(),
        }
    }

    /// Check this stream.
    pub fn stream(mut self, choice: StreamChoice) -> Self {
        self.stream = Some(choice);
        self
    }

    /// Against this horizon (a relay whose lease, attempts or backoff
    /// differ from the defaults: [`RelayTiming::horizon`]).
    pub fn horizon(mut self, horizon: Horizon) -> Self {
        self.horizon = horizon;
        self
    }
}

/// Check that the stream remembers message ids at least as long as the
/// relay may publish an event again ([`Horizon::check_window`], the
/// comparison the NATS publisher makes when a relay starts): ok when its
/// `duplicate_window` covers the horizon; fail when it is shorter (a
/// republished event would be stored twice), with the window to set.
///
/// A server that cannot be reached, a stream that is not there, or
/// JetStream that does not answer fail too: a relay started now would
/// refuse to start for the same reason. No stream chosen is a warning. The
/// check takes at most 15 s.
///
/// ```no_run
/// # async fn f() {
/// use idem_runtime::operate::{check_stream, CheckState, StreamCheck, StreamChoice};
///
/// let check = check_stream(
///     &StreamCheck::new("nats://127.0.0.1:4222").stream(StreamChoice::Named("ORDERS".into())),
/// )
/// .await;
/// if check.state == CheckState::Fail {
///     eprintln!("{}: {}", check.detail, check.fix.unwrap_or_default());
/// }
/// # }
/// ```
pub async fn check_stream(options: &StreamCheck) -> Check {
    let Some(choice) = &options.stream else {
        return Check::new(
            NAME,
            CheckState::Warn,
            "NATS given, but no stream: the duplicate window was not checked".into(),
            Some("name the relay's stream with --stream (as given to NatsPublisher::new) or its subject with --subject"),
        );
    };
    match tokio::time::timeout(BOUND, check(options, choice)).await {
        Ok(check) => check,
        Err(_) => fail(
            format!("NATS did not answer within {BOUND:?}"),
            "check that the server is up and JetStream enabled: a relay started now would not start",
        ),
    }
}

fn fail(detail: String, fix: &str) -> Check {
    Check::new(NAME, CheckState::Fail, detail, Some(fix))
}

async fn check(options: &StreamCheck, choice: &StreamChoice) -> Check {
    let client = match async_nats::ConnectOptions::new()
        .connection_timeout(Duration::from_secs(5))
        .connect(options.nats_url.as_str())
        .await
    {
        Ok(client) => client,
        Err(e) => {
            return fail(
                format!("could not reach NATS: {e}"),
                "start the NATS server or correct NATS_URL (--nats-url): the relay's start-up check fails the same way",
            )
        }
    };
    let context = async_nats::jetstream::new(client);
    let (name, captures) = match choice {
        StreamChoice::Named(name) => (name.clone(), None),
        StreamChoice::Capturing(subject) => {
            match context.stream_by_subject(subject.as_str()).await {
                Ok(name) => (name, Some(subject)),
                Err(e) if matches!(e.kind(), GetStreamByNameErrorKind::NotFound) => return fail(
                    format!("no stream captures the subject {subject}"),
                    "create the relay's stream for it (`nats stream add`), or correct --subject",
                ),
                Err(e) => {
                    return fail(
                        format!("could not find the stream of {subject}: {e}"),
                        "check that JetStream is enabled and this account may list streams",
                    )
                }
            }
        }
    };
    let window = match duplicate_window(&context, &name).await {
        Ok(window) => window,
        Err(e) => {
            return match e.kind() {
                GetStreamErrorKind::JetStream(js)
                    if js.error_code() == ErrorCode::STREAM_NOT_FOUND =>
                {
                    fail(
                        format!("no stream named {name}"),
                        "create it (`nats stream add`), or correct --stream",
                    )
                }
                _ => fail(
                    format!("could not read stream {name}: {e}"),
                    "check that JetStream is enabled and this account may read the stream",
                ),
            }
        }
    };
    let of = captures.map_or_else(String::new, |s| format!(" (captures {s})"));
    let h = options.horizon;
    let span = format!(
        "the relay's republish horizon of {:?} (lease {:?} + backoff {:?})",
        h.total(),
        h.lease,
        h.retry
    );
    match h.check_window(&name, window) {
        Ok(()) => Check::new(
            NAME,
            CheckState::Ok,
            format!(
                "{name}{of} keeps message ids for {window:?} (duplicate_window), at least {span}"
            ),
            None,
        ),
        Err(PrepareError::DedupWindowTooShort { horizon, .. }) => {
            let secs = horizon.as_secs() + u64::from(horizon.subsec_nanos() > 0);
            Check::new(
                NAME,
                CheckState::Fail,
                format!(
                    "{name}{of} keeps message ids for {window:?} (duplicate_window), shorter than {span}: an event published again would be stored twice"
                ),
                Some(&format!(
                    "raise its duplicate_window to at least {secs}s (`nats stream edit {name} --dupe-window {secs}s`), or shorten the relay's lease and backoff"
                )),
            )
        }
        Err(e) => fail(e.to_string(), "see the relay's start-up check"),
    }
}
