//! What the server reports of a session unasked: the key it gave the
//! connection at start-up (`BackendKeyData`), and the parameters it reports
//! whenever their value changes (`ParameterStatus`).
//!
//! Both tell idem whether a pooled connection is still the session it set
//! up. The key names the server session a connection talks to: a body may
//! swap the `AsyncPgConnection` it was lent for one of its own, and idem's
//! `COMMIT` must not go to that one (see [`crate::tx`]). The parameters show
//! session state a body committed that would make every later call on the
//! connection fail: a read-only default, another session user. PostgreSQL
//! reports a transaction-local change too, and its undoing when the
//! transaction ends, so what was last reported on an idle connection is its
//! session's value.

/// Parameters whose session value, changed by a body, would refuse idem's
/// statements on every later call (`25006`, or permission denied on
/// `idem_requests`): a connection on which one differs from its value at
/// start-up is not handed out again. (`SET ROLE` is not reported; a role
/// without superuser rights changes `is_superuser` when the session's user
/// had them.)
const WATCHED: [&str; 3] = [
    "default_transaction_read_only",
    "session_authorization",
    "is_superuser",
];

#[derive(Debug, Default)]
pub(super) struct Reported {
    /// The backend's process id and secret, as the server sent them.
    key: Option<[u8; 8]>,
    /// Each watched parameter reported so far: its first value (at
    /// start-up) and its latest.
    watched: Vec<(&'static str, Vec<u8>, Vec<u8>)>,
    /// The session's `client_encoding`, when the server said it is not
    /// UTF8 (tokio-postgres sets UTF8; a body's `SET` can change it).
    foreign_encoding: Option<String>,
}

impl Reported {
    /// A `BackendKeyData` body: the process id and the secret, 4 bytes each.
    pub(super) fn on_key(&mut self, body: &[u8]) {
        if let Ok(key) = <[u8; 8]>::try_from(body) {
            self.key = Some(key);
        }
    }

    /// A `ParameterStatus` body: a name and a value, each NUL-terminated.
    pub(super) fn on_parameter(&mut self, body: &[u8]) {
        let mut parts = body.split(|&b| b == 0);
        let (name, value) = (
            parts.next().unwrap_or_default(),
            parts.next().unwrap_or_default(),
        );
        if name == b"client_encoding" {
            self.foreign_encoding = (!value.eq_ignore_ascii_case(b"UTF8"))
                .then(|| String::from_utf8_lossy(value).into_owned());
        } else if let Some(&watched) = WATCHED.iter().find(|w| w.as_bytes() == name) {
            match self.watched.iter_mut().find(|(n, ..)| *n == watched) {
                Some((_, _, now)) => value.clone_into(now),
                None => self.watched.push((watched, value.to_vec(), value.to_vec())),
            }
        }
    }

    pub(super) fn key(&self) -> Option<[u8; 8]> {
        self.key
    }

    pub(super) fn foreign_encoding(&self) -> Option<String> {
        self.foreign_encoding.clone()
    }

    /// A watched parameter whose value is not what it was at start-up, said
    /// for a log line.
    pub(super) fn drift(&self) -> Option<String> {
        self.watched
            .iter()
            .find(|(_, first, now)| first != now)
            .map(|(name, first, now)| {
                format!(
                    "{name} is {} (it was {} when the connection was made)",
                    String::from_utf8_lossy(now),
                    String::from_utf8_lossy(first)
                )
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parameter(name: &str, value: &str) -> Vec<u8> {
        format!("{name}\0{value}\0").into_bytes()
    }

    #[test]
    fn a_watched_parameter_drifts_from_its_start_up_value_only() {
        let mut r = Reported::default();
        r.on_key(&[0, 0, 0, 7, 1, 2, 3, 4]);
        r.on_key(&[1, 2, 3]);
        assert_eq!(
            r.key(),
            Some([0, 0, 0, 7, 1, 2, 3, 4]),
            "a short body is not a key"
        );
        r.on_parameter(&parameter("default_transaction_read_only", "off"));
        r.on_parameter(&parameter("TimeZone", "UTC"));
        r.on_parameter(&parameter("TimeZone", "Asia/Shanghai"));
        assert_eq!(r.drift(), None, "not watched");
        // SET LOCAL: reported, then reported back when the transaction ends.
        r.on_parameter(&parameter("default_transaction_read_only", "on"));
        assert!(r.drift().is_some_and(|d| d.contains("is on (it was off")));
        r.on_parameter(&parameter("default_transaction_read_only", "off"));
        assert_eq!(r.drift(), None);
        r.on_parameter(&parameter("client_encoding", "SJIS"));
        assert_eq!(r.foreign_encoding().as_deref(), Some("SJIS"));
        r.on_parameter(&parameter("client_encoding", "utf8"));
        assert_eq!(r.foreign_encoding(), None);
    }
}
