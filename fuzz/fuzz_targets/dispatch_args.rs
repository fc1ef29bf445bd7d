//! Argument parsing and canonicalization: the command line (split on NUL bytes)
//! never panics, and any JSON text the strict parser accepts canonicalizes
//! idempotently and passes the contract check without panicking.
#![no_main]

use clap::Parser as _;
use libfuzzer_sys::fuzz_target;
use toolgate::cli::Cli;
use toolgate::engine::canonical::{canonical_string, canonicalize_text, parse_strict, MAX_DEPTH, MAX_INPUT_BYTES};

fuzz_target!(|data: &[u8]| {
    // The CLI: argv is the input split on NUL.
    let argv = std::iter::once("toolgate".to_string())
        .chain(data.split(|b| *b == 0).map(|a| String::from_utf8_lossy(a).into_owned()));
    let _ = Cli::try_parse_from(argv);

    // Tool arguments.
    if let Ok(v) = parse_strict(data, MAX_INPUT_BYTES, MAX_DEPTH) {
        let c = canonical_string(&v);
        assert_eq!(canonicalize_text(c.as_bytes()).as_deref(), Ok(c.as_str()), "canonical form is a fixed point");
        if let Ok(contracts) = toolgate::tools::demo_catalog() {
            for tool in ["create_refund", "notify_customer", "get_order"] {
                if let Some(contract) = contracts.get(tool) {
                    let _ = contract.check_input(&v);
                }
            }
        }
    }
});
