//! Request mapping for the `http` adapter: the placeholders a catalog writes
//! in paths, query parameters, headers and body templates, so that the API's
//! shape need not be the tool's (issue 35 §3).
//!
//! Two placeholders exist: `{key}` (the downstream key) and `{args.NAME}` or
//! `{args.NAME.FIELD}` (a value of the call's arguments). Written by hand: the
//! grammar is these two forms and nothing else, and a template crate would
//! bring expressions, loops and escaping rules a catalog must not have.

use serde_json::{Map, Value};

/// One placeholder of a template.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Placeholder {
    /// `{key}`: the downstream key.
    Key,
    /// `{args.a.b}`: the path into the arguments.
    Arg(Vec<String>),
}

/// A template as literal text and placeholders, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Piece {
    Text(String),
    Hole(Placeholder),
}

/// Parses a template; `Err` names what is wrong (an unclosed brace, an
/// unknown placeholder).
fn pieces(t: &str) -> Result<Vec<Piece>, String> {
    let mut out = Vec::new();
    let mut rest = t;
    while let Some(open) = rest.find('{') {
        if open > 0 {
            out.push(Piece::Text(rest[..open].to_string()));
        }
        let after = &rest[open + 1..];
        let close = after.find('}').ok_or_else(|| format!("an unclosed {{ in {t:?}"))?;
        out.push(Piece::Hole(placeholder(&after[..close])?));
        rest = &after[close + 1..];
    }
    if rest.contains('}') {
        return Err(format!("a }} without its {{ in {t:?}"));
    }
    if !rest.is_empty() {
        out.push(Piece::Text(rest.to_string()));
    }
    Ok(out)
}

fn placeholder(name: &str) -> Result<Placeholder, String> {
    if name == "key" {
        return Ok(Placeholder::Key);
    }
    let path: Vec<&str> = match name.strip_prefix("args.") {
        Some(p) => p.split('.').collect(),
        None => return Err(format!("{{{name}}} is not a placeholder: {{key}} or {{args.NAME}}")),
    };
    if path.iter().any(|s| s.is_empty() || !s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')) {
        return Err(format!("{{{name}}}: argument names are letters, digits, _ and -, joined by ."));
    }
    Ok(Placeholder::Arg(path.into_iter().map(str::to_string).collect()))
}

/// Every placeholder of a text template (for the catalog's checks).
pub fn placeholders(t: &str) -> Result<Vec<Placeholder>, String> {
    Ok(pieces(t)?
        .into_iter()
        .filter_map(|p| match p {
            Piece::Hole(h) => Some(h),
            Piece::Text(_) => None,
        })
        .collect())
}

/// Every placeholder of a JSON body template: in its string values, anywhere.
pub fn json_placeholders(t: &Value) -> Result<Vec<Placeholder>, String> {
    let mut out = Vec::new();
    match t {
        Value::String(s) => out.extend(placeholders(s)?),
        Value::Array(a) => {
            for v in a {
                out.extend(json_placeholders(v)?);
            }
        }
        Value::Object(o) => {
            for v in o.values() {
                out.extend(json_placeholders(v)?);
            }
        }
        _ => {}
    }
    Ok(out)
}

/// The value an argument path names (`None`: absent).
fn arg<'a>(args: &'a Value, path: &[String]) -> Option<&'a Value> {
    path.iter().try_fold(args, |v, seg| v.get(seg.as_str())).filter(|v| !v.is_null())
}

/// A scalar as text: strings as they are, numbers and booleans as JSON writes them.
fn scalar_text(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        Value::Bool(b) => Some(b.to_string()),
        _ => None,
    }
}

fn name_of(path: &[String]) -> String {
    format!("args.{}", path.join("."))
}

/// Fills a text template; each value goes through `encode` (a path segment's
/// percent-encoding, or nothing for a header). `Ok(None)`: an argument it
/// names is absent (an optional query parameter is then left out).
pub fn fill_text(t: &str, key: &str, args: &Value, encode: &dyn Fn(&str) -> String) -> Result<Option<String>, String> {
    let mut out = String::new();
    for p in pieces(t)? {
        match p {
            Piece::Text(s) => out.push_str(&s),
            Piece::Hole(Placeholder::Key) => out.push_str(&encode(key)),
            Piece::Hole(Placeholder::Arg(path)) => {
                let Some(v) = arg(args, &path) else { return Ok(None) };
                let text = scalar_text(v)
                    .ok_or_else(|| format!("{{{}}} is not a string, number or boolean", name_of(&path)))?;
                out.push_str(&encode(&text));
            }
        }
    }
    Ok(Some(out))
}

