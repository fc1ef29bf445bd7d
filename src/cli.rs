//! The command line (docs/design.md §15). A stable contract: `--json` prints one JSON
//! document; exit codes are 0 ok, 1 the call's result is a failure or unknown,
//! 2 usage or environment error. Errors print a stable code and a message, never
//! a backtrace or a local path.

use std::ffi::OsString;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use clap::{Args, Parser, Subcommand, ValueEnum};
use serde_json::{json, Value};

use crate::downstream::FaultPlan;
use crate::engine::canonical::CallIdentity;
use crate::engine::clock::{parse_rfc3339, rfc3339, Clock, ManualClock, SystemClock};
use crate::engine::envelope::Envelope;
use crate::engine::projection::{Projection, UnknownProjection, QUERY_STATUS_TOOL};
use crate::engine::world::{World, DEMO_WORLD};
use crate::engine::{
    fresh_call_identity, BulkAction, BulkTarget, DispatchRequest, Engine, EngineError, EngineOptions, QueryRequest,
    Resolution, ResolveRequest,
};
use crate::store::{AttemptOutcome, Location};

/// `print!` through [`write_stdout`]: never panics on a closed pipe.
macro_rules! out {
    ($($t:tt)*) => { write_stdout(&format!($($t)*)) };
}

/// `println!` through [`write_stdout`]: never panics on a closed pipe.
macro_rules! outln {
    () => { write_stdout("\n") };
    ($($t:tt)*) => { write_stdout(&format!("{}\n", format_args!($($t)*))) };
}

/// toolgate: a durable tool-call dispatcher. Exactly one business effect per
/// intent, and an explicit way out of OUTCOME_UNKNOWN.
#[derive(Debug, Parser)]
#[command(name = "toolgate", version, about, long_about = None)]
pub struct Cli {
    /// The ledger database: a SQLite file, or a PostgreSQL URL
    /// (`postgres://USER@HOST[:PORT]/DB`, also `postgresql://`).
    #[arg(long, global = true, value_name = "PATH|URL", env = "TOOLGATE_DB")]
    pub db: Option<PathBuf>,
    /// Fix the clock at this instant (RFC 3339), for tests and scripted demos.
    #[arg(long, global = true, value_name = "RFC3339")]
    pub now: Option<String>,
    /// Operator identity for operator actions.
    #[arg(long, global = true, value_name = "NAME")]
    pub operator: Option<String>,
    /// Refuse every state-changing action.
    #[arg(long, global = true)]
    pub read_only: bool,
    /// The tool catalog: a directory with one JSON file per tool (see
    /// assets/catalog/); the built-in demo catalog when absent.
    #[arg(long, global = true, value_name = "DIR")]
    pub catalog: Option<PathBuf>,
    /// Command (the console opens when none is given, once it lands).
    #[command(subcommand)]
    pub command: Option<Command>,
}

