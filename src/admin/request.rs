//! What a request asks: its query or form fields, where the router is
//! mounted, which page.

use axum::http::{StatusCode, Uri};
use idem_runtime::operate::Page;

use super::{Admin, Refusal};

/// A request's query or form fields, decoded.
pub(super) struct Fields(Vec<(String, String)>);

impl Fields {
    pub(super) fn parse(s: &str) -> Fields {
        Fields(
            s.split('&')
                .filter(|p| !p.is_empty())
                .map(|p| {
                    let (k, v) = p.split_once('=').unwrap_or((p, ""));
                    (decode(k), decode(v))
                })
                .collect(),
        )
    }
    pub(super) fn query(uri: &Uri) -> Fields {
        Fields::parse(uri.query().unwrap_or(""))
    }
    pub(super) fn get(&self, name: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
    pub(super) fn text(&self, name: &str) -> String {
        self.get(name).unwrap_or("").trim().to_owned()
    }
    pub(super) fn all<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a str> + 'a {
        self.0
            .iter()
            .filter(move |(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
    pub(super) fn number(&self, name: &str) -> Option<i64> {
        self.get(name)?.trim().parse().ok()
    }

    /// The fields, or a 400 when one holds a NUL byte: PostgreSQL's text
    /// cannot hold one, and a filter with it would fail as a database
    /// error.
    pub(super) fn without_nul(self) -> Result<Fields, Refusal> {
        match self.0.iter().find(|(k, v)| k.contains('\0') || v.contains('\0')) {
            None => Ok(self),
            Some((name, _)) => Err(Refusal(
                StatusCode::BAD_REQUEST,
                format!(
                    "The field {name:?} holds a NUL byte (%00), which no key, kind, consumer or scope can hold: nothing was looked up or changed."
                ),
            )),
        }
    }
}

/// `application/x-www-form-urlencoded` decoding (`+` is a space).
fn decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).ok();
                match hex.and_then(|h| u8::from_str_radix(h, 16).ok()) {
                    Some(b) => {
                        out.push(b);
                        i += 2;
                    }
                    None => out.push(b'%'),
                }
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Where the router is mounted: the original path minus the router's own.
pub(super) fn base(original: &Uri, own: &Uri) -> String {
    let full = original.path();
    let rest = own.path().trim_end_matches('/');
    full.strip_suffix(rest)
        .unwrap_or("")
        .trim_end_matches('/')
        .to_owned()
}

/// The request's page: `offset` from the query, `limit` the config's size.
pub(super) fn page(admin: &Admin, q: &Fields) -> Page {
    Page {
        limit: admin.config.page_size,
        offset: q.number("offset").unwrap_or(0).max(0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_decode_and_a_nul_byte_is_refused() {
        let q = Fields::parse("kind=a+b%2Fc&offset=2&id=1&id=2");
        assert_eq!(q.text("kind"), "a b/c");
        assert_eq!(q.number("offset"), Some(2));
        assert_eq!(q.all("id").collect::<Vec<_>>(), ["1", "2"]);
        assert!(Fields::parse("kind=ok").without_nul().is_ok());
        for nul in ["kind=%00", "kind=a%00b", "x%00=1"] {
            let refused = Fields::parse(nul).without_nul().err().expect(nul);
            assert_eq!(refused.0, StatusCode::BAD_REQUEST, "{nul}");
        }
    }
}
