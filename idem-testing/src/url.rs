//! Just enough URL handling to point an admin URL at another database.
//!
//! tokio-postgres can parse URLs but not print them back, and both callers of
//! the harness (tokio-postgres and diesel-async) want a URL string, so the
//! database path is swapped textually, keeping user, host, port and query.

use crate::HarnessError;

const SCHEMES: [&str; 2] = ["postgres://", "postgresql://"];

/// Splits `url` into (scheme + authority, query-with-leading-`?`), dropping the path.
fn split(url: &str) -> Result<(&str, &str), HarnessError> {
    let scheme_len = SCHEMES
        .iter()
        .find(|scheme| url.starts_with(*scheme))
        .map(|scheme| scheme.len())
        .ok_or_else(|| HarnessError::InvalidUrl {
            url: redact(url),
            reason: "expected a postgres:// or postgresql:// URL".into(),
        })?;
    let rest = &url[scheme_len..];
    let authority_len = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let after = &rest[authority_len..];
    let query = match after.find('?') {
        Some(start) => {
            let query = &after[start..];
            // A fragment means nothing to libpq-style URLs; dropping it keeps the result parseable.
            &query[..query.find('#').unwrap_or(query.len())]
        }
        None => "",
    };
    Ok((&url[..scheme_len + authority_len], query))
}

/// The same server URL, but naming database `database`.
pub(crate) fn with_database(url: &str, database: &str) -> Result<String, HarnessError> {
    let (base, query) = split(url)?;
    Ok(format!("{base}/{database}{query}"))
}

/// The `host:port` a URL points at (port 5432 when none is given).
pub(crate) fn host_port(url: &str) -> Result<String, HarnessError> {
    let (base, _) = split(url)?;
    let authority = &base[base.find("://").map_or(0, |i| i + 3)..];
    let host_port = &authority[authority.rfind('@').map_or(0, |at| at + 1)..];
    if host_port.is_empty() {
        return Err(HarnessError::InvalidUrl {
            url: redact(url),
            reason: "the URL names no host".into(),
        });
    }
    Ok(if host_port.contains(':') {
        host_port.to_owned()
    } else {
        format!("{host_port}:5432")
    })
}

/// The same URL, pointing at `host_port` instead.
pub(crate) fn with_host_port(url: &str, host_port: &str) -> Result<String, HarnessError> {
    let (base, query) = split(url)?;
    let scheme_len = base.find("://").map_or(0, |i| i + 3);
    let authority = &base[scheme_len..];
    let user = &authority[..authority.rfind('@').map_or(0, |at| at + 1)];
    let path = &url[base.len()..url.len() - query.len()];
    Ok(format!(
        "{}{user}{host_port}{path}{query}",
        &base[..scheme_len]
    ))
}

/// The user and password in the URL's authority, percent-decoded.
pub(crate) fn credentials(url: &str) -> Result<(Option<String>, Option<String>), HarnessError> {
    let (base, _) = split(url)?;
    let authority = &base[base.find("://").map_or(0, |i| i + 3)..];
    let Some(at) = authority.rfind('@') else {
        return Ok((None, None));
    };
    let userinfo = &authority[..at];
    let (user, password) = match userinfo.split_once(':') {
        Some((user, password)) => (user, Some(password)),
        None => (userinfo, None),
    };
    let user = (!user.is_empty()).then(|| percent_decode(user));
    Ok((user, password.map(percent_decode)))
}

fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match (bytes[i], hex) {
            (b'%', Some(byte)) => {
                out.push(byte);
                i += 3;
            }
            (byte, _) => {
                out.push(byte);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// `url` with any password replaced, so it can go into error messages and Debug output.
pub(crate) fn redact(url: &str) -> String {
    let Some(scheme_len) = SCHEMES
        .iter()
        .find(|scheme| url.starts_with(*scheme))
        .map(|scheme| scheme.len())
    else {
        // Not a URL (maybe a key=value string that contains a password): show nothing of it.
        return "<unparseable connection string>".into();
    };
    let rest = &url[scheme_len..];
    let authority_len = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let authority = &rest[..authority_len];
    let masked = match authority.rfind('@') {
        Some(at) => match authority[..at].find(':') {
            Some(colon) => format!("{}:***{}", &authority[..colon], &authority[at..]),
            None => authority.to_owned(),
        },
        None => authority.to_owned(),
    };
    let masked_query = mask_password_param(&rest[authority_len..]);
    format!("{}{masked}{masked_query}", &url[..scheme_len])
}

fn mask_password_param(path_and_query: &str) -> String {
    let Some(start) = path_and_query.find('?') else {
        return path_and_query.to_owned();
    };
    let params: Vec<String> = path_and_query[start + 1..]
        .split('&')
        .map(|param| {
            if param.starts_with("password=") {
                "password=***".to_owned()
            } else {
                param.to_owned()
            }
        })
        .collect();
    format!("{}?{}", &path_and_query[..start], params.join("&"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replaces_the_database_and_keeps_the_rest() {
        let cases = [
            (
                "postgres://postgres@127.0.0.1:5432/postgres",
                "postgres://postgres@127.0.0.1:5432/db1",
            ),
            ("postgres://localhost", "postgres://localhost/db1"),
            ("postgresql://h:1/", "postgresql://h:1/db1"),
            (
                "postgres://u:p@h/x?sslmode=disable&application_name=a",
                "postgres://u:p@h/db1?sslmode=disable&application_name=a",
            ),
            (
                "postgres://u@/x?host=/var/run/postgresql",
                "postgres://u@/db1?host=/var/run/postgresql",
            ),
        ];
        for (input, expected) in cases {
            assert_eq!(with_database(input, "db1").unwrap(), expected, "{input}");
        }
    }

    #[test]
    fn rejects_non_urls() {
        assert!(matches!(
            with_database("host=localhost user=postgres", "db1"),
            Err(HarnessError::InvalidUrl { .. })
        ));
    }

    #[test]
    fn redacts_passwords() {
        assert_eq!(
            redact("postgres://u:secret@h:5432/db?password=x&sslmode=disable"),
            "postgres://u:***@h:5432/db?password=***&sslmode=disable"
        );
        assert_eq!(redact("postgres://u@h/db"), "postgres://u@h/db");
        assert!(!redact("host=h password=secret").contains("secret"));
    }
}

#[cfg(test)]
mod host_port_tests {
    use super::*;

    #[test]
    fn credentials_are_read_and_decoded() {
        assert_eq!(
            credentials("postgres://u%40x:p%3Aw@h:1/db").unwrap(),
            (Some("u@x".to_owned()), Some("p:w".to_owned()))
        );
        assert_eq!(
            credentials("postgres://postgres@h/db").unwrap(),
            (Some("postgres".to_owned()), None)
        );
        assert_eq!(credentials("postgres://h/db").unwrap(), (None, None));
    }

    #[test]
    fn host_and_port_are_read_and_replaced() {
        let url = "postgres://postgres:pw@127.0.0.1:5432/app?sslmode=disable";
        assert_eq!(host_port(url).unwrap(), "127.0.0.1:5432");
        assert_eq!(
            with_host_port(url, "127.0.0.1:6000").unwrap(),
            "postgres://postgres:pw@127.0.0.1:6000/app?sslmode=disable"
        );
        assert_eq!(host_port("postgres://db/app").unwrap(), "db:5432");
        assert_eq!(
            with_host_port("postgres://db/app", "h:1").unwrap(),
            "postgres://h:1/app"
        );
    }
}