/// `toolgate provider ...`.
#[derive(Debug, Subcommand)]
pub enum ProviderCommand {
    /// Serve the simulated providers over HTTP (loopback only unless --public)
    /// until Ctrl-C or SIGTERM; prints `listening on ADDR` once bound. The
    /// provider's own database (a SQLite file, created when missing) is
    /// `--db PATH`.
    Serve {
        /// Address to listen on (port 0: any free port).
        #[arg(long, default_value = "127.0.0.1:8081")]
        listen: std::net::SocketAddr,
        /// The same as `--db` (the name earlier versions took).
        #[arg(long = "provider-db", value_name = "PATH")]
        provider_db: Option<PathBuf>,
        /// Allow a non-loopback address.
        #[arg(long)]
        public: bool,
        /// Faults for requests without a Toolgate-Fault header: a script
        /// (`rate_limit(2000),ok`) or a rate (`random(0.05,seed=7)`).
        #[arg(long, value_name = "SPEC")]
        faults: Option<String>,
        /// Answer 401 to every request without `Authorization: Bearer TOKEN`
        /// (a simulated rotated API key).
        #[arg(long, value_name = "TOKEN")]
        require_bearer: Option<String>,
    },
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// The simulated payments and notifications providers over HTTP.
    Provider {
        /// What to do.
        #[command(subcommand)]
        what: ProviderCommand,
    },
    /// Bearer tokens for `toolgate serve`: create (printed once), list, revoke.
    Token {
        /// What to do.
        #[command(subcommand)]
        what: TokenCommand,
    },
    /// Serve the HTTP API for agents and operators (loopback only unless
    /// --public) until Ctrl-C or SIGTERM; prints `listening on http://ADDR`
    /// once bound. Runs the outbox workers and the reaper in the same process.
    Serve(ServeArgs),
    /// Serve the catalog as Model Context Protocol tools on standard input and
    /// output, as the agent the token names (checked at every call).
    Mcp {
        /// An agent's (subject) bearer token from `token create`.
        #[arg(long, env = "TOOLGATE_TOKEN", hide_env_values = true)]
        token: String,
        /// Calls the session runs at once (one engine each, 1 to 64); a
        /// cancellation has an engine of its own and never waits behind them.
        #[arg(long, default_value_t = 2)]
        concurrency: usize,
        /// Calls that may wait for a free engine (1 to 4096); beyond it a call
        /// is answered SERVER_BUSY at once.
        #[arg(long, default_value_t = 64)]
        queue: usize,
        /// At SIGTERM, SIGINT or the end of input: how long (ms, up to 60000)
        /// calls in flight may run on before they are detached (moved out of
        /// in_flight: cancelled before send, or to the unknown queue).
        #[arg(long, default_value_t = 3000)]
        grace_ms: u64,
    },
    /// Create a database and load a world file (the demo world by default).
    Init {
        /// World file (JSON); the demo world when absent.
        #[arg(long, value_name = "FILE")]
        world: Option<PathBuf>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Dispatch one tool call and print its envelope.
    Dispatch(DispatchArgs),
    /// Explicit status query for an operation (never executes the tool).
    Query(QueryArgs),
    /// Approve a pending approval request; the held call then runs. With
    /// `--all`: every pending request the selection matches, one by one.
    Approve {
        /// Approval id.
        #[arg(required_unless_present = "all", conflicts_with = "all")]
        approval_id: Option<String>,
        /// Approver (must be on the tenant's allowlist, not the requester).
        #[arg(long)]
        approver: String,
        /// With `--all`: only this tenant's requests.
        #[arg(long, requires = "all")]
        tenant: Option<String>,
        /// Which requests (`--all`).
        #[command(flatten)]
        select: SelectArgs,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Deny a pending approval request (or, with `--all`, every one the selection matches).
    Deny {
        /// Approval id.
        #[arg(required_unless_present = "all", conflicts_with = "all")]
        approval_id: Option<String>,
        /// Approver.
        #[arg(long)]
        approver: String,
        /// Why (mandatory; with `--all`, shared by every audit entry).
        #[arg(long)]
        note: String,
        /// With `--all`: only this tenant's requests.
        #[arg(long, requires = "all")]
        tenant: Option<String>,
        /// Which requests (`--all`).
        #[command(flatten)]
        select: SelectArgs,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// List pending approval requests with their expiry.
    Approvals {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Resolve an unknown / needs_review operation by a human decision.
    Resolve(ResolveArgs),
    /// Cancel an accepted or in-flight operation (needs --operator): before send it
    /// is cancelled (no effect, terminal); after send the effect cannot be undone
    /// and it moves to the unknown queue.
    Cancel(CancelArgs),
    /// Simulated agents against the database, like real harnesses (retries with
    /// the same key, status queries after unknown, conflicting re-sends), with a
    /// progress bar and a final table.
    Load(LoadArgs),
    /// The classroom lab (demo databases only): list the "defenses off" toggles,
    /// switch one on, or put every defense back.
    Lab(LabArgs),
    /// Operations: list or show one (record, bindings, trace).
    Ops {
        /// What to do.
        #[command(subcommand)]
        what: OpsCommand,
    },
    /// Counts: operations and outbox rows by state, effects, duplicates.
    Counts {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Tenants after `init`: add one, disable it (every subject of it is
    /// refused SUBJECT_DISABLED) or enable it again. Each change is in the
    /// operator log (`--operator NAME`, else $USER).
    Tenant {
        /// What to do.
        #[command(subcommand)]
        what: TenantCommand,
    },
    /// Subjects after `init`: add one to a tenant, disable it (its calls are
    /// refused SUBJECT_DISABLED; its grants and operations are kept) or
    /// enable it again. Each change is in the operator log.
    Subject {
        /// What to do.
        #[command(subcommand)]
        what: SubjectCommand,
    },
    /// Grant a tool to a subject.
    Grant(GrantArgs),
    /// Revoke a tool from a subject (effective at the next check).
    Revoke(GrantArgs),
    /// List orders.
    Orders {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Reaper pass: expired leases, then the retention purge (terminal operations
    /// past their retention that no person acted on; each leaves a tombstone).
    Reap {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// The ledger's one clock: where ledger time comes from, this host's
    /// offset to it, and whether reaping and purging are paused.
    Clock {
        /// On SQLite: make this host's wall clock ledger time (after a jump
        /// that an operator checked was a correction).
        #[arg(long)]
        accept: bool,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Worker pass: run every due outbox row.
    Work {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// The scenarios of docs/design.md §13 as scripts: list them, or run them on fresh databases.
    Scenario {
        /// What to do.
        #[command(subcommand)]
        what: ScenarioCommand,
    },
    /// Generate the demo database deterministically (the committed `demo.db`).
    DemoDb {
        /// Where to write it (must not exist).
        #[arg(long, value_name = "PATH")]
        out: PathBuf,
        /// Seed for ids and secrets.
        #[arg(long, default_value_t = crate::demo::DEMO_SEED)]
        seed: u64,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// The console on a working copy of the demo database, with simulated agents
    /// dispatching refunds (a few with faults) so the panes move. With `--db
    /// PATH`: a new working copy at PATH (kept after the console closes), or
    /// PATH itself when it already is a demo database; any other file is
    /// refused (NOT_A_DEMO_DB). Interactive: no `--json`.
    Demo {
        /// Agents in the load generator.
        #[arg(long, default_value_t = 2)]
        agents: usize,
    },
    /// Integrity and semantic audit of the database (or `--log`: the operator log).
    Audit {
        /// List the operator log instead.
        #[arg(long)]
        log: bool,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Export the trace, one event per pipeline step (tenant and subject only as
    /// salted hashes, arguments only as a digest).
    Trace(TraceArgs),
    /// Metrics computed from the database: the Prometheus text format, JSON, or a
    /// `/metrics` endpoint (`--listen`).
    Metrics(MetricsArgs),
    /// Measure the engine against bare SQLite loops making the same commits,
    /// side by side on one temporary disk, at synchronous=FULL and NORMAL.
    Bench {
        /// A short smoke run (one small round), not a measurement.
        #[arg(long)]
        quick: bool,
        /// Print JSON.
        #[arg(long)]
        json: bool,
        /// Where to make the temporary directory (removed at the end).
        #[arg(long, value_name = "PATH")]
        dir: Option<PathBuf>,
        /// Also measure the HTTP API: fresh and replayed calls through
        /// `toolgate serve` (in this process, on a loopback port) against the
        /// in-process engine's, at synchronous=FULL.
        #[arg(long)]
        http: bool,
    },
}

/// `token` subcommands.
#[derive(Debug, Subcommand)]
pub enum TokenCommand {
    /// Make a token for a subject (`--tenant T --subject S`) or, with the
    /// global `--operator NAME`, for an operator in some tenants (`--tenant
    /// T`, repeatable) or in every tenant (`--all-tenants`, said explicitly).
    /// The token is printed once: the ledger keeps only a digest of it.
    Create {
        /// Tenant of the subject; for an operator, a tenant it may act in (repeatable).
        #[arg(long)]
        tenant: Vec<String>,
        /// Subject the token acts for.
        #[arg(long, requires = "tenant")]
        subject: Option<String>,
        /// An operator token for every tenant (instead of `--tenant`).
        #[arg(long, conflicts_with_all = ["tenant", "subject"])]
        all_tenants: bool,
        /// A label shown in `token list`.
        #[arg(long)]
        name: Option<String>,
        /// Expiry (RFC 3339); none by default.
        #[arg(long, value_name = "RFC3339")]
        expires: Option<String>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// List tokens (id, prefix, whom it is for, expiry, revocation; never a secret).
    List {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Revoke a token: the next request that carries it is refused (TOKEN_REVOKED).
    Revoke {
        /// Token id (`tok_…`, from `token list`).
        id: String,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
}

/// `tenant` subcommands.
#[derive(Debug, Subcommand)]
pub enum TenantCommand {
    /// Add a tenant (it has no subject yet: `toolgate subject add`).
    Add {
        /// Tenant id (1 to 128 of A-Z a-z 0-9 _ - . @ :).
        name: String,
        /// An approver of the tenant's approvals (repeatable).
        #[arg(long = "approver")]
        approvers: Vec<String>,
        /// Amounts above this need an approval under an `above_threshold`
        /// tool (0, the default: every amount above zero does).
        #[arg(long, default_value_t = 0)]
        approval_threshold_minor: i64,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Disable a tenant: every call of its subjects is refused SUBJECT_DISABLED.
    Disable(PrincipalArgs),
    /// Enable a disabled tenant again.
    Enable(PrincipalArgs),
}

/// `subject` subcommands.
#[derive(Debug, Subcommand)]
pub enum SubjectCommand {
    /// Add a subject to a tenant (no grant yet: `toolgate grant`).
    Add(SubjectArgs),
    /// Disable a subject: its calls are refused SUBJECT_DISABLED (a subject
    /// is never deleted: its operations and the operator log name it).
    Disable(SubjectArgs),
    /// Enable a disabled subject again (its grants are as they were).
    Enable(SubjectArgs),
}

/// `tenant disable` / `tenant enable` arguments.
#[derive(Debug, Args)]
pub struct PrincipalArgs {
    /// Tenant id.
    pub name: String,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

/// `subject add|disable|enable` arguments.
#[derive(Debug, Args)]
pub struct SubjectArgs {
    /// Tenant of the subject.
    #[arg(long)]
    pub tenant: String,
    /// Subject id (1 to 128 of A-Z a-z 0-9 _ - . @ :).
    pub name: String,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

/// `serve` arguments.
#[derive(Debug, Args)]
pub struct ServeArgs {
    /// Address to listen on (port 0: any free port).
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub listen: std::net::SocketAddr,
    /// Allow a non-loopback address.
    #[arg(long)]
    pub public: bool,
    /// Engine threads answering requests (each owns its own connections).
    #[arg(long, default_value_t = 4)]
    pub threads: usize,
    /// Connections served at once; more wait in the kernel's accept queue.
    #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u32).range(1..=65_536))]
    pub max_connections: u32,
    /// Connections served at once from one client address; more are answered
    /// 429 TOO_MANY_CONNECTIONS and closed (clients behind one proxy or NAT
    /// share an address: raise it there).
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..=65_536))]
    pub max_connections_per_client: u32,
}

// The defaults written in `ServeArgs` are the server's own.
const _: () = assert!(crate::api::MAX_CONNECTIONS == 1024 && crate::api::MAX_CONNECTIONS_PER_CLIENT == 256);

/// `trace` arguments.
#[derive(Debug, Args)]
pub struct TraceArgs {
    /// Only events at or after this time (RFC 3339).
    #[arg(long, value_name = "RFC3339")]
    pub since: Option<String>,
    /// Only the events of one operation.
    #[arg(long, value_name = "ID")]
    pub operation: Option<String>,
    /// `jsonl`: one JSON object per line with stable field names; `text`: for people.
    #[arg(long, value_enum, default_value_t = TraceFormatArg::Text)]
    pub format: TraceFormatArg,
    /// The same as `--format jsonl`.
    #[arg(long, conflicts_with = "format")]
    pub json: bool,
}

/// `trace --format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum TraceFormatArg {
    /// One line per event.
    Text,
    /// JSON lines.
    Jsonl,
}

/// `metrics` arguments.
#[derive(Debug, Args)]
pub struct MetricsArgs {
    /// Output format.
    #[arg(long, value_enum, default_value_t = MetricsFormatArg::Prometheus)]
    pub format: MetricsFormatArg,
    /// The same as `--format json`.
    #[arg(long, conflicts_with = "format")]
    pub json: bool,
    /// Serve `GET /metrics` on this address (e.g. 127.0.0.1:9464; port 0 picks a
    /// free one) until killed, instead of printing once.
    #[arg(long, value_name = "ADDR")]
    pub listen: Option<String>,
    /// Window of the rates and windowed percentiles (JSON), in minutes.
    #[arg(long, default_value_t = 15)]
    pub window_minutes: i64,
    /// Rate bucket length, in minutes.
    #[arg(long, default_value_t = 1)]
    pub bucket_minutes: i64,
    /// Only this tool.
    #[arg(long)]
    pub tool: Option<String>,
    /// Only this tenant (matched by its salted hash; labels show the hash).
    #[arg(long)]
    pub tenant: Option<String>,
    /// Only tools of this risk.
    #[arg(long)]
    pub risk: Option<String>,
    /// Only this tool version (`input.output.effect` revisions, e.g. 1.1.1).
    #[arg(long)]
    pub tool_version: Option<String>,
}

/// `metrics --format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum MetricsFormatArg {
    /// The Prometheus text exposition format.
    Prometheus,
    /// The whole snapshot as JSON (rates per bucket, percentiles per tool).
    Json,
}

/// `ops` subcommands.
#[derive(Debug, Subcommand)]
pub enum OpsCommand {
    /// List operations, newest first.
    List {
        /// Only this state.
        #[arg(long)]
        state: Option<String>,
        /// At most this many.
        #[arg(long, default_value_t = 50)]
        limit: i64,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Show one operation: record, bindings, attempts, trace timeline, operator log.
    Show {
        /// Operation id.
        operation_id: String,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
}

/// `scenario` subcommands.
#[derive(Debug, Subcommand)]
pub enum ScenarioCommand {
    /// List the built-in scenarios.
    List {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Run scenarios step by step, each on a fresh database, and check every step
    /// against its script. Exits 1 when any step fails.
    Run {
        /// A scenario number, or `all`.
        #[arg(required_unless_present = "file", conflicts_with = "file")]
        target: Option<String>,
        /// Run this scenario file instead of a built-in one.
        #[arg(long, value_name = "FILE")]
        file: Option<PathBuf>,
        /// Leave the database at PATH (for several scenarios: a directory, one
        /// `scenario-NN.db` each). PATH must not exist yet.
        #[arg(long, value_name = "PATH")]
        keep_db: Option<PathBuf>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
}

/// A call identity on the command line (`dispatch` and `query`): each part
/// absent is fresh, so a harness names the parts it needs to retry under.
#[derive(Debug, Args)]
pub struct CallArgs {
    /// Call identity: call id (fresh when absent).
    #[arg(long)]
    pub call_id: Option<String>,
    /// Call identity: response id.
    #[arg(long)]
    pub response_id: Option<String>,
    /// Call identity: provider.
    #[arg(long)]
    pub provider: Option<String>,
    /// Call identity: API family.
    #[arg(long)]
    pub api_family: Option<String>,
    /// Call identity: adapter revision.
    #[arg(long)]
    pub adapter_revision: Option<String>,
}

impl CallArgs {
    /// The call identity, fresh where a part was not given.
    fn identity(&self) -> CallIdentity {
        let fresh = fresh_call_identity();
        CallIdentity {
            provider: self.provider.clone().unwrap_or(fresh.provider),
            api_family: self.api_family.clone().unwrap_or(fresh.api_family),
            response_id: self.response_id.clone().unwrap_or(fresh.response_id),
            call_id: self.call_id.clone().unwrap_or(fresh.call_id),
            adapter_revision: self.adapter_revision.clone().unwrap_or(fresh.adapter_revision),
        }
    }
}

/// `dispatch` arguments.
#[derive(Debug, Args)]
pub struct DispatchArgs {
    /// Tenant.
    #[arg(long)]
    pub tenant: String,
    /// Subject.
    #[arg(long)]
    pub subject: String,
    /// Tool name.
    #[arg(long)]
    pub tool: String,
    /// Arguments as JSON text; `-` reads standard input.
    #[arg(long, value_name = "JSON")]
    pub args: Option<OsString>,
    /// Read the arguments from a file.
    #[arg(long, value_name = "FILE", conflicts_with = "args")]
    pub args_file: Option<PathBuf>,
    /// Idempotency key (8..255 chars), stable per business intent.
    #[arg(long)]
    pub key: Option<String>,
    /// The call identity.
    #[command(flatten)]
    pub call: CallArgs,
    /// An approval the caller holds.
    #[arg(long)]
    pub approval_id: Option<String>,
    /// Operation deadline in milliseconds from now.
    #[arg(long)]
    pub deadline_ms: Option<u64>,
    /// Downstream faults for this call's attempts, e.g. `rate_limit(2000),ok`.
    #[arg(long)]
    pub fault: Option<String>,
    /// Print only the model-facing result as this provider's tool-result message:
    /// openai-responses, openai-chat, anthropic or gemini (JSON; the call id is `--call-id`).
    #[arg(long, value_name = "PROVIDER")]
    pub project: Option<String>,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

/// Bulk selection (`--all`): every operation or approval the flags match, each
/// acted on by its own engine call (its own audit entry); one refusal does not
/// stop the rest. `--dry-run` lists what would be touched and changes nothing.
#[derive(Debug, Args)]
pub struct SelectArgs {
    /// Act on every row the selection matches instead of one.
    #[arg(long)]
    pub all: bool,
    /// Only these states, comma-separated (`outcome_unknown` is `unknown`);
    /// operations only. Default for query and resolve: unknown,needs_review.
    #[arg(long, value_delimiter = ',', requires = "all", value_name = "STATE")]
    pub state: Vec<String>,
    /// Only this tool.
    #[arg(long = "tool", requires = "all", value_name = "TOOL")]
    pub select_tool: Option<String>,
    /// Only rows in their state (approvals: asked) at least this long: 30s, 5m, 2h, 1d.
    #[arg(long, requires = "all", value_name = "DURATION")]
    pub older_than: Option<String>,
    /// List what would be touched; change nothing.
    #[arg(long, requires = "all")]
    pub dry_run: bool,
}

/// `query` arguments.
#[derive(Debug, Args)]
pub struct QueryArgs {
    /// Tenant of the caller (with `--all`: only this tenant's operations).
    #[arg(long, required_unless_present = "all")]
    pub tenant: Option<String>,
    /// Subject of the caller.
    #[arg(long, required_unless_present = "all", conflicts_with = "all")]
    pub subject: Option<String>,
    /// The opaque status_ref from the envelope.
    #[arg(long, required_unless_present = "all", conflicts_with = "all")]
    pub status_ref: Option<String>,
    /// The request digest the caller expects.
    #[arg(long = "expect-sha256", required_unless_present = "all", conflicts_with = "all")]
    pub expect_sha256: Option<String>,
    /// Every operation the selection matches, queried as `--operator` (`--all`).
    #[command(flatten)]
    pub select: SelectArgs,
    /// The idempotency key, to check the scope too.
    #[arg(long)]
    pub key: Option<String>,
    /// The query's own call identity (bound to the purpose `query_status`:
    /// retry a query under the same identity; reusing a dispatch's is CALL_ID_CONFLICT).
    #[command(flatten)]
    pub call: CallArgs,
    /// Print only the model-facing result as this provider's tool-result message
    /// (see `dispatch --project`; the tool is `query_operation_status`).
    #[arg(long, value_name = "PROVIDER", conflicts_with = "all")]
    pub project: Option<String>,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

/// Resolution choices.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum ResolveAs {
    /// The effect happened (needs --evidence RECEIPT_ID).
    Succeeded,
    /// No effect.
    Failed,
    /// The effect happened and was undone.
    Compensated,
}

/// `resolve` arguments.
#[derive(Debug, Args)]
pub struct ResolveArgs {
    /// Operation id.
    #[arg(required_unless_present = "all", conflicts_with = "all")]
    pub operation_id: Option<String>,
    /// With `--all`: only this tenant's operations.
    #[arg(long, requires = "all")]
    pub tenant: Option<String>,
    /// Every operation the selection matches (`--all`; failed or compensated only).
    #[command(flatten)]
    pub select: SelectArgs,
    /// The decision.
    #[arg(long = "as", value_enum)]
    pub resolution: ResolveAs,
    /// Receipt id (mandatory for succeeded).
    #[arg(long)]
    pub evidence: Option<String>,
    /// Apply the decision although the provider's evidence contradicts it
    /// (the status query the engine runs first); the audit entry records it.
    #[arg(long)]
    pub against_evidence: bool,
    /// State that there is no evidence either way: needed to resolve as
    /// failed a tool whose downstream has no lookup, where
    /// nothing can show that the call had no effect; the operator log records it.
    #[arg(long)]
    pub no_evidence: bool,
    /// Note, version seen, action id.
    #[command(flatten)]
    pub act: OperatorActArgs,
}

/// What every operator action on an operation carries (`resolve`, `cancel`).
#[derive(Debug, Args)]
pub struct OperatorActArgs {
    /// Why (mandatory).
    #[arg(long)]
    pub note: String,
    /// The version you saw (refused if the operation changed since).
    #[arg(long)]
    pub seen_version: Option<i64>,
    /// This action's own id (repeating it is harmless).
    #[arg(long)]
    pub action_id: Option<String>,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

/// `grant` / `revoke` arguments.
#[derive(Debug, Args)]
pub struct GrantArgs {
    /// Tenant.
    #[arg(long)]
    pub tenant: String,
    /// Subject.
    #[arg(long)]
    pub subject: String,
    /// Tool.
    #[arg(long)]
    pub tool: String,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

/// A CLI failure: stable code + message, exit 2.
#[derive(Debug)]
pub struct CliError {
    code: String,
    message: String,
    json: bool,
}

impl CliError {
    fn new(code: &str, message: impl Into<String>) -> Self {
        Self { code: code.to_string(), message: message.into(), json: false }
    }
}

impl From<EngineError> for CliError {
    fn from(e: EngineError) -> Self {
        Self::new(e.code(), e.to_string())
    }
}

/// Runs the CLI with the process arguments; returns the exit code.
pub fn main() -> i32 {
    // A panic (there should be none) prints a short report, never the build
    // machine's source paths or a backtrace. The console wraps this hook with
    // its own, which restores the terminal first.
    std::panic::set_hook(Box::new(|info| {
        eprintln!(
            "error[INTERNAL]: toolgate hit an internal error (a bug). Please report it with the command you ran."
        );
        // For whoever debugs toolgate itself: the panic's own words, on request only.
        if std::env::var_os("TOOLGATE_PANIC_DETAIL").is_some() {
            eprintln!("{info}");
        }
    }));
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let code = if e.use_stderr() { 2 } else { 0 };
            let _ = e.print();
            return code;
        }
    };
    let wants_json = command_wants_json(cli.command.as_ref());
    match run(&cli) {
        Ok(code) => code,
        Err(mut e) => {
            e.json |= wants_json;
            if e.json {
                outln!("{}", json!({"error": {"code": e.code, "message": e.message}}));
            } else {
                eprintln!("error[{}]: {}", e.code, e.message);
            }
            2
        }
    }
}

fn command_wants_json(c: Option<&Command>) -> bool {
    match c {
        Some(
            Command::Init { json, .. }
            | Command::Approve { json, .. }
            | Command::Deny { json, .. }
            | Command::Approvals { json }
            | Command::Counts { json }
            | Command::Orders { json }
            | Command::Reap { json }
            | Command::Clock { json, .. }
            | Command::Work { json }
            | Command::Audit { json, .. }
            | Command::Bench { json, .. },
        ) => *json,
        Some(Command::DemoDb { json, .. }) => *json,
        Some(Command::Demo { .. } | Command::Provider { .. } | Command::Serve(_) | Command::Mcp { .. }) => false,
        Some(Command::Token {
            what: TokenCommand::Create { json, .. } | TokenCommand::List { json } | TokenCommand::Revoke { json, .. },
        }) => *json,
        Some(Command::Dispatch(a)) => a.json,
        Some(Command::Query(a)) => a.json,
        Some(Command::Resolve(a)) => a.act.json,
        Some(Command::Cancel(a)) => a.act.json,
        Some(Command::Load(a)) => a.json,
        Some(Command::Lab(a)) => a.json,
        Some(Command::Grant(a) | Command::Revoke(a)) => a.json,
        Some(Command::Tenant { what: TenantCommand::Add { json, .. } }) => *json,
        Some(Command::Tenant { what: TenantCommand::Disable(a) | TenantCommand::Enable(a) }) => a.json,
        Some(Command::Subject {
            what: SubjectCommand::Add(a) | SubjectCommand::Disable(a) | SubjectCommand::Enable(a),
        }) => a.json,
        Some(Command::Ops { what: OpsCommand::List { json, .. } | OpsCommand::Show { json, .. } }) => *json,
        Some(Command::Scenario { what: ScenarioCommand::List { json } | ScenarioCommand::Run { json, .. } }) => *json,
        Some(Command::Trace(a)) => a.json || a.format == TraceFormatArg::Jsonl,
        Some(Command::Metrics(a)) => a.json || a.format == MetricsFormatArg::Json,
        None => false,
    }
}

fn clock_from(now: Option<&str>) -> Result<Arc<dyn Clock>, CliError> {
    match now {
        None => Ok(Arc::new(SystemClock)),
        Some(s) => parse_rfc3339(s)
            .map(|ms| Arc::new(ManualClock::new(ms)) as Arc<dyn Clock>)
            .ok_or_else(|| CliError::new("BAD_TIME", "--now must be an RFC 3339 time, e.g. 2026-01-01T00:00:00Z")),
    }
}

fn db_path(cli: &Cli) -> Result<&Path, CliError> {
    cli.db.as_deref().ok_or_else(|| CliError::new("DB_REQUIRED", "--db PATH is required for this command"))
}

/// The engine options of a command: its clock and its catalog (`--catalog`).
fn engine_options(cli: &Cli) -> Result<EngineOptions, CliError> {
    let clock = clock_from(cli.now.as_deref())?;
    let toolset = crate::tools::load_toolset(cli.catalog.as_deref()).map_err(EngineError::from)?;
    Ok(EngineOptions { clock, ..EngineOptions::new(toolset) })
}

fn open(cli: &Cli) -> Result<Engine, CliError> {
    let path = db_path(cli)?;
    let engine = Engine::open(path, engine_options(cli)?)?;
    // Diagnostics go to `<db>.log` (or $TOOLGATE_LOG), never to the terminal.
    crate::telemetry::logging::init_for_db(path);
    tracing::info!(read_only = cli.read_only, pid = std::process::id(), "cli opened the ledger");
    Ok(engine)
}

/// Opens the ledger for a read command: read-only, never created, migrated or
/// written (an empty or foreign file is DB_NOT_TOOLGATE).
fn open_read(cli: &Cli) -> Result<Engine, CliError> {
    let path = db_path(cli)?;
    let engine = Engine::open_read_only(path, engine_options(cli)?)?;
    crate::telemetry::logging::init_for_db(path);
    tracing::info!(pid = std::process::id(), "cli opened the ledger read-only");
    Ok(engine)
}

fn refuse_read_only(cli: &Cli) -> Result<(), CliError> {
    if cli.read_only {
        return Err(CliError::new("READ_ONLY", "refused: --read-only is set"));
    }
    Ok(())
}

/// Opens the console: on `--db PATH` in place, or on a working copy of the demo
/// database re-based to now (the committed file is never written).
fn console(cli: &Cli, agents: usize) -> Result<i32, CliError> {
    use std::io::IsTerminal;
    // Said, not ignored: the console's panes, countdowns and working copy
    // run on the wall clock.
    if cli.now.is_some() {
        return Err(CliError::new(
            "INVALID_ARGUMENTS",
            "--now fixes the clock of a scripted command; the console runs on the wall clock (leave --now out)",
        ));
    }
    if !std::io::stdout().is_terminal() {
        return Err(CliError::new(
            "NOT_A_TERMINAL",
            "the console needs a terminal; see `toolgate --help` for the commands",
        ));
    }
    let (db, label, scratch) = if let (Some(p), true) = (&cli.db, agents > 0) {
        // `toolgate demo --db PATH`: the demo runs there.
        let name = p.file_name().map_or_else(|| "demo".into(), |n| n.to_string_lossy().into_owned());
        if Location::is_postgres(p) || p.exists() {
            // Looked at without writing: a refused command changes nothing
            // (an empty file or database is not made a ledger to be refused).
            let demo = match Engine::open_read_only(p, crate::tools::demo_options()) {
                Ok(e) => e.is_demo(),
                // An older demo database is migrated by the console, as any ledger.
                Err(e) if e.code() == "DB_SCHEMA_OLD" => Engine::open(p, crate::tools::demo_options())?.is_demo(),
                Err(e) if e.code() == "DB_NOT_TOOLGATE" => false,
                Err(e) => return Err(e.into()),
            };
            if !demo {
                return Err(CliError::new(
                    "NOT_A_DEMO_DB",
                    "the demo's agents only write to a demo database: give a new path (a working copy is made there) or one made by `toolgate demo-db`",
                ));
            }
        } else {
            crate::demo::working_copy_at(p, chrono::Utc::now().timestamp_millis())?;
        }
        (p.clone(), name, tempfile_dir()?)
    } else if let (Some(p), 0) = (&cli.db, agents) {
        if !Location::is_postgres(p) && !p.exists() {
            return Err(CliError::new("DB_NOT_FOUND", "no database at the given path (run `toolgate init` first)"));
        }
        // A file that is not a ledger is refused before anything is made
        // beside it (no working directory, no log file).
        match Engine::open_read_only(p, crate::tools::demo_options()) {
            Err(e) if e.code() != "DB_SCHEMA_OLD" => return Err(e.into()),
            _ => {}
        }
        (p.clone(), Location::of(p).label(), tempfile_dir()?)
    } else {
        let now = chrono::Utc::now().timestamp_millis();
        let scratch = tempfile_dir()?;
        match crate::demo::working_copy(&scratch, now) {
            Ok(copy) => (copy, "demo.db (working copy)".to_string(), scratch),
            Err(e) => {
                let _ = std::fs::remove_dir_all(&scratch);
                return Err(e.into());
            }
        }
    };
    let operator = operator_or_user(cli);
    // The console owns the terminal: diagnostics go to the database's log file only.
    crate::telemetry::logging::init_for_db(&db);
    let load = (agents > 0).then(|| crate::load::spawn_agents(&db, agents)).transpose()?;
    let in_scratch = db.starts_with(&scratch);
    let result = crate::tui::run(&crate::tui::ConsoleOptions {
        db,
        db_label: label,
        operator,
        read_only: cli.read_only,
        workers: true,
        scratch: scratch.clone(),
        load: load.as_ref().map(|l| l.stats.clone()),
        toolset: engine_options(cli)?.toolset,
    });
    if let Some(l) = load {
        l.stop();
    }
    let discarded = in_scratch && result.is_ok();
    let _ = std::fs::remove_dir_all(&scratch);
    if discarded {
        // Said once the terminal is back: what was done in the copy is gone.
        outln!(
            "toolgate: the working copy of demo.db was discarded with what you did in it; `toolgate demo --db FILE` keeps one at FILE"
        );
    }
    result.map_err(|e| match e {
        crate::tui::ConsoleError::Engine(e) => CliError::from(e),
        crate::tui::ConsoleError::Terminal(e) => CliError::new("TERMINAL", format!("terminal error: {}", e.kind())),
    })?;
    Ok(0)
}

fn tempfile_dir() -> Result<PathBuf, CliError> {
    let dir = std::env::temp_dir().join(format!(
        "toolgate-console-{}-{}",
        std::process::id(),
        hex::encode(rand::random::<[u8; 4]>())
    ));
    std::fs::create_dir_all(&dir)
        .map_err(|e| CliError::new("TEMP_DIR", format!("cannot create a working directory: {}", e.kind())))?;
    Ok(dir)
}

/// The `--project` choice, refused before anything is opened or dispatched.
fn projection(name: Option<&str>) -> Result<Option<Projection>, CliError> {
    name.map(|n| Projection::parse(n).map_err(|e| CliError::new(UnknownProjection::CODE, e.to_string()))).transpose()
}

fn print_json(v: &impl serde::Serialize) {
    outln!("{}", serde_json::to_string_pretty(v).unwrap_or_else(|_| "null".into()));
}

/// The database of `provider serve`: `--db PATH` (also `$TOOLGATE_DB`), or
/// `--provider-db PATH`; both only when they agree. A SQLite file: the
/// simulated providers keep no tables on PostgreSQL.
fn provider_serve_db<'a>(db: Option<&'a Path>, provider_db: Option<&'a Path>) -> Result<&'a Path, CliError> {
    let path = match (db, provider_db) {
        (Some(a), Some(b)) if a != b => {
            return Err(CliError::new("USAGE", "--db and --provider-db name two databases: give one"));
        }
        (Some(p), _) | (None, Some(p)) => p,
        (None, None) => {
            return Err(CliError::new("DB_REQUIRED", "provider serve needs the provider's database: --db PATH"));
        }
    };
    if Location::is_postgres(path) {
        return Err(CliError::new("USAGE", "the simulated providers keep their tables in a SQLite file: --db PATH"));
    }
    Ok(path)
}

fn run(cli: &Cli) -> Result<i32, CliError> {
    let Some(command) = &cli.command else {
        return console(cli, 0);
    };
    match command {
        Command::DemoDb { out, seed, json } => {
            crate::demo::generate(out, *seed)?;
            if *json {
                outln!("{}", json!({"written": true, "seed": seed, "schema_version": crate::store::SCHEMA_VERSION}));
            } else {
                outln!("demo database written (seed {seed})");
            }
            Ok(0)
        }
        Command::Demo { agents } => console(cli, *agents),
        Command::Cancel(a) => cancel_command(cli, a),
        Command::Token { what } => token_command(cli, what),
        Command::Tenant { what } => tenant_command(cli, what),
        Command::Subject { what } => subject_command(cli, what),
        Command::Serve(a) => serve_command(cli, a),
        Command::Mcp { token, concurrency, queue, grace_ms } => {
            refuse_read_only(cli)?;
            // A queue of 0 would refuse a call whenever no engine happens to be
            // waiting at that instant, even between two calls of a calm session.
            if !(1..=64).contains(concurrency) || !(1..=4096).contains(queue) || *grace_ms > 60_000 {
                return Err(CliError::new(
                    "USAGE",
                    "--concurrency must be 1 to 64, --queue 1 to 4096, --grace-ms at most 60000",
                ));
            }
            let path = db_path(cli)?;
            let opts = crate::mcp::StdioOptions {
                workers: (0..*concurrency).map(|_| engine_options(cli)).collect::<Result<_, _>>()?,
                lane: engine_options(cli)?,
                queue: *queue,
                grace: std::time::Duration::from_millis(*grace_ms),
            };
            // Diagnostics go to `<db>.log`: standard output is the protocol.
            crate::telemetry::logging::init_for_db(path);
            crate::mcp::serve_stdio(path, token, opts).map_err(|e| CliError::new(e.code(), e.to_string()))?;
            Ok(0)
        }
        Command::Load(a) => load_command(cli, a),
        Command::Lab(a) => lab_command(cli, a),
        Command::Init { world, json } => {
            refuse_read_only(cli)?;
            let path = db_path(cli)?;
            let text = match world {
                Some(f) => std::fs::read(f).map_err(|e| {
                    CliError::new("WORLD_UNREADABLE", format!("cannot read the world file: {}", e.kind()))
                })?,
                None => DEMO_WORLD.as_bytes().to_vec(),
            };
            // Refusals name the file as the user knows it (its name, never a resolved path).
            let name = world
                .as_deref()
                .and_then(Path::file_name)
                .map_or_else(|| "the built-in world".to_string(), |n| n.to_string_lossy().into_owned());
            let w = World::parse_named(&name, &text)?;
            let file = !Location::is_postgres(path);
            if let Some(parent) = path.parent().filter(|p| file && !p.as_os_str().is_empty()) {
                if !parent.is_dir() {
                    return Err(CliError::new(
                        "DB_OPEN_FAILED",
                        "cannot open the database: the parent directory does not exist",
                    ));
                }
            }
            let existed = !file || path.exists();
            // The catalog loads (or is refused) before anything is created.
            let opts = engine_options(cli)?;
            let mut engine = Engine::create(path, opts)?;
            if let Err(e) = engine.load_world(&w) {
                drop(engine);
                if !existed {
                    let _ = std::fs::remove_file(path);
                    let _ = std::fs::remove_file(path.with_extension("db-wal"));
                }
                return Err(e.into());
            }
            let summary = json!({"tenants": w.tenants.len(), "subjects": w.subjects.len(), "grants": w.grants.len(), "orders": w.orders.len()});
            if *json {
                print_json(&json!({"initialized": true, "world": summary}));
            } else {
                outln!(
                    "initialized: {} tenants, {} subjects, {} grants, {} orders",
                    w.tenants.len(),
                    w.subjects.len(),
                    w.grants.len(),
                    w.orders.len()
                );
            }
            Ok(0)
        }
        Command::Dispatch(a) => {
            refuse_read_only(cli)?;
            let project = projection(a.project.as_deref())?;
            let arguments = read_args(a)?;
            let mut engine = open(cli)?;
            if let Some(f) = &a.fault {
                engine.set_faults(FaultPlan::parse(f).map_err(|e| CliError::new("BAD_FAULT", e.to_string()))?);
            }
            let call = a.call.identity();
            let call_id = call.call_id.clone();
            let env = engine.dispatch(&DispatchRequest {
                tenant: a.tenant.clone(),
                subject: a.subject.clone(),
                tool: a.tool.clone(),
                arguments,
                idempotency_key: a.key.clone(),
                call: Some(call),
                approval_id: a.approval_id.clone(),
                deadline_ms: a.deadline_ms,
                token_id: None,
            })?;
            match project {
                Some(p) => print_json(&p.render(&call_id, &a.tool, &env.model_result)),
                None => print_envelope(&env, a.json),
            }
            Ok(env.exit_code())
        }
        Command::Query(a) if a.select.all => {
            let operator = cli.operator.clone().unwrap_or_default();
            bulk_command(cli, &a.select, a.tenant.as_deref(), &BulkAction::Query, &operator, a.json)
        }
        Command::Approve { approver, tenant, select, json, .. } if select.all => {
            bulk_command(cli, select, tenant.as_deref(), &BulkAction::Approve, approver, *json)
        }
        Command::Deny { approver, note, tenant, select, json, .. } if select.all => {
            bulk_command(cli, select, tenant.as_deref(), &BulkAction::Deny { note: note.clone() }, approver, *json)
        }
        Command::Resolve(a) if a.select.all => {
            let operator = cli.operator.clone().unwrap_or_default();
            let resolution = match a.resolution {
                ResolveAs::Succeeded => Resolution::Succeeded,
                ResolveAs::Failed => Resolution::Failed,
                ResolveAs::Compensated => Resolution::Compensated,
            };
            let action = BulkAction::Resolve { resolution, note: a.act.note.clone(), no_evidence: a.no_evidence };
            bulk_command(cli, &a.select, a.tenant.as_deref(), &action, &operator, a.act.json)
        }
        Command::Query(a) => {
            refuse_read_only(cli)?;
            let project = projection(a.project.as_deref())?;
            let mut engine = open(cli)?;
            let call = a.call.identity();
            let call_id = call.call_id.clone();
            let env = engine.query_operation_status(&QueryRequest {
                tenant: a.tenant.clone().unwrap_or_default(),
                subject: a.subject.clone().unwrap_or_default(),
                status_ref: a.status_ref.clone().unwrap_or_default(),
                expected_request_sha256: a.expect_sha256.clone().unwrap_or_default(),
                idempotency_key: a.key.clone(),
                call: Some(call),
                operator: cli.operator.clone(),
            })?;
            match project {
                Some(p) => print_json(&p.render(&call_id, QUERY_STATUS_TOOL, &env.model_result)),
                None => print_envelope(&env, a.json),
            }
            Ok(env.exit_code())
        }
        Command::Approve { approval_id, approver, json, .. } => {
            refuse_read_only(cli)?;
            let mut engine = open(cli)?;
            let env = engine.approve(approval_id.as_deref().unwrap_or_default(), approver)?;
            print_envelope(&env, *json);
            Ok(env.exit_code())
        }
        Command::Deny { approval_id, approver, note, json, .. } => {
            refuse_read_only(cli)?;
            let mut engine = open(cli)?;
            let out = engine.deny(approval_id.as_deref().unwrap_or_default(), approver, note)?;
            print_outcome(&out, *json);
            Ok(i32::from(!out.applied))
        }
        Command::Approvals { json } => {
            let mut engine = open_read(cli)?;
            let now = engine.clock().now_ms();
            let rows = engine.pending_approvals(1000)?;
            let list: Vec<Value> = rows
                .iter()
                .map(|a| {
                    json!({
                        "approval_id": a.id, "tool": a.tool, "tenant": a.tenant, "subject": a.subject,
                        "amount_minor": crate::engine::approval_amount(a), "created_at": rfc3339(a.created_at),
                        "expires_at": rfc3339(a.expires_at), "expires_in_ms": a.expires_at - now,
                        "expired": now >= a.expires_at, "request_sha256": a.request_sha256,
                    })
                })
                .collect();
            if *json {
                print_json(&json!({"pending": list}));
            } else if list.is_empty() {
                outln!("no pending approvals");
            } else {
                outln!(
                    "{:<30} {:<16} {:<8} {:<12} {:>12}  expires in",
                    "approval",
                    "tool",
                    "tenant",
                    "subject",
                    "amount"
                );
                for a in &rows {
                    let left = a.expires_at - now;
                    let exp = if left <= 0 { "expired".to_string() } else { format!("{}s", left / 1000) };
                    outln!(
                        "{:<30} {:<16} {:<8} {:<12} {:>12}  {exp}",
                        a.id,
                        a.tool,
                        a.tenant,
                        a.subject,
                        crate::engine::approval_amount(a).map_or("-".into(), |v| v.to_string())
                    );
                }
            }
            Ok(0)
        }
        Command::Resolve(a) => {
            refuse_read_only(cli)?;
            let operator = cli
                .operator
                .clone()
                .ok_or_else(|| CliError::new("OPERATOR_REQUIRED", "--operator NAME is required to resolve"))?;
            let mut engine = open(cli)?;
            let req = ResolveRequest {
                operation_id: a.operation_id.clone().unwrap_or_default(),
                resolution: match a.resolution {
                    ResolveAs::Succeeded => Resolution::Succeeded,
                    ResolveAs::Failed => Resolution::Failed,
                    ResolveAs::Compensated => Resolution::Compensated,
                },
                operator,
                note: a.act.note.clone(),
                evidence: a.evidence.clone(),
                seen_version: a.act.seen_version,
                action_id: a.act.action_id.clone(),
                no_evidence: a.no_evidence,
            };
            let out = if a.against_evidence { engine.resolve_against_evidence(&req)? } else { engine.resolve(&req)? };
            print_outcome(&out, a.act.json);
            Ok(i32::from(!out.applied))
        }
        Command::Ops { what } => match what {
            OpsCommand::List { state, limit, json } => {
                let mut engine = open_read(cli)?;
                let state = match state.as_deref() {
                    None => None,
                    Some(s) => Some(crate::store::OpState::parse(s).ok_or_else(|| {
                        let all: Vec<&str> = crate::store::OpState::ALL.iter().map(|s| s.as_str()).collect();
                        CliError::new("BAD_STATE", format!("unknown state {s:?} (one of: {})", all.join(", ")))
                    })?),
                };
                let rows = engine.list_operations(state, (*limit).clamp(1, 10_000))?;
                if *json {
                    print_json(&json!({"operations": rows}));
                } else {
                    outln!(
                        "{:<28} {:<16} {:<13} {:<8} {:<10} {:<24}",
                        "operation",
                        "tool",
                        "state",
                        "version",
                        "key",
                        "updated"
                    );
                    for o in &rows {
                        outln!(
                            "{:<28} {:<16} {:<13} {:<8} {:<10} {:<24}",
                            o.id,
                            o.tool,
                            o.state,
                            o.version,
                            crate::display::digest(&o.key_sha256, 8),
                            rfc3339(o.updated_at)
                        );
                    }
                }
                Ok(0)
            }
            OpsCommand::Show { operation_id, json } => {
                let mut engine = open_read(cli)?;
                let Some(d) = engine.operation_detail(operation_id)? else {
                    return Err(CliError::new("NO_SUCH_OPERATION", "no such operation"));
                };
                if *json {
                    let trace: Vec<Value> = d.trace.iter().map(trace_json).collect();
                    print_json(&json!({
                        "operation": d.operation, "outbox": d.outbox, "attempts": d.attempts, "trace": trace,
                        "audit": d.audit, "may_land_until": d.may_land_until, "receipt_window_until": d.receipt_window_until,
                        "context": d.context.iter().map(|(k, v)| json!({"label": k, "value": v})).collect::<Vec<_>>(),
                    }));
                } else {
                    print_detail(&d);
                }
                Ok(0)
            }
        },
        Command::Provider { what: ProviderCommand::Serve { listen, provider_db, public, faults, require_bearer } } => {
            let faults = match faults {
                Some(spec) => {
                    crate::downstream::FaultPlan::parse(spec).map_err(|e| CliError::new("BAD_FAULT", e.to_string()))?
                }
                None => crate::downstream::FaultPlan::none(),
            };
            let provider_db = provider_serve_db(cli.db.as_deref(), provider_db.as_deref())?;
            crate::telemetry::logging::init_for_db(provider_db);
            let opts = crate::downstream::serve::ServeOptions {
                listen: *listen,
                public: *public,
                faults,
                require_bearer: require_bearer.clone(),
            };
            crate::downstream::serve::serve(provider_db, opts, |addr| {
                outln!("listening on {addr}");
            })
            .map_err(|e| CliError::new(e.code(), e.to_string()))?;
            Ok(0)
        }
        Command::Counts { json } => {
            let mut engine = open_read(cli)?;
            let c = engine.counts()?;
            if *json {
                print_json(&c);
            } else {
                outln!("operations: {}", fmt_map(&c.operations));
                outln!("outbox:     {}", fmt_map(&c.outbox));
                let (counted, not): (Vec<_>, Vec<_>) = c.downstreams.iter().partition(|(_, d)| d.counted);
                let names = |v: &[(&String, &crate::engine::DownstreamEffects)]| {
                    v.iter().map(|(n, _)| crate::display::escape(n)).collect::<Vec<_>>().join(", ")
                };
                let scope = match (counted.is_empty(), not.is_empty()) {
                    (_, true) => String::new(),
                    (true, false) => format!(" (counted at no downstream: not at {})", names(&not)),
                    (false, false) => format!(" (counted at {} only; not at {})", names(&counted), names(&not)),
                };
                outln!("downstream effects: {}{scope}", c.downstream_effects);
                outln!("side_effect_duplicates: {}{scope}", c.side_effect_duplicates);
                for (name, d) in &c.downstreams {
                    match (d.effects, d.side_effect_duplicates, &d.note) {
                        (Some(e), Some(dups), _) => {
                            outln!(
                                "  {:<16} {:<10} effects {e}, duplicates {dups}",
                                crate::display::escape(name),
                                d.adapter
                            );
                        }
                        (.., note) => outln!(
                            "  {:<16} {:<10} not counted: {}",
                            crate::display::escape(name),
                            crate::display::escape(&d.adapter),
                            crate::display::escape(note.as_deref().unwrap_or(""))
                        ),
                    }
                }
                outln!("pending approvals: {}", c.pending_approvals);
                if let Some(clock) = &c.clock {
                    outln!(
                        "clock: {:?}, this host {} ms off ledger time{}",
                        clock.source,
                        clock.offset_ms,
                        clock.paused.as_deref().map(|w| format!("; PAUSED: {w}")).unwrap_or_default()
                    );
                }
            }
            Ok(0)
        }
        Command::Grant(g) | Command::Revoke(g) => {
            refuse_read_only(cli)?;
            let mut engine = open(cli)?;
            let grant = matches!(command, Command::Grant(_));
            let changed = if grant {
                engine.grant(&g.tenant, &g.subject, &g.tool)?
            } else {
                engine.revoke(&g.tenant, &g.subject, &g.tool)?
            };
            let what = if grant { "granted" } else { "revoked" };
            if g.json {
                print_json(&json!({"action": what, "changed": changed}));
            } else {
                outln!("{what}{}", if changed { "" } else { " (no change)" });
            }
            Ok(0)
        }
        Command::Orders { json } => {
            let mut engine = open_read(cli)?;
            let orders = crate::tools::demo::orders(&mut engine)?;
            // What accepted refunds that may still take effect hold of each order.
            let mut held: std::collections::BTreeMap<String, i64> = std::collections::BTreeMap::new();
            for (_, resource, amount) in engine.holds()? {
                *held.entry(resource).or_default() += amount;
            }
            let held_of = |o: &crate::tools::demo::OrderRow| {
                held.get(&crate::tools::demo::resource(&o.order_ref)).copied().unwrap_or(0)
            };
            if *json {
                let rows: Vec<Value> = orders
                    .iter()
                    .map(|o| {
                        let mut v = json!(o);
                        v["held_minor"] = json!(held_of(o));
                        v["remaining_minor"] = json!(o.captured_minor - o.refunded_minor - held_of(o));
                        v
                    })
                    .collect();
                print_json(&json!({"orders": rows}));
            } else {
                outln!(
                    "{:<12} {:<8} {:<12} {:<4} {:>10} {:>10} {:>10} {:>10}  status",
                    "order",
                    "tenant",
                    "owner",
                    "cur",
                    "captured",
                    "refunded",
                    "held",
                    "remaining"
                );
                for o in &orders {
                    outln!(
                        "{:<12} {:<8} {:<12} {:<4} {:>10} {:>10} {:>10} {:>10}  {}{}",
                        o.order_ref,
                        o.tenant,
                        o.owner,
                        o.currency,
                        o.captured_minor,
                        o.refunded_minor,
                        held_of(o),
                        o.captured_minor - o.refunded_minor - held_of(o),
                        o.status,
                        if o.over_refunded_minor > 0 {
                            format!("  PAID {} ABOVE THE CAPTURE", o.over_refunded_minor)
                        } else {
                            String::new()
                        }
                    );
                }
            }
            Ok(0)
        }
        Command::Reap { json } => {
            refuse_read_only(cli)?;
            let mut engine = open(cli)?;
            let r = engine.reap()?;
            let p = engine.purge_expired()?;
            let paused = r.clock_paused.clone().or_else(|| p.clock_paused.clone());
            if *json {
                print_json(&json!({
                    "requeued_unsent": r.requeued_unsent, "requeued_same_key": r.requeued_same_key,
                    "parked_unknown": r.parked_unknown, "purged": p.purged, "kept_for_audit": p.kept_for_audit,
                    "clock_paused": paused,
                }));
            } else if let Some(why) = &paused {
                outln!("reap paused, nothing done: {why}");
            } else {
                outln!(
                    "reaped: {} back to accepted (never sent), {} re-queued with the same downstream key, {} parked as unknown; {} purged past retention (tombstones kept), {} past retention kept because a person acted on them",
                    r.requeued_unsent, r.requeued_same_key, r.parked_unknown, p.purged, p.kept_for_audit
                );
            }
            // A pass that could not act is not a success a script may ignore.
            Ok(i32::from(paused.is_some()))
        }
        Command::Clock { accept, json } => {
            let mut engine = if *accept {
                refuse_read_only(cli)?;
                open(cli)?
            } else {
                open_read(cli)?
            };
            let status = if *accept { Some(engine.accept_host_clock()?) } else { engine.clock_status() };
            let Some(st) = status else {
                return Err(CliError::from(crate::engine::EngineError::invalid(
                    "CLOCK_MANUAL",
                    "this command runs on a manual clock (--now): there is no ledger clock to show",
                )));
            };
            if *json {
                print_json(&st);
            } else {
                outln!(
                    "ledger time: {} ({}); this host's wall clock is {} ms off it, uncertainty {} ms",
                    rfc3339(engine.clock().now_ms()),
                    match st.source {
                        crate::engine::ledger_clock::ClockSource::Database => "the database server's clock",
                        crate::engine::ledger_clock::ClockSource::Anchor => "this host's anchor in the ledger",
                    },
                    st.offset_ms,
                    st.uncertainty_ms
                );
                match &st.paused {
                    Some(why) => outln!("paused: {why}"),
                    None => outln!("reaping and purging: running"),
                }
            }
            Ok(i32::from(st.paused.is_some()))
        }
        Command::Work { json } => {
            refuse_read_only(cli)?;
            let mut engine = open(cli)?;
            let n = engine.work(10_000)?;
            if *json {
                print_json(&json!({"ran": n}));
            } else {
                outln!("ran {n} outbox row(s)");
            }
            Ok(0)
        }
        Command::Scenario { what } => scenario_command(what),
        Command::Trace(a) => trace_command(cli, a),
        Command::Metrics(a) => metrics_command(cli, a),
        Command::Bench { quick, json, dir, http } => {
            // `--db postgres://...` benches on that server (databases made and dropped there).
            let postgres = cli.db.clone().filter(|d| Location::is_postgres(d));
            let opts = crate::bench::BenchOptions { quick: *quick, dir: dir.clone(), postgres, http: *http };
            let report = crate::bench::run(&opts).map_err(|e| CliError::new(e.code(), e.to_string()))?;
            if *json {
                print_json(&report);
            } else {
                out!("{}", crate::bench::table(&report));
            }
            Ok(0)
        }
        Command::Audit { log, json } => {
            let mut engine = open_read(cli)?;
            if *log {
                let rows = engine.audit_log(10_000)?;
                if *json {
                    print_json(&json!({"log": rows}));
                } else {
                    for r in &rows {
                        outln!(
                            "{} #{:<5} {:<8} {:<10} {:<8} {:<28} {}",
                            rfc3339(r.at),
                            r.seq,
                            r.result,
                            crate::display::escape(&r.action),
                            crate::display::escape(&r.actor),
                            crate::display::escape(
                                r.operation_id.as_deref().or(r.approval_id.as_deref()).unwrap_or("-")
                            ),
                            crate::display::escape(&r.reason)
                        );
                    }
                }
                return Ok(0);
            }
            let findings = engine.audit()?;
            let warnings = engine.audit_warnings()?;
            // A read opens no downstream it cannot: those were not asked.
            let not_checked = engine.unopened_downstreams().clone();
            if *json {
                print_json(&json!({
                    "ok": findings.is_empty(), "findings": findings, "warnings": warnings,
                    "downstreams_not_checked": not_checked,
                }));
            } else {
                for f in &findings {
                    outln!("{:<22} {:<30} {}", f.check, f.reference, f.detail);
                }
                for f in &warnings {
                    outln!("warning: {:<13} {:<30} {}", f.check, f.reference, f.detail);
                }
                for (name, why) in &not_checked {
                    outln!(
                        "not checked: downstream {} (not opened by this read: {})",
                        crate::display::escape(name),
                        crate::display::escape(why)
                    );
                }
                if findings.is_empty() {
                    outln!("audit: no findings");
                } else {
                    outln!("audit: {} finding(s)", findings.len());
                }
            }
            Ok(i32::from(!findings.is_empty()))
        }
    }
}

impl From<crate::scenarios::ScenarioError> for CliError {
    fn from(e: crate::scenarios::ScenarioError) -> Self {
        Self::new(e.code(), e.to_string())
    }
}

/// A bulk selection as a store filter; a bad state or duration is a usage error.
fn select_filter(sel: &SelectArgs, tenant: Option<&str>, approvals: bool) -> Result<crate::store::Filter, CliError> {
    use crate::tui::app::filter::{parse_duration, state_name};
    let bad = |m: String| CliError::new("BAD_SELECTION", m);
    let mut f = crate::store::Filter {
        tenant: tenant.map(str::to_string),
        tool: sel.select_tool.clone(),
        older_than_ms: sel.older_than.as_deref().map(parse_duration).transpose().map_err(bad)?,
        ..crate::store::Filter::default()
    };
    if approvals {
        if !sel.state.is_empty() {
            return Err(bad("--state selects operations; approvals are all pending".into()));
        }
    } else {
        let states =
            if sel.state.is_empty() { vec!["unknown".to_string(), "needs_review".into()] } else { sel.state.clone() };
        f.states =
            states.iter().map(|s| state_name(&s.trim().to_ascii_lowercase())).collect::<Result<_, _>>().map_err(bad)?;
    }
    Ok(f)
}

/// The rows a filter matches, every one (keyset pages of 500), as targets
/// with what a listing shows: (target, state, tool, tenant).
fn select_rows(
    engine: &mut Engine,
    f: &crate::store::Filter,
    approvals: bool,
) -> Result<Vec<(BulkTarget, String, String, String)>, CliError> {
    use crate::store::{cursor_after, Key, OpsView, Order, APPROVALS_SORT, OPS_SORT};
    // Id order: stable, and every row once however the set changes meanwhile.
    let order = Order { column: 1, desc: false };
    let mut out = Vec::new();
    let mut cursor = None;
    loop {
        let n = if approvals {
            let page = engine.approvals_page(f, order, cursor.as_ref(), 500)?;
            cursor = page.last().map(|a| cursor_after(APPROVALS_SORT, order, a, Key::Text(a.id.clone())));
            out.extend(page.iter().map(|a| {
                (
                    BulkTarget { id: a.id.clone(), seen_version: None },
                    a.state.to_string(),
                    a.tool.clone(),
                    a.tenant.clone(),
                )
            }));
            page.len()
        } else {
            let page = engine.ops_page(OpsView::All, f, order, cursor.as_ref(), 500)?;
            cursor = page.last().map(|o| cursor_after(OPS_SORT, order, o, Key::Text(o.id.clone())));
            out.extend(page.iter().map(|o| {
                (
                    BulkTarget { id: o.id.clone(), seen_version: Some(o.version) },
                    o.state.to_string(),
                    o.tool.clone(),
                    o.tenant.clone(),
                )
            }));
            page.len()
        };
        if n < 500 {
            return Ok(out);
        }
    }
}

/// `query|approve|deny|resolve --all`: the selection, then (unless
/// `--dry-run`) the action on each. Exit 0 when every row ended as meant,
/// 1 when any was refused or is still unknown, 2 for a usage error.
fn bulk_command(
    cli: &Cli,
    sel: &SelectArgs,
    tenant: Option<&str>,
    action: &BulkAction,
    operator: &str,
    json: bool,
) -> Result<i32, CliError> {
    action.check()?;
    let filter = select_filter(sel, tenant, action.on_approvals())?;
    if !sel.dry_run {
        refuse_read_only(cli)?;
        if operator.is_empty() {
            return Err(CliError::new(
                "OPERATOR_REQUIRED",
                format!("--operator NAME is required to {} --all (not for --dry-run)", action.verb()),
            ));
        }
    }
    let mut engine = if sel.dry_run { open_read(cli)? } else { open(cli)? };
    let rows = select_rows(&mut engine, &filter, action.on_approvals())?;
    let verb = action.verb();
    if sel.dry_run {
        if json {
            let list: Vec<Value> = rows
                .iter()
                .map(|(t, state, tool, tenant)| json!({"id": t.id, "state": state, "tool": tool, "tenant": tenant}))
                .collect();
            print_json(&json!({"action": verb, "dry_run": true, "selected": rows.len(), "would_touch": list}));
        } else {
            for (t, state, tool, tenant) in &rows {
                outln!(
                    "would {verb} {}  {state}  {}  {}",
                    t.id,
                    crate::display::escape(tool),
                    crate::display::escape(tenant)
                );
            }
            outln!("{} would be touched (dry run: nothing changed)", rows.len());
        }
        return Ok(0);
    }
    let targets: Vec<BulkTarget> = rows.into_iter().map(|(t, ..)| t).collect();
    let report = engine.bulk(action, &targets, operator, |_, _| {})?;
    if json {
        print_json(&json!({
            "action": verb, "dry_run": false, "selected": targets.len(), "results": report.items,
            "summary": report.summary(), "all_done": report.all_done(),
        }));
    } else {
        for it in &report.items {
            outln!("{verb} {}: {} ({})", it.id, it.outcome, crate::display::escape(&it.message));
        }
        outln!("{verb} {}: {}", targets.len(), report.summary());
    }
    Ok(i32::from(!report.all_done()))
}

/// `toolgate scenario list|run`: each scenario runs on its own fresh database; a
/// crash step really aborts a child `toolgate` process (this binary).
fn scenario_command(what: &ScenarioCommand) -> Result<i32, CliError> {
    use crate::scenarios::{self, report, CrashMode, RunOptions, ScenarioRun};
    match what {
        ScenarioCommand::List { json } => {
            let all = scenarios::builtin()?;
            if *json {
                let list: Vec<Value> = all
                    .iter()
                    .map(|s| json!({"id": s.id, "slug": s.slug, "title": s.title, "summary": s.summary, "steps": s.steps.len()}))
                    .collect();
                print_json(&json!({"scenarios": list}));
            } else {
                out!("{}", report::list(&all));
            }
            Ok(0)
        }
        ScenarioCommand::Run { target, file, keep_db, json } => {
            let scripts = match (file, target) {
                (Some(f), _) => vec![scenarios::load_file(f)?],
                (None, Some(t)) => scenarios::select(t)?,
                (None, None) => return Err(CliError::new("USAGE", "give a scenario number, `all`, or --file FILE")),
            };
            let bin = std::env::current_exe().map_err(|e| {
                CliError::new("NO_EXECUTABLE", format!("cannot locate the toolgate binary: {}", e.kind()))
            })?;
            if let Some(dir) = keep_db.as_ref().filter(|_| scripts.len() > 1) {
                if dir.exists() {
                    return Err(CliError::new("SCENARIO_DB", "the --keep-db path already exists; choose a new one"));
                }
                std::fs::create_dir_all(dir).map_err(|e| {
                    CliError::new("SCENARIO_DB", format!("cannot create the --keep-db directory: {}", e.kind()))
                })?;
            }
            let (mut passed, mut failed, mut reports) = (0, 0, Vec::new());
            for (i, s) in scripts.iter().enumerate() {
                let keep = keep_db.as_ref().map(|p| {
                    if scripts.len() > 1 {
                        p.join(format!("scenario-{:02}.db", s.id))
                    } else {
                        p.clone()
                    }
                });
                let r = ScenarioRun::run(
                    s,
                    RunOptions { crash_mode: CrashMode::ChildProcess(bin.clone()), keep_db: keep, http: None },
                )?;
                if r.passed {
                    passed += 1;
                } else {
                    failed += 1;
                }
                if *json {
                    reports.push(r);
                } else {
                    if i > 0 {
                        outln!();
                    }
                    out!("{}", report::render(&r));
                }
            }
            if *json {
                print_json(&json!({"scenarios": reports, "passed": passed, "failed": failed}));
            } else {
                outln!();
                outln!("{}", report::summary_line(passed, failed));
            }
            Ok(i32::from(failed > 0))
        }
    }
}

fn read_args(a: &DispatchArgs) -> Result<Vec<u8>, CliError> {
    // The engine enforces the limit; reading stops one byte past it, so a huge
    // file is never read whole and the engine still sees that it is too large.
    const READ_CAP: u64 = crate::engine::canonical::MAX_INPUT_BYTES as u64 + 1;
    let read_all = |r: &mut dyn Read| -> Result<Vec<u8>, CliError> {
        let mut buf = Vec::new();
        r.take(READ_CAP)
            .read_to_end(&mut buf)
            .map_err(|e| CliError::new("ARGS_UNREADABLE", format!("cannot read the arguments: {}", e.kind())))?;
        Ok(buf)
    };
    if let Some(f) = &a.args_file {
        let mut file = std::fs::File::open(f)
            .map_err(|e| CliError::new("ARGS_UNREADABLE", format!("cannot read the arguments file: {}", e.kind())))?;
        return read_all(&mut file);
    }
    match &a.args {
        None => Ok(b"{}".to_vec()),
        Some(s) if s == "-" => read_all(&mut std::io::stdin()),
        Some(s) => Ok(os_bytes(s)),
    }
}

#[cfg(unix)]
fn os_bytes(s: &OsString) -> Vec<u8> {
    use std::os::unix::ffi::OsStrExt;
    s.as_os_str().as_bytes().to_vec()
}

#[cfg(not(unix))]
fn os_bytes(s: &OsString) -> Vec<u8> {
    s.to_string_lossy().as_bytes().to_vec()
}

fn fmt_map(m: &std::collections::BTreeMap<String, i64>) -> String {
    if m.is_empty() {
        return "none".into();
    }
    m.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(" ")
}

fn print_outcome(o: &crate::engine::OperatorOutcome, json: bool) {
    if json {
        print_json(o);
    } else if o.applied {
        outln!("ok: {}", o.message);
    } else {
        outln!("refused [{}]: {}", o.code, o.message);
    }
}

/// Prints an envelope: the whole envelope (docs/design.md §4) as JSON, or a summary for people.
pub fn print_envelope(env: &Envelope, json: bool) {
    if json {
        print_json(env);
        return;
    }
    let m = &env.model_result;
    let exec = serde_json::to_value(m.execution).unwrap_or(Value::Null);
    let status = serde_json::to_value(m.status).unwrap_or(Value::Null);
    outln!(
        "status: {}   outcome: {}   delivery: {}",
        status.as_str().unwrap_or("?"),
        exec["outcome"].as_str().unwrap_or("?"),
        exec["delivery"].as_str().unwrap_or("?")
    );
    if let Some(e) = &m.error {
        let rec = serde_json::to_value(e.recovery).unwrap_or(Value::Null);
        outln!(
            "error: {}   recovery: {}   retryable: {}{}",
            e.code,
            rec.as_str().unwrap_or("?"),
            if e.retryable { "yes" } else { "no" },
            e.retry_after_ms.map_or(String::new(), |ms| format!("   retry_after_ms: {ms}"))
        );
        outln!("message: {}", e.message);
        if let Some(d) = &e.detail {
            outln!("detail: {d}");
        }
    }
    if let Some(d) = &m.data {
        outln!("data: {d}");
    }
    let a = &env.protected_audit;
    if let Some(op) = &a.operation_id {
        outln!("operation: {op}");
    }
    if let Some(ap) = &a.approval_id {
        outln!("approval: {ap}");
    }
    if let Some(s) = &a.downstream.status_ref {
        outln!("status_ref: {s}");
    }
    if let Some(r) = &a.binding.request_sha256 {
        outln!("request_sha256: {r}");
    }
    if let Some(r) = &a.downstream.receipt_id {
        outln!("receipt: {r}");
    }
}

fn trace_json(t: &crate::store::TraceRow) -> Value {
    crate::telemetry::export::event_json(t)
}

/// `toolgate trace`: the whole trace (or one operation's) as text or JSON lines.
fn trace_command(cli: &Cli, a: &TraceArgs) -> Result<i32, CliError> {
    use crate::telemetry::export::{self, Format};
    let since = match &a.since {
        None => i64::MIN,
        Some(s) => parse_rfc3339(s)
            .ok_or_else(|| CliError::new("BAD_TIME", "--since must be an RFC 3339 time, e.g. 2026-01-01T00:00:00Z"))?,
    };
    let format = match a.format {
        _ if a.json => Format::Jsonl,
        TraceFormatArg::Text => Format::Text,
        TraceFormatArg::Jsonl => Format::Jsonl,
    };
    let mut engine = open_read(cli)?;
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::new(stdout.lock());
    let written = match &a.operation {
        Some(id) => {
            engine.read(|tx| tx.trace_for(id)).map_err(crate::telemetry::TelemetryError::from).and_then(|rows| {
                for t in rows.iter().filter(|t| t.at >= since) {
                    export::write_event(t, format, &mut out)?;
                }
                std::io::Write::flush(&mut out)?;
                Ok(rows.len() as u64)
            })
        }
        None => export::export(&mut engine, since, format, &mut out),
    };
    match written {
        Ok(_) => Ok(0),
        Err(e) if e.is_broken_pipe() => Ok(0),
        Err(e) => Err(CliError::new(e.code(), e.to_string())),
    }
}

/// `toolgate metrics`: print once, or serve `/metrics` until killed.
fn metrics_command(cli: &Cli, a: &MetricsArgs) -> Result<i32, CliError> {
    use crate::telemetry::{metrics, prometheus};
    let mut engine = open_read(cli)?;
    let window = metrics::Window::with_buckets(a.window_minutes, a.bucket_minutes);
    let slice = metrics::Slice {
        tool: a.tool.clone(),
        tenant_ref: a.tenant.as_deref().map(|t| engine.hashed("tenant", t)),
        risk: a.risk.clone(),
        version: a.tool_version.clone(),
    };
    let format = if a.json { MetricsFormatArg::Json } else { a.format };
    let render = move |engine: &mut Engine| -> Result<String, EngineError> {
        let snap = metrics::snapshot(engine, window, &slice)?;
        Ok(match format {
            MetricsFormatArg::Prometheus => prometheus::render(&snap),
            MetricsFormatArg::Json => serde_json::to_string_pretty(&snap).unwrap_or_else(|_| "null".into()) + "\n",
        })
    };
    let Some(addr) = &a.listen else {
        out!("{}", render(&mut engine)?);
        return Ok(0);
    };
    let listen: std::net::SocketAddr = addr.parse().map_err(|_| {
        CliError::new("INVALID_ARGUMENTS", format!("--listen {addr}: not an address (HOST:PORT, e.g. 127.0.0.1:9184)"))
    })?;
    let content_type = match format {
        MetricsFormatArg::Prometheus => prometheus::CONTENT_TYPE,
        MetricsFormatArg::Json => "application/json",
    };
    crate::api::serve_metrics(
        engine,
        listen,
        move |e| render(e).map(|body| (content_type, body)),
        |local| {
            // The first line tells a caller (or a test that asked for port 0) where to scrape.
            outln!("listening on http://{local}/metrics");
            let _ = std::io::Write::flush(&mut std::io::stdout());
            tracing::info!(addr = %local, "serving /metrics");
        },
    )
    .map_err(|e| CliError::new(e.code(), e.to_string()))?;
    Ok(0)
}

fn print_detail(d: &crate::engine::OperationDetail) {
    let o = &d.operation;
    outln!("operation {}  ({} v{})", o.id, o.state, o.version);
    outln!(
        "  tool {}  effect {}  revisions in{}/out{}/eff{}",
        o.tool,
        o.effect,
        o.input_rev,
        o.output_rev,
        o.effect_rev
    );
    outln!("  key_sha256      {}", o.key_sha256);
    outln!("  request_sha256  {}", o.request_sha256);
    outln!("  result_sha256   {}", o.result_sha256.as_deref().unwrap_or("-"));
    outln!("  call_binding    {}", o.call_binding_sha256);
    outln!("  status_ref      {}", o.status_ref);
    outln!(
        "  downstream      request {}  receipt {}",
        o.downstream_request_id.as_deref().unwrap_or("-"),
        o.receipt_id.as_deref().unwrap_or("-")
    );
    if let Some(c) = &o.code {
        outln!("  code            {c}");
    }
    if let Some(until) = d.may_land_until {
        outln!("  may still land  until {} (a decision of no effect waits for it)", rfc3339(until));
    }
    if let Some(until) = d.receipt_window_until {
        outln!("  receipt window  until {} (a receipt may still appear: query again after it)", rfc3339(until));
    }
    for (label, value) in &d.context {
        outln!("  {:<15} {}", crate::display::escape(label), crate::display::escape(value));
    }
    if let Some(r) = &o.resolution {
        outln!(
            "  resolution      {r} by {} ({})",
            crate::display::escape(o.resolved_by.as_deref().unwrap_or("?")),
            crate::display::escape(o.resolution_note.as_deref().unwrap_or(""))
        );
    }
    if let Some(ob) = &d.outbox {
        outln!("  outbox          {} attempt {} (at most {} per call)", ob.state, ob.attempt, ob.max_attempts);
    }
    outln!("attempts:");
    for a in &d.attempts {
        outln!(
            "  #{} by {}  claimed {}  sent {}  -> {} {}",
            a.attempt,
            a.owner,
            rfc3339(a.claimed_at),
            a.sent_at.map_or("never".into(), rfc3339),
            a.outcome.map_or("open", AttemptOutcome::as_str),
            a.code.as_deref().unwrap_or("")
        );
    }
    outln!("trace:");
    for t in &d.trace {
        outln!(
            "  {} {:<16} {:<24} {:<12} {:<18} {:<9} {}",
            rfc3339(t.at),
            t.step,
            t.code.as_deref().unwrap_or("-"),
            t.outcome.as_deref().unwrap_or("-"),
            t.delivery.as_deref().unwrap_or("-"),
            t.attempt.map_or(String::new(), |a| format!("attempt {a}")),
            crate::telemetry::export::describe(t)
        );
    }
    if !d.audit.is_empty() {
        outln!("operator log:");
        for r in &d.audit {
            outln!(
                "  {} {} {} by {}: {}",
                rfc3339(r.at),
                r.action,
                r.result,
                crate::display::escape(&r.actor),
                crate::display::escape(&r.reason)
            );
        }
    }
}

// ------------------------------------------------------- tokens and serve

/// The operator an operator-log entry names: `--operator`, else `$USER`.
/// The operator a command acts as: `--operator`, else the login name (the
/// console's default too), else `operator`.
fn operator_or_user(cli: &Cli) -> String {
    cli.operator.clone().unwrap_or_else(crate::tui::default_operator)
}

fn tenant_command(cli: &Cli, what: &TenantCommand) -> Result<i32, CliError> {
    refuse_read_only(cli)?;
    let operator = operator_or_user(cli);
    let mut engine = open(cli)?;
    match what {
        TenantCommand::Add { name, approvers, approval_threshold_minor, json } => {
            let spec = crate::engine::world::TenantSpec {
                id: name.clone(),
                approvers: approvers.clone(),
                approval_threshold_minor: *approval_threshold_minor,
            };
            engine.add_tenant(&spec, &operator)?;
            if *json {
                print_json(&json!({"action": "tenant_add", "tenant": name, "changed": true}));
            } else {
                outln!("tenant {} added", crate::display::escape(name));
            }
        }
        TenantCommand::Disable(a) | TenantCommand::Enable(a) => {
            let enable = matches!(what, TenantCommand::Enable(_));
            let changed = engine.set_enabled(&a.name, None, enable, &operator)?;
            principal_changed(a.json, "tenant", enable, changed);
        }
    }
    Ok(0)
}

fn subject_command(cli: &Cli, what: &SubjectCommand) -> Result<i32, CliError> {
    refuse_read_only(cli)?;
    let operator = operator_or_user(cli);
    let mut engine = open(cli)?;
    match what {
        SubjectCommand::Add(a) => {
            engine.add_subject(&a.tenant, &a.name, &operator)?;
            if a.json {
                print_json(&json!({"action": "subject_add", "tenant": a.tenant, "subject": a.name, "changed": true}));
            } else {
                outln!("subject {} added to {}", crate::display::escape(&a.name), crate::display::escape(&a.tenant));
            }
        }
        SubjectCommand::Disable(a) | SubjectCommand::Enable(a) => {
            let enable = matches!(what, SubjectCommand::Enable(_));
            let changed = engine.set_enabled(&a.tenant, Some(&a.name), enable, &operator)?;
            principal_changed(a.json, "subject", enable, changed);
        }
    }
    Ok(0)
}

fn principal_changed(json: bool, who: &str, enable: bool, changed: bool) {
    let verb = if enable { "enable" } else { "disable" };
    if json {
        print_json(&json!({"action": format!("{who}_{verb}"), "changed": changed}));
    } else {
        outln!("{verb}d{}", if changed { "" } else { " (it already was)" });
    }
}

fn token_command(cli: &Cli, what: &TokenCommand) -> Result<i32, CliError> {
    use crate::engine::tokens::TokenFor;
    match what {
        TokenCommand::Create { tenant, subject, all_tenants, name, expires, json } => {
            refuse_read_only(cli)?;
            let who = match (tenant.as_slice(), subject, &cli.operator, all_tenants) {
                ([t], Some(s), None, false) => TokenFor::Subject { tenant: t.clone(), subject: s.clone() },
                ([], None, Some(o), true) => TokenFor::Operator { operator: o.clone(), tenants: None },
                ([_, ..], None, Some(o), false) => TokenFor::Operator { operator: o.clone(), tenants: Some(tenant.clone()) },
                ([], None, Some(_), false) => {
                    return Err(CliError::new(
                        "USAGE",
                        "an operator token names the tenants it may act in (--tenant T, repeatable) or says --all-tenants",
                    ))
                }
                _ => {
                    return Err(CliError::new(
                        "USAGE",
                        "give either --tenant T --subject S (an agent's token) or --operator NAME with --tenant T... or --all-tenants (an operator's), not both",
                    ))
                }
            };
            let expires_at = expires
                .as_deref()
                .map(|s| {
                    parse_rfc3339(s).ok_or_else(|| {
                        CliError::new("BAD_TIME", "--expires must be an RFC 3339 time, e.g. 2026-01-01T00:00:00Z")
                    })
                })
                .transpose()?;
            let mut engine = open(cli)?;
            let t = engine.create_token(&who, name.as_deref(), expires_at)?;
            if *json {
                print_json(&json!({"token": t.token, "id": t.row.id, "prefix": t.row.prefix, "kind": t.row.kind,
                    "tenant": t.row.tenant, "subject": t.row.subject, "operator": t.row.operator, "name": t.row.name,
                    "expires_at": t.row.expires_at.map(rfc3339)}));
            } else {
                outln!("{}", t.token);
                eprintln!("token {} ({}): shown once, the ledger keeps only its digest", t.row.id, t.row.kind);
            }
            Ok(0)
        }
        TokenCommand::List { json } => {
            let mut engine = open_read(cli)?;
            let rows = engine.tokens()?;
            let now = engine.clock().now_ms();
            let state = |r: &crate::store::TokenRow| {
                if r.revoked_at.is_some() {
                    "revoked"
                } else if r.expires_at.is_some_and(|t| now >= t) {
                    "expired"
                } else {
                    "active"
                }
            };
            if *json {
                let list: Vec<Value> = rows
                    .iter()
                    .map(|r| {
                        json!({"id": r.id, "prefix": r.prefix, "kind": r.kind, "tenant": r.tenant, "subject": r.subject,
                        "operator": r.operator, "name": r.name, "created_at": rfc3339(r.created_at),
                        "expires_at": r.expires_at.map(rfc3339), "revoked_at": r.revoked_at.map(rfc3339),
                        "state": state(r),
                        "operator_tenants": (r.kind == "operator").then(|| match &r.operator_tenants {
                            None => json!("all"),
                            Some(t) => json!(t.split(',').collect::<Vec<_>>()),
                        })})
                    })
                    .collect();
                print_json(&json!({"tokens": list}));
            } else if rows.is_empty() {
                outln!("no tokens");
            } else {
                outln!("{:<20} {:<20} {:<8} {:<28} {:<8} name", "id", "prefix", "kind", "for", "state");
                for r in &rows {
                    let who = match (&r.tenant, &r.subject, &r.operator) {
                        (Some(t), Some(s), _) => format!("{t}/{s}"),
                        (_, _, Some(o)) => match &r.operator_tenants {
                            None => format!("{o} (all tenants)"),
                            Some(t) => format!("{o} ({t})"),
                        },
                        _ => "?".into(),
                    };
                    outln!(
                        "{:<20} {:<20} {:<8} {:<28} {:<8} {}",
                        r.id,
                        r.prefix,
                        r.kind,
                        crate::display::escape(&who),
                        state(r),
                        crate::display::escape(r.name.as_deref().unwrap_or("-"))
                    );
                }
            }
            Ok(0)
        }
        TokenCommand::Revoke { id, json } => {
            refuse_read_only(cli)?;
            let mut engine = open(cli)?;
            let changed = engine.revoke_token(id)?;
            if *json {
                print_json(&json!({"revoked": id, "changed": changed}));
            } else {
                outln!("revoked{}", if changed { "" } else { " (it already was)" });
            }
            Ok(0)
        }
    }
}

fn serve_command(cli: &Cli, a: &ServeArgs) -> Result<i32, CliError> {
    refuse_read_only(cli)?;
    if a.threads == 0 || a.threads > 64 {
        return Err(CliError::new("USAGE", "--threads must be between 1 and 64"));
    }
    let path = db_path(cli)?;
    let opts = engine_options(cli)?;
    crate::telemetry::logging::init_for_db(path);
    let serve = crate::api::ServeOptions {
        listen: a.listen,
        public: a.public,
        threads: a.threads,
        toolset: opts.toolset,
        sync: opts.sync,
        worker: true,
        clock: opts.clock,
        max_connections: a.max_connections as usize,
        max_connections_per_client: a.max_connections_per_client as usize,
    };
    crate::api::serve(path, &serve, |addr| {
        outln!("listening on http://{addr}");
    })
    .map_err(|e| CliError::new(e.code(), e.to_string()))?;
    Ok(0)
}

// ------------------------------------------------- cancel, load and the lab

/// `cancel` arguments.
#[derive(Debug, Args)]
pub struct CancelArgs {
    /// Operation id.
    pub operation_id: String,
    /// Note, version seen, action id.
    #[command(flatten)]
    pub act: OperatorActArgs,
}

/// `load` arguments.
#[derive(Debug, Args)]
pub struct LoadArgs {
    /// Agents (threads, each with its own dispatcher and outbox worker).
    #[arg(long, default_value_t = 4)]
    pub agents: usize,
    /// Business intents to carry out in total.
    #[arg(long, default_value_t = 1000)]
    pub ops: u64,
    /// Fault rate of the simulated providers, e.g. `5%` or `0.05` (kept in the
    /// database: a console on it can change it live). Default: the database's.
    #[arg(long, value_name = "SPEC")]
    pub fault_rate: Option<String>,
    /// Seed of the agents' choices and faults.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// The providers' database when they run as `toolgate provider serve`
    /// (with `--catalog assets/catalog-http`): the referee counts effects there.
    #[arg(long = "provider-db", value_name = "PATH")]
    pub provider_db: Option<PathBuf>,
    /// Switch this defense off for the run (demo databases only; see `toolgate lab`).
    #[arg(long, value_name = "TOGGLE")]
    pub lab: Option<String>,
    /// Drive the agents through the HTTP API of `toolgate serve` at URL
    /// (repeat it for several replicas on this --db; each call goes to one at
    /// random). The run mints one token per agent and approver in the ledger
    /// and revokes them at its end; the servers run the outbox.
    #[arg(long = "url", value_name = "URL")]
    pub urls: Vec<String>,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

/// `lab` arguments.
#[derive(Debug, Args)]
pub struct LabArgs {
    /// Switch this defense off (one at a time; replaces the active one).
    #[arg(long, value_name = "NAME", conflicts_with = "off")]
    pub toggle: Option<String>,
    /// Put every defense back on.
    #[arg(long)]
    pub off: bool,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

/// Writes to stdout; a closed pipe (`| head`) is not an error worth a panic.
/// Writes to standard output. A reader that went away (`toolgate ops list |
/// head -1`) ends the command quietly with exit 0, as coreutils and ripgrep
/// do; any other write failure is reported once, without a panic.
///
/// The CLI prints no escape sequences of its own, so every control character
/// but the line breaks of its own layout is written out (`\u{1b}`): a stored
/// name or note cannot clear the screen or move the cursor. Stored free text
/// that may hold a line break goes through [`crate::display::escape`] first.
fn write_stdout(text: &str) {
    use std::io::Write as _;
    let safe: std::borrow::Cow<'_, str> = if text.chars().any(|c| c.is_control() && c != '\n') {
        text.split('\n').map(crate::display::escape).collect::<Vec<_>>().join("\n").into()
    } else {
        text.into()
    };
    let mut out = std::io::stdout().lock();
    match out.write_all(safe.as_bytes()).and_then(|()| out.flush()) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => std::process::exit(0),
        Err(e) => {
            // Not `eprintln!`: on a closed terminal stderr fails too, and it
            // would panic instead of exiting with the code.
            let _ = writeln!(std::io::stderr(), "error[STDOUT_FAILED]: cannot write the output: {}", e.kind());
            std::process::exit(2);
        }
    }
}

fn operator_of(cli: &Cli, what: &str) -> Result<String, CliError> {
    cli.operator
        .clone()
        .ok_or_else(|| CliError::new("OPERATOR_REQUIRED", format!("--operator NAME is required to {what}")))
}

fn cancel_command(cli: &Cli, a: &CancelArgs) -> Result<i32, CliError> {
    refuse_read_only(cli)?;
    let operator = operator_of(cli, "cancel")?;
    let mut engine = open(cli)?;
    let out = engine.cancel(&crate::engine::CancelRequest {
        operation_id: a.operation_id.clone(),
        operator,
        note: a.act.note.clone(),
        seen_version: a.act.seen_version,
        action_id: a.act.action_id.clone(),
    })?;
    print_outcome(&out, a.act.json);
    Ok(i32::from(!out.applied))
}

/// `5%`, `0.05` or `0` → basis points.
fn parse_fault_rate(spec: &str) -> Result<u32, CliError> {
    let bad = || CliError::new("BAD_FAULT_RATE", "--fault-rate must be a rate such as 5% or 0.05 (0% to 100%)");
    let s = spec.trim();
    let rate = match s.strip_suffix('%') {
        Some(p) => p.trim().parse::<f64>().map_err(|_| bad())? / 100.0,
        None => s.parse::<f64>().map_err(|_| bad())?,
    };
    if !(0.0..=1.0).contains(&rate) {
        return Err(bad());
    }
    Ok((rate * 10_000.0).round() as u32)
}

fn lab_toggle_arg(name: &str) -> Result<crate::engine::LabToggle, CliError> {
    crate::engine::LabToggle::parse(name).ok_or_else(|| {
        let names: Vec<&str> = crate::engine::LabToggle::ALL.iter().map(|t| t.as_str()).collect();
        CliError::new("UNKNOWN_TOGGLE", format!("no lab toggle named {name:?}; one of: {}", names.join(", ")))
    })
}

fn load_command(cli: &Cli, a: &LoadArgs) -> Result<i32, CliError> {
    use std::io::IsTerminal;
    refuse_read_only(cli)?;
    let path = db_path(cli)?;
    let fault_bp = a.fault_rate.as_deref().map(parse_fault_rate).transpose()?;
    let lab = a.lab.as_deref().map(lab_toggle_arg).transpose()?;
    if a.agents == 0 || a.agents > 256 {
        return Err(CliError::new("USAGE", "--agents must be between 1 and 256"));
    }
    if let Some(bad) = a.urls.iter().find(|u| !(u.starts_with("http://") || u.starts_with("https://"))) {
        return Err(CliError::new("USAGE", format!("--url takes an http:// address, not {bad:?}")));
    }
    // Opening checks the file (and fails with its own code) before any thread starts.
    drop(open(cli)?);
    let opts = crate::load::LoadOptions {
        agents: a.agents,
        ops: a.ops,
        fault_bp,
        seed: a.seed,
        lab,
        operator: cli.operator.clone().unwrap_or_else(|| "loadgen".into()),
        clock: clock_from(cli.now.as_deref())?,
        toolset: engine_options(cli)?.toolset,
        provider_db: a.provider_db.clone(),
        urls: a.urls.clone(),
        ..crate::load::LoadOptions::default()
    };
    let bar = std::io::stderr().is_terminal();
    let mut progress = |p: crate::load::Progress| {
        if bar {
            eprint!("\r{}", crate::load::progress_line(&p));
        }
    };
    let report = crate::load::run(path, &opts, &mut progress)?;
    if bar {
        eprintln!();
    }
    if a.json {
        print_json(&report);
    } else {
        write_stdout(&crate::load::render(&report));
    }
    // A run whose every call was refused for what it asked (an unknown tool,
    // a missing grant, arguments the catalog refuses) measured nothing.
    let refused_as_asked = ["UNKNOWN_TOOL", "POLICY_DENIED", "SUBJECT_DISABLED", "INVALID_ARGUMENTS", "NOT_FOUND"];
    if report.calls > 0 && report.answers.keys().all(|code| refused_as_asked.contains(&code.as_str())) {
        let said: Vec<String> = report.answers.iter().map(|(c, n)| format!("{c} {n}")).collect();
        eprintln!(
            "load: every call was refused for what it asked ({}): the catalog or the world does not fit this load",
            said.join(", ")
        );
        return Ok(1);
    }
    // With every defense on, a duplicate or a silently wrong result is a failure.
    Ok(i32::from(lab.is_none() && (report.duplicates > 0 || report.silently_wrong > 0)))
}

fn lab_command(cli: &Cli, a: &LabArgs) -> Result<i32, CliError> {
    use std::fmt::Write as _;

    use crate::engine::LabToggle;
    let mut engine = open(cli)?;
    if a.off || a.toggle.is_some() {
        refuse_read_only(cli)?;
        let toggle = a.toggle.as_deref().map(lab_toggle_arg).transpose()?;
        let operator = operator_or_user(cli);
        engine.set_lab_toggle(toggle, &operator)?;
    }
    let state = engine.lab_state()?;
    if a.json {
        let toggles: Vec<Value> = LabToggle::ALL
            .iter()
            .map(
                |t| json!({"name": t.as_str(), "side": t.side(), "rule": t.rule(), "harm": t.harm(), "keel": t.keel()}),
            )
            .collect();
        print_json(&json!({"lab": state, "toggles": toggles}));
        return Ok(0);
    }
    let mut out = String::new();
    if state.demo {
        let _ = match state.toggle {
            Some(t) => writeln!(out, "LAB: defense OFF: {}  ({})", t.as_str(), t.keel()),
            None => writeln!(out, "lab: every defense on"),
        };
    } else {
        let _ = writeln!(out, "not a demo database: lab toggles are refused here (LAB_NOT_DEMO)");
        let _ = writeln!(out, "make one with `toolgate demo-db --out PATH`, or run `toolgate demo`");
    }
    let _ = writeln!(out, "fault rate of the simulated agents: {:.1}%", f64::from(state.fault_bp) / 100.0);
    let _ = writeln!(out, "masked conflicts so far: {}\n", state.masked_conflicts);
    for t in LabToggle::ALL {
        let on = if state.toggle == Some(t) { "*" } else { " " };
        let _ = writeln!(out, "{on} {:<28} {}", t.as_str(), t.rule());
        let _ = writeln!(out, "  {:<28} {}", "", t.harm());
    }
    write_stdout(&out);
    Ok(0)
}

#[cfg(test)]
mod lab_cli_tests {
    use super::parse_fault_rate;

    #[test]
    fn fault_rates() {
        for (spec, bp) in
            [("5%", Some(500)), ("0.05", Some(500)), ("0", Some(0)), ("100%", Some(10_000)), ("0.5%", Some(50))]
        {
            assert_eq!(parse_fault_rate(spec).ok(), bp, "{spec}");
        }
        for spec in ["-1%", "101%", "x", "1.5"] {
            assert!(parse_fault_rate(spec).is_err(), "{spec}");
        }
    }
}
