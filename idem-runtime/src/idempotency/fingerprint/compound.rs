//! The containers of `idem-fp-v2`: sequences, whose count is known only at
//! their end, and maps and structs, whose entries are sorted before they
//! are written. Also serde_json's private one-field structs, decoded back
//! into the values they stand for.

use serde::ser::{self, Serialize};
use serde_json::Value;

use super::encoder::{
    encode_into, put_float, put_int, put_len, put_signed, put_str, EncodeError, MAP, SEQ, STR,
};

/// With serde_json's `arbitrary_precision` or `raw_value` features (which any
/// crate in a build can turn on), a `Number` or a `RawValue` serializes as a
/// one-field struct of this name holding its JSON text. Decoding them here
/// keeps a `serde_json::Value` encoding the same whatever features are on.
pub(super) const NUMBER_TOKEN: &str = "$serde_json::private::Number";
pub(super) const RAW_VALUE_TOKEN: &str = "$serde_json::private::RawValue";

/// A sequence, tuple or tuple variant being written: `'A' || u32(n) ||
/// items`, the count patched in at the end.
pub(super) struct Seq<'a> {
    out: &'a mut Vec<u8>,
    depth: usize,
    count_at: usize,
    count: usize,
}

impl<'a> Seq<'a> {
    pub(super) fn start(out: &'a mut Vec<u8>, depth: usize) -> Seq<'a> {
        out.push(SEQ);
        let count_at = out.len();
        // Patched in `finish`: a sequence need not know its length up front.
        out.extend_from_slice(&[0; 4]);
        Seq {
            out,
            depth,
            count_at,
            count: 0,
        }
    }

    fn element<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), EncodeError> {
        encode_into(self.out, value, self.depth)?;
        self.count += 1;
        Ok(())
    }

    fn finish(self) -> Result<(), EncodeError> {
        let mut count = Vec::with_capacity(4);
        put_len(&mut count, self.count)?;
        self.out[self.count_at..self.count_at + count.len()].copy_from_slice(&count);
        Ok(())
    }
}

impl ser::SerializeSeq for Seq<'_> {
    type Ok = ();
    type Error = EncodeError;

    fn serialize_element<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), EncodeError> {
        self.element(value)
    }

    fn end(self) -> Result<(), EncodeError> {
        self.finish()
    }
}

impl ser::SerializeTuple for Seq<'_> {
    type Ok = ();
    type Error = EncodeError;

    fn serialize_element<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), EncodeError> {
        self.element(value)
    }

    fn end(self) -> Result<(), EncodeError> {
        self.finish()
    }
}

impl ser::SerializeTupleStruct for Seq<'_> {
    type Ok = ();
    type Error = EncodeError;

    fn serialize_field<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), EncodeError> {
        self.element(value)
    }

    fn end(self) -> Result<(), EncodeError> {
        self.finish()
    }
}

impl ser::SerializeTupleVariant for Seq<'_> {
    type Ok = ();
    type Error = EncodeError;

    fn serialize_field<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), EncodeError> {
        self.element(value)
    }

    fn end(self) -> Result<(), EncodeError> {
        self.finish()
    }
}

/// A map, struct or struct variant being written. Its entries are encoded
/// apart and written at the end, sorted by the bytes of their encoded keys,
/// so the order they came in does not matter; a key seen twice is refused.
pub(super) struct Map<'a> {
    out: &'a mut Vec<u8>,
    depth: usize,
    entries: Vec<(Vec<u8>, Vec<u8>)>,
    /// The key whose value comes next (`SerializeMap` gives them apart).
    key: Option<Vec<u8>>,
    /// serde_json's private struct for a `Number` or `RawValue`: its token
    /// and, once seen, its JSON text.
    json_text: Option<(&'static str, Option<String>)>,
}

impl<'a> Map<'a> {
    pub(super) fn new(out: &'a mut Vec<u8>, depth: usize, len: usize) -> Map<'a> {
        Map {
            out,
            depth,
            // `len` is only a hint: capped, so a wrong one cannot reserve much.
            entries: Vec::with_capacity(len.min(64)),
            key: None,
            json_text: None,
        }
    }

    /// serde_json's private struct named `token`, which holds JSON text.
    pub(super) fn json_text(out: &'a mut Vec<u8>, depth: usize, token: &'static str) -> Map<'a> {
        let mut map = Map::new(out, depth, 0);
        map.json_text = Some((token, None));
        map
    }

    fn value_of<T: Serialize + ?Sized>(&self, value: &T) -> Result<Vec<u8>, EncodeError> {
        let mut bytes = Vec::new();
        encode_into(&mut bytes, value, self.depth)?;
        Ok(bytes)
    }

