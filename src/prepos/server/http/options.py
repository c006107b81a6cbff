"""`prepos serve`'s command line: its options, parsed and checked into a `ServerConfig`.

    prepos serve [--model DIR] [--host 127.0.0.1] [--port 8000] [--journal PATH] ...

The server listens at once and loads the model (and restores the journal's sessions) in
the background: `GET /health` answers 503 until it is ready, then 200. With `--backend
llama-server`, `vllm` or `sglang` it serves in front of engines already running at
`--engine-url`, `--model` naming the same model for its tokenizer and chat template.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import replace
from pathlib import Path

from prepos.config import (
    KV_LAYOUTS,
    BudgetConfig,
    EngineConfig,
    RelaxedConfig,
    TierConfig,
    default_threads,
)
from prepos.engine import remote_config
from prepos.paths import DEFAULT_MODEL
from prepos.server.http.auth import load_keys
from prepos.server.http.guard import MAX_HEADER_BYTES
from prepos.server.http.limits import Limits
from prepos.server.http.state import REMOTE_ENGINES, RemoteEngine, ServerConfig
from prepos.server.store.database import is_url
from prepos.server.store.lease import LeaseConfig


def size(text: str) -> int:
    """A size in bytes: an integer, or one with a K, M or G suffix (powers of 1024)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper().removesuffix("B")
    try:
        return int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 4G, 512M)") from None


def default_journal(model: Path) -> Path:
    state = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state")
    return state / "prepos" / f"{Path(model).name}.sqlite3"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    return parser().parse_args(argv)


