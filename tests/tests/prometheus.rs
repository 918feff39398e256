//! The dashboards and alerts against a real Prometheus server (Debian's `prometheus`):
//! it scrapes a local cluster (router, prefill and decode workers, kvstore) under a
//! bounded load and evaluates deploy/prometheus/alerts.yaml; then every dashboard panel
//! query and every alert expression must return data, and the prefix-cache hit-rate
//! panel must move when shared-prefix traffic starts.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use serde_json::Value;
use sluice_e2e::deploy_files::{panels, root as repo};
use sluice_e2e::pytools::pytools;
use sluice_e2e::{KvSpec, Spec, TestCluster, http, ids_request, prompt};

const VOCAB: u32 = 320;
/// Scrape and rule evaluation interval.
const INTERVAL: &str = "1s";
/// What `$__rate_interval` stands for: a few scrape intervals.
const RATE_WINDOW: &str = "15s";

fn find(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|p| std::env::split_paths(&p).map(|d| d.join(name)).find(|p| p.is_file()))
}

/// Percent-encode a query for a URL.
fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

struct Prometheus {
    addr: String,
    child: tokio::process::Child,
    _dir: tempfile::TempDir,
}

impl Prometheus {
    async fn start(bin: &PathBuf, targets: &[(&str, String)]) -> Prometheus {
        let dir = tempfile::tempdir().unwrap();
        std::fs::copy(repo().join("deploy/prometheus/alerts.yaml"), dir.path().join("alerts.yaml")).unwrap();
        let mut config = format!(
            "global:\n  scrape_interval: {INTERVAL}\n  evaluation_interval: {INTERVAL}\nrule_files: [alerts.yaml]\nscrape_configs:\n"
        );
        for (job, url) in targets {
            let rest = url.trim_start_matches("http://");
            let (hostport, path) = rest.split_at(rest.find('/').unwrap());
            config.push_str(&format!(
                "  - job_name: {job}\n    metrics_path: {path}\n    static_configs:\n      - targets: ['{hostport}']\n"
            ));
        }
        std::fs::write(dir.path().join("prometheus.yml"), config).unwrap();
        let port = cluster::launch::free_port();
        let addr = format!("127.0.0.1:{port}");
        let log = std::fs::File::create(dir.path().join("prometheus.log")).unwrap();
        let child = tokio::process::Command::new(bin)
            .arg(format!("--config.file={}", dir.path().join("prometheus.yml").display()))
            .arg(format!("--storage.tsdb.path={}", dir.path().join("data").display()))
            .arg(format!("--web.listen-address={addr}"))
            .arg("--log.level=warn")
            .stdout(Stdio::null())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .expect("start prometheus");
        let p = Prometheus { addr, child, _dir: dir };
        let deadline = Instant::now() + Duration::from_secs(60);
        while !matches!(http(&p.addr, "GET", "/-/ready", None).await, Ok((200, _))) {
            assert!(Instant::now() < deadline, "prometheus not ready: {}", p.log());
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        p
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self._dir.path().join("prometheus.log")).unwrap_or_default()
    }

    /// An instant query's result vector.
    async fn query(&self, q: &str) -> Vec<Value> {
        let (status, body) = http(&self.addr, "GET", &format!("/api/v1/query?query={}", encode(q)), None)
            .await
            .unwrap_or_else(|e| panic!("query {q}: {e}"));
        assert_eq!(status, 200, "query {q}: {body}");
        let v: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["status"], "success", "{q}: {v}");
        v["data"]["result"].as_array().cloned().unwrap_or_default()
    }

    /// The first sample's value of a query (NaN when there is none).
    async fn value(&self, q: &str) -> f64 {
        self.query(q).await.first().and_then(|r| r["value"][1].as_str()?.parse().ok()).unwrap_or(f64::NAN)
    }

    /// Wait (bounded) until every target has been scraped up.
    async fn wait_up(&self, targets: usize) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let up = self.query("up == 1").await.len();
            if up == targets {
                return;
            }
            assert!(Instant::now() < deadline, "{up} of {targets} targets up: {}", self.log());
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
}

/// A panel query as Grafana would send it, with its variables filled in.
fn fill(expr: &str) -> String {
    expr.replace("$__rate_interval", RATE_WINDOW).replace("$job", ".*").replace("$instance", ".*")
}

/// An alert expression with every comparison made a `bool` one, so it returns its
/// series (0 or 1) whether or not the alert would fire.
fn unfiltered(expr: &str) -> String {
    let (b, mut out, mut depth, mut quoted, mut i) = (expr.as_bytes(), String::new(), 0, false, 0);
    while i < b.len() {
        let c = b[i] as char;
        match c {
            '"' => quoted = !quoted,
            '{' if !quoted => depth += 1,
            '}' if !quoted => depth -= 1,
            _ => {}
        }
        let two = expr.get(i..i + 2).unwrap_or("");
        let op = if quoted || depth > 0 {
            None
        } else if ["==", "!=", ">=", "<="].contains(&two) {
            Some(two)
        } else if (c == '>' || c == '<') && !two.ends_with('=') {
            Some(&expr[i..i + 1])
        } else {
            None
        };
        match op {
            Some(op) => {
                out.push_str(op);
                out.push_str(" bool");
                i += op.len();
            }
            None => {
                out.push(c);
                i += 1;
            }
        }
    }
    out
}

