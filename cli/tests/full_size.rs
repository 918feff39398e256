//! `sluice model init --preset flash --layers 2` as a user runs it: a real-width V4-Flash
//! checkpoint (~9 GB: two layers of 256 FP4 experts, FP8 projections, the 129,280-row
//! BF16 embedding and head) written sharded, inspected, and its option errors.

use std::path::Path;
use std::process::{Command, Output};

fn sluice(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_sluice")).args(args).env("RUST_LOG", "error").output().expect("run sluice")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Free bytes on the filesystem holding `dir` (`df`), if it can be read.
fn free_bytes(dir: &Path) -> Option<u64> {
    let o = Command::new("df").args(["--output=avail", "-B1"]).arg(dir).output().ok()?;
    text(&o.stdout).lines().nth(1)?.trim().parse().ok()
}

#[test]
fn flash_with_two_layers_is_written_sharded_and_inspected() {
    let tmp = tempfile::tempdir().unwrap();
    let free = free_bytes(tmp.path()).unwrap_or(0);
    if free < 14 << 30 {
        eprintln!(
            "SKIPPED flash_with_two_layers_is_written_sharded_and_inspected: not enough disk ({free} bytes free, 14 GiB wanted)"
        );
        return;
    }
    let dir = tmp.path().join("flash2");
    let d = dir.to_str().unwrap();
    let o = sluice(&["model", "init", "--preset", "flash", "--layers", "2", "--seed", "1", "--out", d]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let summary = text(&o.stdout);
    assert!(summary.contains("2 layers, hidden 4096, vocab 129280"), "{summary}");
    // Top-level tensors and one shard a layer, named as DeepSeek names them, indexed.
    let index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("model.safetensors.index.json")).unwrap()).unwrap();
    let map = index["weight_map"].as_object().unwrap();
    assert_eq!(map["layers.1.ffn.experts.255.w3.weight"], "model-00003-of-00003.safetensors");
    assert_eq!(map["embed.weight"], "model-00001-of-00003.safetensors");
    let total = index["metadata"]["total_size"].as_u64().unwrap();
    assert!((9_000_000_000..9_500_000_000).contains(&total), "total_size {total}");

    let o = sluice(&["model", "inspect", d, "--json"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let v: serde_json::Value = serde_json::from_str(&text(&o.stdout)).unwrap();
    assert_eq!(v["layers"].as_array().unwrap().len(), 2);

    // The same directory again is refused; so is a second write over it.
    let o = sluice(&["model", "init", "--preset", "flash", "--layers", "2", "--out", d]);
    assert!(!o.status.success() && text(&o.stderr).contains("already holds a checkpoint"), "{}", text(&o.stderr));
}

#[test]
fn full_size_options_are_checked() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().join("m");
    let d = d.to_str().unwrap();
    let o = sluice(&["model", "init", "--preset", "small", "--layers", "2", "--out", d]);
    assert!(
        !o.status.success() && text(&o.stderr).contains("--layers applies to the released shapes"),
        "{}",
        text(&o.stderr)
    );
    let o = sluice(&["model", "init", "--preset", "flash", "--dtype", "bf16", "--out", d]);
    assert!(!o.status.success() && text(&o.stderr).contains("drop --dtype"), "{}", text(&o.stderr));
    let o = sluice(&["model", "init", "--preset", "pro", "--layers", "99", "--out", d]);
    assert!(!o.status.success() && text(&o.stderr).contains("choose 1 to 61"), "{}", text(&o.stderr));
}
