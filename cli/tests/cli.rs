//! The `sluice` binary as a user runs it: init a model, inspect it, generate from it,
//! and get clear errors for bad input.

use std::path::Path;
use std::process::{Command, Output};

fn sluice(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_sluice")).args(args).env("RUST_LOG", "error").output().expect("run sluice")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn init_tiny(dir: &Path) {
    let o = sluice(&["model", "init", "--preset", "tiny", "--seed", "5", "--out", dir.to_str().unwrap()]);
    assert!(o.status.success(), "init failed: {}", stderr(&o));
}

#[test]
fn init_inspect_generate() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("tiny");
    init_tiny(&model);
    let m = model.to_str().unwrap();

    let o = sluice(&["model", "inspect", m]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = stdout(&o);
    assert!(text.contains("4 layers (window 1, CSA 2, HCA 1)"), "{text}");
    assert!(text.contains("B/token"), "{text}");

    let o = sluice(&["model", "inspect", m, "--json", "--kv-dtype", "f32"]);
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(v["layers"].as_array().unwrap().len(), 4);
    assert!(v["bytes_per_token"]["total"].as_f64().unwrap() > 0.0);
    // fp8 entries: the tiny preset's 32-dim entries (16 BF16 RoPE dims) are 56-byte
    // records against 64 bytes in bf16; 32-dim indexer keys 40 (32 + 1 scale, padded)
    // against 64.
    let per_token = |dtype: &str| -> serde_json::Value {
        let o = sluice(&["model", "inspect", m, "--json", "--kv-dtype", dtype]);
        assert!(o.status.success(), "{}", stderr(&o));
        serde_json::from_str::<serde_json::Value>(&stdout(&o)).unwrap()["bytes_per_token"].clone()
    };
    let (fp8, bf16) = (per_token("fp8"), per_token("bf16"));
    let ratio = |pool: &str| fp8[pool].as_f64().unwrap() / bf16[pool].as_f64().unwrap();
    assert_eq!((ratio("csa_main"), ratio("hca"), ratio("csa_index")), (56.0 / 64.0, 56.0 / 64.0, 40.0 / 64.0));

    let args = [
        "generate",
        "--model",
        m,
        "--prompt-ids",
        "1,2,3,4,5,6,7",
        "--max-tokens",
        "9",
        "--json",
        "--top-logprobs",
        "3",
    ];
    let o = sluice(&args);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    let tokens = v["tokens"].as_array().unwrap();
    assert_eq!(tokens.len(), 9);
    assert_eq!(v["finish_reason"], "length");
    assert_eq!(v["usage"]["prompt_tokens"], 7);
    let top = &v["top_logprobs"][0];
    assert_eq!(top.as_array().unwrap().len(), 3);
    assert_eq!(top[0]["token"], tokens[0], "greedy picks the most likely token");
    // Same request, same output.
    assert_eq!(stdout(&sluice(&args)).split("\"timings\"").next(), stdout(&o).split("\"timings\"").next());

    // Seeded sampling is reproducible and differs from greedy for some seed.
    let sample = |seed: &str| {
        let o = sluice(&[
            "generate",
            "--model",
            m,
            "--prompt-ids",
            "9,8,7",
            "--max-tokens",
            "12",
            "--temperature",
            "1.5",
            "--seed",
            seed,
            "--json",
        ]);
        serde_json::from_str::<serde_json::Value>(stdout(&o).trim()).unwrap()["tokens"].clone()
    };
    assert_eq!(sample("3"), sample("3"));
    assert_ne!(sample("3"), sample("4"));
}

#[test]
fn bad_input_gets_a_clear_error() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("tiny");
    init_tiny(&model);
    let m = model.to_str().unwrap();
    let cases: [(&[&str], &str); 5] = [
        (&["generate", "--model", m, "--prompt-ids", "1,999"], "token id 999 is outside the vocabulary (size 320)"),
        (&["generate", "--model", m, "--prompt-ids", "1,x"], "item 2 (`x`) is not a token id"),
        (&["generate", "--model", m, "--prompt-ids", "1", "--max-tokens", "0"], "--max-tokens must be at least 1"),
        (&["generate", "--model", m, "--prompt-ids", "1", "--top-p", "1.5"], "top_p must be in (0, 1]"),
        (&["generate", "--model", "/nonexistent", "--prompt-ids", "1"], "/nonexistent"),
    ];
    for (args, want) in cases {
        let o = sluice(args);
        assert!(!o.status.success(), "{args:?} should fail");
        assert!(stderr(&o).contains(want), "{args:?}: stderr `{}` lacks `{want}`", stderr(&o));
    }
    let o = sluice(&["model", "init", "--preset", "tiny", "--out", m]);
    assert!(!o.status.success() && stderr(&o).contains("already holds a checkpoint"), "{}", stderr(&o));
}
