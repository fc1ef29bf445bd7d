//! The `toolgate` binary: parse and hand off to [`toolgate::cli`].

fn main() {
    std::process::exit(toolgate::cli::main());
}
