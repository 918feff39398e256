//! `POST /v1/completions` bodies: JSON decoded by serde as the HTTP API decodes it
//! (unknown fields refused), then the router's validation.
//!
//! Asserts: never a panic; a refused body gets a non-empty message; an accepted body
//! keeps every promise of [`crate::router_generate::check`].

use router::inputs;

use crate::router_generate::{check, limits, model};

pub fn run(data: &[u8]) {
    let (model, limits) = (model(), limits());
    match inputs::completion_body(model, &limits, data) {
        Ok(v) => check(model, &limits, &v),
        Err(message) => assert!(!message.is_empty()),
    }
}
