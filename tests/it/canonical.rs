//! RFC 8785 vectors and strict-parsing refusals.

use std::path::Path;

use toolgate::engine::canonical::{canonicalize_text, parse_strict, CanonicalError, MAX_DEPTH, MAX_INPUT_BYTES};

#[test]
fn every_rfc8785_vector_canonicalizes_exactly() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/it/fixtures/jcs");
    let mut n = 0;
    for entry in std::fs::read_dir(dir.join("input")).unwrap() {
        let entry = entry.unwrap();
        let input = std::fs::read(entry.path()).unwrap();
        let expected = std::fs::read(dir.join("output").join(entry.file_name())).unwrap();
        let got = canonicalize_text(&input).unwrap();
        assert_eq!(got.as_bytes(), expected.as_slice(), "vector {:?}", entry.file_name());
        n += 1;
    }
    assert_eq!(n, 6, "all six vectors ran");
}

#[test]
fn hostile_json_is_refused_with_a_reason() {
    let deep = "[".repeat(4096) + &"]".repeat(4096);
    assert!(matches!(parse_strict(deep.as_bytes(), MAX_INPUT_BYTES, MAX_DEPTH), Err(CanonicalError::TooDeep { .. })));
    let big = format!(r#"{{"a":"{}"}}"#, "x".repeat(2 * 1024 * 1024));
    assert!(matches!(parse_strict(big.as_bytes(), MAX_INPUT_BYTES, MAX_DEPTH), Err(CanonicalError::TooLarge { .. })));
    assert!(matches!(parse_strict(br#"{"a":1,"a":1}"#, 100, 4), Err(CanonicalError::DuplicateKey { .. })));
    assert!(parse_strict(b"NaN", 100, 4).is_err());
    assert!(parse_strict(br#"{"a":"\udc00"}"#, 100, 4).is_err());
    assert!(parse_strict(b"\"\xc3\x28\"", 100, 4).is_err());
}
