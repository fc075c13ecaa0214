//! The format's published vectors, and every collision v1 had, now gone.

use std::collections::{BTreeMap, HashMap};

use serde::ser::{SerializeMap, SerializeStruct, Serializer};
use serde_json::{json, Value};

use super::*;

fn enc<T: Serialize + ?Sized>(value: &T) -> Vec<u8> {
    canonical(value).unwrap()
}

fn field(name: &str, value: &impl Serialize) -> Field {
    Field::new(name, value).unwrap()
}

fn fp(fields: &[Field]) -> String {
    hex(&fingerprint(fields))
}

/// `'I' || sign || 16-byte magnitude`, by hand.
fn int(negative: bool, magnitude: u128) -> Vec<u8> {
    [&[b'I', u8::from(negative)][..], &magnitude.to_be_bytes()].concat()
}

/// `u32(len) || bytes`, by hand.
fn str_(s: &str) -> Vec<u8> {
    [&(s.len() as u32).to_be_bytes()[..], s.as_bytes()].concat()
}

#[test]
fn published_vectors() {
    // Pinned, and rebuilt by hand from the format in the module docs:
    // changing the encoding changes every stored fingerprint.
    let empty: [u8; 32] = Sha256::digest(b"idem-fp-v2\0\0\0\0").into();
    assert_eq!(fingerprint(&[]), empty);
    let object = [
        &b"O\0\0\0\x02"[..],
        b"S\0\0\0\x01aU",
        b"S\0\0\0\x01bA\0\0\0\x02",
        &int(false, 1),
        b"S\0\0\0\x01x",
    ]
    .concat();
    assert_eq!(enc(&json!({"b": [1, "x"], "a": null})), object);
    assert_eq!(
        hex(&object),
        "4f000000025300000001615553000000016241000000024900\
         00000000000000000000000000000001530000000178"
    );
    assert_eq!(enc(&-1_i8), int(true, 1));
    assert_eq!(enc(&u128::MAX), int(false, u128::MAX));
    assert_eq!(enc(&i128::MIN), int(true, 1 << 127));
    assert_eq!(enc(&1.5_f64), b"F\x3f\xf8\0\0\0\0\0\0");
    assert_eq!(enc(&f64::NAN), b"F\x7f\xf8\0\0\0\0\0\0");
    assert_eq!(enc(&f64::INFINITY), b"F\x7f\xf0\0\0\0\0\0\0");
    assert_eq!(enc(&f64::NEG_INFINITY), b"F\xff\xf0\0\0\0\0\0\0");
    assert_eq!(enc(&None::<i32>), b"N");
    assert_eq!(enc(&Some(None::<i32>)), b"YN");
    assert_eq!(enc(&Some(7_u8)), int(false, 7));
    assert_eq!(enc(&()), b"U");
    assert_eq!(enc(&true), b"B\x01");

    let payment = fp(&[
        field("amount", &3000),
        field("currency", &"CNY"),
        field("merchant", &"demo"),
    ]);
    let by_hand = [
        &b"idem-fp-v2\0\0\0\x03"[..],
        &str_("amount"),
        &int(false, 3000),
        &str_("currency"),
        b"S",
        &str_("CNY"),
        &str_("merchant"),
        b"S",
        &str_("demo"),
    ]
    .concat();
    assert_eq!(payment, hex(&Sha256::digest(&by_hand)));
    assert_eq!(
        payment,
        "b7cbb58cbb34833670216ccb1e4633c794c34bdf3d8713ea67fd664ce9a74c50"
    );
    // The names #[idempotent(fingerprint(cmd.amount, ..))] gives its fields.
    assert_eq!(
        fp(&[
            field("cmd.merchant", &"demo"),
            field("cmd.amount", &3000_i64),
            field("cmd.currency", &"CNY"),
        ]),
        "0ca3c5714b175e1d90e1f06fb2ec43b76e640cc794f2bcd137e897634952a386"
    );
}

