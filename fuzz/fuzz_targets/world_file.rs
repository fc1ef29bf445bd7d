//! World files: parsing and checking a hostile world file never panics; a file
//! that is accepted survives a serialize/parse round trip.
#![no_main]

use libfuzzer_sys::fuzz_target;
use toolgate::engine::world::World;

fuzz_target!(|data: &[u8]| {
    // The demo toolset's domain checks its own section (orders) too.
    let tools = toolgate::tools::demo_toolset();
    if let Ok(w) = World::parse_checked("world file", data, &tools) {
        let text = serde_json::to_vec(&w).expect("an accepted world serializes");
        assert!(World::parse_checked("world file", &text, &tools).is_ok(), "an accepted world re-parses");
    }
});
