//! The layering, checked (issue 34 §6): which crate may depend on which, which
//! crates the core may never pull in (directly or through another), which
//! modules may not name which, and ARCHITECTURE.md's code map against the tree.
//!
//! The crate table is the compiler's to enforce (a crate can only import what
//! its manifest names); this test keeps the manifests honest. The module table
//! covers the lines inside a crate, where only a text check can look.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use serde_json::Value;

/// Each workspace crate and the workspace crates it may depend on (normal
/// dependencies). A crate missing from here fails the test: add it, with its
/// floor.
const CRATES: &[(&str, &[&str])] = &[
    ("toolgate-core", &[]),
    ("toolgate-adapters", &["toolgate-core"]),
    ("toolgate-sim", &["toolgate-core", "toolgate-adapters"]),
    ("toolgate-server", &["toolgate-core"]),
    ("toolgate-console", &["toolgate-core", "toolgate-adapters", "toolgate-sim"]),
    ("toolgate", &["toolgate-core", "toolgate-adapters", "toolgate-sim", "toolgate-server", "toolgate-console"]),
];

/// Crates a floor may not pull in, directly or through any other crate.
const NEVER: &[(&str, &[&str])] = &[
    (
        "toolgate-core",
        &[
            "ratatui",
            "crossterm",
            "axum",
            "hyper",
            "tower",
            "rmcp",
            "clap",
            "ureq",
            // (rustls is the store's: TLS to PostgreSQL, sslmode=verify-full.)
            "tracing-subscriber",
            "mimalloc",
        ],
    ),
    ("toolgate-adapters", &["ratatui", "crossterm", "axum", "rmcp", "clap", "tracing-subscriber", "mimalloc"]),
    ("toolgate-sim", &["ratatui", "crossterm", "axum", "rmcp", "clap", "tracing-subscriber", "mimalloc"]),
    ("toolgate-server", &["ratatui", "crossterm", "clap", "ureq", "tracing-subscriber", "mimalloc"]),
    // (hyper comes with the adapters' `provider serve`; the console serves nothing.)
    ("toolgate-console", &["axum", "rmcp", "clap", "tracing-subscriber", "mimalloc"]),
];

/// Inside a crate: the files under a path (relative to the repository) and
/// the texts they may not contain outside comments.
const MODULES: &[(&str, &[&str])] = &[
    // The ledger is the ground: it names nothing above it.
    ("crates/toolgate-core/src/store", &["crate::engine", "crate::telemetry", "engine::", "telemetry::"]),
    // The engine reads and writes the ledger; observability reads the engine.
    ("crates/toolgate-core/src/engine", &["crate::telemetry", "telemetry::"]),
    ("crates/toolgate-core/src/failpoint.rs", &["crate::"]),
    ("crates/toolgate-core/src/display.rs", &["crate::"]),
    // The HTTP server mounts MCP; MCP never reaches back into it.
    ("crates/toolgate-server/src/mcp", &["crate::api", "api::"]),
    ("crates/toolgate-server/src/pool.rs", &["crate::api", "crate::mcp"]),
    ("crates/toolgate-server/src/status.rs", &["crate::api", "crate::mcp"]),
    // The console's model never imports its view (issue 19 §8).
    ("crates/toolgate-console/src/tui/app.rs", &["super::ui", "tui::ui", "ratatui::", "crossterm::"]),
    ("crates/toolgate-console/src/tui/app", &["super::ui", "tui::ui", "ratatui::", "crossterm::"]),
    ("crates/toolgate-console/src/tui/format.rs", &["super::ui", "tui::ui", "ratatui::", "crossterm::"]),
];

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn cargo() -> std::process::Command {
    let mut c = std::process::Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    c.current_dir(root());
    c
}

/// Each workspace crate's normal (not dev, not build) dependencies, by name,
/// from its manifest (`cargo metadata --no-deps`: nothing to resolve or fetch).
fn direct_dependencies() -> BTreeMap<String, BTreeSet<String>> {
    let out = cargo().args(["metadata", "--format-version", "1", "--no-deps", "--offline"]).output().unwrap();
    assert!(out.status.success(), "cargo metadata: {}", String::from_utf8_lossy(&out.stderr));
    let meta: Value = serde_json::from_slice(&out.stdout).unwrap();
    meta["packages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            let deps = p["dependencies"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|d| d["kind"].is_null())
                .map(|d| d["name"].as_str().unwrap().to_string())
                .collect();
            (p["name"].as_str().unwrap().to_string(), deps)
        })
        .collect()
}

/// Every crate `krate` links on this platform, through any path (`cargo tree
/// -e normal`: no dev or build dependencies).
fn linked(krate: &str) -> BTreeSet<String> {
    linked_with(krate, &[])
}

