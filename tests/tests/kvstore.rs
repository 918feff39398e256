//! The shared-prefix kvstore in a real cluster (router, prefill and decode workers,
//! kvstore processes): for every SWA policy a cached prefix reproduces the cold run
//! and `usage.cached_tokens` says what was restored; hits at, before and after block
//! boundaries and prompts that diverge after a shared prefix; two prefill workers
//! putting the same prefix; a store smaller than the working set; restarts and a
//! `kill -9` in the middle of writes; a store that cannot be reached at all; and fp8
//! KV entries (`--kv-dtype fp8`) stored and restored through it.

use std::time::Duration;

use engine::generate::{GenerateRequest, Generation, generate};
use engine::sampling::SamplingParams;
use engine::{CpuBackend, Engine, EngineOptions, EntryDtype};
use model_spec::prefix::{RestoreInput, restorable_blocks};
use model_spec::{RestorePlan, SwaPolicy};
use sluice_e2e::{Generated, KvSpec, Spec, TestCluster, ids_request, prompt};

const VOCAB: u32 = 320;
const BLOCK: usize = 128;
/// The tiny preset: 4 layers, a 128-token window.
const LAYERS: usize = 4;
const MAX_TOKENS: usize = 8;
/// Restored prefixes compute the rest of the prompt in other batch shapes than a cold
/// prefill, so logprobs agree to rounding, not bit for bit.
const LOGPROB_TOL: f32 = 2e-3;

fn local_engine(c: &TestCluster) -> Engine<CpuBackend> {
    local_engine_with(c, EntryDtype::Bf16)
}

fn local_engine_with(c: &TestCluster, kv_dtype: EntryDtype) -> Engine<CpuBackend> {
    let opts = EngineOptions { kv_dtype, max_pages: 64, max_sequences: 2, max_chunk_tokens: 2048 };
    Engine::load(&c.model, CpuBackend::new(), opts).expect("load model in-process")
}

fn cold(engine: &mut Engine<CpuBackend>, prompt: &[u32]) -> Generation {
    let req = GenerateRequest {
        prompt: prompt.to_vec(),
        max_tokens: MAX_TOKENS,
        sampling: SamplingParams::default(),
        stop_tokens: vec![],
    };
    tokio::task::block_in_place(|| generate(engine, &req, |_| {})).expect("in-process generation")
}

/// The cluster's answer equals the cold in-process one: same greedy tokens, logprobs
/// within rounding.
fn assert_same(got: &Generated, want: &Generation, what: &str) {
    let ids: Vec<u32> = want.tokens.iter().map(|s| s.token).collect();
    assert_eq!(got.ids(), ids, "{what}: greedy tokens differ from the cold run");
    for (i, (g, w)) in got.logprobs().iter().zip(want.tokens.iter().map(|s| s.logprob)).enumerate() {
        assert!((g - w).abs() <= LOGPROB_TOL, "{what}: logprob {i} is {g}, the cold run's {w}");
    }
}

fn cached(g: &Generated) -> usize {
    g.fin.usage.as_ref().expect("usage").cached_tokens as usize
}

/// What a prefill worker restores of `len` prompt tokens when the store holds the first
/// `stored_blocks` blocks of the prompt, with snapshots where the policy takes them.
fn expected_cached(policy: SwaPolicy, len: usize, stored_blocks: usize) -> usize {
    let n = restorable_blocks(len, BLOCK).min(stored_blocks);
    let snapshots: Vec<usize> = (1..=n).filter(|&k| policy.snapshots_at(k, BLOCK)).collect();
    RestorePlan::choose(&RestoreInput {
        cached_blocks: n,
        snapshots: &snapshots,
        block: BLOCK,
        window: 128,
        layers: LAYERS,
    })
    .cached_tokens
}

