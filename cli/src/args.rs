//! Parsers for argument values clap cannot express directly.

use engine::{Device, EntryDtype};

/// A comma-separated list of token ids.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenIds(pub Vec<u32>);

/// `1,2,3` → token ids; the error names the offending item.
pub fn token_ids(s: &str) -> Result<TokenIds, String> {
    if s.trim().is_empty() {
        return Err("the prompt is empty; give at least one token id".into());
    }
    s.split(',')
        .enumerate()
        .map(|(i, part)| {
            part.trim()
                .parse::<u32>()
                .map_err(|_| format!("item {} (`{}`) is not a token id (a non-negative integer)", i + 1, part.trim()))
        })
        .collect::<Result<Vec<_>, _>>()
        .map(TokenIds)
}

pub fn kv_dtype(s: &str) -> Result<EntryDtype, String> {
    EntryDtype::parse_arg(s)
}

/// `--device`: `cpu` or `cuda:N`.
pub fn device(s: &str) -> Result<Device, String> {
    Device::parse(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_ids_and_names_bad_items() {
        assert_eq!(token_ids("1, 2,3").unwrap(), TokenIds(vec![1, 2, 3]));
        assert!(token_ids("1,x").unwrap_err().contains("item 2 (`x`)"));
        assert!(token_ids("").is_err());
        assert!(kv_dtype("fp16").unwrap_err().contains("f32, bf16 or fp8"));
        assert_eq!(kv_dtype("fp8").unwrap(), EntryDtype::Fp8);
        assert_eq!(device("cuda:1").unwrap(), Device::Cuda(1));
        assert!(device("cuda:").unwrap_err().contains("cpu or cuda:N"));
    }
}
