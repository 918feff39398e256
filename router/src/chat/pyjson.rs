//! JSON written the way Python's `json.dumps(v, ensure_ascii=False)` writes it (`", "`
//! between items, `": "` after keys, non-ASCII kept), with object keys in the order the
//! client sent them. DeepSeek's V4 encoding embeds tool schemas, response schemas and
//! tool-call arguments in this form, so the prompt's bytes (and tokens) depend on it.
//!
//! Values are transcoded from the client's JSON text rather than from a parsed
//! `serde_json::Value`, whose key order depends on a crate feature other crates of
//! the workspace switch on.

use std::fmt::{self, Write};

use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::value::RawValue;

/// `raw` (any JSON text) re-written in Python's layout.
pub fn python_json(raw: &str) -> Result<String, serde_json::Error> {
    let mut out = String::with_capacity(raw.len() + raw.len() / 8);
    let mut de = serde_json::Deserializer::from_str(raw);
    Writer(&mut out).deserialize(&mut de)?;
    de.end()?;
    Ok(out)
}

/// A JSON string literal (quotes and escapes as both Python and serde_json write them).
pub fn quote(s: &str) -> String {
    serde_json::to_string(s).expect("a string always serialises")
}

/// The members of a JSON object in the order given; `None` when `raw` is not an object.
pub fn object_members(raw: &str) -> Option<Vec<(String, Box<RawValue>)>> {
    struct Members;
    impl<'de> Visitor<'de> for Members {
        type Value = Vec<(String, Box<RawValue>)>;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("a JSON object")
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            let mut out = Vec::new();
            while let Some((k, v)) = map.next_entry::<String, Box<RawValue>>()? {
                out.push((k, v));
            }
            Ok(out)
        }
    }
    let mut de = serde_json::Deserializer::from_str(raw);
    let members = de.deserialize_map(Members).ok()?;
    de.end().ok()?;
    Some(members)
}

struct Writer<'a>(&'a mut String);

impl<'de> DeserializeSeed<'de> for Writer<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Writer<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_bool<E: de::Error>(self, v: bool) -> Result<(), E> {
        self.0.push_str(if v { "true" } else { "false" });
        Ok(())
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<(), E> {
        let _ = write!(self.0, "{v}");
        Ok(())
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<(), E> {
        let _ = write!(self.0, "{v}");
        Ok(())
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<(), E> {
        // Shortest round-trip digits with a ".0" on integral values, as Python's repr.
        self.0.push_str(&serde_json::to_string(&v).map_err(E::custom)?);
        Ok(())
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<(), E> {
        self.0.push_str(&quote(v));
        Ok(())
    }
    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        self.0.push_str("null");
        Ok(())
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        self.0.push('[');
        let mut first = true;
        loop {
            if !first {
                self.0.push_str(", ");
            }
            let len = self.0.len();
            if seq.next_element_seed(Writer(self.0))?.is_none() {
                // The separator written for an element that did not come.
                self.0.truncate(if first { len } else { len - 2 });
                break;
            }
            first = false;
        }
        self.0.push(']');
        Ok(())
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        self.0.push('{');
        let mut first = true;
        while let Some(key) = map.next_key::<String>()? {
            if !first {
                self.0.push_str(", ");
            }
            first = false;
            self.0.push_str(&quote(&key));
            self.0.push_str(": ");
            map.next_value_seed(Writer(self.0))?;
        }
        self.0.push('}');
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_pythons_layout_in_the_given_key_order() {
        let raw = r#"{"z":1,"a":[1, 2.50,{"k":null}],"s":"é\n\"","big":1e3,"t":true,"e":[],"o":{}}"#;
        assert_eq!(
            python_json(raw).unwrap(),
            r#"{"z": 1, "a": [1, 2.5, {"k": null}], "s": "é\n\"", "big": 1000.0, "t": true, "e": [], "o": {}}"#
        );
        assert!(python_json("{").is_err());
        let members = object_members(r#"{"b": 1, "a": "x"}"#).unwrap();
        assert_eq!(members.iter().map(|(k, _)| k.as_str()).collect::<Vec<_>>(), ["b", "a"]);
        assert!(object_members("[1]").is_none());
    }
}
