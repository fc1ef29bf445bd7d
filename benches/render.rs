//! The console's frame cost against ledger size: fetch the visible page (keyset,
//! index-backed) and render it at 140×40, on ledgers of 1,000 and 1,000,000
//! operations. The target is the million-row frame within 1.5× of the
//! thousand-row one, in every order a pane can be sorted by (issue 19 §2):
//! each Ledger and Unknown sort column, both directions, fetched the way the
//! console's engine thread answers the pane's request.
//!
//! `cargo bench --bench render` (building the 1M-row ledger takes a while once);
//! bench names are `frame_PANE_SIZE/COLUMN_DIR`, the pane's default order marked
//! `(default)`. A quicker run: `cargo bench --bench render -- --sample-size 10
//! --warm-up-time 1 --measurement-time 2`.

use std::path::Path;

use criterion::{criterion_group, criterion_main, Criterion};
use ratatui::backend::TestBackend;
use ratatui::Terminal;
use toolgate::engine::Engine;
use toolgate::store::Order;
use toolgate::tui::app::{default_order, sort_columns, Action, App, Pane};
use toolgate::tui::backend::fetch_page;

/// Copies the demo working copy's operations until the ledger holds `n` rows
/// (bench set-up only: plain SQL on a scratch file).
fn ledger(dir: &Path, n: i64) -> std::path::PathBuf {
    let now = 1_800_000_000_000;
    let path = toolgate::demo::working_copy(dir, now).expect("working copy");
    let c = rusqlite::Connection::open(&path).expect("open");
    let have: i64 = c.query_row("SELECT count(*) FROM operations", [], |r| r.get(0)).expect("count");
    c.execute_batch("BEGIN").expect("begin");
    let cols: Vec<String> = c
        .prepare("SELECT name FROM pragma_table_info('operations')")
        .expect("cols")
        .query_map([], |r| r.get(0))
        .expect("cols")
        .map(|r| r.expect("col"))
        .collect();
    let select: Vec<String> = cols
        .iter()
        .map(|c| match c.as_str() {
            "id" => "printf('op_bench%016d', ?1)".to_string(),
            "idem_key" => "printf('bench-key-%016d', ?1)".to_string(),
            "status_ref" => "printf('sr1_bench%016d', ?1)".to_string(),
            "updated_at" | "created_at" => "updated_at - ?1".to_string(),
            other => other.to_string(),
        })
        .collect();
    let sql = format!(
        "INSERT INTO operations ({}) SELECT {} FROM operations WHERE id = (SELECT id FROM operations ORDER BY rowid LIMIT 1 OFFSET (?1 % {have}))",
        cols.join(", "),
        select.join(", ")
    );
    let mut st = c.prepare(&sql).expect("prepare");
    for i in 0..(n - have).max(0) {
        st.execute([i]).expect("insert");
    }
    drop(st);
    // The copies bypass the store, which keeps the counts per state (migration 0013).
    c.execute_batch(
        "DELETE FROM state_counts; INSERT INTO state_counts (state, n) SELECT state, count(*) FROM operations GROUP BY state; COMMIT",
    )
    .expect("recount, commit");
    path
}

/// One console frame: the request the pane sends for its current order, the
/// page the engine thread answers with, and the draw.
fn frame(engine: &mut Engine, app: &mut App, term: &mut Terminal<TestBackend>) {
    let event = fetch_page(engine, app.fetch()).expect("a fetch request").expect("page");
    app.update(Action::Engine(event));
    term.draw(|f| {
        toolgate::tui::ui::render(app, f);
    })
    .expect("draw");
}

fn bench(c: &mut Criterion) {
    let dir = tempfile::tempdir().expect("tempdir");
    for (label, n) in [("1k", 1_000i64), ("1M", 1_000_000)] {
        let sub = dir.path().join(label);
        std::fs::create_dir_all(&sub).expect("dir");
        let path = ledger(&sub, n);
        let mut engine = Engine::open(&path, toolgate::tools::demo_options()).expect("engine");
        let mut app = App::new("bench", "bench", false, false, 1_800_000_000_000);
        app.size = (140, 40);
        let mut term = Terminal::new(TestBackend::new(140, 40)).expect("terminal");
        for pane in [Pane::Ledger, Pane::Unknown] {
            app.update(Action::SelectPane(pane));
            let mut group = c.benchmark_group(format!("frame_{}_{label}", pane.title().to_lowercase()));
            for (column, name) in sort_columns(pane).into_iter().enumerate() {
                for desc in [false, true] {
                    let order = Order { column, desc };
                    app.sorts.insert(pane, order);
                    let dir = if desc { "desc" } else { "asc" };
                    let default = if order == default_order(pane) { " (default)" } else { "" };
                    group.bench_function(format!("{name}_{dir}{default}"), |b| {
                        b.iter(|| frame(&mut engine, &mut app, &mut term));
                    });
                }
            }
            group.finish();
            app.sorts.remove(&pane);
        }
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(30);
    targets = bench
}
criterion_main!(benches);
