//! status_ref: verification never panics and never accepts a string that was not
//! minted under the key; a minted one always verifies.
#![no_main]

use libfuzzer_sys::fuzz_target;
use toolgate::engine::canonical::StatusRefKey;

fuzz_target!(|data: &[u8]| {
    let key = StatusRefKey::new(b"fuzz secret");
    let s = String::from_utf8_lossy(data);
    if key.verify(&s).is_ok() {
        // Only a minted value can verify: its nonce must mint to exactly it.
        let nonce = hex_nonce(&s).expect("a verified status_ref has a hex nonce");
        assert_eq!(key.mint(nonce), s, "verified but not minted");
    }
    if data.len() >= 16 {
        let mut nonce = [0u8; 16];
        nonce.copy_from_slice(&data[..16]);
        assert!(key.verify(&key.mint(nonce)).is_ok());
    }
});

fn hex_nonce(s: &str) -> Option<[u8; 16]> {
    let body = s.strip_prefix("sr1_")?;
    let mut out = [0u8; 16];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(body.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}
