//! ETag and If-Match parsing against RFC 9110's grammar.

use super::*;
use crate::http::HttpStatus;

fn strong(o: &str) -> EntityTag {
    EntityTag {
        weak: false,
        opaque: o.into(),
    }
}

fn offset(r: Result<IfMatch, EtagError>) -> usize {
    match r {
        Err(EtagError::Malformed { offset, .. }) => offset,
        other => panic!("expected Malformed, got {other:?}"),
    }
}

#[test]
fn round_trip() {
    for v in [0, 1, 7, 10, 1_000_000, i64::MAX - 1, i64::MAX] {
        let tag = etag_for_version(v);
        assert_eq!(version_from_etag(&tag), Ok(v));
        assert_eq!(
            IfMatch::parse(&tag).unwrap().expected_version(),
            Ok(Some(v))
        );
    }
    assert_eq!(etag_for_version(0), "\"v0\"");
    assert_eq!(etag_for_version(i64::MAX), "\"v9223372036854775807\"");
    assert_eq!(version_from_etag(" \t\"v3\" "), Ok(3));
}

#[test]
fn wildcard() {
    assert_eq!(IfMatch::parse("*"), Ok(IfMatch::Any));
    assert_eq!(IfMatch::parse(" \t* "), Ok(IfMatch::Any));
    assert_eq!(IfMatch::Any.expected_version(), Ok(None));
    assert_eq!(offset(IfMatch::parse("*, \"v1\"")), 0);
    assert_eq!(offset(IfMatch::parse("\"v1\", *")), 6);
    assert_eq!(offset(IfMatch::parse("**")), 0);
    assert!(matches!(
        version_from_etag("*"),
        Err(EtagError::Malformed { offset: 0, .. })
    ));
}

#[test]
fn lists_with_whitespace_and_empty_elements() {
    let want = IfMatch::Tags(vec![strong("v1"), strong("x"), strong("v1")]);
    assert_eq!(IfMatch::parse("\"v1\",\"x\",\"v1\""), Ok(want.clone()));
    assert_eq!(
        IfMatch::parse(" \"v1\" ,\t\"x\" , \"v1\" "),
        Ok(want.clone())
    );
    assert_eq!(
        IfMatch::parse(", \"v1\",, \"x\" , ,\"v1\",").as_ref(),
        Ok(&want)
    );
    assert_eq!(want.expected_version(), Ok(Some(1)));
    assert_eq!(IfMatch::parse(","), Err(EtagError::Empty));
    assert_eq!(IfMatch::parse(" , ,\t"), Err(EtagError::Empty));
    assert_eq!(IfMatch::parse(""), Err(EtagError::Empty));
    assert_eq!(version_from_etag(""), Err(EtagError::Empty));
    assert_eq!(
        IfMatch::Tags(vec![]).expected_version(),
        Err(EtagError::Empty)
    );
    assert_eq!(
        IfMatch::parse("\"\"").unwrap(),
        IfMatch::Tags(vec![strong("")])
    );
}

#[test]
fn weak_tags() {
    let parsed = IfMatch::parse("W/\"v4\"").unwrap();
    assert_eq!(
        parsed,
        IfMatch::Tags(vec![EntityTag {
            weak: true,
            opaque: "v4".into()
        }])
    );
    let err = parsed.expected_version().unwrap_err();
    assert_eq!(
        err,
        EtagError::Weak {
            tag: "W/\"v4\"".into()
        }
    );
    assert_eq!(err.http_status(), 412);
    assert_eq!(version_from_etag("W/\"v4\""), Err(err));
    // A strong tag in the same list can still match.
    assert_eq!(
        IfMatch::parse("W/\"v4\", \"v4\"")
            .unwrap()
            .expected_version(),
        Ok(Some(4))
    );
    // `W/` is case-sensitive and must be followed directly by the quote.
    assert_eq!(offset(IfMatch::parse("w/\"v4\"")), 0);
    assert_eq!(offset(IfMatch::parse("W/ \"v4\"")), 2);
    assert_eq!(offset(IfMatch::parse("W/")), 2);
}

#[test]
fn foreign_and_out_of_range_tags() {
    for opaque in [
        "abc", "", "v", "V1", "v07", "v+7", "v1.0", "v 1", "v-", "vé", "x1",
    ] {
        let tag = strong(opaque);
        let want = EtagError::Foreign {
            tag: tag.to_string(),
        };
        assert_eq!(own_version(&tag), Err(want.clone()), "{opaque}");
        assert_eq!(want.http_status(), 412);
    }
    assert_eq!(
        version_from_etag("\"v07\""),
        Err(EtagError::Foreign {
            tag: "\"v07\"".into()
        })
    );
    for opaque in [
        "v-1",
        "v-0",
        "v-9223372036854775808",
        "v9223372036854775808",
        "v99999999999999999999999",
    ] {
        let tag = strong(opaque);
        let got = version_from_etag(&tag.to_string());
        assert_eq!(
            got,
            Err(EtagError::VersionOutOfRange {
                tag: tag.to_string()
            })
        );
        assert_eq!(got.unwrap_err().http_status(), 412);
    }
    // Negative versions never round-trip into an accepted precondition.
    assert!(version_from_etag(&etag_for_version(-1)).is_err());
    assert!(version_from_etag(&etag_for_version(i64::MIN)).is_err());
    // If no tag can match, the first tag's error is reported.
    let list = IfMatch::parse("\"abc\", W/\"v1\"").unwrap();
    assert_eq!(
        list.expected_version(),
        Err(EtagError::Foreign {
            tag: "\"abc\"".into()
        })
    );
}

