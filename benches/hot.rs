//! The CPU-only pieces every call pays for, each on its own: strict parsing and
//! RFC 8785 canonicalization, the request / result / call-binding digests, JSON
//! Schema validation (schemas compiled once, at start-up), and `status_ref`
//! minting and checking.
//!
//! `cargo bench --bench hot`

use criterion::{black_box, criterion_group, criterion_main, Criterion};
use toolgate::engine::canonical::{
    call_binding_sha256, canonical_string, parse_strict, request_object, sha256_hex, BindingInput, CallIdentity,
    Revisions, StatusRefKey, MAX_DEPTH, MAX_INPUT_BYTES,
};

const ARGS: &[u8] = br#"{"reason":"damaged","currency":"EUR","amount_minor":1000,"order_ref":"ord_1001"}"#;
const RESULT: &str = r#"{"amount_minor":1000,"currency":"EUR","order_ref":"ord_1001","refund_id":"re_0123456789abcdef","status":"succeeded"}"#;

fn call() -> CallIdentity {
    CallIdentity {
        provider: "openai".into(),
        api_family: "responses".into(),
        response_id: "resp_0123456789abcdef".into(),
        call_id: "call_0123456789abcdef".into(),
        adapter_revision: "1".into(),
    }
}

fn canonical(c: &mut Criterion) {
    let rev = Revisions { input: 1, output: 1, effect: 1 };
    c.bench_function("parse_strict_arguments", |b| {
        b.iter(|| parse_strict(black_box(ARGS), MAX_INPUT_BYTES, MAX_DEPTH).expect("valid"));
    });
    let args = parse_strict(ARGS, MAX_INPUT_BYTES, MAX_DEPTH).expect("valid");
    c.bench_function("request_sha256", |b| {
        b.iter(|| {
            let request = request_object("acme", "agent_ana", "create_refund", black_box(&args), rev);
            sha256_hex(canonical_string(&request).as_bytes())
        });
    });
    let result = parse_strict(RESULT.as_bytes(), MAX_INPUT_BYTES, MAX_DEPTH).expect("valid");
    c.bench_function("result_canonical_and_sha256", |b| {
        b.iter(|| sha256_hex(canonical_string(black_box(&result)).as_bytes()));
    });
    c.bench_function("stored_json_recheck", |b| {
        // What verifying a stored row costs per JSON column: parse, re-canonicalize, compare.
        b.iter(|| {
            let v = parse_strict(black_box(RESULT).as_bytes(), usize::MAX, 256).expect("valid");
            canonical_string(&v) == RESULT
        });
    });
    let call = call();
    let digest = "5e0c7a1d9b3f42e8a6c1d0b9e8f7a6b5c4d3e2f1a0b9c8d7e6f5a4b3c2d1e0f9";
    c.bench_function("call_binding_sha256", |b| {
        b.iter(|| {
            call_binding_sha256(black_box(&BindingInput {
                tenant: "acme",
                subject: "agent_ana",
                call: &call,
                operation_id: "op_0123456789abcdef0123",
                idempotency_key: "refund-0001",
                revisions: rev,
                request_sha256: digest,
                result_sha256: Some(digest),
                downstream_request_id: Some("dreq_0123456789abcdef"),
                receipt_id: Some("rcpt_0123456789abcdef"),
                status_ref: "sr1_00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff",
            }))
        });
    });
}

fn schemas(c: &mut Criterion) {
    let contracts = toolgate::tools::demo_catalog().expect("contracts");
    let refund = contracts.get("create_refund").expect("create_refund");
    let args = parse_strict(ARGS, MAX_INPUT_BYTES, MAX_DEPTH).expect("valid");
    let result = parse_strict(RESULT.as_bytes(), MAX_INPUT_BYTES, MAX_DEPTH).expect("valid");
    c.bench_function("schema_check_input", |b| b.iter(|| refund.check_input(black_box(&args)).is_ok()));
    c.bench_function("schema_check_output", |b| b.iter(|| refund.check_output(black_box(&result)).is_ok()));
    let bad = parse_strict(br#"{"order_ref":"x","amount_minor":-1}"#, MAX_INPUT_BYTES, MAX_DEPTH).expect("valid");
    c.bench_function("schema_check_input_violation", |b| b.iter(|| refund.check_input(black_box(&bad)).is_err()));
}

fn status_ref(c: &mut Criterion) {
    let key = StatusRefKey::new(b"0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef");
    c.bench_function("status_ref_mint", |b| b.iter(|| key.mint(black_box([7; 16]))));
    let good = key.mint([7; 16]);
    c.bench_function("status_ref_verify", |b| b.iter(|| key.verify(black_box(&good)).is_ok()));
    c.bench_function("status_ref_verify_malformed", |b| b.iter(|| key.verify(black_box("sr1_nope")).is_err()));
}

criterion_group!(benches, canonical, schemas, status_ref);
criterion_main!(benches);