fn metric(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series).and_then(|rest| rest.trim().parse().ok()))
        .unwrap_or_else(|| panic!("{series} not exposed"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_swa_policy_reproduces_the_cold_run() {
    let base = prompt(900, 1, VOCAB);
    for policy_text in ["full", "periodic:256", "zero"] {
        let policy: SwaPolicy = policy_text.parse().unwrap();
        let spec = Spec { kvstore: Some(KvSpec::policy(policy_text)), ..Spec::new(1, 1) };
        let c = TestCluster::start(spec).await;
        let mut engine = local_engine(&c);

        // Cold: nothing cached yet.
        let first = c.generate(ids_request(base.clone(), MAX_TOKENS as u32)).await.expect("cold request");
        assert_same(&first, &cold(&mut engine, &base), &format!("{policy_text}: first request"));
        assert_eq!(cached(&first), 0);
        let blocks = base.len() / BLOCK;
        let snapshots = (1..=blocks).filter(|&k| policy.snapshots_at(k, BLOCK)).count() as u64;
        let stats = c.wait_kvstore(blocks as u64, snapshots).await;
        assert_eq!(stats.pages, blocks as u64, "{policy_text}: one page per complete block");
        assert_eq!(stats.snapshots, snapshots, "{policy_text}: snapshots where the policy takes them");

        // The same prompt again, and prompts that end at, before and after a block
        // boundary of it, or share a prefix and then diverge.
        let mut diverged = base[..600].to_vec();
        diverged.extend(prompt(200, 9, VOCAB));
        let cases: Vec<(&str, Vec<u32>, usize)> = vec![
            ("same prompt", base.clone(), blocks),
            ("ends at a block boundary", base[..512].to_vec(), blocks),
            ("ends one token after", base[..513].to_vec(), blocks),
            ("ends one token before", base[..511].to_vec(), blocks),
            ("diverges after 600 tokens", diverged, 600 / BLOCK),
        ];
        for (what, p, shared_blocks) in cases {
            let what = format!("{policy_text}: {what}");
            let got = c.generate(ids_request(p.clone(), MAX_TOKENS as u32)).await.expect("cached request");
            assert_same(&got, &cold(&mut engine, &p), &what);
            let want = expected_cached(policy, p.len(), shared_blocks);
            assert!(want > 0, "{what}: the case must hit");
            assert_eq!(cached(&got), want, "{what}: usage.cached_tokens");
        }

        let m = c.scrape("prefill-0").await;
        assert!(metric(&m, r#"sluice_prefix_cache_hit_tokens_total{pool="csa_main"}"#) > 0.0);
        assert!(metric(&m, "sluice_prefix_cache_put_bytes_total") > 0.0);
        for op in ["lookup", "get", "put"] {
            let errors = metric(&m, &format!(r#"sluice_prefix_cache_errors_total{{op="{op}"}}"#));
            assert_eq!(errors, 0.0, "{policy_text}: {op} errors");
        }
        let swa_hits = metric(&m, r#"sluice_prefix_cache_hit_tokens_total{pool="swa"}"#);
        match policy {
            SwaPolicy::Zero => assert_eq!(swa_hits, 0.0, "zero stores no window state"),
            _ => assert!(swa_hits > 0.0, "{policy_text}: windows restored from snapshots"),
        }
        let recompute =
            metric(&m, &format!(r#"sluice_prefix_cache_recompute_tokens_total{{policy="{}"}}"#, policy.label()));
        match policy {
            SwaPolicy::Full => assert_eq!(recompute, 0.0, "full restores every window directly"),
            _ => assert!(recompute > 0.0, "{policy_text} recomputes"),
        }
        let r = c.scrape("router").await;
        assert!(metric(&r, "sluice_cached_tokens_total") > 0.0);
        let kv = c.scrape("kvstore").await;
        assert!(metric(&kv, "sluice_kvstore_hit_tokens_total") > 0.0);
        assert_eq!(metric(&kv, "sluice_kvstore_corrupt_records_total"), 0.0);
        c.assert_pages_return(Duration::from_secs(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_prefill_workers_putting_one_prefix_store_it_once() {
    let spec = Spec { kvstore: Some(KvSpec::policy("full")), ..Spec::new(2, 1) };
    let c = TestCluster::start(spec).await;
    let mut engine = local_engine(&c);
    let p = prompt(700, 4, VOCAB);
    let want = cold(&mut engine, &p);
    let (a, b) = tokio::join!(
        c.generate(ids_request(p.clone(), MAX_TOKENS as u32)),
        c.generate(ids_request(p.clone(), MAX_TOKENS as u32))
    );
    assert_same(&a.expect("first"), &want, "first of two");
    assert_same(&b.expect("second"), &want, "second of two");
    let blocks = (p.len() / BLOCK) as u64;
    let stats = c.wait_kvstore(blocks, blocks).await;
    assert_eq!((stats.pages, stats.snapshots), (blocks, blocks), "stored once");
    assert_eq!(stats.dropped_puts, 0);
    let again = c.generate(ids_request(p.clone(), MAX_TOKENS as u32)).await.expect("third");
    assert_same(&again, &want, "after both puts");
    assert_eq!(cached(&again), expected_cached(SwaPolicy::Full, p.len(), blocks as usize));
    c.assert_pages_return(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_smaller_than_the_working_set_evicts_and_stays_within_capacity() {
    let capacity: u64 = 2 << 20;
    let kv = KvSpec {
        policy: "full".into(),
        args: vec!["--capacity".into(), capacity.to_string(), "--segment-bytes".into(), "256KiB".into()],
        url: None,
        dir: None,
    };
    let c = TestCluster::start(Spec { kvstore: Some(kv), ..Spec::new(1, 1) }).await;
    let mut engine = local_engine(&c);
    let prompts: Vec<Vec<u32>> = (0..16).map(|i| prompt(900, 100 + i, VOCAB)).collect();
    let wants: Vec<Generation> = prompts.iter().map(|p| cold(&mut engine, p)).collect();
    // Bytes on disk now. The store may delete an evicted segment between the listing and
    // its stat: a file gone by then holds nothing.
    let disk = |c: &TestCluster| -> u64 {
        std::fs::read_dir(&c.kvstore_dir)
            .unwrap()
            .map(|e| match e.unwrap().metadata() {
                Ok(m) => m.len(),
                Err(err) if err.kind() == std::io::ErrorKind::NotFound => 0,
                Err(err) => panic!("stat of a kvstore file: {err}"),
            })
            .sum()
    };
    // Two rounds, two requests at a time: the second round reads while the store evicts.
    for round in 0..2 {
        for pair in (0..prompts.len()).collect::<Vec<_>>().chunks(2) {
            let (a, b) = tokio::join!(
                c.generate(ids_request(prompts[pair[0]].clone(), MAX_TOKENS as u32)),
                c.generate(ids_request(prompts[pair[1]].clone(), MAX_TOKENS as u32))
            );
            assert_same(&a.expect("request"), &wants[pair[0]], &format!("round {round}, prompt {}", pair[0]));
            assert_same(&b.expect("request"), &wants[pair[1]], &format!("round {round}, prompt {}", pair[1]));
            let used = disk(&c);
            assert!(used <= capacity, "{used} bytes on disk, capacity {capacity}");
        }
    }
    let stats = c.wait_kvstore(1, 0).await;
    assert!(stats.evictions > 0, "the working set (~6 MB) is three times the capacity: {stats:?}");
    assert!(stats.disk_bytes <= capacity);
    // Snapshots go before pages: the most recent prompt keeps its pages longest.
    let last = c.generate(ids_request(prompts[15].clone(), MAX_TOKENS as u32)).await.expect("request");
    assert_same(&last, &wants[15], "most recent prompt");
    c.assert_pages_return(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_keeps_its_data_across_restarts_and_survives_a_crash_mid_write() {
    let mut c = TestCluster::start(Spec { kvstore: Some(KvSpec::policy("periodic:256")), ..Spec::new(1, 1) }).await;
    let mut engine = local_engine(&c);
    let a = prompt(800, 21, VOCAB);
    let want_a = cold(&mut engine, &a);
    assert_same(&c.generate(ids_request(a.clone(), MAX_TOKENS as u32)).await.unwrap(), &want_a, "cold");
    c.wait_kvstore(6, 3).await;

    // A clean restart keeps everything.
    c.stop_kvstore(false).await;
    c.start_kvstore().await;
    let stats = c.kvstore_stats().await;
    assert_eq!((stats.pages, stats.snapshots), (6, 3), "recovered from disk");
    let hit = c.generate(ids_request(a.clone(), MAX_TOKENS as u32)).await.unwrap();
    assert_same(&hit, &want_a, "after a restart");
    assert_eq!(cached(&hit), expected_cached(SwaPolicy::Periodic { tokens: 256 }, a.len(), 6));

    // A crash while a stream of prompts is being written: requests keep succeeding
    // (cold once the store is gone), and after a restart whatever the store serves
    // passes its checksums and reproduces the cold results.
    let prompts: Vec<Vec<u32>> = (0..12).map(|i| prompt(700 + 13 * i as usize, 200 + i, VOCAB)).collect();
    let wants: Vec<Generation> = prompts.iter().map(|p| cold(&mut engine, p)).collect();
    let mut served = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        if i == 6 {
            c.stop_kvstore(true).await;
        }
        let g = c.generate(ids_request(p.clone(), MAX_TOKENS as u32)).await.expect("requests survive the crash");
        assert_same(&g, &wants[i], &format!("prompt {i} around the crash"));
        served.push(g);
    }
    c.start_kvstore().await;
    let mut hits = 0;
    for (i, p) in prompts.iter().enumerate() {
        let g = c.generate(ids_request(p.clone(), MAX_TOKENS as u32)).await.expect("after the crash");
        assert_same(&g, &wants[i], &format!("prompt {i} after the crash"));
        hits += usize::from(cached(&g) > 0);
    }
    assert!(hits >= 1, "prompts written before the crash are served from the store");
    let kv = c.scrape(&c.kvstore.as_ref().unwrap().name.clone()).await;
    assert_eq!(metric(&kv, "sluice_kvstore_corrupt_records_total"), 0.0, "nothing damaged was served");
    let p = c.scrape("prefill-0").await;
    assert!(metric(&p, r#"sluice_prefix_cache_errors_total{op="lookup"}"#) > 0.0, "the outage was counted");
    c.assert_pages_return(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_store_means_cold_prompts_and_counted_misses() {
    let dead = format!("http://127.0.0.1:{}", cluster::launch::free_port());
    let kv = KvSpec { policy: "full".into(), args: vec![], url: Some(dead), dir: None };
    let c = TestCluster::start(Spec { kvstore: Some(kv), ..Spec::new(1, 1) }).await;
    let mut engine = local_engine(&c);
    for (len, salt) in [(300usize, 1u32), (300, 1), (600, 2)] {
        let p = prompt(len, salt, VOCAB);
        let g = c.generate(ids_request(p.clone(), MAX_TOKENS as u32)).await.expect("served cold");
        assert_same(&g, &cold(&mut engine, &p), &format!("prompt {len}/{salt}"));
        assert_eq!(cached(&g), 0);
    }
    let m = c.scrape("prefill-0").await;
    assert!(metric(&m, r#"sluice_prefix_cache_errors_total{op="lookup"}"#) >= 3.0);
    assert_eq!(metric(&m, r#"sluice_prefix_cache_hit_tokens_total{pool="csa_main"}"#), 0.0);
    assert_eq!(metric(&m, r#"sluice_prefix_cache_query_tokens_total{pool="csa_main"}"#), 1200.0);
    c.assert_pages_return(Duration::from_secs(5)).await;
}

/// fp8 KV entries end to end: workers storing fp8 records put pages and snapshots into
/// the store, and a later prompt restored from them (a snapshot plus recomputed gap
/// under `periodic`) reproduces the cold fp8 run of an in-process engine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fp8_kv_entries_round_trip_through_the_store() {
    let fp8 = vec!["--kv-dtype".to_string(), "fp8".to_string()];
    let spec = Spec {
        kvstore: Some(KvSpec::policy("periodic:256")),
        prefill_args: vec![fp8.clone()],
        decode_args: fp8,
        ..Spec::new(1, 1)
    };
    let c = TestCluster::start(spec).await;
    let mut engine = local_engine_with(&c, EntryDtype::Fp8);
    let policy: SwaPolicy = "periodic:256".parse().unwrap();
    let base = prompt(700, 4, VOCAB);
    let first = c.generate(ids_request(base.clone(), MAX_TOKENS as u32)).await.expect("cold request");
    assert_same(&first, &cold(&mut engine, &base), "fp8: first request");
    let blocks = base.len() / BLOCK;
    let snapshots = (1..=blocks).filter(|&k| policy.snapshots_at(k, BLOCK)).count() as u64;
    assert!(snapshots > 0, "the prompt spans a periodic snapshot");
    let stats = c.wait_kvstore(blocks as u64, snapshots).await;
    assert_eq!((stats.pages, stats.snapshots), (blocks as u64, snapshots), "fp8: pages and periodic snapshots stored");
    for (what, p) in [("same prompt", base.clone()), ("ends one token after a boundary", base[..641].to_vec())] {
        let got = c.generate(ids_request(p.clone(), MAX_TOKENS as u32)).await.expect("cached request");
        assert_same(&got, &cold(&mut engine, &p), &format!("fp8: {what}"));
        assert_eq!(cached(&got), expected_cached(policy, p.len(), blocks), "fp8 {what}: usage.cached_tokens");
    }
    let kv = c.scrape("kvstore").await;
    assert!(metric(&kv, "sluice_kvstore_hit_tokens_total") > 0.0);
    assert_eq!(metric(&kv, "sluice_kvstore_corrupt_records_total"), 0.0);
    c.assert_pages_return(Duration::from_secs(5)).await;
}
