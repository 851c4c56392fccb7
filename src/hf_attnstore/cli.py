"""The `attnstore` command line (also `python -m hf_attnstore`)."""

from __future__ import annotations

import argparse
import logging
import sys


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    results = run_demo(conversations=args.conversations, turns=args.turns, max_new_tokens=args.max_new_tokens,
                       max_user_tokens=args.max_user_tokens)
    return 0 if all(r.identical for r in results) else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="attnstore", description="Multi-turn KV cache reuse for transformers.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="real ShareGPT conversations through SmolLM2: store vs recomputation")
    demo.add_argument("--conversations", type=int, default=3, help="how many multi-turn conversations")
    demo.add_argument("--turns", type=int, default=4, help="user turns per conversation (at most)")
    demo.add_argument("--max-new-tokens", type=int, default=32, help="tokens generated per turn")
    demo.add_argument("--max-user-tokens", type=int, default=128, help="user messages are clipped to this")
    demo.set_defaults(func=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
