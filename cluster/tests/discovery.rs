//! Discovery against a real etcd: registration, watching, crash and shutdown semantics, and an
//! etcd outage with restart. Every wait is bounded; timings are printed (run with --nocapture).

use std::future::Future;
use std::time::{Duration, Instant};

use cluster::discovery::{self, EtcdConfig, Member, Membership, Registration, Role};
use cluster::testing::{EtcdServer, free_port};

const TTL: Duration = Duration::from_secs(2);
const DIAL: Duration = Duration::from_secs(1);

fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
}

fn config(etcd: &EtcdServer, cluster: &str) -> EtcdConfig {
    EtcdConfig {
        lease_ttl: TTL,
        dial_timeout: DIAL,
        ..EtcdConfig::new(etcd.endpoints(), EtcdConfig::members_prefix(cluster))
    }
}

fn member(id: &str, role: Role, pages: u64) -> Member {
    Member {
        id: id.to_owned(),
        role,
        grpc_addr: format!("http://127.0.0.1:{}", 5000 + pages),
        ucx_address: Some("dWN4LWFkZHJlc3M=".to_owned()),
        model: "deepseek-v4-tiny".to_owned(),
        fingerprint: "0123abcd".to_owned(),
        capacity: serde_json::json!({ "pages": pages, "batch": 8 }),
    }
}

fn ids(members: &[Member]) -> Vec<&str> {
    members.iter().map(|m| m.id.as_str()).collect()
}

fn has(members: &[Member], id: &str) -> bool {
    members.iter().any(|m| m.id == id)
}

async fn within<T>(limit: Duration, what: &str, work: impl Future<Output = T>) -> T {
    tokio::time::timeout(limit, work).await.unwrap_or_else(|_| panic!("timed out after {limit:?} waiting for {what}"))
}

/// Waits (bounded) until `view` satisfies `pred`; returns how long that took.
async fn wait_view(
    view: &mut Membership,
    limit: Duration,
    what: &str,
    pred: impl FnMut(&[Member]) -> bool,
) -> Duration {
    let start = Instant::now();
    within(limit, what, view.wait_for(pred)).await.expect("membership source alive");
    start.elapsed()
}

