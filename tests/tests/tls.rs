//! Transport security end to end: a real cluster (router, prefill and decode workers, a
//! kvstore) started with TLS certificates made here by rcgen and API keys on the router.
//! Keyed clients are served over TLS on both APIs; clients without a key, plaintext
//! clients and clients without a cluster certificate on internal ports are refused; a
//! commit whose checksum or lease does not match is refused and counted; a certificate
//! replaced on disk is served after the reload, without a restart.

use std::path::Path;
use std::time::{Duration, Instant};

use cluster::tls::generate::{Ca, Issued, local_names};
use cluster::tls::{ClientTls, Dialer, fingerprint};
use sluice_e2e::{KvSpec, Spec, TestCluster, http_with, ids_request, prompt};
use sluice_proto::v1 as pb;
use sluice_proto::v1::decode_client::DecodeClient;
use sluice_proto::v1::generation_client::GenerationClient;
use sluice_proto::v1::kv_store_client::KvStoreClient;
use tonic::Code;

const KEY: &str = "sk-tls-test-0123456789";
/// Bound on every single call of this test (a refused handshake must fail, not hang).
const CALL: Duration = Duration::from_secs(20);

fn host_port(url: &str) -> (String, u16) {
    let rest = url.trim_start_matches("https://").trim_start_matches("http://");
    let authority = rest.split('/').next().expect("an authority");
    let (h, p) = authority.rsplit_once(':').expect("host:port");
    (h.to_string(), p.parse().expect("a port"))
}

/// The fingerprint of the certificate a TLS port serves.
async fn served(client: &ClientTls, url: &str) -> String {
    let (host, port) = host_port(url);
    let stream = tokio::time::timeout(CALL, client.connect(&host, port, false))
        .await
        .expect("handshake in time")
        .unwrap_or_else(|e| panic!("TLS handshake with {url}: {e}"));
    let certs = stream.get_ref().1.peer_certificates().expect("the server sent its certificate");
    fingerprint(&certs[0])
}

fn keyed<T>(msg: T, key: &str) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    r.metadata_mut().insert("authorization", format!("Bearer {key}").parse().unwrap());
    r
}

async fn generate(
    client: &mut GenerationClient<tonic::transport::Channel>,
    key: Option<&str>,
) -> Result<usize, tonic::Status> {
    let req = ids_request(prompt(40, 7, 300), 4);
    let req = match key {
        Some(k) => keyed(req, k),
        None => tonic::Request::new(req),
    };
    let fut = async {
        let mut stream = client.generate(req).await?.into_inner();
        let mut tokens = 0;
        while let Some(ev) = stream.message().await? {
            match ev.event {
                Some(pb::generate_event::Event::Token(_)) => tokens += 1,
                Some(pb::generate_event::Event::Final(_)) => return Ok(tokens),
                None => {}
            }
        }
        Err(tonic::Status::unknown("no final event"))
    };
    tokio::time::timeout(CALL, fut).await.unwrap_or_else(|_| Err(tonic::Status::deadline_exceeded("test bound")))
}

fn metric(text: &str, series: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse::<f64>().ok())
        .unwrap_or_else(|| panic!("no {series} in:\n{text}")) as u64
}

