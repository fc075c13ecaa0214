//! The canonical encoding a request fingerprint is the SHA-256 of.
//!
//! Format `idem-fp-v2` (stable: stored fingerprints depend on it):
//!
//! ```text
//! fingerprint = SHA-256( "idem-fp-v2" || u32(n) || field_1 || ... || field_n )
//! field       = str(name) || value(v)     sorted by name (bytewise), then by value(v)
//! value(None)       = 'N'
//! value(Some(x))    = value(x)            if value(x) opens with neither 'N' nor 'Y'
//!                   = 'Y' || value(x)     otherwise
//! value(())         = 'U'                 also a unit struct, and serde_json's null
//! value(bool)       = 'B' || 0x00 | 0x01
//! value(integer)    = 'I' || sign || u128 magnitude big-endian (16 bytes)
//!                                         sign 0x00 (zero, positive) | 0x01 (negative)
//! value(float)      = 'F' || f64 bits big-endian (8 bytes)
//!                                         f32 widened; every NaN 0x7ff8000000000000; -0.0 as +0.0
//! value(string)     = 'S' || u32(byte length) || UTF-8     also a char
//! value(bytes)      = value of the sequence of its u8s
//! value(sequence)   = 'A' || u32(len) || value(item)...    also a tuple, tuple struct
//! value(map)        = 'O' || u32(len) || (value(key) || value(v))...
//!                                         entries sorted by the bytes of value(key)
//! value(struct)     = value(map of its field names, as strings, to its fields)
//! value(newtype(x)) = value(x)
//! enum variants, as serde_json shapes them (externally tagged):
//!   unit            = value(string name)
//!   newtype(x)      = 'O' || u32(1) || value(string name) || value(x)
//!   tuple(..)       = 'O' || u32(1) || value(string name) || value(sequence)
//!   struct {..}     = 'O' || u32(1) || value(string name) || value(struct)
//! str(s)            = u32(byte length) || UTF-8 bytes
//! u32(n)            = 4 bytes big-endian
//! ```
//!
//! Every value is written straight from serde's data model, never through
//! `serde_json::Value` or JSON text, so nothing is lost on the way; every
//! value is type-tagged and every string and container length-prefixed, so
//! `("ab", "c")` and `("a", "bc")` differ. What counts as the same value:
//!
//! - **Integers by value**, whatever their type: `1_i32`, `1_u64` and
//!   `1_i128` agree, from `i128::MIN` to `u128::MAX`. An integer never
//!   equals a float: `1` and `1.0` differ.
//! - **Floats by `==`**, except that all NaNs are one value: `-0.0` equals
//!   `0.0` (a client sending `-0.0` asks for the same amount), while NaN,
//!   `+∞`, `-∞`, `None` and `()` all differ from each other.
//! - **Maps by their entries**: a key is a full value, so the key `1`
//!   differs from the key `"1"`; entries are sorted by their encoded key, so
//!   a `HashMap` and a `BTreeMap` with the same entries agree; a key given
//!   twice (a custom `Serialize`, `#[serde(flatten)]`) is refused.
//! - **Structs as maps** with string keys, and enum variants as serde_json
//!   shapes them (a unit variant is the string of its name), so a typed body
//!   and the `serde_json::Value` of the same JSON agree (skipped fields are
//!   absent, as in JSON). A `Vec` and a tuple of the same items agree too.
//! - **`Option`**: `Some(x)` is `x`, so wrapping a parameter in `Option`
//!   keeps the fingerprints of present values, and a typed `Some(5)` equals
//!   the JSON `5`. `None` has its own tag, and a `Some` whose content would
//!   open with `N` or `Y` is escaped with `Y`, so `None`, `Some(None)` and
//!   `Some(())` all differ (`Some(())` is `()`). serde_json serializes a
//!   JSON `null` like `()`,
//!   so a typed `None` differs from a JSON `null`: fingerprint a parameter
//!   either typed or as a `Value`, not one in some releases and the other in
//!   others.
//! - **Bytes as their sequence of integers**, like a `Vec<u8>` and like
//!   serde_json writes them. The encoder is human-readable, like JSON, so a
//!   type that serializes differently for humans (an address, a timestamp)
//!   encodes as it would appear in JSON.
//! - With serde_json's `arbitrary_precision` or `raw_value` features on, a
//!   `Number` or a `RawValue` encodes as the same value without them.
//!
//! A value nested deeper than [`MAX_DEPTH`] levels is refused with
//! [`Error::Unserializable`] rather than overflowing the stack: each
//! sequence, map, struct, `Some` and newtype is a level, and an enum variant
//! with a value is a map around it. serde_json reads JSON text no deeper than
//! that, so any JSON body it accepts encodes. A string or container longer
//! than `u32::MAX` is refused the same way.
//!
//! Fingerprints of format `idem-fp-v1` (which went through JSON data, where
//! NaN, infinities, `None` and `()` were all `null` and map keys strings) do
//! not equal their v2 fingerprints: a retry that spans the upgrade is a
//! fingerprint mismatch under a caller's key, and a new key (so a new run)
//! under a derived one.