#[test]
fn what_json_made_null_is_now_distinct() {
    // v1 encoded all of these as `null`.
    let values = [
        enc(&f64::NAN),
        enc(&f64::INFINITY),
        enc(&f64::NEG_INFINITY),
        enc(&None::<f64>),
        enc(&()),
    ];
    for (i, a) in values.iter().enumerate() {
        for b in &values[i + 1..] {
            assert_ne!(a, b);
        }
    }
    // A JSON null is what serde_json serializes it as: `()`, not `None`.
    assert_eq!(enc(&json!(null)), enc(&()));
    assert_ne!(enc(&json!(null)), enc(&None::<i32>));
    // One NaN, one zero.
    assert_eq!(enc(&f64::NAN), enc(&-f64::NAN));
    assert_eq!(enc(&f64::NAN), enc(&f32::NAN));
    assert_eq!(enc(&f64::from_bits(0x7ff0_0000_dead_beef)), enc(&f64::NAN));
    assert_eq!(enc(&-0.0_f64), enc(&0.0_f64));
    assert_eq!(enc(&json!(-0.0)), enc(&0.0_f64));
    assert_eq!(enc(&f32::INFINITY), enc(&f64::INFINITY));
}

#[test]
fn options_nest_without_colliding() {
    let none = enc(&None::<Option<i32>>);
    let some_none = enc(&Some(None::<i32>));
    let some_some_none = enc(&Some(Some(None::<i32>)));
    assert_ne!(none, some_none);
    assert_ne!(some_none, some_some_none);
    assert_ne!(none, some_some_none);
    // Some is transparent otherwise, so a typed Some(5) is the JSON 5.
    assert_eq!(enc(&Some(Some(5))), enc(&5));
    assert_eq!(enc(&Some(5)), enc(&json!(5)));
    assert_ne!(enc(&None::<()>), enc(&Some(())));
    assert_ne!(enc(&None::<()>), enc(&()));
    assert_eq!(enc(&Some(())), enc(&()));
}

#[test]
fn map_keys_are_typed_values() {
    let int_key: BTreeMap<i32, &str> = [(1, "a")].into();
    let str_key: BTreeMap<&str, &str> = [("1", "a")].into();
    assert_ne!(enc(&int_key), enc(&str_key));
    assert_eq!(enc(&str_key), enc(&json!({"1": "a"})));
    let i64_key: BTreeMap<i64, &str> = [(1, "a")].into();
    assert_eq!(enc(&int_key), enc(&i64_key));
    // Keys need not be strings at all (v1 refused these).
    let tuple_key: HashMap<(i32, i32), i32> = [((1, 2), 3)].into();
    assert!(canonical(&tuple_key).is_ok());
}

