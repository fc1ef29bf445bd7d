//! The command line's grammar (clap): every command, its arguments and their
//! documentation, which `--help` prints.

use crate::engine::canonical::CallIdentity;
use crate::engine::fresh_call_identity;
use clap::{Args, Parser, Subcommand, ValueEnum};
use std::ffi::OsString;
use std::path::PathBuf;

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
    /// Rewrite a SQLite ledger into the least space and set it to give space
    /// back after each purge from then on (a ledger made before schema 18
    /// needs this once; it holds the database while it runs). PostgreSQL:
    /// refused, its autovacuum does this.
    Vacuum {
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
    /// Worker pass: run every due outbox row, then ask about the unknown
    /// outcomes of tools whose downstream a worker asks by itself
    /// (`downstream.auto_query`).
    Work {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// The tool catalog: check a directory offline, or print the JSON Schema
    /// of a catalog file (for an editor).
    Catalog {
        /// What to do.
        #[command(subcommand)]
        what: CatalogCommand,
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
        /// Only this tool (the console's `tool:` filter).
        #[arg(long)]
        tool: Option<String>,
        /// Order by this column, newest or largest first (`updated`,
        /// `operation`, `since`, `created`, `tool`, `scope`, `state`: the
        /// console's sort columns, index-backed).
        #[arg(long, value_name = "COLUMN")]
        sort: Option<String>,
        /// With --sort: smallest or oldest first.
        #[arg(long, requires = "sort")]
        asc: bool,
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

/// `toolgate catalog ...`.
#[derive(Debug, Subcommand)]
pub enum CatalogCommand {
    /// Load a catalog directory as `--catalog` would, without a ledger, and
    /// print every problem at once, each with its file and field. Exits 1
    /// when there is any.
    Check {
        /// The catalog directory.
        dir: PathBuf,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Print the JSON Schema of one catalog file (its shape; `check` also
    /// applies the rules that span fields).
    Schema,
    /// Read an MCP server's tools (`tools/list`) and write one catalog file
    /// per tool into DIR, for a person to review before use: the schemas as
    /// the server gives them, the effect class proposed from its annotations
    /// (`readOnlyHint`: read; anything else external, unless --key-argument
    /// says the server de-duplicates by that argument). The server is a
    /// command after `--` (stdio, started now and stopped after) or --url.
    ImportMcp {
        /// Where to write the files (made if missing).
        #[arg(long, value_name = "DIR")]
        out: PathBuf,
        /// A streamable HTTP server instead of a command.
        #[arg(long, value_name = "URL")]
        url: Option<String>,
        /// The environment variable holding the server's bearer token (with --url).
        #[arg(long, value_name = "VAR", requires = "url")]
        bearer_env: Option<String>,
        /// Downstream names are PREFIX_TOOL.
        #[arg(long, value_name = "PREFIX", default_value = "mcp")]
        prefix: String,
        /// The argument by which the server de-duplicates calls: tools that
        /// take it become `write` (toolgate fills it with its downstream key
        /// and asks an unknown outcome by re-sending).
        #[arg(long, value_name = "NAME")]
        key_argument: Option<String>,
        /// How long the server remembers a key (with --key-argument).
        #[arg(long, value_name = "MS", default_value_t = 86_400_000)]
        key_retention_ms: u64,
        /// Replace files that exist.
        #[arg(long)]
        force: bool,
        /// Print JSON.
        #[arg(long)]
        json: bool,
        /// The server's command and arguments (stdio), after `--`.
        #[arg(last = true, value_name = "COMMAND")]
        command: Vec<String>,
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
    pub(super) fn identity(&self) -> CallIdentity {
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

impl Command {
    /// Whether the command changes the ledger. With `--read-only` such a
    /// command is refused before it reads anything (`READ_ONLY`): one place,
    /// an exhaustive match, so a new command must say which it is.
    pub fn writes(&self) -> bool {
        // `--all --dry-run` only plans: it reads.
        let acts = |sel: &SelectArgs| !(sel.all && sel.dry_run);
        match self {
            Command::Mcp { .. }
            | Command::Init { .. }
            | Command::Dispatch(_)
            | Command::Grant(_)
            | Command::Revoke(_)
            | Command::Reap { .. }
            | Command::Vacuum { .. }
            | Command::Work { .. }
            | Command::Tenant { .. }
            | Command::Subject { .. }
            | Command::Serve(_)
            | Command::Cancel(_)
            | Command::Load(_) => true,
            Command::Query(a) => acts(&a.select),
            Command::Approve { select, .. } | Command::Deny { select, .. } => acts(select),
            Command::Resolve(a) => acts(&a.select),
            Command::Clock { accept, .. } => *accept,
            Command::Token { what } => matches!(what, TokenCommand::Create { .. } | TokenCommand::Revoke { .. }),
            Command::Lab(a) => a.off || a.toggle.is_some(),
            // The console opens a ledger read-only itself under --read-only
            // (`demo` with agents on a --db ledger is refused by `console`);
            // the provider's own store is not the ledger.
            Command::Demo { .. }
            | Command::DemoDb { .. }
            | Command::Provider { .. }
            | Command::Approvals { .. }
            | Command::Ops { .. }
            | Command::Counts { .. }
            | Command::Orders { .. }
            | Command::Scenario { .. }
            | Command::Catalog { .. }
            | Command::Trace(_)
            | Command::Metrics(_)
            | Command::Bench { .. }
            | Command::Audit { .. } => false,
        }
    }
}

pub(super) fn command_wants_json(c: Option<&Command>) -> bool {
    match c {
        Some(
            Command::Init { json, .. }
            | Command::Approve { json, .. }
            | Command::Deny { json, .. }
            | Command::Approvals { json }
            | Command::Counts { json }
            | Command::Orders { json }
            | Command::Reap { json }
            | Command::Vacuum { json }
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
        Some(Command::Catalog { what: CatalogCommand::Check { json, .. } }) => *json,
        Some(Command::Catalog { what: CatalogCommand::Schema }) => true,
        Some(Command::Catalog { what: CatalogCommand::ImportMcp { json, .. } }) => *json,
        Some(Command::Trace(a)) => a.json || a.format == TraceFormatArg::Jsonl,
        Some(Command::Metrics(a)) => a.json || a.format == MetricsFormatArg::Json,
        None => false,
    }
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
    /// Before the referee counts, wait this long, then run the outbox and the
    /// workers' status queries (re-sends of `lookup.by = resend` tools) once
    /// more, so retries and unknown outcomes still waiting get their turn.
    #[arg(long, value_name = "MS", default_value_t = 0)]
    pub settle_ms: u64,
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

/// `cancel` arguments.
#[derive(Debug, Args)]
pub struct CancelArgs {
    /// Operation id.
    pub operation_id: String,
    /// Note, version seen, action id.
    #[command(flatten)]
    pub act: OperatorActArgs,
}