def parser() -> argparse.ArgumentParser:
    """`prepos serve`'s options (docs/options.md is made from them: tests/docs/test_readme.py
    checks)."""
    p = argparse.ArgumentParser(prog="prepos serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL,
                   help="an HF model directory, a .gguf file or a known model's name "
                   "(smollm2) (default: the bundled %(default)s)")
    p.add_argument("--backend", default="auto", choices=["auto", "torch", "llama.cpp",
                                                          *REMOTE_ENGINES],
                   help="in process: auto (llama.cpp where it is installed, GGUF files "
                   "always; else torch), torch or llama.cpp; in front of a running engine: "
                   "llama-server, vllm or sglang at --engine-url, --model then naming the "
                   "same model for its tokenizer and chat template (an HF directory, a "
                   ".gguf file or smollm2)")
    p.add_argument("--engine-url", action="append", default=[],
                   help="a remote engine's base URL, e.g. http://127.0.0.1:8080 (repeatable: "
                   "replicas of one model, each session on one of them)")
    p.add_argument("--background-gives-way", action="store_true",
                   help="in front of vLLM or SGLang: idle work (a pre-decode) gives way to every "
                   "foreground request on its replica (stopped, resumed once none is in "
                   "flight), as on llama-server, instead of running beside it at background "
                   "priority; for engines on CPUs, where a batched step costs its width")
    p.add_argument("--engine-model",
                   help="the model name the remote engine serves, sent in its requests "
                   "(vLLM, SGLang; default: the engine's only model)")
    p.add_argument("--kv-cells", type=int, default=EngineConfig.kv_cells,
                   help="llama.cpp: the resident KV cells all sessions share (default "
                   "%(default)s; the rest of their KV waits in the tiers below)")
    p.add_argument("--batch-tokens", type=int, default=EngineConfig.batch_tokens,
                   help="the tokens of one batched step: every decoding stream's next token, "
                   "then prompts in the rest, a long one in chunks (default %(default)s; as "
                   "llama-server's -b). Smaller: a decoding stream waits less behind a "
                   "prompt, prompts take longer")
    p.add_argument("--batch-wait-ms", type=float, default=EngineConfig.batch_wait_ms,
                   help="a step that would start from idle waits at most this long for the "
                   "chat, Responses and Messages requests still being read, so requests "
                   "sent together start in one step (default %(default)s; 0: never wait). "
                   "A lone request never waits")
    p.add_argument("--kv-sequences", type=int, default=EngineConfig.max_sequences,
                   help="llama.cpp: sessions holding a KV at once (at most 256)")
    p.add_argument("--kv-layout", default=EngineConfig.kv_layout, choices=KV_LAYOUTS,
                   help="llama.cpp: unified (one pool; every step scans all sessions' cells) "
                   "or streams (kv-cells / kv-sequences cells per session, each step scans "
                   "its own: faster with many sessions resident or decoding at once)")
    p.add_argument("--kv-idle-cells", type=int, default=EngineConfig.kv_idle_cells,
                   help="llama.cpp, unified layout: the cells idle sessions keep resident "
                   "while a request runs; the rest move to the RAM tier, least recently used "
                   "first (default %(default)s; -1: no bound but --kv-cells)")
    p.add_argument("--kv-ram", type=size, default=None,
                   help="bytes of host RAM for the KV of sessions not resident (K/M/G "
                   "suffixes; default: a quarter of the machine's memory)")
    p.add_argument("--ready-logits-memory", type=size,
                   default=EngineConfig.ready_logits_bytes,
                   help="bytes of full next-token vectors prepared answers keep, most recently "
                   "used first (K/M/G; default 512M); beyond it a prepared answer keeps its "
                   "top tokens: greedy requests are answered from it, others take the full "
                   "path")
    p.add_argument("--kv-disk", type=size, default=TierConfig().disk_bytes,
                   help="bytes of disk for the KV below RAM (default 16G); beyond it a "
                   "session's KV is recomputed from its committed tokens when needed")
    p.add_argument("--kv-dir", type=Path, default=None,
                   help="where the disk tier's files go (default: the system's temporary "
                   "directory; removed when the server stops)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    p.add_argument("--port-file", type=Path, help="write the bound port here once listening")
    p.add_argument("--served-model-name", help="the model id of /v1 (default: the dir name)")
    p.add_argument("--journal", help="SQLite journal path (default: "
                   "$XDG_STATE_HOME/prepos/<model>.sqlite3); 'none' disables persistence")
    p.add_argument("--store", dest="journal", help="the session store: a SQLite path (as "
                   "--journal) or a postgresql:// URL, shared by several nodes that own "
                   "sessions by lease")
    p.add_argument("--store-timeout", type=float, default=2.0, help="seconds a write may "
                   "wait for the store (a locked or slow one); then the request is refused "
                   "with 503 store_unavailable and nothing is committed (default %(default)s)")
    p.add_argument("--node-id", default="", help="this node's name in a shared store "
                   "(default: a new random one per process)")
    p.add_argument("--advertise-url", help="where the other nodes reach this one (default: "
                   "http://HOST:PORT as bound)")
    p.add_argument("--lease-seconds", type=float, default=LeaseConfig.lease_s,
                   help="a node's lease on its sessions: another node takes them over this "
                   "long after it stops renewing (default %(default)s)")
    p.add_argument("--renew-seconds", type=float, default=LeaseConfig.renew_s,
                   help="how often the lease is renewed (default %(default)s)")
    p.add_argument("--api-key", action="append", default=[],
                   help="accept this Bearer key (repeatable; also PREPOS_API_KEYS, comma-"
                   "separated); with none given the server is open")
    p.add_argument("--api-keys-file", help="file of keys, one a line")
    p.add_argument("--metrics-key", action="append", default=[],
                   help="GET /metrics needs this Bearer key (repeatable; also "
                   "PREPOS_METRICS_KEYS; give an API key here to let its holder scrape); "
                   "with none given /metrics is public")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--threads", type=int, default=default_threads(),
                   help="compute threads (default: one per physical core this process may "
                   "run on, as llama.cpp's own default)")
    p.add_argument("--no-preposition", action="store_true",
                   help="never pre-position (every request pays its entry: the baseline)")
    p.add_argument("--predecode-tokens", type=int, default=EngineConfig.predecode_tokens,
                   help="after an exact entry is pre-positioned (a standing query, the turn "
                        "after a user message or tool result), decode its greedy answer at "
                        "idle up to this many tokens (a session's answer_max_tokens "
                        "overrides it; 0: off)")
    p.add_argument("--predecode-min-hit", type=float, default=EngineConfig.predecode_min_hit,
                   help="pre-decode an entry, or bring a session's KV back from RAM or disk "
                        "to pre-position it, only while the chance h = rho / (1 + rho) that a "
                        "request comes before the next update (rho: its session's requests per "
                        "update, as observed) is at least this (0: always)")
    p.add_argument("--lookup-tokens", type=int, default=EngineConfig.lookup_tokens,
                   help="prompt-lookup draft tokens verified per forward of a greedy answer "
                        "(0: off)")
    p.add_argument("--lookup-said-tokens", type=int, default=EngineConfig.lookup_said_tokens,
                   help="tokens of a session's latest answers its next greedy answer drafts "
                        "from besides its context (0: the context only)")
    p.add_argument("--relaxed-r-max", type=float, default=RelaxedConfig.r_max,
                   help="the relaxed fast path's risk budget: a question class is served "
                        "while its verified false-accept rate's Wilson upper bound is within")
    p.add_argument("--relaxed-start", default=RelaxedConfig.start, choices=["cold", "serve"],
                   help="a new question class on the relaxed path: answered by the full path, "
                        "its answers the evidence, until promoted (cold, the default: no "
                        "unverified exposure), or served relaxed on probation, each answer "
                        "verified after it is served and corrected if wrong (serve)")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20)
    p.add_argument("--max-sessions", type=int, default=Limits.max_sessions,
                   help="sessions the server keeps (journalled; their KV in the tiers)")
    p.add_argument("--max-sessions-per-key", type=int,
                   help="sessions one API key may hold (default: an equal share of "
                   "--max-sessions for each key, so no key can crowd the others out)")
    p.add_argument("--max-subscribers", type=int, default=Limits.max_subscribers,
                   help="event subscriptions (SSE) open at once (default %(default)s)")
    p.add_argument("--max-subscribers-per-key", type=int,
                   help="event subscriptions one API key may hold open (default: an equal "
                   "share of --max-subscribers for each key)")
    p.add_argument("--max-tokens", type=int, default=1024,
                   help="most tokens a request may generate")
    p.add_argument("--default-max-tokens", type=int, default=64,
                   help="tokens a session-API request generates when it names no max_tokens "
                        "(an OpenAI request without one takes the rest of the context, up "
                        "to --max-tokens)")
    p.add_argument("--strict-max-tokens", action="store_true",
                   help="refuse (400) a max_tokens over --max-tokens or past the context, "
                   "instead of answering up to either with finish_reason length")
    p.add_argument("--max-input-tokens", type=int,
                   help="most tokens of input text in one request (default: the model's "
                   "context)")
    p.add_argument("--context-length", type=int,
                   help="the model's context in tokens (llama.cpp): past its training "
                   "context, RoPE scaled with YaRN (default: as trained); the resident KV "
                   "cells are at least this many")
    p.add_argument("--max-session-tokens", type=int,
                   help="most tokens a session may hold (default: the model's context)")
    p.add_argument("--max-session-cells", type=int, default=BudgetConfig.session_cells,
                   help="default per-session KV cell budget (default: the model's context)")
    p.add_argument("--max-kv-cells", type=int, default=BudgetConfig.engine_cells,
                   help="the engine's KV cell budget")
    p.add_argument("--max-queue", type=int, default=256,
                   help="foreground requests queued on the model worker before 429")
    p.add_argument("--switch-interval-ms", type=float, default=0.5,
                   help="the interpreter's thread switch interval (default %(default)s ms)")
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--access-log", action="store_true")
    p.add_argument("--allowed-origins", default="",
                   help="CORS: comma-separated browser origins allowed to call the API "
                   "('*' for any; default: none, no CORS headers); web pages of other "
                   "origins may not send requests that change something (403)")
    p.add_argument("--allowed-hosts", default="",
                   help="comma-separated host names the server answers besides IP addresses, "
                   "localhost, the --host name and (listening beyond loopback) this "
                   "machine's name ('.example.com' takes its subdomains; '*' any): other "
                   "Host headers are refused (403), as DNS rebinding sends them")
    p.add_argument("--implicit-memory", type=size, default=EngineConfig.implicit_memory,
                   help="bytes of bookkeeping (tokens, text, messages; their KV is the "
                   "tiers') for stateless chat conversations kept as implicit sessions, so a "
                   "stock client's next turn pays only its new messages, and as many for "
                   "stored Responses API chains; a kept one whose KV the tiers dropped is "
                   "closed (K/M/G; 0: none kept; default 1G)")
    p.add_argument("--implicit-sessions", type=int, default=None,
                   help="at most this many implicit sessions too (default: no count, only "
                   "--implicit-memory; 0: none kept)")
    p.add_argument("--response-sessions", type=int, default=EngineConfig.response_sessions,
                   help="at most this many stored Responses API chains kept as sessions too, "
                   "least recently used closed first (their responses stay stored; default: "
                   "no count, only --implicit-memory; 0: none kept)")
    p.add_argument("--responses-bytes", type=size, default=ServerConfig.responses_bytes,
                   help="bytes of stored responses per API key, the oldest evicted first, "
                   "and as many of conversations (K/M/G suffixes; default 256M)")
    p.add_argument("--responses-ttl", type=float, default=ServerConfig.responses_ttl,
                   help="seconds a stored response is kept (default 30 days)")
    p.add_argument("--idempotency-bytes", type=size, default=ServerConfig.idempotency_bytes,
                   help="bytes of Idempotency-Key results kept per API key, the oldest "
                   "dropped first (K/M/G suffixes; default 64M)")
    p.add_argument("--request-timeout", type=float, default=30.0,
                   help="seconds a client may take to send one whole request (headers and "
                   "body); slower ones are closed (default %(default)s)")
    p.add_argument("--max-header-bytes", type=int, default=MAX_HEADER_BYTES,
                   help="most bytes of a request's line and headers (431 beyond; default "
                   "%(default)s)")
    p.add_argument("--keep-alive", type=float, default=60.0,
                   help="seconds an idle keep-alive connection stays open")
    return p


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    for flag in ("lookup_tokens", "lookup_said_tokens", "implicit_sessions", "implicit_memory",
                 "response_sessions", "ready_logits_memory", "max_sessions_per_key",
                 "max_subscribers", "max_subscribers_per_key", "idempotency_bytes",
                 "max_input_tokens"):
        if (getattr(args, flag) or 0) < 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 0, got "
                             f"{getattr(args, flag)}")
    if args.batch_tokens < 1:
        raise ValueError(f"--batch-tokens must be >= 1, got {args.batch_tokens}")
    if not 0 <= args.batch_wait_ms <= 10_000:
        raise ValueError(f"--batch-wait-ms must be between 0 and 10000, got "
                         f"{args.batch_wait_ms}")
    if not 0 < args.responses_ttl < float("inf"):
        raise ValueError(f"--responses-ttl must be a number of seconds > 0, got "
                         f"{args.responses_ttl}")
    if args.journal is None:
        journal: Path | str | None = default_journal(args.model)
    elif is_url(args.journal):
        journal = args.journal
    elif args.journal.lower() in ("none", ""):
        journal = None
    else:
        journal = Path(args.journal)
    engine = EngineConfig(device=args.device, dtype=args.dtype, threads=args.threads,
                          backend=args.backend, kv_cells=args.kv_cells,
                          max_sequences=args.kv_sequences, kv_layout=args.kv_layout,
                          batch_tokens=args.batch_tokens, batch_wait_ms=args.batch_wait_ms,
                          kv_idle_cells=None if args.kv_idle_cells < 0 else args.kv_idle_cells,
                          tiers=TierConfig(**({} if args.kv_ram is None
                                              else {"ram_bytes": args.kv_ram}),
                                           disk_bytes=args.kv_disk, disk_dir=args.kv_dir),
                          max_context=args.max_session_tokens,
                          context_length=args.context_length,
                          preposition=not args.no_preposition,
                          predecode_tokens=max(0, args.predecode_tokens),
                          predecode_min_hit=args.predecode_min_hit,
                          ready_logits_bytes=args.ready_logits_memory,
                          budget=BudgetConfig(args.max_session_cells, args.max_kv_cells),
                          lookup_tokens=args.lookup_tokens,
                          lookup_said_tokens=args.lookup_said_tokens,
                          relaxed=RelaxedConfig(r_max=args.relaxed_r_max,
                                                start=args.relaxed_start),
                          implicit_memory=args.implicit_memory,
                          implicit_sessions=args.implicit_sessions,
                          response_sessions=args.response_sessions,
                          max_queue=args.max_queue)
    limits = Limits(max_body_bytes=args.max_body_bytes, max_sessions=args.max_sessions,
                    max_sessions_per_key=args.max_sessions_per_key,
                    max_subscribers=args.max_subscribers,
                    max_subscribers_per_key=args.max_subscribers_per_key,
                    max_tokens=args.max_tokens,
                    default_max_tokens=min(args.default_max_tokens, args.max_tokens),
                    max_input_tokens=args.max_input_tokens,
                    strict_max_tokens=args.strict_max_tokens,
                    max_header_bytes=args.max_header_bytes)
    origins = tuple(o.strip() for o in args.allowed_origins.split(",") if o.strip())
    remote = None
    if args.backend in REMOTE_ENGINES:
        if not args.engine_url:
            raise ValueError(f"--backend {args.backend} needs --engine-url (the engine's URL)")
        remote = RemoteEngine(REMOTE_ENGINES[args.backend], tuple(args.engine_url),
                              args.engine_model, args.background_gives_way)
        # the in-process back-end choice does not apply in front of an engine
        engine = remote_config(replace(engine, backend="auto"))
    elif args.engine_url or args.engine_model or args.background_gives_way:
        flag = ("--engine-url" if args.engine_url else "--engine-model" if args.engine_model
                else "--background-gives-way")
        raise ValueError(f"{flag} needs --backend llama-server, vllm or sglang")
    if not args.store_timeout > 0:
        raise ValueError(f"--store-timeout must be > 0, got {args.store_timeout}")
    return ServerConfig(model=args.model, engine=engine, remote=remote, journal=journal,
                        store_timeout=args.store_timeout,
                        api_keys=load_keys(args.api_key, args.api_keys_file),
                        metrics_keys=load_keys(args.metrics_key, env="PREPOS_METRICS_KEYS"),
                        served_model_name=args.served_model_name, limits=limits,
                        allowed_origins=origins, host=args.host,
                        allowed_hosts=tuple(h.strip() for h in args.allowed_hosts.split(",")
                                            if h.strip()),
                        request_timeout=args.request_timeout,
                        responses_bytes=args.responses_bytes, responses_ttl=args.responses_ttl,
                        idempotency_bytes=args.idempotency_bytes,
                        lease=LeaseConfig(args.node_id, args.lease_seconds, args.renew_seconds,
                                          min(1.0, args.lease_seconds / 4)),
                        advertise_url=args.advertise_url)
