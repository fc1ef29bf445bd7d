//! Issue 36 §2: PostgreSQL behind a network that stops delivering. A TCP
//! proxy inside the test (no root needed) between toolgate and the server
//! passes bytes, or blackholes them: it keeps every socket open and keeps
//! reading (so the kernel acknowledges everything) but delivers nothing, the
//! worst middlebox there is (TCP keepalives and `tcp_user_timeout` see a
//! healthy socket). toolgate's own bound on each round trip
//! (`store::pg_client`: the session's statement_timeout plus 5 s) is what
//! answers the caller.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use toolgate::engine::envelope::Status;
use toolgate::engine::Engine;
use toolgate::Coded;

use crate::support::{opts, refund, T0};

/// A TCP proxy to `upstream` that can blackhole both directions.
struct Proxy {
    port: u16,
    blackhole: Arc<AtomicBool>,
}

impl Proxy {
    fn start(upstream: String) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let blackhole = Arc::new(AtomicBool::new(false));
        let bh = blackhole.clone();
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { return };
                let Ok(server) = TcpStream::connect(&upstream) else { continue };
                for (mut from, mut to) in [(client.try_clone().unwrap(), server.try_clone().unwrap()), (server, client)]
                {
                    let bh = bh.clone();
                    std::thread::spawn(move || {
                        let mut buf = [0u8; 16 * 1024];
                        loop {
                            let n = match from.read(&mut buf) {
                                Ok(0) | Err(_) => break,
                                Ok(n) => n,
                            };
                            // Blackholed: read (the kernel acknowledges) and drop.
                            if !bh.load(Ordering::SeqCst) && to.write_all(&buf[..n]).is_err() {
                                break;
                            }
                        }
                        let _ = to.shutdown(std::net::Shutdown::Write);
                    });
                }
            }
        });
        Self { port, blackhole }
    }

    fn set_blackhole(&self, on: bool) {
        self.blackhole.store(on, Ordering::SeqCst);
    }
}

#[test]
fn a_blackhole_before_accept_is_db_unavailable_within_the_bound_and_the_retry_runs_once() {
    if crate::support::pg_base().is_none() {
        return;
    }
    let fx = crate::support::Fixture::on(crate::support::Backend::Postgres);
    let direct = fx.path().to_str().unwrap().to_string();
    // postgres://toolgate@127.0.0.1:PORT/DB → the same through the proxy,
    // with a 1 s statement timeout (the round-trip bound is then 6 s).
    let (head, tail) = direct.split_once('@').unwrap();
    let (hostport, db) = tail.split_once('/').unwrap();
    let proxy = Proxy::start(hostport.to_string());
    let proxied = format!("{head}@127.0.0.1:{}/{db}?options=-c%20statement_timeout%3D1s", proxy.port);
    let clock = toolgate::engine::clock::ManualClock::new(T0);
    let mut e = Engine::open(std::path::Path::new(&proxied), opts(&clock, "proxied")).unwrap();
    let warm = e.dispatch(&refund("part-warm-00001", 100)).unwrap();
    assert_eq!(warm.model_result.status, Status::Succeeded, "{warm:?}");

    proxy.set_blackhole(true);
    let started = Instant::now();
    let answer = e.dispatch(&refund("part-dark-00001", 200));
    let waited = started.elapsed();
    let code = answer.as_ref().err().map(|e| e.code().to_string());
    assert_eq!(code.as_deref(), Some("DB_UNAVAILABLE"), "{:?}", answer.map(|a| a.model_result));
    // The bound (6 s), once for the statement and once for the reconnect,
    // and slack for a busy machine: never the hang it was.
    eprintln!("blackhole before accept: DB_UNAVAILABLE after {waited:?}");
    assert!(waited < Duration::from_secs(45), "answered after {waited:?}");

    // The network heals: the same key runs once (nothing happened before).
    proxy.set_blackhole(false);
    let again = e.dispatch(&refund("part-dark-00001", 200)).unwrap();
    assert_eq!(again.model_result.status, Status::Succeeded, "{again:?}");
    let mut direct_engine = fx.engine();
    assert_eq!(crate::support::effects(&mut direct_engine), 2);
    assert_eq!(crate::support::duplicates(&mut direct_engine), 0);
}

/// The PostgreSQL URL `direct` through the proxy, with a 1 s statement
/// timeout (a 6 s bound on each round trip).
fn through(proxy: &Proxy, direct: &str) -> String {
    let (head, tail) = direct.split_once('@').unwrap();
    let (_, db) = tail.split_once('/').unwrap();
    format!("{head}@127.0.0.1:{}/{db}?options=-c%20statement_timeout%3D1s", proxy.port)
}

/// The network goes dark while the downstream (an HTTP provider, reachable)
/// executes the call: its reply cannot be recorded. The caller is answered
/// OUTCOME_UNKNOWN with its status_ref within the bound, not a database error
/// as if nothing had happened; once the ledger is reachable, the attempt's
/// lease runs out and the status query settles it from the provider's
/// receipt: one effect.
#[test]
fn a_blackhole_between_send_and_persist_answers_outcome_unknown_and_the_query_settles_it() {
    if crate::support::pg_base().is_none() {
        return;
    }
    let fx = crate::http::HttpFixture::with_catalog_on(crate::support::Backend::Postgres, &|_| {});
    let direct = fx.ledger.to_str().unwrap().to_string();
    let hostport = direct.split_once('@').unwrap().1.split_once('/').unwrap().0.to_string();
    let proxy = Proxy::start(hostport);
    let proxied = through(&proxy, &direct);
    let mut e = Engine::open(std::path::Path::new(&proxied), fx.opts()).unwrap();
    // The provider takes 3 s; the network goes dark 1 s into it.
    e.set_faults(toolgate::downstream::FaultPlan::parse("latency(3000)").unwrap());
    let dark = std::thread::spawn({
        let bh = proxy.blackhole.clone();
        move || {
            std::thread::sleep(Duration::from_secs(1));
            bh.store(true, Ordering::SeqCst);
        }
    });
    let started = Instant::now();
    let env = e.dispatch(&refund("part-persist-0001", 300)).unwrap();
    let waited = started.elapsed();
    dark.join().unwrap();
    eprintln!("blackhole between send and persist: {:?} after {waited:?}", env.code());
    assert_eq!(env.model_result.status, Status::Unknown, "{env:?}");
    assert_eq!(env.code(), Some(toolgate::engine::envelope::Code::OutcomeUnknown));
    let status_ref = env.protected_audit.downstream.status_ref.clone().expect("a status_ref to ask by");
    assert!(waited < Duration::from_secs(45), "answered after {waited:?}");
    assert_eq!(fx.server.effects(), 1, "the provider committed");
    // The network heals. The ledger still holds the attempt in flight: its
    // lease runs out, the reaper takes it, and the status query settles it.
    proxy.set_blackhole(false);
    let mut d = Engine::open(&fx.ledger, fx.opts()).unwrap();
    fx.clock.advance(60_000);
    d.reap().unwrap();
    let q = d
        .query_operation_status(&toolgate::engine::QueryRequest {
            tenant: "acme".into(),
            subject: "agent_ana".into(),
            status_ref,
            expected_request_sha256: env.protected_audit.binding.request_sha256.clone().unwrap(),
            ..toolgate::engine::QueryRequest::default()
        })
        .unwrap();
    assert_eq!(q.model_result.status, Status::Succeeded, "{q:?}");
    assert_eq!(fx.server.effects(), 1);
    assert_eq!(fx.server.duplicates(), 0);
}
