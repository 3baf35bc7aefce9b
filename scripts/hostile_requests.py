"""Sends a corpus of hostile structured-output requests to a running
OpenAI-compatible server and prints, for each, the status, the seconds it
took and the start of the error message: every one should end in 200 or
4xx, none in 5xx, and the server should answer a plain request after each.

    outrider up --http-port 8123 2> up.log &
    python scripts/hostile_requests.py --url http://127.0.0.1:8123
    awk '{ print length }' up.log | sort -n | tail -1   # the longest log line

The corpus: huge choice lists, grammars that do not parse or that break the
grammar engine's limits mid-generation, catastrophic and huge regular
expressions, recursive, dangling and deep JSON schemas, a huge enum, many
tools and a missing one, two constraints at once, and constraints beyond
the coordinator's size limits.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import httpx

MESSAGES = [{"role": "user", "content": "Answer with one item."}]


def nested_arrays(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def tools(count: int) -> list[dict[str, Any]]:
    parameters = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    return [
        {"type": "function", "function": {"name": f"f{i}", "parameters": parameters}}
        for i in range(count)
    ]


CORPUS: dict[str, dict[str, Any]] = {
    "1,000 choices": {"guided_choice": [f"c{i}" for i in range(1_000)]},
    "3,000 choices": {"guided_choice": [f"c{i}" for i in range(3_000)]},
    "10,000 choices": {"guided_choice": [f"c{i}" for i in range(10_000)]},
    "100,000 choices": {"guided_choice": [f"c{i}" for i in range(100_000)]},
    "a Lark grammar that does not parse": {"guided_grammar": "start: (("},
    "a grammar with an empty language": {"guided_grammar": "start: start"},
    "2,500 alternatives with one prefix": {
        "guided_grammar": "start: " + " | ".join(f'"a{i}" "b"' for i in range(2_500))
    },
    "an invalid regex": {"guided_regex": "(("},
    "a 50,000-branch regex": {"guided_regex": "|".join(f"w{i}" for i in range(50_000))},
    "(a+)+$": {"guided_regex": "(a+)+$"},
    "a recursive $ref": {
        "guided_json": {
            "type": "object",
            "properties": {"next": {"$ref": "#"}},
            "required": ["next"],
        }
    },
    "a dangling $ref": {"guided_json": {"$ref": "#/definitions/missing"}},
    "a 300-deep array schema": {"guided_json": nested_arrays(300)},
    "a 20,000-value enum": {"guided_json": {"enum": [f"value-{i}" for i in range(20_000)]}},
    "a 600 KB schema": {"guided_json": {"enum": [f"value-{i:06d}" for i in range(40_000)]}},
    "1,000 tools, required": {"tools": tools(1_000), "tool_choice": "required"},
    "2,000 tools": {"tools": tools(2_000)},
    "a missing named tool": {
        "tools": tools(2),
        "tool_choice": {"type": "function", "function": {"name": "nowhere"}},
    },
    "two guides at once": {"guided_regex": "a+", "guided_choice": ["a", "b"]},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8123", help="the server's base URL")
    parser.add_argument("--max-tokens", type=int, default=8)
    args = parser.parse_args()
    print("| request | status | seconds | message |\n|---|---:|---:|---|")
    failures = 0
    with httpx.Client(base_url=args.url, timeout=120) as http:
        for name, constraint in CORPUS.items():
            body = {"messages": MESSAGES, "max_tokens": args.max_tokens, **constraint}
            started = time.perf_counter()
            answer = http.post("/v1/chat/completions", json=body)
            seconds = time.perf_counter() - started
            message = answer.json().get("error", {}).get("message", "") if answer.is_error else ""
            plain = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2})
            failures += answer.status_code >= 500 or plain.status_code != 200
            shown = json.dumps(message[:110])[1:-1].replace("|", "\\|")
            print(f"| {name} | {answer.status_code} | {seconds:.2f} | {shown} |", flush=True)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
