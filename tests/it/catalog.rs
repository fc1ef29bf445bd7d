//! The catalog as a newcomer writes it: every field the loader accepts is
//! documented in docs/catalog.md, and every problem of a catalog is reported
//! at once, each with its file and field path.

use std::path::Path;

use assert_cmd::Command;
use serde_json::Value;
use toolgate::downstream::http::http_section_schema;
use toolgate::downstream::mcp::mcp_section_schema;
use toolgate::engine::contracts::catalog_file_schema;

/// Resolves a schemars subschema, as the loader does.
fn resolve<'a>(root: &'a Value, s: &'a Value) -> &'a Value {
    toolgate::engine::contracts::resolve_subschema(root, s).unwrap()
}

/// Every field path a schema accepts under `prefix`, with whether it is required.
fn fields(root: &Value, schema: &Value, prefix: &str, out: &mut Vec<(String, bool)>) {
    let s = resolve(root, schema);
    let required: Vec<&str> = s
        .get("required")
        .and_then(Value::as_array)
        .map_or(Vec::new(), |r| r.iter().filter_map(Value::as_str).collect());
    let Some(props) = s.get("properties").and_then(Value::as_object) else { return };
    for (name, sub) in props {
        let path = if prefix.is_empty() { name.clone() } else { format!("{prefix}.{name}") };
        out.push((path.clone(), required.contains(&name.as_str())));
        if path == "downstream.http" {
            // The http adapter's own section, with its own derived schema.
            let http = http_section_schema();
            fields(&http, &http, &path, out);
            continue;
        }
        if path == "downstream.mcp" {
            // The mcp adapter's own section, likewise.
            let mcp = mcp_section_schema();
            fields(&mcp, &mcp, &path, out);
            continue;
        }
        let sub = resolve(root, sub);
        if sub.get("type").and_then(Value::as_str) == Some("array") || sub.get("items").is_some() {
            if let Some(items) = sub.get("items") {
                fields(root, items, &format!("{path}[]"), out);
            }
        } else {
            fields(root, sub, &path, out);
        }
    }
}

#[test]
fn every_catalog_field_is_documented() {
    let doc = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/catalog.md")).unwrap();
    // The doc's rows: `| \`path\` | required | type | default | meaning |`.
    let rows: Vec<(String, String)> = doc
        .lines()
        .filter_map(|l| {
            let cells: Vec<&str> = l.split('|').map(str::trim).collect();
            let path = cells.get(1)?.strip_prefix('`')?.strip_suffix('`')?;
            Some((path.to_string(), (*cells.get(2)?).to_string()))
        })
        .collect();
    let schema = catalog_file_schema();
    let mut accepted = Vec::new();
    fields(&schema, &schema, "", &mut accepted);
    assert!(accepted.len() > 40, "the walk found the fields: {accepted:?}");
    for (path, required) in &accepted {
        let row = rows.iter().find(|(p, _)| p == path);
        let Some((_, says)) = row else { panic!("docs/catalog.md does not document the catalog field `{path}`") };
        // `Option` fields serde reads as absent-or-null; the loader itself
        // requires these to be written, `null` or not.
        let required_by_loader = ["downstream.http.lookup"].contains(&path.as_str());
        if *required || required_by_loader {
            assert!(says.starts_with("yes"), "`{path}` is required by the loader; docs/catalog.md says {says:?}");
        } else {
            assert!(!says.starts_with("yes"), "`{path}` has a default; docs/catalog.md says {says:?}");
        }
    }
    // And nothing documented that the loader does not accept.
    for (path, _) in &rows {
        assert!(accepted.iter().any(|(p, _)| p == path), "docs/catalog.md documents `{path}`, which no loader accepts");
    }
}