#[test]
fn map_order_does_not_matter() {
    let entries: Vec<(String, u32)> = (0..50).map(|i| (format!("k{i}"), i)).collect();
    let hashed: HashMap<String, u32> = entries.iter().cloned().collect();
    let sorted: BTreeMap<String, u32> = entries.iter().cloned().collect();
    assert_eq!(enc(&hashed), enc(&sorted));
    let spelled_one: Value = serde_json::from_str(r#"{"k":1,"j":[true,null]}"#).unwrap();
    let spelled_two: Value = serde_json::from_str(r#"{"j":[true,null],"k":1}"#).unwrap();
    assert_eq!(enc(&spelled_one), enc(&spelled_two));
}

#[test]
fn a_struct_is_the_map_and_the_json_with_its_keys() {
    #[derive(Serialize)]
    struct Transfer {
        to: String,
        amount: i64,
        note: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        memo: Option<String>,
        tags: Vec<&'static str>,
    }
    let typed = Transfer {
        to: "bob".into(),
        amount: 30,
        note: Some("rent".into()),
        memo: None,
        tags: vec!["a", "b"],
    };
    let body: Value =
        serde_json::from_str(r#"{"tags":["a","b"],"note":"rent","amount":30,"to":"bob"}"#).unwrap();
    assert_eq!(enc(&typed), enc(&body));
    let mut map: HashMap<&str, Value> = HashMap::new();
    map.insert("to", json!("bob"));
    map.insert("amount", json!(30));
    map.insert("note", json!("rent"));
    map.insert("tags", json!(["a", "b"]));
    assert_eq!(enc(&typed), enc(&map));
    // A sequence and a tuple of the same items agree.
    assert_eq!(enc(&(1, 2)), enc(&vec![1, 2]));
}

#[test]
fn enums_take_serde_json_shapes() {
    #[derive(Serialize)]
    enum Command {
        Stop,
        Pay(i64),
        Move(i32, i32),
        Rename { to: String },
    }
    assert_eq!(enc(&Command::Stop), enc(&json!("Stop")));
    assert_eq!(enc(&Command::Pay(5)), enc(&json!({"Pay": 5})));
    assert_eq!(enc(&Command::Move(1, 2)), enc(&json!({"Move": [1, 2]})));
    assert_eq!(
        enc(&Command::Rename { to: "x".into() }),
        enc(&json!({"Rename": {"to": "x"}}))
    );
    assert_ne!(enc(&Command::Pay(5)), enc(&Command::Move(5, 0)));
}

#[test]
fn values_are_tagged_and_length_prefixed() {
    assert_ne!(enc(&("ab", "c")), enc(&("a", "bc")));
    assert_ne!(fp(&[field("a", &"bc")]), fp(&[field("ab", &"c")]));
    assert_ne!(enc(&1), enc(&"1"));
    assert_ne!(enc(&1), enc(&1.0));
    assert_ne!(enc(&json!(1)), enc(&json!(1.0)));
    assert_ne!(enc(&json!([])), enc(&json!({})));
    assert_ne!(enc(&false), enc(&0));
    assert_eq!(enc(&'a'), enc(&"a"));
}

#[test]
fn integers_are_encoded_by_value() {
    assert_eq!(enc(&1_i32), enc(&1_u64));
    assert_eq!(enc(&1_i32), enc(&1_i128));
    assert_eq!(enc(&1_u8), enc(&1_u128));
    assert_eq!(enc(&-1_i8), enc(&-1_i128));
    assert_eq!(enc(&0_i64), enc(&0_u128));
    assert_eq!(enc(&json!(u64::MAX)), enc(&u64::MAX));
    assert_eq!(enc(&json!(-3)), enc(&-3_i16));
    assert_ne!(enc(&u128::MAX), enc(&i128::MAX));
    assert_ne!(enc(&i128::MIN), enc(&(1_u128 << 127)));
    assert_ne!(enc(&-1), enc(&1));
}

#[test]
fn bytes_are_their_sequence_of_integers() {
    struct Raw(&'static [u8]);
    impl Serialize for Raw {
        fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            s.serialize_bytes(self.0)
        }
    }
    assert_eq!(enc(&Raw(&[1, 2])), enc(&vec![1_u8, 2]));
    assert_eq!(enc(&Raw(&[1, 2])), enc(&json!([1, 2])));
}

#[test]
fn field_order_does_not_matter() {
    let a = fp(&[field("x", &json!({"k": 1})), field("y", &"s")]);
    let b = fp(&[field("y", &"s"), field("x", &json!({"k": 1}))]);
    assert_eq!(a, b);
    assert_ne!(a, fp(&[field("x", &json!({"k": 1})), field("y", &"t")]));
}

/// A sequence nested `n` deep, serialized without building it.
struct Deep(usize);

impl Serialize for Deep {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self.0 {
            0 => s.serialize_unit(),
            n => [Deep(n - 1)].serialize(s),
        }
    }
}

/// `Some` wrapped `n` deep: wrappers count as levels too.
struct DeepSome(usize);

impl Serialize for DeepSome {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self.0 {
            0 => s.serialize_unit(),
            n => s.serialize_some(&DeepSome(n - 1)),
        }
    }
}

#[test]
fn nesting_is_bounded() {
    let mut vec_200 = json!(0);
    for _ in 0..200 {
        vec_200 = Value::Array(vec![vec_200]);
    }
    let err = Field::new("deep", &vec_200).unwrap_err();
    match err {
        Error::Unserializable { what, source } => {
            assert_eq!(what, "fingerprint field `deep`");
            assert!(
                source.to_string().contains("nested deeper than 128"),
                "{source}"
            );
        }
        other => panic!("{other}"),
    }
    assert!(canonical(&Deep(MAX_DEPTH)).is_ok());
    assert!(canonical(&Deep(MAX_DEPTH + 1)).is_err());
    // Far past any stack: refused, not overflowed.
    assert!(canonical(&Deep(1_000_000)).is_err());
    assert!(canonical(&DeepSome(1_000_000)).is_err());
    // Whatever serde_json reads, encodes.
    let mut depth = 1;
    while serde_json::from_str::<Value>(&format!("{}{}", "[".repeat(depth), "]".repeat(depth)))
        .is_ok()
    {
        depth += 1;
    }
    let deepest = format!("{}{}", "[".repeat(depth - 1), "]".repeat(depth - 1));
    assert!(canonical(&serde_json::from_str::<Value>(&deepest).unwrap()).is_ok());
}

#[test]
fn a_key_given_twice_is_refused() {
    struct Twice;
    impl Serialize for Twice {
        fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            let mut map = s.serialize_map(None)?;
            map.serialize_entry("k", &1)?;
            map.serialize_entry("k", &2)?;
            map.end()
        }
    }
    let err = canonical(&Twice).unwrap_err();
    assert!(err.to_string().contains("same key twice"), "{err}");
    // Two Rust keys that serialize alike are the same key.
    #[derive(Serialize, PartialEq, Eq, PartialOrd, Ord)]
    #[serde(untagged)]
    enum Id {
        Small(i32),
        Big(i64),
    }
    let ids: BTreeMap<Id, &str> = [(Id::Small(1), "a"), (Id::Big(1), "b")].into();
    assert!(canonical(&ids).is_err());
}