/// Polls `check` every 20 ms until it holds; returns how long that took.
async fn poll(limit: Duration, what: &str, mut check: impl FnMut() -> bool) -> Duration {
    let start = Instant::now();
    within(limit, what, async {
        while !check() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    start.elapsed()
}

async fn raw_client(etcd: &EtcdServer) -> etcd_client::Client {
    etcd_client::Client::connect(etcd.endpoints(), None).await.expect("etcd client")
}

/// The lease the key is attached to in etcd, if the key exists.
async fn lease_of(etcd: &EtcdServer, key: &str) -> Option<i64> {
    let response = raw_client(etcd).await.get(key, None).await.expect("etcd get");
    response.kvs().first().map(|kv| kv.lease())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registrations_appear_in_the_watch_and_updates_are_visible() {
    init_tracing();
    let etcd = EtcdServer::start();
    let cfg = config(&etcd, "visible");
    let mut view = discovery::watch(cfg.clone()).await.expect("watch");
    assert!(view.current().is_empty());

    let prefill = Registration::start(cfg.clone(), member("prefill-1", Role::Prefill, 100)).await.expect("register");
    let decode = Registration::start(cfg.clone(), member("decode-1", Role::Decode, 200)).await.expect("register");
    assert_eq!(prefill.key(), "/sluice/visible/members/prefill-1");
    assert!(prefill.lease_id().is_some());
    wait_view(&mut view, Duration::from_secs(5), "both members", |m| m.len() == 2).await;
    assert_eq!(ids(&view.current()), ["decode-1", "prefill-1"], "members come in id order");
    assert_eq!(view.of_role(Role::Prefill), [member("prefill-1", Role::Prefill, 100)]);
    assert_eq!(view.of_role(Role::Decode), [member("decode-1", Role::Decode, 200)]);
    assert!(view.of_role(Role::Kvstore).is_empty());
    assert_eq!(view.get("decode-1").map(|m| m.capacity["pages"].clone()), Some(200.into()));

    // Entries that are not members are not placed; the update put after it proves it was seen.
    raw_client(&etcd).await.put("/sluice/visible/members/junk", "not json", None).await.expect("put junk");
    decode.update(member("decode-1", Role::Decode, 150));
    wait_view(&mut view, Duration::from_secs(5), "the new capacity", |m| {
        m.iter().any(|m| m.id == "decode-1" && m.capacity["pages"] == 150)
    })
    .await;
    assert_eq!(ids(&view.current()), ["decode-1", "prefill-1"]);
    assert_eq!(decode.member().capacity["pages"], 150);

    // The id of a registration is fixed: a renamed update keeps the registered key.
    prefill.update(member("renamed", Role::Prefill, 101));
    wait_view(&mut view, Duration::from_secs(5), "the prefill update", |m| {
        m.iter().any(|m| m.id == "prefill-1" && m.capacity["pages"] == 101)
    })
    .await;
    assert!(!has(&view.current(), "renamed"));

    // A watcher started later lists what is already there; another cluster's prefix sees nothing.
    let late = discovery::watch(cfg.clone()).await.expect("watch");
    assert_eq!(ids(&late.current()), ["decode-1", "prefill-1"]);
    let other = discovery::watch(config(&etcd, "visible-other")).await.expect("watch");
    assert!(other.current().is_empty());

    prefill.shutdown().await;
    decode.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_removes_at_once_and_a_crashed_member_expires_within_the_ttl() {
    init_tracing();
    let etcd = EtcdServer::start();
    let cfg = config(&etcd, "lifecycle");
    let mut view = discovery::watch(cfg.clone()).await.expect("watch");
    let graceful = Registration::start(cfg.clone(), member("decode-graceful", Role::Decode, 1)).await.unwrap();
    let dropped = Registration::start(cfg.clone(), member("decode-dropped", Role::Decode, 2)).await.unwrap();
    let crashed = Registration::start(cfg.clone(), member("decode-crashed", Role::Decode, 3)).await.unwrap();
    wait_view(&mut view, Duration::from_secs(5), "three members", |m| m.len() == 3).await;

    let start = Instant::now();
    graceful.shutdown().await;
    wait_view(&mut view, Duration::from_secs(5), "the shut-down member to go", |m| !has(m, "decode-graceful")).await;
    let shutdown_gone = start.elapsed();
    println!("shutdown: member gone from the watch after {shutdown_gone:?}");
    assert!(shutdown_gone < TTL, "revoking must beat lease expiry, took {shutdown_gone:?}");

    // Dropping the handle revokes in the background.
    let start = Instant::now();
    drop(dropped);
    wait_view(&mut view, Duration::from_secs(5), "the dropped member to go", |m| !has(m, "decode-dropped")).await;
    let drop_gone = start.elapsed();
    println!("drop: member gone from the watch after {drop_gone:?}");
    assert!(drop_gone < TTL, "a dropped registration must revoke, took {drop_gone:?}");

    // A crash: keep-alives stop, nobody revokes; etcd expires the lease.
    let start = Instant::now();
    crashed.abandon().await;
    let crash_gone = wait_view(&mut view, TTL + Duration::from_secs(5), "the crashed member to expire", |m| {
        !has(m, "decode-crashed")
    })
    .await;
    println!("crash: member gone from the watch after {crash_gone:?} (lease TTL {TTL:?})");
    assert!(start.elapsed() >= TTL / 2, "the member must live until its lease expires");
    // etcd checks for expired leases every 500 ms and revokes through raft.
    assert!(crash_gone <= TTL + Duration::from_secs(2), "took {crash_gone:?}");
    assert!(view.current().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_etcd_outage_keeps_the_last_membership_and_members_re_register() {
    init_tracing();
    let mut etcd = EtcdServer::start();
    let cfg = config(&etcd, "outage");
    let prefill = Registration::start(cfg.clone(), member("prefill-o", Role::Prefill, 1)).await.unwrap();
    let decode = Registration::start(cfg.clone(), member("decode-o", Role::Decode, 2)).await.unwrap();
    let doomed = Registration::start(cfg.clone(), member("decode-doomed", Role::Decode, 3)).await.unwrap();
    let mut view = discovery::watch(cfg.clone()).await.expect("watch");
    wait_view(&mut view, Duration::from_secs(5), "three members", |m| m.len() == 3).await;
    let old_prefill_lease = prefill.lease_id().unwrap();
    let old_decode_lease = decode.lease_id().unwrap();

    tokio::task::block_in_place(|| etcd.stop());
    // This one dies while etcd is down; its lease must expire once etcd is back.
    doomed.abandon().await;

    // Serving continues on the last known membership well past the lease TTL.
    let outage = Instant::now();
    while outage.elapsed() < TTL * 2 + Duration::from_secs(1) {
        assert_eq!(ids(&view.current()), ["decode-doomed", "decode-o", "prefill-o"], "membership lost in the outage");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(prefill.lease_id(), None, "the registration must notice the loss");
    assert_eq!(decode.lease_id(), None, "the registration must notice the loss");

    // Registering while etcd is down fails within the dial timeout instead of hanging.
    let start = Instant::now();
    let refused = Registration::start(cfg.clone(), member("prefill-refused", Role::Prefill, 4)).await;
    assert!(refused.is_err(), "registration without etcd must fail");
    assert!(start.elapsed() < DIAL + Duration::from_secs(1), "took {:?}", start.elapsed());

    tokio::task::block_in_place(|| etcd.restart());
    let restarted = Instant::now();

    // Both registrations come back under new leases (etcd may revive the old ones for a while
    // after a restart, so only a new lease proves a re-registration).
    let mut prefill_back = None;
    let mut decode_back = None;
    poll(Duration::from_secs(15), "both re-registrations", || {
        if prefill.lease_id().is_some_and(|l| l != old_prefill_lease) {
            prefill_back.get_or_insert_with(|| restarted.elapsed());
        }
        if decode.lease_id().is_some_and(|l| l != old_decode_lease) {
            decode_back.get_or_insert_with(|| restarted.elapsed());
        }
        prefill_back.is_some() && decode_back.is_some()
    })
    .await;
    println!("outage: re-registered {prefill_back:?} (prefill) / {decode_back:?} (decode) after etcd became healthy");
    assert_eq!(lease_of(&etcd, prefill.key()).await, prefill.lease_id(), "key must be under the new lease");
    assert_eq!(lease_of(&etcd, decode.key()).await, decode.lease_id(), "key must be under the new lease");

    // The watcher reconnected: a member registered after the restart shows up...
    let start = Instant::now();
    let newcomer = Registration::start(cfg.clone(), member("kvstore-new", Role::Kvstore, 5)).await.expect("register");
    wait_view(&mut view, Duration::from_secs(10), "the newcomer", |m| has(m, "kvstore-new")).await;
    println!("outage: newcomer visible {:?} after registering", start.elapsed());

    // ...and the member that died during the outage goes once its (revived) lease expires.
    wait_view(&mut view, Duration::from_secs(15), "the doomed member to expire", |m| !has(m, "decode-doomed")).await;
    println!("outage: member that died in the outage gone {:?} after etcd became healthy", restarted.elapsed());
    assert_eq!(ids(&view.current()), ["decode-o", "kvstore-new", "prefill-o"]);

    // The re-registered members stay: their new leases are kept alive past the TTL.
    let settle = Instant::now();
    while settle.elapsed() < TTL + Duration::from_secs(1) {
        assert_eq!(ids(&view.current()), ["decode-o", "kvstore-new", "prefill-o"]);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(lease_of(&etcd, prefill.key()).await.is_some());

    // Updates made after a re-registration reach etcd under the new lease.
    decode.update(member("decode-o", Role::Decode, 22));
    wait_view(&mut view, Duration::from_secs(5), "the post-outage update", |m| {
        m.iter().any(|m| m.id == "decode-o" && m.capacity["pages"] == 22)
    })
    .await;

    newcomer.shutdown().await;
    prefill.shutdown().await;
    decode.shutdown().await;
    wait_view(&mut view, Duration::from_secs(5), "everyone to leave", |m| m.is_empty()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_started_during_an_outage_fails_and_registrations_survive_a_short_one() {
    init_tracing();
    let mut etcd = EtcdServer::start();
    let cfg = config(&etcd, "short");
    let reg = Registration::start(cfg.clone(), member("prefill-s", Role::Prefill, 1)).await.unwrap();
    let mut view = discovery::watch(cfg.clone()).await.expect("watch");
    wait_view(&mut view, Duration::from_secs(5), "the member", |m| m.len() == 1).await;

    tokio::task::block_in_place(|| etcd.stop());
    let start = Instant::now();
    assert!(discovery::watch(cfg.clone()).await.is_err(), "watch without etcd must fail");
    assert!(start.elapsed() < DIAL + Duration::from_secs(1), "took {:?}", start.elapsed());
    tokio::task::block_in_place(|| etcd.restart());

    poll(Duration::from_secs(15), "re-registration", || reg.lease_id().is_some()).await;
    assert_eq!(lease_of(&etcd, reg.key()).await, reg.lease_id());
    assert_eq!(ids(&view.current()), ["prefill-s"]);
    reg.shutdown().await;
    wait_view(&mut view, Duration::from_secs(5), "the member to leave", |m| m.is_empty()).await;
}

#[tokio::test]
async fn unreachable_etcd_fails_within_the_dial_timeout() {
    let cfg = EtcdConfig {
        dial_timeout: Duration::from_millis(500),
        ..EtcdConfig::new(vec![format!("http://127.0.0.1:{}", free_port())], EtcdConfig::members_prefix("none"))
    };
    let start = Instant::now();
    assert!(Registration::start(cfg.clone(), member("prefill-x", Role::Prefill, 1)).await.is_err());
    assert!(discovery::watch(cfg.clone()).await.is_err());
    assert!(start.elapsed() < Duration::from_secs(2), "took {:?}", start.elapsed());

    let bad = EtcdConfig { endpoints: vec![], ..cfg.clone() };
    assert!(matches!(discovery::watch(bad).await, Err(discovery::DiscoveryError::Config(_))));
    let bad_id = member("a/b", Role::Decode, 1);
    assert!(matches!(Registration::start(cfg, bad_id).await, Err(discovery::DiscoveryError::Config(_))));
}

#[tokio::test]
async fn a_fixed_membership_needs_no_etcd_and_never_changes() {
    let members = vec![member("prefill-0", Role::Prefill, 1), member("decode-0", Role::Decode, 2)];
    let mut fixed = Membership::fixed(members.clone());
    assert_eq!(fixed.current(), members);
    assert_eq!(ids(&fixed.of_role(Role::Decode)), ["decode-0"]);
    assert_eq!(fixed.get("prefill-0"), Some(members[0].clone()));
    assert!(fixed.get("nobody").is_none());
    let seen = within(Duration::from_secs(1), "an immediate match", fixed.wait_for(|m| m.len() == 2)).await;
    assert_eq!(seen.expect("fixed source"), members);
    let clone = fixed.clone();
    assert!(
        tokio::time::timeout(Duration::from_millis(200), fixed.changed()).await.is_err(),
        "a fixed list must neither change nor report a closed source"
    );
    assert_eq!(clone.current(), members);
}
