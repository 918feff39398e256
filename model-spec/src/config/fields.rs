//! Typed access to a JSON config object with errors that name the field.

use serde_json::{Map, Value};

use super::ConfigError;

pub(crate) struct Fields<'a> {
    obj: &'a Map<String, Value>,
    /// Path of this object inside the config (`rope_scaling.`), for error messages.
    prefix: String,
}

fn bad(field: &str, want: &str, got: &Value) -> ConfigError {
    ConfigError::Invalid { field: field.to_string(), reason: format!("expected {want}, got {got}") }
}

impl<'a> Fields<'a> {
    pub(crate) fn new(v: &'a Value) -> Result<Self, ConfigError> {
        match v.as_object() {
            Some(obj) => Ok(Fields { obj, prefix: String::new() }),
            None => Err(ConfigError::Invalid { field: "<root>".into(), reason: "config must be a JSON object".into() }),
        }
    }

    fn path(&self, name: &str) -> String {
        format!("{}{name}", self.prefix)
    }

    pub(crate) fn get(&self, name: &str) -> Option<&'a Value> {
        self.obj.get(name).filter(|v| !v.is_null())
    }

    pub(crate) fn usize(&self, name: &str) -> Result<usize, ConfigError> {
        self.opt_usize(name)?.ok_or_else(|| ConfigError::Missing { field: self.path(name) })
    }

    pub(crate) fn opt_usize(&self, name: &str) -> Result<Option<usize>, ConfigError> {
        match self.get(name) {
            None => Ok(None),
            Some(v) => {
                v.as_u64().map(|n| Some(n as usize)).ok_or_else(|| bad(&self.path(name), "a non-negative integer", v))
            }
        }
    }

    pub(crate) fn f64(&self, name: &str) -> Result<f64, ConfigError> {
        self.opt_f64(name)?.ok_or_else(|| ConfigError::Missing { field: self.path(name) })
    }

    pub(crate) fn opt_f64(&self, name: &str) -> Result<Option<f64>, ConfigError> {
        match self.get(name) {
            None => Ok(None),
            Some(v) => v.as_f64().map(Some).ok_or_else(|| bad(&self.path(name), "a number", v)),
        }
    }

    pub(crate) fn opt_str(&self, name: &str) -> Result<Option<&'a str>, ConfigError> {
        match self.get(name) {
            None => Ok(None),
            Some(v) => v.as_str().map(Some).ok_or_else(|| bad(&self.path(name), "a string", v)),
        }
    }

    fn opt_list<T>(
        &self,
        name: &str,
        want: &str,
        item: impl Fn(&Value) -> Option<T>,
    ) -> Result<Option<Vec<T>>, ConfigError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Array(items)) => items
                .iter()
                .enumerate()
                .map(|(i, v)| item(v).ok_or_else(|| bad(&format!("{}[{i}]", self.path(name)), want, v)))
                .collect::<Result<Vec<_>, _>>()
                .map(Some),
            Some(v) => Err(bad(&self.path(name), &format!("a list of {want}s"), v)),
        }
    }

    pub(crate) fn opt_usize_list(&self, name: &str) -> Result<Option<Vec<usize>>, ConfigError> {
        self.opt_list(name, "integer", |v| v.as_u64().map(|n| n as usize))
    }

    pub(crate) fn opt_str_list(&self, name: &str) -> Result<Option<Vec<String>>, ConfigError> {
        self.opt_list(name, "string", |v| v.as_str().map(str::to_string))
    }

    pub(crate) fn object(&self, name: &str) -> Result<Option<Fields<'a>>, ConfigError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Object(obj)) => Ok(Some(Fields { obj, prefix: format!("{}.", self.path(name)) })),
            Some(v) => Err(bad(&self.path(name), "an object", v)),
        }
    }
}