#[test]
fn a_failing_serialize_is_refused() {
    struct Fails;
    impl Serialize for Fails {
        fn serialize<S: Serializer>(&self, _: S) -> Result<S::Ok, S::Error> {
            Err(serde::ser::Error::custom("no canonical form"))
        }
    }
    let err = Field::new("bad", &Fails).unwrap_err();
    assert!(matches!(err, Error::Unserializable { .. }), "{err}");
    assert!(err.to_string().contains("no canonical form"), "{err}");
}

/// serde_json's private shape for a `Number` under `arbitrary_precision` or a
/// `RawValue` under `raw_value`: a one-field struct holding the JSON text.
struct JsonText(&'static str, &'static str);

impl Serialize for JsonText {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut st = s.serialize_struct(self.0, 1)?;
        st.serialize_field(self.0, self.1)?;
        st.end()
    }
}

#[test]
fn serde_json_features_do_not_change_a_value() {
    const NUMBER: &str = "$serde_json::private::Number";
    const RAW: &str = "$serde_json::private::RawValue";
    for text in [
        "1",
        "-3",
        "18446744073709551615",
        "1.5",
        "1e3",
        "-0",
        "1.0",
        "1e400",
    ] {
        let Ok(plain) = serde_json::from_str::<Value>(text) else {
            continue;
        };
        assert_eq!(enc(&JsonText(NUMBER, text)), enc(&plain), "{text}");
    }
    assert_eq!(
        enc(&JsonText(RAW, r#"{"b":[1,"x"],"a":null}"#)),
        enc(&json!({"a": null, "b": [1, "x"]}))
    );
}
