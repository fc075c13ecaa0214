//! The serializer behind `idem-fp-v2`: it writes the canonical bytes of any
//! `T: Serialize` straight from serde's data model, so nothing is lost on
//! the way (v1 went through `serde_json::Value`, where NaN, infinities,
//! `None` and `()` all became `null` and map keys became strings).
//!
//! This module writes scalars and wrappers, and opens containers, whose
//! entries `compound` collects. The byte format and the reasons for each
//! rule are in the parent module's documentation.

use std::fmt;

use serde::ser::{self, Serialize};

use super::compound::{Map, Seq, NUMBER_TOKEN, RAW_VALUE_TOKEN};

/// The deepest nesting encoded; see the parent module's documentation.
pub(super) const MAX_DEPTH: usize = 128;

// One tag byte opens every value. `SOME` only ever opens an escaped `Some`.
const NONE: u8 = b'N';
const SOME: u8 = b'Y';
const UNIT: u8 = b'U';
const BOOL: u8 = b'B';
const INT: u8 = b'I';
const FLOAT: u8 = b'F';
pub(super) const STR: u8 = b'S';
pub(super) const SEQ: u8 = b'A';
pub(super) const MAP: u8 = b'O';

/// The one NaN every NaN is encoded as (the quiet NaN with no payload).
const CANONICAL_NAN: u64 = 0x7ff8_0000_0000_0000;

/// Why a value has no canonical encoding.
#[derive(Debug)]
pub(super) struct EncodeError(pub(super) String);

impl fmt::Display for EncodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for EncodeError {}

impl ser::Error for EncodeError {
    fn custom<T: fmt::Display>(msg: T) -> Self {
        EncodeError(msg.to_string())
    }
}

impl EncodeError {
    /// The message, for the `serde_json::Error` that `Error::Unserializable`
    /// carries.
    pub(super) fn into_message(self) -> String {
        self.0
    }
}

/// The canonical bytes of `value`.
pub(super) fn encode<T: Serialize + ?Sized>(value: &T) -> Result<Vec<u8>, EncodeError> {
    let mut out = Vec::new();
    encode_into(&mut out, value, 0)?;
    Ok(out)
}

pub(super) fn encode_into<T: Serialize + ?Sized>(
    out: &mut Vec<u8>,
    value: &T,
    depth: usize,
) -> Result<(), EncodeError> {
    value.serialize(Encoder { out, depth })
}

/// `u32(n)`: a count or a byte length, refused past `u32::MAX` rather than
/// truncated (two lengths that truncate alike would collide).
pub(super) fn put_len(out: &mut Vec<u8>, len: usize) -> Result<(), EncodeError> {
    let len = u32::try_from(len)
        .map_err(|_| EncodeError(format!("a length of {len} is over the format's 2^32 - 1")))?;
    out.extend_from_slice(&len.to_be_bytes());
    Ok(())
}

/// The depth of a value nested one level in one at `depth`, refused past
/// [`MAX_DEPTH`] before recursing, so no value can overflow the stack.
fn deeper(depth: usize) -> Result<usize, EncodeError> {
    if depth >= MAX_DEPTH {
        return Err(EncodeError(format!(
            "the value is nested deeper than {MAX_DEPTH} levels"
        )));
    }
    Ok(depth + 1)
}

/// `'S' || u32(len) || UTF-8`.
pub(super) fn put_str(out: &mut Vec<u8>, s: &str) -> Result<(), EncodeError> {
    out.push(STR);
    put_len(out, s.len())?;
    out.extend_from_slice(s.as_bytes());
    Ok(())
}

/// `'I' || sign || u128 magnitude`: one shape for every integer type, so a
/// value encodes alike whatever type carried it, up to `u128::MAX` and down
/// to `i128::MIN`. Zero is never negative, so each integer has one encoding.
pub(super) fn put_int(out: &mut Vec<u8>, negative: bool, magnitude: u128) {
    out.push(INT);
    out.push(u8::from(negative && magnitude != 0));
    out.extend_from_slice(&magnitude.to_be_bytes());
}