#[test]
fn comparisons_become_bool_outside_selectors() {
    assert_eq!(unfiltered(r#"a{le="2.5"} > 0.95"#), r#"a{le="2.5"} > bool 0.95"#);
    assert_eq!(
        unfiltered(r#"up == 0 and on (job) x{s=~"a|b"} >= 1"#),
        r#"up == bool 0 and on (job) x{s=~"a|b"} >= bool 1"#
    );
    assert_eq!(unfiltered("a < 0.5 * b"), "a < bool 0.5 * b");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_panel_and_alert_returns_data_from_a_real_prometheus() {
    let Some(bin) = find("prometheus") else {
        eprintln!("prometheus not found (apt-get install prometheus): the dashboard and alerts are not evaluated");
        return;
    };
    let c = TestCluster::start(Spec { kvstore: Some(KvSpec::policy("full")), ..Spec::new(1, 1) }).await;
    let targets = [
        ("sluice-router", c.metrics_url("router")),
        ("sluice-prefill", c.metrics_url("prefill-0")),
        ("sluice-decode", c.metrics_url("decode-0")),
        ("sluice-kvstore", c.metrics_url("kvstore")),
    ];
    let prom = Prometheus::start(&bin, &targets).await;
    prom.wait_up(targets.len()).await;
    let hit_rate = "sum(rate(sluice_prefix_cache_hit_tokens_total{pool=\"csa_main\"}[10s])) / sum(rate(sluice_prefix_cache_query_tokens_total{pool=\"csa_main\"}[10s]))";

    // Bounded load without shared prefixes: every prompt is new, nothing hits.
    for i in 0..6u32 {
        c.generate(ids_request(prompt(300, 1000 + i, VOCAB), 4)).await.expect("a request");
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    let before = prom.value(hit_rate).await;
    assert_eq!(before, 0.0, "no shared prefixes, no hits: {}", prom.log());

    // Shared-prefix traffic: one 640-token prefix, different endings.
    let shared = prompt(640, 7, VOCAB);
    let ask = |i: u32| {
        let mut p = shared.clone();
        p.extend(prompt(40, 2000 + i, VOCAB));
        ids_request(p, 4)
    };
    // The first one stores the prefix's 5 blocks of 128 tokens, each with a snapshot
    // (policy `full`): wait for those on top of the 6 prompts' 2 blocks each (waiting for
    // 5 of each in all returned at once and raced the puts).
    let stored = c.wait_kvstore(12, 12).await;
    c.generate(ask(0)).await.expect("the first shared-prefix request");
    c.wait_kvstore(stored.pages + 5, stored.snapshots + 5).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut i = 1;
    let after = loop {
        let g = c.generate(ask(i)).await.expect("a shared-prefix request");
        assert!(g.fin.usage.unwrap().cached_tokens > 0, "request {i} hits");
        i += 1;
        let v = prom.value(hit_rate).await;
        if v > 0.5 || Instant::now() > deadline {
            break v;
        }
    };
    assert!(after > 0.5, "the hit-rate panel's query moved from {before} to only {after}");

    // Every panel query returns data.
    let dash: Value =
        serde_json::from_str(&std::fs::read_to_string(repo().join("deploy/grafana/sluice-dashboard.json")).unwrap())
            .unwrap();
    let mut checked = 0;
    for p in panels(&dash).into_iter().filter(|p| p["type"] != "row") {
        for t in p["targets"].as_array().into_iter().flatten() {
            let q = fill(t["expr"].as_str().unwrap());
            let result = prom.query(&q).await;
            assert!(!result.is_empty(), "panel {:?}: no data for {q}", p["title"]);
            checked += 1;
        }
    }
    assert!(checked >= 40, "{checked} panel queries");

    // Every recording rule has been evaluated, and every alert expression returns its series.
    let rules = pytools().yaml_docs(&repo().join("deploy/prometheus/alerts.yaml"));
    let mut alerts = 0;
    for group in rules[0]["groups"].as_array().unwrap() {
        for r in group["rules"].as_array().unwrap() {
            let expr = r["expr"].as_str().unwrap();
            if let Some(name) = r["record"].as_str() {
                assert!(!prom.query(name).await.is_empty(), "recording rule {name} produced nothing");
                continue;
            }
            let name = r["alert"].as_str().unwrap();
            let q = unfiltered(expr);
            assert!(!prom.query(&q).await.is_empty(), "alert {name}: no data for {q}");
            alerts += 1;
        }
    }
    assert!(alerts >= 10, "{alerts} alerts");
    // Nothing is firing in a healthy cluster (pending or firing alerts would show here).
    let firing: Vec<Value> = prom.query("ALERTS{alertstate=\"firing\"}").await;
    assert!(firing.is_empty(), "alerts firing in a healthy cluster: {firing:?}");
    drop(prom.child);
}
