//! What an event is, and the rules its key and subject must follow.

use std::fmt;

use serde::Serialize;
use uuid::Uuid;

use crate::attempt::CallId;

/// A typed event that [`emit`](super::emit()) can write to the outbox.
///
/// ```
/// use idem_runtime::outbox::Event;
///
/// #[derive(serde::Serialize)]
/// struct OrderPlaced { order: i64, amount: i64 }
///
/// impl Event for OrderPlaced {
///     const KIND: &'static str = "order.placed";
///     const VERSION: u32 = 1;
///     fn key(&self) -> String { format!("order-{}", self.order) }
/// }
/// assert_eq!(OrderPlaced { order: 7, amount: 3 }.subject(), "order.placed");
/// ```
pub trait Event: Serialize {
    /// The event type, stored and sent as a header (`Idem-Event-Kind`).
    const KIND: &'static str;
    /// The schema version of the payload (`Idem-Event-Version`).
    const VERSION: u32;
    /// The ordering key: the aggregate the event is about. Events of one
    /// key are published in commit order; 1 to 255 bytes, no control
    /// characters, no white space at either end (it travels in the
    /// `Idem-Event-Key` header, whose value a NATS client trims: `"k "`
    /// would reach a consumer as `"k"`, another key's).
    fn key(&self) -> String;
    /// The subject to publish on, before the publisher's prefix. Default:
    /// [`KIND`](Self::KIND). Dot-separated tokens of visible ASCII, no
    /// wildcards (`*`, `>`), and not the server's own: none whose first
    /// token begins with `$` (`$JS.API..` would be a JetStream request, a
    /// purge or a delete of a stream) or is `_INBOX` (replies).
    fn subject(&self) -> String {
        Self::KIND.to_owned()
    }
}

/// The id of an emitted event; the broker deduplicates on it
/// (`Nats-Msg-Id`).
///
/// Inside an idempotent call it is a UUIDv5 of the call's scope, key, random
/// token and the event's ordinal in the attempt: every attempt of one
/// request emits the same ids, and a request that reuses a key after its
/// record expired emits new ones. Elsewhere a UUIDv7, ordered by time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct EventId(pub(crate) Uuid);

impl EventId {
    /// The id as a UUID.
    pub fn as_uuid(&self) -> Uuid {
        self.0
    }
}

impl From<Uuid> for EventId {
    fn from(id: Uuid) -> Self {
        EventId(id)
    }
}

impl fmt::Display for EventId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0.hyphenated(), f)
    }
}

/// The namespace of deterministic event ids (a UUIDv4 made once for idem).
const NAMESPACE: Uuid = Uuid::from_u128(0x6a0f_4e2c_93b1_4d7e_8c5a_2f1e_7b9d_3c40);

/// The id of the `ordinal`-th event (0 first) emitted by an attempt of the
/// idempotent call `call`. The scope hash and the key are joined with NUL,
/// which neither contains, and the token has a fixed length, so no two calls
/// share ids. The token is there because (scope, key) names a request only
/// while its record lives: a key reused after expiry is a new request, and
/// its events must not be taken for the first one's copies, neither by the
/// outbox's primary key nor by a consumer's inbox.
pub(crate) fn deterministic_id(call: &CallId, ordinal: u32) -> EventId {
    let mut name = format!("idem-outbox-v2\0{}\0{}\0", call.scope, call.key).into_bytes();
    name.extend_from_slice(&call.token);
    name.extend_from_slice(&ordinal.to_be_bytes());
    EventId(Uuid::new_v5(&NAMESPACE, &name))
}

/// A fresh time-ordered id, for events emitted outside an idempotent call.
pub(crate) fn time_ordered_id() -> EventId {
    EventId(Uuid::now_v7())
}

/// Why an event's key or subject was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum InvalidEvent {
    /// The ordering key is empty, longer than 255 bytes, has control
    /// characters, or white space at either end.
    #[error("invalid event key {key:?}: {reason}")]
    Key {
        /// The key as given.
        key: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The subject is not a plain NATS subject.
    #[error("invalid event subject {subject:?}: {reason}")]
    Subject {
        /// The subject as given.
        subject: String,
        /// What is wrong with it.
        reason: &'static str,
    },
}

/// Check an ordering key.
pub(crate) fn validate_key(key: &str) -> Result<(), InvalidEvent> {
    let trimmed = |key: &str| (key.trim() != key).then_some("white space at either end");
    match key_problem(key).or_else(|| trimmed(key)) {
        None => Ok(()),
        Some(reason) => Err(InvalidEvent::Key {
            key: key.to_owned(),
            reason,
        }),
    }
}

/// What is wrong with a key (an event's, or a job's kind or key), if
/// anything: 1 to 255 bytes, no control characters.
pub(crate) fn key_problem(key: &str) -> Option<&'static str> {
    if key.is_empty() {
        Some("empty")
    } else if key.len() > 255 {
        Some("longer than 255 bytes")
    } else if key.chars().any(char::is_control) {
        Some("has control characters")
    } else {
        None
    }
}

/// Check a subject: tokens of visible ASCII separated by single dots.
pub(crate) fn validate_subject(subject: &str) -> Result<(), InvalidEvent> {
    let reason = if subject.is_empty() {
        "empty"
    } else if subject.len() > 255 {
        "longer than 255 bytes"
    } else if !subject.bytes().all(|b| b.is_ascii_graphic()) {
        "only visible ASCII, no spaces"
    } else if subject.split('.').any(str::is_empty) {
        "empty token"
    } else if subject.split('.').any(|t| t == "*" || t == ">") {
        "wildcards are for subscribers"
    } else if subject.starts_with('$') {
        "`$` subjects are the server's and JetStream's API"
    } else if subject.split('.').next() == Some("_INBOX") {
        "`_INBOX` subjects are for replies"
    } else {
        return Ok(());
    };
    Err(InvalidEvent::Subject {
        subject: subject.to_owned(),
        reason,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deterministic_ids_depend_on_every_part() {
        let call = |scope: &str, key: &str, token: u8| CallId {
            scope: scope.to_owned(),
            key: key.to_owned(),
            token: [token; 16],
        };
        let id = deterministic_id(&call("s", "k", 1), 0);
        assert_eq!(id, deterministic_id(&call("s", "k", 1), 0));
        assert_eq!(id.as_uuid().get_version_num(), 5);
        assert_ne!(id, deterministic_id(&call("s", "k", 1), 1));
        assert_ne!(id, deterministic_id(&call("t", "k", 1), 0));
        assert_ne!(id, deterministic_id(&call("s", "j", 1), 0));
        assert_ne!(id, deterministic_id(&call("s", "k", 2), 0));
    }

    #[test]
    fn time_ordered_ids_are_v7() {
        assert_eq!(time_ordered_id().as_uuid().get_version_num(), 7);
    }

    #[test]
    fn keys_and_subjects_are_checked() {
        assert!(validate_key("order-1").is_ok());
        assert!(validate_key("").is_err());
        assert!(validate_key(&"k".repeat(256)).is_err());
        assert!(validate_key("a\nb").is_err());
        assert!(validate_subject("orders.placed").is_ok());
        for bad in ["", "a..b", ".a", "a.", "a b", "a.*", "a.>", "é"] {
            assert!(validate_subject(bad).is_err(), "{bad:?}");
        }
    }
}