/// The same, with these features of `krate` on.
fn linked_with(krate: &str, features: &[&str]) -> BTreeSet<String> {
    let mut cmd = cargo();
    cmd.args(["tree", "--offline", "-e", "normal", "--prefix", "none", "--format", "{p}", "-p", krate]);
    if !features.is_empty() {
        cmd.args(["--features", &features.join(",")]);
    }
    let out = cmd.output().unwrap();
    assert!(out.status.success(), "cargo tree: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_string)
        .collect()
}

#[test]
fn each_crate_depends_only_on_the_floors_below_it() {
    let deps = direct_dependencies();
    let members: BTreeSet<&String> = deps.keys().collect();
    let table: BTreeSet<String> = CRATES.iter().map(|(c, _)| (*c).to_string()).collect();
    assert_eq!(
        members,
        table.iter().collect(),
        "every workspace crate has a row in CRATES (and no row names a crate that is gone)"
    );
    for (krate, allowed) in CRATES {
        for dep in deps[*krate].iter().filter(|d| table.contains(*d)) {
            assert!(allowed.contains(&dep.as_str()), "{krate} depends on {dep}, which is not below it");
        }
    }
}

#[test]
fn the_core_pulls_in_no_terminal_http_server_mcp_or_cli_crate() {
    for (krate, never) in NEVER {
        let linked = linked(krate);
        assert!(linked.contains("serde"), "{krate}: {linked:?}");
        for bad in *never {
            assert!(!linked.contains(*bad), "{krate} pulls in {bad}");
        }
    }
    // The adapters' `mcp` feature (the binary's) brings the MCP client, and
    // nothing of a server or a terminal: the MCP server stays toolgate-server's.
    let with_mcp = linked_with("toolgate-adapters", &["mcp"]);
    assert!(with_mcp.contains("rmcp"), "{with_mcp:?}");
    for bad in ["ratatui", "crossterm", "axum", "clap", "tracing-subscriber", "mimalloc"] {
        assert!(!with_mcp.contains(bad), "toolgate-adapters with mcp pulls in {bad}");
    }
}

/// Every `.rs` file under `path` (a file or a directory, relative to the
/// repository), with its text.
fn sources(path: &str) -> Vec<(PathBuf, String)> {
    let mut out = Vec::new();
    let mut stack = vec![root().join(path)];
    while let Some(p) = stack.pop() {
        if p.is_dir() {
            stack.extend(std::fs::read_dir(&p).unwrap().map(|e| e.unwrap().path()));
        } else if p.extension().is_some_and(|e| e == "rs") {
            let text = std::fs::read_to_string(&p).unwrap();
            out.push((p, text));
        }
    }
    out
}

/// A line's code, without a trailing or whole-line comment.
fn code(line: &str) -> &str {
    line.find("//").map_or(line, |i| &line[..i])
}

#[test]
fn modules_name_nothing_above_them() {
    for (path, never) in MODULES {
        let files = sources(path);
        assert!(!files.is_empty(), "{path} holds no source: the table names a path that moved");
        for (file, text) in &files {
            for (n, line) in text.lines().enumerate() {
                for needle in *never {
                    assert!(
                        !code(line).contains(needle),
                        "{}:{} names {needle}: {}",
                        file.strip_prefix(root()).unwrap().display(),
                        n + 1,
                        line.trim()
                    );
                }
            }
        }
    }
}

/// The paths ARCHITECTURE.md's code map names in backticks
/// (`crates/…`, `src/…`, `tests/…`, `assets/…`, `examples/…`, `benches/…`, `fuzz/…`).
fn mapped_paths(map: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for piece in map.split('`').skip(1).step_by(2) {
        let p = piece.trim_end_matches(['/', ':']);
        let known = ["crates/", "src/", "tests/", "assets/", "examples/", "benches/", "fuzz/", "docs/"];
        if known.iter().any(|k| p.starts_with(k)) && !p.contains(' ') && !p.contains('*') {
            out.insert(p.to_string());
        }
    }
    out
}

#[test]
fn the_code_map_names_paths_that_exist_and_every_module_of_every_crate() {
    let text = std::fs::read_to_string(root().join("ARCHITECTURE.md")).unwrap();
    let start = text.find("## Code map").unwrap();
    let end = text[start..].find("\n## ").map_or(text.len(), |i| start + i);
    let map = &text[start..end];
    let paths = mapped_paths(map);
    assert!(paths.len() > 20, "{paths:?}");
    for p in &paths {
        assert!(root().join(p).exists(), "ARCHITECTURE.md's code map names `{p}`, which does not exist");
    }
    // Every top-level module of every crate is on the map.
    let mut crates: Vec<PathBuf> =
        std::fs::read_dir(root().join("crates")).unwrap().map(|e| e.unwrap().path()).collect();
    crates.push(root().to_path_buf());
    for krate in crates {
        let src = krate.join("src");
        for entry in std::fs::read_dir(&src).unwrap() {
            let path = entry.unwrap().path();
            let name = path.file_name().unwrap().to_string_lossy().to_string();
            if name == "lib.rs" {
                continue;
            }
            let rel = path.strip_prefix(root()).unwrap().to_string_lossy().replace('\\', "/");
            assert!(
                paths.iter().any(|p| p == &rel || p.starts_with(&format!("{rel}/"))),
                "ARCHITECTURE.md's code map does not name `{rel}`"
            );
        }
    }
}

/// Whether a file may hold SQL: the ledger's store, or a domain's own store
/// module (the demo's orders).
fn may_hold_sql(rel: &str) -> bool {
    rel.starts_with("crates/toolgate-core/src/store/") || rel == "crates/toolgate-adapters/src/tools/demo/store.rs"
}

#[test]
fn no_sql_outside_a_store_module() {
    let statements = ["\"SELECT ", "\"INSERT INTO ", "\"DELETE FROM ", "\"UPDATE ", "\"CREATE TABLE", "\"PRAGMA "];
    let mut files = sources("crates");
    files.extend(sources("src"));
    assert!(files.len() > 50);
    for (file, text) in &files {
        let rel = file.strip_prefix(root()).unwrap().to_string_lossy().replace('\\', "/");
        if may_hold_sql(&rel) {
            continue;
        }
        for (n, line) in text.lines().enumerate() {
            for s in statements {
                assert!(!code(line).contains(s), "{rel}:{} holds SQL outside a store module: {}", n + 1, line.trim());
            }
        }
    }
}
