//! CSRF tokens: a double-submit cookie whose value the router also signs.
//!
//! A token is `nonce.mac`: 16 random bytes and the SHA-256 of the
//! router's secret (32 random bytes, new for each router) followed by the
//! nonce, both in hex. A page sets it as the `SameSite=Strict`, `HttpOnly`
//! cookie [`COOKIE`] and puts it in each form; a POST passes only when the
//! form's token equals the cookie's and the router signed it.

use axum::http::header::{COOKIE as COOKIE_HEADER, HOST, ORIGIN};
use axum::http::{HeaderMap, Uri};
use sha2::{Digest, Sha256};

/// The cookie that carries the token.
pub(crate) const COOKIE: &str = "idem_admin_csrf";

/// One router's signing secret.
#[derive(Clone)]
pub(crate) struct Csrf {
    secret: [u8; 32],
}

impl Csrf {
    /// A fresh secret from the operating system's generator.
    pub(crate) fn new() -> Csrf {
        let mut secret = [0u8; 32];
        getrandom::fill(&mut secret).expect("the operating system's random generator");
        Csrf { secret }
    }

    fn mac(&self, nonce: &[u8]) -> [u8; 32] {
        let mut h = Sha256::new();
        h.update(b"idem-admin-csrf\0");
        h.update(self.secret);
        h.update(nonce);
        h.finalize().into()
    }

    /// A new token.
    pub(crate) fn issue(&self) -> String {
        let mut nonce = [0u8; 16];
        getrandom::fill(&mut nonce).expect("the operating system's random generator");
        format!("{}.{}", hex(&nonce), hex(&self.mac(&nonce)))
    }

    /// Whether this router signed `token`.
    pub(crate) fn valid(&self, token: &str) -> bool {
        let Some((nonce, mac)) = token.split_once('.') else {
            return false;
        };
        let (Some(nonce), Some(mac)) = (unhex(nonce), unhex(mac)) else {
            return false;
        };
        nonce.len() == 16 && mac.len() == 32 && same(&self.mac(&nonce), &mac)
    }

    /// Whether a POST carries a good token: the form's equals the cookie's,
    /// and this router signed it.
    pub(crate) fn check(&self, cookie: Option<&str>, form: Option<&str>) -> bool {
        match (cookie, form) {
            (Some(c), Some(f)) => same(c.as_bytes(), f.as_bytes()) && self.valid(f),
            _ => false,
        }
    }
}

/// Every token the request's `Cookie` headers carry (HTTP/2 may split the
/// cookies over several headers). More than one means a second cookie of
/// the name was set by someone else: cookies are not kept apart by port,
/// so a page on another port of the same host can set one (with a longer
/// `Path`, which the browser sends first).
pub(crate) fn from_cookies(headers: &HeaderMap) -> Vec<&str> {
    headers
        .get_all(COOKIE_HEADER)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|h| h.split(';'))
        .filter_map(|pair| {
            let (name, value) = pair.trim().split_once('=')?;
            (name == COOKIE).then_some(value)
        })
        .collect()
}

/// Why a POST is refused for where it comes from, if it is: a browser
/// says where in `Sec-Fetch-Site` (which must be `same-origin`) and
/// `Origin` (which must name this request's own `Host`: host and port, the
/// scheme's default port filled in, and the scheme too where the request's
/// URI carries one, as over HTTP/2). `SameSite=Strict` does not stop
/// another port of the same host, which is the same site; these do. A
/// request with neither header (not a browser's) is left to the token.
pub(crate) fn cross_origin(headers: &HeaderMap, uri: &Uri) -> Option<&'static str> {
    if let Some(site) = headers.get("sec-fetch-site") {
        if site.as_bytes() != b"same-origin" {
            return Some("The browser says this POST came from another origin (Sec-Fetch-Site), another port of this host included.");
        }
    }
    let origin = headers.get(ORIGIN)?;
    let host = headers
        .get(HOST)
        .and_then(|h| h.to_str().ok())
        .or(uri.authority().map(|a| a.as_str()));
    match (origin.to_str().ok(), host) {
        (Some(origin), Some(host)) if same_origin(origin, host, uri.scheme_str()) => None,
        _ => Some("This POST came from another origin (its Origin header does not name this page's host and port)."),
    }
}

