//! CSRF tokens: a double-submit cookie whose value the router also signs.
//!
//! A token is `nonce.mac`: 16 random bytes and the SHA-256 of the
//! router's secret (32 random bytes, new for each router) followed by the
//! nonce, both in hex. A page sets it as the `SameSite=Strict`, `HttpOnly`
//! cookie [`COOKIE`] and puts it in each form; a POST passes only when the
//! form's token equals the cookie's and the router signed it.

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

/// The token in a `Cookie` header, if any.
pub(crate) fn from_cookies(header: Option<&str>) -> Option<&str> {
    header?.split(';').find_map(|pair| {
        let (name, value) = pair.trim().split_once('=')?;
        (name == COOKIE).then_some(value)
    })
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
        assert_eq!(
            from_cookies(Some(&format!("a=b; {COOKIE}={t}; c=d"))),
            Some(t.as_str())
        );
    }
}
