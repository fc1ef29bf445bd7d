//! `toolgate bench --quick --json --http` runs end to end: every phase measured
//! something, and the contention check held (one effect per shared intent, no
//! duplicates, no busy error reaching a caller). Speed is never asserted here:
//! the numbers belong to `toolgate bench` itself, on a quiet machine.

use std::process::Command;

use serde_json::Value;

fn quick_bench_runs_and_its_checks_hold(backend: crate::support::Backend) {
    let dir = tempfile::tempdir().unwrap();
    // On a memory file system when there is one: the smoke run needs no fsync.
    let shm = std::path::Path::new("/dev/shm");
    let parent = if shm.is_dir() { tempfile::tempdir_in(shm).unwrap() } else { dir };
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_toolgate"));
    cmd.args(["bench", "--quick", "--json", "--http", "--dir"]).arg(parent.path()).env("TOOLGATE_LOG", "off");
    if backend == crate::support::Backend::Postgres {
        // Its ledgers are databases made on the server for the run.
        cmd.arg("--db").arg(crate::support::pg_base().unwrap());
    }
    let out = cmd.output().unwrap();
    assert!(out.status.success(), "{}\n{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    let expect = if backend == crate::support::Backend::Postgres { "postgres" } else { "sqlite" };
    assert_eq!(report["backend"], expect);
    let modes = report["modes"].as_array().unwrap();
    let names: Vec<&str> = modes.iter().map(|m| m["synchronous"].as_str().unwrap()).collect();
    assert_eq!(names, ["FULL", "NORMAL"]);
    for m in modes {
        let phases: Vec<&str> = m["phases"].as_array().unwrap().iter().map(|p| p["name"].as_str().unwrap()).collect();
        // The HTTP API is measured at FULL (`--http`): through a real loopback socket.
        let full = m["synchronous"] == "FULL";
        let mut expect = vec!["bare_write", "fresh_dispatch", "bare_lookup", "bare_replay", "replay", "query"];
        if full {
            expect.extend(["http_fresh", "http_replay"]);
        }
        expect.extend(["contention_shared", "contention_distinct"]);
        assert_eq!(phases, expect);
        for r in ["http_fresh_over_fresh", "http_replay_over_replay"] {
            assert_eq!(m["ratios"][r].is_null(), !full, "{r}: {}", m["ratios"]);
        }
        for p in m["phases"].as_array().unwrap() {
            assert!(p["ops"].as_u64().unwrap() > 0, "{p}");
            assert!(p["ops_per_s"].as_f64().unwrap() > 0.0, "{p}");
            assert!(p["p99_us"].as_u64().unwrap() >= p["p50_us"].as_u64().unwrap(), "{p}");
        }
        for r in ["fresh_over_bare", "replay_over_lookup", "replay_over_bare_replay"] {
            assert!(m["ratios"][r]["median"].as_f64().unwrap() > 0.0, "{r}: {}", m["ratios"]);
        }
        if full {
            assert!(m["ratios"]["http_fresh_over_fresh"]["median"].as_f64().unwrap() > 0.0, "{}", m["ratios"]);
            // A fresh dispatch waits for the disk at least once (its accept); a
            // replay changes no state and never needs to.
            let sc = &m["synced_commits"];
            assert!(sc["per_fresh"].as_f64().unwrap() >= 1.0, "{sc}");
            assert!(sc["per_replay"].as_f64().unwrap() < 1.0, "{sc}");
        }
        let c = &m["contention"];
        assert_eq!(c["threads"], 8);
        assert_eq!(c["shared_intents"], 100);
        assert_eq!(c["shared_effects"], 100, "{c}");
        assert_eq!(c["shared_fresh"], 100, "{c}");
        assert_eq!(c["duplicates"], 0, "{c}");
        assert_eq!(c["busy_errors"], 0, "{c}");
        assert_eq!(c["distinct_effects"], c["distinct_intents"], "{c}");
    }
    // The temporary directory is gone.
    assert_eq!(std::fs::read_dir(parent.path()).unwrap().count(), 0);
}

crate::on_both_backends!(quick_bench_runs_and_its_checks_hold);