#[test]
fn ambiguous_list() {
    let list = IfMatch::parse("\"v1\", \"v1\", \"v2\"").unwrap();
    let err = list.expected_version().unwrap_err();
    assert_eq!(
        err,
        EtagError::Ambiguous {
            first: 1,
            second: 2
        }
    );
    assert_eq!(err.http_status(), 400);
}

#[test]
fn malformed_input() {
    // Unterminated quote: points at the opening quote.
    assert_eq!(offset(IfMatch::parse("\"v1")), 0);
    assert_eq!(offset(IfMatch::parse("\"v1\", \"v2")), 6);
    assert_eq!(offset(IfMatch::parse("\"")), 0);
    // Missing quotes.
    assert_eq!(offset(IfMatch::parse("v1")), 0);
    assert_eq!(offset(IfMatch::parse("\"v1\", v2")), 6);
    assert!(matches!(
        version_from_etag("v1"),
        Err(EtagError::Malformed { offset: 0, .. })
    ));
    // Junk between or after tags.
    assert_eq!(offset(IfMatch::parse("\"v1\" \"v2\"")), 5);
    assert_eq!(offset(IfMatch::parse("\"v1\"x")), 4);
    assert_eq!(offset(IfMatch::parse("\"v1\"; \"v2\"")), 4);
    assert!(matches!(
        version_from_etag("\"v1\", \"v1\""),
        Err(EtagError::Malformed { offset: 4, .. })
    ));
    // Non-visible characters inside a tag, or outside where OWS is not allowed.
    assert_eq!(offset(IfMatch::parse("\"v 1\"")), 2);
    assert_eq!(offset(IfMatch::parse("\"v\x001\"")), 2);
    assert_eq!(offset(IfMatch::parse("\"v1\x7f\"")), 3);
    assert_eq!(offset(IfMatch::parse("\"v1\n\"")), 3);
    assert_eq!(offset(IfMatch::parse("\n\"v1\"")), 0);
    assert_eq!(offset(IfMatch::parse("\"v1\"\r\n")), 4);
    // obs-text (non-ASCII) is legal syntax but never ours.
    let tag = IfMatch::parse("\"é\"").unwrap();
    assert!(matches!(
        tag.expected_version(),
        Err(EtagError::Foreign { .. })
    ));
    let err = IfMatch::parse("\"v1\" junk").unwrap_err();
    assert_eq!(err.http_status(), 400);
    assert!(err.to_string().contains("byte 5"));
}

/// Deterministic fuzzing: arbitrary bytes (lossily made UTF-8) and strings built
/// from syntax-heavy pieces must never panic, and accepted lists must re-render.
#[test]
fn fuzz_never_panics() {
    let mut state = 0x9E37_79B9_7F4A_7C15_u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let pieces = [
        "\"",
        "W/",
        "w/",
        ",",
        " ",
        "\t",
        "*",
        "v",
        "-",
        "0",
        "7",
        "v1",
        "\"v2\"",
        "9223372036854775808",
        "é",
        "\u{7f}",
        "\0",
        "\n",
        "x",
        "/",
        "W",
    ];
    for round in 0..20_000 {
        let len = (next() % 24) as usize;
        let input = if round % 2 == 0 {
            let bytes: Vec<u8> = (0..len).map(|_| next() as u8).collect();
            String::from_utf8_lossy(&bytes).into_owned()
        } else {
            (0..len)
                .map(|_| pieces[(next() % pieces.len() as u64) as usize])
                .collect()
        };
        if let Err(e) = version_from_etag(&input) {
            let _ = (e.http_status(), e.to_string());
        }
        match IfMatch::parse(&input) {
            Ok(IfMatch::Any) => {}
            Ok(IfMatch::Tags(tags)) => {
                let rendered: Vec<String> = tags.iter().map(|t| t.to_string()).collect();
                let again = IfMatch::parse(&rendered.join(", ")).unwrap();
                assert_eq!(again, IfMatch::Tags(tags.clone()));
                if let Err(e) = again.expected_version() {
                    let _ = (e.http_status(), e.to_string());
                }
            }
            Err(e) => {
                let _ = (e.http_status(), e.to_string());
            }
        }
    }
}
