//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::time::Duration;

/// Every wait in the tests is bounded by this.
pub const TIMEOUT: Duration = Duration::from_secs(20);

/// A recognisable, position-dependent byte pattern.
pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[1] ^ seed).collect()
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

pub fn unhex(text: &str) -> Result<Vec<u8>, String> {
    if !text.len().is_multiple_of(2) {
        return Err(format!("odd-length hex ({} chars)", text.len()));
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&text[i..i + 2], 16).map_err(|e| format!("bad hex at {i}: {e}")))
        .collect()
}