pub(super) fn put_signed(out: &mut Vec<u8>, v: i128) {
    put_int(out, v < 0, v.unsigned_abs());
}

/// `'F' || f64 bits`: every NaN is one NaN, and -0.0 is +0.0, so two floats
/// are the same exactly when `a == b` or both are NaN.
pub(super) fn put_float(out: &mut Vec<u8>, v: f64) {
    let bits = if v.is_nan() {
        CANONICAL_NAN
    } else if v == 0.0 {
        0
    } else {
        v.to_bits()
    };
    out.push(FLOAT);
    out.extend_from_slice(&bits.to_be_bytes());
}

/// The header of an enum variant's one-entry map, `{variant: ..}`, as
/// serde_json shapes it; the caller writes the value.
fn put_variant_header(out: &mut Vec<u8>, variant: &str) -> Result<(), EncodeError> {
    out.push(MAP);
    put_len(out, 1)?;
    put_str(out, variant)
}

/// Writes one value at `depth` levels of nesting.
struct Encoder<'a> {
    out: &'a mut Vec<u8>,
    depth: usize,
}

impl Encoder<'_> {
    fn nested(&self) -> Result<usize, EncodeError> {
        deeper(self.depth)
    }
}

impl<'a> ser::Serializer for Encoder<'a> {
    type Ok = ();
    type Error = EncodeError;
    type SerializeSeq = Seq<'a>;
    type SerializeTuple = Seq<'a>;
    type SerializeTupleStruct = Seq<'a>;
    type SerializeTupleVariant = Seq<'a>;
    type SerializeMap = Map<'a>;
    type SerializeStruct = Map<'a>;
    type SerializeStructVariant = Map<'a>;

    fn serialize_bool(self, v: bool) -> Result<(), EncodeError> {
        self.out.push(BOOL);
        self.out.push(u8::from(v));
        Ok(())
    }

    fn serialize_i8(self, v: i8) -> Result<(), EncodeError> {
        self.serialize_i128(v.into())
    }

    fn serialize_i16(self, v: i16) -> Result<(), EncodeError> {
        self.serialize_i128(v.into())
    }

    fn serialize_i32(self, v: i32) -> Result<(), EncodeError> {
        self.serialize_i128(v.into())
    }

    fn serialize_i64(self, v: i64) -> Result<(), EncodeError> {
        self.serialize_i128(v.into())
    }

    fn serialize_i128(self, v: i128) -> Result<(), EncodeError> {
        put_signed(self.out, v);
        Ok(())
    }

    fn serialize_u8(self, v: u8) -> Result<(), EncodeError> {
        self.serialize_u128(v.into())
    }

    fn serialize_u16(self, v: u16) -> Result<(), EncodeError> {
        self.serialize_u128(v.into())
    }

    fn serialize_u32(self, v: u32) -> Result<(), EncodeError> {
        self.serialize_u128(v.into())
    }

    fn serialize_u64(self, v: u64) -> Result<(), EncodeError> {
        self.serialize_u128(v.into())
    }

    fn serialize_u128(self, v: u128) -> Result<(), EncodeError> {
        put_int(self.out, false, v);
        Ok(())
    }

    fn serialize_f32(self, v: f32) -> Result<(), EncodeError> {
        self.serialize_f64(v.into())
    }

    fn serialize_f64(self, v: f64) -> Result<(), EncodeError> {
        put_float(self.out, v);
        Ok(())
    }

    fn serialize_char(self, v: char) -> Result<(), EncodeError> {
        put_str(self.out, v.encode_utf8(&mut [0; 4]))
    }

    fn serialize_str(self, v: &str) -> Result<(), EncodeError> {
        put_str(self.out, v)
    }

