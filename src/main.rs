//! The `toolgate` binary: parse and hand off to [`toolgate::cli`].

/// mimalloc, not the system allocator: a dispatch makes several hundred
/// small allocations (rows, canonical texts, trace events), which cost about
/// a third as many instructions there (README, Performance). The library
/// leaves the choice to whoever embeds it.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
    std::process::exit(toolgate::cli::main());
}
