"""``vllm-dspark-pp patches``: list the registered vLLM patches."""

from __future__ import annotations

NAME = "patches"
HELP = "List the vLLM patches this plugin applies (--markdown writes docs/patches.md's text)."


def add_arguments(parser) -> None:
    parser.add_argument("--markdown", action="store_true", help="print the docs/patches.md index")


def run(args) -> int:
    from vllm_dspark_pp.patches import markdown_index, registry

    if args.markdown:
        print(markdown_index())
        return 0
    for info in registry():
        print(f"{info.name:40s} {info.target:45s} {info.fields.get('UPSTREAM', '')[:60]}")
    return 0
