//! Static membership for a single machine: `--peers prefill=http://127.0.0.1:7001,decode=http://127.0.0.1:7002`.

use crate::discovery::{Member, Role};

/// Parse `role=url` pairs separated by commas; the error names the bad item.
pub fn parse_peers(spec: &str) -> Result<Vec<Member>, String> {
    spec.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .enumerate()
        .map(|(i, item)| {
            let (role, url) = item.split_once('=').ok_or_else(|| {
                format!("peer {} (`{item}`) is not role=url, e.g. prefill=http://127.0.0.1:7001", i + 1)
            })?;
            let role = match role.trim() {
                "prefill" => Role::Prefill,
                "decode" => Role::Decode,
                "kvstore" => Role::Kvstore,
                other => {
                    return Err(format!("peer {} has unknown role `{other}`; use prefill, decode or kvstore", i + 1));
                }
            };
            let url = url.trim();
            if !(url.starts_with("http://") || url.starts_with("https://")) {
                return Err(format!("peer {} address `{url}` must start with http:// or https://", i + 1));
            }
            Ok(Member {
                id: format!("{}-{}", role.as_str(), i),
                role,
                grpc_addr: url.to_string(),
                ucx_address: None,
                model: String::new(),
                fingerprint: String::new(),
                capacity: serde_json::Value::Null,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_names_errors() {
        let m = parse_peers("prefill=http://127.0.0.1:1, decode=http://127.0.0.1:2").unwrap();
        assert_eq!(m.len(), 2);
        assert_eq!(m[1].role, Role::Decode);
        assert_eq!(m[1].grpc_addr, "http://127.0.0.1:2");
        assert!(parse_peers("prefill").unwrap_err().contains("peer 1"));
        assert!(parse_peers("prefill=http://a,gpu=http://b").unwrap_err().contains("unknown role `gpu`"));
        assert!(parse_peers("decode=127.0.0.1:2").unwrap_err().contains("http://"));
    }
}