/// Fills a JSON body template. A string that is one placeholder and nothing
/// else becomes the value itself (a number stays a number, an object an
/// object); an object member whose value names an absent argument is left
/// out; a placeholder inside longer text is filled as text.
pub fn fill_json(t: &Value, key: &str, args: &Value) -> Result<Value, String> {
    Ok(match t {
        Value::String(s) => fill_json_string(s, key, args)?.unwrap_or(Value::Null),
        Value::Array(a) => Value::Array(a.iter().map(|v| fill_json(v, key, args)).collect::<Result<Vec<_>, _>>()?),
        Value::Object(o) => {
            let mut out = Map::new();
            for (k, v) in o {
                let filled = match v {
                    Value::String(s) => fill_json_string(s, key, args)?,
                    other => Some(fill_json(other, key, args)?),
                };
                if let Some(f) = filled {
                    out.insert(k.clone(), f);
                }
            }
            Value::Object(out)
        }
        other => other.clone(),
    })
}

fn fill_json_string(s: &str, key: &str, args: &Value) -> Result<Option<Value>, String> {
    let ps = pieces(s)?;
    if let [Piece::Hole(h)] = ps.as_slice() {
        return Ok(match h {
            Placeholder::Key => Some(Value::String(key.to_string())),
            Placeholder::Arg(path) => arg(args, path).cloned(),
        });
    }
    match fill_text(s, key, args, &|x| x.to_string())? {
        Some(text) => Ok(Some(Value::String(text))),
        None => Err(format!("{s:?} names an argument the call does not have")),
    }
}

/// A filled body as form fields (`application/x-www-form-urlencoded`): a flat
/// object whose values are scalars.
pub fn form_fields(body: &Value) -> Result<Vec<(String, String)>, String> {
    let Value::Object(o) = body else { return Err("a form body is an object".into()) };
    o.iter()
        .map(|(k, v)| {
            scalar_text(v)
                .map(|t| (k.clone(), t))
                .ok_or_else(|| format!("form field {k:?} is not a string, number or boolean"))
        })
        .collect()
}

/// Form fields as `application/x-www-form-urlencoded` text (the WHATWG
/// rules: `*-._` and alphanumerics kept, space as `+`, the rest `%XX`).
pub fn form_encode(fields: &[(String, String)]) -> String {
    let mut out = form_urlencoded::Serializer::new(String::new());
    for (k, v) in fields {
        out.append_pair(k, v);
    }
    out.finish()
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn placeholders_are_the_key_and_argument_paths_and_nothing_else() {
        assert_eq!(placeholders("/v1/{key}/x").unwrap(), vec![Placeholder::Key]);
        assert_eq!(
            placeholders("/c/{args.channel}/m/{args.meta.id}").unwrap(),
            vec![Placeholder::Arg(vec!["channel".into()]), Placeholder::Arg(vec!["meta".into(), "id".into()])]
        );
        for bad in ["/{id}", "/{args.}", "/{args.a..b}", "/{args.a b}", "/{key", "/key}", "/{args.a/b}"] {
            assert!(placeholders(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn text_is_filled_and_encoded_and_an_absent_argument_is_none() {
        let args = json!({"channel": "ops/eu 1", "n": 3, "ok": true, "list": [1]});
        let enc = |s: &str| s.replace('/', "%2F").replace(' ', "%20");
        let f = |t: &str| fill_text(t, "dk_1", &args, &enc);
        assert_eq!(f("/c/{args.channel}/{key}").unwrap().as_deref(), Some("/c/ops%2Feu%201/dk_1"));
        assert_eq!(f("{args.n}-{args.ok}").unwrap().as_deref(), Some("3-true"));
        assert_eq!(f("{args.missing}").unwrap(), None);
        assert!(f("{args.list}").is_err(), "not a scalar");
    }

    #[test]
    fn a_body_template_keeps_types_and_drops_absent_members() {
        let args = json!({"amount_minor": 1500, "order_id": "ord_1", "meta": {"a": 1}});
        let t = json!({
            "amount": "{args.amount_minor}",
            "reference": "refund of {args.order_id}",
            "metadata": "{args.meta}",
            "idempotency": "{key}",
            "note": "{args.note}",
            "fixed": 7,
            "list": ["{args.order_id}"],
        });
        let b = fill_json(&t, "dk_9", &args).unwrap();
        assert_eq!(
            b,
            json!({"amount": 1500, "reference": "refund of ord_1", "metadata": {"a": 1}, "idempotency": "dk_9", "fixed": 7, "list": ["ord_1"]})
        );
        assert!(fill_json(&json!({"x": "a {args.note}"}), "k", &args).is_err(), "absent inside text");
        assert_eq!(
            form_fields(&json!({"amount": 1500, "currency": "eur", "live": false})).unwrap(),
            vec![("amount".into(), "1500".into()), ("currency".into(), "eur".into()), ("live".into(), "false".into())]
        );
        assert!(form_fields(&json!({"nested": {"a": 1}})).is_err());
        assert_eq!(form_encode(&[("a b".into(), "x&y=z/é".into())]), "a+b=x%26y%3Dz%2F%C3%A9");
    }
}