#[test]
fn the_loader_reports_every_problem_at_once_with_file_and_field() {
    let dir = tempfile::tempdir().unwrap();
    let cat = dir.path().join("cat");
    std::fs::create_dir(&cat).unwrap();
    let demo = Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/catalog");
    let read = |f: &str| -> Value { serde_json::from_str(&std::fs::read_to_string(demo.join(f)).unwrap()).unwrap() };
    // Five problems in one file, two in another, one file sound.
    let mut refund = read("create_refund.json");
    let o = refund.as_object_mut().unwrap();
    o.remove("risk");
    o.remove("data_classification");
    o.insert("colour".into(), "red".into());
    refund["effect"] = "bogus".into();
    refund["retry"].as_object_mut().unwrap().remove("max_attempts");
    let mut order = read("get_order.json");
    order["approval"]["policy"] = "sometimes".into();
    order["retry"]["attempt_timeout_ms"] = "5s".into();
    std::fs::write(cat.join("create_refund.json"), refund.to_string()).unwrap();
    std::fs::write(cat.join("get_order.json"), order.to_string()).unwrap();
    std::fs::copy(demo.join("notify_customer.json"), cat.join("notify_customer.json")).unwrap();
    let ledger = dir.path().join("l.db");
    let out = Command::new(env!("CARGO_BIN_EXE_toolgate"))
        .args(["init", "--catalog"])
        .arg(&cat)
        .arg("--db")
        .arg(&ledger)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.starts_with("error[CATALOG_INVALID]: 7 problems:"), "{err}");
    for line in [
        "catalog file create_refund.json, field risk: missing (required)",
        "catalog file create_refund.json, field data_classification: missing (required)",
        "catalog file create_refund.json, field retry.max_attempts: missing (required)",
        "catalog file create_refund.json, field colour: unknown field (allowed here: approval, circuit,",
        r#"catalog file create_refund.json, field effect: must be one of "read", "write", "external""#,
        r#"catalog file get_order.json, field approval.policy: must be one of "never", "above_threshold", "always""#,
        "catalog file get_order.json, field retry.attempt_timeout_ms:",
    ] {
        assert!(err.contains(line), "{line:?} is not in: {err}");
    }
    assert!(!err.contains("line ") && !err.contains("column"), "fields, not end-of-file positions: {err}");
    assert!(!err.contains(&*dir.path().to_string_lossy()), "no local path: {err}");
    assert!(!ledger.exists(), "nothing written");

    // The http adapter's section: every problem of every tool at once too,
    // with the other files' own problems.
    let http = Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/catalog-http");
    let cat = dir.path().join("cat-http");
    std::fs::create_dir(&cat).unwrap();
    let read = |f: &str| -> Value { serde_json::from_str(&std::fs::read_to_string(http.join(f)).unwrap()).unwrap() };
    let mut refund = read("create_refund.json");
    let h = &mut refund["downstream"]["http"];
    h.as_object_mut().unwrap().remove("execute");
    h["key_header"] = 5.into();
    h["reply"]["reciept"] = "/x".into();
    let mut notify = read("notify_customer.json");
    notify["downstream"]["http"].as_object_mut().unwrap().remove("lookup");
    std::fs::write(cat.join("create_refund.json"), refund.to_string()).unwrap();
    std::fs::write(cat.join("notify_customer.json"), notify.to_string()).unwrap();
    // And a file-level problem in a third file: reported in the same run.
    let mut order = read("get_order.json");
    order.as_object_mut().unwrap().remove("risk");
    std::fs::write(cat.join("get_order.json"), order.to_string()).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_toolgate"))
        .env("TOOLGATE_PROVIDER_URL", "http://127.0.0.1:9")
        .args(["init", "--catalog"])
        .arg(&cat)
        .arg("--db")
        .arg(&ledger)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.starts_with("error[CATALOG_INVALID]: 5 problems:"), "{err}");
    for line in [
        "catalog file create_refund.json, field downstream.http.execute: missing (required)",
        "catalog file create_refund.json, field downstream.http.key_header:",
        "catalog file create_refund.json, field downstream.http.reply.reciept: unknown field (allowed here: body_sha256, key, receipt_id, request_id, result)",
        "catalog file notify_customer.json, field downstream.http.lookup: say how a call is looked up by its key",
        "catalog file get_order.json, field risk: missing (required)",
    ] {
        assert!(err.contains(line), "{line:?} is not in: {err}");
    }
    assert!(!ledger.exists(), "nothing written");
}

