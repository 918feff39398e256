//! Every fuzz target in `cargo test`: its corpus and regression inputs replayed, then a
//! bounded mutation run (`SLUICE_FUZZ_SECONDS` per target, default 2; see
//! `sluice_fuzz::engine`). The longer, coverage-guided run is `scripts/fuzz.sh`.

use std::path::Path;

use sluice_fuzz::{TARGETS, corpus, engine, seeds, target};

fn replay(name: &str) {
    let body = target(name).expect("a known target");
    let inputs = corpus::inputs(name);
    assert!(!inputs.is_empty(), "target {name} has no corpus; run with SLUICE_FUZZ_WRITE_SEEDS=1");
    for (path, bytes) in &inputs {
        if std::panic::catch_unwind(|| body(bytes)).is_err() {
            panic!("target {name} fails on {}", path.display());
        }
    }
}

fn bounded(name: &str) {
    let body = target(name).expect("a known target");
    let seeds: Vec<Vec<u8>> = corpus::inputs(name).into_iter().map(|(_, b)| b).collect();
    let (budget, seed) = engine::settings();
    let report = engine::run(name, body, &seeds, budget, seed);
    eprintln!("fuzz {name}: {} executions in {:.1} s", report.executions, report.elapsed.as_secs_f64());
    assert!(report.executions > 0);
}

macro_rules! targets {
    ($($name:ident),* $(,)?) => {
        $(mod $name {
            #[test]
            fn corpus_and_regressions_replay() {
                super::replay(stringify!($name));
            }

            #[test]
            fn bounded_mutation_run() {
                super::bounded(stringify!($name));
            }
        })*

        #[test]
        fn every_target_has_tests_and_a_libfuzzer_binary() {
            let tested = [$(stringify!($name)),*];
            let named: Vec<&str> = TARGETS.iter().map(|(n, _)| *n).collect();
            assert_eq!(tested.to_vec(), named);
            for n in named {
                let bin = corpus::root().join("fuzz_targets").join(format!("{n}.rs"));
                assert!(bin.is_file(), "{} is missing", bin.display());
            }
        }
    };
}

targets!(
    kv_wire,
    kvstore_record,
    kvstore_segment,
    kvstore_recovery,
    sequence_export,
    router_generate,
    router_completion,
    router_chat,
    safetensors,
    model_config,
);

/// The committed seeds are what the encoders make now (so a format change that the
/// seeds no longer exercise is noticed); `SLUICE_FUZZ_WRITE_SEEDS=1` rewrites them.
#[test]
fn seed_corpus_is_current() {
    let write = std::env::var_os("SLUICE_FUZZ_WRITE_SEEDS").is_some();
    for (name, _) in TARGETS {
        let dir = corpus::corpus_dir(name);
        for (file, bytes) in seeds::seeds(name) {
            let path = dir.join(&file);
            if write {
                std::fs::create_dir_all(&dir).expect("corpus dir");
                std::fs::write(&path, &bytes).expect("write seed");
            }
            let committed = std::fs::read(&path).unwrap_or_default();
            assert!(committed == bytes, "{} differs from its encoder's output", Path::new(&path).display());
        }
    }
}
