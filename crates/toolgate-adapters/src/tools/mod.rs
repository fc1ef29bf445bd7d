//! The tools toolgate ships, above the engine: the demo catalog
//! (`assets/catalog/`, embedded) with its domain ([`demo::DemoDomain`]), and
//! the toolsets that put a catalog together with the domains and adapters
//! that serve it (`simulated`, `http`).
//!
//! `crate::tools::demo_options()` is defined here, not in the engine: it is the
//! demo toolset, so the engine itself names no tool and no provider. An
//! embedder builds its own [`Toolset`] (see `examples/embed.rs`).

pub mod demo;

use std::path::Path;
use std::sync::Arc;

use crate::downstream::http::HttpAdapter;
use crate::downstream::SimulatedAdapter;
use crate::engine::contracts::{ContractError, Contracts};
use crate::engine::tool::{ToolDomain, Toolset};
use crate::engine::EngineOptions;

const DEMO_CATALOG: [(&str, &str); 3] = [
    ("create_refund.json", include_str!("../../../../assets/catalog/create_refund.json")),
    ("get_order.json", include_str!("../../../../assets/catalog/get_order.json")),
    ("notify_customer.json", include_str!("../../../../assets/catalog/notify_customer.json")),
];

/// The demo catalog shipped in `assets/catalog/` (embedded in the binary).
pub fn demo_catalog() -> Result<Contracts, ContractError> {
    Contracts::from_texts(DEMO_CATALOG.iter().map(|(f, t)| (*f, *t)))
}

/// A catalog served by the demo domain and the `simulated`, `http` and (with
/// the `mcp` feature, as the binary builds it) `mcp` adapters: the toolset's
/// MCP servers are shared by every engine it opens.
///
/// The demo domain's rules (an order's capture, its world sections) apply to
/// the demo's tool names, but never to a tool an MCP server runs: a server's
/// `get_order` is its own, not the demo's.
pub fn toolset_for(catalog: Arc<Contracts>) -> Result<Toolset, ContractError> {
    let demo_tools: Vec<&str> =
        demo::TOOLS.iter().copied().filter(|t| catalog.get(t).is_none_or(|c| c.downstream.adapter != "mcp")).collect();
    let builder = Toolset::builder(catalog)
        .adapter("simulated", Arc::new(SimulatedAdapter))
        .adapter("http", Arc::new(HttpAdapter));
    #[cfg(feature = "mcp")]
    let builder = builder.adapter("mcp", Arc::new(crate::downstream::mcp::McpAdapter::default()));
    builder.domain(&demo_tools, &(Arc::new(demo::DemoDomain) as Arc<dyn ToolDomain>)).build()
}

/// The demo catalog with its domain and the simulated providers.
pub fn demo_toolset() -> Arc<Toolset> {
    static DEMO: std::sync::OnceLock<Arc<Toolset>> = std::sync::OnceLock::new();
    DEMO.get_or_init(|| {
        // The embedded catalog is part of the build; the unit test below loads it.
        let catalog = demo_catalog().expect("the embedded demo catalog loads");
        Arc::new(toolset_for(Arc::new(catalog)).expect("the demo catalog's adapters exist"))
    })
    .clone()
}

/// The JSON Schema of one catalog file as these adapters read it
/// (`toolgate catalog schema`, for editors): the engine's file schema with
/// the `http` and `mcp` adapters' sections in place of its open
/// `downstream.http` and `downstream.mcp`. The
/// shape only: the rules that span fields (a `write` tool's downstream
/// de-duplicates, a path argument is required, ...) are `catalog check`'s.
pub fn catalog_schema() -> serde_json::Value {
    use serde_json::{json, Value};
    let mut file = crate::engine::contracts::catalog_file_schema();
    #[cfg_attr(not(feature = "mcp"), allow(unused_mut))]
    let mut sections = vec![(
        "http",
        "HttpConfig",
        crate::downstream::http::http_section_schema(),
        "The http adapter's settings (only with `adapter: http`).",
    )];
    #[cfg(feature = "mcp")]
    sections.push((
        "mcp",
        "McpConfig",
        crate::downstream::mcp::mcp_section_schema(),
        "The mcp adapter's settings (only with `adapter: mcp`): the MCP server that runs the tool.",
    ));
    for (field, def, mut section, description) in sections {
        // The section schema's own definitions join the file's (the names differ).
        let own_defs = section.as_object_mut().and_then(|o| o.remove("$defs")).unwrap_or(Value::Null);
        for k in ["$schema", "title"] {
            if let Some(o) = section.as_object_mut() {
                o.remove(k);
            }
        }
        if let Some(defs) = file.get_mut("$defs").and_then(Value::as_object_mut) {
            if let Value::Object(h) = own_defs {
                for (k, v) in h {
                    defs.entry(k).or_insert(v);
                }
            }
            defs.insert(def.into(), section);
            if let Some(props) = defs.get_mut("DownstreamRef").and_then(|d| d.get_mut("properties")) {
                props[field] = json!({ "description": description, "$ref": format!("#/$defs/{def}") });
            }
        }
    }
    file
}

/// `--catalog DIR`: that directory's catalog, served like the demo's; the
/// built-in demo catalog without it.
pub fn load_toolset(dir: Option<&Path>) -> Result<Arc<Toolset>, ContractError> {
    match dir {
        None => Ok(demo_toolset()),
        Some(d) => {
            // The files' own problems and the adapters' problems with the
            // sections of the sound ones, in one report, by file.
            let (sound, mut problems) = Contracts::from_dir_partial(d)?;
            match toolset_for(Arc::new(sound)) {
                Ok(t) if problems.is_empty() => return Ok(Arc::new(t)),
                Ok(_) => {}
                Err(e) => problems.extend(e.into_problems()),
            }
            problems.sort_by(|a, b| problem_file(a).cmp(problem_file(b)));
            ContractError::all(problems)?;
            Err(ContractError::Unreadable("the catalog did not load".into()))
        }
    }
}

fn problem_file(e: &ContractError) -> &str {
    match e {
        ContractError::Invalid { file, .. } => file,
        _ => "",
    }
}

/// The engine options of the demo toolset: the defaults of
/// [`EngineOptions::new`] over [`demo_toolset`].
pub fn demo_options() -> EngineOptions {
    EngineOptions::new(demo_toolset())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_demo_catalog_loads_and_is_served() {
        let t = toolset_for(Arc::new(demo_catalog().unwrap())).unwrap();
        assert_eq!(t.catalog().all().len(), 3);
    }
}
