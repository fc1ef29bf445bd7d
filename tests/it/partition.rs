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