mod compound;
mod encoder;

use serde::Serialize;
use sha2::{Digest, Sha256};

use crate::error::Error;

const DOMAIN: &[u8] = b"idem-fp-v2";

/// How deeply a value may nest before it is refused; see the module
/// documentation for what counts as a level.
pub const MAX_DEPTH: usize = encoder::MAX_DEPTH;

/// A field of the fingerprint: its name and the canonical bytes of its value.
#[derive(Debug, Clone, PartialEq)]
pub struct Field {
    name: String,
    value: Vec<u8>,
}

impl Field {
    /// Encode `value` for the fingerprint. Fails (before anything is written)
    /// when it has no canonical encoding: nested deeper than [`MAX_DEPTH`], a
    /// map with a key twice, or its `Serialize` failed.
    pub fn new(name: &str, value: &impl Serialize) -> Result<Field, Error> {
        if u32::try_from(name.len()).is_err() {
            return Err(unserializable(
                "a fingerprint field".to_owned(),
                "its name is longer than 2^32 - 1 bytes".to_owned(),
            ));
        }
        let value = encode_as(value, || format!("fingerprint field `{name}`"))?;
        Ok(Field {
            name: name.to_owned(),
            value,
        })
    }
}

/// The fingerprint of `fields`: 32 bytes.
pub fn fingerprint(fields: &[Field]) -> [u8; 32] {
    let mut sorted: Vec<&Field> = fields.iter().collect();
    // By value as well, so a name given twice is canonical too.
    sorted.sort_by(|a, b| (a.name.as_bytes(), &a.value).cmp(&(b.name.as_bytes(), &b.value)));
    let mut hasher = Sha256::new();
    hasher.update(DOMAIN);
    hasher.update(u32_len(sorted.len()).to_be_bytes());
    for field in sorted {
        hasher.update(u32_len(field.name.len()).to_be_bytes());
        hasher.update(field.name.as_bytes());
        hasher.update(&field.value);
    }
    hasher.finalize().into()
}

/// The canonical bytes of one value, as the module documentation gives them
/// (the `value(v)` a field's name is followed by).
pub fn canonical<T: Serialize + ?Sized>(value: &T) -> Result<Vec<u8>, Error> {
    encode_as(value, || "the value".to_owned())
}

/// The canonical bytes of `value`, or `Error::Unserializable` naming it
/// `what()`.
pub(crate) fn encode_as<T: Serialize + ?Sized>(
    value: &T,
    what: impl FnOnce() -> String,
) -> Result<Vec<u8>, Error> {
    encoder::encode(value).map_err(|e| unserializable(what(), e.into_message()))
}

fn unserializable(what: String, message: String) -> Error {
    // `Error::Unserializable` carries a serde_json error; serde lets any
    // serializer's error be made from a message.
    Error::Unserializable {
        what,
        source: <serde_json::Error as serde::ser::Error>::custom(message),
    }
}

/// A count or length known to fit: `Field::new` refuses longer names, and no
/// request has 2^32 fields.
fn u32_len(len: usize) -> u32 {
    u32::try_from(len).unwrap_or(u32::MAX)
}

/// Lower-case hex of bytes.
pub(crate) use crate::sql::to_hex as hex;

#[cfg(test)]
mod tests;