/// Issue 35 §3: `toolgate catalog check DIR` validates a catalog offline
/// (no ledger, no network) and prints every problem at once; `toolgate
/// catalog schema` prints the JSON Schema an editor validates a file with,
/// which accepts every shipped catalog file and refuses a misspelt field.
#[test]
fn catalog_check_reports_every_problem_and_catalog_schema_validates_the_shipped_files() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let tg = |args: &[&std::ffi::OsStr]| {
        let out = Command::new(env!("CARGO_BIN_EXE_toolgate")).args(args).output().unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let os = |s: &str| std::ffi::OsString::from(s);
    // A sound catalog: exit 0 and its tools.
    let http = root.join("assets/catalog-http");
    let (code, out, err) = tg(&[&os("catalog"), &os("check"), http.as_os_str(), &os("--json")]);
    assert_eq!(code, Some(0), "{err}");
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["ok"], true);
    assert_eq!(v["tools"].as_array().map(Vec::len), Some(3), "{v}");
    // Two broken files: every problem, by file and field, exit 1, no path.
    let dir = tempfile::tempdir().unwrap();
    let read = |f: &str| -> Value { serde_json::from_str(&std::fs::read_to_string(http.join(f)).unwrap()).unwrap() };
    let mut refund = read("create_refund.json");
    refund["downstream"]["http"]["execute"]["path"] = "/v1/{args.nope}".into();
    refund["downstream"]["http"]["reply"]["reciept"] = "/x".into();
    let mut notify = read("notify_customer.json");
    notify["effect"] = "bogus".into();
    std::fs::write(dir.path().join("create_refund.json"), refund.to_string()).unwrap();
    std::fs::write(dir.path().join("notify_customer.json"), notify.to_string()).unwrap();
    let (code, out, _) = tg(&[&os("catalog"), &os("check"), dir.path().as_os_str(), &os("--json")]);
    assert_eq!(code, Some(1), "{out}");
    let v: Value = serde_json::from_str(&out).unwrap();
    let problems = v["problems"].as_array().unwrap();
    let has = |file: &str, field: &str| problems.iter().any(|p| p["file"] == file && p["field"] == field);
    assert!(has("create_refund.json", "downstream.http.reply.reciept"), "{v}");
    assert!(has("notify_customer.json", "effect"), "{v}");
    assert!(!out.contains(&*dir.path().to_string_lossy()), "no local path: {out}");
    let (code, text, _) = tg(&[&os("catalog"), &os("check"), dir.path().as_os_str()]);
    assert_eq!(code, Some(1));
    assert!(text.contains("problem(s)"), "{text}");
    // Once the shape is right, the rules that span fields speak (the path's argument).
    refund["downstream"]["http"]["reply"].as_object_mut().unwrap().remove("reciept");
    notify["effect"] = "external".into();
    std::fs::write(dir.path().join("create_refund.json"), refund.to_string()).unwrap();
    std::fs::write(dir.path().join("notify_customer.json"), notify.to_string()).unwrap();
    let (code, out, _) = tg(&[&os("catalog"), &os("check"), dir.path().as_os_str()]);
    assert_eq!(code, Some(1));
    assert!(out.contains("\"nope\" is not an input property"), "{out}");
    // A directory that is not there is an error with a stable code.
    let (code, _, err) = tg(&[&os("catalog"), &os("check"), dir.path().join("missing").as_os_str()]);
    assert_eq!(code, Some(2));
    assert!(err.starts_with("error[CATALOG_UNREADABLE]"), "{err}");

    // The schema: every shipped file is valid, a misspelt field is not.
    let (code, out, err) = tg(&[&os("catalog"), &os("schema")]);
    assert_eq!(code, Some(0), "{err}");
    let schema: Value = serde_json::from_str(&out).unwrap();
    let validator = jsonschema::validator_for(&schema).expect("the printed schema compiles");
    for sub in ["assets/catalog", "assets/catalog-http"] {
        for entry in std::fs::read_dir(root.join(sub)).unwrap() {
            let p = entry.unwrap().path();
            if p.extension().and_then(|e| e.to_str()) != Some("json") {
                continue;
            }
            let file: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
            let errors: Vec<String> = validator.iter_errors(&file).map(|e| e.to_string()).collect();
            assert!(errors.is_empty(), "{}: {errors:?}", p.display());
        }
    }
    let mut bad = read("create_refund.json");
    bad["downstream"]["http"]["execute"]["methd"] = "POST".into();
    assert!(!validator.is_valid(&bad), "an unknown field inside the http section is refused");
    let mut bad = read("create_refund.json");
    bad["downstream"]["lookup"] = serde_json::json!({"by": "guess", "key_retention_ms": 1});
    assert!(!validator.is_valid(&bad));
}