    fn finish(mut self) -> Result<(), EncodeError> {
        if let Some((token, text)) = self.json_text {
            let text = text.ok_or_else(|| EncodeError(format!("`{token}` without its text")))?;
            return write_json_text(self.out, token, &text, self.depth);
        }
        if self.key.is_some() {
            return Err(EncodeError("a map key without its value".to_owned()));
        }
        self.entries.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        if self.entries.windows(2).any(|w| w[0].0 == w[1].0) {
            return Err(EncodeError(
                "a map or struct has the same key twice".to_owned(),
            ));
        }
        self.out.push(MAP);
        put_len(self.out, self.entries.len())?;
        for (key, value) in &self.entries {
            self.out.extend_from_slice(key);
            self.out.extend_from_slice(value);
        }
        Ok(())
    }
}

impl ser::SerializeMap for Map<'_> {
    type Ok = ();
    type Error = EncodeError;

    fn serialize_key<T: Serialize + ?Sized>(&mut self, key: &T) -> Result<(), EncodeError> {
        // A key is a full value: the integer 1 and the string "1" differ.
        self.key = Some(self.value_of(key)?);
        Ok(())
    }

    fn serialize_value<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), EncodeError> {
        let key = self
            .key
            .take()
            .ok_or_else(|| EncodeError("a map value without its key".to_owned()))?;
        let value = self.value_of(value)?;
        self.entries.push((key, value));
        Ok(())
    }

    fn end(self) -> Result<(), EncodeError> {
        self.finish()
    }
}

impl ser::SerializeStruct for Map<'_> {
    type Ok = ();
    type Error = EncodeError;

    fn serialize_field<T: Serialize + ?Sized>(
        &mut self,
        key: &'static str,
        value: &T,
    ) -> Result<(), EncodeError> {
        if self.json_text.is_some() {
            let text = string_of(&self.value_of(value)?)?;
            if let Some((_, slot)) = &mut self.json_text {
                *slot = Some(text);
            }
            return Ok(());
        }
        // A field is a string key, so a struct equals the map (or the JSON
        // object) with the same keys and values.
        let mut name = Vec::with_capacity(key.len() + 5);
        put_str(&mut name, key)?;
        let value = self.value_of(value)?;
        self.entries.push((name, value));
        Ok(())
    }

    fn end(self) -> Result<(), EncodeError> {
        self.finish()
    }
}

impl ser::SerializeStructVariant for Map<'_> {
    type Ok = ();
    type Error = EncodeError;

    fn serialize_field<T: Serialize + ?Sized>(
        &mut self,
        key: &'static str,
        value: &T,
    ) -> Result<(), EncodeError> {
        ser::SerializeStruct::serialize_field(self, key, value)
    }

    fn end(self) -> Result<(), EncodeError> {
        self.finish()
    }
}

/// The string an encoded `'S'` value holds.
fn string_of(encoded: &[u8]) -> Result<String, EncodeError> {
    match encoded.split_first() {
        Some((&STR, rest)) if rest.len() >= 4 => std::str::from_utf8(&rest[4..])
            .map(str::to_owned)
            .map_err(|e| EncodeError(e.to_string())),
        _ => Err(EncodeError(
            "serde_json's private number or raw value without its text".to_owned(),
        )),
    }
}

/// A serde_json `Number` or `RawValue` given as JSON text: encoded as the
/// same value without those features would be.
fn write_json_text(
    out: &mut Vec<u8>,
    token: &str,
    text: &str,
    depth: usize,
) -> Result<(), EncodeError> {
    if token == NUMBER_TOKEN {
        // As serde_json reads a number without `arbitrary_precision`: an
        // integer when it has no fraction or exponent and fits an i64 or a
        // u64, otherwise an f64 (`-0` too: serde_json reads it as -0.0).
        let integral = !text.contains(['.', 'e', 'E']) && text != "-0";
        if integral {
            if let Ok(v) = text.parse::<i64>() {
                put_signed(out, v.into());
                return Ok(());
            }
            if let Ok(v) = text.parse::<u64>() {
                put_int(out, false, v.into());
                return Ok(());
            }
        }
        let v: f64 = text
            .parse()
            .map_err(|_| EncodeError(format!("`{text}` is not a JSON number")))?;
        put_float(out, v);
        return Ok(());
    }
    let value: Value = serde_json::from_str(text).map_err(|e| EncodeError(e.to_string()))?;
    encode_into(out, &value, depth)
}