/// Whether `origin` (`scheme://host[:port]`) names `host` (`host[:port]`,
/// the `Host` header), default ports filled in from the origin's scheme;
/// and its scheme is `scheme`, when that is known. (Over HTTP/1.1 the
/// server is not told the scheme, and TLS may end in front of it; one port
/// speaks one scheme, so host and port decide.)
fn same_origin(origin: &str, host: &str, scheme: Option<&str>) -> bool {
    let Some((own, rest)) = origin.split_once("://") else {
        return false;
    };
    let scheme_ok = scheme.is_none_or(|s| s.eq_ignore_ascii_case(own));
    let scheme = own;
    let default = match scheme.to_ascii_lowercase().as_str() {
        "http" => "80",
        "https" => "443",
        _ => return false,
    };
    let with_port = |authority: &str| -> Option<(String, String)> {
        if authority.is_empty() || authority.contains(['/', '@', '?', '#']) {
            return None;
        }
        // `[::1]:8080`, `[::1]`, `host:8080`, `host`.
        let (name, port) = match authority.rsplit_once(':') {
            Some((name, port)) if !port.contains(']') => (name, port),
            _ => (authority, default),
        };
        if port.is_empty() || !port.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        let port = port.trim_start_matches('0');
        Some((name.to_ascii_lowercase(), port.to_owned()))
    };
    match (with_port(rest), with_port(host)) {
        (Some(a), Some(b)) => scheme_ok && a == b,
        _ => false,
    }
}

/// Equal, in time that depends only on the lengths.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if s.len() % 2 != 0 || !s.is_ascii() {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_signed_and_must_match_the_cookie() {
        let csrf = Csrf::new();
        let t = csrf.issue();
        assert!(csrf.valid(&t));
        assert!(csrf.check(Some(&t), Some(&t)));
        assert!(!csrf.check(None, Some(&t)));
        assert!(!csrf.check(Some(&t), None));
        let other = csrf.issue();
        assert!(
            !csrf.check(Some(&other), Some(&t)),
            "cookie and form differ"
        );
        assert!(!Csrf::new().valid(&t), "another router's token");
        let forged = format!(
            "{}{}",
            &t[..t.len() - 1],
            if t.ends_with('0') { '1' } else { '0' }
        );
        assert!(!csrf.check(Some(&forged), Some(&forged)));
        assert!(!csrf.valid("x.y"));
        let mut headers = HeaderMap::new();
        let one = format!("a=b; {COOKIE}={t}; c=d");
        headers.insert(COOKIE_HEADER, one.parse().expect("a header"));
        assert_eq!(from_cookies(&headers), [t.as_str()]);
        // A second one, in another Cookie header (HTTP/2) or the same.
        headers.append(
            COOKIE_HEADER,
            format!("{COOKIE}={other}").parse().expect("a header"),
        );
        assert_eq!(from_cookies(&headers), [t.as_str(), other.as_str()]);
    }

    #[test]
    fn origins_must_name_the_host_and_port() {
        let same = |origin, host| same_origin(origin, host, None);
        assert!(same("http://127.0.0.1:8080", "127.0.0.1:8080"));
        assert!(same("http://Admin.Example:80", "admin.example"));
        assert!(same("https://admin.example", "admin.example:443"));
        assert!(same("http://[::1]:8080", "[::1]:8080"));
        assert!(same("http://[::1]", "[::1]:80"));
        assert!(
            !same("http://127.0.0.1:8081", "127.0.0.1:8080"),
            "another port"
        );
        assert!(
            !same("http://localhost:8080", "127.0.0.1:8080"),
            "another name"
        );
        assert!(
            !same("https://127.0.0.1:80", "127.0.0.1"),
            "another scheme's port"
        );
        for bad in [
            "null",
            "",
            "127.0.0.1:8080",
            "ftp://127.0.0.1:8080",
            "http://u@127.0.0.1:8080",
            "http://127.0.0.1:80x",
        ] {
            assert!(!same(bad, "127.0.0.1:8080"), "{bad}");
        }
        // Where the URI says the scheme (HTTP/2), it must agree.
        assert!(same_origin("https://a:8443", "a:8443", Some("https")));
        assert!(!same_origin("http://a:8443", "a:8443", Some("https")));

        let with = |pairs: &[(&'static str, &str)]| {
            let mut h = HeaderMap::new();
            for (name, value) in pairs {
                h.insert(*name, value.parse().expect("a header"));
            }
            h
        };
        let path: Uri = "/admin/jobs/action".parse().expect("a uri");
        let host = ("host", "127.0.0.1:8080");
        let own = ("origin", "http://127.0.0.1:8080");
        assert_eq!(cross_origin(&with(&[host]), &path), None, "not a browser");
        let fetch = ("sec-fetch-site", "same-origin");
        assert_eq!(cross_origin(&with(&[host, own, fetch]), &path), None);
        let site = ("sec-fetch-site", "same-site");
        assert!(cross_origin(&with(&[host, own, site]), &path).is_some());
        let other = ("origin", "http://127.0.0.1:9090");
        assert!(cross_origin(&with(&[host, other]), &path).is_some());
        assert!(cross_origin(&with(&[host, ("origin", "null")]), &path).is_some());
        // HTTP/2: no Host header, the URI's authority and scheme.
        let h2: Uri = "http://127.0.0.1:8080/admin/jobs/action"
            .parse()
            .expect("a uri");
        assert_eq!(cross_origin(&with(&[own]), &h2), None);
        assert!(
            cross_origin(&with(&[own]), &path).is_some(),
            "no host at all"
        );
    }
}