fn write_keys(dir: &Path) -> std::path::PathBuf {
    let path = dir.join("api-keys");
    std::fs::write(&path, format!("# test keys\n{KEY}\n")).unwrap();
    path
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_tls_cluster_serves_keyed_clients_and_refuses_everyone_else() {
    let files = tempfile::tempdir().unwrap();
    let ca = Ca::new("sluice e2e CA").unwrap();
    let first = ca.issue(&local_names()).unwrap();
    let tls_dir = files.path().join("tls");
    first.write(&tls_dir, &ca).unwrap();
    let keys = write_keys(files.path());
    let spec = Spec {
        tls: Some(tls_dir.clone()),
        router_args: vec!["--api-keys-file".into(), keys.display().to_string()],
        extra_env: vec![("SLUICE_TLS_RELOAD_MS".into(), "200".into())],
        kvstore: Some(KvSpec { args: vec!["--put-lease-ms".into(), "300".into()], ..KvSpec::policy("periodic:1024") }),
        ..Spec::new(1, 1)
    };
    let c = TestCluster::start(spec).await;
    assert!(c.grpc.starts_with("https://"), "{}", c.grpc);
    let decode_url = c.worker_url("decode-0");
    let kv_url = c.kvstore_url.clone().expect("a kvstore");

    // gRPC over TLS: served with a key, UNAUTHENTICATED without one or with a wrong one.
    let mut client = c.client().await;
    assert!(generate(&mut client, Some(KEY)).await.expect("a keyed request is served") > 0);
    for key in [None, Some("sk-wrong")] {
        let e = generate(&mut client, key).await.expect_err("refused");
        assert_eq!(e.code(), Code::Unauthenticated, "{key:?}: {e:?}");
        assert!(!e.message().contains(KEY), "keys are never echoed");
    }

    // HTTP over TLS: the same keys; 401 otherwise; /health stays open for probes.
    let body = r#"{"prompt": [5, 6, 7, 8], "max_tokens": 3}"#;
    let auth = format!("Bearer {KEY}");
    let (status, text) =
        http_with(&c.dialer, &c.http, "POST", "/v1/completions", Some(body), &[("authorization", &auth)])
            .await
            .unwrap();
    assert_eq!(status, 200, "{text}");
    for headers in [vec![], vec![("authorization", "Bearer sk-wrong")]] {
        let (status, text) =
            http_with(&c.dialer, &c.http, "POST", "/v1/completions", Some(body), &headers).await.unwrap();
        assert_eq!(status, 401, "{headers:?}: {text}");
    }
    assert_eq!(c.http_get("/health").await.unwrap().0, 200);
    let router_metrics = c.scrape("router").await;
    assert!(metric(&router_metrics, r#"sluice_requests_total{status="unauthenticated"}"#) >= 4, "{router_metrics}");

    // Plaintext clients get nowhere on TLS ports.
    let plain = Dialer::plaintext();
    for url in [&c.grpc, &decode_url, &kv_url] {
        let attempt = async {
            let ch = plain.channel(url).await?;
            let mut h = tonic_health::pb::health_client::HealthClient::new(ch);
            h.check(tonic_health::pb::HealthCheckRequest::default()).await.map_err(|e| e.to_string())
        };
        let r = tokio::time::timeout(CALL, attempt).await.expect("bounded");
        assert!(r.is_err(), "a plaintext gRPC client was answered by {url}");
    }
    let r = sluice_e2e::http(&c.http, "GET", "/health", None).await;
    assert!(r.is_err(), "a plaintext HTTP client was answered: {r:?}");

    // Internal ports take only peers with a certificate of the cluster CA: a client that
    // trusts the CA but has no certificate, or one of another CA, is refused at the
    // handshake; the harness's client (the service certificate) is served.
    let ca_file = tls_dir.join("ca.crt");
    let anonymous = Dialer::tls(ClientTls::trusting(&ca_file, None).unwrap());
    let stranger_dir = files.path().join("stranger");
    let other_ca = Ca::new("another CA").unwrap();
    other_ca.issue(&local_names()).unwrap().write(&stranger_dir, &other_ca).unwrap();
    let mut stranger_files = cluster::tls::Paths::in_dir(&stranger_dir);
    stranger_files.ca = ca_file.clone(); // it trusts our CA, but is signed by another
    let stranger_live = cluster::tls::Live::load(stranger_files).unwrap();
    let stranger = Dialer::tls(ClientTls::with_identity(&stranger_live, None).unwrap());
    let reserve =
        || pb::ReserveRequest { request_id: "tls-test".into(), prompt_tokens: 8, max_tokens: 4, ..Default::default() };
    for (who, dialer) in [("no certificate", &anonymous), ("another CA's certificate", &stranger)] {
        let r = tokio::time::timeout(CALL, async {
            let ch = dialer.channel(&decode_url).await?;
            DecodeClient::new(ch).reserve(reserve()).await.map_err(|e| e.to_string())
        })
        .await
        .expect("bounded");
        assert!(r.is_err(), "a decode worker reserved pages for a client with {who}");
        let r = tokio::time::timeout(CALL, async {
            let ch = dialer.channel(&kv_url).await?;
            KvStoreClient::new(ch)
                .delete(pb::DeleteRequest { keys: vec![], all: true })
                .await
                .map_err(|e| e.to_string())
        })
        .await
        .expect("bounded");
        assert!(r.is_err(), "the kvstore deleted for a client with {who}");
    }
    // The router's public port asks for no certificate: the anonymous client is served.
    let mut anon_router = GenerationClient::new(anonymous.channel(&c.grpc).await.unwrap());
    assert!(generate(&mut anon_router, Some(KEY)).await.expect("served without a client certificate") > 0);

    // A commit whose checksums do not match what landed is refused and counted; the
    // reservation is gone, so committing it again is refused for its lease.
    let mut decode = c.decode_client("decode-0").await;
    let r = decode.reserve(reserve()).await.expect("a cluster peer may reserve").into_inner();
    let commit = pb::CommitRequest {
        reservation_id: r.reservation_id.clone(),
        tokens: 8,
        page_checksums: vec![1],
        rings_checksum: 2,
        comp_checksum: 3,
        logits_checksum: 4,
    };
    let e = decode.commit(commit.clone()).await.expect_err("bytes that never landed");
    assert_eq!(e.code(), Code::DataLoss, "{e:?}");
    let e = decode.commit(commit).await.expect_err("no such reservation any more");
    assert_eq!(e.code(), Code::NotFound, "{e:?}");
    let text = c.scrape("decode-0").await;
    assert_eq!(metric(&text, r#"sluice_kv_commits_refused_total{reason="checksum"}"#), 1, "{text}");
    assert_eq!(metric(&text, r#"sluice_kv_commits_refused_total{reason="lease"}"#), 1, "{text}");

    // The same at the kvstore: a put whose checksum does not match is not stored, nor is
    // one committed after its lease (300 ms here).
    let mut kv = c.kvstore_client().await;
    let offer = |k: u8| pb::BeginPutRequest {
        records: vec![pb::PutRecord {
            key: vec![k; 32],
            kind: pb::RecordKind::Page as i32,
            len: 4096,
            pools: Some(pb::PoolBytes { hca: 4096, ..Default::default() }),
            ..Default::default()
        }],
    };
    let put = kv.begin_put(offer(1)).await.expect("begin put").into_inner();
    assert_eq!(put.accepted, vec![true], "{put:?}");
    let done =
        kv.commit_put(pb::CommitPutRequest { put_id: put.put_id, checksums: vec![42] }).await.unwrap().into_inner();
    assert_eq!((done.stored, done.rejected), (0, 1));
    let late = kv.begin_put(offer(2)).await.expect("begin put").into_inner();
    assert_eq!(late.accepted, vec![true], "{late:?}");
    tokio::time::sleep(Duration::from_millis(600)).await;
    let e =
        kv.commit_put(pb::CommitPutRequest { put_id: late.put_id, checksums: vec![0] }).await.expect_err("lease over");
    assert_eq!(e.code(), Code::NotFound, "{e:?}");
    let text = c.scrape("kvstore").await;
    assert_eq!(metric(&text, r#"sluice_kvstore_put_dropped_total{reason="checksum"}"#), 1, "{text}");
    assert_eq!(metric(&text, r#"sluice_kvstore_put_dropped_total{reason="lease"}"#), 1, "{text}");
    assert_eq!(c.kvstore_stats().await.pages, 0, "nothing refused was stored");

    // A certificate replaced on disk is served after the reload, on every port, and the
    // services keep talking to each other with it.
    let probe =
        ClientTls::with_identity(&cluster::tls::Live::load(cluster::tls::Paths::in_dir(&tls_dir)).unwrap(), None)
            .unwrap();
    let ports = [c.grpc.clone(), decode_url.clone(), kv_url.clone(), c.metrics_url("decode-0")];
    for url in &ports {
        assert_eq!(served(&probe, url).await, first.fingerprint(), "{url} before the renewal");
    }
    let renewed: Issued = ca.issue(&local_names()).unwrap();
    assert_ne!(renewed.fingerprint(), first.fingerprint());
    renewed.write(&tls_dir, &ca).unwrap();
    let deadline = Instant::now() + Duration::from_secs(15);
    for url in &ports {
        loop {
            let now = served(&probe, url).await;
            if now == renewed.fingerprint() {
                break;
            }
            assert!(Instant::now() < deadline, "{url} still serves {now} after the files changed");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let mut client = GenerationClient::new(c.dialer.channel(&c.grpc).await.unwrap());
    assert!(generate(&mut client, Some(KEY)).await.expect("served after the renewal") > 0);
}

/// Plaintext on a non-loopback address is refused with a message that says what to change,
/// unless it is asked for.
#[test]
fn plaintext_off_loopback_needs_tls_or_an_explicit_opt_out() {
    let dir = tempfile::tempdir().unwrap();
    let model = sluice_e2e::write_model(dir.path());
    let bin = cluster::launch::find_binary("router").expect("router binary (cargo build --workspace --bins)");
    let run = |extra: &[&str]| {
        std::process::Command::new(&bin)
            .env_clear()
            .args([
                "--model",
                &model.display().to_string(),
                "--peers",
                "prefill=http://127.0.0.1:1,decode=http://127.0.0.1:2",
            ])
            .args(extra)
            .arg("--check-config")
            .output()
            .expect("router runs")
    };
    let out = run(&["--listen", "0.0.0.0:50051"]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--listen 0.0.0.0:50051") && err.contains("--tls-dir") && err.contains("--insecure-plaintext"),
        "{err}"
    );
    assert!(run(&["--listen", "0.0.0.0:50051", "--insecure-plaintext"]).status.success());
    assert!(run(&["--listen", "0.0.0.0:50051", "--tls-dir", "/etc/sluice/tls"]).status.success());
    assert!(run(&[]).status.success(), "loopback defaults need nothing");
}
