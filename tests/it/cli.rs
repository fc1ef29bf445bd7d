//! The CLI contract.