    /// Bytes are the sequence of their values, like a `Vec<u8>` and like
    /// serde_json writes them.
    fn serialize_bytes(self, v: &[u8]) -> Result<(), EncodeError> {
        self.out.push(SEQ);
        put_len(self.out, v.len())?;
        for &b in v {
            put_int(self.out, false, b.into());
        }
        Ok(())
    }

    fn serialize_none(self) -> Result<(), EncodeError> {
        self.out.push(NONE);
        Ok(())
    }

    /// `Some(x)` is `x`, unless `x` itself opens with `N` or `Y` (a `None`
    /// or an escaped `Some`): then it is `'Y' || x`. So `Some(5)` is `5`, yet
    /// `None`, `Some(None)` and `Some(Some(None))` all differ.
    fn serialize_some<T: Serialize + ?Sized>(self, value: &T) -> Result<(), EncodeError> {
        let depth = self.nested()?;
        let start = self.out.len();
        encode_into(self.out, value, depth)?;
        if matches!(self.out.get(start), Some(&(NONE | SOME))) {
            self.out.insert(start, SOME);
        }
        Ok(())
    }

    fn serialize_unit(self) -> Result<(), EncodeError> {
        self.out.push(UNIT);
        Ok(())
    }

    fn serialize_unit_struct(self, _name: &'static str) -> Result<(), EncodeError> {
        self.serialize_unit()
    }

    /// A unit variant is its name, as serde_json writes it.
    fn serialize_unit_variant(
        self,
        _name: &'static str,
        _index: u32,
        variant: &'static str,
    ) -> Result<(), EncodeError> {
        put_str(self.out, variant)
    }

    fn serialize_newtype_struct<T: Serialize + ?Sized>(
        self,
        _name: &'static str,
        value: &T,
    ) -> Result<(), EncodeError> {
        let depth = self.nested()?;
        encode_into(self.out, value, depth)
    }

    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        _name: &'static str,
        _index: u32,
        variant: &'static str,
        value: &T,
    ) -> Result<(), EncodeError> {
        let depth = self.nested()?;
        put_variant_header(self.out, variant)?;
        encode_into(self.out, value, depth)
    }

    fn serialize_seq(self, _len: Option<usize>) -> Result<Seq<'a>, EncodeError> {
        let depth = self.nested()?;
        Ok(Seq::start(self.out, depth))
    }

    fn serialize_tuple(self, len: usize) -> Result<Seq<'a>, EncodeError> {
        self.serialize_seq(Some(len))
    }

    fn serialize_tuple_struct(
        self,
        _name: &'static str,
        len: usize,
    ) -> Result<Seq<'a>, EncodeError> {
        self.serialize_seq(Some(len))
    }

    fn serialize_tuple_variant(
        self,
        _name: &'static str,
        _index: u32,
        variant: &'static str,
        _len: usize,
    ) -> Result<Seq<'a>, EncodeError> {
        // Two levels, `{variant: [..]}`, as its JSON equivalent counts them.
        let depth = deeper(self.nested()?)?;
        put_variant_header(self.out, variant)?;
        Ok(Seq::start(self.out, depth))
    }

    fn serialize_map(self, len: Option<usize>) -> Result<Map<'a>, EncodeError> {
        let depth = self.nested()?;
        Ok(Map::new(self.out, depth, len.unwrap_or(0)))
    }

    fn serialize_struct(self, name: &'static str, len: usize) -> Result<Map<'a>, EncodeError> {
        if name == NUMBER_TOKEN || name == RAW_VALUE_TOKEN {
            return Ok(Map::json_text(self.out, self.depth, name));
        }
        self.serialize_map(Some(len))
    }

    fn serialize_struct_variant(
        self,
        _name: &'static str,
        _index: u32,
        variant: &'static str,
        len: usize,
    ) -> Result<Map<'a>, EncodeError> {
        // Two levels, `{variant: {..}}`, as its JSON equivalent counts them.
        let depth = deeper(self.nested()?)?;
        put_variant_header(self.out, variant)?;
        Ok(Map::new(self.out, depth, len))
    }
}
